"""``python -m benchmarks``: the suite's index (benchmarks/__init__.py), one benchmark a block.
``python -m benchmarks NAME [ARGS ...]``: run that benchmark from the repository root with ARGS, as its
command line does (``python`` or ``bash``), with this checkout first on PYTHONPATH; exits with its
status. ``--device KIND`` lists only the benchmarks that run on KIND."""

from __future__ import annotations

import os
import subprocess
import sys

from benchmarks import BENCHMARKS, BY_NAME, DEVICES, HERE, Benchmark

ROOT = HERE.parent


def describe(b: Benchmark) -> str:
    where = f"PERF.md, \"{b.perf}\"" if b.perf is not None else b.elsewhere
    return "\n".join(
        [
            f"{b.name}: {b.measures}",
            f"    on:      {', '.join(b.devices)}",
            f"    run:     {b.command}",
            f"    figures: {where}",
        ]
    )


def listing(device: str | None = None) -> str:
    shown = [b for b in BENCHMARKS if device is None or device in b.devices]
    head = f"{len(shown)} benchmarks (python -m benchmarks NAME [ARGS] runs one):"
    return "\n".join([head, *(describe(b) for b in shown)])


def run(b: Benchmark, args: list[str]) -> int:
    """The script with ``args``, from the repository root (the scripts call ``train.py`` and read
    ``benchmarks/rounds/`` from there)."""
    path = HERE / b.script
    cmd = ["bash", str(path), *args] if b.script.endswith(".sh") else [sys.executable, str(path), *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.call(cmd, cwd=ROOT, env=env)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(listing())
        return 0
    if argv[0] == "--device":
        if len(argv) < 2 or argv[1] not in DEVICES:
            print(f"--device takes one of: {', '.join(DEVICES)}", file=sys.stderr)
            return 2
        print(listing(argv[1]))
        return 0
    name, args = argv[0], argv[1:]
    if name not in BY_NAME:
        print(f"no benchmark {name!r}; the benchmarks: {', '.join(BY_NAME)}", file=sys.stderr)
        return 2
    return run(BY_NAME[name], args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
