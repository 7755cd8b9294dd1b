"""The launcher's last checks and the run files every rank reads: ``config.yaml``, ``plan.json`` (with the
search), ``provenance.json``, the NCCL record, and the checkpoint lock the launch takes before writing.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from framework.checkpoint.lock import Owner
from framework.config.schema import (
    Config,
)
from framework.launch.prelaunch import JobFailed, PreparedJob, check_not_nested
from framework.planner.plan import Plan
from framework.planner.report import format_plan, plan_to_dict
from framework.planner.resolve import PLAN_FILE, write_plan
from framework.planner.search import format_search, search_to_dict
from framework.planner.topology import (
    describe_nccl,
    write_nccl_record,
)

log = logging.getLogger("framework")


def write_run_files(job: PreparedJob, run_dir: Path, recipe: str | None) -> Owner | None:
    """The launcher's (rank 0's) last checks and the run files every rank reads: ``config.yaml``,
    ``plan.json`` (with the search), provenance and the NCCL record. JobFailed (exit 2) on a refusal,
    before anything is written. Returns the checkpoint lock this launch took (``take_launch_lock``)."""
    cfg, plan, nccl_env = job.cfg, job.plan, job.nccl_env
    try:
        check_checkpoint_lock(cfg, run_dir)  # before anything is written: exit 2, run dir removed
        check_resume_model(cfg, run_dir)
        check_export_dir(cfg, run_dir)
        owner = take_launch_lock(cfg, run_dir)
    except ValueError as e:
        raise JobFailed(str(e), 2) from e
    config_yaml = job.config_yaml
    (run_dir / "config.yaml").write_text(config_yaml)
    record = plan_to_dict(plan)
    brief = plan.world_size == 1 and not cfg.run.dry_run
    if job.search is not None:
        record["search"] = search_to_dict(job.search)
        if not brief:
            log.info("%s", format_search(job.search))
    write_plan(run_dir, record)
    write_provenance(run_dir, recipe, config_yaml)
    write_nccl_record(run_dir, nccl_env)
    if brief:  # one rank: the choice in one line; the table, the search and NCCL's are in the files
        log.info("%s", plan_line(cfg, plan, run_dir))
        for warning in plan.warnings:
            log.warning("%s", warning)
        return
    log.info("plan:\n%s", format_plan(plan))
    if cfg.mesh.hardware.device_type == "cpu":
        log.info("%s", CPU_PREDICTION)
    if nccl_env:
        log.info("nccl: %s", describe_nccl(nccl_env))
    return owner


# The step-time model's constants are fitted to GPUs (framework.planner.cost); on the CPU profile its
# prediction for the default run was far slower than measured (benchmarks/PERF.md, "A user's first
# hour": the figure).
CPU_PREDICTION = (
    "mesh/hardware=cpu: the predicted step time and tokens/s above are the GPU-fitted step-time model's, "
    "not this CPU's (measure with a short run); the memory figures hold"
)


def plan_line(cfg: Config, plan: Plan, run_dir: Path) -> str:
    """A one-rank run's plan in one line: the layout, its batch and checkpointing, the memory, and
    where the full plan is (plan.json: the estimates and, under sharding=auto, the search). The
    predicted step time only for a GPU profile (CPU_PREDICTION says why)."""
    gib = 2**30
    time = (
        ""
        if cfg.mesh.hardware.device_type == "cpu"
        else f", predicted step {plan.prediction.step_time_s * 1e3:.1f} ms"
    )
    return (
        f"plan: {plan.strategy} on 1 rank, micro batch {plan.micro_batch_size} x {plan.grad_accum_steps} "
        f"accumulation, activation checkpointing {plan.activation_checkpointing}, "
        f"{plan.memory.total / gib:.2f} of {plan.memory.device / gib:.0f} GiB{time} (in full: {run_dir / PLAN_FILE})"
    )


def check_checkpoint_lock(cfg: Config, run_dir: Path) -> None:
    """Before launch: refuse (exit 2, nothing written) when another live run holds the checkpoint dir."""
    if not cfg.checkpoint.enabled:
        return
    from framework.checkpoint import lock

    root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    check_not_nested("checkpoint.dir" if cfg.checkpoint.dir else "hydra.run.dir", root)
    lock.check_free(root, str(run_dir))


def take_launch_lock(cfg: Config, run_dir: Path) -> Owner | None:
    """The checkpoint root's lock, taken by the launcher before it writes the run files, and handed
    to the ranks (framework.checkpoint.lock: the lock of a rank's own launcher is the rank's). Why:
    two launches of one run dir started seconds apart both passed the lock check, since the first
    run's rank takes the lock only once its model is built; the second then rewrote the first's
    config.yaml and plan.json and failed inside its ranks with a LockHeld traceback. Of two launches
    racing here, one gets the lock and the other a LockHeld line (exit 2). None for a dry run or
    without checkpointing (nothing to lock)."""
    if not cfg.checkpoint.enabled or cfg.run.dry_run:
        return None
    from framework.checkpoint import lock
    from framework.config.run_values import checkpoint_root

    return lock.acquire(checkpoint_root(cfg.checkpoint, run_dir), str(run_dir))


def release_launch_lock(job: PreparedJob | None, run_dir: Path, owner: Owner | None) -> None:
    """The launcher's lock, released if it still holds it (the ranks never took it over: they failed
    first); never a lock the ranks or another run hold."""
    if owner is None or job is None:
        return
    from framework.checkpoint import lock
    from framework.config.run_values import checkpoint_root

    lock.release(checkpoint_root(job.cfg.checkpoint, run_dir), owner)


def check_export_dir(cfg: Config, run_dir: Path) -> None:
    """Before launch: ``checkpoint.export_hf`` writes ``RUN_DIR/hf`` after training; a file there (a
    reused run dir) was a FileExistsError traceback once the run had trained, and a folder that
    export-hf did not write would lose its files."""
    if not cfg.checkpoint.export_hf:
        return
    from framework.checkpoint.export_hf import EXPORT_MARKER

    out = run_dir / "hf"
    fix = (
        "valid: move it away, or checkpoint.export_hf=false "
        "(export later with python -m framework export-hf)"
    )
    if out.exists() and not out.is_dir():
        raise ValueError(f"checkpoint.export_hf=true writes {out}, which is a file; {fix}")
    if out.is_dir() and any(out.iterdir()) and not (out / EXPORT_MARKER).is_file():
        raise ValueError(f"checkpoint.export_hf=true writes {out}, a folder export-hf did not write; {fix}")


def check_resume_model(cfg: Config, run_dir: Path) -> None:
    """Before launch: refuse (exit 2, nothing written) resuming a checkpoint of another model shape
    (framework.checkpoint.init_from.check_resume_model): the newest committed one under the checkpoint root
    for ``checkpoint.resume=auto``, else the one it names."""
    resume = cfg.checkpoint.resume
    if not cfg.checkpoint.enabled or resume == "none":
        return
    from framework.checkpoint import init_from, store

    if resume == "auto":
        root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
        found = store.committed(root)
        if not found:
            return
        step_dir = found[-1][1]
    else:
        from framework.checkpoint.resolve import check_step_dir

        step_dir = check_step_dir(Path(resume), "checkpoint.resume")
    init_from.check_resume_model(
        step_dir, cfg.model, "checkpoint.resume" + ("=auto" if resume == "auto" else "")
    )


def write_provenance(run_dir: Path, recipe: str | None, config_yaml: str) -> None:
    """``provenance.json``: the recipe (name, source file, its hash), the config hash, the code's commit."""
    from framework.launch.recipes import provenance

    (run_dir / "provenance.json").write_text(json.dumps(provenance(recipe, config_yaml), indent=2) + "\n")
