"""Random windows over a flat token array: the ``stdlib``, ``tokens`` and ``synthetic`` sources.

Every sample is a function of (seed, global batch index, position in the global batch), never of the
rank or of how many ranks there are. A data-parallel rank takes its contiguous slice of each global
batch. So the whole data state is one replicated number, ``consumed_batches``: a checkpoint saved
with 8 data-parallel ranks resumes on 4 or 1 with no sample skipped or repeated.

- ``stdlib``: the Python standard library's own source files, present on every machine; byte-level
  tokens (vocab 256). The last ``val_fraction`` of the files (by sorted path) is held out.
- ``tokens``: a memory-mapped token file (framework.data.tokens) from ``python -m framework data prepare``.
- ``synthetic``: uniform random tokens, for benchmarks (no I/O, any vocab).
"""

from __future__ import annotations

import functools
import os
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from framework.config.schema import DataConfig, DataSource
from framework.data.records import SourceSpec, resolve_files
from framework.data.tokens import FileStamp, check_unchanged, open_token_paths

# Cap on the stdlib corpus: ~30 MB of source would take seconds to read for no benefit on a tiny model.
STDLIB_MAX_BYTES = 8 * 1024 * 1024


@dataclass
class Corpus:
    """Train and validation token streams (1-D integer arrays or memmaps) and the vocab they need."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    description: str
    stamps: list[FileStamp] = field(default_factory=list)  # the token files as opened (memory-mapped)


def stdlib_files() -> list[Path]:
    """The standard library's ``*.py`` files, sorted by path, without any under ``site-packages``.

    The walk does not enter ``site-packages`` (it sits inside the stdlib folder and holds torch and
    every other installed package: ``rglob`` then filtering took 0.6 s per call, this 0.02 s). The
    list is read once per process (the launcher's data check and an in-process run share it)."""
    root = sysconfig.get_paths()["stdlib"]
    files = list(_stdlib_files(root))
    if not files:
        raise RuntimeError(f"no Python source files found under the standard library at {root}")
    return files


@functools.lru_cache(maxsize=4)
def _stdlib_files(root: str) -> tuple[Path, ...]:
    found = []
    for folder, dirs, names in os.walk(root):  # like rglob: symlinked folders are not entered
        dirs[:] = [d for d in dirs if d != "site-packages"]
        found += [Path(folder, n) for n in names if n.endswith(".py")]
    return tuple(sorted(found))


def load_stdlib(val_fraction: float, max_bytes: int = STDLIB_MAX_BYTES) -> Corpus:
    files = stdlib_files()
    n_val = max(1, int(len(files) * val_fraction))
    train_files, val_files = files[:-n_val], files[-n_val:]
    train = _read_bytes(train_files, max_bytes)
    val = _read_bytes(val_files, max(max_bytes // 10, 64 * 1024))
    return Corpus(train, val, 256, f"stdlib source ({len(train_files)} train / {len(val_files)} val files)")


def _read_bytes(files: list[Path], max_bytes: int) -> np.ndarray:
    chunks: list[bytes] = []
    total = 0
    for f in files:
        data = f.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


def token_files(spec: SourceSpec, path: str) -> list[Path]:
    """A token file, or the .bin files of a folder or glob. A missing path goes to open_tokens as it
    is, for its message naming `prepare`."""
    p = Path(path).expanduser()
    if p.suffix == ".bin" and not any(c in path for c in "*?[") and not p.is_dir():
        return [p]
    return resolve_files(spec, path)


def load_corpus(cfg: DataConfig, vocab_size: int, seq_len: int, scan: bool = False) -> Corpus | None:
    """Load the configured source; ``None`` for synthetic data (batches are drawn, not read).
    ``scan`` checks every token id against the vocab (the launcher does, once, before launch)."""
    if cfg.source is DataSource.synthetic:
        return None
    if cfg.source is DataSource.stdlib:
        corpus = load_stdlib(cfg.val_fraction)
    else:
        if cfg.path is None:
            raise ValueError("data.source=tokens needs data.path=<token file .bin, a folder or a glob>")
        spec = SourceSpec(DataSource.tokens, cfg.path)
        files = token_files(spec, cfg.path)
        train, vocab = open_token_paths(files, scan=scan)
        stamps = [FileStamp.of(f) for f in files]
        if cfg.val_path is not None:
            val_files = token_files(spec, cfg.val_path)
            val, _ = open_token_paths(val_files, "data.val_path", scan=scan)
            stamps += [FileStamp.of(f) for f in val_files]
        else:
            split = int(train.size * (1 - cfg.val_fraction))
            train, val = train[:split], train[split:]
        corpus = Corpus(train, val, vocab, f"token file {cfg.path}", stamps)
    if corpus.vocab_size > vocab_size:
        raise ValueError(
            f"the data's vocabulary ({corpus.vocab_size} tokens, {corpus.description}) is larger than "
            f"model.vocab_size={vocab_size}: set model.vocab_size>={corpus.vocab_size}"
        )
    for name, arr in (("train", corpus.train), ("validation", corpus.val)):
        if arr.size <= seq_len + 1:
            raise ValueError(
                f"the {name} split of {corpus.description} has {arr.size} tokens, fewer than one sequence "
                f"(train.seq_len+2={seq_len + 2}): use more data or a smaller train.seq_len"
            )
    return corpus


def check_batch_split(global_batch_size: int, micro_batch_size: int, dp_size: int) -> None:
    """A sampler's global batch must be whole micro batches on every data-parallel rank (ValueError)."""
    if global_batch_size % (dp_size * micro_batch_size):
        raise ValueError(
            f"train.global_batch_size={global_batch_size} is not divisible by data-parallel degree "
            f"{dp_size} x train.micro_batch_size={micro_batch_size}"
        )


class BatchSampler:
    """Deterministic batches for one data-parallel rank; state is the replicated global position.

    ``next_batch()`` returns this rank's micro-batches of the next global batch as a list of
    (inputs, targets) pairs, each (micro_batch_size, seq_len) int64.
    """

    def __init__(
        self,
        tokens: np.ndarray | None,
        vocab_size: int,
        seq_len: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
    ) -> None:
        check_batch_split(global_batch_size, micro_batch_size, dp_size)
        self.tokens = tokens
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.consumed_batches = 0
        # The memory-mapped files ``tokens`` reads (build_data sets them): checked before each read.
        self.stamps: list[FileStamp] = []
        # How long the last ``next_batch`` kept the training loop waiting (seconds): the loop reports
        # it per step as ``data_wait_ms`` and as a share of the step time.
        self.last_wait_s = 0.0

    def global_batch(self, index: int) -> torch.Tensor:
        """All sequences (global_batch_size, seq_len + 1) of global batch ``index``."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        n, s = self.global_batch_size, self.seq_len + 1
        if self.tokens is None:
            return torch.randint(0, self.vocab_size, (n, s), generator=g)
        check_unchanged(self.stamps)
        starts = torch.randint(0, self.tokens.size - s, (n,), generator=g).tolist()
        rows = np.stack([np.asarray(self.tokens[o : o + s]) for o in starts])
        return torch.from_numpy(rows.astype(np.int64))

    def rank_slice(self, index: int) -> torch.Tensor:
        """This rank's contiguous share of global batch ``index``."""
        per_rank = self.global_batch_size // self.dp_size
        lo = self.dp_rank * per_rank
        if self.tokens is None:
            return self.global_batch(index)[lo : lo + per_rank]
        # Read only this rank's rows: draw the same starts, slice before touching the tokens.
        check_unchanged(self.stamps)  # a truncated map read past its end is a SIGBUS
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        s = self.seq_len + 1
        starts = torch.randint(0, self.tokens.size - s, (self.global_batch_size,), generator=g).tolist()
        rows = np.stack([np.asarray(self.tokens[o : o + s]) for o in starts[lo : lo + per_rank]])
        return torch.from_numpy(rows.astype(np.int64))

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        t0 = time.perf_counter()
        rows = self.rank_slice(self.consumed_batches)
        self.consumed_batches += 1
        out = [(m[:, :-1], m[:, 1:]) for m in rows.split(self.micro_batch_size)]
        self.last_wait_s = time.perf_counter() - t0  # read synchronously: all of it is a wait
        return out

    def loss_scales(self) -> None:
        """Every target counts here: micro-batches weigh the same (the interface of StreamSampler)."""
        return None

    def peek(self) -> torch.Tensor:
        """This rank's rows of the next batch, without consuming it."""
        return self.rank_slice(self.consumed_batches)

    def rewind(self) -> None:
        """Give the last batch back (a step undone by a rollback): the next call returns it again."""
        self.consumed_batches -= 1

    def close(self) -> None:
        """Nothing runs in the background here (the interface of StreamSampler)."""

    def state_dict(self) -> dict[str, int]:
        return {"consumed_batches": self.consumed_batches, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(
                f"data state was saved with train.seed={state['seed']}, this run has {self.seed}: "
                "resuming would replay different samples"
            )
        self.consumed_batches = int(state["consumed_batches"])


def validation_batches(
    corpus: Corpus | None,
    vocab_size: int,
    seq_len: int,
    global_batch_size: int,
    micro_batch_size: int,
    num_batches: int,
    dp_rank: int,
    dp_size: int,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed held-out set, the same windows on every run and every layout: ``num_batches`` global
    batches of ``global_batch_size`` sequences, each rank taking its share in micro batches.

    Why the global batch: it is the one batch size every layout of a run shares. Sized by the micro
    batch (as it was), one process (micro batch 16), pp=2 (4) and an interleaved pipeline (2)
    evaluated 64, 16 and 8 different windows, and reported different validation losses for the
    same weights."""
    sampler = BatchSampler(
        None if corpus is None else corpus.val,
        vocab_size,
        seq_len,
        global_batch_size,
        micro_batch_size,
        dp_rank,
        dp_size,
        seed=12345,
    )
    out = []
    for _ in range(num_batches):
        out.extend(sampler.next_batch())
    return out
