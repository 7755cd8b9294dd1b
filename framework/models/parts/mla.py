"""Multi-head latent attention (DeepSeek-V2/V3; transformers' ``DeepseekV3Attention``): the query through
a low-rank projection and its RMSNorm (or one full projection), the keys and values through one
compressed latent (``kv_lora_rank``, normed) that ``wkv_b`` expands per head, and a decoupled RoPE part:
``qk_rope_head_dim`` features of each query head and one RoPE key shared by every head.

The decode cache holds the normed latent and the rotated RoPE key per position (``cache_shapes``), not
the expanded keys and values: ``kv_lora_rank + qk_rope_head_dim`` values a position and layer instead of
``heads x (qk_head_dim + v_head_dim)``. The RoPE features are in interleaved pairs, as the published
checkpoints store them (transformers' ``rope_interleave: true``), so no row is permuted on the way.

Tensor parallelism leaves this sublayer whole on every TP rank (its weights are ``TPStyle.replicated``:
framework.parallel.tensor.block_plan): the heads are not split yet.

The kernel: SDPA. Its flash kernels take equal q, k and v widths only, and MLA's differ (192 and 128
in the published models), so under ``model.attention=auto`` torch picks the memory-efficient kernel
on CUDA (which takes a narrower v; not the math fallback). ``model.attention=flash|fa4`` pads v with
zero columns to the q/k width and slices the output back (``padded_v_attention``): exact, as a zero
column of v gives a zero column of the output and its gradient is dropped, for 1.2x the FLOPs at
(192, 128). ``cudnn``, ``efficient`` and ``math`` pick that SDPA backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from framework.config.schema import AttentionBackend
from framework.models.parts.cache import KVCache
from framework.models.parts.masks import causal_band
from framework.models.parts.norm import RMSNorm
from framework.models.parts.rope import apply_rope, yarn_mscale


class LatentAttention(nn.Module):
    """``forward(x, rope, mask=None)`` as ``framework.models.parts.attention.Attention``'s; ``rope``: the
    tables of the RoPE part (``qk_rope_head_dim`` wide)."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        q_lora_rank: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        norm_eps: float,
        softmax_scale: float,
        backend: AttentionBackend = AttentionBackend.auto,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.n_heads, self.kv_lora_rank = n_heads, kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        qk = qk_nope_head_dim + qk_rope_head_dim
        self.scale = softmax_scale
        # None where the family has no low-rank query (V2-Lite): TorchScript drops a branch on None.
        self.wq = nn.Linear(dim, n_heads * qk, bias=False) if not q_lora_rank else None
        self.wq_a = nn.Linear(dim, q_lora_rank, bias=False) if q_lora_rank else None
        self.q_norm = RMSNorm(q_lora_rank, norm_eps) if q_lora_rank else None
        self.wq_b = nn.Linear(q_lora_rank, n_heads * qk, bias=False) if q_lora_rank else None
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(kv_lora_rank, norm_eps)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)

    def _query(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q without RoPE, q's RoPE part), each (batch, seq, heads, width)."""
        b, s, _ = x.shape
        if self.wq_a is not None and self.q_norm is not None and self.wq_b is not None:
            q = self.wq_b(self.q_norm(self.wq_a(x)))
        else:
            assert self.wq is not None
            q = self.wq(x)
        q = q.view(b, s, -1, self.nope + self.rope_dim)
        return q[..., : self.nope], q[..., self.nope :]

    def _latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the normed latent (batch, seq, kv_lora_rank), the RoPE key before rotation (batch, seq, 1, rope))."""
        kv = self.wkv_a(x)
        latent, k_rope = kv[..., : self.kv_lora_rank], kv[..., self.kv_lora_rank :]
        return self.kv_norm(latent), k_rope.unsqueeze(2)

    def _attend(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        mask: object,
        causal: bool,
    ) -> torch.Tensor:
        """Attention over the expanded latent; q_* (batch, q, heads, .), latent (batch, kv, rank), k_rope
        (batch, kv, 1, rope) rotated. Returns (batch, q, heads * v_head_dim)."""
        b, t, _ = latent.shape
        kv = self.wkv_b(latent).view(b, t, -1, self.nope + self.v_dim)
        k_nope, v = kv[..., : self.nope], kv[..., self.nope :]
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        if isinstance(mask, BlockMask):
            out = flex_attention(q, k, v, block_mask=mask, scale=self.scale)
        elif mask is not None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        elif self.backend in (AttentionBackend.flash, AttentionBackend.fa4):
            out = padded_v_attention(q, k, v, causal, self.scale)
        elif self.backend is not AttentionBackend.auto:
            with sdpa_kernel(_SDPA_BACKENDS[self.backend]):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=self.scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=self.scale)
        return out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: None (causal), a dense boolean mask, or FlexAttention's ``BlockMask`` (document
        masking; the flash kernels' variable-length spans are not taken: qk and v widths differ)."""
        q_nope, q_rope = self._query(x)
        latent, k_rope = self._latent(x)
        q_rope, k_rope = apply_rope(q_rope, rope), apply_rope(k_rope, rope)
        return self.wo(self._attend(q_nope, q_rope, latent, k_rope, mask, causal=True))

    def cache_shapes(self, batch: int, capacity: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """What ``KVCache`` keeps for this layer: the latent and the rotated RoPE key per position."""
        return (batch, capacity, self.kv_lora_rank), (batch, capacity, 1, self.rope_dim)

    def forward_cached(self, x: torch.Tensor, cache: KVCache, layer: int) -> torch.Tensor:
        """``forward`` for ``x`` (batch, new, dim) after the cached positions, keeping the compressed
        latent in ``cache`` (its keys) and the rotated RoPE key (its values)."""
        s = x.shape[1]
        start, end = cache.length, cache.length + s
        rope = cache.rope[start:end]
        q_nope, q_rope = self._query(x)
        latent, k_rope = self._latent(x)
        cache.keys[layer][:, start:end] = latent
        cache.values[layer][:, start:end] = apply_rope(k_rope, rope)
        mask = causal_band(s, end, start, cache.windows[layer], x.device)
        out = self._attend(
            q_nope,
            apply_rope(q_rope, rope),
            cache.keys[layer][:, :end],
            cache.values[layer][:, :end],
            mask,
            False,
        )
        return self.wo(out)


_SDPA_BACKENDS = {
    AttentionBackend.cudnn: SDPBackend.CUDNN_ATTENTION,
    AttentionBackend.efficient: SDPBackend.EFFICIENT_ATTENTION,
    AttentionBackend.math: SDPBackend.MATH,
}


def padded_v_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> torch.Tensor:
    """SDPA's flash kernel on q, k (batch, heads, seq, qk) and v (batch, heads, seq, v_dim), v_dim <=
    qk: v padded with zero columns to qk (the kernel's equal widths), the output's first v_dim kept."""
    width = v.shape[-1]
    v = F.pad(v, (0, q.shape[-1] - width))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    return out[..., :width]


def softmax_scale(qk_head_dim: int, yarn_factor: float, mscale_all_dim: float) -> float:
    """``qk_head_dim ** -0.5``, times YaRN's ``mscale ** 2`` where ``mscale_all_dim`` is set (DeepSeek's
    reference, transformers' ``yarn_apply_mscale``): the non-rotary features share the temperature."""
    scale = qk_head_dim ** (-0.5)
    if yarn_factor != 1.0 and mscale_all_dim:
        m = yarn_mscale(yarn_factor, mscale_all_dim)
        scale = scale * m * m
    return scale
