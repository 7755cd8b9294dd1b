"""The run dir before and after a refused launch: refuse a dir that is a file, not writable, or held by a
live run before Hydra writes into it (``RunDirCheck``, a Hydra callback), and remove what Hydra just
created when the launch is refused (only a dir this invocation created holding nothing but Hydra's own
files; never a folder that existed).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework.launch.prelaunch import check_dir_creatable

HYDRA_FILES = {".hydra", "train.log"}


# Run dir (resolved) -> what existed before Hydra's mkdir: None when the run dir itself did not,
# else the names already inside it. Recorded by ``RunDirCheck`` so that a refusal removes only what
# this invocation created (a user's folder given as hydra.run.dir, and its train.log, stay).
_BEFORE_HYDRA: dict[str, tuple[frozenset[str] | None, list[Path]]] = {}


def note_run_dir(run_dir: Path) -> None:
    """Before Hydra creates ``run_dir``: record whether it (and which parents) exist already."""
    path = Path(run_dir).resolve()
    created = [p for p in (path, *path.parents) if not p.exists()]
    inside = frozenset(p.name for p in path.iterdir()) if path.is_dir() else None
    _BEFORE_HYDRA[str(path)] = (inside, created)


def discard_run_dir(run_dir: Path) -> None:
    """Remove what Hydra wrote for this invocation, never anything else: the run dir and its new
    parents only when this invocation created them and they hold nothing but Hydra's files; in a
    folder that existed before, only the Hydra files that were not there. Nothing without a record."""
    path = Path(run_dir).resolve()
    record = _BEFORE_HYDRA.pop(str(path), None)
    if record is None or not path.is_dir():
        return
    inside, created = record
    if inside is not None:
        for name in HYDRA_FILES - inside:
            target = path / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target, ignore_errors=True)
            elif target.is_file():
                target.unlink(missing_ok=True)
        return
    if {p.name for p in path.iterdir()} <= HYDRA_FILES:
        shutil.rmtree(path, ignore_errors=True)
        for parent in created[1:]:
            if parent.is_dir() and not any(parent.iterdir()):
                parent.rmdir()


class RunDirCheck(Callback):
    """Refuse an unusable ``hydra.run.dir`` / ``hydra.sweep.dir`` before Hydra creates it.

    Hydra makes the run dir before our task function runs, and a file or a read-only folder there
    was a Python traceback from Hydra's ``mkdir`` (or, for read-only, a failure in every rank later).
    Registered in conf/config.yaml's ``hydra.callbacks``; exits 2 with one line, having written nothing.
    """

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _refuse_run_dir("hydra.run.dir", str(config.hydra.run.dir))
        _refuse_locked_run_dir(config, Path(str(config.hydra.run.dir)))
        note_run_dir(Path(str(config.hydra.run.dir)))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _refuse_run_dir("hydra.sweep.dir", str(config.hydra.sweep.dir))


def _refuse_run_dir(key: str, value: str) -> None:
    try:
        check_dir_creatable(key, value)
    except ValueError as e:
        _refuse(str(e))


def _refuse_locked_run_dir(config: DictConfig, run_dir: Path) -> None:
    """Refuse (exit 2) a run dir that a live run holds, before Hydra rewrites its ``.hydra/`` files
    and appends to its ``train.log``: the later check (``check_checkpoint_lock``) came only after
    Hydra had written into the live run's records. Held means: the run dir's ``checkpoints/LOCK``,
    or the ``checkpoint.dir`` this launch would lock, belongs to a live process. Rank 0 (or the
    launcher) only, as the later check: a torchrun rank on another host cannot tell a live lock
    from its own job's. A ``checkpoint.dir`` that does not read plainly is the validation's to report."""
    if os.environ.get("RANK", "0") != "0" or not run_dir.is_dir():
        return
    from framework.checkpoint import lock

    own = run_dir / "checkpoints"
    owner = lock.blocking_owner(own, str(run_dir))
    if owner is not None:
        _refuse(
            f"hydra.run.dir={str(run_dir)!r} belongs to a live run: {owner.describe()} holds "
            f"{own / lock.LOCK}, and a second launch there would overwrite its files; valid: another "
            f"hydra.run.dir, or wait for that run to end (if it is gone, remove {own / lock.LOCK})"
        )
    try:
        enabled = OmegaConf.select(config, "checkpoint.enabled", default=False)
        root = OmegaConf.select(config, "checkpoint.dir", default=None)
    except OmegaConfBaseException:
        return
    if enabled is True and isinstance(root, str) and root:
        owner = lock.blocking_owner(Path(root), str(run_dir))
        if owner is not None:
            _refuse(lock.refusal(Path(root), owner))


def _refuse(message: str) -> None:
    """One line on stderr, exit 2: a refusal before Hydra has written anything."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)
