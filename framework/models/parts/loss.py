"""The loss head's cross-entropy on vocabulary-sharded logits (loss parallelism, ``parallel.loss_parallel``).

Under tensor parallelism with loss parallelism on (the default, as torchtitan's), the output
projection's logits stay sharded over the vocabulary (a DTensor ``Shard(-1)`` over the TP ranks,
framework.parallel.tensor) and ``F.cross_entropy`` runs on the shards under torch's
``loss_parallel()``: its handlers compute the log-softmax and the target's log-probability from
three all-reduces of one float per token (the max, the sum of exponentials, the target's logit) and
the gradient with no communication, so no rank holds more than 1/tp of the logits or their
gradient. The handlers are looked up when each op dispatches, in forward *and* in backward: the
caller enters ``loss_parallel_scope`` around both (the training steps, the pipeline schedule's step,
evaluation). Here rather than in framework.parallel because the decoder's loss head (below the
parallel layer) checks that the scope is open: outside it the op fails on the plain targets with
"got mixed torch.Tensor and DTensor", which names nothing a user can fix.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

# Open ``loss_parallel_scope``s (the training loop is single-threaded): torch's ``loss_parallel()``
# is not reentrant (its exit removes the handlers even while an outer scope still needs them).
_OPEN_SCOPES = 0


@contextlib.contextmanager
def _entered_once() -> Iterator[None]:
    from torch.distributed.tensor.parallel import loss_parallel

    global _OPEN_SCOPES
    _OPEN_SCOPES += 1
    try:
        if _OPEN_SCOPES > 1:
            yield
        else:
            with loss_parallel():
                yield
    finally:
        _OPEN_SCOPES -= 1


def loss_parallel_scope(modules: Iterable[nn.Module]) -> contextlib.AbstractContextManager:
    """torch's ``loss_parallel()`` where one of ``modules`` (those whose output is the logits:
    framework.parallel.pipeline.logit_modules) keeps its logits sharded over the vocabulary
    (``Decoder.vocab_shards``), else nothing. Enter it around the forward that computes the loss
    and the backward from it. Nesting is allowed (an inner scope does nothing)."""
    if any(getattr(m, "vocab_shards", None) is not None for m in modules):
        return _entered_once()
    return contextlib.nullcontext()


def require_scope() -> None:
    """Raise RuntimeError unless a ``loss_parallel_scope`` is open; nothing while Dynamo traces (a
    compiled loss region is checked by its eager caller, ``Decoder._head``, before it runs)."""
    if not torch.compiler.is_compiling() and not _OPEN_SCOPES:
        raise RuntimeError(
            "the logits are sharded over the vocabulary (parallel.loss_parallel=true under tensor "
            "parallelism): compute the loss and its backward inside "
            "framework.models.parts.loss.loss_parallel_scope([model]), or set parallel.loss_parallel=false"
        )


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """``F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction=reduction)`` of
    vocabulary-sharded ``logits`` (batch, seq, vocab / tp), as the plain head computes it of whole
    ones (IGNORE_INDEX targets skipped alike), as a plain tensor: the loss comes back replicated over
    the TP ranks and its local value is the loss. Raises RuntimeError outside ``loss_parallel_scope``
    (checked in eager; a compiled region was traced inside it)."""
    require_scope()
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction=reduction)
    # to_local() is a view of the DTensor's local tensor; FSDP2 warns when a module returns a view
    # (an in-place op on it would skip its pre-backward hook): a copy of the one value.
    return loss.to_local().clone()  # type: ignore[attr-defined]
