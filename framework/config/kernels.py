"""The model group's kernel choices for the loss head and the Linear layers (framework.kernels reads them):
a fused linear cross-entropy, float8 training and its gradients' format.
"""

from __future__ import annotations

from enum import Enum


class FusedCrossEntropy(Enum):
    """The loss head's kernel: ``none`` (the output projection, then cross-entropy in fp32; compiled
    by the executor), or a fused linear cross-entropy that never writes the (tokens x vocab) logits:
    ``liger`` (liger-kernel's chunked Triton kernel) or ``cce`` (Apple's cut-cross-entropy)."""

    none = "none"
    liger = "liger"
    cce = "cce"


class Float8Recipe(Enum):
    """Float8 training of the Linear layers (torchao.float8): ``tensorwise`` scales each tensor once
    (the faster recipe), ``rowwise`` scales each row (finer, closer to bf16); ``none``: bf16 autocast."""

    none = "none"
    tensorwise = "tensorwise"
    rowwise = "rowwise"


class Float8GradDtype(Enum):
    """The float8 format of the output gradients in tensorwise float8's two backward GEMMs: ``e4m3``
    (3 mantissa bits: finer steps, 2^18 of range under one scale) or ``e5m2`` (2 mantissa bits, 2^32
    of range: torchao's tensorwise default, made for gradients' wide range)."""

    e4m3 = "e4m3"
    e5m2 = "e5m2"
