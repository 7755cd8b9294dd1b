"""Side-by-side comparison of two run dirs: graph, config, loss curve, performance.

Reads only the files every run writes (config.yaml, metrics.jsonl, summary.json, and
frozen/fingerprint.json or verification.json when present), so it works on runs from any machine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from framework.config.schema import flatten
from framework.freeze import graph_diff, load_fingerprint
from framework.record.metrics import read_metrics
from framework.verify.consistency import FINGERPRINT_PATH
from framework.verify.report import read_report

PERF_KEYS = (
    "tokens_per_s",
    "mfu",
    "peak_mem_gib",
    "step_p50_s",
    "step_p99_s",
    "time_to_first_step_s",
    "train_time_s",
    "steps",
    "skipped_steps",
)


def _check_run_dir(run: Path) -> None:
    if not (run / "config.yaml").is_file():
        raise ValueError(f"{run} is not a run dir (no config.yaml); pass the directories that train.py wrote")


def config_diff(a: Path, b: Path) -> list[tuple[str, Any, Any]]:
    fa = flatten(OmegaConf.to_container(OmegaConf.load(a / "config.yaml")))
    fb = flatten(OmegaConf.to_container(OmegaConf.load(b / "config.yaml")))
    return [(k, fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]


def _fingerprint(run: Path) -> tuple[str | None, list | None]:
    path = run / FINGERPRINT_PATH
    if path.is_file():
        return load_fingerprint(path)
    report = read_report(run) or {}
    for check in report.get("checks", []):
        if check["figures"].get("fingerprint"):
            return check["figures"]["fingerprint"], None
    return None, None


def graph_section(a: Path, b: Path) -> str:
    fa, sa = _fingerprint(a)
    fb, sb = _fingerprint(b)
    if fa is None or fb is None:
        return "not recorded in " + " and ".join(str(r) for r, f in ((a, fa), (b, fb)) if f is None)
    if fa == fb:
        return f"equal ({fa[:16]})"
    if sa is not None and sb is not None:
        return graph_diff(sa, sb)
    return f"differ: {fa[:16]} vs {fb[:16]} (node lists not saved: run with freeze=export for the diff)"


def loss_figures(a: Path, b: Path) -> dict[str, Any]:
    la = {r["step"]: r["loss"] for r in read_metrics(a) if r.get("loss") is not None}
    lb = {r["step"]: r["loss"] for r in read_metrics(b) if r.get("loss") is not None}
    common = sorted(set(la) & set(lb))
    out: dict[str, Any] = {}
    for name, curve in (("a", la), ("b", lb)):
        if curve:
            out[f"final_{name}"] = curve[max(curve)]
            out[f"min_{name}"] = min(curve.values())
    out["common_steps"] = len(common)
    if common:
        diffs = [abs(la[s] - lb[s]) for s in common]
        worst = max(range(len(common)), key=lambda i: diffs[i])
        out["max_abs_diff"] = diffs[worst]
        out["max_abs_diff_step"] = common[worst]
    return out


def perf_rows(a: Path, b: Path) -> list[tuple[str, Any, Any]]:
    def load(run: Path) -> dict[str, Any]:
        path = run / "summary.json"
        return json.loads(path.read_text()) if path.is_file() else {}

    sa, sb = load(a), load(b)
    return [(k, sa.get(k), sb.get(k)) for k in PERF_KEYS if k in sa or k in sb]


def _cell(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else "-" if v is None else str(v)


def compare_runs(a: Path, b: Path) -> str:
    """The report as Markdown. Raises ValueError when either path is not a run dir."""
    a, b = Path(a), Path(b)
    _check_run_dir(a)
    _check_run_dir(b)
    lines = [f"# Compare\n\na: `{a}`\nb: `{b}`\n", "## Graph\n", graph_section(a, b), "", "## Config\n"]
    diff = config_diff(a, b)
    if diff:
        lines += ["| key | a | b |", "|---|---|---|"] + [
            f"| {k} | {_cell(x)} | {_cell(y)} |" for k, x, y in diff
        ]
    else:
        lines.append("identical")
    lines += ["", "## Loss\n"]
    lines += [f"- {k}: {_cell(v)}" for k, v in loss_figures(a, b).items()]
    lines += ["", "## Performance\n", "| figure | a | b | b/a |", "|---|---|---|---|"]
    for k, x, y in perf_rows(a, b):
        ratio = f"{y / x:.3f}" if isinstance(x, (int, float)) and isinstance(y, (int, float)) and x else "-"
        lines.append(f"| {k} | {_cell(x)} | {_cell(y)} | {ratio} |")
    return "\n".join(lines) + "\n"
