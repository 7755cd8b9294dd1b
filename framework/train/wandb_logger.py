"""The shipped ``wandb`` callback: ``logger=wandb`` starts Weights & Biases on rank 0 as a metrics sink.

It starts once the checkpoint is loaded, so that the wandb run id saved in it continues the same
wandb run after a restart (framework.record.wandb_sink); the sink closes with the metrics.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from framework.config.schema import LoggerKind
from framework.train.callbacks import Callback, RunContext


class WandbLogger(Callback):
    """``logger=wandb`` (``logger.*``): every metrics row also goes to wandb; a no-op otherwise."""

    def on_resume(self, run: RunContext, step: int, extra: dict[str, Any]) -> None:
        if run.cfg.logger.kind is not LoggerKind.wandb or run.metrics is None:
            return
        plain = OmegaConf.to_container(OmegaConf.structured(run.cfg), enum_to_str=True)
        assert isinstance(plain, dict)
        run.metrics.start_sinks(run.cfg.logger, run.run_dir, plain, run_id=extra.get("wandb_run_id"))
