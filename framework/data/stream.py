"""Packing documents into windows, on the fly, with a data state that is a small replicated value.

``PackedWindows`` tokenizes one source's records in order (``Tokenizer.encode_batch``: hf and
sentencepiece spread each batch over their own threads), puts BOS (with ``tokenizer.add_bos``) before
and EOS after every document, and cuts the joined stream into windows of ``seq_len + 1`` tokens (as
torchtitan packs). Its position is a ``Cursor`` (epoch, record number, tokens of that record already
used): three integers, the same on every rank.

``StreamSampler`` builds each global batch from one or more such sources (``data.mix``): which source
fills each row of global batch ``i`` is drawn from a generator seeded by (seed, i) with the mixture's
weights, and each source gives its next windows in order. So global batch ``i`` is a function of the
seed, ``i`` and the cursors, never of the rank or the number of ranks: every rank builds the same
global batch (in a background thread, ``data.prefetch`` batches ahead) and keeps its contiguous slice.
The state saved in a checkpoint is ``consumed_batches`` plus one cursor per source; a run resumes on
any number of data-parallel ranks with no sample skipped or repeated.

The price of rank independence: every rank tokenizes the whole global batch, not its share
(benchmarks/data_bench.py measures the rate per rank).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from framework.data.records import Records
from framework.data.sampler import check_batch_split
from framework.data.sft import split_rows
from framework.data.tokenizer import Tokenizer
from framework.data.tokens import FileStamp, check_unchanged

# Mixes the batch index into the source-choice generator's seed (distinct from BatchSampler's stream).
MIX_SALT = 7_919


@dataclass
class Cursor:
    """Where a packed stream stands: the next token is token ``offset`` of record ``record``
    (counted with its BOS/EOS) in pass ``epoch`` over the source."""

    epoch: int = 0
    record: int = 0
    offset: int = 0


class WindowSource(Protocol):
    """Gives windows in order and says where it stands."""

    def take(self, n: int) -> np.ndarray: ...

    def state(self) -> dict[str, int]: ...

    def seek(self, state: dict[str, int]) -> None: ...


def holdout(every: int, val: bool) -> Callable[[int], bool]:
    """Which record numbers a split keeps: the validation split is every ``every``-th record (the
    last of each group of ``every``), the train split the rest; ``every=0`` keeps all in train."""
    if every <= 0:
        return (lambda i: False) if val else (lambda i: True)
    if val:
        return lambda i: i % every == every - 1
    return lambda i: i % every != every - 1


class PackedWindows:
    """One source's records -> token ids with BOS/EOS -> windows of ``window`` tokens."""

    def __init__(
        self,
        records: Records,
        tokenizer: Tokenizer,
        window: int,
        keep: Callable[[int], bool],
        add_bos: bool = False,
        encode_batch: int = 256,
        label: str = "data",
    ) -> None:
        self.records = records
        self.tok = tokenizer
        self.window = window
        self.keep = keep
        self.bos = tokenizer.bos_id if add_bos else None
        self.eos = tokenizer.eos_id
        self.encode_batch = max(1, encode_batch)
        self.label = label
        self.seek(asdict(Cursor()))

    def seek(self, state: dict[str, int]) -> None:
        c = Cursor(**state)
        self._gen = self._tokenized(c.epoch, c.record)
        self._skip_first = c.offset  # applied to record c.record when it arrives
        self._at = Cursor(c.epoch, c.record, c.offset)
        self._cur: np.ndarray = np.empty(0, dtype=np.int64)
        self._pos = 0

    def state(self) -> dict[str, int]:
        return asdict(
            Cursor(self._at.epoch, self._at.record, self._pos if self._cur.size else self._at.offset)
        )

    def _tokenized(self, epoch: int, start: int) -> Iterator[tuple[int, int, np.ndarray]]:
        """(epoch, record number, ids) for every kept record from ``start`` on, epoch after epoch."""
        while True:
            produced = False
            batch: list[tuple[int, str, bool, bool]] = []
            for n, (text, first, last) in enumerate(self.records.iterate(skip=start), start):
                if self.keep(n):
                    batch.append((n, text, first, last))
                if len(batch) >= self.encode_batch:
                    for item in self._encode(batch):
                        produced = produced or item[1].size > 0
                        yield (epoch, *item)
                    batch = []
            for item in self._encode(batch):
                produced = produced or item[1].size > 0
                yield (epoch, *item)
            if not produced and start == 0:
                raise ValueError(f"{self.label}: the source gives no tokens (every record is empty)")
            epoch, start = epoch + 1, 0

    def _encode(self, batch: list[tuple[int, str, bool, bool]]) -> list[tuple[int, np.ndarray]]:
        if not batch:
            return []
        ids = self.tok.encode_batch([t for _, t, _, _ in batch])
        out = []
        for (n, _, first, last), seq in zip(batch, ids, strict=True):
            parts = [seq]
            if first and self.bos is not None:
                parts.insert(0, [self.bos])
            if last and self.eos is not None:
                parts.append([self.eos])
            out.append((n, np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])))
        return out

    def take(self, n: int) -> np.ndarray:
        need = n * self.window
        out = np.empty(need, dtype=np.int64)
        filled = 0
        while filled < need:
            if self._pos >= self._cur.size:
                epoch, record, ids = next(self._gen)
                skip = self._skip_first if (epoch, record) == (self._at.epoch, self._at.record) else 0
                self._skip_first = 0
                self._at = Cursor(epoch, record, 0)
                self._cur, self._pos = ids, min(skip, ids.size)
                continue
            k = min(need - filled, self._cur.size - self._pos)
            out[filled : filled + k] = self._cur[self._pos : self._pos + k]
            self._pos += k
            filled += k
        return out.reshape(n, self.window)


class RandomWindows:
    """A token array (a token file, the stdlib bytes, or random ids) as a mix source: call ``k``
    draws its windows' offsets from a generator seeded by (seed, source, windows drawn so far)."""

    def __init__(self, tokens: np.ndarray | None, vocab_size: int, window: int, seed: int, salt: int) -> None:
        self.tokens, self.vocab_size, self.window = tokens, vocab_size, window
        self.seed, self.salt = seed, salt
        self.drawn = 0
        self.stamps: list[FileStamp] = []  # the memory-mapped files of ``tokens``: checked before a read

    def take(self, n: int) -> np.ndarray:
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + self.salt) * 1_000_033 + self.drawn)
        self.drawn += n
        if self.tokens is None:
            return torch.randint(0, self.vocab_size, (n, self.window), generator=g).numpy()
        starts = torch.randint(0, self.tokens.size - self.window, (n,), generator=g).tolist()
        check_unchanged(self.stamps)  # a truncated map read past its end is a SIGBUS
        return np.stack([np.asarray(self.tokens[o : o + self.window], dtype=np.int64) for o in starts])

    def state(self) -> dict[str, int]:
        return {"drawn": self.drawn}

    def seek(self, state: dict[str, int]) -> None:
        self.drawn = int(state["drawn"])


@dataclass
class _Batch:
    index: int
    rows: np.ndarray  # (global_batch_size, seq_len + 1)
    after: list[dict[str, int]]  # every source's state after this batch
    # This rank's micro-batches (inputs, targets) and their loss weights, made by the packer thread
    # too: next_batch then runs no tensor op, each of which would hand the GIL to the packer and wait
    # up to the switch interval (5 ms) to get it back (measured: 10-20 ms per 1B step on an H200).
    micro: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    scales: list[float] | None = None


def compose(
    sources: Sequence[WindowSource], weights: torch.Tensor, seed: int, index: int, size: int
) -> np.ndarray:
    """Global batch ``index``: each row's source drawn from (seed, index), then each source's next
    windows in row order."""
    if len(sources) == 1:
        return sources[0].take(size)
    g = torch.Generator().manual_seed(seed * 1_000_003 + index + MIX_SALT)
    choice = torch.multinomial(weights, size, replacement=True, generator=g).numpy()
    rows = np.empty((size, 0), dtype=np.int64)
    for s, src in enumerate(sources):
        where = np.flatnonzero(choice == s)
        if where.size:
            part = src.take(int(where.size))
            if rows.shape[1] == 0:
                rows = np.empty((size, part.shape[1]), dtype=np.int64)
            rows[where] = part
    return rows


class StreamSampler:
    """Same interface as ``BatchSampler`` (next_batch, peek, rewind, state_dict, load_state_dict)
    over packed and mixed sources; see the module docstring for why the state is rank-independent."""

    def __init__(
        self,
        sources: Sequence[WindowSource],
        weights: Sequence[float],
        seq_len: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        prefetch: int = 4,
    ) -> None:
        check_batch_split(global_batch_size, micro_batch_size, dp_size)
        self.sources = list(sources)
        self.weights = torch.tensor(list(weights), dtype=torch.float64)
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed = seed
        self.prefetch = max(1, prefetch)
        self.consumed_batches = 0
        # How long the last ``next_batch`` kept the training loop waiting (seconds): near 0 while the
        # background packer stays ``prefetch`` batches ahead; the loop reports it per step.
        self.last_wait_s = 0.0
        self._after = [s.state() for s in self.sources]  # the state after the last consumed batch
        self._scales: list[float] | None = None
        self._pushback: list[_Batch] = []
        self._history: list[tuple[_Batch, list[dict[str, int]]]] = []  # for rewind
        self._queue: queue.Queue[_Batch | BaseException] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the background producer ------------------------------------------------------------------
    def _start(self) -> None:
        if self._thread is not None:
            return
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.prefetch)
        self._thread = threading.Thread(
            target=self._produce,
            args=(self.consumed_batches + len(self._pushback), self._stop, self._queue),
            name="data-packer",
            daemon=True,
        )
        self._thread.start()

    def _produce(self, index: int, stop: threading.Event, out: queue.Queue) -> None:
        try:
            while not stop.is_set():
                rows = compose(self.sources, self.weights, self.seed, index, self.global_batch_size)
                item: _Batch | BaseException = self._prepare(
                    _Batch(index, rows, [s.state() for s in self.sources])
                )
                index += 1
                while not stop.is_set():
                    try:
                        out.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised in next_batch
            out.put(e)

    def _prepare(self, item: _Batch) -> _Batch:
        mine = self._rank_rows(item)
        item.micro = [split_rows(m) for m in mine.split(self.micro_batch_size)]
        item.scales = self._token_scales(item, mine)
        return item

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def _get(self) -> _Batch:
        if self._pushback:
            return self._pushback.pop()
        self._start()
        assert self._queue is not None
        item = self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        return item

    # -- the sampler interface --------------------------------------------------------------------
    def _rank_rows(self, item: _Batch) -> torch.Tensor:
        per_rank = self.global_batch_size // self.dp_size
        lo = self.dp_rank * per_rank
        return torch.from_numpy(np.ascontiguousarray(item.rows[lo : lo + per_rank]))

    def next_batch(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        t0 = time.perf_counter()
        item = self._get()
        assert item.index == self.consumed_batches, (item.index, self.consumed_batches)
        self._history = [(item, self._after)]
        self._after = item.after
        self.consumed_batches += 1
        self._scales = item.scales
        self.last_wait_s = time.perf_counter() - t0
        return item.micro

    def _token_scales(self, item: _Batch, rows: torch.Tensor) -> list[float] | None:
        """Where targets are masked (data=sft), each micro-batch's weight in the step: its share of
        the global batch's trained targets, times the data-parallel degree (DDP/FSDP average over
        ranks). Then the step's loss and gradient are the mean over every trained target of the global
        batch, not a mean of per-micro-batch means that would over-weight short responses. Every rank
        holds the whole global batch, so this needs no communication. None: no target is masked."""
        trained = item.rows[:, 1:] >= 0
        if trained.all():
            return None
        total = int(trained.sum())
        return [int((m[:, 1:] >= 0).sum()) * self.dp_size / total for m in rows.split(self.micro_batch_size)]

    def loss_scales(self) -> list[float] | None:
        """The last batch's micro-batch weights for ``train_step`` (see ``_token_scales``)."""
        return self._scales

    def peek(self) -> torch.Tensor:
        """This rank's rows of the next batch, without consuming it."""
        item = self._get()
        self._pushback.append(item)
        return self._rank_rows(item)

    def rewind(self) -> None:
        """Give the last batch back (a step undone by a rollback): the next call returns it again."""
        item, before = self._history.pop()
        self._pushback.append(item)
        self._after = before
        self.consumed_batches -= 1

    def state_dict(self) -> dict[str, Any]:
        return {"consumed_batches": self.consumed_batches, "seed": self.seed, "sources": self._after}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(
                f"data state was saved with train.seed={state['seed']}, this run has {self.seed}: "
                "resuming would replay different samples"
            )
        saved = state.get("sources")
        if not isinstance(saved, list) or len(saved) != len(self.sources):
            raise ValueError(
                f"the checkpoint's data state has {len(saved) if isinstance(saved, list) else 'no'} source "
                f"positions, this run's data has {len(self.sources)} sources: resume with the same data config"
            )
        self.close()
        for src, st in zip(self.sources, saved, strict=True):
            src.seek(dict(st))
        self._after = [dict(s) for s in saved]
        self._pushback, self._history = [], []
        self.consumed_batches = int(state["consumed_batches"])


def fixed_windows(
    sources: Sequence[WindowSource], weights: Sequence[float], size: int, seed: int
) -> np.ndarray:
    """``size`` windows from fresh sources in mixture order: a validation set that every run shares."""
    return compose(sources, torch.tensor(list(weights), dtype=torch.float64), seed, 0, size)
