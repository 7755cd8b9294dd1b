"""A launch under torchrun (or submitit): the process group first, from each rank's own composition; rank
0 alone validates and resolves, and every rank gets its result or its refusal (``from_rank_zero``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework.config.schema import (
    to_config,
)
from framework.launch.prelaunch import JobFailed
from framework.launch.ranks import (
    apply_allocator_environment,
)
from framework.parallel.process import resolve_device
from framework.planner.topology import (
    apply_nccl_environment,
    nccl_environment,
)


def join_torchrun(dcfg: DictConfig, run_dir: Path) -> None:
    """A torchrun (or submitit) rank: create the process group the trainer then runs in, taking
    its settings (device, NCCL environment and timeout, allocator) from this rank's own composition,
    and stop unless every rank composed the same config into the same run dir. Validation and the
    plan are rank 0's alone (``from_rank_zero``); every rank reads the plan from the run dir.

    Raises JobFailed (exit 2) for settings that do not convert, or ranks that disagree."""
    from framework.parallel.process import init_distributed
    from framework.train.agreement import check_same_composition

    try:
        own = to_config(dcfg)
        nccl_env = nccl_environment(own.nccl, run_dir, own.mesh.procs_per_node)
        device = resolve_device(own.run.device)
    except (ValueError, OmegaConfBaseException) as e:
        raise JobFailed(str(e).splitlines()[0], 2) from e
    apply_nccl_environment(nccl_env)  # before the process group: NCCL reads it there
    apply_allocator_environment(own.run)
    env = init_distributed(device, own.nccl.timeout_s)
    composed = OmegaConf.to_container(dcfg, resolve=False)
    try:
        check_same_composition(env, run_dir, composed)
    except ValueError as e:
        raise JobFailed(str(e), 2) from e


def from_rank_zero(
    rank: int, torchrun: bool, act: Callable[[], Any], share: Callable[[Any], str | None] = lambda _: None
) -> tuple[Any, str | None]:
    """``act()`` on rank 0 while the other ranks of a torchrun job wait for it: (its result, on rank 0
    only; ``share(result)``, a short string such as the config hash, on every rank). A refusal there
    (JobFailed) is every rank's, with rank 0's line and exit status. Without torchrun this process is
    the launcher: ``act()``, plainly. Never the plan: the ranks read that from the run dir."""
    if not torchrun:
        value = act()
        return value, share(value)
    import torch.distributed as dist

    value, failed = None, None
    box: list[Any] = [None]
    if rank == 0:
        try:
            value = act()
            box = [("ok", share(value))]
        except JobFailed as e:
            failed, box = e, [("failed", str(e), e.code)]
    dist.broadcast_object_list(box, src=0)
    if failed is not None:
        raise failed
    if box[0][0] == "failed":
        raise JobFailed(box[0][1], box[0][2])
    return value, box[0][1]
