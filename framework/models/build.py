"""A family's decoder from a config, and what the planner reads off its shape: parameter count and
training flops per token."""

from __future__ import annotations

import torch

from framework.config.schema import ModelConfig
from framework.models.parts.decoder import Decoder
from framework.models.registry import family, model_spec


def decoder(cfg: ModelConfig, max_seq_len: int, document_eos: int | None = None) -> Decoder:
    """``cfg``'s family's decoder on the current device (its spec, its block, the shared trunk)."""
    return Decoder(cfg, model_spec(cfg), family(cfg).block, max_seq_len, document_eos)


def build_model(cfg: ModelConfig, max_seq_len: int, document_eos: int | None = None) -> Decoder:
    """Build on the meta device: no memory is taken until ``to_empty`` + ``init_weights``."""
    with torch.device("meta"):
        return decoder(cfg, max_seq_len, document_eos)


def num_params(cfg: ModelConfig, include_embedding: bool = True) -> int:
    """Parameter count from the shape alone (its spec; tied embeddings counted once)."""
    n = model_spec(cfg).numel[0]
    return n if include_embedding else n - cfg.vocab_size * cfg.dim


def active_params(cfg: ModelConfig, include_embedding: bool = True) -> int:
    """Parameters one token's forward multiplies by: ``num_params`` for a dense model; for a sparse
    one each routed expert stack counts top-k of its E experts (``model.moe.num_experts_per_tok``)."""
    total, expert, experts = model_spec(cfg).numel
    n = total - expert + (expert * cfg.moe.num_experts_per_tok // experts if experts else 0)
    return n if include_embedding else n - cfg.vocab_size * cfg.dim


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training flops per token: 6N + 12·L·H·Q·T (PaLM appendix B; N excludes the input embedding).

    6N covers the matmuls of forward (2N) and backward (4N); 12·L·H·Q·T is attention's score and
    value products (L layers, H heads, Q head dim, T sequence length), which N does not see. On a
    sparse model N is the active parameters (top-k of each layer's experts: ``active_params``), as
    MoE MFU is reported (DeepSeek-V3, Qwen3-MoE, torchtitan).
    """
    n = active_params(cfg, include_embedding=False)
    if cfg.tie_embeddings:
        # The tied output projection is a matmul of vocab x dim even though its weight is shared.
        n += cfg.vocab_size * cfg.dim
    return 6.0 * n + 12.0 * model_spec(cfg).score_width(cfg.n_heads) * seq_len
