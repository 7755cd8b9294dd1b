"""What ``train.py`` sets up before Hydra runs, without torch: the resolvers its config names
(``${run_stamp:}``, ``${sweep_id:}``, the SLURM launcher's mesh figures) and the stack-dump timer.

Why apart from framework.launch.ranks (which re-exports them): ``python train.py --help``, a typo
refused by Hydra and every other answer given before a run starts should not wait for ``import
torch`` (seconds on a loaded 2-core machine; benchmarks/startup_bench.py). Standard library only at
import (OmegaConf when the resolvers are registered).
"""

from __future__ import annotations

import datetime
import os
import sys
import uuid
import warnings
from typing import Any


def arm_stack_dump() -> None:
    """Dump every thread's Python stack to stderr once this process has run ``FRAMEWORK_STACK_DUMP_S``
    seconds (unset: never). For hunting hangs in CI: a test that kills a stuck run after N seconds sets
    a smaller value, and the killed run's stderr then says where each process was."""
    seconds = os.environ.get("FRAMEWORK_STACK_DUMP_S", "")
    if not seconds:
        return
    try:
        after = float(seconds)
    except ValueError:
        after = 0.0
    if not after > 0:  # also NaN
        print(
            f"error: FRAMEWORK_STACK_DUMP_S={seconds}: use a number of seconds > 0, or unset it",
            file=sys.stderr,
        )
        sys.exit(2)
    import faulthandler

    # The process's own stderr: a test's captured sys.stderr has no file descriptor.
    faulthandler.dump_traceback_later(after, exit=False, file=sys.__stderr__)


def run_stamp() -> str:
    """The run-dir name shared by every rank of one launch (framework.launch.ranks's docstring says how)."""
    stamp = os.environ.get("RUN_STAMP")
    if stamp:
        return stamp
    now = datetime.datetime.now()
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if joined_torchrun() and run_id and run_id != "none":
        return f"{now:%Y-%m-%d}/{run_id}"
    # A fresh process: make the stamp once and export it, so anything this process starts agrees.
    stamp = f"{now:%Y-%m-%d}/{now:%H-%M-%S}-{uuid.uuid4().hex[:6]}"
    os.environ["RUN_STAMP"] = stamp
    return stamp


def register_resolvers() -> None:
    from omegaconf import OmegaConf  # here: `python -m framework --help` imports this module too

    if not OmegaConf.has_resolver("run_stamp"):
        # use_cache: every ${run_stamp:} in one config resolves to the same value.
        OmegaConf.register_new_resolver("run_stamp", run_stamp, use_cache=True)
    from framework.launch.sweep import register_resolver

    register_resolver()  # ${sweep_id:}: the stable sweep dir of conf/config.yaml
    # conf/hydra/launcher/*.yaml: the SLURM allocation derived from the mesh group.
    for name, fn in (("mesh_nodes", _mesh_nodes), ("mesh_procs_per_node", _mesh_procs_per_node)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


def _mesh_nodes(shape: Any) -> int:
    from framework.config.schema import MeshConfig

    return MeshConfig(shape=list(shape)).nodes


def _mesh_procs_per_node(shape: Any) -> int:
    from framework.config.schema import MeshConfig

    return MeshConfig(shape=list(shape)).procs_per_node


def joined_torchrun() -> bool:
    """True when this process is a rank started by torchrun (not by our own launcher)."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ and "FRAMEWORK_WORKER" not in os.environ


INTERRUPTED = "interrupted (Ctrl-C)"


def one_line_interrupts(line: str | None = INTERRUPTED) -> None:
    """An interrupt (Ctrl-C) that reaches the top of the main thread prints one line, not the
    traceback of wherever it landed (a hundred lines inside torch.export during the freeze, or
    inside an import). The exit status stays the interpreter's for SIGINT (130). Any other uncaught
    exception goes to the hook that was installed before. The training loop's own SIGINT handling
    (framework.checkpoint.preempt: save, then exit 0) is unchanged.

    ``line=None``: print nothing (a self-launched rank: its launcher, told of the same Ctrl-C,
    prints the one line for all ranks)."""
    previous = sys.excepthook
    if getattr(previous, "one_line_interrupts", False):  # installed already (train.py run again in-process)
        return

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if issubclass(kind, KeyboardInterrupt):
            if line is not None:
                print(line, file=sys.stderr)
            return
        previous(kind, value, tb)

    hook.one_line_interrupts = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def one_line_warnings() -> None:
    """A Python warning prints as one line, ``file:line: Category: message``, without the source
    line Python adds below it (``return {name: validate_variable(...)}`` under each NCCL debugging
    variable of ``nccl=gdr3``: two lines of noise per warning for a user of the command line)."""

    def one_line(
        message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
    ) -> str:
        return f"{filename}:{lineno}: {category.__name__}: {message}\n"

    warnings.formatwarning = one_line  # type: ignore[assignment]
