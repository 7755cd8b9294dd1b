"""One writer per checkpoint root: a lock file naming its owner (user, host, pid, run id).

Why: two runs pointed at one ``checkpoint.dir`` interleave their saves. Each one's rank 0 removes
the other's ``.tmp`` as stale, retention deletes the other's checkpoints, and a commit can list a
directory the other run just emptied (a checkpoint without ``extra.json``). So the first run takes
``root/LOCK`` (created with ``O_EXCL``: atomic on POSIX and on NFSv3+) and any other run is refused
with the owner's name.

A lock whose owner is gone is taken over, and the log says so: the owner's pid (and its
launcher's pid, which outlives a restart of the ranks) is dead on this host. The launcher takes the
lock before it writes the run files (framework.launch.run_files.take_launch_lock) and its ranks take it
over silently: a lock held by a rank's own launcher is the rank's. A lock held from
another host cannot be checked from here; it is refused, naming that host, so that the user
removes it knowingly. The owner's own later attempts (an elastic restart: the same launcher) take
it over without a fight.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("framework")

LOCK = "LOCK"


@dataclass(frozen=True)
class Owner:
    user: str
    host: str
    pid: int  # the process that holds the lock (rank 0)
    launcher_pid: int | None  # its launcher (elastic agent / torchrun), alive across rank restarts
    run_id: str  # the run dir
    since: str = ""

    def describe(self) -> str:
        launcher = f", launcher pid {self.launcher_pid}" if self.launcher_pid else ""
        return (
            f"run {self.run_id} (user {self.user}, host {self.host}, pid {self.pid}{launcher}, "
            f"since {self.since})"
        )


def me(run_id: str) -> Owner:
    """This process as a lock owner. ``launcher_pid`` is set only when a launcher started us."""
    launched = "FRAMEWORK_WORKER" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (containers)
        user = str(os.getuid())
    return Owner(
        user=user,
        host=socket.gethostname(),
        pid=os.getpid(),
        launcher_pid=os.getppid() if launched else None,
        run_id=run_id,
        since=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )


class LockHeld(ValueError):
    """Another live run owns the checkpoint root (a user error: pick another ``checkpoint.dir``)."""


def read(root: Path) -> Owner | None:
    """The current owner, or None when there is no lock (an unreadable lock counts as stale)."""
    try:
        raw = json.loads((root / LOCK).read_text())
        return Owner(**{k: raw[k] for k in Owner.__dataclass_fields__})
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return Owner("?", socket.gethostname(), -1, None, "?", "unreadable lock file")


def _pid_alive(pid: int | None) -> bool:
    """Whether ``pid`` runs. A zombie does not: it has exited and only waits for its parent to
    reap it. Ranks of a SIGKILLed launcher are reparented to pid 1, which in a container (a
    minimal init, Docker without --init) may reap them late or never; counted as alive, a zombie
    rank 0 kept its run dir's lock, and every relaunch was refused as "a live run" (found by
    benchmarks/fault_campaign.py). Linux says so in /proc; elsewhere ``kill(pid, 0)`` decides."""
    if not pid or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False  # no /proc (not Linux), or it was reaped just now
    return stat.rpartition(")")[2].split()[:1] == ["Z"]  # the state follows the command in parentheses


def blocking_owner(root: Path, run_id: str) -> Owner | None:
    """The owner that keeps ``run_id`` from writing into ``root``; None when the lock is free,
    stale (dead owner on this host) or ours (this process, or an earlier attempt of our launcher)."""
    owner = read(root)
    if owner is None:
        return None
    mine = me(run_id)
    if owner.host != mine.host:
        return owner
    if owner.pid == mine.pid or (owner.launcher_pid is not None and owner.launcher_pid == mine.launcher_pid):
        return None
    if mine.launcher_pid is not None and owner.pid == mine.launcher_pid:  # our launcher's, handed to us
        return None
    if _pid_alive(owner.pid) or _pid_alive(owner.launcher_pid):
        return owner
    return None


def refusal(root: Path, owner: Owner) -> str:
    return (
        f"checkpoint.dir={str(root)!r} is in use by {owner.describe()}: two runs writing one checkpoint "
        f"dir interleave and delete each other's saves. Use another checkpoint.dir, or wait for that run "
        f"to end (if it is gone, remove {root / LOCK})"
    )


def check_free(root: Path, run_id: str) -> None:
    """Before launch: LockHeld naming the owner when another live run holds ``root``."""
    owner = blocking_owner(root, run_id)
    if owner is not None:
        raise LockHeld(refusal(root, owner))


def acquire(root: Path, run_id: str) -> Owner:
    """Take the lock of ``root`` for this process; LockHeld naming the owner when another run has it.

    A stale lock (dead owner on this host) is moved away atomically before the new one is created,
    so of two processes taking over the same stale lock only one wins; the takeover is logged.
    """
    root.mkdir(parents=True, exist_ok=True)
    mine = me(run_id)
    for _ in range(5):
        try:
            fd = os.open(root / LOCK, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            owner = blocking_owner(root, run_id)
            if owner is not None:
                raise LockHeld(refusal(root, owner)) from None
            old = read(root)
            handed = old is not None and mine.launcher_pid is not None and old.pid == mine.launcher_pid
            if old is not None and old.pid != mine.pid and not handed:
                ours = old.launcher_pid is not None and old.launcher_pid == mine.launcher_pid
                why = "an earlier attempt of this launch" if ours else "its owner is no longer running"
                log.warning("checkpoint lock: taking over %s from %s: %s", root / LOCK, old.describe(), why)
            try:
                os.replace(root / LOCK, root / f"{LOCK}.stale.{mine.pid}")
                os.unlink(root / f"{LOCK}.stale.{mine.pid}")
            except FileNotFoundError:
                pass  # someone else moved it first: try again
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(mine), f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        return mine
    raise LockHeld(f"could not take the lock {root / LOCK}: it keeps changing owner")


def release(root: Path, owner: Owner) -> None:
    """Remove the lock if it is still ``owner``'s (never someone else's)."""
    current = read(root)
    if current is not None and current.pid == owner.pid and current.host == owner.host:
        try:
            (root / LOCK).unlink()
        except FileNotFoundError:
            pass
