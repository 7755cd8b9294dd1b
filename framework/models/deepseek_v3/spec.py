"""The DeepSeek-V3 layout: multi-head latent attention's weights, then a dense SwiGLU (kind ``dense``)
or the router, its selection bias, the stacked experts and the shared experts (kind ``moe``), in the
stack ``model.layer_pattern`` writes (``dense x3, moe x58``)."""

from __future__ import annotations

import dataclasses

from framework.config.schema import DeepseekV3Config
from framework.models.deepseek_v3.hf import HF_ARCHITECTURE, HF_EXPERT_PARTS, HF_PREFIX
from framework.models.parts.layout import decoder_spec, feed_forward
from framework.models.parts.sparse import moe_weights, sparse_saved_values
from framework.models.spec import AttentionKind, LayerKind, MLPKind, ModelSpec, TPStyle, Weight, layer_pattern

R = TPStyle.replicated
# What each multi-token prediction layer of the Hub files also stores: the embedding and the output
# head, shared with the trunk (equal tensors), by their name there -> ours.
MTP_SHARED = {"embed_tokens.weight": "tok_embeddings.weight", "shared_head.head.weight": "output.weight"}


def mla_weights(m: DeepseekV3Config) -> tuple[Weight, ...]:
    """Multi-head latent attention (framework.models.parts.mla): whole on every TP rank."""
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    h = m.n_heads
    if m.q_lora_rank:
        q = (
            Weight("attention.wq_a", "self_attn.q_a_proj.weight", (m.q_lora_rank, m.dim), R),
            Weight("attention.q_norm", "self_attn.q_a_layernorm.weight", (m.q_lora_rank,), R),
            Weight("attention.wq_b", "self_attn.q_b_proj.weight", (h * qk, m.q_lora_rank), R),
        )
    else:
        q = (Weight("attention.wq", "self_attn.q_proj.weight", (h * qk, m.dim), R),)
    return (
        *q,
        Weight(
            "attention.wkv_a",
            "self_attn.kv_a_proj_with_mqa.weight",
            (m.kv_lora_rank + m.qk_rope_head_dim, m.dim),
            R,
        ),
        Weight("attention.kv_norm", "self_attn.kv_a_layernorm.weight", (m.kv_lora_rank,), R),
        Weight(
            "attention.wkv_b",
            "self_attn.kv_b_proj.weight",
            (h * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
            R,
        ),
        Weight("attention.wo", "self_attn.o_proj.weight", (m.dim, h * m.v_head_dim), R),
    )


def mla_saved_values(m: DeepseekV3Config) -> int:
    """Values one block's attention and norms save per token (the planner's term, an estimate from the
    code): the residual and norms (10 x dim, as the dense block's), the query's low-rank output and its
    norm, the latent and RoPE key before and after their norm and rotation, q, k and v expanded per
    head, the attention output."""
    qk, h = m.qk_nope_head_dim + m.qk_rope_head_dim, m.n_heads
    return (
        10 * m.dim
        + 2 * m.q_lora_rank
        + 2 * (m.kv_lora_rank + m.qk_rope_head_dim)
        + h * (2 * qk + 2 * m.v_head_dim)
    )


def deepseek_v3_spec(m: DeepseekV3Config) -> ModelSpec:
    norms = (
        Weight("attention_norm", "input_layernorm.weight", (m.dim,), TPStyle.sequence),
        *mla_weights(m),
        Weight("ffn_norm", "post_attention_layernorm.weight", (m.dim,), TPStyle.sequence),
    )
    bias = Weight(
        "feed_forward.gate",
        f"{HF_PREFIX}.gate.e_score_correction_bias",
        (m.moe.num_experts,),
        TPStyle.moe,
        param="expert_bias",
        buffer=True,
    )
    attention = mla_saved_values(m)
    score = m.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) // 2
    mla = {"attention": AttentionKind.mla, "score_width": score}
    dense = LayerKind("dense", (*norms, *feed_forward(m)), attention + 4 * m.ffn_dim, **mla)
    sparse = LayerKind(
        "moe",
        (*norms, *moe_weights(m, HF_PREFIX, HF_EXPERT_PARTS), bias),
        # the MoE part of the sparse block's count (its attention part is GQA's: replaced by MLA's)
        attention + sparse_saved_values(m, 0) - 10 * m.dim,
        mlp=MLPKind.moe_shared if m.moe.num_shared_experts else MLPKind.moe,
        **mla,
    )
    layers = layer_pattern(m.layer_pattern, {"dense": dense, "moe": sparse}, "model.layer_pattern")
    if len(layers) != m.n_layers:
        raise ValueError(
            f"model.layer_pattern={m.layer_pattern!r} gives {len(layers)} layers but model.n_layers={m.n_layers}; "
            f"valid: a pattern of {m.n_layers} layers (e.g. 'dense x1, moe x{m.n_layers - 1}')"
        )
    spec = decoder_spec(m, "deepseek_v3", layers, m.qk_rope_head_dim, HF_ARCHITECTURE)
    return dataclasses.replace(spec, mtp=(mtp_kind(m, sparse),) * m.mtp_layers, mtp_shared=MTP_SHARED)


def mtp_kind(m: DeepseekV3Config, block: LayerKind) -> LayerKind:
    """The multi-token prediction layer (framework.models.parts.mtp): the norms of the trunk's hidden
    state and of the next token's embedding, their projection back to ``dim``, an MoE block as the
    trunk's (``block``) and the shared head's own norm, under the Hub files' names (its block's flat,
    as a trunk layer's; ``embed_tokens`` and ``shared_head.head``, copies of the shared tensors, are
    the importer's and exporter's: ``MTP_SHARED``)."""
    own = (
        Weight("enorm", "enorm.weight", (m.dim,), R),
        Weight("hnorm", "hnorm.weight", (m.dim,), R),
        Weight("eh_proj", "eh_proj.weight", (m.dim, 2 * m.dim), R),
        Weight("norm", "shared_head.norm.weight", (m.dim,), R),
    )
    inner = tuple(dataclasses.replace(w, module=f"block.{w.module}") for w in block.weights)
    # the block's values, the two normed inputs, their concatenation and the projection's output
    return dataclasses.replace(block, name="mtp", weights=(*own, *inner), saved_values=block.saved_values + 5 * m.dim)
