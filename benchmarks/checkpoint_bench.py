"""Checkpoint benchmark (not a test): prints a table.

For the tiny recipe and a 125M shape, on one gloo rank (so the dist code paths run):

* save throughput of a sync ``Checkpointer.save`` (DCP write + fsync + sha256 manifest + rename)
  against a raw sequential write (+ fsync) of the same number of bytes on the same disk;
* time the training loop is blocked by ``save`` for async_mode none / thread / process;
* time to resume: ``latest()`` (manifest verification) + ``load``.

Usage: ``python benchmarks/checkpoint_bench.py [--dir /path/on/the/disk] [--skip-125m] [--no-process]``
The ``__main__`` guard is required: the process checkpointer spawns a helper that re-imports this file.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from framework.checkpoint import Checkpointer
from framework.config.schema import AsyncMode, CheckpointConfig, ModelConfig
from framework.models import build_model, materialize

SHAPES = {
    "tiny": ModelConfig(),
    "125m": ModelConfig(
        name="llama_125m",
        dim=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=12,
        ffn_dim=2048,
        vocab_size=32000,
        tie_embeddings=False,
    ),
}


def _setup(
    cfg: ModelConfig,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    model = build_model(cfg, 64)
    materialize(model, "cpu", 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab_size, (1, 16))
    model(x).float().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, _one)


def _one(step: int) -> float:
    return 1.0


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def raw_write_s(path: Path, nbytes: int) -> float:
    """Sequential write of ``nbytes`` in 8 MiB blocks, then fsync: what the disk gives one writer."""
    block = os.urandom(8 << 20)
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            left -= f.write(block[: min(left, len(block))])
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    path.unlink()
    return dt


def bench_shape(name: str, base: Path, modes: list[AsyncMode]) -> list[tuple[str, str]]:
    cfg = SHAPES[name]
    model, opt, sch = _setup(cfg)
    rows = []
    root = base / name
    extra = {"step": 1, "data": {"consumed_batches": 1}}

    # Sync save: throughput against a raw write of the same bytes.
    ck = Checkpointer(CheckpointConfig(enabled=True, keep_last=0), root)
    t0 = time.perf_counter()
    ck.save(1, model, opt, sch, extra)
    save_s = time.perf_counter() - t0
    nbytes = _dir_bytes(root / "step_000001")
    raw_s = raw_write_s(base / "raw.bin", nbytes)
    mb = nbytes / 2**20
    rows.append((f"{name}: checkpoint size", f"{mb:.1f} MiB"))
    rows.append(
        (f"{name}: sync save (DCP + fsync + sha256 + commit)", f"{save_s:.3f} s = {mb / save_s:.0f} MiB/s")
    )
    rows.append(
        (f"{name}: raw sequential write + fsync, same bytes", f"{raw_s:.3f} s = {mb / raw_s:.0f} MiB/s")
    )

    # Loop-blocked time per mode: save() returns, then the commit happens in wait().
    for i, mode in enumerate(modes):
        ck = Checkpointer(CheckpointConfig(enabled=True, keep_last=0, async_mode=mode), root)
        for j in range(2):  # 1st: allocates staging buffers (and starts the helper process)
            step = 10 + 2 * i + j
            ck.save(step, model, opt, sch, extra)
            blocked = ck.last_blocked_s
            t0 = time.perf_counter()
            while ck.writing():  # the loop would be training now
                time.sleep(0.005)
            t1 = time.perf_counter()
            ck.wait()
            commit = time.perf_counter() - t1
            label = f"{name}: save blocked, async={mode.value}" + (" (1st)" if j == 0 else " (2nd)")
            rows.append(
                (
                    label,
                    f"{blocked * 1e3:.0f} ms; background {t1 - t0:.2f} s; commit in wait() {commit * 1e3:.0f} ms",
                )
            )
            if mode is AsyncMode.none:
                break

    # Resume: verify (sha256 of every file) + load into a fresh model.
    model2, opt2, sch2 = _setup(cfg)
    t0 = time.perf_counter()
    path = ck.latest()
    t1 = time.perf_counter()
    assert path is not None
    ck.load(path, model2, opt2, sch2)
    t2 = time.perf_counter()
    rows.append((f"{name}: resume = latest() verify + load", f"{t1 - t0:.3f} s + {t2 - t1:.3f} s"))
    ok = all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True)
    )
    rows.append((f"{name}: loaded state bitwise equal", str(ok)))
    ck.close()
    shutil.rmtree(root)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--skip-125m", action="store_true")
    ap.add_argument("--no-process", action="store_true", help="skip async_mode=process")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(dir=args.dir))
    dist.init_process_group("gloo", store=dist.FileStore(str(base / "store"), 1), rank=0, world_size=1)
    modes = [AsyncMode.none, AsyncMode.thread] + ([] if args.no_process else [AsyncMode.process])
    rows = []
    for name in ["tiny"] + ([] if args.skip_125m else ["125m"]):
        rows += bench_shape(name, base, modes)
    width = max(len(k) for k, _ in rows)
    print(f"\ncheckpoint benchmark: torch {torch.__version__}, {torch.get_num_threads()} threads, dir {base}")
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    dist.destroy_process_group()
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
