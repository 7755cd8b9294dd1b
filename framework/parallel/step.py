"""The pieces of one training step that the plain step (framework.train.loop) and the pipelined step
(framework.parallel.pipeline) share: host buffers, the step's result and timer, autocast, the loss and
the optimiser update. They sit below both, so that neither imports the other's privates."""

from __future__ import annotations

import collections
import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from framework.kernels.fused_ce import IGNORE_INDEX
from framework.models import compute_dtype


class HostIO:
    """Pinned host buffers for each step's batch (in) and figures (out), reused in a ring.

    Why: a copy from pageable host memory synchronises the stream before it starts, and reading a
    device value (``float(t)``) waits for everything queued, including the next step. Through
    pinned buffers both copies are queued like kernels and a step's figures are read by waiting on
    that step's own event, so the host can queue step k+1 before it reads step k (the trainer does,
    see ``runner.StepRunner.defer``): the GPU never idles between steps. Preallocated and reused:
    allocating pinned memory every step (``Tensor.pin_memory()``) costs more than pageable copies
    (benchmarks/PERF.md, "Where the code's constants and choices come from"). On the CPU it does
    nothing.

    A buffer is reused at the earliest ``slots`` uses later, once its previous copy is done; a
    :class:`StepResult` must therefore be read within ``slots`` steps (the trainer reads each one
    within one step).
    """

    def __init__(self, device: torch.device, slots: int = 4, max_slots: int = 64) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.slots = slots
        self.max_slots = max_slots
        # (direction, shape, dtype) -> [buffer, event of its last copy], oldest use first
        self._rings: dict[tuple, collections.deque[list]] = {}

    def _slot(self, key: tuple) -> list:
        """The least recently used buffer for ``key``, or a new one while there are fewer than
        ``slots``, or while the oldest is still being copied (many micro-batches per step: growing
        the ring beats waiting for the previous step); past ``max_slots``, wait for the oldest."""
        ring = self._rings.setdefault(key, collections.deque())
        oldest = ring[0] if ring else None
        busy = oldest is not None and oldest[1] is not None and not oldest[1].query()
        if len(ring) < self.slots or (busy and len(ring) < self.max_slots):
            slot = [torch.empty(key[1], dtype=key[2], pin_memory=True), None]
        else:
            slot = ring.popleft()
            if slot[1] is not None:
                slot[1].synchronize()  # the copy that last used this buffer is done
        ring.append(slot)
        return slot

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        if not self.cuda:
            return t.to(self.device)
        slot = self._slot(("in", tuple(t.shape), t.dtype))
        slot[0].copy_(t)
        out = slot[0].to(self.device, non_blocking=True)
        slot[1] = torch.cuda.Event()
        slot[1].record()
        return out

    def to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """An asynchronous copy of ``t`` and the event that marks it done (None: already done)."""
        if not self.cuda:
            return t, None
        slot = self._slot(("out", tuple(t.shape), t.dtype))
        slot[0].copy_(t, non_blocking=True)
        slot[1] = torch.cuda.Event()
        slot[1].record()
        return slot[0], slot[1]


@dataclass(frozen=True)
class StepParts:
    """What a build's step function binds once (framework.train.loop.pick_step): the model, its
    optimizer and scheduler, the gradient clip (0: measure only) and the device. They travel
    together from the build to every step, which then takes only its batch."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    grad_clip: float
    device: torch.device


@dataclass
class StepResult:
    """One step's figures. On CUDA they are copied to the host asynchronously: reading ``loss``,
    ``grad_norm``, ``finite`` or ``seconds`` waits for this step's own copy (not for steps queued
    after it), once. Reading ``loss`` is a collective (an all-reduce over ranks, of a host value):
    every rank must read it at the same step."""

    loss_t: torch.Tensor  # this rank's mean loss (device); averaged over ranks when read
    grad_norm_t: torch.Tensor  # before clipping
    finite_t: torch.Tensor
    # The learning rate of each optimizer param group, as this step's update used it (the scheduler
    # moves them to the next step's right after the update: read them here, not from the scheduler).
    lrs: tuple[float, ...]
    _timer: StepTimer
    # An MoE model's load-balancing term as the loss added it, before its coefficient: the mean over
    # the step's micro batches, of the whole model (framework.models.take_aux; a pipeline's summed
    # over its stages). The same on every rank (its counts span the data-parallel ranks): read here.
    aux_t: torch.Tensor | None = None
    # DeepSeek-V3's multi-token prediction cross-entropy as the loss added it, before its weight: the
    # mean over the step's micro batches (framework.models.take_mtp), this rank's (``mtp`` averages
    # it over the ranks).
    mtp_t: torch.Tensor | None = None
    _host: torch.Tensor | None = None  # [loss, grad norm, finite], filled by _ready
    _ready: torch.cuda.Event | None = None
    _values: list[float] | None = None

    def _fetch(self) -> list[float]:
        if self._values is None:
            if self._host is not None:
                if self._ready is not None:
                    self._ready.synchronize()
                self._values = [float(v) for v in self._host.tolist()]
            else:
                figures = [self.loss_t, self.grad_norm_t, self.finite_t]
                extra = [t for t in (self.aux_t, self.mtp_t) if t is not None]
                self._values = [float(t) for t in figures + extra]
        return self._values

    @property
    def loss(self) -> float:
        return mean_over_ranks(torch.tensor(self._fetch()[0], dtype=torch.float64))

    @property
    def lr(self) -> float:
        """The first param group's rate (the logged ``lr``; every group's: ``lrs``)."""
        return self.lrs[0]

    @property
    def grad_norm(self) -> float:
        return self._fetch()[1]

    @property
    def finite(self) -> bool:
        return bool(self._fetch()[2])

    @property
    def aux(self) -> float | None:
        """``aux_t`` on the host (no collective), or None without the load-balancing term."""
        values = self._fetch()
        return values[3] if self.aux_t is not None else None

    @property
    def mtp(self) -> float | None:
        """``mtp_t`` averaged over the ranks (a collective, as ``loss``: every rank reads it at the same
        steps), or None without multi-token prediction."""
        if self.mtp_t is None:
            return None
        value = self._fetch()[3 + (self.aux_t is not None)]
        return mean_over_ranks(torch.tensor(value, dtype=torch.float64))

    @property
    def seconds(self) -> float:
        return self._timer.seconds()


def step_result(
    total: torch.Tensor,
    norm: torch.Tensor,
    finite: torch.Tensor,
    lrs: list[float],
    timer: StepTimer,
    io: HostIO | None,
    aux: torch.Tensor | None = None,
    mtp: torch.Tensor | None = None,
) -> StepResult:
    """A step's figures; ``lrs``: ``group_lrs`` read before the update (the rates it ran with)."""
    result = StepResult(total, norm, finite, tuple(float(v) for v in lrs), timer, aux, mtp)
    if io is not None and io.cuda:
        figures = [total, norm, finite] + [t for t in (aux, mtp) if t is not None]
        packed = torch.stack([t.float() for t in figures])
        result._host, result._ready = io.to_host(packed)
    return result


def group_lrs(optimizer: torch.optim.Optimizer) -> list[float]:
    """Each param group's learning rate now: read before ``update``, the rates the step runs with.

    Why the groups and not ``scheduler.get_last_lr()``: they are what the optimizer reads, also
    when a callback's ``before_step`` set one (framework.train.callbacks); the scheduler then
    writes the next step's over them."""
    return [float(g["lr"]) for g in optimizer.param_groups]


class StepTimer:
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


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA (fp32 master weights); plain fp32 on CPU (``model.compute_dtype``)."""
    dtype = compute_dtype(device)
    if dtype is not None:
        return torch.autocast(device.type, dtype=dtype)
    return contextlib.nullcontext()


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def to_device(t: torch.Tensor, device: torch.device, io: HostIO | None) -> torch.Tensor:
    return io.to_device(t) if io is not None else t.to(device, non_blocking=True)


def update(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler, finite: torch.Tensor
) -> None:
    """The optimiser and schedule step after backward; a non-finite loss or norm (``finite`` False)
    updates nothing. Shared by every training step (plain and pipelined)."""
    if getattr(optimizer, "defaults", {}).get("fused"):
        # The fused AdamW kernel skips the update (and its step count) where found_inf is set:
        # no host synchronisation before the optimiser step.
        optimizer.found_inf = (~finite).float()
        optimizer.step()
    elif bool(finite):
        optimizer.step()
    else:
        # Skip the update through the optimiser itself, as the fused kernel's found_inf does: with
        # every gradient dropped, AdamW's step() updates nothing (no parameter, no state, no step
        # count). The scheduler then follows a step() call, as torch expects (it warns otherwise).
        optimizer.zero_grad(set_to_none=True)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()


def mean_over_ranks(value: torch.Tensor) -> float:
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value)  # gloo has no AVG: sum, then divide
        value /= dist.get_world_size()
    return float(value)


def targets_counted(y: torch.Tensor) -> int:
    """The targets a mean cross-entropy averages over (F.cross_entropy skips IGNORE_INDEX ones)."""
    return int((y != IGNORE_INDEX).sum())


def ratio_over_ranks(total: torch.Tensor, count: torch.Tensor) -> float:
    """sum(total) / sum(count) over every rank, in one all-reduce (float64: sums over thousands of
    micro batches keep their digits); NaN when no rank counted anything."""
    both = torch.stack([total.double(), count.double()])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(both)
    return float(both[0] / both[1]) if float(both[1]) > 0 else float("nan")


def total_grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of the parameters' gradients as a plain tensor (a DTensor norm made whole over its
    mesh). Grouped by device mesh: torch's ``get_total_norm`` stacks the per-tensor norms, which
    DTensors of different meshes refuse, and expert parallelism puts the experts on a mesh of their
    own (framework.parallel.expert); with one mesh it is ``get_total_norm`` itself, bit for bit."""
    norms = []
    for group in _by_mesh(params).values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        full = getattr(norm, "full_tensor", None)  # a DTensor under FSDP2 / TP / EP
        norms.append(full() if full is not None else norm)
    if len(norms) == 1:
        return norms[0]
    return torch.stack([n.float() for n in norms]).square().sum().sqrt()


def clip_grads(params: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients by ``max_norm / norm`` where above 1 (``clip_grads_with_norm_``), one
    call per device mesh: its foreach multiply refuses DTensors of two meshes in one list."""
    for group in _by_mesh(params).values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)


def _by_mesh(params: list[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    """The parameters grouped by their gradient's DTensor mesh (None: plain tensors), in order."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    return groups
