"""Pipeline parallelism: cut the meta-built model into stages and run them with torch's schedules.

As torchtitan does it: each stage is a copy of the whole meta-device model with the blocks of other
stages deleted, and the embedding (all but the first stage) or the final norm and output projection
(all but the last) set to None; ``Decoder.forward`` passes hidden states through a stage without
them. Parameter names stay those of the single-process model (``layers.5.attention.wq.weight``),
so the per-name initialisation gives every layout the single-process weights and DCP checkpoints
load across pp degrees. The plan says which blocks each stage holds (``Plan.pp_split``, by the
per-layer cost model) and which stages each pp rank holds (``framework.planner.stages.stage_ids``).

One rank may hold several stages (interleaved schedules); ``PipelineModel`` shows them to the rest
of the trainer as one module under the single-process names (the optimizer, gradient clipping and
DCP read it), while the schedule runs the stages themselves.

Tied embeddings (``model.tie_embeddings``), as Megatron-LM's embedding group does it: the first
stage holds the embedding, the last stage a copy of the same weight as its output projection, drawn
from the embedding's name (so both start equal). After backward the copy's gradient is added into
the embedding's over a process group of the two ranks ({first, last stage} of each pipeline, one per
data / tensor coordinate; none when one rank holds both, as zbv's V does), the embedding alone is
clipped and stepped (one set of AdamW moments), and its new value is sent back to the copy. The
copy is no parameter of the optimizer and its gradient does not enter the norm; checkpoints hold
the tied weight once, as ``tok_embeddings.weight``, at any pp degree (framework.checkpoint.state's
``to_dcp``: the copy is offered and read under that name), so they load across pp degrees. Cost per step: the tied weight's local shard once
each way between the two ranks.

The schedule is built here (``build_schedule``) and run by framework.parallel.pipeline_run (the
step, evaluation, the verifier's logits, the whole state).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TypeGuard

import torch
import torch.distributed as dist
import torch.nn.functional as F
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
from torch.distributed.tensor import DTensor

from framework.config.schema import PPSchedule
from framework.models import Decoder, routing_unchanged
from framework.models.parts.loss import vocab_parallel_cross_entropy

SCHEDULES: dict[PPSchedule, type[_PipelineSchedule]] = {
    PPSchedule["gpipe"]: ScheduleGPipe,
    PPSchedule["1f1b"]: Schedule1F1B,
    PPSchedule["interleaved_1f1b"]: ScheduleInterleaved1F1B,
    PPSchedule["interleaved_zb"]: ScheduleInterleavedZeroBubble,
    PPSchedule["zbv"]: ScheduleZBVZeroBubble,
}


def cut_stage(model: Decoder, layers: range, first: bool, last: bool) -> Decoder:
    """A copy of the meta-device ``model`` that keeps only ``layers`` (and the embedding if
    ``first``, the final norm and output projection if ``last``). Copying on meta costs no memory.

    An MoE model's load-balancing term goes into backward through each stage's output (``Decoder``'s
    ``inject_aux``, Megatron's way): the stage's layers' share of the per-layer loss, whatever
    ``model.moe.aux_loss_scope`` says. transformers' ``global`` loss couples every layer's routers,
    which the stages hold apart; the launcher has already taken ``layer`` for it, with one line
    (framework.launch.prelaunch.aux_scope_under_pipeline), and so does a pipeline built from code."""
    stage = copy.deepcopy(model)
    stage.inject_aux = stage.aux_per_layer = True
    # Under loss parallelism the last stage hands its vocabulary-sharded logits to the schedule's
    # loss (``PipelineLoss``), not gathered ones.
    stage.gather_logits = False
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

    def __init__(self, stages: list[Decoder], stage_ids: list[int], num_stages: int) -> None:
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
        self.document_eos = stages[0].document_eos
        self.schedule: _PipelineSchedule | None = None
        self.pp_group: dist.ProcessGroup | None = None
        # The stages' data-parallel ranks (framework.models.token_group_of): the wrapper registers
        # their layers, not the stages, so no Decoder among its modules carries it.
        self.token_group = stages[0].token_group
        self.loss = PipelineLoss()
        self.tied: TiedWeight | None = None

    @property
    def tied_copies(self) -> list[nn.Parameter]:
        """Parameters the optimizer leaves out: the last stage's copy of a tied weight (stepped
        through the embedding it copies, see ``TiedWeight``)."""
        return [self.tied.copy] if self.tied is not None and self.tied.copy is not None else []

    @property
    def stages(self) -> list[Decoder]:
        return self._stages

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError(
            "a pipeline-parallel model runs through its schedule (framework.train.loop), not a call"
        )


def is_pipeline(model: nn.Module) -> TypeGuard[PipelineModel]:
    """Whether ``model`` is the wrapper ``parallelize`` returns for ``pp > 1``: the one place that
    tells a pipeline from a plain model (everything else asks here, or the helpers below)."""
    return isinstance(model, PipelineModel)


def pipeline_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The ranks of ``model``'s pipeline (each holds its own stages); None without a pipeline."""
    return model.pp_group if is_pipeline(model) else None


def called_modules(model: nn.Module) -> list[nn.Module]:
    """The modules a step calls: a pipeline's stages (its schedule never calls the wrapper), else
    the model itself. Hooks that must fire in a step go on these."""
    return list(model.stages) if is_pipeline(model) else [model]


def logit_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose output is the logits: a pipeline's last stage where this rank holds it
    (none on the other pp ranks), else the model itself."""
    if is_pipeline(model):
        return [s for s in model.stages if s.output is not None]
    return [model]


def tied_copies(model: nn.Module) -> list[nn.Parameter]:
    """Parameters the optimizer leaves out: a pipeline's copy of a tied weight (``TiedWeight``)."""
    return model.tied_copies if is_pipeline(model) else []


class PipelineLoss:
    """The schedule's loss on the last stage, per micro batch: the mean cross-entropy of its targets;
    or, with a step ``weight`` (masked targets, data=sft), the sum over its trained targets times
    that weight times the number of micro batches (the schedule divides every gradient by that
    number, ``scale_grads``). ``pipeline_step`` sets the weight to the data-parallel degree over
    the global batch's trained targets, so the step's loss and gradient are the mean over every
    trained target of the global batch, as ``train_step`` with ``scales`` makes them.

    Under loss parallelism (``Decoder.vocab_shards``) the logits are the last stage's vocabulary
    shards (a DTensor) and the same cross-entropy runs on them under torch's ``loss_parallel()``,
    which ``pipeline_step`` and the evaluation enter around the schedule; its replicated value is
    the loss."""

    def __init__(self) -> None:
        self.weight: float | None = None
        self.microbatches = 1

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if isinstance(logits, DTensor):  # the last stage's vocabulary shards: loss parallelism
            if self.weight is None:
                return vocab_parallel_cross_entropy(logits, targets)
            return vocab_parallel_cross_entropy(logits, targets, "sum") * (self.weight * self.microbatches)
        flat, y = logits.flatten(0, 1).float(), targets.flatten()
        if self.weight is None:
            return F.cross_entropy(flat, y)
        return F.cross_entropy(flat, y, reduction="sum") * (self.weight * self.microbatches)


@dataclass
class TiedWeight:
    """A tied weight split over a pipeline (see the module docstring): the embedding's weight where
    this rank holds the first stage, the last stage's copy where it holds that one, the group of the
    two ranks (None when this rank holds both) and the global rank of the embedding's holder."""

    master: nn.Parameter | None
    copy: nn.Parameter | None
    group: dist.ProcessGroup | None
    src: int

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """After backward: the embedding's gradient becomes the sum of both uses' (the copy's is
        dropped), as one process's tied parameter accumulates both. Nothing when the weight is
        frozen (``peft=lora``): no stage computed a gradient for it."""
        held = self.master if self.master is not None else self.copy
        if held is not None and not held.requires_grad:
            return
        if self.master is not None and self.copy is not None:
            _local_grad(self.master).add_(_local_grad(self.copy))
        elif self.group is not None:
            held = self.master if self.master is not None else self.copy
            assert held is not None and held.grad is not None
            dist.reduce(_local_grad(held), dst=self.src, group=self.group)
        if self.copy is not None:
            self.copy.grad = None

    @torch.no_grad()
    def broadcast(self) -> None:
        """After the optimiser step: the copy takes the embedding's new value."""
        if self.master is not None and self.copy is not None:
            _local(self.copy).copy_(_local(self.master))
        elif self.group is not None:
            held = self.master if self.master is not None else self.copy
            assert held is not None
            dist.broadcast(_local(held), src=self.src, group=self.group)


def _local(t: torch.Tensor | None) -> torch.Tensor:
    """This rank's shard of a (possibly sharded) parameter or gradient, sharing its storage."""
    assert t is not None
    return t.to_local() if isinstance(t, DTensor) else t


def _local_grad(p: nn.Parameter) -> torch.Tensor:
    """This rank's shard of ``p``'s gradient, laid out as ``p`` is: under TP the embedding's gradient
    comes back replicated while the weight is sharded over the vocabulary (the copy's is sharded),
    so it is cut to the weight's placement first (a local slice, no communication)."""
    g = p.grad
    assert g is not None
    if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
        p.grad = g = g.redistribute(p.device_mesh, p.placements)
    return _local(g)


def tie_stages(model: PipelineModel, mesh: DeviceMesh, pp_dim: int, last_pp_rank: int) -> None:
    """Make ``model.tied`` (left None on a rank that holds neither stage): one group per pipeline of
    the first stage's rank (pp rank 0) and the last stage's (``last_pp_rank``), the same data /
    tensor coordinate; collective over all ranks, which create every group in the same order."""
    master = next((s.tok_embeddings.weight for s in model.stages if s.tok_embeddings is not None), None)
    copy_ = next((s.output.weight for s in model.stages if s.output is not None), None)
    me = dist.get_rank()
    rows = mesh.mesh.movedim(pp_dim, -1).reshape(-1, mesh.mesh.shape[pp_dim]).tolist()
    group, src = None, -1
    for row in rows:
        ranks = sorted({row[0], row[last_pp_rank]})
        made = dist.new_group(ranks) if len(ranks) > 1 else None
        if me in ranks:
            group, src = made, row[0]
    if master is None and copy_ is None:
        return
    assert src >= 0, f"rank {me} holds a tied stage but is in no pipeline of the mesh"
    if master is not None and copy_ is not None:
        assert master is not copy_ and _local(master).shape == _local(copy_).shape
    model.tied = TiedWeight(master, copy_, group, src)


class Stage(PipelineStage):
    """A ``PipelineStage`` whose first-step shape probe leaves the MoE routing figures as they were
    (``routing_unchanged``). On its first step torch's schedule runs each stage's forward once more
    before the micro batches (``_prepare_forward_infra`` -> ``_forward_metadata_inference``, torch's
    dynamic shape mode): on the first micro batch's tokens on the first stage, on uninitialised
    inputs of the received shapes on a later one. Counted, that forward added a micro batch's worth
    of routings to step 1's expert load (``balance_row``: metrics.jsonl, the console line,
    metrics.png) and to the sigmoid routers' bias update (issue 25), and its load-balancing term to
    the step's (``_step_loss`` once kept only each stage's last n terms for this). No-op for a dense
    model."""

    def _prepare_forward_infra(self, *args: object, **kwargs: object) -> object:
        with routing_unchanged(self.submod):
            return super()._prepare_forward_infra(*args, **kwargs)


def build_schedule(
    model: PipelineModel,
    pp_mesh: DeviceMesh,
    schedule: PPSchedule,
    num_microbatches: int,
    device: torch.device,
) -> None:
    """Wrap each stage in a ``Stage`` (a ``PipelineStage``) over the pp axis and make the schedule (in place).

    Shapes between stages are inferred on the first step (torch's dynamic mode). The loss function
    (``model.loss``) runs on the last stage per micro batch; gradients are scaled by the number of
    micro batches (``scale_grads``), so they are the mean over the rank's batch, as without
    pipelining.
    """
    model.loss.microbatches = num_microbatches
    loss_fn = model.loss
    group = pp_mesh.get_group()
    stages = [
        Stage(s, i, model.num_stages, device, group=group)
        for s, i in zip(model.stages, model.stage_ids, strict=True)
    ]
    cls = SCHEDULES[schedule]
    if len(stages) == 1 and cls in (ScheduleGPipe, Schedule1F1B):
        model.schedule = cls(stages[0], n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=True)
    else:
        model.schedule = cls(stages, n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=True)
    model.pp_group = group
