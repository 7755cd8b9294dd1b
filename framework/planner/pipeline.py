"""The plan's pipeline terms: its busiest rank (parameters, blocks, memory with the schedule's
micro batches in flight), the share of the model's cost it runs, and the point-to-point and
tied-weight communication between stages. The schedule's arithmetic (splits, bubbles, in-flight
counts) is framework.planner.stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from framework.config.schema import (
    Config,
)
from framework.planner import stages as pipeline_stages
from framework.planner.comm import axis_is_intra_node, link_of
from framework.planner.layout import (
    Degrees,
    MeshAxis,
)
from framework.planner.memory import MemoryEstimate, autocast_bf16, rank_memory
from framework.planner.overlap import CommEstimate
from framework.planner.params import MASTER_BYTES, ParamSpec, fsdp_units, local_numel, rank_specs, tied_copy


@dataclass(frozen=True)
class PipelinePlan:
    """The planned pipeline of one layout, and its busiest rank (framework.planner.stages)."""

    schedule: str
    microbatches: int
    stages_per_rank: int
    split: tuple[tuple[int, int], ...]
    ranks: tuple[tuple[int, ...], ...]
    specs: list[ParamSpec]  # the busiest rank's parameters
    layers: tuple[int, ...]  # its blocks' indices
    memory: MemoryEstimate  # the rank with the most memory
    fraction: float  # the busiest rank's share of the model's cost
    bubble: float

    def fields(self) -> dict[str, Any]:
        return {
            "pp_schedule": self.schedule,
            "pp_microbatches": self.microbatches,
            "pp_stages_per_rank": self.stages_per_rank,
            "pp_split": self.split,
            "pp_ranks": self.ranks,
            "pp_bubble": self.bubble,
        }


def plan_pipeline(
    cfg: Config, d: Degrees, specs: list[ParamSpec], tp: int, shard: int, accum: int
) -> PipelinePlan:
    p = cfg.parallel
    spr, sched = p.pp_stages_per_rank, p.pp_schedule
    m = pipeline_stages.microbatches(cfg, d.pp, d.dp)
    tokens = cfg.train.global_batch_size * cfg.train.seq_len / d.dp / d.cp  # a CP rank's sequence shard
    split = pipeline_stages.split_layers(cfg, d.pp * spr, tokens)
    ranks = pipeline_stages.rank_stages(d.pp, spr, sched)
    flight = pipeline_stages.in_flight(sched, d.pp, spr, m)
    last = len(split) - 1
    per_rank = []
    for ids in ranks:
        mine = rank_specs(specs, split, ids, tied_copy(cfg.model))
        layers = tuple(i for s in ids for i in range(*split[s]))
        # The first rank holds the most micro batches in flight; every rank is costed at that peak.
        mem = rank_memory(
            cfg,
            mine,
            tp,
            shard,
            fsdp_units(mine, tp),
            accum=accum,
            pipeline=(layers, flight, last in ids),
            cp=d.cp,
            held=pipeline_stages.held_for_step(cfg, d.pp),
        )
        per_rank.append((mem.total, mine, layers, mem))
    _, mine, layers, memory = max(per_rank, key=lambda t: t[0])
    fraction = pipeline_stages.stage_cost_fraction(split, ranks, cfg, tokens)
    return PipelinePlan(
        schedule=sched.value,
        microbatches=m,
        stages_per_rank=spr,
        split=split,
        ranks=tuple(tuple(r) for r in ranks),
        specs=mine,
        layers=layers,
        memory=memory,
        fraction=fraction,
        bubble=pipeline_stages.bubble_fraction(sched, d.pp, spr, m),
    )


def send_recv(
    cfg: Config, d: Degrees, sizes: tuple[int, ...], axes: tuple[MeshAxis, ...], accum: int
) -> CommEstimate:
    """Point-to-point between neighbouring stages: each micro batch's activations forward and their
    gradient backward, once per stage a rank holds (micro batch x seq/(tp cp) x dim each: under CP
    each rank passes its own sequence shard to the same CP rank of the next stage)."""
    intra = axis_is_intra_node(sizes, axes.index(MeshAxis.pp), cfg.mesh.procs_per_node)
    alpha, beta = link_of(cfg, intra)
    elem = 2 if autocast_bf16(cfg) else 4
    payload = cfg.train.micro_batch_size * cfg.train.seq_len * cfg.model.dim * elem // d.tp // d.cp
    calls = 2 * accum * cfg.parallel.pp_stages_per_rank
    per = alpha + payload / beta
    return CommEstimate(
        "pp", "send_recv", d.pp, "intra" if intra else "inter", calls, payload, payload * calls, per * calls
    )


def tied_weight_comm(
    cfg: Config,
    d: Degrees,
    sizes: tuple[int, ...],
    axes: tuple[MeshAxis, ...],
    ranks: tuple[tuple[int, ...], ...],
) -> list[CommEstimate]:
    """A tied embedding split over a pipeline (framework.parallel.pipeline.TiedWeight): once per step
    the last stage's copy sends its gradient to the embedding's rank (``dist.reduce`` over their
    group of two) and gets the stepped weight back (``dist.broadcast``), each this rank's fp32
    shard of the vocab x dim weight (TP and FSDP shards). None where one rank holds both (zbv)."""
    tied = tied_copy(cfg.model)
    last = sum(len(r) for r in ranks) - 1
    if tied is None or any(0 in r and last in r for r in ranks):
        return []
    intra = axis_is_intra_node(sizes, axes.index(MeshAxis.pp), cfg.mesh.procs_per_node)
    alpha, beta = link_of(cfg, intra)
    payload = local_numel(tied, d.tp, d.fsdp_shard) * MASTER_BYTES
    link = "intra" if intra else "inter"
    return [
        CommEstimate("pp", kind, 2, link, 1, payload, payload, alpha + payload / beta)
        for kind in ("tied_reduce", "tied_broadcast")
    ]
