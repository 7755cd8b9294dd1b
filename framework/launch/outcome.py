"""How a run ended, said in one line: a stop, a preemption, changed data, failed saves or failed ranks;
the run's objective for a sweep, and the ``outputs/latest`` link to the newest run dir.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from framework.config.schema import (
    Config,
)
from framework.launch import sweep
from framework.launch.prelaunch import JobFailed

log = logging.getLogger("framework")


def after_failure(cfg: Config, run_dir: Path, checkpoints: Path | None) -> str:
    """What happens after the ranks failed for good: no restart is left, and how to go on from the
    newest checkpoint (framework.launch.failures.resume_point says which)."""
    left = f"no restart left (run.max_restarts={cfg.run.max_restarts})"
    from framework.checkpoint import store

    committed = store.committed(checkpoints) if checkpoints is not None else []
    if not committed:
        return f"{left}, and no checkpoint was saved"
    return f"{left}; run again with hydra.run.dir={run_dir} to resume from {committed[-1][1]}"


def data_changed_report(run_dir: Path, cfg: Config, e: Exception | str) -> str:
    """One line: which data file changed (or which folder was deleted), and which checkpoints the
    run keeps."""
    from framework.checkpoint import store
    from framework.config.run_values import checkpoint_root

    committed = store.committed(checkpoint_root(cfg.checkpoint, run_dir)) if cfg.checkpoint.enabled else []
    if not committed:
        return f"{e}; no checkpoint is left" if cfg.checkpoint.enabled else f"{e}; checkpointing was off"
    return f"{e}; the checkpoints up to step {committed[-1][0]} are kept ({committed[-1][1].parent})"


def preemption(run_dir: Path, since: float) -> dict | None:
    """The ``preempted`` event this launch's ranks logged (None: they stopped without one)."""
    from framework.record.metrics import read_metrics

    rows = [r for r in read_metrics(run_dir) if r.get("event") == "preempted" and r.get("time", 0) >= since]
    return rows[-1] if rows else None


def stop_report(run_dir: Path, cfg: Config, stop: dict | None, signum: int | None = None) -> str:
    """The one true line about a stop by a signal: which checkpoint exists now, and how to resume."""
    from framework.checkpoint import store
    from framework.config.run_values import checkpoint_root

    name = f"signal {signum}" if signum is not None else "a signal"
    if signum == 2:
        name += " (SIGINT: Ctrl-C)"
    root = checkpoint_root(cfg.checkpoint, run_dir)
    if stop is not None and stop.get("saved"):
        path = store.step_dir(root, int(stop["step"]))
        return (
            f"stopped by {name}: the ranks saved a checkpoint at step {stop['step']} ({path}); "
            f"run again with hydra.run.dir={run_dir} to resume"
        )
    committed = store.committed(root) if cfg.checkpoint.enabled else []
    latest = f"the latest checkpoint is {committed[-1][1]}" if committed else "there is no checkpoint"
    if not cfg.checkpoint.enabled:
        why = "checkpointing is off (checkpoint=final|sync|async saves on a signal)"
    elif stop is None:
        why = "the ranks stopped before they agreed on a step to save"
    else:
        why = f"the save at step {stop['step']} failed: {stop.get('detail', '')}"
    return f"stopped by {name}: no checkpoint was saved at the stop ({why}); {latest}"


def failed_saves(run_dir: Path) -> str | None:
    """Why this run must not exit 0: it checkpointed, and every one of its saves failed."""
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        return None
    ck = json.loads(summary_path.read_text()).get("checkpoint") or {}
    if ck.get("failed") and not ck.get("saved"):
        return (
            f"every checkpoint save of this run failed ({ck['failed']} of {ck['failed']}; see "
            f"summary.json): {ck.get('last_error')}"
        )
    return None


def check_saves(run_dir: Path) -> float | None:
    failed = failed_saves(run_dir)
    if failed:
        raise JobFailed(failed, 1)
    return run_result(run_dir)


def run_result(run_dir: Path) -> float | None:
    """The job's objective (final val loss, else train loss): what Hydra's sweepers (Optuna) minimise."""
    summary_path = run_dir / "summary.json"
    return sweep.objective(json.loads(summary_path.read_text())) if summary_path.is_file() else None


def link_latest(run_dir: Path) -> Path | None:
    """``outputs/latest`` -> the newest run dir, for a run dir under a folder named ``outputs`` (the
    default ``hydra.run.dir`` is ``outputs/DATE/TIME-ID``, two levels down; elsewhere nothing is
    written outside the run dir). The link is relative (``DATE/TIME-ID``): the tree can move.

    Rank 0 only; atomic: a new link under a temporary name replaces the old one (``os.replace``), so
    a reader never sees it missing. A ``latest`` that is not a symlink (a user's folder) is kept."""
    path = run_dir.resolve()
    root = next((p for p in path.parents[:2] if p.name == "outputs"), None)
    if root is None or os.environ.get("RANK", "0") != "0":
        return None
    latest = root / "latest"
    if latest.exists() and not latest.is_symlink():
        log.warning("not linking %s: it exists and is not a symlink", latest)
        return None
    tmp = root / f".latest.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(path.relative_to(root))
    os.replace(tmp, latest)
    return latest


def finish_run(run_dir: Path, cfg: Config) -> None:
    """Rank 0, after training: ``outputs/latest``, the run's PNG, and its path in ``summary.json``."""
    link_latest(run_dir)
    summary_path = run_dir / "summary.json"
    if not cfg.logger.plot or not summary_path.is_file():
        return
    from framework.train.plots import plot_run

    try:
        plot = plot_run(run_dir)
    except ValueError as e:  # no loss rows (e.g. zero steps): nothing to draw
        log.warning("no plot: %s", e)
        return
    info = json.loads(summary_path.read_text())
    info["plot"] = str(plot)
    summary_path.write_text(json.dumps(info, indent=2) + "\n")
    log.info("plot: %s", plot)
