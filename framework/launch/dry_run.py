"""Dry run: build the real mesh and the real sharded model at full world size, on one process.

A fake process group (``torch.testing._internal.distributed.fake_pg``) answers every collective
without communicating, so ``init_device_mesh`` and the real ``parallelize`` functions run as rank 0
of an N-rank job would, on the meta device (nothing is allocated). The per-rank parameter bytes are
measured from the sharded model (``to_local()`` shapes of DTensors) and set next to the planner's
estimate: if they disagree, the planner's model of the wrappers is wrong. Under ``model.float8`` the
report also counts the Linear layers torchao swapped and the weights FSDP2 all-gathers in float8,
next to the layers the planner counts (framework.models.linears.converted), and the MoE experts
marked float8 (expert parallelism's runners included) next to ``linears.converted_experts``.

The model is parallelized for the declared hardware's device type (``mesh.hardware.compute_capability``):
for a GPU profile the executor's CUDA-only paths (``executor=cudagraphs``) are applied as a launch
would, and nothing runs, so no kernel or GPU is needed.

The fake group and the meshes live in a forked child process: state they leave behind in torch's
distributed globals made later real (gloo) FSDP2/TP runs forked from the same process compute
wrong results (found by running tests/launch/test_dry_run.py before tests/parallel/test_parallel.py), so the
caller's process is never touched. Fork costs milliseconds; nothing is re-imported.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from framework.config.schema import Config, Float8Recipe
from framework.models import build_model, linears
from framework.parallel import build_mesh, parallelize
from framework.parallel.float8 import is_float8
from framework.planner.params import GIB
from framework.planner.plan import Plan, pp_rank_param_bytes, pp_rank_specs
from framework.planner.resolve import check_plan


@dataclass(frozen=True)
class Measured:
    """What the child measured on rank 0's sharded model."""

    param_bytes: int  # rank 0's parameters after sharding (fp32 master weights)
    num_sharded_params: int  # DTensor parameters
    num_params: int  # parameter tensors (tied ones once)
    num_float8_layers: int  # torchao Float8Linear modules
    num_float8_all_gather: int  # weights FSDP2 all-gathers in float8
    num_float8_experts: int = 0  # MoE experts modules marked float8 (GroupedExperts or their EP runner)


@dataclass(frozen=True)
class DryRunReport:
    plan: Plan
    measured_param_bytes: int  # rank 0's parameters after sharding (fp32 master weights)
    estimated_param_bytes: int
    num_sharded_params: int  # DTensor parameters
    num_params: int  # parameter tensors (tied ones once)
    wall_s: float
    float8: Float8Recipe = Float8Recipe.none
    planned_float8_layers: int = 0  # the planner's converted layers on rank 0 (framework.kernels.float8)
    num_float8_layers: int = 0  # measured: Float8Linear modules on rank 0
    planned_float8_all_gather: int = 0  # float8 weights FSDP2 should all-gather in float8
    num_float8_all_gather: int = 0  # measured
    planned_float8_experts: int = 0  # MoE experts modules the planner converts on rank 0
    num_float8_experts: int = 0  # measured: marked float8 on rank 0

    @property
    def rel_error(self) -> float:
        return abs(self.measured_param_bytes - self.estimated_param_bytes) / max(self.measured_param_bytes, 1)


def local_param_bytes(model: nn.Module) -> tuple[int, int, int]:
    """(bytes of this rank's parameter shards, number of DTensor parameters, number of parameters)."""
    total, sharded, count = 0, 0, 0
    for p in model.parameters():  # deduplicates tied parameters
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
        sharded += isinstance(p, DTensor)
        count += 1
    return total, sharded, count


def float8_all_gathered(model: nn.Module) -> int:
    """Parameters whose local shard is torchao's float8-all-gather weight (0 without torchao)."""
    return sum(
        type(p._local_tensor).__name__ == "WeightWithDynamicFloat8CastTensor"
        for p in model.parameters()
        if isinstance(p, DTensor)
    )


def planned_float8(cfg: Config, plan: Plan) -> tuple[int, int]:
    """(Linear layers the planner converts on pp rank 0, of them the weights FSDP2 all-gathers in
    float8: all of them under tensorwise with FSDP over more than one rank, else none)."""
    chosen = {s.fqn for s in linears.converted(cfg.model)}
    layers = sum(s.name.removesuffix(".weight") in chosen for s in pp_rank_specs(cfg, plan, 0))
    layout = plan.layout
    gathered = cfg.model.float8 is Float8Recipe.tensorwise and layout.fsdp and layout.fsdp_shard > 1
    return layers, layers if gathered else 0


def planned_float8_experts(cfg: Config, plan: Plan) -> int:
    """MoE experts modules the planner converts (``linears.converted_experts``) on pp rank 0."""
    chosen = {f"{g.fqn}.{g.param}" for g in linears.converted_experts(cfg.model)}
    return sum(s.name in chosen for s in pp_rank_specs(cfg, plan, 0) if s.name.endswith(".gate_up_proj"))


def _measure(cfg: Config, plan: Plan) -> Measured:
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", rank=0, world_size=plan.world_size, store=FakeStore())
    try:
        mesh = build_mesh(plan, "cpu")
        model = build_model(cfg.model, cfg.train.seq_len)
        sharded_model = parallelize(
            model,
            mesh,
            plan,
            cfg.sharding,
            cfg.bucketing,
            cfg.executor,
            torch.device(cfg.mesh.hardware.device_type),  # nothing runs: the meta model stays on meta
            cfg.train.seed,
            init_weights=False,
        )
        num_float8 = sum(is_float8(m) for m in sharded_model.modules())
        experts = sum(getattr(m, "float8", False) is True for m in sharded_model.modules())
        return Measured(
            *local_param_bytes(sharded_model), num_float8, float8_all_gathered(sharded_model), experts
        )
    finally:
        dist.destroy_process_group()


def _child(cfg: Config, plan: Plan, conn: Connection) -> None:
    code = 0
    try:
        conn.send((True, _measure(cfg, plan)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the caller
        conn.send((False, traceback.format_exc()))
        code = 1
    finally:
        conn.close()
        os._exit(code)  # skip interpreter teardown of the copied state


def dry_run(cfg: Config, plan: Plan) -> DryRunReport:
    """Shard the meta model of resolved ``cfg`` as ``plan`` lays it out (both from
    framework.planner.resolve.resolve, planned once) on a fake process group of the full world size.

    Raises ValueError when ``plan`` is another config's (in this process, before anything is
    forked); RuntimeError if this process already has a process group, or with the child's
    traceback if sharding failed there.
    """
    start = time.perf_counter()
    check_plan(cfg, plan)
    if dist.is_initialized():
        raise RuntimeError("dry_run needs a process without a process group (it creates a fake one)")
    ctx = mp.get_context("fork")
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(cfg, plan, sender), daemon=True)
    proc.start()
    sender.close()
    try:
        ok, payload = receiver.recv()
    except EOFError:
        ok, payload = False, "the dry-run process died without a report"
    finally:
        proc.join()
        receiver.close()
    if not ok:
        raise RuntimeError(f"dry run failed (exit code {proc.exitcode}):\n{payload}")
    measured: Measured = payload
    planned_layers, planned_gather = planned_float8(cfg, plan)
    return DryRunReport(
        plan=plan,
        measured_param_bytes=measured.param_bytes,
        # Under pp the fake rank 0 holds pp rank 0's stages; the plan's memory is the busiest rank's.
        estimated_param_bytes=plan.memory.params
        if plan.layout.pp == 1
        else pp_rank_param_bytes(cfg, plan, 0),
        num_sharded_params=measured.num_sharded_params,
        num_params=measured.num_params,
        wall_s=time.perf_counter() - start,
        float8=cfg.model.float8,
        planned_float8_layers=planned_layers,
        num_float8_layers=measured.num_float8_layers,
        planned_float8_all_gather=planned_gather,
        num_float8_all_gather=measured.num_float8_all_gather,
        planned_float8_experts=planned_float8_experts(cfg, plan),
        num_float8_experts=measured.num_float8_experts,
    )


def format_dry_run(report: DryRunReport) -> str:
    p = report.plan
    mesh = " x ".join(f"{a}={s}" for a, s in zip(p.mesh_axes, p.mesh_shape, strict=True))
    float8_lines = []
    if report.float8 is not Float8Recipe.none:
        float8_lines = [
            f"  float8 layers       planned {report.planned_float8_layers}, swapped "
            f"{report.num_float8_layers} (model.float8={report.float8.value}); all-gathered in float8 "
            f"by FSDP: planned {report.planned_float8_all_gather}, measured {report.num_float8_all_gather}"
        ]
        if report.planned_float8_experts or report.num_float8_experts:
            float8_lines.append(
                f"  float8 MoE experts  planned {report.planned_float8_experts}, marked "
                f"{report.num_float8_experts} (torchao's rowwise float8 grouped GEMM)"
            )
    return "\n".join(
        [
            f"dry run: {p.strategy} on {p.world_size} ranks ({mesh}) in {report.wall_s:.2f} s",
            f"  parameter tensors   {report.num_params} ({report.num_sharded_params} DTensor)",
            f"  params per rank     estimated {report.estimated_param_bytes:,} B "
            f"({report.estimated_param_bytes / GIB:.3f} GiB), measured {report.measured_param_bytes:,} B "
            f"(rel. error {report.rel_error:.2e})",
            f"  memory per rank     estimated {p.memory.total / GIB:.2f} GiB of "
            f"{p.memory.device / GIB:.0f} GiB",
            *float8_lines,
        ]
    )
