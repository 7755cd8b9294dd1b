"""GPT-OSS's attention (transformers' ``GptOssAttention``): grouped-query attention with biases on
the q, k, v and output projections and a learned sink per head, an extra logit in each row's softmax
that takes probability mass and gives no value (``sinks``); each layer full causal or banded
(``window``: GPT-OSS alternates 128-token sliding layers with full ones).

The softmax with a sink is computed here in the eager form (scores, the sink appended, softmax,
the sink's column dropped): exact in fp32 on the CPU and what the parity tests compare. Not yet the
fast path: a GPU kernel would take FlexAttention's log-sum-exp and scale its output by
``sigmoid(lse - sink)``, which is the same quantity.
"""

from __future__ import annotations

import torch
from torch import nn

from framework.models.parts.cache import KVCache
from framework.models.parts.masks import causal_band
from framework.models.parts.rope import apply_rope


class SinkAttention(nn.Module):
    """``forward(x, rope, mask=None)`` as ``framework.models.parts.attention.Attention``'s: ``mask``
    None is causal (banded by ``window`` when > 0), else a boolean (queries, keys) mask, True = seen."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, window: int = 0) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim, self.window = n_heads, n_kv_heads, head_dim, window
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=True)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=True)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=True)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=True)
        self.sinks = nn.Parameter(torch.zeros(n_heads))

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q = apply_rope(self.wq(x).view(b, s, self.n_heads, self.head_dim), rope)
        k = apply_rope(self.wk(x).view(b, s, self.n_kv_heads, self.head_dim), rope)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim)
        if mask is None:
            mask = causal_band(s, s, 0, self.window, x.device)
        return self.wo(self.attend(q, k, v, mask))

    def forward_cached(self, x: torch.Tensor, cache: KVCache, layer: int) -> torch.Tensor:
        """``forward`` for ``x`` (batch, new, dim) after the cached positions, its keys and values
        written into ``cache`` (framework.models.parts.cache: (batch, kv_heads, capacity, head_dim)),
        each query seeing the cached keys its layer's window leaves."""
        b, s, _ = x.shape
        start, end = cache.length, cache.length + s
        rope = cache.rope[start:end]
        q = apply_rope(self.wq(x).view(b, s, self.n_heads, self.head_dim), rope)
        k = apply_rope(self.wk(x).view(b, s, self.n_kv_heads, self.head_dim), rope)
        cache.keys[layer][:, :, start:end] = k.transpose(1, 2)
        cache.values[layer][:, :, start:end] = (
            self.wv(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        )
        keys, values = (
            cache.keys[layer][:, :, :end].transpose(1, 2),
            cache.values[layer][:, :, :end].transpose(1, 2),
        )
        mask = causal_band(s, end, start, cache.windows[layer], x.device)
        return self.wo(self.attend(q, keys, values, mask))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q (batch, queries, heads, hd), k and v (batch, keys, kv_heads, hd), ``mask`` (queries, keys)
        boolean: the attention output (batch, queries, heads * hd), each row's softmax with its
        head's sink logit beside the scores."""
        groups = self.n_heads // self.n_kv_heads
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = (q @ k.transpose(-1, -2)) * self.head_dim**-0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        sinks = self.sinks.view(1, -1, 1, 1).to(scores.dtype).expand(*scores.shape[:-1], 1)
        logits = torch.cat([scores, sinks], dim=-1)
        logits = logits - logits.amax(dim=-1, keepdim=True)  # as transformers: no overflow in bf16
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        out = probs.to(v.dtype) @ v
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)
