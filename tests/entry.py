"""Run ``train.py``'s entry point without a fresh interpreter: in this process, or in a forked child.

Why: a ``python train.py`` subprocess costs 4-6 s of CPU on the 2-core CI machine (a fresh
interpreter importing torch and the framework) before it does anything. A refusal in this
process (``train_main``) costs the compose and the checks, well under a second. A run that
trains goes to a child forked from this process (``train_forked``): real ``train.py``, real
Hydra, real launcher and ranks, without the imports. The real-process path keeps its own tests
(``tests/launch/test_rules.py``'s end-to-end cases, the signal and launcher tests of test_elastic.py).
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent


def train_main(*argv: str) -> int:
    """``python train.py *argv`` in this process; returns its exit status.

    The module is loaded under the name ``__main__`` (not put in sys.modules): Hydra then finds
    ``conf/`` next to the file, and its own ``if __name__ == "__main__": main()`` runs, as
    ``python train.py`` does. The environment is restored afterwards: the entry point exports
    RUN_STAMP (and a launch would set RANK, MASTER_PORT, ...), which later tests' children and
    forked ranks would otherwise inherit; a process group it left is destroyed for the same reason.
    """
    saved_argv, saved_env, saved_cwd = sys.argv, dict(os.environ), os.getcwd()
    try:
        os.chdir(ROOT)
        return _exec_train(argv)
    finally:
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        if dist.is_initialized():
            dist.destroy_process_group()
        # train.py armed a stack dump of this process (framework.launch.ranks.arm_stack_dump): it was for
        # that run, and a child forked while it is armed would hang re-arming it (train_forked).
        faulthandler.cancel_dump_traceback_later()


def _exec_train(argv: tuple[str, ...]) -> int:
    """Run ``train.py`` as ``__main__`` with ``argv``; its exit status."""
    spec = importlib.util.spec_from_file_location("__main__", ROOT / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.argv = ["train.py", *argv]
    try:
        spec.loader.exec_module(module)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)  # what the interpreter does with a message as the exit code
        return 1
    return 0


def train_forked(
    *argv: str, timeout: float, env: dict[str, str] | None = None, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    """``python train.py *argv`` in a child forked from this process: its exit status and output.

    The child starts with torch, Hydra and the framework imported; everything after is the real
    thing: ``train.py`` runs as ``__main__`` with that argv (and ``env``, default this process's,
    without RUN_STAMP), Hydra composes, a multi-rank run launches its ranks as ``python train.py``
    does. The child leads its own process group, killed whole when the child ends or at the
    timeout (then ``subprocess.TimeoutExpired`` is raised, as ``subprocess.run`` does). Ranks of a
    self-launch run in sessions of their own (torch's elastic launcher) and die with their launcher
    (``framework.launch.ranks.die_with_launcher``). Output goes to files, not pipes: a rank that outlived
    its launcher cannot keep this call waiting.
    """
    child_env = dict(os.environ if env is None else env)
    child_env.pop("RUN_STAMP", None)
    # An armed faulthandler watchdog does not survive fork: the child's train.py, re-arming it
    # (arm_stack_dump), would wait forever for the parent's watchdog thread to stop.
    faulthandler.cancel_dump_traceback_later()
    with tempfile.TemporaryDirectory() as d:
        out_path, err_path = Path(d) / "out", Path(d) / "err"
        pid = _fork_train(argv, child_env, cwd, out_path, err_path)
        code = _wait(pid, timeout)
        out, err = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    if code is None:
        raise subprocess.TimeoutExpired(["train.py", *argv], timeout, out, err)
    return subprocess.CompletedProcess(["train.py", *argv], code, out, err)


class ForkedRun:
    """``python train.py *argv`` running in a child forked from this process, as ``subprocess.Popen``
    would start it (``start_forked``): for tests that act on a run while it trains (a signal, a file
    changed or deleted under it). The child leads its own process group, killed whole when the child
    has ended (its ranks run in sessions of their own and die with it: die_with_launcher). Its
    stdout and stderr go to files (one, with ``merge``), read by ``communicate``."""

    def __init__(self, argv: tuple[str, ...], env: dict[str, str], cwd: Path, log: Path | None) -> None:
        self.args = ["train.py", *argv]
        self.returncode: int | None = None
        self._dir = tempfile.TemporaryDirectory()
        self.out_path = log if log is not None else Path(self._dir.name) / "out"
        self.err_path = log if log is not None else Path(self._dir.name) / "err"
        self.pid = _fork_train(argv, env, cwd, self.out_path, self.err_path)

    def poll(self) -> int | None:
        if self.returncode is None and os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)  # the zombie keeps the group's id until reaped
            _, raw = os.waitpid(self.pid, 0)
            LIVE.discard(self.pid)
            self.returncode = os.waitstatus_to_exitcode(raw)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
        self.wait(timeout=30)

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float) -> tuple[str, str]:
        """Wait for the end; (stdout, stderr) as text (both the one log with ``log``)."""
        self.wait(timeout)
        out = self.out_path.read_text(errors="replace")
        err = out if self.err_path == self.out_path else self.err_path.read_text(errors="replace")
        return out, err


def start_forked(
    *argv: str, env: dict[str, str] | None = None, cwd: Path = ROOT, log: Path | None = None
) -> ForkedRun:
    """``subprocess.Popen([python, "train.py", *argv])`` without the fresh interpreter: a child
    forked from this process runs train.py as ``train_forked`` does, and returns at once. ``log``:
    stdout and stderr both go to that file (``stderr=STDOUT``)."""
    child_env = dict(os.environ if env is None else env)
    child_env.pop("RUN_STAMP", None)
    faulthandler.cancel_dump_traceback_later()  # see train_forked
    return ForkedRun(argv, child_env, cwd, log)


# The forked children not reaped yet: each leads its own session (os.setsid), so a Ctrl-C or SIGTERM
# of pytest does not reach it; ``kill_children`` (tests/conftest.py, when the session ends however
# it ends) kills their process groups, and their ranks die with them (die_with_launcher).
LIVE: set[int] = set()


def kill_children() -> list[int]:
    """SIGKILL every forked child's process group that is still there, reap it; the pids."""
    killed = sorted(LIVE)
    for pid in killed:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        LIVE.discard(pid)
    return killed


def _fork_train(argv: tuple[str, ...], env: dict[str, str], cwd: Path, out_path: Path, err_path: Path) -> int:
    """Fork a child that runs train.py with ``argv``, its output in the two files (or one); its pid."""
    pid = os.fork()
    if pid:
        LIVE.add(pid)
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.setsid()
            _redirect(out_path, err_path)
            os.environ.clear()
            os.environ.update(env)
            os.chdir(cwd)
            code = _exec_train(argv)
        except BaseException as e:  # noqa: BLE001 - what the interpreter prints (its hook), then exit 1
            sys.excepthook(type(e), e, e.__traceback__)
            code = 130 if isinstance(e, KeyboardInterrupt) else 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def _redirect(out_path: Path, err_path: Path) -> None:
    """The child's fds 1 and 2 (inherited by its ranks) and sys.stdout/err go to two files (one
    open file for both when they are the same path, as ``stderr=STDOUT``)."""
    for fd, path in ((1, out_path), (2, err_path)):
        if fd == 2 and err_path == out_path:
            os.dup2(1, 2)
            continue
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    # pytest's capture replaced sys.stdout/err with its own files: point them back at fds 1 and 2.
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - lives until os._exit
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115


def _wait(pid: int, timeout: float) -> int | None:
    """The child's exit status (-N for signal N, as subprocess reports it); None on timeout.

    Either way nothing of its process group is left running."""
    deadline = time.monotonic() + timeout
    # WNOWAIT: the child stays a zombie (its pid, the group's id, cannot be reused) until killpg ran.
    timed_out = False
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        timed_out = time.monotonic() > deadline
        if timed_out:
            break
        time.sleep(0.02)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    _, raw = os.waitpid(pid, 0)
    LIVE.discard(pid)
    return None if timed_out else os.waitstatus_to_exitcode(raw)


def write_run_config(run_dir: Path, *overrides: str) -> None:
    """``run_dir/config.yaml`` and ``plan.json`` as ``python train.py *overrides`` writes them for its
    ranks: composed by Hydra from ``conf/``, validated, layout and batch resolved
    (``framework.launch.prelaunch.prelaunch``), planned once.

    For reference runs that train on forked ranks (``tests.dist.train_rank``) instead of a launch."""
    from hydra import compose, initialize_config_dir

    from framework.config import schema as config
    from framework.config.schema import quote_numeric_choices, to_yaml
    from framework.launch import recipes
    from framework.launch.prelaunch import prelaunch
    from framework.launch.ranks import register_resolvers
    from framework.planner.report import plan_to_dict
    from framework.planner.resolve import write_plan

    config.register()
    recipes.register()
    register_resolvers()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        dcfg = compose("config", overrides=quote_numeric_choices(list(overrides)))
    cfg, plan, _ = prelaunch(dcfg, run_dir, None)
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    write_plan(run_dir, plan_to_dict(plan))
