"""The Llama layout (torchtitan's module names; Hugging Face ``LlamaForCausalLM``'s names)."""

from __future__ import annotations

from framework.config.schema import ModelConfig
from framework.models.spec import ModelSpec, TPStyle, Weight


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


def feed_forward(m: ModelConfig) -> tuple[Weight, ...]:
    """SwiGLU: w2(silu(w1 x) * w3 x); w1/w3 column-parallel, w2 row-parallel."""
    return (
        Weight("feed_forward.w1", "mlp.gate_proj.weight", (m.ffn_dim, m.dim), TPStyle.colwise),
        Weight("feed_forward.w2", "mlp.down_proj.weight", (m.dim, m.ffn_dim), TPStyle.rowwise),
        Weight("feed_forward.w3", "mlp.up_proj.weight", (m.ffn_dim, m.dim), TPStyle.colwise),
    )


def decoder_spec(m: ModelConfig, family: str, block: tuple[Weight, ...], hd: int, arch: str) -> ModelSpec:
    """The root weights every family here shares around its ``block``: embedding, final norm, head.
    ``family`` is also the HF ``model_type``."""
    last = (
        Weight("norm", "model.norm.weight", (m.dim,), TPStyle.sequence),
        Weight("output", "lm_head.weight", (m.vocab_size, m.dim), TPStyle.output, tied=m.tie_embeddings),
    )
    return ModelSpec(
        family=family,
        hf_architecture=arch,
        hf_model_type=family,
        n_layers=m.n_layers,
        head_dim=hd,
        first=(
            Weight("tok_embeddings", "model.embed_tokens.weight", (m.vocab_size, m.dim), TPStyle.embedding),
        ),
        block=block,
        last=last,
        # attention(x, rope): the RoPE table is a plain tensor every rank holds whole.
        sublayers={"attention": 2, "feed_forward": 1},
    )


def llama_block(m: ModelConfig, hd: int) -> tuple[Weight, ...]:
    """Pre-norm attention and SwiGLU: the block of Llama and of the families built on it."""
    return (
        Weight("attention_norm", "input_layernorm.weight", (m.dim,), TPStyle.sequence),
        *attention(m, hd),
        Weight("ffn_norm", "post_attention_layernorm.weight", (m.dim,), TPStyle.sequence),
        *feed_forward(m),
    )


def llama_spec(m: ModelConfig) -> ModelSpec:
    hd = head_dim(m)
    return decoder_spec(m, "llama", llama_block(m, hd), hd, "LlamaForCausalLM")
