"""Float8 loss parity: compare the loss curves of runs that differ only in ``model.float8``.

    python benchmarks/float8_parity.py --out parity.png bf16=RUN_DIR tensorwise=RUN_DIR rowwise=RUN_DIR

Reads each run's ``metrics.jsonl`` (the same seed and data, so the same batches at every step), draws
the training loss of all runs on one plot (and the validation loss where it was logged), and prints a
markdown table: the mean training loss of the last ``--last`` logged steps, the final validation
loss, and each one's relative difference from the first run (the bf16 reference). The issue's bar
is a final loss within 1% of bf16's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from framework.record.metrics import read_metrics  # noqa: E402


def curves(run: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    rows = read_metrics(run)
    train = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    return train, val


def table(runs: dict[str, Path], last: int) -> tuple[str, dict[str, tuple[float, float | None]]]:
    figures: dict[str, tuple[float, float | None]] = {}
    for name, run in runs.items():
        train, val = curves(run)
        if not train:
            raise ValueError(f"{run}: no loss rows in metrics.jsonl")
        cut = train[-1][0] - last
        tail = [loss for step, loss in train if step > cut]
        figures[name] = (statistics.mean(tail), val[-1][1] if val else None)
    ref_train, ref_val = next(iter(figures.values()))
    lines = [
        f"| numerics | train loss, mean of the last {last} steps | vs first | final val loss | vs first |",
        "|---|---|---|---|---|",
    ]
    for name, (tr, va) in figures.items():
        d_val = f"{(va - ref_val) / ref_val:+.2%}" if va is not None and ref_val else "-"
        lines.append(
            f"| {name} | {tr:.4f} | {(tr - ref_train) / ref_train:+.2%} | "
            f"{'-' if va is None else f'{va:.4f}'} | {d_val} |"
        )
    return "\n".join(lines), figures


def plot(runs: dict[str, Path], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_ratio) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=[3, 1])
    ref = dict(curves(next(iter(runs.values())))[0])
    for i, (name, run) in enumerate(runs.items()):
        train, val = curves(run)
        c = f"C{i}"
        ax.plot([s for s, _ in train], [v for _, v in train], color=c, label=f"{name} train", lw=1)
        if val:
            ax.plot([s for s, _ in val], [v for _, v in val], "o--", color=c, ms=3, label=f"{name} val")
        both = [(s, v / ref[s] - 1) for s, v in train if s in ref]
        ax_ratio.plot([s for s, _ in both], [100 * r for _, r in both], color=c, label=name, lw=1)
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    ax_ratio.axhline(1, color="grey", lw=0.5, ls=":")
    ax_ratio.axhline(-1, color="grey", lw=0.5, ls=":")
    ax_ratio.set_ylabel("train loss vs first, %")
    ax_ratio.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="NAME=RUN_DIR, the bf16 reference first")
    p.add_argument("--out", type=Path, required=True, help="the comparison PNG")
    p.add_argument("--last", type=int, default=50, help="steps averaged for the final training loss")
    p.add_argument("--title", default="float8 vs bf16: training loss, same seed and data")
    args = p.parse_args()
    runs = {}
    for item in args.runs:
        name, sep, path = item.partition("=")
        if not sep or not Path(path).is_dir():
            sys.exit(f"error: {item!r} is not NAME=RUN_DIR with an existing run dir")
        runs[name] = Path(path)
    md, _ = table(runs, args.last)
    plot(runs, args.out, args.title)
    print(md)
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
