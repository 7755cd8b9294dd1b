"""Grouped-query attention through SDPA (a chosen backend); under a document mask FlexAttention,
the flash kernel's variable-length form (``model.attention=flash|fa4``), or SDPA's dense mask.

Options a family picks when it builds its block (framework.models.<family>.model): ``qk_norm``, an
RMSNorm over each query and key head before RoPE (Qwen3).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from framework.config.schema import AttentionBackend, ModelConfig
from framework.models.parts.cache import KVCache
from framework.models.parts.masks import DocumentSpans, causal_band
from framework.models.parts.norm import RMSNorm
from framework.models.parts.rope import apply_rope

_SDPA_BACKENDS = {
    AttentionBackend.flash: SDPBackend.FLASH_ATTENTION,
    AttentionBackend.cudnn: SDPBackend.CUDNN_ATTENTION,
    AttentionBackend.efficient: SDPBackend.EFFICIENT_ATTENTION,
    AttentionBackend.math: SDPBackend.MATH,
    # The flash backend, whose kernels framework.kernels.fa4.activate swaps for flash-attn-4's.
    AttentionBackend.fa4: SDPBackend.FLASH_ATTENTION,
}


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, head_dim: int, qk_norm: bool = False) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = head_dim
        self.gqa = cfg.n_heads != cfg.n_kv_heads
        self.backend = _SDPA_BACKENDS.get(cfg.attention)
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        # None where the family has no q/k norm: TorchScript (freeze=script) drops a branch on a None
        # attribute, where a bool flag would make it compile the missing modules' call.
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if qk_norm else None

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as (batch, seq, heads, head_dim), before RoPE (q/k normalised per head when the
        family has qk_norm). -1 for the head count: under tensor parallelism each rank holds only
        its share of heads."""
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: None (causal), a dense boolean mask, or FlexAttention's ``BlockMask``. The
        annotation leaves BlockMask out, and so does the check below when scripting: TorchScript
        (``freeze=script``) would try to compile that class, and a scripted model never has one."""
        b, s, _ = x.shape
        q, k, v = self.heads(x)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        # From the config, not the tensors: tracing would turn a shape comparison into a tensor, and
        # tensor parallelism divides both head counts by the same degree.
        if mask is not None:  # data.document_mask
            out = self._attend_masked(q, k, v, mask)
        elif self.backend is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa)
        else:
            with sdpa_kernel(self.backend):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa)
        out = out.transpose(1, 2).reshape(b, s, -1)
        return self.wo(out)

    def forward_cached(self, x: torch.Tensor, cache: KVCache, layer: int) -> torch.Tensor:
        """``forward`` for ``x`` (batch, new, dim) after the cached positions; writes this layer's
        keys and values into ``cache`` (framework.models.parts.cache: why a separate method)."""
        b, s, _ = x.shape
        start, end = cache.length, cache.length + s
        q, k, v = self.heads(x)
        rope = cache.rope[start:end]
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        cache.keys[layer][:, :, start:end] = k.transpose(1, 2)
        cache.values[layer][:, :, start:end] = v.transpose(1, 2)
        keys, values = cache.keys[layer][:, :, :end], cache.values[layer][:, :, :end]
        # Query i sits at position start + i and sees keys 0..start + i (causal, offset by the cache),
        # the last ``sliding_window`` of them where the family has a window.
        mask = causal_band(s, end, start, cache.windows[layer], x.device)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=self.gqa
        )
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def _attend_masked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Causal within each document: FlexAttention for a BlockMask, the variable-length flash
        kernel for ``DocumentSpans``, SDPA for a dense mask (TorchScript compiles only the dense
        case: it cannot name the other two)."""
        if torch.jit.is_scripting():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.gqa)
        else:
            if isinstance(mask, BlockMask):
                return _flex(q)(q, k, v, block_mask=mask, enable_gqa=self.gqa)
            if isinstance(mask, DocumentSpans):
                return _varlen(q, k, v, mask)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.gqa)


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans: DocumentSpans) -> torch.Tensor:
    """Causal attention within each span of the flattened rows, through aten's flash-attention op in
    its variable-length form (FlashAttention-2's kernel, or flash-attn-4's once framework.kernels.fa4
    has swapped it in: torch's registry replaces that op too). Its autograd formula is aten's own.
    q, k, v: (batch, heads, seq, head_dim) views of (batch, seq, heads, head_dim) tensors, so the
    flattening below copies nothing; GQA needs no expansion (the kernel reads each KV head for its
    group). The longest span is bounded by ``seq``: a constant, so the graph never depends on the
    data (the kernels size their grids from the offsets)."""
    b, h, s, d = q.shape
    flat = [t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (q, k, v)]
    cu = spans.cu_seqlens
    out = torch.ops.aten._flash_attention_forward(*flat, cu, cu, s, s, 0.0, True, False)[0]
    return out.view(b, s, h, d).transpose(1, 2)


_FLEX_COMPILED: list[Callable[..., torch.Tensor]] = []


def _flex(q: torch.Tensor) -> Callable[..., torch.Tensor]:
    """FlexAttention compiled once on CUDA (eager flex materializes the scores: the unfused
    reference), as torchtitan does; under a compiled block Dynamo traces through it."""
    if not q.is_cuda:
        return flex_attention
    if not _FLEX_COMPILED:
        _FLEX_COMPILED.append(torch.compile(flex_attention, dynamic=False))
    return _FLEX_COMPILED[0]
