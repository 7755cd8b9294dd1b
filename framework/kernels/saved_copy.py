"""``saved_copy(x)``: ``x`` copied by an op Inductor cannot see into (a ``torch.library`` custom op),
so a compiled graph saves the copy for backward instead of recomputing it there; its gradient passes
through unchanged.

Why: under float8 (torchao's tensorwise recipe) each Linear's weight gradient needs its input cast
to float8 in column-major order. Compiled per block, the partitioner recomputed the RMSNorm output
that feeds the projections in backward and Inductor fused that recompute, the float8 cast and the
transposed write into the norm's backward reduction: one persistent-reduction kernel a norm that
writes column-wise, ~1.7 ms a layer on an H200 at 8K tokens (benchmarks/PERF.md, the float8
profiles of sessions 10 and 12). Saved, the norm output is read by a tiled pointwise cast instead.
The copy costs one read and one write in forward (bf16, 64 MiB at 8K x 4096) and the saved tensor
its memory; the values are unchanged, so losses and gradients are bitwise those without it.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


@torch.library.custom_op("framework::saved_copy", mutates_args=())
def _copy(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_copy.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _backward(_ctx: object, grad: torch.Tensor) -> torch.Tensor:
    return grad


_copy.register_autograd(_backward)


def saved_copy(x: torch.Tensor) -> torch.Tensor:
    """``x``, copied so that a compiled backward reads it saved (see the module docstring). Plain
    tensors only: a DTensor (tensor parallelism) passes through unchanged."""
    if isinstance(x, DTensor):
        return x
    return _copy(x)
