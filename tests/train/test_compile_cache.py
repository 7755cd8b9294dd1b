"""executor.cache_dir: a fresh machine (an empty Inductor cache) starts warm from the cache dir.

Two real ``train.py`` runs with Inductor on CPU, each with its own empty ``TORCHINDUCTOR_CACHE_DIR``
(what a new node has): the first compiles cold and adds a blob; the second loads it, hits every
graph, compiles nothing and adds nothing. A corrupt blob next to the good one is skipped with a
warning, not a failed run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(tmp: Path, name: str, cache: Path) -> tuple[dict, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp / f"inductor-{name}")}
    env.pop("RUN_STAMP", None)
    cmd = [
        sys.executable,
        "train.py",
        f"hydra.run.dir={tmp / name}",
        "executor=compile",
        f"executor.cache_dir={cache}",
        "train.steps=4",
        "train.eval_every=0",
        "train.log_every=2",
        "train.seq_len=32",
        "freeze=none",  # the export (~3 s of CPU per launch) plays no part in the cache
        "logger.plot=false",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp / name / "summary.json").read_text())["compile_cache"], proc.stdout + proc.stderr


def test_second_node_starts_warm_from_the_cache_dir(tmp_path: Path) -> None:
    cache = tmp_path / "compile-cache"
    cold, _ = run(tmp_path, "cold", cache)
    assert cold["loaded"] == 0 and cold["hits"] == 0 and cold["misses"] > 0
    assert cold["saved"] > 0
    blobs = sorted(cache.glob("artifacts-*.bin"))
    assert len(blobs) == 1
    (cache / "artifacts-corrupt.bin").write_bytes(b"not a cache")
    warm, out = run(tmp_path, "warm", cache)
    assert warm["loaded"] == cold["saved"]
    assert warm["hits"] == cold["misses"] and warm["misses"] == 0
    assert warm["saved"] == 0  # nothing new compiled: no new blob
    assert sorted(cache.glob("artifacts-*.bin")) == sorted([*blobs, cache / "artifacts-corrupt.bin"])
    assert "artifacts-corrupt.bin unreadable" in out
