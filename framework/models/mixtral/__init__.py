"""Mixtral (Hugging Face ``MixtralForCausalLM``): Mistral's attention (grouped-query, an optional
sliding window) with every MLP a Mixture-of-Experts layer (``framework.models.moe``: softmax top-k
router, the top-k weights always renormalised, stacked SwiGLU experts ``model.ffn_dim`` wide). The
record the registry lists."""

from __future__ import annotations

from framework.config.schema import MixtralConfig, MoEConfig
from framework.models.family import Family
from framework.models.mixtral.hf import HF_ARCHITECTURE, HF_FIELDS, HF_FIXED, HF_MOE_FIELDS, MOE_KEYS
from framework.models.mixtral.model import mixtral_block
from framework.models.mixtral.spec import mixtral_spec

MIXTRAL = Family(
    "mixtral",
    mixtral_spec,
    mixtral_block,
    HF_ARCHITECTURE,
    HF_FIELDS,
    config=MixtralConfig,
    moe_keys=MOE_KEYS,
    hf_moe_fields=HF_MOE_FIELDS,
    hf_fixed=HF_FIXED,
    tiny=dict(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=96,
        sliding_window=8,
        moe=MoEConfig(num_experts=4),
    ),
)
