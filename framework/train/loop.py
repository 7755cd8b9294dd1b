"""The training step: forward, backward with gradient accumulation, clip, optimiser step.

Kept free of logging, checkpointing and launching so it can be driven (and tested) on its own.
With ``train.optimizer_in_backward`` the optimiser step moves into the backward pass instead
(:class:`InBackward`): each parameter is updated as soon as its gradient is complete and the gradient
is freed, so the step never holds every gradient at once.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from framework.models import take_aux, take_mtp
from framework.models.parts.loss import loss_parallel_scope
from framework.parallel.pipeline import is_pipeline
from framework.parallel.pipeline_run import pipeline_evaluate, pipeline_step
from framework.parallel.step import (
    HostIO,
    StepParts,
    StepResult,
    StepTimer,
    autocast,
    clip_grads,
    group_lrs,
    ratio_over_ranks,
    step_result,
    targets_counted,
    to_device,
    total_grad_norm,
    update,
)
from framework.train.optimizers import Combined

# train.optimizer_in_backward on CUDA: run the per-parameter updates on their own stream (InBackward).
# A module constant, not a config field: the benchmark flips it to measure the overlap.
OPTIMIZER_SIDE_STREAM = True


@dataclass
class InBackward:
    """The optimiser step run inside backward, one parameter at a time (``train.optimizer_in_backward``).

    Why: the fp32 gradients are as large as the weights (27 GB for a 7B model); stepping each
    parameter from its post-accumulate-grad hook and dropping its gradient at once frees that memory
    for activations (less recompute, or a larger batch). It is the mechanism of torchtitan's
    ``optimizer.early_step_in_backward`` and torch's ``_apply_optimizer_in_backward``.

    The main optimiser stays the one that is checkpointed and scheduled: each per-parameter optimiser
    reads and writes the main one's ``state`` (so checkpoints are the same with or without this option)
    and takes its group's learning rate on every step. What is given up, and therefore refused by the
    planner: a global gradient-norm clip (the norm is only known after the last gradient), gradient
    accumulation, and data parallelism (the hook fires before DDP/FSDP reduce the gradient). A
    non-finite loss still skips the whole step, and a non-finite gradient skips its parameter's update
    (fused AdamW's ``found_inf``, no host sync), so no NaN reaches the weights; but a step with a finite
    loss and a non-finite gradient somewhere has updated the other parameters. The gradient norm is
    still measured, for the logs.
    """

    main: torch.optim.Optimizer
    per_param: dict[nn.Parameter, tuple[torch.optim.Optimizer, dict]]
    poison: torch.Tensor  # 0.0, or NaN when this step's loss is non-finite
    norm_sq: torch.Tensor  # sum of the squared gradient norms seen this step
    handles: list[RemovableHandle]
    stream: torch.cuda.Stream | None = None  # CUDA: the updates' own stream (see _step)
    # train.in_backward_grad_checks: each gradient's norm and finiteness; off, only the loss's (poison)
    check_grads: bool = True

    def _update(self, p: torch.Tensor) -> None:
        opt, group = self.per_param[p]
        opt.state = self.main.state  # the main optimiser's load_state_dict replaces its dict
        opt.param_groups[0]["lr"] = group["lr"]  # moved by the scheduler
        assert p.grad is not None
        if self.check_grads:
            g_norm = torch.linalg.vector_norm(p.grad, dtype=torch.float32)
            self.norm_sq += g_norm.square()
            ok = torch.isfinite(g_norm + self.poison)  # this gradient and the loss are finite
        else:
            ok = torch.isfinite(self.poison)  # the loss is finite
        if group.get("fused"):
            opt.found_inf = (~ok).float()  # type: ignore[attr-defined]  # no host sync
            opt.step()
        elif bool(ok):
            opt.step()

    def _step(self, p: torch.Tensor) -> None:
        grad = p.grad
        assert grad is not None
        if self.stream is None:
            self._update(p)
        else:
            # On CUDA the update runs on a stream of its own, so the memory-bound AdamW of one layer
            # overlaps the backward GEMMs of the layers before it. The side stream first waits for
            # all work queued so far (this gradient, and the backward ops that read this weight),
            # and the gradient's memory is not reused before the side stream is done with it.
            # ``finish`` makes the main stream wait for the updates before the next forward.
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                self._update(p)
            grad.record_stream(self.stream)
        p.grad = None

    def finish(self) -> None:
        """After backward: the main stream waits for the updates (and the gradient norm)."""
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def attach_in_backward(optimizer: torch.optim.Optimizer, check_grads: bool = True) -> InBackward:
    """Hook a per-parameter copy of ``optimizer`` onto each of its parameters (see :class:`InBackward`)."""
    device = optimizer.param_groups[0]["params"][0].device
    ib = InBackward(
        main=optimizer,
        per_param={},
        poison=torch.zeros((), device=device),
        norm_sq=torch.zeros((), device=device),
        handles=[],
        check_grads=check_grads,
    )
    if device.type == "cuda" and OPTIMIZER_SIDE_STREAM:
        ib.stream = torch.cuda.Stream(device)
    parts = optimizer.parts if isinstance(optimizer, Combined) else [optimizer]
    for part in parts:
        for group in part.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            # The group's hyper-parameters (incl. ``fused``) drive the step; the constructor only
            # validates them (and takes ``fused`` only where the class has it: not Muon's).
            fused = {"fused": hyper["fused"]} if "fused" in hyper else {}
            for p in group["params"]:
                sub = type(part)([{**hyper, "params": [p]}], **fused)
                ib.per_param[p] = (sub, group)
                ib.handles.append(p.register_post_accumulate_grad_hook(ib._step))
    return ib


# DDP modules whose static graph has been recorded (their first synced iteration is done): from then
# on a micro-batch may skip the gradient sync. Weak: a module replaced by a fallback drops out.
_GRAPH_RECORDED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def mark_graph_recorded(model: nn.Module) -> None:
    """``model`` (a DDP module; anything else is ignored) has run one synced forward + backward."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        _GRAPH_RECORDED.add(model)


def _no_grad_sync(model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
    """Skip the gradient all-reduce on all but the last micro-batch (DDP and FSDP2)."""
    if last:
        return contextlib.nullcontext()
    if isinstance(model, nn.parallel.DistributedDataParallel):
        # DDP(static_graph=True) records the graph on its first iteration and asserts
        # ("expect_autograd_hooks_") if that iteration skips the sync: sync every micro-batch once.
        if model.static_graph and model not in _GRAPH_RECORDED:
            return contextlib.nullcontext()
        return model.no_sync()
    set_sync = getattr(model, "set_requires_gradient_sync", None)
    if set_sync is not None:  # FSDP2's FSDPModule
        # sharding.reshard_after_forward=false: the units also stay unsharded after this backward, so
        # each is gathered once from the step's first forward to its last backward (as torch's
        # PipelineStage does under pp; the plan counts one all-gather per unit and step).
        hold = getattr(model, "hold_for_step", False)

        @contextlib.contextmanager
        def fsdp_no_sync() -> Iterator[None]:
            set_sync(False)
            if hold:
                model.set_reshard_after_backward(False)  # type: ignore[operator]
            try:
                yield
            finally:
                set_sync(True)
                if hold:
                    model.set_reshard_after_backward(True)  # type: ignore[operator]

        return fsdp_no_sync()
    return contextlib.nullcontext()


def global_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip to ``max_norm`` (inf: measure only) and return the total norm as a plain tensor."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = total_grad_norm(params)
    if max_norm > 0:
        clip_grads(params, max_norm, norm)
    return norm


Batches = list[tuple[torch.Tensor, torch.Tensor]]
SeqShard = Callable[[torch.Tensor, torch.Tensor], contextlib.AbstractContextManager]


class StepFn(Protocol):
    """One optimizer step of a built model over this rank's micro-batches (``pick_step``)."""

    def __call__(
        self, micro_batches: Batches, io: HostIO | None = None, scales: list[float] | None = None
    ) -> StepResult: ...


def pick_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    grad_clip: float,
    device: torch.device,
    in_backward: InBackward | None = None,
    seq_shard: SeqShard | None = None,
) -> StepFn:
    """The step function of one build, picked once (the runner calls it at each build, never per
    step): the optimizer inside backward (``train.optimizer_in_backward``), the pipeline's schedule
    (``pp > 1``), or the plain step. Its parts are bound here; a step passes only its batch."""
    parts = StepParts(model, optimizer, scheduler, grad_clip, device)
    if in_backward is not None:
        return functools.partial(_step_in_backward, parts, in_backward)
    if is_pipeline(model):
        return functools.partial(pipeline_step, parts)
    return functools.partial(plain_step, parts, seq_shard=seq_shard)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    micro_batches: Batches,
    grad_clip: float,
    device: torch.device,
    in_backward: InBackward | None = None,
    io: HostIO | None = None,
    scales: list[float] | None = None,
    seq_shard: SeqShard | None = None,
) -> StepResult:
    """One step of ``pick_step``'s function, picked for this call: for callers that step a model
    they built themselves (tests, benchmarks); the runner picks once per build."""
    step = pick_step(model, optimizer, scheduler, grad_clip, device, in_backward, seq_shard)
    return step(micro_batches, io, scales)


def plain_step(
    parts: StepParts,
    micro_batches: Batches,
    io: HostIO | None = None,
    scales: list[float] | None = None,
    *,
    seq_shard: SeqShard | None = None,
) -> StepResult:
    """One optimiser step over this rank's micro-batches of one global batch.

    Each micro-batch loss is divided by the number of micro-batches, so the accumulated gradient is
    the mean over this rank's share; DDP/FSDP average over ranks, giving the global-batch mean.
    With masked targets (data=sft) ``scales`` gives each micro-batch's weight instead (the sampler's
    ``loss_scales``: its share of the global batch's trained targets times the data-parallel degree),
    so the loss is the mean over every trained target of the global batch.
    A non-finite loss or gradient norm skips the optimiser step (the caller decides what next).
    ``seq_shard`` (context parallelism, framework.parallel.context) cuts each micro-batch to this
    rank's sequence shard, in place, around its forward and backward.
    """
    model, optimizer, device = parts.model, parts.optimizer, parts.device
    timer = StepTimer(device)
    if device.type == "cuda":
        # CUDA graphs (executor=cudagraphs) replay per step: mark where a new step begins.
        torch.compiler.cudagraph_mark_step_begin()
    lrs = group_lrs(optimizer)  # this step's rates, before update() moves them
    n = len(micro_batches)
    total = torch.zeros((), device=device)
    take_aux(model)  # forwards before this step (DDP's bucket settling, a verifier's check) count not
    take_mtp(model)
    for i, (x, y) in enumerate(micro_batches):
        x, y = to_device(x, device, io), to_device(y, device, io)
        if seq_shard is not None:  # it cuts in place: never the host-transfer slots
            x, y = x.clone(), y.clone()
        shard = seq_shard(x, y) if seq_shard is not None else contextlib.nullcontext()
        with shard, _no_grad_sync(model, last=i == n - 1), loss_parallel_scope((model,)):
            with autocast(device):
                loss = model(x, y) / n if scales is None else model(x, y) * scales[i]
            loss.backward()
        total += loss.detach()
    mark_graph_recorded(model)
    norm = global_grad_norm(model, parts.grad_clip)
    finite = torch.isfinite(norm) & torch.isfinite(total)
    update(optimizer, parts.scheduler, finite)
    timer.stop()
    return step_result(total, norm, finite, lrs, timer, io, take_aux(model), take_mtp(model))


def _step_in_backward(
    parts: StepParts,
    ib: InBackward,
    micro_batches: Batches,
    io: HostIO | None = None,
    scales: list[float] | None = None,
) -> StepResult:
    """The step of ``train.optimizer_in_backward``: the updates happen during backward; a
    non-finite loss skips them. One micro-batch on one rank, no clip (the planner refuses the
    rest), so ``scales`` would be [1.0] and is not read."""
    # One micro-batch per step: the planner refuses anything else (framework.planner.plan._check_in_backward).
    assert len(micro_batches) == 1, len(micro_batches)
    model, device = parts.model, parts.device
    timer = StepTimer(device)
    if device.type == "cuda":
        torch.compiler.cudagraph_mark_step_begin()
    lrs = group_lrs(ib.main)  # this step's rates, before the scheduler moves them
    ((x, y),) = micro_batches
    x, y = to_device(x, device, io), to_device(y, device, io)
    ib.norm_sq.zero_()
    take_aux(model)  # forwards before this step count not
    take_mtp(model)
    with autocast(device):
        loss = model(x, y)
    total = loss.detach().float()
    ib.poison.copy_(torch.where(torch.isfinite(total), 0.0, float("nan")))
    loss.backward()
    ib.finish()
    norm = ib.norm_sq.sqrt()
    finite = torch.isfinite(norm) & torch.isfinite(total)
    # The per-parameter copies did this step's updates and dropped every gradient, so the main
    # optimiser's step() updates nothing; it runs so that the step the scheduler follows (and any
    # step hook) is the main optimiser's, in torch's order (the scheduler warns otherwise).
    ib.main.step()
    parts.scheduler.step()
    timer.stop()
    return step_result(total, norm, finite, lrs, timer, io, take_aux(model), take_mtp(model))


@torch.no_grad()
def evaluate(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device
) -> float:
    """The mean loss over every trained target of the validation set, whatever the layout.

    Each micro batch's mean loss is weighted by its number of trained targets (IGNORE_INDEX ones
    count for nothing) and the sums and counts are added over all ranks in one all-reduce, then
    divided. So the value is the same for one process, dp, tp and pp (up to float summation order):
    a mean of per-rank means weighed a rank's masked batch like a full one, and a pipeline's
    stages other than the last hold no loss (they add 0 to both)."""
    if is_pipeline(model):  # through the schedule
        total, count = pipeline_evaluate(model, batches, device)  # type: ignore[arg-type]
        return ratio_over_ranks(total, count)
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    for x, y in batches:
        with autocast(device), loss_parallel_scope((model,)):
            loss = model(x.to(device), y.to(device)).double()
        n = targets_counted(y)
        if n:  # a micro batch with no trained target has a NaN mean: it adds nothing
            total += loss * n
            count += n
    model.train(was_training)
    return ratio_over_ranks(total, count)
