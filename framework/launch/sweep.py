"""Multirun sweeps: a stable sweep dir, per-job markers, resume, and the summary at the end.

``python train.py -m sharding=ddp,fsdp mesh=2,4`` runs each job as a full multi-rank job (the
launching process self-launches the job's ranks and waits for them before the next job starts).

- Stable sweep dir: ``multirun/sweep-<hash>``, the hash of the command line's overrides as a set
  (``-m`` left out, order ignored), unless ``hydra.sweep.dir`` is set. Re-running the same command,
  or the same overrides in another order, finds the same dir.
- Job marker: each job's dir holds ``job.json`` (its overrides, status: running, ok, failed,
  skipped, and the sha256 of its resolved ``config.yaml``). A job is skipped on a re-run when a job
  of the sweep dir (or an attempt set aside there) completed with the same resolved config and left
  a ``summary.json``: an edited recipe, or any change that reaches the config, reruns the job;
  reordered overrides (which renumber the jobs) rerun nothing, the skipped job's dir gets a copy of
  the summary and ``result_of`` names where it was computed. Failed and missing jobs run again.
  Start afresh with another ``hydra.sweep.dir`` or by deleting the sweep dir.
- ``SweepSummary`` (a Hydra callback, ``hydra.callbacks.sweep_summary`` in conf/config.yaml) writes
  ``sweep_summary.csv``, ``sweep_summary.md`` and ``sweep_summary.png`` into the sweep dir when the
  sweep ends, and exits non-zero when a job failed.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("framework")
JOB_FILE = "job.json"
SWEEP_ID_ENV = "FRAMEWORK_SWEEP_ID"
COLUMNS = (
    "job",
    "overrides",
    "status",
    "final_loss",
    "final_val_loss",
    "tokens_per_s",
    "mfu",
    "peak_mem_gib",
    "train_time_s",
    "run_dir",
    "plot",
)


def sweep_id(argv: list[str] | None = None) -> str:
    """``sweep-<hash of the overrides>``: the same overrides give the same sweep dir (see module doc).

    Set once per launch and exported, so that processes the launcher starts (submitit jobs) agree.
    """
    if argv is None and os.environ.get(SWEEP_ID_ENV):
        return os.environ[SWEEP_ID_ENV]
    # Sorted: reordering the overrides renumbers the jobs but changes no job's config, and jobs are
    # matched by their resolved config (``completed``), not by their number.
    args = sorted(a for a in (sys.argv[1:] if argv is None else argv) if a not in ("-m", "--multirun"))
    value = "sweep-" + hashlib.sha256("\0".join(args).encode()).hexdigest()[:12]
    if argv is None:
        os.environ[SWEEP_ID_ENV] = value
    return value


def register_resolver() -> None:
    if not OmegaConf.has_resolver("sweep_id"):
        OmegaConf.register_new_resolver("sweep_id", sweep_id, use_cache=True)


def read_job(job_dir: Path) -> dict[str, Any] | None:
    path = job_dir / JOB_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def write_job(job_dir: Path, overrides: list[str], status: str, **extra: Any) -> None:
    """Record a job's status (atomically: a crash never leaves half a marker)."""
    info = {"overrides": list(overrides), "status": status, "time": round(time.time(), 3), **extra}
    tmp = job_dir / (JOB_FILE + ".tmp")
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    tmp.replace(job_dir / JOB_FILE)


def completed(job_dir: Path, config_sha256: str) -> tuple[dict[str, Any], Path] | None:
    """(summary, where) of a job of this sweep that completed with this resolved config, else None.

    Looks in ``job_dir`` first, then every other job dir of the sweep and the attempts set aside in
    them (reordered overrides put a config under another job number).
    """
    sweep_dir = job_dir.parent
    dirs = [job_dir, *sorted(p for p in sweep_dir.iterdir() if p.is_dir() and p != job_dir)]
    for d in dirs:
        attempts = d / "attempts"
        for candidate in [d, *(sorted(attempts.iterdir()) if attempts.is_dir() else [])]:
            job = read_job(candidate)
            summary = candidate / "summary.json"
            if (
                job is not None
                and job.get("status") in ("ok", "skipped")
                and job.get("config_sha256") == config_sha256
                and summary.is_file()
            ):
                return json.loads(summary.read_text()), candidate
    return None


def record_skip(job_dir: Path, overrides: list[str], config_sha256: str, source: Path) -> None:
    """Mark ``job_dir`` skipped; when the result lives elsewhere, set this dir's own earlier results
    aside (they stay findable) and copy the summary in, so the sweep summary reads it here."""
    if source != job_dir:
        set_aside_previous_attempt(job_dir)
        shutil.copyfile(source / "summary.json", job_dir / "summary.json")
    write_job(job_dir, overrides, "skipped", config_sha256=config_sha256, result_of=str(source))


def set_aside_previous_attempt(job_dir: Path) -> Path | None:
    """Move a failed (or different) earlier attempt's results into ``attempts/N/`` before a rerun.

    metrics.jsonl is appended to, so a rerun in place would mix two attempts' rows; checkpoints stay
    where they are, so ``checkpoint.resume=auto`` continues from them.
    """
    if read_job(job_dir) is None:
        return None
    attempts = job_dir / "attempts"
    dest = attempts / str(len(list(attempts.iterdir())) if attempts.is_dir() else 0)
    dest.mkdir(parents=True)
    for name in (JOB_FILE, "metrics.jsonl", "summary.json", "metrics.png"):
        if (job_dir / name).exists():
            (job_dir / name).replace(dest / name)
    return dest


def skip_if_completed(
    job_dir: Path, overrides: list[str], config_sha256: str, rank: int
) -> tuple[float | None] | None:
    """(the job's objective,) when the same resolved config completed in a previous run of this sweep
    (rank 0 records the skip); None when the job must run. Keyed on the resolved config: an edited
    recipe reruns, reordered overrides do not."""
    done = completed(job_dir, config_sha256)
    if done is None:
        return None
    summary, source = done
    if rank == 0:
        record_skip(job_dir, overrides, config_sha256, source)
    log.info(
        "job %s: skipped, the same resolved config completed in a previous run of this sweep (%s)",
        job_dir.name,
        source,
    )
    return (objective(summary),)


def record_failure(job_dir: Path, overrides: list[str], marked: bool, error: str) -> None:
    """A job that failed (a refusal or an exception): its earlier attempt set aside unless this one
    already did when it marked itself running, then ``job.json`` says ``failed`` and why."""
    if not marked:
        set_aside_previous_attempt(job_dir)
    write_job(job_dir, overrides, "failed", error=error)


def objective(summary: dict[str, Any]) -> float | None:
    """What a job returns to the sweeper (Optuna minimises it): the final validation loss, else train loss."""
    value = summary.get("final_val_loss")
    return value if value is not None else summary.get("final_loss")


def collect(sweep_dir: Path, since: float = 0.0) -> list[dict[str, Any]]:
    """One row per job dir of the sweep touched since ``since`` (jobs of this invocation)."""
    jobs = []
    for job_dir in sorted(
        (p for p in sweep_dir.iterdir() if p.is_dir()), key=lambda p: (len(p.name), p.name)
    ):
        hydra_overrides = job_dir / ".hydra" / "overrides.yaml"
        if not hydra_overrides.is_file():
            continue
        marker = read_job(job_dir)
        stamp = (job_dir / JOB_FILE).stat().st_mtime if marker else hydra_overrides.stat().st_mtime
        if stamp < since:
            continue
        overrides = marker["overrides"] if marker else list(OmegaConf.load(hydra_overrides))
        summary_path = job_dir / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        status = marker["status"] if marker else "failed"
        if status == "running":  # the job's process died without recording an end
            status = "failed"
        row: dict[str, Any] = {"job": job_dir.name, "overrides": " ".join(overrides), "status": status}
        for key in COLUMNS[3:9]:
            row[key] = summary.get(key) if status != "failed" else None
        row["run_dir"] = str(job_dir.resolve())
        row["plot"] = summary.get("plot") if status != "failed" else None
        if marker and marker.get("error"):
            row["error"] = marker["error"]
        jobs.append(row)
    return jobs


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


def write_summary(sweep_dir: Path, jobs: list[dict[str, Any]]) -> list[Path]:
    """``sweep_summary.csv``, ``sweep_summary.md`` and ``sweep_summary.png`` in the sweep dir."""
    from framework.train.plots import SWEEP_PLOT, plot_sweep

    csv_path, md_path = sweep_dir / "sweep_summary.csv", sweep_dir / "sweep_summary.md"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(COLUMNS), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(jobs)
    # The table and the plot show what differs between jobs; the CSV keeps every override.
    common = set.intersection(*(set(j["overrides"].split()) for j in jobs)) if len(jobs) > 1 else set()
    shown = [{**j, "overrides": " ".join(o for o in j["overrides"].split() if o not in common)} for j in jobs]
    lines = [
        f"# Sweep {sweep_dir}",
        "",
        f"Overrides of every job: `{' '.join(sorted(common))}`" if common else "",
        "",
        "| " + " | ".join(COLUMNS[:9]) + " |",
        "|" + "---|" * 9,
    ]
    lines += ["| " + " | ".join(_fmt(j.get(c)) for c in COLUMNS[:9]) + " |" for j in shown]
    errors = [f"- job {j['job']}: {j['error']}" for j in jobs if j.get("error")]
    if errors:
        lines += ["", "Failures:", *errors]
    md_path.write_text("\n".join(lines) + "\n")
    paths = [csv_path, md_path]
    if jobs:
        paths.append(plot_sweep(shown, sweep_dir / SWEEP_PLOT))
    return paths


class SweepSummary(Callback):
    """Hydra callback: at the end of a multirun, summarise every job of the sweep dir."""

    def __init__(self) -> None:
        self.started = 0.0

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # 1 s of slack: file mtimes can be coarser than time.time().
        self.started = time.time() - 1.0

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not sweep_dir.is_dir():
            return
        jobs = collect(sweep_dir, self.started)
        paths = write_summary(sweep_dir, jobs)
        counts = {s: sum(j["status"] == s for j in jobs) for s in ("ok", "skipped", "failed")}
        log.info(
            "sweep summary (%d ok, %d skipped, %d failed): %s",
            counts["ok"],
            counts["skipped"],
            counts["failed"],
            ", ".join(str(p) for p in paths),
        )
        if counts["failed"]:
            print(f"error: {counts['failed']} sweep job(s) failed; see {paths[1]}", file=sys.stderr)
            sys.exit(1)
