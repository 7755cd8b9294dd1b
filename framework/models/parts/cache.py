"""The KV cache that decoding fills: each layer's keys and values, the RoPE tables for the whole
capacity, and each layer's attention window.

Why a separate walk of the modules rather than a cache inside ``forward``: training runs whole
sequences through one causal SDPA call, and a cache would put a branch and per-call state into the
graphs that freeze, export and compile see. Each module that attends has a ``forward_cached``
beside its ``forward`` (the same weights, norms, RoPE and MLP), which no traced graph reaches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class KVCache:
    """Keys and values per layer, (batch, kv_heads, capacity, head_dim), or what a layer's attention
    keeps instead (``cache_shapes``: multi-head latent attention's compressed latent and its RoPE
    key); ``length`` positions filled; ``windows``: each layer's sliding window (0: every cached key
    is seen)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    rope: torch.Tensor
    length: int = 0
    windows: list[int] = field(default_factory=list)

    @classmethod
    def empty(cls, model: nn.Module, batch: int, capacity: int) -> KVCache:
        """An empty cache for a decoder (``framework.models.Decoder``: its config, head size,
        windows, embedding and layers; an attention with ``cache_shapes`` says what it keeps)."""
        cfg = model.cfg
        p = model.tok_embeddings.weight
        keys, values, windows = [], [], []
        for key, block in model.layers.items():
            attention = block.attention
            if hasattr(attention, "cache_shapes"):
                k_shape, v_shape = attention.cache_shapes(batch, capacity)
            else:
                k_shape = v_shape = (batch, cfg.n_kv_heads, capacity, model.head_dim)
            keys.append(torch.zeros(k_shape, dtype=p.dtype, device=p.device))
            values.append(torch.zeros(v_shape, dtype=p.dtype, device=p.device))
            shared = model.sliding_window or 0
            windows.append(model.layer_windows[key] if model.layer_windows is not None else shared)
        # Tables for the whole capacity: a prompt plus its continuation may be longer than training's seq_len.
        rope = model.rope_for(capacity, p.device)
        return cls(keys, values, rope, windows=windows)
