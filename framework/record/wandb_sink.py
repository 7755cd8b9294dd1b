"""Weights & Biases as a metrics sink (``logger=wandb``), on rank 0 only.

Works with no network: without a configured API key (``WANDB_API_KEY`` unset and no netrc entry for
the wandb host) the run is recorded offline in the run dir (``wandb sync`` uploads it later). The run
id is returned so the trainer can store it in checkpoints: a restarted job passes it back and wandb
continues the same run (``id=``, ``resume="allow"``). The resolved config is logged with secrets
(keys matching key|token|secret|password) redacted.
"""

from __future__ import annotations

import logging
import netrc
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from framework.config.schema import LoggerConfig, WandbMode

log = logging.getLogger("framework")
SECRET_KEY = re.compile(r"key|token|secret|password", re.IGNORECASE)
REDACTED = "***"
RUN_ID_FILE = "wandb_run_id"


def strip_secrets(node: Any) -> Any:
    """A copy of a nested dict/list with the value of every secret-looking key redacted."""
    if isinstance(node, dict):
        return {k: REDACTED if SECRET_KEY.search(str(k)) else strip_secrets(v) for k, v in node.items()}
    if isinstance(node, list):
        return [strip_secrets(v) for v in node]
    return node


def has_api_key() -> bool:
    """True when wandb could authenticate: WANDB_API_KEY, or a netrc entry for the wandb host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    path = os.environ.get("NETRC") or str(Path.home() / ".netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def resolve_mode(mode: WandbMode) -> str:
    """online/offline: the config's explicit choice, else WANDB_MODE, else online only with a key."""
    if mode is not WandbMode.auto:
        return mode.value
    env = os.environ.get("WANDB_MODE")
    if env in ("online", "offline", "disabled"):
        return env
    return "online" if has_api_key() else "offline"


class WandbSink:
    """A ``Metrics`` sink: ``log(row)`` sends the numeric fields at ``row["step"]``; ``close()`` finishes.

    wandb drops rows whose step is below the last one logged (after a resume, the steps between the
    checkpoint and the crash are logged again and dropped): metrics.jsonl stays the full record.
    """

    def __init__(self, run: Any) -> None:
        self.run = run

    @property
    def run_id(self) -> str:
        return self.run.id

    def log(self, row: dict[str, Any]) -> None:
        # Numbers only: events stay in metrics.jsonl. bool is an int subclass; wandb plots it as 0/1.
        values = {k: v for k, v in row.items() if k not in ("step", "time") and isinstance(v, (int, float))}
        if values:
            self.run.log(values, step=int(row["step"]))

    def close(self) -> None:
        self.run.finish()


def start_wandb(
    logger: LoggerConfig, run_dir: Path, config: dict[str, Any], run_id: str | None = None
) -> WandbSink:
    """Start (or resume) the wandb run of ``run_dir``. Call on rank 0 only.

    ``run_id``: the id saved in the checkpoint being resumed; else the id this run dir already used
    (an elastic restart in the same dir); else a new one. Files go to ``run_dir/wandb`` (WANDB_DIR).
    """
    import wandb
    from wandb.sdk.lib.runid import generate_id

    id_file = run_dir / RUN_ID_FILE
    if run_id is None and id_file.is_file():
        run_id = id_file.read_text().strip() or None
    run_id = run_id or generate_id()
    os.environ["WANDB_DIR"] = str(run_dir)
    mode = resolve_mode(logger.mode)
    run = wandb.init(
        project=logger.project,
        entity=logger.entity,
        dir=str(run_dir),
        id=run_id,
        resume="allow",
        mode=mode,
        tags=list(logger.tags) or None,
        config=strip_secrets(config),
        reinit="finish_previous",
    )
    id_file.write_text(run.id + "\n")
    log.info("wandb: run %s (%s) in %s", run.id, mode, run_dir / "wandb")
    return WandbSink(run)
