"""What the cheap verification hooks cost: the default run with them on (the default) and off, on CPU.

The cheap hooks (issue 24 point 5) run by default: ``verify.graph`` (the ranks' frozen graph
fingerprints and config hashes, one ``all_gather_object`` before the first training collective) and
``verify.ladder`` (the executor rungs: where a lower rung exists, one forward of the first
micro-batch before step 1 catches a compile error, and a latency circuit breaker reads each timed
step, with one all-reduce per window of ``verify.breaker_window`` steps). Off means
``verify.graph=false verify.ladder=false``.

Each case runs ``python train.py`` as a user does, hooks on and off in turn, in the order on-off,
off-on, ... (so that a change in the machine's load, or a compile cache that the first run of a
pair fills, hits both alike), ``--repeats`` times, and prints medians (min-max in brackets):
the process's wall time, the time to the first step (where the start-up hooks run), the median
step and tokens/s (where the breaker runs). Compare the two columns of one run, never numbers
taken on another machine or another day.

    OMP_NUM_THREADS=1 python benchmarks/verify_hooks_bench.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OFF = ["verify.graph=false", "verify.ladder=false"]
CASES = {
    "default (1 rank, eager)": [],
    "2 ranks (mesh=2, eager)": ["mesh=2"],
    "1 rank, executor=compile": ["executor=compile"],
}


FIGURES = (
    ("wall_s", ".2f"),
    ("first_step_s", ".2f"),
    ("step_ms", ".1f"),
    ("tokens_per_s", ",.0f"),
    ("fallbacks", ".0f"),
)


def one_run(run_dir: Path, overrides: list[str]) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.pop("RUN_STAMP", None)
    cmd = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    s = json.loads((run_dir / "summary.json").read_text())
    return {
        "wall_s": wall,
        "first_step_s": s["time_to_first_step_s"],
        "step_ms": s["step_p50_s"] * 1e3,
        "tokens_per_s": s["tokens_per_s"],
        # A tripped breaker steps a compiled run down to eager: slower steps that are no hook's cost.
        "fallbacks": float(sum("fallback/" in e for e in s["events"])),
    }


def cell(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} [{format(min(values), fmt)}-{format(max(values), fmt)}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30, help="train.steps of each run (the recipe's: 200)")
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    args = ap.parse_args()
    base = [f"train.steps={args.steps}"]
    print("| case | figure | hooks on (default) | hooks off | on - off |\n|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases:
            got: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
            for r in range(args.repeats):
                pair = [("on", []), ("off", OFF)]
                for name, extra in pair if r % 2 == 0 else pair[::-1]:  # on-off, off-on, ...
                    run_dir = Path(tmp) / f"{list(CASES).index(case)}-{name}-{r}"
                    got[name].append(one_run(run_dir, base + CASES[case] + extra))
            for key, fmt in FIGURES:
                on, off = ([g[key] for g in got[n]] for n in ("on", "off"))
                delta = format(statistics.median(on) - statistics.median(off), "+" + fmt)
                print(f"| {case} | {key} | {cell(on, fmt)} | {cell(off, fmt)} | {delta} |", flush=True)


if __name__ == "__main__":
    main()
