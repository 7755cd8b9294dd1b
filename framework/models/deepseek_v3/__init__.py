"""DeepSeek-V3 (Hugging Face ``DeepseekV3ForCausalLM``): multi-head latent attention with YaRN, a stack
of dense layers then MoE ones (``model.layer_pattern``: ``dense x3, moe x58``), the MoE layers with
shared experts, sigmoid routing limited to the best expert groups, the aux-loss-free selection bias
and a routed scaling factor (framework.models.moe). Kimi K2 and Moonlight share the architecture.
The record the registry lists."""

from __future__ import annotations

from framework.config.schema import DeepseekV3Config, MoEConfig
from framework.models.deepseek_v3.hf import (
    HF_ARCHITECTURE,
    HF_FIELDS,
    HF_FIXED,
    HF_MOE_FIELDS,
    HF_MOE_VALUES,
    MOE_KEYS,
    hf_read,
    hf_write,
)
from framework.models.deepseek_v3.model import deepseek_v3_block
from framework.models.deepseek_v3.spec import deepseek_v3_spec
from framework.models.family import Family

DEEPSEEK_V3 = Family(
    "deepseek_v3",
    deepseek_v3_spec,
    deepseek_v3_block,
    HF_ARCHITECTURE,
    HF_FIELDS,
    config=DeepseekV3Config,
    moe_keys=MOE_KEYS,
    hf_moe_fields=HF_MOE_FIELDS,
    hf_fixed=HF_FIXED,
    hf_moe_values=HF_MOE_VALUES,
    hf_read=hf_read,
    hf_write=hf_write,
    tiny=dict(
        dim=64, n_layers=2, layer_pattern="dense x1, moe x1", n_heads=4, n_kv_heads=4, ffn_dim=96,
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        moe=MoEConfig(num_experts=4, num_experts_per_tok=2, num_shared_experts=1),
    ),
)
