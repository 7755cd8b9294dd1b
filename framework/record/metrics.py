"""Run-dir metrics: ``metrics.jsonl`` (always), a progress bar or plain log lines, and sinks.

Sinks are objects with ``log(row)`` and ``close()``; ``Metrics.start_sinks`` builds them from
``LoggerConfig`` (``logger=wandb`` adds ``framework.record.wandb_sink.WandbSink``) and ``close`` (or the end
of its ``with`` block) closes them with the file. Only rank 0 writes. Every JSONL row has ``step``; training rows have ``loss``, validation rows
``val_loss`` and ``val_ppl`` (its perplexity, exp of the mean per-token loss), events (fallbacks, restarts, checkpoint failures) have ``event``.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from framework.config.schema import LoggerConfig, LoggerKind

log = logging.getLogger("framework")


def perplexity(loss: float) -> float:
    """exp(mean per-token cross-entropy); inf rather than an OverflowError for a diverged loss."""
    return math.exp(loss) if loss < 700 else math.inf


def validation_row(step: int, val_loss: float, sets: dict[str, float] | None = None) -> dict[str, Any]:
    """A validation row; ``sets``: the loss of each named set (train.eval_sets), as ``val_loss/NAME``
    and ``val_ppl/NAME``."""
    row = {"step": step, "val_loss": val_loss, "val_ppl": perplexity(val_loss)}
    for name, loss in (sets or {}).items():
        row |= {f"val_loss/{name}": loss, f"val_ppl/{name}": perplexity(loss)}
    return row


class Metrics:
    def __init__(
        self, run_dir: Path, enabled: bool, total_steps: int, start_step: int, progress_bar: bool
    ) -> None:
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.rows: list[dict[str, Any]] = []
        self._file = self.path.open("a") if enabled else None
        use_bar = enabled and progress_bar and sys.stderr.isatty()
        self._bar = tqdm(total=total_steps, initial=start_step, dynamic_ncols=True) if use_bar else None
        self.sinks: list[Any] = []  # objects with .log(row) and .close() (wandb): see start_sinks
        # The progress every training line carries (step/total, elapsed, ETA): train.log, a SLURM log
        # or nohup.out have no bar. From here: the steps this launch runs (a resume starts mid-way).
        self.total_steps, self.start_step = total_steps, start_step
        self._started = time.monotonic()

    def start_sinks(
        self, logger: LoggerConfig, run_dir: Path, config: dict[str, Any], run_id: str | None = None
    ) -> None:
        """Open the sinks ``logger`` asks for (rank 0 only; see ``make_sinks``)."""
        if self.enabled:
            self.sinks = make_sinks(logger, run_dir, config, run_id)

    def log(self, row: dict[str, Any]) -> None:
        if self._file is None:  # not rank 0, or closed
            return
        row = {"time": round(time.time(), 3), **row}
        self.rows.append(row)
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        for sink in self.sinks:
            sink.log(row)
        text = format_row(row)
        if "loss" in row:
            text = self.with_progress(text, row["step"])
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.write(text)
        else:
            log.info(text)

    def begin(self, step: int) -> None:
        """The launch's steps start now, at ``step`` (past a resumed checkpoint's): elapsed and ETA
        count from here, and the bar stands at ``step``."""
        self.start_step, self._started = step, time.monotonic()
        if self._bar is not None:
            self._bar.n = step
            self._bar.refresh()

    def with_progress(self, text: str, step: int, now: float | None = None) -> str:
        """``text`` (a training row's line, ``step N | ...``) as ``step N/TOTAL | ... | elapsed E, ETA R``:
        the time since this launch's steps began and the rest at their mean pace so far."""
        elapsed = (time.monotonic() if now is None else now) - self._started
        done = step - self.start_step
        eta = elapsed / done * max(self.total_steps - step, 0) if done > 0 else None
        head = f"step {step}"
        text = f"{head}/{self.total_steps}{text[len(head):]}" if text.startswith(head) else text
        return f"{text} | elapsed {duration(elapsed)}, ETA {duration(eta) if eta is not None else '-'}"

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        """Close the progress bar, the file and every sink; a second call does nothing."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._file is not None:
            self._file.close()
            self._file = None
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close()

    def __enter__(self) -> Metrics:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def wandb_run_id(self) -> str | None:
        """The wandb run id to save in checkpoints (None without a wandb sink)."""
        return next((s.run_id for s in self.sinks if hasattr(s, "run_id")), None)


def make_sinks(
    logger: LoggerConfig, run_dir: Path, config: dict[str, Any], run_id: str | None = None
) -> list[Any]:
    """The sinks ``logger`` asks for, besides metrics.jsonl. Call on rank 0 only.

    ``config``: the resolved config as plain containers (secrets are redacted before logging);
    ``run_id``: the wandb run id saved in the checkpoint being resumed, so the same run continues.
    """
    if logger.kind is LoggerKind.wandb:
        from framework.record.wandb_sink import start_wandb

        return [start_wandb(logger, run_dir, config, run_id)]
    return []


def duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``: a log line's elapsed time or ETA."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_row(row: dict[str, Any]) -> str:
    if "event" in row:
        return f"step {row.get('step', '-')}: {row['event']}: {row.get('detail', '')}"
    parts = [f"step {row['step']}"]
    for key, fmt in (
        ("loss", "loss {:.4f}"),
        ("val_loss", "val_loss {:.4f}"),
        ("val_ppl", "val_ppl {:.2f}"),
        ("lr", "lr {:.2e}"),
        ("grad_norm", "grad_norm {:.3f}"),
        ("tokens_per_s", "{:,.0f} tok/s"),
        ("data_wait_share", "data wait {:.1%}"),
        ("mfu", "mfu {:.1%}"),
        ("peak_mem_gib", "mem {:.2f} GiB"),
        ("moe_load_max", "experts max/mean {:.2f}"),  # the worst MoE layer's; 1.0 = balanced
        ("moe_aux_loss", "aux {:.4f}"),
        ("moe_dropped_frac", "dropped {:.2%}"),
    ):
        if row.get(key) is not None:
            parts.append(fmt.format(row[key]))
    parts += [f"{k} {v:.4f}" for k, v in row.items() if k.startswith("val_loss/") and v is not None]
    return " | ".join(parts)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
