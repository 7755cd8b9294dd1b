"""The config's own rules, before the launcher's heavy imports: a refused value answers in under a second.

Why: the launcher (framework.launch.entry, prelaunch) imports torch, the models and the planner, about
4 s on a quiet 2-core machine, before its first check; most refusals are a key's own range
(``train.lr=-1``), which the rules beside the keys (framework.config.rules) judge without any of it.
This runs those tables first, in the launcher's order; a value they refuse is the same one line and
exit 2 as from the launcher (each rule is the same object in both tables, so whatever fails here
fails there too). Everything else, and every case this cannot judge alone, goes on to the launcher
unchanged: a sweep's jobs (each records its own failure), torchrun's ranks (rank 0 validates for
all), ``model.init_from`` (the shape comes from the checkpoint), and a config that does not convert
or whose rule raises anything but the one-line ``ValueError``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from framework.config.rules.checkpoint import CHECKPOINT_RULES
from framework.config.rules.data import DATA_RULES
from framework.config.rules.model import MODEL_RULES
from framework.config.rules.parallel import PARALLEL_RULES
from framework.config.rules.rule import Rule, check_table
from framework.config.rules.run import EXECUTOR_RULES, FREEZE_RULES, LOGGER_RULES, RUN_RULES
from framework.config.rules.train import LR_SCHEDULER_RULES, OPTIMIZER_RULES, PEFT_RULES, TRAIN_RULES
from framework.config.schema import to_config
from framework.launch.run_dir_guard import discard_run_dir


def _config_rules() -> Iterator[tuple[str, Rule]]:
    """framework.launch.rules' order, less the rules that need a layer above the config."""
    for table in (
        MODEL_RULES,
        DATA_RULES,
        TRAIN_RULES,
        OPTIMIZER_RULES,
        LR_SCHEDULER_RULES,
        RUN_RULES,
        PARALLEL_RULES,
        FREEZE_RULES,
        PEFT_RULES,
        EXECUTOR_RULES,
        CHECKPOINT_RULES,
        LOGGER_RULES,
    ):
        yield from table.items()


def first_refusal(dcfg: DictConfig) -> str | None:
    """The one line of the first config rule ``dcfg`` breaks; None where it breaks none or where
    only the launcher can judge it."""
    if dcfg.get("model", {}).get("init_from"):
        return None
    try:
        cfg = to_config(dcfg)
    except Exception:  # noqa: BLE001 - the launcher converts it again and says what is wrong
        return None
    try:
        check_table(cfg, dict(_config_rules()))
    except ValueError as e:
        return str(e)
    except Exception:  # noqa: BLE001 - a rule that needs a value checked earlier: the launcher's order
        return None
    return None


def refuse_early(dcfg: DictConfig) -> None:
    """Exit 2 with the launcher's one line (and Hydra's files removed, as the launcher does) when a
    single run's config breaks one of its own rules."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN or "TORCHELASTIC_RUN_ID" in os.environ:
        return
    line = first_refusal(dcfg)
    if line is None:
        return
    print(f"error: {line}", file=sys.stderr)
    discard_run_dir(Path(hydra_cfg.runtime.output_dir))
    sys.exit(2)
