"""Documents from files and datasets, as one ordered stream of text records.

A record is ``(text, starts_document, ends_document)``: a jsonl line, a parquet row and a dataset example are one
record each, a text file is read in pieces of about ``PIECE_BYTES`` cut at line ends (so a 10 GB file
streams) and only its last piece ends the document. Records are numbered in a fixed order (files
sorted, then their records), so "record i" means the same text on every rank and in every run: the
packer's resumable cursor is a record number (framework.data.stream).

``check_source`` runs before launch and turns every bad input into a ``ValueError`` naming the file
(and line) and what is valid.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import json
import logging
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from framework.config.schema import DataSource
from framework.data.tokenizer import needs
from framework.data.tokens import FileStamp, check_unchanged

Record = tuple[str, bool, bool]  # (text, starts a document, ends a document)
PIECE_BYTES = 16 * 1024
# Up to this many bytes of input, check_source reads every record before launch (UTF-8, JSON, the
# field); beyond it, the first CHECK_HEAD_BYTES of each file, and a bad record later stops the run
# with the same message.
CHECK_ALL_BYTES = 64 * 1024 * 1024
CHECK_HEAD_BYTES = 1024 * 1024
SUFFIXES = {
    DataSource.text: (".txt", ".md", ".text"),
    DataSource.jsonl: (".jsonl", ".json"),
    DataSource.sft: (".jsonl", ".json"),
    DataSource.parquet: (".parquet",),
    DataSource.tokens: (".bin",),
}


@dataclass(frozen=True)
class SourceSpec:
    """What one stream reads: the typed fields of ``data`` (or of one ``data.mix`` entry) it needs."""

    source: DataSource
    path: str | None
    field: str = "text"
    column: str = "text"
    name: str | None = None
    split: str = "train"
    streaming: bool = False
    key: str = "data"  # the config key that names it, for messages ("data" or "data.mix[1]")


def is_sidecar(f: Path) -> bool:
    """A token file's sidecar (``X.json`` beside ``X.bin``, from ``prepare``): in a folder of jsonl
    files it is not a document file (it was read as one and refused as "not a JSON object")."""
    return f.suffix == ".json" and f.with_suffix(".bin").is_file()


def _kind(p: Path) -> str:
    mode = p.stat().st_mode
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"))
    return next((what for test, what in kinds if test(mode)), "not a regular file or folder")


def _unique(files: list[Path]) -> list[Path]:
    """Each file once, by its real path: a ``**`` glob follows a symlink loop (dir/loop -> dir) and
    listed every file 41 times, until the kernel's ELOOP, so it was read 41 times per epoch."""
    seen: set[str] = set()
    out = []
    for f in files:
        real = os.path.realpath(f)
        if real not in seen:
            seen.add(real)
            out.append(f)
    return out


def check_disjoint(spec: SourceSpec, val_path: str) -> None:
    """Refuse validation files that are also training files (through a link, a glob or a folder):
    the validation loss would be measured on trained-on text."""
    train = {os.path.realpath(f): f for f in resolve_files(spec)}
    both = [train[r] for r in (os.path.realpath(f) for f in resolve_files(spec, val_path)) if r in train]
    if both:
        raise ValueError(
            f"{spec.key}.val_path={val_path!r} shares {len(both)} file(s) with {spec.key}.path={spec.path!r} "
            f"(e.g. {str(both[0])!r}): validation would measure trained-on text; valid: disjoint files"
        )


def resolve_files(spec: SourceSpec, path: str | None = None) -> list[Path]:
    """``data.path`` as a file, a folder (its files with the source's suffixes) or a glob."""
    # The message names the key the user set: a missing val_path was reported as data.path.
    name = f"{spec.key}.path" if path is None or path == spec.path else f"{spec.key}.val_path"
    path = spec.path if path is None else path
    suffixes = SUFFIXES[spec.source]
    if not path:
        raise ValueError(f"{spec.key}.source={spec.source.value} needs {name}=<file, folder or glob>")
    p = Path(path).expanduser()
    if any(c in path for c in "*?["):
        files = sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
        if not files:
            raise ValueError(f"{name}={path!r}: the glob matches no files")
    elif p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in suffixes and not is_sidecar(f))
        if not files:
            raise ValueError(f"{name}={path!r} is a folder with no {'/'.join(suffixes)} files")
    elif p.is_file():
        files = [p]
    elif p.exists():  # a FIFO, socket or device was reported as "does not exist"
        raise ValueError(
            f"{name}={path!r} is {_kind(p)}, not a regular file (valid: a file, a folder or a glob)"
        )
    else:
        raise ValueError(f"{name}={path!r} does not exist (valid: a file, a folder or a glob)")
    files = _unique(files)
    for f in files:
        if f.stat().st_size == 0:
            raise ValueError(f"{name}: {str(f)!r} is an empty file")
    return files


def _text_pieces(path: Path, piece_bytes: int = PIECE_BYTES) -> Iterator[Record]:
    with path.open("rb") as f:
        offset = 0
        pending = f.read(piece_bytes)
        while pending:
            chunk = pending + f.readline()  # cut at a line end: no word or UTF-8 sequence is split
            pending = f.read(piece_bytes)
            try:
                text = chunk.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}: not UTF-8 text (byte {offset + e.start}: {chunk[e.start : e.start + 4]!r})"
                ) from e
            yield text, offset == 0, not pending
            offset += len(chunk)


def setting(key: str, name: str) -> str:
    """How a user sets ``name``: the config key (``data.field``, ``data.mix[1].field``), or the
    flag (``--field``) for ``python -m framework data``'s inputs (key ``input``)."""
    return f"--{name}" if key == "input" else f"{key}.{name}"


def json_line(raw: bytes, where: str) -> Any:
    """One jsonl line, or ValueError naming ``where`` (file:line) and what is wrong with it."""
    try:
        return json.loads(raw)
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 text") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not a JSON object ({e.msg})") from e


def _jsonl_records(path: Path, field: str, key: str) -> Iterator[Record]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            row = json_line(raw, f"{path}:{lineno}")
            if not isinstance(row, dict):
                raise ValueError(
                    f"{path}:{lineno}: a JSON {type(row).__name__}, not an object with the field {field!r}"
                )
            if field not in row:
                raise ValueError(
                    f"{path}:{lineno}: no field {field!r} (it has {sorted(row)[:8]}); set {setting(key, 'field')}"
                )
            text = row[field]
            if not isinstance(text, str):
                raise ValueError(
                    f"{path}:{lineno}: {setting(key, 'field')}={field!r} is {type(text).__name__}, not text"
                )
            yield text, True, True


def _parquet_file(path: Path, column: str, key: str) -> Any:
    pq = needs("pyarrow.parquet", "data=parquet")

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid / OSError for a corrupt file
        raise ValueError(f"{path}: not a readable parquet file ({str(e).splitlines()[0][:160]})") from e
    names = pf.schema_arrow.names
    if column not in names:
        raise ValueError(
            f"{path}: no column {column!r} (columns: {names[:10]}); set {setting(key, 'column')}"
        )
    return pf


def _parquet_records(path: Path, column: str, key: str, skip: int = 0) -> Iterator[Record]:
    pf = _parquet_file(path, column, key)
    groups = []
    for g in range(pf.num_row_groups):  # skip whole row groups from the metadata: no reading
        rows = pf.metadata.row_group(g).num_rows
        if skip >= rows:
            skip -= rows
            continue
        groups.append(g)
    if not groups:
        return
    try:
        for batch in pf.iter_batches(columns=[column], row_groups=groups, batch_size=1024):
            for text in batch.column(0).to_pylist():
                if skip:
                    skip -= 1
                    continue
                if text is None:
                    text = ""
                if not isinstance(text, str):
                    raise ValueError(
                        f"{path}: {setting(key, 'column')}={column!r} holds {type(text).__name__}, not text"
                    )
                yield text, True, True
    except OSError as e:  # a corrupt page past the footer
        raise ValueError(f"{path}: not a readable parquet file ({str(e).splitlines()[0][:160]})") from e


def file_records(spec: SourceSpec, files: list[Path], skip: int = 0) -> Iterator[Record]:
    """Every record of ``files`` in order, after the first ``skip`` (skipped ones are read, never
    tokenized; parquet skips whole row groups from its metadata)."""
    for f in files:
        if spec.source is DataSource.parquet:
            if skip:
                n = _parquet_file(f, spec.column, spec.key).metadata.num_rows
                if skip >= n:
                    skip -= n
                    continue
            it = _parquet_records(f, spec.column, spec.key, skip)
            skip = 0
        elif spec.source is DataSource.jsonl:
            it = _jsonl_records(f, spec.field, spec.key)
        else:
            it = _text_pieces(f)
        for rec in it:
            if skip:
                skip -= 1
                continue
            yield rec


@contextlib.contextmanager
def quiet_datasets() -> Iterator[None]:
    """``datasets`` without its progress bars and its own log lines on stderr ("Generating train
    split: 0 examples", "Failed to read file ... ArrowInvalid"): they came before, and around, the
    one error line of an empty or unreadable split. Its settings are restored afterwards."""
    import datasets

    bars = datasets.utils.is_progress_bar_enabled()
    level = datasets.utils.logging.get_verbosity()
    datasets.utils.disable_progress_bars()
    datasets.utils.logging.set_verbosity(logging.CRITICAL)
    try:
        yield
    finally:
        datasets.utils.logging.set_verbosity(level)
        if bars:
            datasets.utils.enable_progress_bars()


def load_hf(spec: SourceSpec, path: str | None = None) -> Any:
    """``datasets.load_dataset`` for ``data=hf``: a data file by its suffix, a folder, or a name
    (the local cache, or the hub where the machine can reach it)."""
    datasets = needs("datasets", "data=hf")
    path = spec.path if path is None else path
    if not path:
        raise ValueError(
            f"{spec.key}.source=hf needs {spec.key}.path=<dataset folder, data file or hub name>"
        )
    p = Path(path).expanduser()
    builders = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
    try:
        if p.is_file():
            if p.suffix not in builders:
                raise ValueError(f"{spec.key}.path={path!r}: valid data files end in {sorted(builders)}")
            with quiet_datasets():
                ds = datasets.load_dataset(
                    builders[p.suffix], data_files=str(p), split=spec.split, streaming=spec.streaming
                )
        else:
            with quiet_datasets():
                ds = datasets.load_dataset(path, spec.name, split=spec.split, streaming=spec.streaming)
    except ValueError as e:
        if str(e).startswith(spec.key):  # ours, naming the key already
            raise
        # datasets' own (an empty split is 'Instruction "train[:0]" corresponds to no data!'): name ours.
        raise ValueError(f"{spec.key}.path={path!r} with {spec.key}.split={spec.split!r}: {e}") from None
    except Exception as e:  # noqa: BLE001 - datasets raises many types (FileNotFoundError, DatasetNotFoundError, ...)
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise ValueError(f"{spec.key}.path={path!r}: datasets.load_dataset failed: {first}") from e
    names = ds.column_names
    if names is None:  # some streaming datasets only know their columns once read
        first_row = next(iter(ds), None)
        names = list(first_row) if first_row else []
    if spec.column not in names:
        raise ValueError(
            f"{spec.key}.path={path!r}: no column {spec.column!r} (columns: {names[:10]}); set {spec.key}.column"
        )
    return ds


def hf_records(spec: SourceSpec, ds: Any, skip: int = 0) -> Iterator[Record]:
    if spec.streaming:
        rows = iter(ds.skip(skip)) if skip else iter(ds)
        for row in rows:
            text = row[spec.column]
            yield ("" if text is None else str(text)), True, True
        return
    column = ds.select_columns([spec.column])
    for start in range(skip, len(column), 1024):
        for text in column[start : start + 1024][spec.column]:
            yield ("" if text is None else str(text)), True, True


CHECK_EVERY = 256  # records between two checks that the files are unchanged (an os.stat each)
T = TypeVar("T")


def watched(records: Iterator[T], stamps: list[FileStamp]) -> Iterator[T]:
    """``records``, checking every ``CHECK_EVERY`` records, at the end and on any read error that
    the files are as stamped: an edit raises DataChanged, not what the new bytes fail on."""
    try:
        for i, rec in enumerate(records):
            if i % CHECK_EVERY == 0:
                check_unchanged(stamps)
            yield rec
    except (ValueError, OSError):
        check_unchanged(stamps)
        raise
    check_unchanged(stamps)


class Records:
    """The ordered records of one source: ``iterate(skip)`` yields them from record ``skip`` on.

    The files are stamped when opened and checked every ``CHECK_EVERY`` records and on any read
    error: a file edited during the run stops it with ``DataChanged`` (one line naming the file),
    not with whatever its new bytes fail on (a traceback through the packer thread)."""

    def __init__(self, spec: SourceSpec, path: str | None = None, files: list[Path] | None = None) -> None:
        self.spec = spec
        self.ds: Any = None
        if files is not None:  # the stdlib's files, read as text by a real tokenizer
            self.files = files
        elif spec.source is DataSource.hf:
            self.files = []
            self.ds = load_hf(spec, path)
        else:
            self.files = resolve_files(spec, path)
        self.stamps = [FileStamp.of(f) for f in self.files]

    def iterate(self, skip: int = 0) -> Iterator[Record]:
        if self.ds is not None:
            return hf_records(self.spec, self.ds, skip)
        return watched(file_records(self.spec, self.files, skip), self.stamps)

    @property
    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)


def check_source(spec: SourceSpec, path: str | None = None, at_least: int = 1) -> int | None:
    """Open the source and read its records (all of them up to CHECK_ALL_BYTES of input, else the
    head of each file; of a stream, its first ``at_least``); returns the number of records when all
    were read, else None. Raises ValueError naming the file, line or column."""
    records = Records(spec, path)
    name = f"{spec.key}.path" if path is None or path == spec.path else f"{spec.key}.val_path"
    where = f"{name}={spec.path if path is None else path!r}"
    if records.ds is not None:
        if spec.streaming:
            # The head of the stream: enough records for a validation hold-out of every
            # ``at_least``-th one (a one-record stream gave an empty validation split, a traceback
            # inside the rank at its first evaluation).
            try:
                with quiet_datasets():
                    head = list(itertools.islice(records.iterate(), at_least))
            except Exception as e:  # noqa: BLE001 - pyarrow's and datasets' own types, any cause
                reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
                raise ValueError(f"{where}: its first records cannot be read ({reason})") from None
            if not head:  # an empty split: the ranks would wait for a first batch forever
                raise ValueError(f"{where}: the split {spec.split!r} has no records, so it gives no tokens")
            return len(head) if len(head) < at_least else None
        if len(records.ds) == 0:
            raise ValueError(f"{where}: the split {spec.split!r} has no records, so it gives no tokens")
        if not any(rec != "" for rec, _, _ in records.iterate()):  # stops at the first text
            raise ValueError(
                f"{where}: none of its {len(records.ds)} records has text (its {setting(spec.key, 'column')} "
                "is empty or null in every one), so it gives no tokens"
            )
        return len(records.ds)
    if records.total_bytes <= CHECK_ALL_BYTES:
        n = text = 0
        for rec, _, _ in records.iterate():
            n, text = n + 1, text + (rec != "")
        if text == 0:  # every text empty (or null in parquet): the rank found no tokens, a traceback
            col = {DataSource.jsonl: "field", DataSource.parquet: "column"}.get(spec.source, "")
            which = f" (its {setting(spec.key, col)} is empty or null in every one)" if col else ""
            raise ValueError(f"{where}: none of its {n} records has text{which}, so it gives no tokens")
        return n
    for f in records.files:
        read = 0
        for text, _, _ in file_records(spec, [f]):
            read += len(text)
            if read >= CHECK_HEAD_BYTES:
                break
    return None
