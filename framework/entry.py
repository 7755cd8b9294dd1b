"""What ``train.py`` does with a composed config: validate, plan, write the run files, launch.

Every check that can fail on user input runs here, before any rank starts. A failed check prints one
clear error, removes the run dir Hydra just created (when it holds nothing but Hydra's own files)
and exits with status 2.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from framework.config import Config, to_config, to_yaml
from framework.launch import check_local_resources, joined_torchrun, resolve_device, spawn_local
from framework.plan import format_plan, make_plan, plan_to_dict
from framework.topology import (
    apply_nccl_environment,
    describe_nccl,
    nccl_environment,
    validate_mesh,
    write_nccl_record,
)

log = logging.getLogger("framework")
HYDRA_FILES = {".hydra", "train.log"}


def discard_run_dir(run_dir: Path) -> None:
    """Remove a run dir that holds only what Hydra wrote for this invocation; never anything else."""
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= HYDRA_FILES:
        shutil.rmtree(run_dir, ignore_errors=True)
        parent = run_dir.parent
        if parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()


def validate(dcfg: DictConfig) -> Config:
    cfg = to_config(dcfg)
    validate_mesh(cfg.mesh)
    device = resolve_device(cfg.run.device)
    check_local_resources(cfg, device)
    return cfg


def run_job(dcfg: DictConfig) -> float | None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    rank = int(os.environ.get("RANK", "0")) if joined_torchrun() else 0
    try:
        cfg = validate(dcfg)
        plan = make_plan(cfg)
        nccl_env = nccl_environment(cfg.nccl, run_dir, cfg.mesh.procs_per_node)
    except ValueError as e:
        log.error("error: %s", e)
        print(f"error: {e}", file=sys.stderr)
        discard_run_dir(run_dir)
        sys.exit(2)

    if rank == 0:
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        (run_dir / "plan.json").write_text(json.dumps(plan_to_dict(plan), indent=2) + "\n")
        log.info("plan:\n%s", format_plan(plan))
        write_nccl_record(run_dir, nccl_env)
        if nccl_env:
            log.info("nccl: %s", describe_nccl(nccl_env))
    # Before any process group exists, and before spawning: the ranks inherit it.
    apply_nccl_environment(nccl_env)
    if cfg.run.dry_run:
        from framework.dry_run import dry_run, format_dry_run

        report = dry_run(cfg)
        log.info("dry run:\n%s", format_dry_run(report))
        return None

    from framework import trainer

    if joined_torchrun():
        from framework.launch import finish

        trainer.run(cfg, run_dir)
        finish(0)
    if cfg.mesh.world_size == 1:
        try:
            summary = trainer.run(cfg, run_dir)
        finally:
            _end_in_process_group()
        return summary.final_val_loss if summary.final_val_loss is not None else summary.final_loss
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        spawn_local(run_dir, cfg.mesh.world_size, cfg.run.max_restarts)
    except ChildFailedError as e:
        log.error("ranks failed (see %s): %s", run_dir / "train.log", e.get_first_failure()[1].message)
        sys.exit(1)
    summary_path = run_dir / "summary.json"
    if summary_path.is_file():
        info = json.loads(summary_path.read_text())
        return info.get("final_val_loss") or info.get("final_loss")
    return None


def _end_in_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
