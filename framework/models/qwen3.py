"""The Qwen3 dense layout (Hugging Face ``Qwen3ForCausalLM``): Llama's, plus an RMSNorm over each
query and key head (``q_norm``/``k_norm``, before RoPE) and a head size set apart from the width."""

from __future__ import annotations

import dataclasses

from framework.config.schema import ModelConfig
from framework.models.llama import attention, decoder_spec, feed_forward, head_dim
from framework.models.spec import ModelSpec, TPStyle, Weight


def qwen3_spec(m: ModelConfig) -> ModelSpec:
    hd = head_dim(m)
    block = (
        Weight("attention_norm", "input_layernorm.weight", (m.dim,), TPStyle.sequence),
        *attention(m, hd),
        # One weight shared by every head, over head_dim: its entries follow the RoPE pair order.
        Weight("attention.q_norm", "self_attn.q_norm.weight", (hd,), TPStyle.heads, 1),
        Weight("attention.k_norm", "self_attn.k_norm.weight", (hd,), TPStyle.heads, 1),
        Weight("ffn_norm", "post_attention_layernorm.weight", (m.dim,), TPStyle.sequence),
        *feed_forward(m),
    )
    return dataclasses.replace(decoder_spec(m, "qwen3", block, hd, "Qwen3ForCausalLM"), qk_norm=True)
