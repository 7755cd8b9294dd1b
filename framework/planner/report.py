"""The plan as a run records and prints it: ``plan.json`` (``plan_to_dict`` / ``plan_from_dict``)
and the table printed once before training (``format_plan``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from framework.planner import stages as pipeline_stages
from framework.planner.cost import CommEstimate, StepPrediction
from framework.planner.layout import (
    Placement,
)
from framework.planner.memory import MemoryEstimate
from framework.planner.params import GIB, MIB
from framework.planner.plan import Plan


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """JSON-ready dict (tuples become lists); ``plan_from_dict`` inverts it. The prediction's
    headline figures are repeated at the top, under the names the search's candidates use."""
    d = dataclasses.asdict(plan)
    d["predicted_step_time_s"] = plan.prediction.step_time_s
    d["predicted_mfu"] = plan.prediction.mfu
    d["memory_gib"] = plan.memory.total / GIB
    return d


def plan_from_dict(d: dict[str, Any]) -> Plan:
    memory = MemoryEstimate(**d["memory"])
    comm = tuple(CommEstimate(**c) for c in d["comm"])
    placement = tuple(Placement(**p) for p in d["placement"])
    prediction = StepPrediction(**d["prediction"])
    derived = ("predicted_step_time_s", "predicted_mfu", "memory_gib", "search")
    rest = {k: v for k, v in d.items() if k not in ("memory", "comm", "placement", "prediction", *derived)}
    for k in ("mesh_shape", "mesh_axes", "bucket_sizes", "warnings"):
        rest[k] = tuple(rest[k])
    for k in ("pp_split", "pp_ranks"):
        rest[k] = tuple(tuple(x) for x in rest.get(k, ()))
    return Plan(memory=memory, comm=comm, placement=placement, prediction=prediction, **rest)


def _gib(b: int) -> str:
    return f"{b / GIB:8.2f} GiB"


def format_plan(plan: Plan) -> str:
    """The table printed once on rank 0 before training."""
    mesh = " x ".join(f"{a}={s}" for a, s in zip(plan.mesh_axes, plan.mesh_shape, strict=True))
    m = plan.memory
    deg = " x ".join(f"{k}={v}" for k, v in plan.degrees.items())
    lines = [
        f"plan: {plan.strategy} on {plan.world_size} ranks ({plan.nodes} node(s) x {plan.procs_per_node})",
        f"  degrees         {deg}",
        f"  mesh            {mesh}",
    ]
    for p in plan.placement:
        lines.append(f"    {p.axis:<13} size {p.size:<5} stride {p.stride:<5} {p.describe()}")
    pr = plan.prediction
    lines += [
        f"  predicted step  {pr.step_time_s * 1e3:.1f} ms (compute {pr.compute_s * 1e3:.1f}, memory-bound "
        f"{pr.memory_s * 1e3:.1f}, exposed comm {pr.exposed_comm_s * 1e3:.1f}, optimizer {pr.optimizer_s * 1e3:.1f}"
        + (f", bubble {pr.bubble_s * 1e3:.1f}" if pr.bubble_s else "")
        + (f", activation offload {pr.offload_s * 1e3:.1f}" if pr.offload_s else "")
        + f"); MFU {pr.mfu:.1%}, "
        f"{pr.tokens_per_s:,.0f} tokens/s",
        f"                  range {pr.low_s * 1e3:.1f}-{pr.high_s * 1e3:.1f} ms: {pr.sources}",
        f"  batch           global {plan.global_batch_size} = dp {plan.dp_degree} x micro "
        f"{plan.micro_batch_size} x accum {plan.grad_accum_steps}; seq {plan.seq_len}",
        f"  params          {plan.num_params:,} total, {plan.params_per_rank:,} per rank",
        "  memory per rank",
        f"    params        {_gib(m.params)}",
        f"    grads         {_gib(m.grads)}",
        f"    optimizer     {_gib(m.optimizer)}  (AdamW, 2 {m.optimizer_state} states)",
        f"    comm buffers  {_gib(m.comm_buffers)}",
    ]
    for mode, b in m.activations_by_mode.items():
        mark = "  <- chosen" if mode == plan.activation_checkpointing else ""
        if mode == "budget" and plan.activation_memory_budget is not None:
            mark += f" (sharding.activation_memory_budget={plan.activation_memory_budget:g})"
        lines.append(f"    acts {mode:<9}{_gib(b)}{mark}")
    lines.append(f"    total         {_gib(m.total)}  of {_gib(m.device).strip()} device")
    lines.append(
        "  comm per step   axis         collective               n  link   calls   volume/rank      time"
    )
    for c in plan.comm:
        lines.append(
            f"                  {c.axis:<12} {c.collective:<23} {c.group_size:>3}  {c.link:<5} {c.calls:>6} "
            f"{c.volume_bytes / MIB:>10.1f} MiB {c.time_s * 1e3:>9.2f} ms"
        )
    lines.append(f"                  total {plan.comm_time_s * 1e3:.2f} ms")
    sizes = [round(b / MIB, 2) for b in plan.bucket_sizes]
    shown = sizes if len(sizes) <= 6 else [*sizes[:3], "...", *sizes[-2:]]
    lines.append(f"  buckets         {len(sizes)} of {shown} MiB; bucket_cap_mb={plan.bucket_cap_mb:g}")
    lines.append(f"                  {plan.bucket_reason}")
    if plan.degrees.get("pp", 1) > 1:
        lines.append(
            f"  pipeline        {plan.pp_schedule}, {plan.pp_microbatches} micro batches, "
            f"{plan.pp_stages_per_rank} stage(s) per rank, bubble {plan.pp_bubble:.1%} of compute "
            f"({plan.prediction.bubble_s * 1e3:.1f} ms)"
        )
        lines.append(f"  stages          {_describe_split(plan)}")
    lines += [f"  WARNING: {w}" for w in plan.warnings]
    return "\n".join(lines)


def _describe_split(plan: Plan) -> str:
    return pipeline_stages.describe_split(plan.pp_split, [list(r) for r in plan.pp_ranks])
