"""The Mixtral layout: Llama's attention weights, the router and the stacked experts; the spec carries
the attention window."""

from __future__ import annotations

import dataclasses

from framework.config.schema import ModelConfig
from framework.models.mixtral.hf import HF_ARCHITECTURE, HF_EXPERT_PARTS, HF_PREFIX
from framework.models.parts.layout import attention, decoder_spec, head_dim
from framework.models.parts.sparse import moe_weights, sparse_saved_values
from framework.models.spec import ModelSpec, TPStyle, Weight


def mixtral_spec(m: ModelConfig) -> ModelSpec:
    hd = head_dim(m)
    block = (
        Weight("attention_norm", "input_layernorm.weight", (m.dim,), TPStyle.sequence),
        *attention(m, hd),
        Weight("ffn_norm", "post_attention_layernorm.weight", (m.dim,), TPStyle.sequence),
        *moe_weights(m, HF_PREFIX, HF_EXPERT_PARTS),
    )
    spec = decoder_spec(m, "mixtral", block, hd, HF_ARCHITECTURE)
    return dataclasses.replace(spec, sliding_window=m.sliding_window)


def activation_values(m: ModelConfig) -> int:
    return sparse_saved_values(m, head_dim(m))
