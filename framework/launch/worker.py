"""One rank of a self-launched job: ``python -m framework.worker RUN_DIR``.

Reads the resolved config that the launching process wrote to ``RUN_DIR/config.yaml`` (so every
rank runs exactly the same config in the same run dir), trains, and exits through
``framework.parallel.process.finish`` (gloo's exit race).
"""

from __future__ import annotations

import logging
import sys
import traceback
from pathlib import Path

from omegaconf import OmegaConf

from framework.config.schema import to_config
from framework.data.tokens import DataChanged
from framework.launch.ranks import arm_stack_dump, die_with_launcher
from framework.parallel.process import KEPT_PARTS, finish
from framework.record.run_dir import DirGone


def setup_logging(run_dir: Path, rank: int) -> None:
    """Rank 0 logs to the console and to the run's log file; other ranks log warnings only."""
    root = logging.getLogger()
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    fmt = logging.Formatter(f"[%(asctime)s][rank{rank}][%(levelname)s] %(message)s", "%H:%M:%S")
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(fmt)
    root.addHandler(console)
    if rank == 0:
        handler = logging.FileHandler(run_dir / "train.log")
        handler.setFormatter(fmt)
        root.addHandler(handler)


def tell_launcher(message: str) -> None:
    """Hand ``message`` to torch's elastic agent (its per-rank error file): the launcher's
    ``ChildFailedError`` then carries it, and framework.launch.entry reports it as the run's one line."""
    import json
    import os
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        Path(path).write_text(json.dumps({"message": message, "timestamp": int(time.time())}))


def main(run_dir: Path) -> int:
    import os

    from framework.train import trainer

    die_with_launcher()
    arm_stack_dump()
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(run_dir, rank)
    try:
        if not run_dir.is_dir():  # deleted before a restart of the ranks
            raise DirGone(f"run dir {run_dir} was deleted during the run; the ranks did not start again")
        cfg = to_config(OmegaConf.load(run_dir / "config.yaml"))
        trainer.run(cfg, run_dir, keep=KEPT_PARTS)  # never freed: the process ends with os._exit
        return 0
    except (DataChanged, DirGone) as e:  # one line, not a traceback: the user changed a file
        logging.getLogger("framework").error("rank %d stopped: %s", rank, e)
        tell_launcher(str(e))
        return 1
    except Exception:  # noqa: BLE001 - the traceback goes to the log; the launcher sees the exit code
        logging.getLogger("framework").error("rank %d failed:\n%s", rank, traceback.format_exc())
        return 1


if __name__ == "__main__":
    finish(main(Path(sys.argv[1])))
