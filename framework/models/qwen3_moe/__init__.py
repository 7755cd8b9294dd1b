"""Qwen3-MoE (Hugging Face ``Qwen3MoeForCausalLM``): Qwen3's attention (an RMSNorm over each query and
key head) with every MLP a Mixture-of-Experts layer (``framework.models.moe``: softmax top-k router,
``norm_topk_prob`` as configured, stacked SwiGLU experts). The record the registry lists."""

from __future__ import annotations

from framework.config.schema import MoEConfig, Qwen3MoeConfig
from framework.models.family import Family
from framework.models.qwen3_moe.hf import HF_ARCHITECTURE, HF_FIELDS, HF_FIXED, HF_MOE_FIELDS, MOE_KEYS
from framework.models.qwen3_moe.model import qwen3_moe_block
from framework.models.qwen3_moe.spec import qwen3_moe_spec

QWEN3_MOE = Family(
    "qwen3_moe",
    qwen3_moe_spec,
    qwen3_moe_block,
    HF_ARCHITECTURE,
    HF_FIELDS,
    config=Qwen3MoeConfig,
    moe_keys=MOE_KEYS,
    hf_moe_fields=HF_MOE_FIELDS,
    hf_fixed=HF_FIXED,
    tiny=dict(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=96, moe=MoEConfig(num_experts=4)
    ),
)
