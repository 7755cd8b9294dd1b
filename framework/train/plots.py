"""PNG plots of a run (loss, tokens/s, MFU, an MoE model's expert balance over steps) and of a sweep (one bar group per job).

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


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Write ``run_dir/metrics.png``: loss (train and validation), tokens/s, and MFU and the worst MoE
    layer's max/mean tokens per expert (1.0 = balanced) when present.

    Raises ValueError when the run dir has no metrics rows (nothing to plot).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    if not any("loss" in r or "val_loss" in r for r in rows):
        raise ValueError(f"no loss rows in {run_dir / 'metrics.jsonl'}: nothing to plot")
    # train.eval_sets: each named set is a line of its own.
    sets = sorted({k for r in rows for k in r if k.startswith("val_loss/")})
    panels = [("loss", ["loss", "val_loss", *sets]), ("tokens/s", ["tokens_per_s"])]
    if any(r.get("mfu") is not None for r in rows):
        panels.append(("MFU", ["mfu"]))
    if any(r.get("moe_load_max") is not None for r in rows):  # an MoE family: its experts' balance
        panels.append(("experts max/mean", ["moe_load_max"]))
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


def plot_sweep(jobs: list[dict[str, Any]], out: Path) -> Path:
    """A comparison PNG of a sweep's jobs: final loss, val loss, tokens/s, MFU (bars, one per job)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in ("final_loss", "final_val_loss", "tokens_per_s", "mfu") if any(j.get(k) for j in jobs)]
    keys = keys or ["final_loss"]
    labels = [f"#{j['job']} {j['overrides']}" for j in jobs]
    fig, axes = plt.subplots(
        1, len(keys), figsize=(3.2 * len(keys) + 2, 0.45 * len(jobs) + 1.6), squeeze=False
    )
    for ax, key in zip(axes[0], keys, strict=True):
        values = [float(j.get(key) or 0.0) for j in jobs]
        colors = ["tab:blue" if j.get("status") != "failed" else "tab:red" for j in jobs]
        ax.barh(range(len(jobs)), values, color=colors)
        ax.set_title(key)
        ax.set_yticks(range(len(jobs)), labels if ax is axes[0, 0] else [""] * len(jobs), fontsize=7)
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(plot_run(Path(arg)))
