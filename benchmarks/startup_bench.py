"""How long the answers that need no training take: help, a typo, a refused value (issue 44 point 4).

Each command runs in a fresh interpreter, as a user types it, ``--repeat`` times; the table gives
the median and the fastest wall time, and whether torch was imported (``-X importtime``, a separate
run). ``--root DIR`` times another checkout (e.g. an export of the commit before a change:
``git archive COMMIT | tar -x -C /tmp/base``), so before and after run on the same machine, in one
call. The goal is under 1 s on a quiet machine; on a shared 2-core machine, compare rows of one call.

    python benchmarks/startup_bench.py [--repeat 5] [--root DIR ...]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (label, argv after the interpreter, expected exit status)
COMMANDS: list[tuple[str, list[str], int]] = [
    ("train.py --help", ["train.py", "--help"], 0),
    ("train.py trian.steps=5 (typo)", ["train.py", "trian.steps=5"], 2),
    ("train.py sharding=bogus", ["train.py", "sharding=bogus"], 2),
    ("train.py train.steps=many", ["train.py", "train.steps=many"], 2),
    ("train.py train.lr=-1 (a rule's refusal)", ["train.py", "train.lr=-1"], 2),
    ("framework --help", ["-m", "framework", "--help"], 0),
    ("framework generate --help", ["-m", "framework", "generate", "--help"], 0),
    ("framework evaluate --help", ["-m", "framework", "evaluate", "--help"], 0),
    ("framework export-hf --help", ["-m", "framework", "export-hf", "--help"], 0),
    ("framework data --help", ["-m", "framework", "data", "--help"], 0),
    ("framework recipes --help", ["-m", "framework", "recipes", "--help"], 0),
    ("framework verify --help", ["-m", "framework", "verify", "--help"], 0),
]


def run(root: Path, argv: list[str], importtime: bool = False) -> tuple[float, int, str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), *argv]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    return time.perf_counter() - start, proc.returncode, proc.stderr


def imports_torch(root: Path, argv: list[str]) -> bool:
    _, _, err = run(root, argv, importtime=True)
    return any(re.search(r"\|\s+torch$", line.rstrip()) for line in err.splitlines())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per command (median and fastest)")
    parser.add_argument("--root", type=Path, action="append", help="checkouts to time (default: this one)")
    args = parser.parse_args()
    roots = args.root or [ROOT]
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start, {args.repeat} runs each")
    print()
    print("| checkout | command | median s | fastest s | exit | imports torch |")
    print("|---|---|---|---|---|---|")
    bad = 0
    for label, argv, expected in COMMANDS:
        for root in roots:  # the checkouts of one command side by side, timed one after the other
            times, codes = [], set()
            for _ in range(args.repeat):
                seconds, code, _ = run(root, argv)
                times.append(seconds)
                codes.add(code)
            torch_too = imports_torch(root, argv)
            code_text = ",".join(map(str, sorted(codes)))
            bad += codes != {expected}
            print(
                f"| {root.name} | `{label}` | {statistics.median(times):.2f} | {min(times):.2f} | "
                f"{code_text} | {'yes' if torch_too else 'no'} |",
                flush=True,
            )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
