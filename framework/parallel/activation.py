"""Activation checkpointing per transformer block.

Applied by replacing the block's ``forward`` on the instance with one that runs it under
``torch.utils.checkpoint.checkpoint`` (non-reentrant), rather than wrapping the block in a new
module: parameter names stay ``layers.N.attention.wq.weight``, which the per-name weight init,
the TP plan, checkpoints and FSDP2 all rely on. ``selective`` checkpoints every other block (the
even ones), trading about half the recompute of ``full`` for half its saving.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from framework.config.schema import ActivationCheckpointing
from framework.models import Decoder, blocks


def _checkpointed(forward: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    return checkpoint(forward, *args, use_reentrant=False)


def checkpoint_block(block: nn.Module) -> None:
    """Recompute this block's activations in backward instead of saving them."""
    block.forward = functools.partial(_checkpointed, block.forward)


def is_checkpointed(block: nn.Module) -> bool:
    fwd = block.__dict__.get("forward")
    return isinstance(fwd, functools.partial) and fwd.func is _checkpointed


def apply_ac(model: Decoder, mode: ActivationCheckpointing) -> int:
    """Checkpoint blocks per ``mode``; returns how many. No-op for ``none`` and for ``budget``
    (the compiler's partitioner recomputes instead: ``apply_compile``'s ``memory_budget``).

    Raises RuntimeError if a mode other than ``none`` checkpointed no block.
    """
    if mode in (ActivationCheckpointing.none, ActivationCheckpointing.budget):
        return 0
    count = 0
    for i, block in enumerate(blocks(model)):
        if mode == ActivationCheckpointing.full or i % 2 == 0:
            checkpoint_block(block)
            count += 1
    if count == 0:
        raise RuntimeError(f"activation_checkpointing={mode.value} checkpointed no block")
    return count


def _offloaded(forward: Callable[..., torch.Tensor], pin: bool, *args: Any) -> torch.Tensor:
    with torch.autograd.graph.save_on_cpu(pin_memory=pin):
        return forward(*args)


def is_offloaded(block: nn.Module) -> bool:
    fwd = block.__dict__.get("forward")
    return isinstance(fwd, functools.partial) and fwd.func is _offloaded


def apply_offload(model: Decoder, on: bool) -> int:
    """``sharding.activation_offload``: each block's saved tensors to host memory (pinned on CUDA);
    returns how many blocks. Call after ``apply_ac`` and ``apply_compile`` (it wraps what they made)."""
    if not on:
        return 0
    units = blocks(model)
    pin = torch.cuda.is_available()
    for block in units:
        block.forward = functools.partial(_offloaded, block.forward, pin)
    return len(units)
