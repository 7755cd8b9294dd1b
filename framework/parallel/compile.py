"""torch.compile per block (or of the whole model), before FSDP/DDP wrap it.

Compiling the block's ``forward`` on the instance keeps parameter names unchanged (no
``_orig_mod.`` prefix) and keeps FSDP2's per-block hooks, which run in ``__call__`` around
``forward``, outside the compiled graph; that is what lets each block compile with
``fullgraph=True``. Compiling before wrapping also avoids Dynamo tracing DDP's logger, which fails.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch._functorch.config as functorch_config
from torch import nn

from framework.config.schema import CompileScope, ExecutorConfig, ExecutorMode, FusedCrossEntropy
from framework.models import Decoder, blocks


def inductor_mode(executor: ExecutorConfig) -> str | None:
    """torch.compile's ``mode`` for this executor: CUDA graphs and/or GEMM autotuning."""
    if executor.mode == ExecutorMode.cudagraphs:
        return "max-autotune" if executor.autotune else "reduce-overhead"
    return "max-autotune-no-cudagraphs" if executor.autotune else None


_DEFAULT_BUDGET = functorch_config.activation_memory_budget


def _compile(fn: Callable[..., Any], executor: ExecutorConfig, mode: str | None) -> Callable[..., Any]:
    return torch.compile(fn, fullgraph=True, dynamic=False, backend=executor.backend, mode=mode)


def apply_compile(
    model: Decoder,
    executor: ExecutorConfig,
    device: torch.device,
    memory_budget: float | None = None,
) -> int:
    """Compile per ``executor``; returns the number of compiled regions (0 for eager).

    ``cudagraphs`` is Inductor with CUDA graphs (``mode="reduce-overhead"``); ``executor.autotune``
    adds max-autotune's GEMM search. ``memory_budget`` (0..1) is the partitioner's activation
    memory budget: the compiler's own activation checkpointing (``activation_checkpointing=budget``).
    It is process-wide torch config (``torch._functorch.config.activation_memory_budget``), read
    when each region first compiles, so each call sets it (None: torch's default) rather than
    patching it around every region call on the hot path; a process trains one model.
    Users' combinations are refused before launch, each in one place: ``cudagraphs`` off CUDA by
    ``framework.launch.prelaunch.check_cudagraphs``, a budget with the eager executor by ``framework.planner.plan``.
    """
    if executor.mode == ExecutorMode.eager:
        assert memory_budget is None, (
            "activation_checkpointing=budget with eager: refused by framework.planner.plan"
        )
        return 0
    assert executor.mode != ExecutorMode.cudagraphs or device.type == "cuda", (
        "refused by framework.launch.prelaunch.check_cudagraphs"
    )
    mode = inductor_mode(executor)
    functorch_config.activation_memory_budget = _DEFAULT_BUDGET if memory_budget is None else memory_budget
    if executor.scope == CompileScope.model:
        model.forward = _compile(model.forward, executor, mode)
        return 1
    units: list[nn.Module] = blocks(model)
    if not units:
        raise RuntimeError("executor.scope=block but the model has no blocks to compile")
    for block in units:
        block.forward = _compile(block.forward, executor, mode)
    # The loss head (final norm, output projection, fp32 cross-entropy) is its own region: with a
    # 128K vocabulary it is a large share of the step, and compiled it fuses the fp32 upcast and
    # log-softmax instead of materialising fp32 logits. A fused cross-entropy kernel (framework.kernels.fused_ce)
    # cannot be traced (it reads the targets on the host): then only the final norm is compiled.
    # ``executor.compile_loss=false`` leaves the head eager (the blocks alone are compiled).
    if not executor.compile_loss:
        return len(units)
    if model.cfg.fused_cross_entropy is FusedCrossEntropy.none:
        model.head_loss = _compile(model.head_loss, executor, mode)
    else:
        model.norm.forward = _compile(model.norm.forward, executor, mode)
    return len(units) + 1
