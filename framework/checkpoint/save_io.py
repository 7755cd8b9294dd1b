"""What one checkpoint save writes through DCP, and how a failed write is told.

DCP's writer here makes the checkpoint's own folder and never its parents (a run dir deleted under
a save stays deleted). Each rank's failure is one line naming its rank, and a full disk is named
as such, with the bytes this rank needed and the bytes free (``describe_failure``).
"""

from __future__ import annotations

import errno
import os
import shutil
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from framework.checkpoint import store
from framework.config.schema import AsyncMode, Integrity

ANOTHER_RANK = "another rank failed"
# async_mode -> the DCP checkpointer that writes in the background.
ASYNC_TYPE = {
    AsyncMode.thread: AsyncCheckpointerType.THREAD,
    AsyncMode.process: AsyncCheckpointerType.PROCESS,
}


@dataclass
class PendingSave:
    """A save whose DCP write may still be running; committed by ``Checkpointer._finish``."""

    step: int
    tmp: Path
    future: Future | None  # resolves to the agreed errors of the commit (see Checkpointer._complete)
    error: str | None
    needed_bytes: int = 0  # this rank's share of the state: the estimate a full disk is reported with
    digests: dict[str, Any] | None = None


class _OwnFolderOnly(FileSystem):
    """Makes the checkpoint's own folder and never its parents: torch's writer makes them all, so a
    save in flight when the run dir was deleted brought the run dir back (or filled a user's new
    folder at its path). Rank 0 made the ``.tmp`` before DCP starts; gone, the write fails instead."""

    def mkdir(self, path: str | os.PathLike) -> None:
        Path(path).mkdir(exist_ok=True)


class Writer(FileSystemWriter):
    """DCP's file writer with ``_OwnFolderOnly`` (a module-level class: the process async mode pickles it)."""

    def __init__(self, path: Path, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = _OwnFolderOnly()


def hash_own_shards(save: Future, tmp: Path, rank: int, integrity: Integrity) -> dict[str, Any]:
    """After this rank's DCP write, hash its own shards off the training thread (hashlib releases
    the GIL), so the commit in ``wait`` only hashes the small files. DCP names a rank's shards
    ``__{rank}_{i}.distcp``; were that to change, the commit would simply hash them itself."""
    save.result()
    return {p.name: store.file_digest(p, integrity) for p in sorted(tmp.glob(f"__{rank}_*.distcp"))}


def describe_failure(e: BaseException, rank: int, tmp: Path, needed: int) -> str:
    """This rank's failure in one line. DCP's CheckpointException carries every failing rank's
    exception, on every rank; each rank names only its own (the others name theirs), so a full disk
    is reported by the rank that hit it with the bytes it needed."""
    if isinstance(e, CheckpointException):
        mine = e.failures.get(rank)  # failures: rank -> (exception, traceback summary)
        if mine is None:
            return ANOTHER_RANK
        e = mine[0]
    free = _free_after_failure(e, tmp)
    if free is not None:
        return no_space(rank, needed, tmp, free)
    return f"rank {rank}: {e!r}"


def no_space(rank: int, needed: int, tmp: Path, free: int) -> str:
    return f"rank {rank}: no space left on device, {needed} bytes needed at {tmp} ({free} bytes free)"


def _free_after_failure(e: BaseException, tmp: Path) -> int | None:
    """The free bytes at ``tmp`` when ``e`` is a full disk, else None.

    An OSError says ENOSPC itself. torch.save's C++ writer (which DCP writes tensors with) drops the
    errno: it raises RuntimeError "[enforce fail at inline_container.cc...] unexpected pos" or "file
    write failed"; such a write error on a disk with less than 1 MiB left is a full disk.
    """
    chain: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and cur not in chain:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    try:
        free = shutil.disk_usage(tmp if tmp.exists() else tmp.parent).free
    except OSError:
        free = 0
    for x in chain:
        if isinstance(x, OSError) and x.errno == errno.ENOSPC:
            return free
        text = str(x)
        if "No space left on device" in text:
            return free
        if isinstance(x, RuntimeError) and "inline_container" in text and free < 1 << 20:
            return free
    return None


def payload_bytes(payload: dict[str, Any]) -> int:
    """Bytes of this rank's tensors in a DCP payload (local shards of DTensors): an upper bound of
    what this rank writes (DCP writes a replicated tensor once, on one rank)."""
    total = 0
    for v in payload.values():
        if isinstance(v, dict):
            total += payload_bytes(v)
        elif isinstance(v, torch.Tensor):
            local = v.to_local() if hasattr(v, "to_local") else v
            total += local.numel() * local.element_size()
    return total


def one_line(e: BaseException) -> str:
    if isinstance(e, CheckpointException):
        return "; ".join(
            f"rank {r}: {str(f[0]).splitlines()[0][:300]}" for r, f in sorted(e.failures.items())
        )
    text = str(e).splitlines()[0][:300] if str(e) else ""
    return f"{type(e).__name__}: {text}"


def require_tensors(payload: dict[str, Any], prefix: str = "") -> None:
    """The DCP payload must be tensors only: DCP would pickle anything else (see state.py)."""
    for k, v in payload.items():
        if isinstance(v, dict):
            require_tensors(v, f"{prefix}{k}.")
        elif not isinstance(v, torch.Tensor):
            raise ValueError(
                f"state {prefix}{k} is a {type(v).__name__}; only tensors are checkpointed through DCP "
                "(put plain values in `extra`)"
            )
