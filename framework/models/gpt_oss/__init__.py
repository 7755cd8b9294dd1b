"""GPT-OSS (Hugging Face ``GptOssForCausalLM``): grouped-query attention with biases and a learned sink
per head (``attention.py``), layers alternating a sliding window and full attention
(``model.layer_pattern``: ``[sliding, full] x12``), every MLP an MoE layer whose router and experts
have biases, with the clamped SwiGLU (``experts.py``), YaRN without truncation. The record the
registry lists."""

from __future__ import annotations

from framework.config.schema import GptOssConfig, MoEConfig
from framework.models.family import Family
from framework.models.gpt_oss.hf import (
    HF_ARCHITECTURE,
    HF_FIELDS,
    HF_FIXED,
    HF_MOE_FIELDS,
    MOE_KEYS,
    hf_read,
    hf_write,
)
from framework.models.gpt_oss.model import gpt_oss_block
from framework.models.gpt_oss.spec import gpt_oss_spec

GPT_OSS = Family(
    "gpt_oss",
    gpt_oss_spec,
    gpt_oss_block,
    HF_ARCHITECTURE,
    HF_FIELDS,
    config=GptOssConfig,
    moe_keys=MOE_KEYS,
    hf_moe_fields=HF_MOE_FIELDS,
    hf_fixed=HF_FIXED,
    hf_read=hf_read,
    hf_write=hf_write,
    tiny=dict(
        dim=64, n_layers=2, layer_pattern="[sliding, full] x1", sliding_window=8, n_heads=4, n_kv_heads=2,
        head_dim=16, ffn_dim=96, moe=MoEConfig(num_experts=4, num_experts_per_tok=2),
    ),
)
