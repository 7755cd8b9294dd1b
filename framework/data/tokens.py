"""Token files: a flat ``.bin`` of uint16/uint32 ids and a JSON sidecar (``.json``) describing it.

The sidecar records the dtype, the vocabulary size, the token count and the digest of the tokenizer
that wrote it (framework.data.tokenizer): training refuses a file made with another tokenizer, naming
both digests, because its ids would mean other words. Files are memory-mapped, never unpickled.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
# Sidecars written before tokenizer digests existed say "tokenizer": "bytes".
LEGACY_BYTES = "bytes"
# Text files given as a token file: which data= option reads them.
TEXT_SOURCES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".txt": "text", ".md": "text"}
SCAN_CHUNK = 64 * 1024 * 1024  # tokens per chunk of the id-range scan (bounded memory on any file size)
# The field every sidecar this framework writes carries: `prepare` replaces only a file it wrote.
WRITTEN_BY = "framework.data prepare"


DATA_CHANGED = "data file "  # how every DataChanged message starts (the launcher recognises it)


class DataChanged(Exception):
    """A data file changed on disk while the run read it. Reading a truncated memory map past its
    new end is a SIGBUS that kills the process (and leaves its checkpoint LOCK); so the sampler
    checks the file before each batch and stops the run with this one line instead."""


@dataclass(frozen=True)
class FileStamp:
    """What a data file was when the run opened it: its size, mtime and inode."""

    path: Path
    size: int
    mtime_ns: int
    inode: int

    @classmethod
    def of(cls, path: Path) -> FileStamp:
        st = os.stat(path)
        return cls(path, st.st_size, st.st_mtime_ns, st.st_ino)


def check_unchanged(stamps: list[FileStamp]) -> None:
    """Raise DataChanged naming the first file whose size, mtime or inode differs from its stamp
    (one ``os.stat`` per file: cheap next to a batch)."""
    for s in stamps:
        try:
            st = os.stat(s.path)
        except OSError:
            raise DataChanged(f"{DATA_CHANGED}{s.path} was removed during the run") from None
        if (st.st_size, st.st_mtime_ns, st.st_ino) != (s.size, s.mtime_ns, s.inode):
            raise DataChanged(
                f"{DATA_CHANGED}{s.path} changed during the run (size {s.size} -> {st.st_size} bytes)"
            )


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


class TokenWriter:
    """Appends token arrays to ``path`` (via ``path.tmp``) and writes the sidecar on ``close``: a
    file interrupted mid-write never looks complete."""

    def __init__(self, path: Path, vocab_size: int) -> None:
        self.path = path
        self.dtype = dtype_for(vocab_size)
        self.vocab_size = vocab_size
        path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = path.with_name(path.name + ".tmp")
        self.f = self.tmp.open("wb")
        self.num_tokens = 0
        self.max_id = -1

    def write(self, tokens: np.ndarray) -> None:
        if tokens.size == 0:
            return
        arr = np.asarray(tokens, dtype=TOKEN_DTYPES[self.dtype])
        self.max_id = max(self.max_id, int(arr.max()))
        arr.tofile(self.f)
        self.num_tokens += int(arr.size)

    def close(self, meta: dict[str, Any]) -> None:
        self.f.close()
        self.tmp.replace(self.path)
        side = {
            "dtype": self.dtype,
            "vocab_size": self.vocab_size,
            "num_tokens": self.num_tokens,
            "max_id": self.max_id,
            **meta,
            "written_by": WRITTEN_BY,
        }
        self.path.with_suffix(".json").write_text(json.dumps(side, indent=2) + "\n")


def write_tokens(path: Path, tokens: np.ndarray, vocab_size: int, meta: dict[str, Any] | None = None) -> None:
    """Write a token file and its sidecar (``path.with_suffix('.json')``) in one go."""
    from framework.data.tokenizer import ByteTokenizer

    w = TokenWriter(path, vocab_size)
    w.write(np.asarray(tokens))
    w.close(meta or {"tokenizer": "bytes", "tokenizer_digest": ByteTokenizer().digest()})


def is_our_sidecar(path: Path) -> bool:
    """Whether ``path`` is a sidecar this framework wrote: it carries ``written_by``, or (written
    before the marker) the fields only a sidecar has; a tokenizer.json or a jsonl is not."""
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    if not isinstance(meta, dict):
        return False
    legacy = meta.get("dtype") in TOKEN_DTYPES and {"vocab_size", "num_tokens", "max_id"} <= meta.keys()
    return meta.get("written_by") == WRITTEN_BY or legacy


def read_sidecar(path: Path, key: str = "data.path") -> dict[str, Any]:
    if path.is_dir():
        raise ValueError(f"{key}={str(path)!r} is a directory, not a token file (.bin)")
    if not path.is_file():
        raise ValueError(
            f"{key}={str(path)!r} does not exist (write one with `python -m framework data prepare`)"
        )
    if path.stat().st_size == 0:
        raise ValueError(f"{key}={str(path)!r} is an empty token file")
    if path.suffix in TEXT_SOURCES:  # its .json "sidecar" may be another token file's (docs.bin's)
        raise ValueError(
            f"{key}={str(path)!r} is a {path.suffix} file, not a token file: read it with "
            f"data={TEXT_SOURCES[path.suffix]}, or tokenize it with `python -m framework data prepare`"
        )
    meta_path = path.with_suffix(".json")
    if not meta_path.is_file():
        raise ValueError(
            f"token file {str(path)!r} has no sidecar {meta_path.name} (dtype, vocab size, tokenizer); "
            "write both with `python -m framework data prepare`"
        )
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{meta_path}: the sidecar is not valid JSON ({e})") from e
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path}: the sidecar is not a JSON object")
    if meta.get("dtype") not in TOKEN_DTYPES:
        raise ValueError(f"{meta_path}: dtype {meta.get('dtype')!r} is not one of {sorted(TOKEN_DTYPES)}")
    vocab = meta.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab <= 0:
        raise ValueError(f"{meta_path}: vocab_size {vocab!r} is not a positive integer")
    return meta


def open_tokens(path: Path, key: str = "data.path", scan: bool = False) -> tuple[np.ndarray, int]:
    """Memory-map a token file; returns (tokens, vocab size). Raises ValueError on a bad file.

    ``scan`` reads every id once (in chunks) to check it is below the sidecar's vocab size: a file
    whose ids do not fit would index past the embedding on the device (a CUDA assert, not a message).
    """
    meta = read_sidecar(path, key)
    itemsize = np.dtype(TOKEN_DTYPES[meta["dtype"]]).itemsize
    size = path.stat().st_size
    if size % itemsize:
        raise ValueError(f"{path}: {size} bytes is not a whole number of {meta['dtype']} tokens (truncated?)")
    tokens = np.memmap(path, dtype=TOKEN_DTYPES[meta["dtype"]], mode="r")
    if tokens.size != meta.get("num_tokens", tokens.size):
        raise ValueError(
            f"{path}: holds {tokens.size} tokens, its sidecar says {meta['num_tokens']} (truncated?)"
        )
    vocab = int(meta["vocab_size"])
    if scan:
        top = max(int(tokens[i : i + SCAN_CHUNK].max()) for i in range(0, tokens.size, SCAN_CHUNK))
        if top >= vocab:
            raise ValueError(
                f"{path}: holds token id {top} >= its sidecar's vocab_size={vocab} "
                "(corrupt, or written with another tokenizer)"
            )
    return tokens, vocab


def tokenizer_digest(path: Path) -> str | None:
    """The digest of the tokenizer that wrote ``path`` (None when the sidecar names none)."""
    from framework.data.tokenizer import ByteTokenizer

    meta = read_sidecar(path)
    if "tokenizer_digest" in meta:
        return str(meta["tokenizer_digest"])
    return ByteTokenizer().digest() if meta.get("tokenizer") == LEGACY_BYTES else None


class TokenFiles:
    """Several token files read as one array: ``size`` and slicing (``a[i:j]``), as ``BatchSampler``
    uses them, without copying the files into memory."""

    def __init__(self, parts: list[np.ndarray], lo: int = 0, hi: int | None = None) -> None:
        self.parts = parts
        self.starts = np.cumsum([0] + [p.size for p in parts])
        self.lo = lo
        self.hi = int(self.starts[-1]) if hi is None else hi
        self.size = self.hi - self.lo

    def __getitem__(self, sl: slice) -> np.ndarray | TokenFiles:
        start, stop, step = sl.indices(self.size)
        assert step == 1, "token files are sliced contiguously"
        a, b = self.lo + start, self.lo + stop
        if b - a > 1 << 20:  # a split (train/val): a view, not a copy
            return TokenFiles(self.parts, a, b)
        out = []
        for i, p in enumerate(self.parts):
            s0, s1 = int(self.starts[i]), int(self.starts[i + 1])
            if s1 > a and s0 < b:
                out.append(np.asarray(p[max(a, s0) - s0 : min(b, s1) - s0]))
        return np.concatenate(out) if out else np.empty(0, dtype=self.parts[0].dtype)


def open_token_paths(
    files: list[Path], key: str = "data.path", scan: bool = False
) -> tuple[np.ndarray | TokenFiles, int]:
    """One token file as its memmap, several as ``TokenFiles``; every file must agree on the vocab."""
    opened = [open_tokens(f, key, scan) for f in files]
    vocabs = {v for _, v in opened}
    if len(vocabs) > 1:
        raise ValueError(
            f"{key}: the token files have different vocab sizes {sorted(vocabs)}: {[str(f) for f in files]}"
        )
    if len(opened) == 1:
        return opened[0][0], opened[0][1]
    return TokenFiles([t for t, _ in opened]), opened[0][1]
