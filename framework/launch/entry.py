"""What ``train.py`` does with a composed config: one job, a single run or one job of a sweep.

In order: the checks before launch (framework.launch.prelaunch), the sweep's bookkeeping
(framework.launch.sweep: a job that completed in a previous run of the same sweep is skipped; a failure
is recorded in the job's ``job.json`` and the job returns NaN, so the other jobs run), the run files
(framework.launch.run_files), then the ranks: in this process, spawned, or as torchrun's
(framework.launch.torchrun). A refusal before launch prints one line and exits with status 2, its run
dir removed when this invocation created it (framework.launch.run_dir_guard).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
import traceback
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from framework.checkpoint.lock import LockHeld
from framework.config.schema import (
    Config,
)
from framework.data.tokens import DATA_CHANGED, DataChanged
from framework.launch import sweep
from framework.launch.failures import describe_failures
from framework.launch.outcome import (
    after_failure,
    check_saves,
    data_changed_report,
    failed_saves,
    finish_run,
    preemption,
    run_result,
    stop_report,
)
from framework.launch.prelaunch import JobFailed, prepare
from framework.launch.ranks import (
    adopt_submitit_environment,
    apply_allocator_environment,
    isolated_environ,
    joined_torchrun,
    spawn_local,
)
from framework.launch.run_dir_guard import discard_run_dir
from framework.launch.run_files import release_launch_lock, write_run_files
from framework.launch.torchrun import from_rank_zero, join_torchrun
from framework.launch.worker import LOCK_HELD
from framework.planner.plan import Plan
from framework.planner.resolve import PLAN_FILE
from framework.planner.topology import (
    apply_nccl_environment,
)
from framework.record.run_dir import GONE_PREFIXES, DirGone

log = logging.getLogger("framework")


def run_job(dcfg: DictConfig) -> float | None:
    """The Hydra task function: one job (a single run, or one job of a sweep)."""
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = list(hydra_cfg.overrides.task)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    with isolated_environ():
        adopt_submitit_environment()
        torchrun = joined_torchrun()
        rank = int(os.environ.get("RANK", "0")) if torchrun else 0
        marked = False  # this job's "running" marker is written
        try:
            if torchrun:  # the process group first; rank 0 alone validates and resolves
                join_torchrun(dcfg, run_dir)
            job, sha = from_rank_zero(
                rank, torchrun, lambda: prepare(dcfg, run_dir, hydra_cfg), lambda j: j.config_sha256
            )
            if multirun:
                skipped = sweep.skip_if_completed(run_dir, overrides, sha, rank)
                if skipped is not None:
                    return skipped[0]
                if rank == 0:
                    sweep.set_aside_previous_attempt(run_dir)
                    sweep.write_job(run_dir, overrides, "running", config_sha256=sha)
                marked = True
            recipe = hydra_cfg.runtime.choices.get("recipe")
            owner, _ = from_rank_zero(rank, torchrun, lambda: write_run_files(job, run_dir, recipe))
            try:
                result = _run(run_dir, rank, job.nccl_env if job is not None else None)
            finally:
                release_launch_lock(job, run_dir, owner)
        except JobFailed as e:
            # A refusal before launch (exit 2, no run dir kept) is one line on stderr; a failure whose
            # run dir stays, or a sweep's job, also goes to the job's log.
            if multirun or e.code != 2:
                log.error("error: %s", e)
            print(f"error: {e}", file=sys.stderr)
            if not multirun:
                if e.code == 2:
                    discard_run_dir(run_dir)
                sys.exit(e.code)
            if rank == 0:
                sweep.record_failure(run_dir, overrides, marked, str(e))
            return math.nan
        except Exception as e:  # noqa: BLE001 - a sweep records the failure and goes on to the next job
            if not multirun:
                raise
            log.error("job %s failed:\n%s", run_dir.name, traceback.format_exc())
            if rank == 0:
                sweep.record_failure(run_dir, overrides, marked, f"{type(e).__name__}: {e}")
            return math.nan
        if multirun and rank == 0:
            sweep.write_job(run_dir, overrides, "ok", config_sha256=sha)
        return result


def _run(run_dir: Path, rank: int, nccl_env: dict[str, str] | None) -> float | None:
    """Train on the run dir's ``config.yaml`` and ``plan.json`` (``load_run``), whatever launched this
    process: the plan was resolved once, before launch, and no rank plans again. ``nccl_env``: the
    launcher's (None on a torchrun rank, which set its own before joining the process group)."""
    from framework.launch.worker import load_run

    try:
        cfg, plan = load_run(run_dir)
    except ValueError as e:
        raise JobFailed(str(e), 2) from e
    if nccl_env is not None and not joined_torchrun():
        # Before any process group exists, and before spawning: the ranks inherit it.
        apply_nccl_environment(nccl_env)
        apply_allocator_environment(cfg.run)
    if cfg.run.dry_run:
        from framework.launch.dry_run import dry_run, format_dry_run

        report = dry_run(cfg, plan)
        log.info("dry run:\n%s", format_dry_run(report))
        return None

    started = time.time()
    if joined_torchrun():
        return _run_torchrun_rank(cfg, plan, run_dir, rank)
    if cfg.mesh.world_size == 1:
        return _run_in_process(cfg, plan, run_dir, started)
    return _run_spawned(cfg, run_dir, started)


def _run_torchrun_rank(cfg: Config, plan: Plan, run_dir: Path, rank: int) -> float | None:
    """This process is one rank that torchrun (or submitit) started: train, then end the process
    with ``finish`` (``os._exit``), except under submitit, whose task must return its result.

    Each such rank composed its config itself (``join_torchrun`` compared the compositions); rank 0
    alone resolved it, and every rank trains on the run dir's ``config.yaml`` and ``plan.json``."""
    from framework.launch.ranks import die_with_launcher
    from framework.parallel.process import KEPT_PARTS, finish
    from framework.train import trainer

    die_with_launcher()
    try:
        trainer.run(cfg, plan, run_dir, keep=KEPT_PARTS)  # never freed: the rank ends with os._exit
    except (DataChanged, DirGone) as e:  # one line on each rank (every rank saw it), not a traceback
        log.error("error: %s", data_changed_report(run_dir, cfg, e))
        finish(1)
    except LockHeld as e:  # another launch took the checkpoint root first: its one line
        log.error("error: %s", e)
        finish(2)
    failed = None
    if rank == 0:
        finish_run(run_dir, cfg)
        failed = failed_saves(run_dir)
    if os.environ.get("SUBMITIT_EXECUTOR"):
        # A submitit task must return (submitit pickles the result); it ends the group itself.
        _end_in_process_group()
        if failed:
            raise JobFailed(failed, 1)
        return run_result(run_dir)
    if failed:
        log.error("error: %s", failed)
    finish(1 if failed else 0, barrier=True)


def _run_in_process(cfg: Config, plan: Plan, run_dir: Path, started: float) -> float | None:
    """One rank, in this process: train (on the plan resolved here), then report a stop by a signal."""
    from framework.train import trainer

    try:
        trainer.run(cfg, plan, run_dir)
    except (DataChanged, DirGone) as e:  # the ranks closed every part (the lock too) on the way out
        raise JobFailed(data_changed_report(run_dir, cfg, e), 1) from None
    except LockHeld as e:  # another launch took the checkpoint root first: its one line, no traceback
        raise JobFailed(str(e), 2) from None
    finally:
        _end_in_process_group()
    finish_run(run_dir, cfg)
    stop = preemption(run_dir, started)
    if stop is not None:  # a signal to this process (Ctrl-C): the rank saved, or says it could not
        if not stop.get("saved"):
            raise JobFailed(stop_report(run_dir, cfg, stop), 1)
        log.warning("%s", stop_report(run_dir, cfg, stop))
    return check_saves(run_dir)


def _run_spawned(cfg: Config, run_dir: Path, started: float) -> float | None:
    """Several ranks on this host: spawn them (elastic, with restarts), wait, report a preemption.
    Each rank reads the run dir's config.yaml and plan.json (framework.launch.worker.load_run)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from framework.config.run_values import checkpoint_root

    checkpoints = checkpoint_root(cfg.checkpoint, run_dir) if cfg.checkpoint.enabled else None
    try:
        signum = spawn_local(run_dir, cfg.mesh.world_size, cfg.run.max_restarts, checkpoints)
    except ChildFailedError as e:
        message = e.get_first_failure()[1].message
        # framework.launch.worker.tell_launcher: a data file changed, the run dir was deleted
        if isinstance(message, str) and message.startswith((DATA_CHANGED, *GONE_PREFIXES)):
            raise JobFailed(data_changed_report(run_dir, cfg, message), 1) from None
        if isinstance(message, str) and message.startswith(str(run_dir / PLAN_FILE)):  # a rank refused it
            raise JobFailed(message, 2) from None
        if isinstance(message, str) and message.startswith(LOCK_HELD):  # framework.launch.worker
            raise JobFailed(message.removeprefix(LOCK_HELD), 2) from None
        raise JobFailed(
            f"ranks failed (see {run_dir / 'train.log'}): {describe_failures(e.failures)}; "
            f"{after_failure(cfg, run_dir, checkpoints)}",
            1,
        ) from e
    finish_run(run_dir, cfg)
    if signum is not None:
        # Preemption: exit 0 (the scheduler requeues; the same run dir resumes) only when the ranks
        # really saved at the step they stopped; otherwise say so and exit 128 + signal.
        stop = preemption(run_dir, started)
        message = stop_report(run_dir, cfg, stop, signum)
        if stop is None or not stop.get("saved"):
            raise JobFailed(message, 128 + signum)
        log.warning("%s", message)
    return check_saves(run_dir)


def _end_in_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
