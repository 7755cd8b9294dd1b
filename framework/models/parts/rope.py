"""Rotary position embeddings: the cos/sin tables (with Llama 3.1's frequency scaling) and the rotation."""

from __future__ import annotations

import math

import torch

from framework.config.schema import ModelConfig


def rope_tables(
    head_dim: int,
    seq_len: int,
    theta: float,
    device: torch.device | None = None,
    scaling: ModelConfig | None = None,
) -> torch.Tensor:
    """cos/sin tables, shape (seq_len, head_dim // 2, 2); real-valued so export and compile keep them.

    ``scaling``: a model config whose ``rope_scaling_factor`` != 1 applies Llama 3.1's frequency
    scaling (transformers' ``_compute_llama3_parameters``, the same operations in the same order).
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is not None and scaling.rope_scaling_factor != 1.0:
        inv = _llama3_scaled(inv, scaling)
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv)
    return torch.stack([freqs.cos(), freqs.sin()], dim=-1)


def _llama3_scaled(inv: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_len = cfg.rope_original_max_position
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]); x is (batch, seq, heads, head_dim). ``tables`` is (seq, ...)
    for positions 0..seq-1, or (batch, seq, ...) for each token's own position (document masking)."""
    b, s, h, d = x.shape
    xf = x.float().reshape(b, s, h, d // 2, 2)
    if tables.dim() == 4:  # per-token positions: (batch, seq, head_dim // 2, 2)
        cos, sin = tables[:, :s, None, :, 0], tables[:, :s, None, :, 1]
    else:
        cos = tables[:s, None, :, 0]
        sin = tables[:s, None, :, 1]
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.reshape(b, s, h, d).type_as(x)
