"""PNG plots of a run (loss, tokens/s, learning rate, gradient norm, MFU, an MoE model's expert balance over
steps) and of a sweep (one bar group per job, and every job's loss curve on one axis).

matplotlib with the Agg backend: no display needed, works on every rank-0 host and in CI. The data
is read back from the run dir's ``metrics.jsonl``, so a plot can be (re)made after the fact:
``python -m framework.plots RUN_DIR``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from framework.record.metrics import read_metrics

RUN_PLOT = "metrics.png"
SWEEP_PLOT = "sweep_summary.png"


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None and "event" not in r]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def run_panels(rows: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """The panels of a run's PNG, (title, the metrics.jsonl keys drawn in it): loss (train,
    validation, each ``train.eval_sets`` set), tokens/s, then those measured: learning rate, gradient
    norm, MFU, the worst MoE layer's max/mean tokens per expert (1.0 = balanced)."""
    sets = sorted({k for r in rows for k in r if k.startswith("val_loss/")})
    panels = [("loss", ["loss", "val_loss", *sets]), ("tokens/s", ["tokens_per_s"])]
    optional = [("learning rate", "lr"), ("grad norm", "grad_norm"), ("MFU", "mfu")]
    optional.append(("experts max/mean", "moe_load_max"))  # an MoE family: its experts' balance
    for title, key in optional:
        if any(r.get(key) is not None and "event" not in r for r in rows):
            panels.append((title, [key]))
    return panels


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Write ``run_dir/metrics.png``, one panel per ``run_panels`` entry.

    Raises ValueError when the run dir has no metrics rows (nothing to plot).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    if not any("loss" in r or "val_loss" in r for r in rows):
        raise ValueError(f"no loss rows in {run_dir / 'metrics.jsonl'}: nothing to plot")
    panels = run_panels(rows)
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 2.6 * len(panels)), sharex=True, squeeze=False)
    for ax, (title, keys) in zip(axes[:, 0], panels, strict=True):
        for key in keys:
            steps, values = _series(rows, key)
            if steps:
                marker = "o" if key.startswith("val_loss") else None
                ax.plot(steps, values, marker=marker, markersize=3, label=key)
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend()
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    path = out or run_dir / RUN_PLOT
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def sweep_curves(jobs: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """Each job's training loss over steps (label -> (steps, losses)), read from its run dir's
    metrics.jsonl; a job without a run dir or loss rows has none."""
    curves = {}
    for j in jobs:
        steps, losses = _series(read_metrics(Path(j["run_dir"])), "loss") if j.get("run_dir") else ([], [])
        if steps:
            curves[f"#{j['job']} {j['overrides']}"] = (steps, losses)
    return curves


def plot_sweep(jobs: list[dict[str, Any]], out: Path) -> Path:
    """A comparison PNG of a sweep's jobs: final loss, val loss, tokens/s, MFU (bars, one per job),
    and below them the jobs' loss curves on one axis (``sweep_curves``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in ("final_loss", "final_val_loss", "tokens_per_s", "mfu") if any(j.get(k) for j in jobs)]
    keys = keys or ["final_loss"]
    labels = [f"#{j['job']} {j['overrides']}" for j in jobs]
    curves = sweep_curves(jobs)
    bars_h = 0.45 * len(jobs) + 1.6
    fig = plt.figure(figsize=(3.2 * len(keys) + 2, bars_h + (3.2 if curves else 0)))
    grid = fig.add_gridspec(2 if curves else 1, len(keys), height_ratios=[bars_h, 3.2] if curves else None)
    axes = [[fig.add_subplot(grid[0, i]) for i in range(len(keys))]]
    if curves:
        ax = fig.add_subplot(grid[1, :])
        for label, (steps, losses) in curves.items():
            ax.plot(steps, losses, label=label)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax, key in zip(axes[0], keys, strict=True):
        values = [float(j.get(key) or 0.0) for j in jobs]
        colors = ["tab:blue" if j.get("status") != "failed" else "tab:red" for j in jobs]
        ax.barh(range(len(jobs)), values, color=colors)
        ax.set_title(key)
        ax.set_yticks(range(len(jobs)), labels if ax is axes[0][0] else [""] * len(jobs), fontsize=7)
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(plot_run(Path(arg)))
