"""The run dir deleted during training (framework.record.run_dir, framework.train.run_dir_watch).

Was: the run went on, its metrics into a deleted file, every save recreating ``checkpoints/step_N``
under the old path, and it exited 0. Now every rank stops at the next metrics write or save with one
line, exit 1, having written nothing more and deleted nothing. Real ``train.py`` runs, 1 and 2 gloo ranks.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from framework.checkpoint import store
from framework.record.run_dir import DirGone, DirStamp, check_creatable
from tests.entry import start_forked

ROOT = Path(__file__).resolve().parents[2]
SMALL = ("train.seq_len=16", "train.global_batch_size=4", "train.eval_every=0", "freeze=none")


def test_a_stamp_tells_deleted_from_replaced(tmp_path: Path) -> None:
    d = tmp_path / "run"
    d.mkdir()
    (d / "config.yaml").write_text("the run's\n")
    stamp = DirStamp.of("run dir", d, marker="config.yaml")
    assert stamp.gone() is None
    shutil.rmtree(d)
    assert stamp.gone() == f"run dir {d} was deleted during the run"
    d.mkdir()  # another folder at the same path (often the same inode number) is not the run's
    assert "another folder now has its path" in (stamp.gone() or "")
    with pytest.raises(DirGone, match=r"noticed at step 3, the ranks stopped and wrote nothing more"):
        stamp.check("at step 3")


def delete_during_run(tmp_path: Path, replace: bool, *extra: str, mode: str = "sync") -> tuple[int, str, str]:
    """A real run saving every 2 steps; once one checkpoint is committed, delete its run dir (and
    with ``replace`` make a user's folder at the same path). Returns (exit status, stdout, stderr)."""
    run = tmp_path / "run"
    overrides = [f"hydra.run.dir={run}", *SMALL, *extra, "train.steps=100000", "train.log_every=2"]
    overrides += [f"checkpoint={mode}", "checkpoint.every_steps=2", "checkpoint.keep_last=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = start_forked(*overrides, env=env)  # python train.py, forked (tests/entry.py)
    try:
        deadline = time.monotonic() + 180
        while not store.committed(run / "checkpoints"):
            assert proc.poll() is None and time.monotonic() < deadline, "the run ended or never saved"
            time.sleep(0.05)
        gone = tmp_path / "deleted"  # rename first: an rmtree racing with a save's new files can fail
        os.rename(run, gone)
        while gone.exists():
            shutil.rmtree(gone, ignore_errors=True)
        if replace:
            run.mkdir()
            (run / "notes.txt").write_text("mine")
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out, err


def assert_one_line(code: int, err: str, run: Path) -> None:
    assert code == 1, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert f"error: run dir {run} was deleted during the run" in errors[0]
    assert "the ranks stopped and wrote nothing more; no checkpoint is left" in errors[0]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_one_rank_stops_in_one_line_and_recreates_nothing(tmp_path: Path, mode: str) -> None:
    """async: a save in flight when the folder goes fails; the one line says why (no warning too)."""
    neighbour = tmp_path / "keep.txt"
    neighbour.write_text("a file beside the run dir")
    code, _, err = delete_during_run(tmp_path, False, mode=mode)
    assert_one_line(code, err, tmp_path / "run")
    assert not (tmp_path / "run").exists()  # a save did not recreate checkpoints/step_N
    assert neighbour.read_text() == "a file beside the run dir"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def test_two_ranks_stop_together_and_leave_a_folder_made_at_its_path_alone(tmp_path: Path) -> None:
    """Both gloo ranks stop at the same step (rank 0's finding is broadcast), each with one line and
    no gloo traceback; the user's new folder at the same path keeps its file and gets nothing."""
    code, out, err = delete_during_run(tmp_path, True, "mesh=2", "run.oversubscribe=true")
    assert code != -signal.SIGKILL
    assert_one_line(code, err, tmp_path / "run")
    for rank in (0, 1):
        assert f"rank {rank} stopped: run dir {tmp_path / 'run'} was deleted" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["notes.txt"]
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_folder_os_access_calls_writable_but_that_takes_no_new_entry_is_refused(tmp_path: Path) -> None:
    """``export-hf RUN /proc/x`` (and a run dir or checkpoint.dir there): os.access says root may
    write /proc, mkdir then failed with a FileNotFoundError traceback after the checkpoint was read.
    The probe leaves nothing behind where it can create."""
    with pytest.raises(
        ValueError, match=r"^OUT='/proc/x' cannot be written: nothing can be created in '/proc' \("
    ):
        check_creatable("OUT='/proc/x'", Path("/proc/x"), "folder")
    check_creatable("OUT='x'", tmp_path / "new" / "x", "folder")
    assert list(tmp_path.iterdir()) == []
