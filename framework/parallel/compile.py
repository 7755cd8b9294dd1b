"""torch.compile per block (or of the whole model), before FSDP/DDP wrap it.

Compiling the block's ``forward`` on the instance keeps parameter names unchanged (no
``_orig_mod.`` prefix) and keeps FSDP2's per-block hooks, which run in ``__call__`` around
``forward``, outside the compiled graph; that is what lets each block compile with
``fullgraph=True``. Compiling before wrapping also avoids Dynamo tracing DDP's logger, which fails.
"""

from __future__ import annotations

import torch
from torch import nn

from framework.config import CompileScope, ExecutorConfig, ExecutorMode
from framework.model import Llama


def _compile_forward(module: nn.Module, executor: ExecutorConfig, mode: str | None) -> None:
    module.forward = torch.compile(
        module.forward, fullgraph=True, dynamic=False, backend=executor.backend, mode=mode
    )


def apply_compile(model: Llama, executor: ExecutorConfig, device: torch.device) -> int:
    """Compile per ``executor``; returns the number of compiled forwards (0 for eager).

    ``cudagraphs`` is torch.compile's ``mode="reduce-overhead"`` (Inductor with CUDA graphs).
    Raises ValueError for ``cudagraphs`` on a non-CUDA device.
    """
    if executor.mode == ExecutorMode.eager:
        return 0
    mode = None
    if executor.mode == ExecutorMode.cudagraphs:
        if device.type != "cuda":
            raise ValueError(
                f"executor.mode=cudagraphs needs a CUDA device, got {device.type}: use executor.mode=compile "
                f"or executor.mode=eager"
            )
        mode = "reduce-overhead"
    if executor.scope == CompileScope.model:
        _compile_forward(model, executor, mode)
        return 1
    blocks = list(model.layers.values())
    for block in blocks:
        _compile_forward(block, executor, mode)
    if not blocks:
        raise RuntimeError("executor.scope=block but the model has no blocks to compile")
    # The loss head (final norm, output projection, fp32 cross-entropy) is its own region: with a
    # 128K vocabulary it is a large share of the step, and compiled it fuses the fp32 upcast and
    # log-softmax instead of materialising fp32 logits.
    model.head_loss = torch.compile(
        model.head_loss, fullgraph=True, dynamic=False, backend=executor.backend, mode=mode
    )
    return len(blocks) + 1
