"""A folder the run writes into, deleted (or replaced) while the run is still going.

Why watch it: a run keeps its files open, so once a user deletes its run dir the metrics go to a
deleted file, every save recreates ``checkpoints/step_N`` under the old path and the run reports
success; a folder another run then made at the same path would get our saves (and our retention).
The run stamps the folder's identity (device and inode) when it starts and compares it at each
metrics write and each save; a mismatch stops every rank with ``DirGone``, one line, writing
nothing more.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# How every DirGone message starts (the launcher recognises it in a rank's error file).
GONE_PREFIXES = ("run dir ", "checkpoint dir ")


class DirGone(Exception):
    """The run dir (or the checkpoint dir) was deleted or replaced during the run: stop, write nothing."""


@dataclass(frozen=True)
class DirStamp:
    """What a folder was when the run started: its device and inode, and those of one file the run
    wrote in it (``marker``): a folder made again at the same path often gets the same inode number
    back, but not the run's file."""

    what: str  # "run dir" or "checkpoint dir": how the message names it (one of GONE_PREFIXES)
    path: Path
    identity: tuple[int, int]  # (st_dev, st_ino) of the folder
    marker: str | None = None  # a file of the run in it (config.yaml), when there is one
    marker_identity: tuple[int, int, int] | None = None  # its (st_ino, st_size, st_mtime_ns)

    @classmethod
    def of(cls, what: str, path: Path, marker: str | None = None) -> DirStamp:
        st = os.stat(path)
        if marker is None or not (Path(path) / marker).is_file():
            return cls(what, Path(path), (st.st_dev, st.st_ino))
        m = os.stat(Path(path) / marker)
        return cls(what, Path(path), (st.st_dev, st.st_ino), marker, (m.st_ino, m.st_size, m.st_mtime_ns))

    def gone(self) -> str | None:
        """Why the folder is no longer the run's (None: it still is). One or two ``os.stat``."""
        try:
            st = os.stat(self.path)
        except OSError:
            return f"{self.what} {self.path} was deleted during the run"
        same = (st.st_dev, st.st_ino) == self.identity
        if same and self.marker is not None:
            try:
                m = os.stat(self.path / self.marker)
                same = (m.st_ino, m.st_size, m.st_mtime_ns) == self.marker_identity
            except OSError:
                same = False
        if not same:
            return f"{self.what} {self.path} was deleted during the run (another folder now has its path)"
        return None

    def check(self, when: str) -> None:
        """Raise DirGone (naming the folder and ``when``, e.g. "at step 20") if it is gone."""
        reason = self.gone()
        if reason is not None:
            raise DirGone(stopped(reason, when))


def stopped(reason: str, when: str) -> str:
    """The one line of a DirGone: what went, when the run noticed, and that it wrote nothing more."""
    return f"{reason}; noticed {when}, the ranks stopped and wrote nothing more"


def check_dir_creatable(key: str, value: str) -> None:
    """ValueError naming ``key`` when ``value`` or a parent of it is an existing file, or when the
    nearest existing folder is not writable (this user cannot create or fill the directory)."""
    check_creatable(f"{key}={value!r}", Path(value))


def check_creatable(named: str, path: Path, noun: str = "directory") -> None:
    """ValueError naming ``named`` (``key=value``) when ``path`` or a parent of it is an existing file,
    or when the nearest existing folder is not writable (this user cannot create or fill it): before
    a run, a save or an export writes there, not as a traceback halfway through."""
    for p in (path, *path.parents):
        if not p.exists():
            continue
        if not p.is_dir():
            raise ValueError(f"{named} cannot be created: {str(p)!r} is a file, not a {noun}")
        if not os.access(p, os.W_OK | os.X_OK):
            raise ValueError(
                f"{named} cannot be written: {str(p)!r} is not writable by this user; "
                f"valid: a {noun} you can create and write"
            )
        why = cannot_create_in(p)
        if why is not None:
            raise ValueError(
                f"{named} cannot be written: nothing can be created in {str(p)!r} ({why}); "
                f"valid: a {noun} you can create and write"
            )
        return


def cannot_create_in(folder: Path) -> str | None:
    """Why nothing can be created in ``folder`` (None: something can): a folder that is made and
    removed at once. Why a probe: ``os.access`` says yes to root for /proc and /sys, where mkdir
    then fails (FileNotFoundError, PermissionError tracebacks after the work), and to a read-only
    mount's owner."""
    import tempfile

    try:
        probe = tempfile.mkdtemp(prefix=".probe-", dir=folder)
    except OSError as e:
        return e.strerror or type(e).__name__
    os.rmdir(probe)
    return None
