"""The checkpoint's control channel: small agreements between ranks, on a group of their own.

Why a group of its own: an async save runs DCP's collectives on a background thread. If the
training loop's own collectives, or these control messages, shared that group, the two threads
would issue collectives in different orders on different ranks and gloo would fail with a
"collective mismatch" (see the shared notes). So checkpointing uses two gloo groups created once:
one that only DCP uses, one that only this channel uses from the main thread. Without an
initialised process group (one process, no launcher) every call degenerates to the local value.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def new_gloo_group() -> dist.ProcessGroup | None:
    """A fresh gloo group over all ranks (collective: every rank must call it), or None alone."""
    return dist.new_group(backend="gloo") if dist_ready() else None


class Channel:
    """Rank, world size and the few collectives checkpointing needs, on one gloo group."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world = dist.get_world_size(group) if group is not None else 1

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank (JSON-like values only: no tensors, nothing large)."""
        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def gather_all(self, obj: T) -> list[T]:
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def any(self, flag: bool) -> bool:
        """True on every rank if it is True on any rank (all_reduce MAX of one int)."""
        if self.group is None:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())
