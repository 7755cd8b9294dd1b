"""The shared pieces as spec entries (``framework.models.spec.Weight``): the dense block's weights
and the root weights around it, and what one dense block saves for backward (the planner's term).

A family's ``spec.py`` lays its block out from these; the names are torchtitan's and Hugging Face's.
"""

from __future__ import annotations

from framework.config.schema import ModelConfig
from framework.models.spec import LayerKind, ModelSpec, TPStyle, Weight, layer_pattern


def head_dim(m: ModelConfig) -> int:
    return m.head_dim or m.dim // m.n_heads


def attention(m: ModelConfig, hd: int) -> tuple[Weight, ...]:
    """wq/wk/wv column-parallel and wo row-parallel, so attention runs on each rank's own heads."""
    q, kv = m.n_heads * hd, m.n_kv_heads * hd
    return (
        Weight("attention.wq", "self_attn.q_proj.weight", (q, m.dim), TPStyle.colwise, m.n_heads),
        Weight("attention.wk", "self_attn.k_proj.weight", (kv, m.dim), TPStyle.colwise, m.n_kv_heads),
        Weight("attention.wv", "self_attn.v_proj.weight", (kv, m.dim), TPStyle.colwise),
        Weight("attention.wo", "self_attn.o_proj.weight", (m.dim, q), TPStyle.rowwise),
    )


def qk_norms(hd: int) -> tuple[Weight, ...]:
    """Qwen3's RMSNorm over each query and key head: one weight shared by every head, over head_dim
    (its entries follow the RoPE pair order)."""
    return (
        Weight("attention.q_norm", "self_attn.q_norm.weight", (hd,), TPStyle.heads, 1),
        Weight("attention.k_norm", "self_attn.k_norm.weight", (hd,), TPStyle.heads, 1),
    )


def feed_forward(m: ModelConfig) -> tuple[Weight, ...]:
    """SwiGLU: w2(silu(w1 x) * w3 x); w1/w3 column-parallel, w2 row-parallel."""
    return (
        Weight("feed_forward.w1", "mlp.gate_proj.weight", (m.ffn_dim, m.dim), TPStyle.colwise),
        Weight("feed_forward.w2", "mlp.down_proj.weight", (m.dim, m.ffn_dim), TPStyle.rowwise),
        Weight("feed_forward.w3", "mlp.up_proj.weight", (m.ffn_dim, m.dim), TPStyle.colwise),
    )


def dense_block(m: ModelConfig, hd: int, qk_norm: bool = False) -> tuple[Weight, ...]:
    """Pre-norm attention and SwiGLU (``framework.models.parts.decoder.dense_block``'s weights)."""
    return (
        Weight("attention_norm", "input_layernorm.weight", (m.dim,), TPStyle.sequence),
        *attention(m, hd),
        *(qk_norms(hd) if qk_norm else ()),
        Weight("ffn_norm", "post_attention_layernorm.weight", (m.dim,), TPStyle.sequence),
        *feed_forward(m),
    )


def repeated(kind: LayerKind, m: ModelConfig) -> tuple[LayerKind, ...]:
    """A stack of one kind: ``KIND xN`` for the model's N layers (every family before DeepSeek-V3)."""
    return layer_pattern(f"{kind.name} x{m.n_layers}", {kind.name: kind})


def dense_kind(m: ModelConfig, hd: int, qk_norm: bool = False, window: int = 0) -> LayerKind:
    """The dense block as a layer kind: its weights, what it saves, its attention window."""
    return LayerKind("dense", dense_block(m, hd, qk_norm), dense_saved_values(m, hd), window=window)


def decoder_spec(
    m: ModelConfig,
    family: str,
    layers: tuple[LayerKind, ...],
    hd: int,
    arch: str,
    sublayers: dict[str, int] | None = None,
) -> ModelSpec:
    """The root weights every family here shares around its ``layers`` (one kind per layer):
    embedding, final norm, head. ``family`` is also the HF ``model_type``."""
    last = (
        Weight("norm", "model.norm.weight", (m.dim,), TPStyle.sequence),
        Weight("output", "lm_head.weight", (m.vocab_size, m.dim), TPStyle.output, tied=m.tie_embeddings),
    )
    return ModelSpec(
        family=family,
        hf_architecture=arch,
        hf_model_type=family,
        head_dim=hd,
        first=(
            Weight("tok_embeddings", "model.embed_tokens.weight", (m.vocab_size, m.dim), TPStyle.embedding),
        ),
        layers=layers,
        last=last,
        # attention(x, rope): the RoPE table is a plain tensor every rank holds whole.
        sublayers=sublayers or {"attention": 2, "feed_forward": 1},
    )


def dense_saved_values(m: ModelConfig, hd: int) -> int:
    """Values one dense block saves for backward, per token (the planner's activation term, scaled
    there by a measured factor per executor): on the order of 10*dim + 3*kv_dim + 4*ffn_dim (norm
    inputs and outputs, q/k/v before and after RoPE, attention output, residual, w1/w3 outputs,
    SiLU and the product feeding w2); SDPA keeps no seq x seq matrix."""
    kv_dim = m.n_kv_heads * hd
    return 10 * m.dim + 3 * kv_dim + 4 * m.ffn_dim


def op_saved_values(m: ModelConfig, hd: int) -> int:
    """Values one dense block keeps per token under ``selective_op`` (framework.parallel.activation's
    per-op policy): its input (the checkpoint's), and the outputs of wq (q_dim), wv (kv_dim),
    attention (q_dim), w1 (ffn_dim) and w2 (dim): the odd matmuls of wq, wk, wv, wo, w1, w3, w2, in
    the order the block runs them. Attention's log-sum-exp (one fp32 value per head) is left out."""
    q, kv = m.n_heads * hd, m.n_kv_heads * hd
    return 2 * m.dim + 2 * q + kv + m.ffn_dim
