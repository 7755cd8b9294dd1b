"""torch.compile per block (or of the whole model), before FSDP/DDP wrap it.

Compiling the block's ``forward`` on the instance keeps parameter names unchanged (no
``_orig_mod.`` prefix) and keeps FSDP2's per-block hooks, which run in ``__call__`` around
``forward``, outside the compiled graph; that is what lets each block compile with
``fullgraph=True``. Compiling before wrapping also avoids Dynamo tracing DDP's logger, which fails.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from framework.config import CompileScope, ExecutorConfig, ExecutorMode
from framework.model import Llama


def inductor_mode(executor: ExecutorConfig) -> str | None:
    """torch.compile's ``mode`` for this executor: CUDA graphs and/or GEMM autotuning."""
    if executor.mode == ExecutorMode.cudagraphs:
        return "max-autotune" if executor.autotune else "reduce-overhead"
    return "max-autotune-no-cudagraphs" if executor.autotune else None


def _under_budget(fn: Callable[..., Any], budget: float, *args: Any, **kwargs: Any) -> Any:
    # The partitioner reads the budget when it splits forward from backward, which happens on the
    # first call (and on any recompile); patching per call keeps it scoped to this model.
    with torch._functorch.config.patch(activation_memory_budget=budget):
        return fn(*args, **kwargs)


def _compile(
    fn: Callable[..., Any], executor: ExecutorConfig, mode: str | None, budget: float | None
) -> Callable[..., Any]:
    compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend=executor.backend, mode=mode)
    if budget is None:
        return compiled
    return functools.partial(_under_budget, compiled, budget)


def apply_compile(
    model: Llama,
    executor: ExecutorConfig,
    device: torch.device,
    memory_budget: float | None = None,
) -> int:
    """Compile per ``executor``; returns the number of compiled regions (0 for eager).

    ``cudagraphs`` is Inductor with CUDA graphs (``mode="reduce-overhead"``); ``executor.autotune``
    adds max-autotune's GEMM search. ``memory_budget`` (0..1) is the partitioner's activation
    memory budget: the compiler's own activation checkpointing (``activation_checkpointing=budget``).
    Raises ValueError for ``cudagraphs`` on a non-CUDA device, or a budget with the eager executor.
    """
    if executor.mode == ExecutorMode.eager:
        if memory_budget is not None:
            raise ValueError(
                "sharding.activation_checkpointing=budget needs a compiled executor (the compiler's "
                "partitioner does the recompute): use executor=compile or executor=cudagraphs"
            )
        return 0
    if executor.mode == ExecutorMode.cudagraphs and device.type != "cuda":
        raise ValueError(
            f"executor.mode=cudagraphs needs a CUDA device, got {device.type}: use executor.mode=compile "
            f"or executor.mode=eager"
        )
    mode = inductor_mode(executor)
    if executor.scope == CompileScope.model:
        model.forward = _compile(model.forward, executor, mode, memory_budget)
        return 1
    blocks: list[nn.Module] = list(model.layers.values())
    if not blocks:
        raise RuntimeError("executor.scope=block but the model has no blocks to compile")
    for block in blocks:
        block.forward = _compile(block.forward, executor, mode, memory_budget)
    # The loss head (final norm, output projection, fp32 cross-entropy) is its own region: with a
    # 128K vocabulary it is a large share of the step, and compiled it fuses the fp32 upcast and
    # log-softmax instead of materialising fp32 logits.
    model.head_loss = _compile(model.head_loss, executor, mode, memory_budget)
    return len(blocks) + 1
