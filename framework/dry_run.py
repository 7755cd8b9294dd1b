"""Dry run: build the real mesh and the real sharded model at full world size, on one process.

A fake process group (``torch.testing._internal.distributed.fake_pg``) answers every collective
without communicating, so ``init_device_mesh`` and the real ``parallelize`` functions run as rank 0
of an N-rank job would, on the meta device (nothing is allocated). The per-rank parameter bytes are
measured from the sharded model (``to_local()`` shapes of DTensors) and set next to the planner's
estimate: if they disagree, the planner's model of the wrappers is wrong.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from framework.config import Config
from framework.model import build_model
from framework.parallel import build_mesh, parallelize
from framework.plan import GIB, Plan, make_plan


@dataclass(frozen=True)
class DryRunReport:
    plan: Plan
    measured_param_bytes: int  # rank 0's parameters after sharding (fp32 master weights)
    estimated_param_bytes: int
    num_sharded_params: int  # DTensor parameters
    num_params: int  # parameter tensors (tied ones once)
    wall_s: float

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


def dry_run(cfg: Config) -> DryRunReport:
    """Plan, then shard the meta model on a fake process group of the full world size.

    Raises ValueError as ``make_plan`` does, and RuntimeError if a process group already exists
    in this process (the fake group would replace it).
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    start = time.perf_counter()
    plan = make_plan(cfg)
    if dist.is_initialized():
        raise RuntimeError("dry_run needs a process without a process group (it creates a fake one)")
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
            torch.device("cpu"),
            cfg.train.seed,
            init_weights=False,
        )
        measured, sharded, count = local_param_bytes(sharded_model)
    finally:
        dist.destroy_process_group()
    return DryRunReport(
        plan=plan,
        measured_param_bytes=measured,
        estimated_param_bytes=plan.memory.params,
        num_sharded_params=sharded,
        num_params=count,
        wall_s=time.perf_counter() - start,
    )


def format_dry_run(report: DryRunReport) -> str:
    p = report.plan
    mesh = " x ".join(f"{a}={s}" for a, s in zip(p.mesh_axes, p.mesh_shape, strict=True))
    return "\n".join(
        [
            f"dry run: {p.strategy} on {p.world_size} ranks ({mesh}) in {report.wall_s:.2f} s",
            f"  parameter tensors   {report.num_params} ({report.num_sharded_params} DTensor)",
            f"  params per rank     estimated {report.estimated_param_bytes:,} B "
            f"({report.estimated_param_bytes / GIB:.3f} GiB), measured {report.measured_param_bytes:,} B "
            f"(rel. error {report.rel_error:.2e})",
            f"  memory per rank     estimated {p.memory.total / GIB:.2f} GiB of "
            f"{p.memory.device / GIB:.0f} GiB",
        ]
    )
