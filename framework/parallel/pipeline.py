"""Pipeline parallelism: cut the meta-built model into stages and run them with torch's schedules.

As torchtitan does it: each stage is a copy of the whole meta-device model with the blocks of other
stages deleted, and the embedding (all but the first stage) or the final norm and output projection
(all but the last) set to None; ``Llama.forward`` passes hidden states through a stage without
them. Parameter names stay those of the single-process model (``layers.5.attention.wq.weight``),
so the per-name initialisation gives every layout the single-process weights and DCP checkpoints
load across pp degrees. The plan says which blocks each stage holds (``Plan.pp_split``, by the
per-layer cost model) and which stages each pp rank holds (``framework.stages.stage_ids``).

One rank may hold several stages (interleaved schedules); ``PipelineModel`` shows them to the rest
of the trainer as one module under the single-process names (the optimizer, gradient clipping and
DCP read it), while the schedule runs the stages themselves.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import _PipelineSchedule

from framework.config import PPSchedule
from framework.loop import HostIO, StepResult, _result, _StepTimer, _to_device, autocast, update
from framework.model import Llama

SCHEDULES: dict[PPSchedule, type[_PipelineSchedule]] = {
    PPSchedule["gpipe"]: ScheduleGPipe,
    PPSchedule["1f1b"]: Schedule1F1B,
    PPSchedule["interleaved_1f1b"]: ScheduleInterleaved1F1B,
    PPSchedule["interleaved_zb"]: ScheduleInterleavedZeroBubble,
    PPSchedule["zbv"]: ScheduleZBVZeroBubble,
}


def cut_stage(model: Llama, layers: range, first: bool, last: bool) -> Llama:
    """A copy of the meta-device ``model`` that keeps only ``layers`` (and the embedding if
    ``first``, the final norm and output projection if ``last``). Copying on meta costs no memory."""
    stage = copy.deepcopy(model)
    for key in list(stage.layers.keys()):
        if int(key) not in layers:
            del stage.layers[key]
    if not first:
        stage.tok_embeddings = None
    if not last:
        stage.norm = None
        stage.output = None
    return stage


class PipelineModel(nn.Module):
    """This rank's pipeline stages as one module with the single-process parameter names.

    The stages' submodules are registered here again (shared, not copied), so ``parameters()``,
    ``named_parameters()`` and ``state_dict()`` are the union of the stages' own, under the names of
    the whole model. Calling it is an error: the schedule (``step``) runs the stages.
    """

    def __init__(self, stages: list[Llama], stage_ids: list[int], num_stages: int) -> None:
        super().__init__()
        self.cfg = stages[0].cfg
        self.stage_ids = stage_ids
        self.num_stages = num_stages
        self._stages = stages  # a plain list: the stages' modules are registered below, once
        for s in stages:
            if s.tok_embeddings is not None:
                self.tok_embeddings = s.tok_embeddings
        layers = {k: v for s in stages for k, v in s.layers.items()}
        self.layers = nn.ModuleDict({k: layers[k] for k in sorted(layers, key=int)})
        for s in stages:
            if s.output is not None:
                self.norm, self.output = s.norm, s.output
        self.schedule: _PipelineSchedule | None = None
        self.pp_group: dist.ProcessGroup | None = None

    @property
    def stages(self) -> list[Llama]:
        return self._stages

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("a pipeline-parallel model runs through its schedule (framework.loop), not a call")


def build_schedule(
    model: PipelineModel,
    pp_mesh: DeviceMesh,
    schedule: PPSchedule,
    num_microbatches: int,
    device: torch.device,
    loss_fn: object,
) -> None:
    """Wrap each stage in a ``PipelineStage`` over the pp axis and make the schedule (in place).

    Shapes between stages are inferred on the first step (torch's dynamic mode). The loss function
    runs on the last stage per micro batch; gradients are scaled by the number of micro batches
    (``scale_grads``), so they are the mean over the rank's batch, as without pipelining.
    """
    group = pp_mesh.get_group()
    stages = [
        PipelineStage(s, i, model.num_stages, device, group=group)
        for s, i in zip(model.stages, model.stage_ids, strict=True)
    ]
    cls = SCHEDULES[schedule]
    if len(stages) == 1 and cls in (ScheduleGPipe, Schedule1F1B):
        model.schedule = cls(stages[0], n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=True)
    else:
        model.schedule = cls(stages, n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=True)
    model.pp_group = group


def _stage_args(model: PipelineModel, x: torch.Tensor, y: torch.Tensor) -> tuple[tuple, dict]:
    """The schedule's inputs on this rank: tokens where it holds the first stage, targets always
    (the schedule reads them on the last stage only)."""
    return ((x,) if model.has_first else ()), {"target": y}


def _pp_sum(t: torch.Tensor, model: PipelineModel) -> torch.Tensor:
    """Sum over the pp axis: the loss lives on the last stage and each rank's squared gradient norm
    on its own stages; after this every rank of the pipeline holds the whole value."""
    t = t.clone()
    dist.all_reduce(t, group=model.pp_group)
    return t


def pipeline_norm(model: PipelineModel, max_norm: float) -> torch.Tensor:
    """The gradient norm over all stages (clipped to ``max_norm`` when > 0), on every rank.

    Each rank measures its own stages' gradients (a DTensor norm under FSDP / TP, made whole over
    those axes), the squares are summed over the pp axis, and every rank scales its own gradients by
    the same factor ``clip_grad_norm_`` would use on one process.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
    full = getattr(norm, "full_tensor", None)
    norm = full() if full is not None else norm
    norm = _pp_sum(norm.float().square(), model).sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm


def pipeline_step(
    model: PipelineModel,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    grad_clip: float,
    device: torch.device,
    io: HostIO | None = None,
) -> StepResult:
    """``framework.loop.train_step`` under pipeline parallelism: the schedule runs forward and
    backward over the rank's batch (its micro batches, concatenated and cut again by the schedule);
    the loss (last stage) and the gradient norm (all stages) are made whole on every rank; then
    clip and optimiser step as without pipelining (a non-finite loss or norm skips the step)."""
    assert model.schedule is not None
    timer = _StepTimer(device)
    lr = scheduler.get_last_lr()[0]
    x = _to_device(torch.cat([b[0] for b in micro_batches]), device, io)
    y = _to_device(torch.cat([b[1] for b in micro_batches]), device, io)
    args, kwargs = _stage_args(model, x, y)
    losses: list[torch.Tensor] = []
    with autocast(device):
        model.schedule.step(*args, **kwargs, losses=losses, return_outputs=False)
    mine = torch.stack([t.detach().float() for t in losses]).mean() if model.has_last else None
    total = _pp_sum(mine if mine is not None else torch.zeros((), device=device), model)
    norm = pipeline_norm(model, grad_clip)
    finite = torch.isfinite(norm) & torch.isfinite(total)
    update(optimizer, scheduler, finite)
    timer.stop()
    return _result(total, norm, finite, lr, timer, io)


@torch.no_grad()
def pipeline_evaluate(
    model: PipelineModel, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device
) -> torch.Tensor:
    """Mean loss over this rank's validation batches, through the schedule's forward-only ``eval``.

    The schedule takes exactly its number of micro batches of the training shape (its buffers
    between stages are sized on the first step), so the batches go in groups of that many; the last
    group is filled up by repeating its batches, whose losses are then left out.
    """
    assert model.schedule is not None
    n = model.schedule._n_microbatches
    kept: list[torch.Tensor] = []
    for start in range(0, len(batches), n):
        group = batches[start : start + n]
        real = len(group)
        group = group + [group[i % real] for i in range(n - real)]
        x = torch.cat([b[0] for b in group]).to(device)
        y = torch.cat([b[1] for b in group]).to(device)
        args, kwargs = _stage_args(model, x, y)
        losses: list[torch.Tensor] = []
        with autocast(device):
            model.schedule.eval(*args, **kwargs, losses=losses)
        kept += [t.float() for t in losses[:real]]
    mine = torch.stack(kept).mean() if model.has_last and kept else torch.zeros((), device=device)
    return _pp_sum(mine, model)
