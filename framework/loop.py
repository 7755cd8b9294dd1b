"""The training step: forward, backward with gradient accumulation, clip, optimiser step.

Kept free of logging, checkpointing and launching so it can be driven (and tested) on its own.
With ``train.optimizer_in_backward`` the optimiser step moves into the backward pass instead
(:class:`InBackward`): each parameter is updated as soon as its gradient is complete and the gradient
is freed, so the step never holds every gradient at once.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from framework.config import TrainConfig
from framework.model import compute_dtype


@dataclass
class StepResult:
    """One step's figures. On CUDA they stay on the device until read: reading ``loss``,
    ``grad_norm``, ``finite`` or ``seconds`` synchronises once, so a loop that only reads them on
    log steps never stalls the GPU queue in between. Reading ``loss`` is a collective (an
    all-reduce over ranks): every rank must read it at the same step."""

    loss_t: torch.Tensor  # this rank's mean loss; averaged over ranks when read
    grad_norm_t: torch.Tensor  # before clipping
    finite_t: torch.Tensor
    lr: float
    _timer: _StepTimer

    @property
    def loss(self) -> float:
        return _mean_over_ranks(self.loss_t)

    @property
    def grad_norm(self) -> float:
        return float(self.grad_norm_t)

    @property
    def finite(self) -> bool:
        return bool(self.finite_t)

    @property
    def seconds(self) -> float:
        return self._timer.seconds()


class _StepTimer:
    """Wall time of one step: CUDA events on the GPU (read lazily), perf_counter on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._value: float | None = None
        if self.cuda:
            self.start_ev = torch.cuda.Event(enable_timing=True)
            self.end_ev = torch.cuda.Event(enable_timing=True)
            self.start_ev.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self.end_ev.record()
        else:
            self._value = time.perf_counter() - self.t0

    def seconds(self) -> float:
        if self._value is None:
            self.end_ev.synchronize()
            self._value = self.start_ev.elapsed_time(self.end_ev) / 1e3
        return self._value


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    """Linear warmup to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at ``steps``."""

    def factor(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        span = max(1, cfg.steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine

    return factor


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; no weight decay on norms (1-D weights); fused kernel on CUDA."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device.type == "cuda")


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

    def _step(self, p: torch.Tensor) -> None:
        opt, group = self.per_param[p]
        opt.state = self.main.state  # the main optimiser's load_state_dict replaces its dict
        opt.param_groups[0]["lr"] = group["lr"]  # moved by the scheduler
        assert p.grad is not None
        g_norm = torch.linalg.vector_norm(p.grad, dtype=torch.float32)
        self.norm_sq += g_norm.square()
        ok = torch.isfinite(g_norm + self.poison)  # this gradient and the loss are finite
        if group.get("fused"):
            opt.found_inf = (~ok).float()  # type: ignore[attr-defined]  # no host sync
            opt.step()
        elif bool(ok):
            opt.step()
        p.grad = None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def attach_in_backward(optimizer: torch.optim.Optimizer) -> InBackward:
    """Hook a per-parameter copy of ``optimizer`` onto each of its parameters (see :class:`InBackward`)."""
    device = optimizer.param_groups[0]["params"][0].device
    ib = InBackward(
        main=optimizer,
        per_param={},
        poison=torch.zeros((), device=device),
        norm_sq=torch.zeros((), device=device),
        handles=[],
    )
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        for p in group["params"]:
            # The group's hyper-parameters (incl. ``fused``) drive the step; the constructor only
            # validates them.
            sub = type(optimizer)([{**hyper, "params": [p]}], fused=hyper.get("fused"))
            ib.per_param[p] = (sub, group)
            ib.handles.append(p.register_post_accumulate_grad_hook(ib._step))
    return ib


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA (fp32 master weights); plain fp32 on CPU (``model.compute_dtype``)."""
    dtype = compute_dtype(device)
    if dtype is not None:
        return torch.autocast(device.type, dtype=dtype)
    return contextlib.nullcontext()


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a CPU batch tensor to ``device`` without stalling the host on CUDA.

    Why: a copy from pageable memory synchronises the stream before it starts, so the host waits for
    the previous step to finish and the GPU then idles while the next step's first kernels are
    launched. From pinned memory the copy is queued like a kernel (the caching host allocator does
    not reuse the pinned block until the copy is done).
    """
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _no_grad_sync(model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
    """Skip the gradient all-reduce on all but the last micro-batch (DDP and FSDP2)."""
    if last:
        return contextlib.nullcontext()
    if isinstance(model, nn.parallel.DistributedDataParallel):
        # DDP(static_graph=True) records the graph on its first iteration and asserts
        # ("expect_autograd_hooks_") if that iteration skips the sync: sync every micro-batch once.
        if model.static_graph and not getattr(model, "_framework_graph_recorded", False):
            return contextlib.nullcontext()
        return model.no_sync()
    set_sync = getattr(model, "set_requires_gradient_sync", None)
    if set_sync is not None:  # FSDP2's FSDPModule

        @contextlib.contextmanager
        def fsdp_no_sync() -> Iterator[None]:
            set_sync(False)
            try:
                yield
            finally:
                set_sync(True)

        return fsdp_no_sync()
    return contextlib.nullcontext()


def _mean_over_ranks(value: torch.Tensor) -> float:
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value)  # gloo has no AVG: sum, then divide
        value /= dist.get_world_size()
    return float(value)


def global_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip to ``max_norm`` (inf: measure only) and return the total norm as a plain tensor."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"), foreach=True)
    full = getattr(norm, "full_tensor", None)  # a DTensor under FSDP2 / TP
    return full() if full is not None else norm


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    grad_clip: float,
    device: torch.device,
    in_backward: InBackward | None = None,
) -> StepResult:
    """One optimiser step over this rank's micro-batches of one global batch.

    Each micro-batch loss is divided by the number of micro-batches, so the accumulated gradient is
    the mean over this rank's share; DDP/FSDP average over ranks, giving the global-batch mean.
    A non-finite loss or gradient norm skips the optimiser step (the caller decides what next).
    With ``in_backward`` the step happens during backward (one micro-batch, no clip; a non-finite
    loss skips it).
    """
    if in_backward is not None:
        return _step_in_backward(model, in_backward, scheduler, micro_batches, device)
    timer = _StepTimer(device)
    if device.type == "cuda":
        # CUDA graphs (executor=cudagraphs) replay per step: mark where a new step begins.
        torch.compiler.cudagraph_mark_step_begin()
    lr = scheduler.get_last_lr()[0]
    n = len(micro_batches)
    total = torch.zeros((), device=device)
    for i, (x, y) in enumerate(micro_batches):
        x, y = to_device(x, device), to_device(y, device)
        with _no_grad_sync(model, last=i == n - 1):
            with autocast(device):
                loss = model(x, y) / n
            loss.backward()
        total += loss.detach()
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model._framework_graph_recorded = True
    norm = global_grad_norm(model, grad_clip)
    finite = torch.isfinite(norm) & torch.isfinite(total)
    if getattr(optimizer, "defaults", {}).get("fused"):
        # The fused AdamW kernel skips the update (and its step count) where found_inf is set:
        # no host synchronisation before the optimiser step.
        optimizer.found_inf = (~finite).float()
        optimizer.step()
    elif bool(finite):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    timer.stop()
    return StepResult(total, norm, finite, lr, timer)


def _step_in_backward(
    model: nn.Module,
    ib: InBackward,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
) -> StepResult:
    if len(micro_batches) != 1:
        raise ValueError(
            f"train.optimizer_in_backward steps each parameter during backward, so it takes one "
            f"micro-batch per step, got {len(micro_batches)}: set train.micro_batch_size to the "
            f"rank's whole batch"
        )
    timer = _StepTimer(device)
    if device.type == "cuda":
        torch.compiler.cudagraph_mark_step_begin()
    lr = scheduler.get_last_lr()[0]
    ((x, y),) = micro_batches
    x, y = to_device(x, device), to_device(y, device)
    ib.norm_sq.zero_()
    with autocast(device):
        loss = model(x, y)
    total = loss.detach().float()
    ib.poison.copy_(torch.where(torch.isfinite(total), 0.0, float("nan")))
    loss.backward()
    norm = ib.norm_sq.sqrt()
    finite = torch.isfinite(norm) & torch.isfinite(total)
    with warnings.catch_warnings():
        # The main optimiser's own step() never runs (its per-parameter copies step), which the
        # scheduler takes for a call order mistake.
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
        scheduler.step()
    timer.stop()
    return StepResult(total, norm, finite, lr, timer)


@torch.no_grad()
def evaluate(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device
) -> float:
    """Mean loss over this rank's validation batches, averaged over ranks."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=device)
    for x, y in batches:
        with autocast(device):
            total += model(x.to(device), y.to(device)).float()
    model.train(was_training)
    return _mean_over_ranks(total / max(1, len(batches)))
