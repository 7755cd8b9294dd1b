"""Single-process CPU run time with and without a competing busy process (issue 24 point 5).

Why: torch's default of one intra-op thread per core collapsed (5-7x slower) when another process
used a core. Runs ``python train.py`` for 30 steps of the default recipe with OMP_NUM_THREADS unset
(the framework chooses) and set to 1, each idle and next to one busy process; prints the wall time.

    python benchmarks/threads_bench.py
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["train.steps=30", "train.eval_every=0", "freeze=none", "logger.plot=false", "train.log_every=10"]


def _busy() -> None:
    while True:
        pass


def run(threads: str | None, busy: bool) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "RUN_STAMP")}
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    hog = mp.Process(target=_busy, daemon=True) if busy else None
    if hog is not None:
        hog.start()
    try:
        with tempfile.TemporaryDirectory() as d:
            start = time.perf_counter()
            subprocess.run(
                [sys.executable, "train.py", f"hydra.run.dir={d}/run", *ARGS],
                cwd=ROOT,
                env=env,
                check=True,
                capture_output=True,
            )
            return time.perf_counter() - start
    finally:
        if hog is not None:
            hog.kill()
            hog.join()


def main() -> None:
    print(f"cores available: {len(os.sched_getaffinity(0))}")
    for threads in (None, "1"):
        for busy in (False, True):
            label = f"OMP_NUM_THREADS={threads or 'unset'}, {'1 busy process' if busy else 'idle'}"
            print(f"{label}: {run(threads, busy):.1f} s", flush=True)


if __name__ == "__main__":
    main()
