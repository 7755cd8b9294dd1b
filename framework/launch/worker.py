"""One rank of a self-launched job: ``python -m framework.worker RUN_DIR``.

Reads the resolved config and its plan that the launching process wrote to ``RUN_DIR/config.yaml``
and ``RUN_DIR/plan.json`` (so every rank runs exactly the same config and layout in the same run
dir, and none plans again), trains, and exits through ``framework.parallel.process.finish`` (gloo's
exit race). A missing plan.json, or one of another config, is one line and exit status 2.
"""

from __future__ import annotations

import logging
import sys
import traceback
from pathlib import Path

from framework.launch.startup import one_line_interrupts

one_line_interrupts(None)  # Ctrl-C while this rank imports or freezes: the launcher says it, once

from omegaconf import OmegaConf

from framework.checkpoint.lock import LockHeld
from framework.config.schema import Config, to_config
from framework.data.tokens import DataChanged
from framework.launch.failures import is_lost_peer
from framework.launch.ranks import arm_stack_dump, die_with_launcher
from framework.parallel.process import KEPT_PARTS, finish
from framework.planner.plan import Plan
from framework.planner.resolve import load_plan
from framework.record.run_dir import DirGone

# How a rank's LockHeld reaches the launcher's ChildFailedError (framework.launch.entry._run_spawned).
LOCK_HELD = "checkpoint lock held: "


def setup_logging(run_dir: Path, rank: int) -> None:
    """Rank 0 logs to the console and to the run's log file; other ranks log warnings only."""
    root = logging.getLogger()
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    fmt = logging.Formatter(f"[%(asctime)s][rank{rank}][%(levelname)s] %(message)s", "%H:%M:%S")
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(fmt)
    console.addFilter(lambda record: not getattr(record, "file_only", False))
    root.addHandler(console)
    if rank == 0:
        handler = logging.FileHandler(run_dir / "train.log")
        handler.setFormatter(fmt)
        root.addHandler(handler)


def tell_launcher(message: str) -> bool:
    """Hand ``message`` to torch's elastic agent (its per-rank error file): the launcher's
    ``ChildFailedError`` then carries it, and framework.launch.entry reports it as the run's one line.
    False when no agent started this rank (nobody to tell)."""
    import json
    import os
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        Path(path).write_text(json.dumps({"message": message, "timestamp": int(time.time())}))
    return bool(path)


def load_run(run_dir: Path) -> tuple[Config, Plan]:
    """The run dir's resolved config and the plan the launcher wrote for it: read, never planned.
    Raises ValueError (one line) for a plan.json that is missing or another config's."""
    cfg = to_config(OmegaConf.load(run_dir / "config.yaml"))
    return cfg, load_plan(cfg, run_dir)


def main(run_dir: Path) -> int:
    import os

    from framework.train import trainer

    die_with_launcher()
    arm_stack_dump()
    rank = int(os.environ.get("RANK", "0"))
    if not run_dir.is_dir():  # deleted before a restart of the ranks
        gone = f"run dir {run_dir} was deleted during the run; the ranks did not start again"
        print(f"error: {gone}", file=sys.stderr)
        tell_launcher(gone)
        return 1
    setup_logging(run_dir, rank)
    try:
        cfg, plan = load_run(run_dir)
    except ValueError as e:  # a bad run dir: one line, before any process group exists
        if not tell_launcher(str(e)):  # the launcher prints it once, for all ranks
            print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        trainer.run(cfg, plan, run_dir, keep=KEPT_PARTS)  # never freed: the process ends with os._exit
        return 0
    except LockHeld as e:  # another launch took the checkpoint root first: one line, exit 2
        if not tell_launcher(f"{LOCK_HELD}{e}"):
            print(f"error: {e}", file=sys.stderr)
        return 2
    except (DataChanged, DirGone) as e:  # one line, not a traceback: the user changed a file
        logging.getLogger("framework").error("rank %d stopped: %s", rank, e)
        tell_launcher(str(e))
        return 1
    except Exception as e:  # noqa: BLE001 - the traceback goes to the log; the launcher sees the exit code
        # A collective that lost its peer is a consequence of another rank's death, which the
        # launcher reports in one line: its traceback goes to the run's log file only (rank 0's).
        lost = is_lost_peer(e)
        logging.getLogger("framework").error(
            "rank %d %s:\n%s",
            rank,
            "lost a peer rank" if lost else "failed",
            traceback.format_exc(),
            extra={"file_only": lost},
        )
        return 1


if __name__ == "__main__":
    finish(main(Path(sys.argv[1])))
