"""Performance baselines: a JSON store of reference figures, and the regression comparison.

A baseline is only comparable with a run of the same shape on the same hardware, so the key is
(model name, mesh shape, sharding, executor, device name, world size). The store is one JSON file
(default ``outputs/baselines.json``), rewritten atomically (write to a temporary file, rename), so
a crash while saving never leaves half a file.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from framework.config.schema import ExecutorMode, VerifyConfig
from framework.planner.layout import Degrees
from framework.verify.report import CheckResult

DEFAULT_STORE = Path("outputs") / "baselines.json"
STORE_VERSION = 1


@dataclass
class PerfFigures:
    """Figures of the post-warm-up steps of a run (step times in seconds)."""

    step_p50_s: float
    step_p99_s: float
    tokens_per_s: float
    mfu: float | None = None
    peak_mem_gib: float | None = None


def device_name(device: torch.device) -> str:
    """The device model, part of a baseline's key."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in [0, 100]); with few steps p99 is the slowest step."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def perf_figures(
    step_seconds: list[float], tokens_per_step: int, mfu: float | None, peak_mem_gib: float | None
) -> PerfFigures | None:
    """From the post-warm-up step times; None when there are none (a run shorter than its warm-up)."""
    if not step_seconds:
        return None
    tps = tokens_per_step * len(step_seconds) / sum(step_seconds)
    return PerfFigures(percentile(step_seconds, 50), percentile(step_seconds, 99), tps, mfu, peak_mem_gib)


def baseline_key(
    model_name: str,
    mesh_shape: Sequence[int],
    layout: Degrees,
    world_size: int,
    device_name: str,
    executor: ExecutorMode,
) -> str:
    """The store key: the model's name, the declared ``mesh.shape``, ``layout`` (the plan's,
    ``Plan.layout``), the device, the world and ``executor``, the mode that actually ran (after a
    fallback: the configured one until then)."""
    mode = executor.value
    sharding = layout.name() + (f"-tp{layout.tp}" if layout.tp > 1 else "")
    mesh = "x".join(str(s) for s in mesh_shape)
    return "|".join(
        (
            model_name,
            f"mesh={mesh}",
            sharding,
            mode,
            device_name,
            f"world={world_size}",
        )
    )


def store_path(cfg: VerifyConfig) -> Path:
    return Path(cfg.baseline) if cfg.baseline else DEFAULT_STORE


def load_store(path: Path) -> dict[str, Any]:
    """The store's ``{key: entry}`` mapping ({} when the file does not exist). ValueError (one line)
    for a file that is not such a store: each entry's figures are checked here, so that the launcher
    (framework.launch.prelaunch.check_verify_files) refuses a broken store before training, not in a
    traceback after it (a list, a wrong version, an entry without its figures were)."""
    if not path.is_file():
        return {}
    where = f"verify.baseline={str(path)!r}"
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{where} is not a baseline store (not JSON: {e})") from None
    if (
        not isinstance(doc, dict)
        or doc.get("version") != STORE_VERSION
        or not isinstance(doc.get("baselines"), dict)
    ):
        raise ValueError(
            f"{where} is not a baseline store; valid: a JSON object {{'version': {STORE_VERSION}, "
            "'baselines': {KEY: {'figures': {...}}}}, as verify.save_baseline=true writes it"
        )
    for key, entry in doc["baselines"].items():
        why = _entry_error(entry)
        if why is not None:
            raise ValueError(
                f"{where}: its entry {key[:80]!r} {why}; valid: an entry verify.save_baseline=true wrote"
            )
    return doc["baselines"]


def _entry_error(entry: Any) -> str | None:
    """Why a store entry cannot be compared with (None: it can): its ``figures`` must be exactly
    PerfFigures' fields, finite numbers, step times and tokens/s above 0 (compare_perf divides by them)."""
    figures = entry.get("figures") if isinstance(entry, dict) else None
    if not isinstance(figures, dict):
        return "has no figures"
    fields = {f for f in PerfFigures.__dataclass_fields__}
    needed = {"step_p50_s", "step_p99_s", "tokens_per_s"}
    if not needed <= figures.keys() or not figures.keys() <= fields:
        return f"has figures {sorted(figures)[:8]}, not {sorted(fields)}"
    for name, value in figures.items():
        number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if not (number or (value is None and name not in needed)) or (name in needed and value <= 0):
            return f"has {name}={value!r}, not a finite number > 0"
    return None


def load_baseline(path: Path, key: str) -> PerfFigures | None:
    entry = load_store(path).get(key)
    return None if entry is None else PerfFigures(**entry["figures"])


def save_baseline(path: Path, key: str, figures: PerfFigures, meta: dict[str, Any]) -> None:
    """Record (or replace) the baseline under ``key``, keeping all other entries."""
    baselines = load_store(path)
    baselines[key] = {"figures": asdict(figures), "recorded": time.time(), **meta}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(
        json.dumps({"version": STORE_VERSION, "baselines": baselines}, indent=2, sort_keys=True) + "\n"
    )
    os.replace(tmp, path)


def compare_perf(current: PerfFigures, baseline: PerfFigures | None, cfg: VerifyConfig) -> CheckResult:
    """Regressions beyond the thresholds: tokens/s drop, p99 step-time rise, peak-memory rise."""
    figures: dict[str, Any] = {f"current_{k}": v for k, v in asdict(current).items()}
    if baseline is None:
        return CheckResult(
            "performance",
            None,
            "no baseline for this key (record one with verify.save_baseline=true)",
            figures,
        )
    figures |= {f"baseline_{k}": v for k, v in asdict(baseline).items()}
    bad = []
    tps_ratio = current.tokens_per_s / baseline.tokens_per_s
    figures["tokens_per_s_ratio"] = tps_ratio
    if tps_ratio < 1.0 - cfg.max_tokens_per_s_drop:
        bad.append(
            f"tokens/s {current.tokens_per_s:,.0f} is {1 - tps_ratio:.1%} below the baseline "
            f"{baseline.tokens_per_s:,.0f} (threshold {cfg.max_tokens_per_s_drop:.0%})"
        )
    p99_ratio = current.step_p99_s / baseline.step_p99_s
    figures["p99_ratio"] = p99_ratio
    if p99_ratio > 1.0 + cfg.max_p99_increase:
        bad.append(
            f"p99 step time {current.step_p99_s * 1e3:.1f} ms is {p99_ratio - 1:.1%} above the baseline "
            f"{baseline.step_p99_s * 1e3:.1f} ms (threshold {cfg.max_p99_increase:.0%})"
        )
    if current.peak_mem_gib is not None and baseline.peak_mem_gib:
        mem_ratio = current.peak_mem_gib / baseline.peak_mem_gib
        figures["memory_ratio"] = mem_ratio
        if mem_ratio > 1.0 + cfg.max_memory_increase:
            bad.append(
                f"peak memory {current.peak_mem_gib:.2f} GiB is {mem_ratio - 1:.1%} above the baseline "
                f"{baseline.peak_mem_gib:.2f} GiB (threshold {cfg.max_memory_increase:.0%})"
            )
    return CheckResult("performance", not bad, "\n".join(bad), figures)
