"""Rotary position embeddings: the cos/sin tables (with Llama 3.1's frequency scaling, or YaRN's) and
the rotation."""

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
    scaling (transformers' ``_compute_llama3_parameters``, the same operations in the same order);
    one whose ``rope_yarn_factor`` != 1 (DeepSeek-V3's) YaRN's (``yarn_inv_freq``), the tables then
    scaled by YaRN's attention factor, as transformers scales its cos and sin.
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is not None and scaling.rope_scaling_factor != 1.0:
        inv = _llama3_scaled(inv, scaling)
    factor = 1.0
    if scaling is not None and getattr(scaling, "rope_yarn_factor", 1.0) != 1.0:
        inv, factor = yarn_inv_freq(head_dim, theta, scaling, device)
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv)
    tables = torch.stack([freqs.cos(), freqs.sin()], dim=-1)
    return tables * factor if factor != 1.0 else tables


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context ``scale`` times the original (transformers'
    ``yarn_get_mscale``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(
    head_dim: int, theta: float, cfg: ModelConfig, device: torch.device | None
) -> tuple[torch.Tensor, float]:
    """YaRN's frequencies and attention factor (transformers' ``_compute_yarn_parameters``, the same
    operations in the same order): high frequencies kept, low ones divided by the factor, a linear
    ramp between the dims that make ``beta_fast`` and ``beta_slow`` rotations over the original
    context, rounded outwards to whole dims unless ``cfg.rope_yarn_truncate`` is false (transformers'
    ``truncate``: on by default and for DeepSeek-V3, off for GPT-OSS)."""
    factor, orig = cfg.rope_yarn_factor, cfg.rope_yarn_original_max_position
    mscale, mscale_all = cfg.rope_yarn_mscale, cfg.rope_yarn_mscale_all_dim
    if mscale and mscale_all:
        attention = float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all))
    else:
        attention = yarn_mscale(factor)
    dim = head_dim

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(cfg.rope_yarn_beta_fast), correction_dim(cfg.rope_yarn_beta_slow)
    if getattr(cfg, "rope_yarn_truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp.to(device=device, dtype=torch.float)
    return interpolation * (1 - keep) + extrapolation * keep, attention


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
