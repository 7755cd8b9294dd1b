"""Float8 loss parity over seeds: runs named ``NUMERICS_sSEED`` under one root (the first numerics
is the reference, bf16), as ``benchmarks/float8_seeds.sh`` writes them.

    python benchmarks/float8_seeds.py ROOT --out parity.png [--numerics bf16,e5m2,e4m3]

Prints two markdown tables: per seed, each run's final train loss (mean of the last ``--last``
logged steps) and final val loss with the difference from the same seed's reference; then per
numerics, the mean of those differences over seeds with their spread (min..max and the sample
standard deviation). The plot: the train loss of each numerics relative to the same seed's
reference, step by step (the mean over seeds, the band min..max), and the loss curves of one seed.
Only seeds with every numerics complete count.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.float8_parity import curves, table  # noqa: E402


def complete_seeds(root: Path, names: list[str], steps: int) -> list[int]:
    """Seeds whose every run logged a train loss at ``steps`` (a run cut by a timeout does not)."""
    seeds = sorted({int(p.name.rsplit("_s", 1)[1]) for p in root.glob(f"{names[0]}_s*") if p.is_dir()})
    return [
        s
        for s in seeds
        if all(
            (root / f"{n}_s{s}").is_dir() and any(st == steps for st, _ in curves(root / f"{n}_s{s}")[0])
            for n in names
        )
    ]


def rel(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else (a - b) / b


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.2%}"


def summarize(root: Path, names: list[str], seeds: list[int], last: int) -> tuple[str, str]:
    per_seed = [
        "| seed | " + " | ".join(f"{n} train | {n} val" for n in names) + " |",
        "|---|" + "---|---|" * len(names),
    ]
    diffs: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in names[1:]}
    for s in seeds:
        _, fig = table({n: root / f"{n}_s{s}" for n in names}, last)
        ref_tr, ref_va = fig[names[0]]
        cells = [f"{ref_tr:.4f} | {ref_va:.4f}" if ref_va is not None else f"{ref_tr:.4f} | -"]
        for n in names[1:]:
            tr, va = fig[n]
            d_tr, d_va = rel(tr, ref_tr), rel(va, ref_va)
            diffs[n][0].append(d_tr)
            if d_va is not None:
                diffs[n][1].append(d_va)
            cells.append(f"{tr:.4f} ({pct(d_tr)}) | " + ("-" if va is None else f"{va:.4f} ({pct(d_va)})"))
        per_seed.append(f"| {s} | " + " | ".join(cells) + " |")
    summary = [
        f"| numerics | train vs {names[0]}: mean | min..max | sd | val vs {names[0]}: mean | min..max | sd |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, (tr, va) in diffs.items():
        cols = []
        for xs in (tr, va):
            if not xs:
                cols += ["-", "-", "-"]
                continue
            sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
            cols += [f"**{statistics.mean(xs):+.2%}**", f"{min(xs):+.2%}..{max(xs):+.2%}", f"{sd:.2%}"]
        summary.append(f"| {n} | " + " | ".join(cols) + " |")
    return "\n".join(per_seed), "\n".join(summary)


def plot(root: Path, names: list[str], seeds: list[int], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_rel) = plt.subplots(2, 1, figsize=(8, 7.5), sharex=True, height_ratios=[2, 2])
    for i, n in enumerate(names):
        train, val = curves(root / f"{n}_s{seeds[0]}")
        ax.plot([s for s, _ in train], [v for _, v in train], color=f"C{i}", lw=1, label=f"{n} train")
        if val:
            ax.plot([s for s, _ in val], [v for _, v in val], "o--", color=f"C{i}", ms=3, label=f"{n} val")
    ax.set_yscale("log")
    ax.set_ylabel(f"loss (seed {seeds[0]})")
    ax.set_title(title)
    ax.legend(fontsize=8)
    for i, n in enumerate(names[1:], start=1):
        per_step: dict[int, list[float]] = {}
        for s in seeds:
            ref = dict(curves(root / f"{names[0]}_s{s}")[0])
            for step, v in curves(root / f"{n}_s{s}")[0]:
                if step in ref:
                    per_step.setdefault(step, []).append(100 * (v / ref[step] - 1))
        steps = sorted(k for k, v in per_step.items() if len(v) == len(seeds))
        mean = [statistics.mean(per_step[k]) for k in steps]
        ax_rel.plot(steps, mean, color=f"C{i}", lw=1.2, label=f"{n}, mean of {len(seeds)} seeds")
        lo, hi = [min(per_step[k]) for k in steps], [max(per_step[k]) for k in steps]
        ax_rel.fill_between(steps, lo, hi, color=f"C{i}", alpha=0.2, lw=0)
    for y in (1, -1):
        ax_rel.axhline(y, color="grey", lw=0.5, ls=":")
    ax_rel.axhline(0, color="grey", lw=0.5)
    ax_rel.set_ylabel(f"train loss vs {names[0]} (same seed), %")
    ax_rel.set_xlabel("step")
    ax_rel.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root", type=Path, help="the folder of NUMERICS_sSEED run dirs")
    p.add_argument("--out", type=Path, required=True, help="the plot (PNG)")
    p.add_argument("--numerics", default="bf16,e5m2,e4m3", help="run name prefixes, the reference first")
    p.add_argument("--steps", type=int, default=500, help="a run counts when it logged this step")
    p.add_argument("--last", type=int, default=50, help="steps averaged for the final train loss")
    p.add_argument(
        "--title",
        default="llama_125m, stdlib bytes, b16x2048, lr 6e-4: float8 tensorwise gradient dtype",
    )
    args = p.parse_args()
    names = args.numerics.split(",")
    seeds = complete_seeds(args.root, names, args.steps)
    if not seeds:
        sys.exit(f"error: no seed under {args.root} has all of {names} complete at step {args.steps}")
    per_seed, summary = summarize(args.root, names, seeds, args.last)
    plot(args.root, names, seeds, args.out, args.title)
    print(f"seeds {seeds}\n\n{per_seed}\n\n{summary}\n\nplot: {args.out}")


if __name__ == "__main__":
    main()
