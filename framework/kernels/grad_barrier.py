"""A fusion barrier on a gradient: ``grad_barrier(x)`` is ``x`` in forward; in backward its gradient
is copied by an op Inductor cannot see into (a ``torch.library`` custom op), so the kernel that
computes the gradient and the kernels that read it are compiled apart.

Why: under float8 (torchao's tensorwise recipe) the gradient of a sublayer's output is cast to
float8 twice in backward, once row-major for the input gradient and once transposed for the
weight gradient. Compiled per block, Inductor fused the transposed cast into the RMSNorm
backward that produces that gradient (one persistent reduction per row that writes its output
column-wise): ~2 ms a layer on an H200 at 8K tokens, where the same work as a tiled pointwise
kernel is a few hundredths of that (benchmarks/PERF.md, session 10's profile). The copy costs one
read and one write of the gradient (bf16, 64 MiB at 8K x 4096: ~30 us on an H200).

The values are unchanged (a copy), so losses and gradients are bitwise those without it.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


@torch.library.custom_op("framework::copy_grad", mutates_args=())
def _copy(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_copy.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class _GradBarrier(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        return _copy(grad)


def grad_barrier(x: torch.Tensor) -> torch.Tensor:
    """``x``, with its gradient materialised behind an opaque copy (see the module docstring).
    Plain tensors only: a DTensor (tensor parallelism) passes through unchanged."""
    if isinstance(x, DTensor) or not x.requires_grad:
        return x
    return _GradBarrier.apply(x)
