"""GPT-OSS's attention (transformers' ``GptOssAttention``): grouped-query attention with biases on
the q, k, v and output projections and a learned sink per head, an extra logit in each row's softmax
that takes probability mass and gives no value (``sinks``); each layer full causal or banded
(``window``: GPT-OSS alternates 128-token sliding layers with full ones).

Two ways to the same softmax with a sink (``flex`` picks; None: FlexAttention on CUDA unless
``model.attention=math``, the eager form elsewhere):

- FlexAttention (``attend_flex``): fused, no (seq x seq) tensor; the layer's causal or banded block
  mask (``sink_block_mask``), GQA read in place (``enable_gqa``), and the kernel's log-sum-exp of each
  row's scores. Appending the sink logit ``s`` to a row whose scores sum to ``exp(lse)`` scales every
  probability by ``exp(lse) / (exp(lse) + exp(s)) = sigmoid(lse - s)``, so the output is FlexAttention's
  times that, per head and row; the gradient reaches the sink and the scores through ``lse``.
  FlexAttention trains on CUDA only (its CPU kernels run forward alone, and compiled refuse the
  log-sum-exp), so off CUDA it serves the parity tests' forwards.
- The eager form (``attend``): scores, the sink appended, softmax, the sink's column dropped. Exact
  in fp32 on the CPU, what the parity tests compare with transformers, and the decode path
  (``forward_cached``, whose masks are offset by the cache).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.attention import flex_attention as flex_module
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from framework.config.schema import AttentionBackend
from framework.models.parts.attention import _flex
from framework.models.parts.cache import KVCache
from framework.models.parts.masks import causal_band
from framework.models.parts.rope import apply_rope

# torch >= 2.9 asks for the log-sum-exp by ``return_aux=AuxRequest(lse=True)`` (``return_lse`` is
# deprecated there); earlier ones by ``return_lse=True``.
_AUX_REQUEST = getattr(flex_module, "AuxRequest", None)


def _band_mask_mod(window: int):  # noqa: ANN202 - FlexAttention's mask_mod signature
    """Query ``q`` sees key ``kv`` at or before it and, for a window > 0, less than ``window`` back:
    ``causal_band``'s rule as FlexAttention's ``mask_mod``."""

    def band(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        seen = q >= kv
        return seen & (q - kv < window) if window > 0 else seen

    return band


_BLOCK_MASKS: dict[tuple[int, int, str], BlockMask] = {}


def sink_block_mask(seq: int, window: int, device: torch.device) -> BlockMask:
    """FlexAttention's block mask of a (seq x seq) causal (``window`` 0) or banded layer, shared by
    every batch row and head. Built once per shape and kept (its construction compiled on CUDA);
    inside a compiled region it is built in the graph, which then holds no Python state to guard on."""
    if torch.compiler.is_compiling():
        return create_block_mask(_band_mask_mod(window), None, None, seq, seq, device=device)
    key = (seq, window, str(device))
    if key not in _BLOCK_MASKS:
        _BLOCK_MASKS[key] = create_block_mask(
            _band_mask_mod(window), None, None, seq, seq, device=device, _compile=device.type == "cuda"
        )
    return _BLOCK_MASKS[key]


def flex_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention's output (batch, heads, q, hd) and log-sum-exp (batch, heads, q), float32, of
    q (batch, heads, q, hd), k and v (batch, kv_heads, keys, hd): compiled once on CUDA
    (framework.models.parts.attention._flex), eager elsewhere."""
    fn = _flex(q)
    if _AUX_REQUEST is not None:
        out, aux = fn(
            q, k, v, block_mask=mask, scale=scale, enable_gqa=True, return_aux=_AUX_REQUEST(lse=True)
        )
        return out, aux.lse
    out, lse = fn(q, k, v, block_mask=mask, scale=scale, enable_gqa=True, return_lse=True)
    return out, lse


class SinkAttention(nn.Module):
    """``forward(x, rope, mask=None)`` as ``framework.models.parts.attention.Attention``'s: ``mask``
    None is causal (banded by ``window`` when > 0), else a boolean (queries, keys) mask, True = seen,
    or FlexAttention's ``BlockMask`` (a document mask). ``backend``: ``model.attention``; ``math``
    keeps the eager form on every device. ``flex``: None chooses (FlexAttention on CUDA), True / False
    force it (the parity tests)."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        window: int = 0,
        backend: AttentionBackend = AttentionBackend.auto,
    ) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim, self.window = n_heads, n_kv_heads, head_dim, window
        self.backend = backend
        self.flex: bool | None = None
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
        if self.uses_flex(x):
            # The decoder hands a windowed layer the dense band of its own window (it refuses
            # document masks with windows), which the layer's block mask states without the tensor.
            block = mask if isinstance(mask, BlockMask) else sink_block_mask(s, self.window, x.device)
            return self.wo(self.attend_flex(q, k, v, block))
        if mask is None:
            mask = causal_band(s, s, 0, self.window, x.device)
        return self.wo(self.attend(q, k, v, mask))

    def uses_flex(self, x: torch.Tensor) -> bool:
        """FlexAttention where it trains (CUDA) unless ``model.attention=math``; ``flex`` overrides."""
        if self.flex is not None:
            return self.flex
        return x.is_cuda and self.backend is not AttentionBackend.math

    def attend_flex(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask) -> torch.Tensor:
        """``attend`` by FlexAttention: q (batch, queries, heads, hd), k and v (batch, keys, kv_heads,
        hd), ``mask`` the block mask; the output (batch, queries, heads * hd), each head's rows
        scaled by the share of the softmax mass the sink leaves them, ``sigmoid(lse - sink)``."""
        out, lse = flex_with_lse(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, self.head_dim**-0.5
        )
        share = torch.sigmoid(lse - self.sinks.view(1, -1, 1).to(lse.dtype))
        out = (out * share.unsqueeze(-1)).to(q.dtype)
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)

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
