"""A portable compile cache in one directory (``executor.cache_dir``).

Inductor caches compiled graphs on local disk (``TORCHINDUCTOR_CACHE_DIR``, under /tmp by
default), so a job that lands on a fresh node compiles from scratch: on an H200 the 1B took 19-41 s
to its first step cold against 10-22 s warm (benchmarks/PERF.md). ``torch.compiler``'s cache
artifacts (``save_cache_artifacts`` / ``load_cache_artifacts``) serialise the compiled graphs, and
the kernels in them, into bytes that can live next to the checkpoints on shared storage: every rank
loads every blob in the directory before its first compile; after training, rank 0 adds one blob
with what this run compiled that was not in the cache (``save_cache_artifacts`` returns only what
this process created, not what it loaded, so one file rewritten each run would lose the earlier
entries). A run that hit everything writes nothing. Artifacts are keyed by graph, torch version and
device inside each blob, so a stale or foreign entry is a miss, not an error; an unreadable blob is
a warning and a cold compile. Delete the directory to start over. The loop drives it as the shipped
``compile_cache`` callback (``CompileCache``, conf/callbacks/compile_cache.yaml).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.utils import counters

from framework.config.schema import ExecutorMode
from framework.train.callbacks import Callback, RunContext

log = logging.getLogger("framework")


@dataclass
class CacheStats:
    """What this process loaded, hit, missed and saved (rank 0's figures go into summary.json)."""

    loaded: int = 0
    saved: int = 0
    hits: int = 0
    misses: int = 0


def _count(info: object) -> int:
    artifacts = getattr(info, "artifacts", None) or {}
    return sum(len(v) for v in artifacts.values())


def load_cache(cache_dir: str | Path) -> int:
    """Hot-load every blob in ``cache_dir`` (none yet is a cold start, not an error); returns the
    number of artifacts loaded."""
    blobs = sorted(Path(cache_dir).glob("artifacts-*.bin"))
    if not blobs:
        log.info("compile cache %s: empty, compiling cold (this run will fill it)", cache_dir)
        return 0
    n = 0
    for blob in blobs:
        try:
            info = torch.compiler.load_cache_artifacts(blob.read_bytes())
        except Exception as e:  # noqa: BLE001 - a bad blob must cost a cold compile, not the run
            log.warning("compile cache blob %s unreadable (%s: %s): skipped", blob, type(e).__name__, e)
            continue
        if info is None:  # torch logs why (e.g. a checksum mismatch) and loads nothing
            log.warning("compile cache blob %s unreadable (torch loaded nothing from it): skipped", blob)
        n += _count(info)
    log.info("compile cache %s: loaded %d artifacts from %d blobs", cache_dir, n, len(blobs))
    return n


def save_cache(cache_dir: str | Path) -> int:
    """Add what this process compiled as one blob (named by its content hash; written to a temp
    file, then renamed); returns the artifact count, 0 when there was nothing new. A failed write
    warns: the run's results are already on disk and the existing blobs are untouched."""
    cache_dir = Path(cache_dir)
    try:
        out = torch.compiler.save_cache_artifacts()
        if out is None:
            return 0
        data, info = out
        cache_dir.mkdir(parents=True, exist_ok=True)
        blob = cache_dir / f"artifacts-{hashlib.sha256(data).hexdigest()[:16]}.bin"
        tmp = cache_dir / f".{blob.name}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, blob)
    except Exception as e:  # noqa: BLE001 - never fail a finished run over its cache
        log.warning("compile cache %s not written (%s: %s)", cache_dir, type(e).__name__, e)
        return 0
    n = _count(info)
    log.info("compile cache %s: added %s (%d artifacts, %d bytes)", cache_dir, blob.name, n, len(data))
    return n


def cache_counters() -> tuple[int, int]:
    """Inductor's FX graph cache hits and misses in this process so far."""
    inductor = counters["inductor"]
    return int(inductor["fxgraph_cache_hit"]), int(inductor["fxgraph_cache_miss"])


class CompileCache(Callback):
    """``executor.cache_dir`` on a compiled executor: every rank loads the cache before the model is
    built (so before its first compile); at the end rank 0 adds what was compiled anew, and the
    figures go into summary.json's ``compile_cache``. A no-op otherwise."""

    def __init__(self) -> None:
        self.stats: CacheStats | None = None

    def setup(self, run: RunContext) -> None:
        ex = run.cfg.executor
        if ex.cache_dir is not None and ex.mode is not ExecutorMode.eager:
            self.stats = CacheStats(loaded=load_cache(ex.cache_dir))

    def on_finish(self, run: RunContext, summary: Any) -> None:
        stats, cache_dir = self.stats, run.cfg.executor.cache_dir
        if stats is None or cache_dir is None:
            return
        stats.hits, stats.misses = cache_counters()
        if run.is_main and stats.misses:  # something new was compiled: keep it for the next run
            stats.saved = save_cache(cache_dir)
        summary.compile_cache = dataclasses.asdict(stats)
