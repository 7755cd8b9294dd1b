"""Running a pipeline's schedule (framework.parallel.pipeline builds it): the training step, the
forward-only passes of evaluation and the verifier's logits, and the whole model's state on rank 0.

Per-micro-batch inputs: every stage gets the schedule's keyword arguments, cut into micro batches
like the tokens: the rows' document ids (``data.document_mask``: a later stage sees hidden states,
not the tokens the mask is built from). The loss of masked targets (data=sft) is token-weighted:
each micro batch's summed loss over its trained targets, times the step's weight (see
``PipelineLoss``), which the sampler's ``loss_scales`` give.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.pipelining import ScheduleZBVZeroBubble
from torch.distributed.pipelining.schedules import _ComputationType, _PipelineSchedule
from torch.distributed.tensor import DTensor

from framework.models import take_aux
from framework.models.parts.loss import loss_parallel_scope
from framework.models.parts.masks import document_ids
from framework.parallel.pipeline import PipelineModel, is_pipeline, logit_modules
from framework.parallel.step import (
    HostIO,
    StepParts,
    StepResult,
    StepTimer,
    autocast,
    clip_grads,
    group_lrs,
    step_result,
    targets_counted,
    to_device,
    total_grad_norm,
    update,
)


def _stage_args(model: PipelineModel, x: torch.Tensor, y: torch.Tensor) -> tuple[tuple, dict]:
    """The schedule's inputs on this rank: tokens where it holds the first stage, targets always
    (the schedule reads them on the last stage only), and with document masking the rows' document
    ids, which every stage receives (cut into micro batches as the tokens are)."""
    kwargs: dict[str, torch.Tensor] = {"target": y}
    if model.document_eos is not None:
        kwargs["documents"] = document_ids(x, model.document_eos)
    return ((x,) if model.has_first else ()), kwargs


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
    params = [p for p in model.parameters() if p.grad is not None]  # a tied copy's is dropped by now
    norm = total_grad_norm(params)
    norm = _pp_sum(norm.float().square(), model).sqrt()
    if max_norm > 0:
        clip_grads(params, max_norm, norm)
    return norm


def pipeline_step(
    parts: StepParts,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    io: HostIO | None = None,
    scales: list[float] | None = None,
) -> StepResult:
    """``framework.train.loop.plain_step`` under pipeline parallelism: the schedule runs forward and
    backward over the rank's batch (its micro batches, concatenated and cut again by the schedule);
    the loss (last stage) and the gradient norm (all stages) are made whole on every rank; then
    clip and optimiser step as without pipelining (a non-finite loss or norm skips the step).
    ``scales`` (masked targets): each micro batch's weight, as ``train_step`` takes them; their sum
    over the rank's trained targets is the step's weight of each trained target (``PipelineLoss``).
    A tied weight's two uses are summed before the norm and its copy updated after the step."""
    model, optimizer, device = parts.model, parts.optimizer, parts.device
    assert is_pipeline(model)
    assert model.schedule is not None
    timer = StepTimer(device)
    lrs = group_lrs(optimizer)  # this step's rates, before update() moves them
    x = to_device(torch.cat([b[0] for b in micro_batches]), device, io)
    y = to_device(torch.cat([b[1] for b in micro_batches]), device, io)
    args, kwargs = _stage_args(model, x, y)
    model.loss.weight = None if scales is None else sum(scales) / max(1, int((y >= 0).sum()))
    losses: list[torch.Tensor] = []
    for stage in model.stages:
        take_aux(stage)  # forwards before this step count not
    with autocast(device), loss_parallel_scope(logit_modules(model)):
        model.schedule.step(*args, **kwargs, losses=losses, return_outputs=False)
    model.loss.weight = None
    mine = torch.stack([t.detach().float() for t in losses]).mean() if model.has_last else None
    total, aux = _step_loss(model, mine if mine is not None else torch.zeros((), device=device))
    if model.tied is not None:
        model.tied.reduce_grads()
    norm = pipeline_norm(model, parts.grad_clip)
    finite = torch.isfinite(norm) & torch.isfinite(total)
    update(optimizer, parts.scheduler, finite)
    if model.tied is not None:
        model.tied.broadcast()
    timer.stop()
    return step_result(total, norm, finite, lrs, timer, io, aux)


def _step_loss(model: PipelineModel, mine: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the step's loss, its load-balancing term before the coefficient, or None when off), on every
    rank: the last stage's cross-entropy (``mine``, 0 on the other ranks) plus the coefficient times
    the term, whose stages' shares (each the mean over its micro batches, ``take_aux``) are summed
    over the pp axis with the loss in one all-reduce. One process's loss is the mean over micro
    batches of cross-entropy plus that term: the same."""
    coef = model.stages[0].router_aux_loss_coef
    if coef is None:
        return _pp_sum(mine, model), None
    # The step's micro batches' forwards only: the first step's shape probe keeps none (``Stage``)
    shares = [a for a in (take_aux(s) for s in model.stages) if a is not None]
    share = torch.stack(shares).sum() if shares else torch.zeros_like(mine)
    total, aux = _pp_sum(torch.stack([mine + coef * share.float(), share.float()]), model)
    return total, aux


# The actions a forward-only pass keeps (``_forward_only``).
_FORWARD_ACTIONS = {
    _ComputationType.FORWARD,
    _ComputationType.SEND_F,
    _ComputationType.RECV_F,
    _ComputationType.UNSHARD,
    _ComputationType.RESHARD,
}


@contextlib.contextmanager
def _forward_only(schedule: _PipelineSchedule) -> Iterator[None]:
    """ZB-V's ``eval`` runs in torch 2.13 its whole training order, backward actions included; where
    two neighbouring stages sit on one rank (the V's turn) the backward hand-off between them then
    fails ("can't steal_bwd_input if this stage doesn't have backward"). Its order is cut to the
    forward actions for the pass (their own order is the schedule's, deadlock-free without the
    backward ones); other schedules skip their backward actions in eval themselves."""
    order = getattr(schedule, "pipeline_order_with_comms", None)
    if not isinstance(schedule, ScheduleZBVZeroBubble) or order is None:
        yield
        return
    schedule.pipeline_order_with_comms = {
        rank: [a for a in actions if a.computation_type in _FORWARD_ACTIONS]
        for rank, actions in order.items()
    }
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = order


@torch.no_grad()
def pipeline_full_state(model: PipelineModel) -> dict[str, torch.Tensor]:
    """The whole model's full, unsharded state on CPU, on rank 0 (``{}`` on the others), under the
    single-process names (a tied model's ``output.weight`` included, as one process's state dict
    has it). Collective: call it on every rank.

    Each rank makes its own stages' tensors whole one at a time (a collective over the data / tensor
    axes, so every rank of the stage takes part), and the ranks of rank 0's pipeline keep them on
    CPU; rank 0 gathers them over its pipeline (one pickled object per pp rank). Rank 0 holds the
    whole model in host memory, as the export without pipelining does."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    keep = 0 in dist.get_process_group_ranks(model.pp_group)  # this rank is in rank 0's pipeline
    mine: dict[str, torch.Tensor] = {}
    for name, t in get_model_state_dict(model).items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if keep:
            mine[name] = full.detach().to("cpu", copy=True)
    if not keep:
        return {}
    parts: list[dict[str, torch.Tensor]] | None = [{} for _ in range(dist.get_world_size(model.pp_group))]
    parts = parts if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0, group=model.pp_group)
    return {k: v for part in parts for k, v in part.items()} if parts is not None else {}


@torch.no_grad()
def pipeline_evaluate(
    model: PipelineModel, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's validation loss sum and trained-target count (float64; both 0 off the last stage),
    through the schedule's forward-only ``eval``: each micro batch's mean loss times its number of
    trained targets, as ``framework.train.loop.evaluate`` adds them without a pipeline.

    The schedule takes exactly its number of micro batches of the training shape (its buffers
    between stages are sized on the first step), so the batches go in groups of that many; the last
    group is filled up by repeating its batches, whose losses are then left out.
    """
    assert model.schedule is not None
    n = model.schedule._n_microbatches
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    for start in range(0, len(batches), n):
        group = batches[start : start + n]
        real = len(group)
        group = group + [group[i % real] for i in range(n - real)]
        x = torch.cat([b[0] for b in group]).to(device)
        y = torch.cat([b[1] for b in group]).to(device)
        losses, _ = _eval(model, x, y, device)
        if not model.has_last:  # the losses live on the last stage
            continue
        for loss, (_, targets) in zip(losses[:real], group[:real], strict=True):
            counted = targets_counted(targets)
            if counted:  # no trained target: a NaN mean that adds nothing
                total += loss.double() * counted
                count += counted
    return total, count


def _eval(
    model: PipelineModel, x: torch.Tensor, y: torch.Tensor, device: torch.device
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """One forward-only pass of the schedule over a batch of its micro batches: the micro batches'
    losses and the merged logits, both on the rank of the last stage (else [] and None)."""
    assert model.schedule is not None
    args, kwargs = _stage_args(model, x.to(device), y.to(device))
    losses: list[torch.Tensor] = []
    with autocast(device), _forward_only(model.schedule), loss_parallel_scope(logit_modules(model)):
        out = model.schedule.eval(*args, **kwargs, losses=losses)
    return losses, out if model.has_last else None


@torch.no_grad()
def pipeline_logits(
    model: PipelineModel, x: torch.Tensor, y: torch.Tensor, device: torch.device
) -> torch.Tensor | None:
    """The logits of one micro batch (the verifier's numerics check), on the rank of the last stage
    (None elsewhere): the schedule runs the micro batch as each of its micro batches."""
    assert model.schedule is not None
    n = model.schedule._n_microbatches
    _, out = _eval(model, x.repeat(n, 1), y.repeat(n, 1), device)
    if isinstance(out, DTensor):  # loss parallelism: the last stage's vocabulary shards, gathered
        out = out.full_tensor()
    return None if out is None else out[: x.shape[0]]
