"""The Qwen3-MoE layout: Qwen3's attention weights, the router and the stacked experts."""

from __future__ import annotations

from framework.config.schema import ModelConfig
from framework.models.parts.layout import attention, decoder_spec, head_dim, qk_norms
from framework.models.parts.sparse import moe_weights, sparse_saved_values
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
    return decoder_spec(m, "qwen3_moe", block, hd, HF_ARCHITECTURE)


def activation_values(m: ModelConfig) -> int:
    return sparse_saved_values(m, head_dim(m))
