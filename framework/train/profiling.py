"""``run.profile=true``: a torch.profiler trace of a window of steps, and the top operators by time.

The window is ``torch.profiler.schedule(wait, warmup, active, repeat=1)``: the first steps (compile,
allocator warm-up) are skipped, then ``active`` steps are recorded once. When the window closes the
trace is written as Chrome JSON to ``<run dir>/profile/trace_rank<R>.json`` (open it in
chrome://tracing or https://ui.perfetto.dev) and the top operators to ``top_ops_rank<R>.json``.
Rank 0 only by default; ``run.profile_ranks=all`` records every rank (each writes its own files).
The loop drives it as a callback (``Profiling``, conf/callbacks/profiler.yaml).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, schedule

from framework.config.schema import ProfileRanks, RunConfig
from framework.train.callbacks import Callback, RunContext

log = logging.getLogger("framework")
PROFILE_DIR = "profile"


class NullProfiler:
    """What ``make_profiler`` returns when this rank does not profile: every call does nothing."""

    def __enter__(self) -> NullProfiler:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def step(self) -> None:
        return None

    def top_operators(self, n: int = 10) -> list[dict[str, Any]]:
        return []


class StepProfiler:
    """A context manager around the training loop; call ``step()`` once per optimizer step."""

    def __init__(self, cfg: RunConfig, out_dir: Path, rank: int) -> None:
        for name in ("profile_wait", "profile_warmup", "profile_active"):
            if getattr(cfg, name) < (1 if name == "profile_active" else 0):
                raise ValueError(
                    f"run.{name}={getattr(cfg, name)}: must be >= {1 if name == 'profile_active' else 0}"
                )
        self.out_dir = out_dir
        self.rank = rank
        self.trace_path = out_dir / f"trace_rank{rank}.json"
        self.top_path = out_dir / f"top_ops_rank{rank}.json"
        self._top: list[dict[str, Any]] = []
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(
            activities=activities,
            schedule=schedule(
                wait=cfg.profile_wait, warmup=cfg.profile_warmup, active=cfg.profile_active, repeat=1
            ),
            on_trace_ready=self._on_trace_ready,
            record_shapes=False,
        )

    def _on_trace_ready(self, prof: profile) -> None:
        try:
            # No parents: a run dir deleted during the run must not come back for a trace (the run
            # stops at its next metrics write, framework.train.run_dir_watch).
            self.out_dir.mkdir(exist_ok=True)
        except OSError as e:
            log.warning("profile: trace of rank %d not written: %s", self.rank, e)
            return
        prof.export_chrome_trace(str(self.trace_path))
        self._top = top_operators(prof)
        self.top_path.write_text(json.dumps(self._top, indent=2) + "\n")
        log.info("profile: trace of rank %d in %s", self.rank, self.trace_path)

    def __enter__(self) -> StepProfiler:
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._prof.__exit__(*exc)

    def step(self) -> None:
        self._prof.step()

    def top_operators(self, n: int = 10) -> list[dict[str, Any]]:
        """The top operators of the recorded window (empty until the window has closed)."""
        return self._top[:n]


def make_profiler(cfg: RunConfig, run_dir: Path, rank: int) -> StepProfiler | NullProfiler:
    """The profiler this rank should run under (a no-op unless ``run.profile`` selects this rank)."""
    if not cfg.profile or (cfg.profile_ranks is ProfileRanks.rank0 and rank != 0):
        return NullProfiler()
    return StepProfiler(cfg, run_dir / PROFILE_DIR, rank)


class Profiling(Callback):
    """The shipped ``profiler`` callback: under ``run.profile`` (and a rank ``run.profile_ranks``
    selects) a ``StepProfiler`` from the loop's start to its finish, stepped after every optimizer
    step; rank 0 logs the top operators at the end."""

    def __init__(self) -> None:
        self.profiler: StepProfiler | None = None

    def on_resume(self, run: RunContext, step: int, extra: dict[str, Any]) -> None:
        chosen = make_profiler(run.cfg.run, run.run_dir, run.rank)
        if isinstance(chosen, StepProfiler):
            self.profiler = chosen.__enter__()

    def after_step(self, run: RunContext, step: int) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def on_finish(self, run: RunContext, summary: Any) -> None:
        prof = self.profiler
        self.close()
        if prof is not None and run.is_main and prof.top_operators():
            log.info("top operators (profiled steps):\n%s", format_top_operators(prof.top_operators(10)))

    def close(self) -> None:
        prof, self.profiler = self.profiler, None
        if prof is not None:
            prof.__exit__(None, None, None)


def top_operators(prof: profile, n: int = 15) -> list[dict[str, Any]]:
    """Operators by self time (device time when CUDA was recorded, else CPU), heaviest first."""
    events = prof.key_averages()
    use_device = any(getattr(e, "self_device_time_total", 0) > 0 for e in events)
    key = "self_device_time_total" if use_device else "self_cpu_time_total"
    # The device's total is its kernels' time: an operator's self device time is the kernels it launched,
    # which are rows of their own too, and annotations (ProfilerStep*, Optimizer.step#...) span them on
    # the device's timeline as well (counting all of them cut every share by 2-3x).
    kernels = (
        [
            e
            for e in events
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
        ]
        if use_device
        else events
    )
    total = sum(getattr(e, key) for e in kernels) or 1.0
    rows = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:n]
    return [
        {
            "name": e.key,
            "calls": e.count,
            "self_ms": getattr(e, key) / 1e3,
            "share": getattr(e, key) / total,
            "clock": "device" if use_device else "cpu",
        }
        for e in rows
    ]


def format_top_operators(rows: list[dict[str, Any]]) -> str:
    """One line per operator, for the run summary."""
    return "\n".join(f"{r['self_ms']:9.2f} ms {r['share']:6.1%} {r['calls']:6d}x  {r['name']}" for r in rows)
