"""The KV cache that decoding fills: each layer's keys and values, the RoPE tables for the whole
capacity, and the family's attention window.

Why a separate walk of the modules rather than a cache inside ``forward``: training runs whole
sequences through one causal SDPA call, and a cache would put a branch and per-call state into the
graphs that freeze, export and compile see. Each module that attends has a ``forward_cached``
beside its ``forward`` (the same weights, norms, RoPE and MLP), which no traced graph reaches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from framework.models.parts.rope import rope_tables


@dataclass
class KVCache:
    """Keys and values per layer, (batch, kv_heads, capacity, head_dim); ``length`` positions filled."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    rope: torch.Tensor
    length: int = 0
    window: int = 0  # the family's sliding window (0: every cached key is seen)

    @classmethod
    def empty(cls, model: nn.Module, batch: int, capacity: int) -> KVCache:
        """An empty cache for a decoder (``framework.models.Decoder``: its config, head size,
        window, embedding and layers)."""
        cfg = model.cfg
        p = model.tok_embeddings.weight
        shape = (batch, cfg.n_kv_heads, capacity, model.head_dim)
        keys = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in model.layers]
        values = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in model.layers]
        # Tables for the whole capacity: a prompt plus its continuation may be longer than training's seq_len.
        rope = rope_tables(model.head_dim, capacity, cfg.rope_theta, p.device, cfg)
        return cls(keys, values, rope, window=model.sliding_window or 0)
