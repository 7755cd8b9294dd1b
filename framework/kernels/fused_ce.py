"""The loss head as one fused linear cross-entropy (``model.fused_cross_entropy``): liger-kernel or
cut-cross-entropy instead of the output projection followed by cross-entropy.

Why: with a 128K vocabulary the logits of a 32K-token micro-batch are 8 GiB in bf16; a fused kernel
computes the loss chunk by chunk (liger, which also takes the gradients in the forward) or tile by
tile (cce) and never holds them. Both are Triton kernels, CUDA only, in optional packages, and
each reads the targets on the host once per step (liger counts them, cce finds the ignored ones),
so neither compiles into a whole-model graph. ``check`` refuses such configs before launch.
"""

from __future__ import annotations

import importlib.util

import torch

from framework.config.schema import CompileScope, ExecutorConfig, ExecutorMode, FusedCrossEntropy, ModelConfig
from framework.kernels.target import MissingPackage

# The package (import name, pip name) that provides each kernel.
PACKAGES = {
    FusedCrossEntropy.liger: ("liger_kernel", "liger-kernel"),
    FusedCrossEntropy.cce: ("cut_cross_entropy", "cut-cross-entropy"),
}

# F.cross_entropy's default, which the model's unfused head and framework.data.sft use.
IGNORE_INDEX = -100


def check(model: ModelConfig, executor: ExecutorConfig, device_type: str, tp: int) -> None:
    """Refuse ``model.fused_cross_entropy`` where it cannot run: off CUDA, under a whole-model
    compiled graph, with the output head sharded by TP (``tp`` > 1), or without its package
    (``MissingPackage``: a dry run only warns of it, framework.kernels.target)."""
    kind = model.fused_cross_entropy
    if kind is FusedCrossEntropy.none:
        return
    key = f"model.fused_cross_entropy={kind.value}"
    if device_type != "cuda":
        raise ValueError(
            f"{key} needs a CUDA device (its kernels are Triton), this run uses {device_type}: "
            "use model.fused_cross_entropy=none"
        )
    if executor.mode is not ExecutorMode.eager and executor.scope is CompileScope.model:
        raise ValueError(
            f"{key} cannot run inside one compiled graph (executor.scope=model: the kernel reads the "
            "targets on the host): use executor.scope=block, or model.fused_cross_entropy=none"
        )
    if tp > 1:
        # Refused, not run on gathered logits: the kernel fuses the projection, so it needs the whole
        # head's weight, which neither TP path has; loss parallelism is TP's own memory saving.
        raise ValueError(
            f"{key} needs the whole output head on each rank, and sharding.tp={tp} shards it over the "
            "vocabulary: use model.fused_cross_entropy=none with tensor parallelism (its loss "
            f"parallelism, parallel.loss_parallel=true, then keeps 1/{tp} of the logits on each rank)"
        )
    module, pip_name = PACKAGES[kind]
    if importlib.util.find_spec(module) is None:
        raise MissingPackage(
            f"{key} needs the {pip_name} package: pip install {pip_name}, or use model.fused_cross_entropy=none"
        )


def linear_cross_entropy(
    kind: FusedCrossEntropy, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """Mean cross-entropy of ``h @ weight.T`` (h: batch x seq x dim, the final norm's output) against
    ``targets``, ignoring ``IGNORE_INDEX``, without materialising the logits.

    The fp32 master weight is cast to the autocast dtype once here, not per chunk inside the kernel
    (liger's chunked matmuls would each cast the 128K x dim weight again); its gradient flows back
    through the cast. liger accumulates the weight gradient in fp32 over its chunks.
    """
    if type(weight).__name__ == "DTensor":  # sharding=auto chose TP after the launch checks
        raise RuntimeError("model.fused_cross_entropy needs an unsharded output head (no tensor parallelism)")
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else h.dtype
    x, w, t = h.flatten(0, 1).to(dtype), weight.to(dtype), targets.flatten()
    if kind is FusedCrossEntropy.liger:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, accum_dtype=torch.float32)(w, x, t)
    if kind is FusedCrossEntropy.cce:
        from cut_cross_entropy import linear_cross_entropy as cce

        return cce(x, w, t, ignore_index=IGNORE_INDEX)
    raise AssertionError(f"no fused kernel for {kind}")
