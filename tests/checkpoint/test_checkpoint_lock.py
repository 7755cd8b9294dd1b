"""The checkpoint root's lock with real processes: a live owner refuses, a dead one is taken over."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from framework.checkpoint import lock


def _write_lock(root: Path, **fields: object) -> None:
    root.mkdir(parents=True, exist_ok=True)
    owner = {
        "user": "alice",
        "host": lock.me("x").host,
        "pid": 0,
        "launcher_pid": None,
        "run_id": "outputs/a",
    }
    owner |= {"since": "2026-12-01T08:00:00Z", **fields}
    (root / lock.LOCK).write_text(json.dumps(owner))


def test_a_live_owner_is_refused_by_name_and_keeps_its_lock(tmp_path: Path) -> None:
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lock(tmp_path, pid=live.pid, run_id="outputs/other-run")
        for attempt in (lock.check_free, lock.acquire):
            with pytest.raises(lock.LockHeld) as e:
                attempt(tmp_path, "outputs/mine")
            msg = str(e.value)
            assert "outputs/other-run" in msg and "user alice" in msg and f"pid {live.pid}" in msg, msg
            assert lock.me("x").host in msg and "checkpoint.dir=" in msg
        assert lock.read(tmp_path).pid == live.pid  # untouched
    finally:
        live.kill()
        live.wait()


def test_a_dead_owner_on_this_host_is_taken_over_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _write_lock(tmp_path, pid=dead.pid, run_id="outputs/crashed")
    lock.check_free(tmp_path, "outputs/mine")  # no error: stale
    with caplog.at_level(logging.WARNING, logger="framework"):
        mine = lock.acquire(tmp_path, "outputs/mine")
    assert (
        "taking over" in caplog.text
        and "outputs/crashed" in caplog.text
        and "no longer running" in caplog.text
    )
    assert lock.read(tmp_path) == mine and mine.run_id == "outputs/mine"
    lock.release(tmp_path, mine)
    assert not (tmp_path / lock.LOCK).exists()


def test_another_host_is_refused_and_release_never_removes_another_owner(tmp_path: Path) -> None:
    _write_lock(tmp_path, host="node-17", pid=1234)
    with pytest.raises(lock.LockHeld, match="host node-17"):
        lock.acquire(tmp_path, "outputs/mine")
    lock.release(tmp_path, lock.me("outputs/mine"))
    assert lock.read(tmp_path).host == "node-17"


def test_a_lock_the_ranks_launcher_holds_is_the_ranks_and_is_taken_over_silently(tmp_path: Path) -> None:
    """The launcher takes the lock before it writes the run files (framework.launch.entry); its
    rank, a child started with FRAMEWORK_WORKER set, takes it over without a warning. Another
    process is refused by the launcher's lock and by the rank's (whose launcher still runs)."""
    import os

    mine = lock.acquire(tmp_path, "outputs/run")  # this process: the launcher
    child = (
        "import logging, sys; from pathlib import Path; from framework.checkpoint import lock; "
        "logging.basicConfig(level=logging.WARNING); "
        "owner = lock.acquire(Path(sys.argv[1]), 'outputs/run'); print(owner.pid, owner.launcher_pid)"
    )

    def start(worker: bool) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != "FRAMEWORK_WORKER"} | (
            {"FRAMEWORK_WORKER": "1"} if worker else {}
        )
        return subprocess.run(
            [sys.executable, "-c", child, str(tmp_path)], env=env, capture_output=True, text=True
        )

    stranger = start(worker=False)
    assert stranger.returncode != 0 and f"pid {mine.pid}" in stranger.stderr, stranger.stderr[-2000:]
    rank = start(worker=True)
    assert rank.returncode == 0 and rank.stderr == "", rank.stderr  # no "taking over" warning
    pid, launcher = rank.stdout.split()
    assert int(launcher) == mine.pid and lock.read(tmp_path).pid == int(pid)
    stranger = start(worker=False)
    assert stranger.returncode != 0 and f"launcher pid {mine.pid}" in stranger.stderr, stranger.stderr[-2000:]


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="needs Linux /proc")
def test_a_zombie_owner_is_dead(tmp_path: Path) -> None:
    """An owner that exited and was not reaped yet (a SIGKILLed launcher's rank, reparented to an
    init that does not reap) holds nothing: the lock is taken over."""
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        while Path(f"/proc/{zombie.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
            pass  # exited, not waited for: a zombie
        _write_lock(tmp_path, pid=zombie.pid, run_id="outputs/killed")
        lock.check_free(tmp_path, "outputs/mine")
        assert lock.acquire(tmp_path, "outputs/mine").run_id == "outputs/mine"
    finally:
        zombie.wait()
