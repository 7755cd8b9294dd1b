"""Ahead-of-time tokenization: documents -> one token file, streamed, on several processes.

``prepare`` reads its inputs record by record (nothing is held in memory but a few chunks), encodes
chunks of records in a pool of worker processes (each loads the tokenizer once) while the parent
writes the results in input order, puts EOS after every document (and BOS before, with
``add_bos``), and records the tokenizer's digest in the sidecar so that training can refuse a file
made with another tokenizer.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from framework.config.schema import DataSource, TokenizerConfig
from framework.data.records import PIECE_BYTES, Record, SourceSpec, file_records, is_sidecar, resolve_files
from framework.data.tokenizer import Tokenizer, load_tokenizer
from framework.data.tokens import TokenWriter, is_our_sidecar

CHUNK_RECORDS = 256  # records per task sent to a worker
SOURCE_BY_SUFFIX = {".jsonl": DataSource.jsonl, ".json": DataSource.jsonl, ".parquet": DataSource.parquet}
KNOWN_SUFFIXES = (".txt", ".md", ".text", ".jsonl", ".json", ".parquet")

_worker: dict[str, Any] = {}


def input_files(inputs: list[str], source: DataSource | None) -> list[tuple[DataSource, Path]]:
    """Each input as a file, a folder or a glob, with the source that reads it (by suffix unless given)."""
    out = []
    for item in inputs:
        p = Path(item).expanduser()
        if p.is_dir() or any(c in item for c in "*?["):
            src = source or DataSource.text
            spec = SourceSpec(src, item, key="input")
            if source is None:  # any known kind of file in a folder
                files = (
                    [
                        f
                        for f in sorted(p.rglob("*"))
                        if f.is_file() and f.suffix in KNOWN_SUFFIXES and not is_sidecar(f)
                    ]
                    if p.is_dir()
                    else resolve_files(spec)
                )
                if not files:
                    raise ValueError(f"input {item!r} holds no {'/'.join(KNOWN_SUFFIXES)} files")
            else:
                files = resolve_files(spec)
        else:
            files = resolve_files(SourceSpec(source or DataSource.text, item, key="input"))
        for f in files:
            if f.stat().st_size == 0:
                raise ValueError(f"input {str(f)!r} is an empty file")
            out.append((source or SOURCE_BY_SUFFIX.get(f.suffix, DataSource.text), f))
    return out


def check_outputs(outputs: list[Path], files: list[tuple[DataSource, Path]]) -> None:
    """Refuse outputs that would overwrite an input (``prepare d.bin d.json`` wrote its sidecar over
    the jsonl ``d.json``; ``prepare t.json ...`` its sidecar over its own tokens), before writing."""
    inputs = {f.resolve(): f for _, f in files}
    for out in outputs:
        if out.resolve() in inputs:
            raise ValueError(
                f"output {str(out)!r} is also an input ({str(inputs[out.resolve()])!r}): writing it would "
                "destroy that input; choose another output name"
            )


def refuse_foreign(path: Path, what: str, force: bool) -> None:
    """Refuse to replace ``path``, a file this command did not write (``what`` says what it is),
    unless ``--force``: ``prepare`` wrote its sidecar over a tokenizer.json, ``tokenizer train``
    its tokenizer over a token file's sidecar."""
    if not force:
        raise ValueError(
            f"{str(path)!r} exists and is {what}, not written by this command: refusing to overwrite it; "
            "choose another output name, or pass --force to replace it"
        )


def check_prepare_outputs(out: Path, force: bool) -> None:
    """A token file is ours when its sidecar is; anything else at OUT or OUT.json is not."""
    side = out.with_suffix(".json")
    if side.exists() and not is_our_sidecar(side):
        refuse_foreign(side, "not a token file's sidecar", force)
    elif out.exists() and not side.exists():
        refuse_foreign(out, "a file without a token sidecar", force)


def records_of(files: list[tuple[DataSource, Path]], field: str, column: str) -> Iterator[Record]:
    for src, f in files:
        yield from file_records(SourceSpec(src, str(f), field, column, key="input"), [f])


def encode_records(tok: Tokenizer, records: list[Record], add_bos: bool) -> np.ndarray:
    ids = tok.encode_batch([t for t, _, _ in records])
    parts: list[list[int]] = []
    for (_, first, last), seq in zip(records, ids, strict=True):
        if first and add_bos and tok.bos_id is not None:
            parts.append([tok.bos_id])
        parts.append(seq)
        if last and tok.eos_id is not None:
            parts.append([tok.eos_id])
    flat = [i for p in parts for i in p]
    return np.asarray(flat, dtype=np.int64)


def _init_worker(cfg: TokenizerConfig, add_bos: bool) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one process per core already
    _worker["tok"] = load_tokenizer(cfg)
    _worker["add_bos"] = add_bos


def _encode_chunk(records: list[Record]) -> np.ndarray:
    return encode_records(_worker["tok"], records, _worker["add_bos"])


def _chunks(records: Iterator[Record]) -> Iterator[list[Record]]:
    chunk: list[Record] = []
    for r in records:
        chunk.append(r)
        if len(chunk) >= CHUNK_RECORDS:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity under a batch scheduler, not the host's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check_workers(workers: int) -> None:
    """ValueError unless ``workers`` is 0 (one per core, at most 8) or 1..the usable cores (at least 2)."""
    most = max(2, usable_cores())  # two on a one-core machine: what the equivalence test runs
    if not 0 <= workers <= most:
        raise ValueError(
            f"--workers {workers}: valid: 0 (one per core, at most 8) or 1 to {most} (the cores this "
            "process may use; each worker is a process)"
        )


def prepare(
    out: Path,
    inputs: list[str],
    tokenizer: TokenizerConfig | None = None,
    source: DataSource | None = None,
    field: str = "text",
    column: str = "text",
    workers: int = 0,
    add_bos: bool = False,
    progress: bool | None = None,
    force: bool = False,
) -> int:
    """Tokenize ``inputs`` into ``out`` (+ sidecar); returns the number of tokens written.

    ``workers=0``: one per CPU core (at most 8); ``workers=1`` encodes in this process; more than
    the cores this process may use is refused (each worker is a process: 10**9 of them forked without
    bound). ``force`` replaces an OUT / OUT.json that ``prepare`` did not write (refused otherwise).
    """
    check_workers(workers)
    tok_cfg = tokenizer or TokenizerConfig()
    tok = load_tokenizer(tok_cfg)
    if add_bos and tok.bos_id is None:
        raise ValueError(f"--add-bos: tokenizer={tok.kind.value} has no BOS token")
    if out.suffix == ".json":
        raise ValueError(
            f"output {str(out)!r}: its sidecar is OUT with the suffix .json, the token file itself here; "
            f"name the token file {out.with_suffix('.bin').name!r}"
        )
    files = input_files(inputs, source)
    check_outputs([out, out.with_suffix(".json")], files)
    check_prepare_outputs(out, force)
    total = sum(f.stat().st_size for _, f in files)
    workers = workers or min(8, usable_cores())
    writer = TokenWriter(out, tok.vocab_size)
    # disable=None: tqdm shows the bar on a terminal only (not in logs and tests).
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc=f"prepare {out.name}",
        disable=None if progress is None else not progress,
    )
    docs = 0
    try:
        chunks = _chunks(records_of(files, field, column))
        if workers == 1:
            for chunk in chunks:
                writer.write(encode_records(tok, chunk, add_bos))
                docs += sum(last for _, _, last in chunk)
                bar.update(sum(len(t) for t, _, _ in chunk))
        else:
            with _pool_context().Pool(workers, initializer=_init_worker, initargs=(tok_cfg, add_bos)) as pool:
                pending: collections.deque[tuple[Any, int, int]] = collections.deque()
                for chunk in chunks:  # at most 2 chunks per worker in flight: memory stays bounded
                    n_docs, n_chars = sum(last for _, _, last in chunk), sum(len(t) for t, _, _ in chunk)
                    pending.append((pool.apply_async(_encode_chunk, (chunk,)), n_docs, n_chars))
                    while len(pending) > 2 * workers:
                        docs += _drain(pending, writer, bar)
                while pending:
                    docs += _drain(pending, writer, bar)
    except BaseException:
        writer.f.close()
        writer.tmp.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    if writer.num_tokens == 0:
        writer.f.close()
        writer.tmp.unlink(missing_ok=True)
        raise ValueError(f"inputs {inputs} hold no text")
    writer.close(
        {
            "tokenizer": tok.kind.value,
            "tokenizer_path": tok_cfg.path,
            "tokenizer_digest": tok.digest(),
            "bos_id": tok.bos_id if add_bos else None,
            "eos_id": tok.eos_id,
            "num_documents": docs,
            "inputs": [str(f) for _, f in files][:100],
            "piece_bytes": PIECE_BYTES,
        }
    )
    return writer.num_tokens


def _pool_context() -> multiprocessing.context.BaseContext:
    """Workers forked from a fresh server process, never from this one: a fork of a process that
    runs threads (torch's, the tokenizer's, a logger's) copies whatever lock a thread held at that
    moment, and a worker that takes it waits forever (the suite hung so once). The server imports
    this module once; each worker is a cheap fork of it."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def _drain(pending: collections.deque, writer: TokenWriter, bar: tqdm) -> int:
    result, n_docs, n_chars = pending.popleft()
    writer.write(result.get())
    bar.update(n_chars)
    return n_docs
