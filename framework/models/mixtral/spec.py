"""The Mixtral layout: Llama's attention weights, the router and the stacked experts, with the
attention window; ``moe xN``."""

from __future__ import annotations

from framework.config.schema import MixtralConfig
from framework.models.mixtral.hf import HF_ARCHITECTURE, HF_EXPERT_PARTS, HF_PREFIX
from framework.models.parts.layout import attention, decoder_spec, head_dim, repeated
from framework.models.parts.sparse import moe_kind, moe_weights
from framework.models.spec import ModelSpec, TPStyle, Weight


def mixtral_spec(m: MixtralConfig) -> ModelSpec:
    hd = head_dim(m)
    block = (
        Weight("attention_norm", "input_layernorm.weight", (m.dim,), TPStyle.sequence),
        *attention(m, hd),
        Weight("ffn_norm", "post_attention_layernorm.weight", (m.dim,), TPStyle.sequence),
        *moe_weights(m, HF_PREFIX, HF_EXPERT_PARTS),
    )
    kind = moe_kind(m, block, hd, window=m.sliding_window)
    return decoder_spec(m, "mixtral", repeated(kind, m), hd, HF_ARCHITECTURE)
