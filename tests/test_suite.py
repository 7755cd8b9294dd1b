"""The test suite itself: stopped by SIGTERM or Ctrl-C it leaves no run behind; its quick subset
(``pytest -m smoke``, README) is a real selection of the suite."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

LONG_TEST = """
from tests.entry import train_forked


def test_a_long_run():
    train_forked({args}, timeout=600)
"""


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (children of all its threads, recursively)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            todo += [k for k in kids if k not in found]
            found.update(kids)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize(
    ("sig", "mesh"), [(signal.SIGTERM, "2"), (signal.SIGINT, "1")], ids=["sigterm", "ctrl_c"]
)
def test_a_stopped_suite_leaves_no_process_behind(tmp_path: Path, sig: int, mesh: str) -> None:
    """A pytest running a test whose forked ``train.py`` trains (in a session of its own; with
    mesh=2 its two ranks below it) is stopped: every process below pytest ends with it. SIGTERM
    killed pytest at once and left the run training; Ctrl-C left it too (its session is not the
    terminal's)."""
    run = tmp_path / "run"
    args = ["train.steps=100000", "train.eval_every=0", "logger.plot=false", "checkpoint=none"]
    args += ["freeze=none", f"mesh={mesh}", f"hydra.run.dir={run}"]
    (tmp_path / "test_long.py").write_text(LONG_TEST.format(args=", ".join(repr(a) for a in args)))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("RUN_STAMP", None)
    cmd = [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q"]
    proc = subprocess.Popen(
        [*cmd, str(tmp_path / "test_long.py")],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal's job
    )
    below: set[int] = set()
    try:
        deadline = time.monotonic() + 300
        while not ((run / "metrics.jsonl").is_file() and '"loss"' in (run / "metrics.jsonl").read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "the run never trained"
            time.sleep(0.1)
        below = descendants(proc.pid)
        assert len(below) >= (1 if mesh == "1" else 3), below  # the forked run (and its ranks)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    deadline = time.monotonic() + 30  # a rank dies of its launcher's death (PDEATHSIG): a moment
    while any(alive(p) for p in below) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in below if alive(p)]
    for p in left:  # what the suite left: this test's own processes, ended before it fails
        os.kill(p, signal.SIGKILL)
    assert not left, out[-3000:]
    assert proc.returncode != 0 and "KeyboardInterrupt" in out, out[-3000:]


def test_the_smoke_subset_is_marked_and_documented() -> None:
    """``pytest -m smoke`` selects the quick subset beside the full suite: some tests of several
    layers, far fewer than the whole; the README names the command."""
    from tests.conftest import SMOKE

    # Only the files SMOKE names are collected: the marker goes on SMOKE's ids alone (conftest.py), so
    # ``-m smoke`` selects the same tests among them as among the whole suite, whose collection (every
    # test module imported, ~2x the time) the full run does anyway.
    files = sorted({s.split("::")[0] for s in SMOKE})
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "smoke",
            "--collect-only",
            "-q",
            "-o",
            "addopts=",
            "-p",
            "no:cacheprovider",
            *files,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    selected = [ln for ln in out.stdout.splitlines() if "::" in ln]
    folders = {ln.split("/")[1] for ln in selected if ln.startswith("tests/") and ln.count("/") > 1}
    assert 10 <= len(selected) <= 120 and len(folders) >= 5, selected
    stale = [s for s in SMOKE if not any(t == s or t.startswith((f"{s}::", f"{s}[")) for t in selected)]
    assert stale == [], "SMOKE ids that select no test"
    assert "pytest -m smoke" in (ROOT / "README.md").read_text()
    # No file marks a test smoke by itself (it would join ``-m smoke`` unlisted, outside the files above).
    decorator = re.compile(r"^\s*@pytest\.mark\.smoke\b|pytestmark\s*=.*\bsmoke\b", re.M)
    marked = [p for p in (ROOT / "tests").rglob("*.py") if decorator.search(p.read_text())]
    assert marked == [], marked
