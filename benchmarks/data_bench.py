"""Loader throughput: tokens/s delivered per rank, with a real BPE tokenizer trained here (no download).

    python benchmarks/data_bench.py                 # ~20 MB of jsonl from the stdlib's source
    python benchmarks/data_bench.py --mb 50 --seq-len 2048 --global-batch 64 --vocab-size 32000

Rows:
- ``jsonl packed``: on-the-fly tokenization (framework.data.stream), for 1, 2, 4 data-parallel ranks.
  Every rank packs the whole global batch (that is what keeps the data state rank-independent), so
  the rate it tokenizes is the same at every degree and what it *delivers* to its own model is that
  rate divided by the degree. The background thread's rate is measured with the trainer absent (the
  upper bound: a training step runs concurrently on the same cores).
- ``tokens file``: random windows over a prepared token file (framework.data.sampler).
- ``prepare``: ahead-of-time tokenization (framework.data.prepare) with 1 and N worker processes.

Compare "delivered per rank" with what a training step consumes per rank (global batch x seq_len /
dp / step time): below it, the loader is the bottleneck.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from framework.config.run_values import batch_shape, data_run  # noqa: E402
from framework.config.schema import (  # noqa: E402
    Config,
    DataConfig,
    DataSource,
    ModelConfig,
    TokenizerConfig,
    TokenizerKind,
    TrainConfig,
)
from framework.data import build_data  # noqa: E402
from framework.data.prepare import prepare  # noqa: E402
from framework.data.tokenizer import train_bpe  # noqa: E402


def write_jsonl(path: Path, megabytes: float) -> int:
    """Documents = standard-library source files (real text), cycled to the size asked for."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    written, n = 0, 0
    with path.open("w") as f:
        while written < megabytes * 1e6:
            for p in files:
                text = p.read_text(encoding="utf-8", errors="replace")
                line = json.dumps({"text": text}) + "\n"
                f.write(line)
                written += len(line)
                n += 1
                if written >= megabytes * 1e6:
                    break
    return n


def bench_stream(cfg: Config, dp: int, batches: int) -> tuple[float, float]:
    """(tokens/s tokenized by one rank's packer, tokens/s delivered to that rank), over ``batches``
    batches from a cold start: the packer encodes data.encode_batch documents per call, so a short
    window after a warm-up would time only its buffer."""
    t0 = time.perf_counter()
    data = build_data(data_run(cfg), batch_shape(cfg.train), 0, dp)
    for _ in range(batches):
        data.sampler.next_batch()
    dt = time.perf_counter() - t0
    data.sampler.close()
    per_batch = cfg.train.global_batch_size * cfg.train.seq_len
    return batches * per_batch / dt, batches * per_batch / dp / dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=5.0, help="jsonl corpus size (MB)")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--batches", type=int, default=0, help="0: one pass over the corpus")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="prepare's processes")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        jsonl = root / "docs.jsonl"
        n_docs = write_jsonl(jsonl, args.mb)
        t0 = time.perf_counter()
        sample = [json.loads(line)["text"] for _, line in zip(range(2000), jsonl.open(), strict=False)]
        tok = train_bpe(root / "bpe.json", sample, args.vocab_size)
        train_s = time.perf_counter() - t0
        tok_cfg = TokenizerConfig(kind=TokenizerKind.hf, path=str(root / "bpe.json"))
        train = TrainConfig(
            seq_len=args.seq_len, global_batch_size=args.global_batch, micro_batch_size=1, eval_every=0
        )
        rows: list[tuple[str, str, float, float]] = []
        for workers in sorted({1, args.workers}):
            t0 = time.perf_counter()
            n = prepare(root / f"p{workers}.bin", [str(jsonl)], tok_cfg, workers=workers, progress=False)
            rate = n / (time.perf_counter() - t0)
            rows.append(("prepare (ahead of time)", f"workers={workers}", rate, float("nan")))
        batches = args.batches or max(4, n // (args.global_batch * args.seq_len))
        for dp in (1, 2, 4):
            t = TrainConfig(**{**train.__dict__, "micro_batch_size": args.global_batch // dp})
            cfg = Config(
                model=ModelConfig(vocab_size=args.vocab_size),
                tokenizer=tok_cfg,
                data=DataConfig(source=DataSource.jsonl, path=str(jsonl), val_fraction=0.0),
                train=t,
            )
            packed, delivered = bench_stream(cfg, dp, batches)
            rows.append(("jsonl packed (on the fly)", f"dp={dp}", packed, delivered))
        for dp in (1, 4):
            t = TrainConfig(**{**train.__dict__, "micro_batch_size": args.global_batch // dp})
            cfg = Config(
                model=ModelConfig(vocab_size=args.vocab_size),
                tokenizer=tok_cfg,
                data=DataConfig(source=DataSource.tokens, path=str(root / f"p{args.workers}.bin")),
                train=t,
            )
            _, delivered = bench_stream(cfg, dp, batches)
            rows.append(("tokens file (random windows)", f"dp={dp}", float("nan"), delivered))
    print(
        f"\ncorpus: {args.mb:g} MB jsonl, {n_docs} documents; BPE vocab {tok.vocab_size} trained in "
        f"{train_s:.1f}s; seq_len {args.seq_len}, global batch {args.global_batch}; "
        f"{os.cpu_count()} CPU cores\n"
    )
    print(
        f"| {'source':<30} | {'ranks':<10} | {'tokenized tok/s (one rank)':>27} | {'delivered tok/s per rank':>25} |"
    )
    print(f"|{'-' * 32}|{'-' * 12}|{'-' * 29}|{'-' * 27}|")
    for name, what, a, b in rows:
        fa = f"{a:,.0f}" if a == a else "-"
        fb = f"{b:,.0f}" if b == b else "-"
        print(f"| {name:<30} | {what:<10} | {fa:>27} | {fb:>25} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
