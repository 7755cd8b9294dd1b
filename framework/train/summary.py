"""The run's summary: the figures ``finish`` gathers (``Summary``), written by rank 0 as
summary.json and as the few lines the log ends with (``write_summary``).
"""

from __future__ import annotations

import json
import logging
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning_utilities.core.rank_zero import rank_zero_only

from framework.parallel.process import DistEnv
from framework.record.metrics import perplexity
from framework.verify.baseline import device_name

log = logging.getLogger("framework")


@dataclass
class Summary:
    steps: int = 0
    final_loss: float | None = None
    final_val_loss: float | None = None
    first_val_loss: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    peak_mem_gib: float | None = None
    time_to_first_step_s: float | None = None
    # The first step's own time less the median step: torch.compile (and CUDA graph capture) time.
    compile_s: float | None = None
    train_time_s: float = 0.0
    skipped_steps: int = 0
    step_p50_s: float | None = None
    step_p99_s: float | None = None
    # The time the loop waited for its batches (framework.data's ``last_wait_s``) over the warm steps:
    # per step, and as a share of the step time (an upper bound of the device's idle time: on CUDA
    # the host waits while the previous step still runs).
    data_wait_ms: float | None = None
    data_wait_share: float | None = None
    executor: str | None = None  # the executor the run ended on (after any fallback)
    # Every event row of this launch's metrics.jsonl ("step N: event: detail"): fallbacks, resumes,
    # rejected checkpoints, failed saves, preemption.
    events: list[str] = field(default_factory=list)
    # checkpoint=...: saves committed and failed, the last failure, the newest committed checkpoint
    # (None with checkpoint=none).
    checkpoint: dict[str, Any] | None = None
    # executor.cache_dir: artifacts loaded / saved, Inductor FX-graph cache hits / misses (rank 0).
    compile_cache: dict[str, int] | None = None


@rank_zero_only
def write_summary(run_dir: Path, summary: Summary, digest: str, env: DistEnv) -> None:
    info = {
        **summary.__dict__,
        "config_hash": digest,
        "world_size": env.world_size,
        "device": str(env.device),
        "device_name": device_name(env.device),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    (run_dir / "summary.json").write_text(json.dumps(info, indent=2) + "\n")
    lines = [f"run dir: {run_dir}", f"steps: {summary.steps} in {summary.train_time_s:.1f}s"]
    if summary.first_val_loss is not None and summary.final_val_loss is not None:
        lines.append(
            f"val loss: {summary.first_val_loss:.4f} -> {summary.final_val_loss:.4f}"
            f" (perplexity {perplexity(summary.final_val_loss):.2f})"
        )
    if summary.final_loss is not None:
        lines.append(f"final train loss: {summary.final_loss:.4f}")
    latest = (summary.checkpoint or {}).get("latest")
    if latest:  # the first model a user trains is one command away from use
        lines.append(
            f"checkpoint: {latest} (use it: python -m framework generate {run_dir} --prompt 'def '; "
            f"python -m framework export-hf {run_dir} OUT)"
        )
    if summary.tokens_per_s:
        lines.append(f"throughput: {summary.tokens_per_s:,.0f} tokens/s")
    if summary.data_wait_share is not None:
        lines.append(
            f"data wait: {summary.data_wait_ms:.2f} ms/step ({summary.data_wait_share:.2%} of the step time)"
        )
    if summary.mfu is not None:
        lines.append(f"MFU: {summary.mfu:.1%}")
    if summary.time_to_first_step_s is not None:
        lines.append(f"time to first step: {summary.time_to_first_step_s:.1f}s")
    if summary.compile_s is not None:
        lines.append(f"compile (first step less a median step): {summary.compile_s:.1f}s")
    if summary.compile_cache is not None:
        c = summary.compile_cache
        lines.append(
            f"compile cache: {c['loaded']} artifacts loaded, {c['hits']} graph hits, {c['misses']} misses, "
            f"{c['saved']} saved"
        )
    log.info("summary:\n  %s", "\n  ".join(lines))
