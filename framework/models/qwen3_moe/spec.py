"""The Qwen3-MoE layout: Qwen3's attention weights, the router and the stacked experts; ``moe xN``."""

from __future__ import annotations

from framework.config.schema import ModelConfig
from framework.models.parts.layout import attention, decoder_spec, head_dim, qk_norms, repeated
from framework.models.parts.sparse import moe_kind, moe_weights
from framework.models.qwen3_moe.hf import HF_ARCHITECTURE, HF_EXPERT_PARTS, HF_PREFIX
from framework.models.spec import ModelSpec, TPStyle, Weight


def qwen3_moe_spec(m: ModelConfig) -> ModelSpec:
    hd = head_dim(m)
    block = (
        Weight("attention_norm", "input_layernorm.weight", (m.dim,), TPStyle.sequence),
        *attention(m, hd),
        *qk_norms(hd),
        Weight("ffn_norm", "post_attention_layernorm.weight", (m.dim,), TPStyle.sequence),
        *moe_weights(m, HF_PREFIX, HF_EXPERT_PARTS),
    )
    return decoder_spec(m, "qwen3_moe", repeated(moe_kind(m, block, hd), m), hd, HF_ARCHITECTURE)
