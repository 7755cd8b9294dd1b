"""Activation checkpointing per transformer block.

Applied by replacing the block's ``forward`` on the instance with one that runs it under
``torch.utils.checkpoint.checkpoint`` (non-reentrant), rather than wrapping the block in a new
module: parameter names stay ``layers.N.attention.wq.weight``, which the per-name weight init,
the TP plan, checkpoints and FSDP2 all rely on. ``selective`` checkpoints every other block (the
even ones), trading about half the recompute of ``full`` for half its saving. ``selective_op``
checkpoints every block under a per-op policy (torch.utils.checkpoint's selective checkpointing,
``create_selective_checkpoint_contexts``): torchtitan's ``selective`` AC with ``selective_ac_option
= "op"`` (torchtitan 9dec370, torchtitan/parallelisms/parallelize_llama.py ``_save_list`` and
``_custom_policy``), the policy of its published Llama 3 benchmarks: keep the output of every other
matmul (a dense block runs wq, wk, wv, wo, w1, w3, w2: wq, wv, w1 and w2 are kept), of attention
and of TP's reduce-scatters; recompute the rest (norms, RoPE, SiLU, the other matmuls).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from framework.config.schema import ActivationCheckpointing, ExecutorConfig, ExecutorMode, ShardingConfig
from framework.models import Decoder, blocks

log = logging.getLogger("framework")

# The matmuls whose outputs alternate between kept and recomputed (float8 Linear layers run
# _scaled_mm), and the ops whose outputs are always kept: attention (each SDPA kernel; FlexAttention
# under a document mask), TP's reduce-scatter (so the recompute sends nothing back), and what
# torchtitan keeps for float8's scales (abs, max). torchtitan 9dec370's ``_save_list``, plus the SDPA
# kernels this framework also dispatches to (cuDNN, the CPU flash kernel) and _scaled_mm.
_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default)
_ALWAYS_KEPT = (
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.higher_order.flex_attention,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops.aten.abs.default,
    torch.ops.aten.max.default,
)


def _op_policy() -> Callable[..., CheckpointPolicy]:
    """One block call's policy: the forward and the recompute count their matmuls apart, so the
    recompute keeps (reads back) exactly the matmuls the forward kept."""
    counts = {False: 0, True: 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in _MATMULS:
            counts[ctx.is_recompute] += 1
            odd = counts[ctx.is_recompute] % 2 == 1
            return CheckpointPolicy.MUST_SAVE if odd else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in _ALWAYS_KEPT else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _op_contexts() -> Any:
    return create_selective_checkpoint_contexts(_op_policy())


def _checkpointed(forward: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    return checkpoint(forward, *args, use_reentrant=False)


def _op_checkpointed(forward: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    return checkpoint(forward, *args, use_reentrant=False, context_fn=_op_contexts)


def checkpoint_block(block: nn.Module, per_op: bool = False) -> None:
    """Recompute this block's activations in backward instead of saving them (``per_op``: those
    the selective policy above does not keep)."""
    block.forward = functools.partial(_op_checkpointed if per_op else _checkpointed, block.forward)


def is_checkpointed(block: nn.Module) -> bool:
    fwd = block.__dict__.get("forward")
    return isinstance(fwd, functools.partial) and fwd.func in (_checkpointed, _op_checkpointed)


def apply_ac(model: Decoder, mode: ActivationCheckpointing) -> int:
    """Checkpoint blocks per ``mode``; returns how many. No-op for ``none`` and for ``budget``
    (the compiler's partitioner recomputes instead: ``apply_compile``'s ``memory_budget``).

    Raises RuntimeError if a mode other than ``none`` checkpointed no block.
    """
    if mode in (ActivationCheckpointing.none, ActivationCheckpointing.budget):
        return 0
    count = 0
    every = mode in (ActivationCheckpointing.full, ActivationCheckpointing.selective_op)
    for i, block in enumerate(blocks(model)):
        if every or i % 2 == 0:
            checkpoint_block(block, per_op=mode == ActivationCheckpointing.selective_op)
            count += 1
    if count == 0:
        raise RuntimeError(f"activation_checkpointing={mode.value} checkpointed no block")
    return count


def _offloaded(forward: Callable[..., torch.Tensor], pin: bool, *args: Any) -> torch.Tensor:
    with torch.autograd.graph.saved_tensors_hooks(functools.partial(_to_host, pin), _from_host):
        return forward(*args)


def _to_host(pin: bool, t: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
    """A saved tensor's copy in (pinned) host memory, with its strides. torch's ``save_on_cpu``
    copies into a contiguous buffer, and a compiled block's backward asserts the strides it saved
    with: on the H200 the 8B's first step failed so (benchmarks/PERF.md, session 14). Always a copy,
    also from the CPU, so that CPU runs check the same strides."""
    pinned = pin and t.is_cuda
    if _dense(t):
        host = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, pin_memory=pinned)
    else:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)
    host.copy_(t, non_blocking=pinned)
    return t.device, host


def _from_host(packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
    device, host = packed
    out = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
    return out.copy_(host, non_blocking=host.is_pinned())


def _dense(t: torch.Tensor) -> bool:
    """Its elements fill its storage span once each (a permuted contiguous tensor): its strides can
    be allocated as they are. Expanded or sliced views are saved contiguous instead."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda p: p[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


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


def activation_rung(
    sharding: ShardingConfig, executor: ExecutorConfig
) -> tuple[ActivationCheckpointing, float | None]:
    """The checkpointing to apply and the partitioner's memory budget (None: torch's default).
    ``budget`` is the compiler's own recompute; on the eager executor, which the fallback ladder
    reaches when compiling fails (users' eager + budget is refused before launch), nothing would
    recompute, and the activations the budget kept off the device would not fit: checkpoint every
    block instead (the memory of ``full``, its recompute), with one line saying so."""
    ac = sharding.activation_checkpointing
    if ac is not ActivationCheckpointing.budget:
        return ac, None
    if executor.mode is ExecutorMode.eager:
        log.warning(
            "executor.mode=eager (the fallback ladder's rung) with activation_checkpointing=budget, which "
            "needs the compiler: checkpointing every block (full) instead"
        )
        return ActivationCheckpointing.full, None
    return ac, sharding.activation_memory_budget
