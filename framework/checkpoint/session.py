"""``RunCheckpoints``: a training run's checkpointing, built once with everything it saves.

It holds the model, optimizer and scheduler (through the runner, which replaces them on a
fallback), the sampler and the train state, and decides itself when to act: ``decide`` every step
(``checkpoint.every_steps`` / ``every_minutes``, the end of the run, a preemption signal: an
agreement between ranks, so a collective every step), ``save_if_due`` after the step's figures were
read, ``rollback`` when the verifier asks for one, ``resume`` at the start. ``close`` (the end of its
``with`` block, also after an exception) finishes an async save, reports failed saves, releases the
lock and restores the signal handlers. With ``checkpoint.enabled=false`` every verb is a no-op
except ``rollback``'s record that there was nothing to roll back to.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from framework.checkpoint import store
from framework.checkpoint.manager import Checkpointer
from framework.checkpoint.preempt import PreemptionHandler
from framework.config.schema import CheckpointConfig, TrainConfig
from framework.record.metrics import Metrics, read_metrics
from framework.record.train_state import TrainState

log = logging.getLogger("framework")
Record = Callable[[int, str, str, str], Any]  # Verifier.fallback(step, trigger, action, detail)


class Trainable(Protocol):
    """What a checkpoint saves and loads (``framework.train.runner.StepRunner``); ``build()`` makes fresh ones."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler

    def build(self) -> None: ...


class Sampler(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def rewind(self) -> None: ...


class RunCheckpoints:
    def __init__(
        self,
        cfg: CheckpointConfig,
        train: TrainConfig,
        root: Path,
        run_dir: Path,
        parts: Trainable,
        sampler: Sampler,
        state: TrainState,
        metrics: Metrics,
        extra: dict[str, Any],
        record: Record,
        max_bad_steps: int,
    ) -> None:
        """``extra``: the plain values every checkpoint also holds (config hash, model shape);
        ``record``: how a rollback is reported (the verifier's fallback events)."""
        self.cfg = cfg
        self.train = train
        self.run_dir = run_dir
        self.parts = parts
        self.sampler = sampler
        self.state = state
        self.metrics = metrics
        self.extra = extra
        self.record = record
        self.max_bad_steps = max_bad_steps
        self.ckpt = Checkpointer(cfg, root, run_id=str(run_dir)) if cfg.enabled else None
        self.preempt = PreemptionHandler(self.ckpt.control_group) if self.ckpt is not None else None
        self.preempted = False
        self._save, self._stop = False, False

    # -- every step --------------------------------------------------------------------------------

    def decide(self, step: int) -> bool:
        """Whether step ``step`` saves or stops. Collective (the preemption flag and the timed
        interval are agreed between ranks): every rank calls it once per step, in the same order."""
        if self.ckpt is None:
            return False
        assert self.preempt is not None
        self._stop = self.preempt.requested()
        self._save = (
            self._stop
            or (step == self.train.steps and self.cfg.at_end)
            or self.ckpt.should_save(step, time.monotonic())
        )
        return self._save or self._stop

    def save_if_due(self, step: int) -> bool:
        """Save step ``step`` when ``decide`` said so; True when the run must stop (a preemption:
        the save is committed, or the event says why not)."""
        if self._save:
            self._write(step)
        if not self._stop:
            return False
        assert self.ckpt is not None and self.preempt is not None
        self.preempted = True
        self.ckpt.wait()  # an async save commits now: the event below says whether it did
        self._log_failures()
        sig, saved = self.preempt.signal_name(), self.ckpt.last_error is None
        detail = (
            f"{sig}: saved step {step}, exiting"
            if saved
            else f"{sig}: the save at step {step} failed ({self.ckpt.last_error}), exiting"
        )
        self.metrics.log({"step": step, "event": "preempted", "detail": detail, "saved": saved})
        return True

    def _write(self, step: int) -> None:
        assert self.ckpt is not None
        extra = {
            "step": step,
            "tokens_seen": self.state.tokens_seen,
            "data": self.sampler.state_dict(),
            "config_hash": self.extra.get("config_hash"),
            "wandb_run_id": self.metrics.wandb_run_id,
            # The shape, so that model.init_from and export-hf can read this checkpoint on its own.
            "model": self.extra.get("model"),
        }
        p = self.parts
        self.ckpt.save(step, p.model, p.optimizer, p.scheduler, extra)
        self._log_failures()

    # -- on demand ---------------------------------------------------------------------------------

    def rollback(self, step: int, rewind: bool) -> int | None:
        """Back to the latest checkpoint after ``max_bad_steps`` non-finite steps ending at ``step``,
        keeping the data position (past the bad batches); returns the step restored (None: there is
        no checkpoint, the run skips on). ``rewind``: a step was queued after ``step`` on the
        weights being replaced; its batch is given back, so the run goes on exactly as if the
        rollback had come before it."""
        path = self.ckpt.latest() if self.ckpt is not None else None
        if path is None:
            self.record(
                step,
                "bad_steps",
                "no checkpoint to roll back to: skipping on",
                f"{self.max_bad_steps} non-finite steps in a row",
            )
            return None
        assert self.ckpt is not None
        if rewind:
            self.sampler.rewind()
        position = self.sampler.state_dict()
        p = self.parts
        extra = self.ckpt.load(path, p.model, p.optimizer, p.scheduler)
        self.sampler.load_state_dict(position)
        self.state.step, self.state.tokens_seen = int(extra["step"]), int(extra.get("tokens_seen", 0))
        self.record(
            step,
            "bad_steps",
            f"rollback to step {extra['step']} ({path.name})",
            f"{self.max_bad_steps} non-finite steps in a row; data stays at batch "
            f"{position['consumed_batches']}",
        )
        return self.state.step

    def resume(self, resume: str, digest: str, is_main: bool) -> dict[str, Any]:
        """Load the checkpoint that ``checkpoint.resume`` names into the parts, the sampler and the
        train state; returns its extra state ({} if none).

        ``auto`` takes the newest checkpoint that verifies and loads; each newer one is moved to
        ``corrupt/`` (kept) with a ``checkpoint_rejected`` event. When none is usable but there were
        checkpoints, or an earlier launch in this run dir trained, the run starts from step 0
        *loudly*: an error in the log, a ``no_usable_checkpoint`` event in metrics.jsonl and in
        summary.json.
        """
        if self.ckpt is None:
            return {}
        t0 = time.perf_counter()
        p = self.parts
        if resume != "auto":
            path = self.ckpt.resolve_resume(resume)
            if path is None:
                return {}
            extra = self.ckpt.load(path, p.model, p.optimizer, p.scheduler)
        else:
            before = trained_before(self.run_dir) if is_main else None
            found = self.ckpt.load_latest(p.model, p.optimizer, p.scheduler)
            for name, reason in found.rejected:
                self.metrics.log({"step": 0, "event": "checkpoint_rejected", "detail": f"{name}: {reason}"})
            if found.path is None:
                if found.load_failed:  # a load stopped part-way: start from freshly initialised weights
                    p.build()
                if found.rejected or before is not None:
                    self._no_checkpoint(found.rejected, before)
                return {}
            path, extra = found.path, found.extra
        if extra.get("config_hash") not in (None, digest) and is_main:
            log.warning(
                "resuming %s, saved with a different config (hash %s, now %s)",
                path,
                extra["config_hash"][:12],
                digest[:12],
            )
        self.sampler.load_state_dict(extra["data"])
        self.state.step, self.state.tokens_seen = int(extra.get("step", 0)), int(extra.get("tokens_seen", 0))
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        detail = f"from {path} at step {extra['step']} in {time.perf_counter() - t0:.1f}s"
        if restarts:
            detail += f" (restart {restarts} of the launcher)"
        self.metrics.log({"step": extra["step"], "event": "resumed", "detail": detail, "restarts": restarts})
        return extra

    def _no_checkpoint(self, rejected: list[tuple[str, str]], before: int | None) -> None:
        """Say loudly (log error, metrics event, summary) that this run starts over from step 0."""
        assert self.ckpt is not None
        root = self.ckpt.root
        if rejected:
            names = ", ".join(Path(n).name for n, _ in rejected)
            what = (
                f"none of the {len(rejected)} checkpoints under {root} is usable ({names}); they were "
                f"moved to {root / 'corrupt'} (kept, with the reason in <name>.why)"
            )
        else:
            what = f"an earlier launch in this run dir trained to step {before}, but no checkpoint is left under {root}"
        detail = f"{what}: training starts from step 0"
        log.error("RESUME FAILED: %s", detail)
        self.metrics.log({"step": 0, "event": "no_usable_checkpoint", "detail": detail})

    # -- the end -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Finish (commit) a pending async save, report failed saves, release the lock, restore the
        signal handlers. Collective when a save is pending; a second call does nothing."""
        try:
            if self.ckpt is not None:
                self.ckpt.close()
                self._log_failures()
        finally:
            if self.preempt is not None:
                self.preempt.close()

    def summary(self, is_main: bool) -> dict[str, Any] | None:
        """Saves committed and failed, the last failure and the newest committed checkpoint
        (None without checkpointing)."""
        if self.ckpt is None:
            return None
        c = self.ckpt
        if c.saves_failed and not c.saves_ok and is_main:
            log.error(
                "every checkpoint save of this run failed (%d of %d): %s",
                c.saves_failed,
                c.saves_failed,
                c.last_error,
            )
        committed = store.committed(c.root)  # the newest one is what generate / export-hf read
        latest = str(committed[-1][1]) if committed else None
        return {"saved": c.saves_ok, "failed": c.saves_failed, "last_error": c.last_error, "latest": latest}

    def _log_failures(self) -> None:
        """A ``checkpoint_failed`` event for each save that failed since the last call (at its own step)."""
        assert self.ckpt is not None
        for step, error in self.ckpt.take_failures():
            self.metrics.log({"step": step, "event": "checkpoint_failed", "detail": error})

    def __enter__(self) -> RunCheckpoints:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def trained_before(run_dir: Path) -> int | None:
    """The last step an earlier launch in this run dir logged a loss for (None: none did). Read before
    this launch logs its first step."""
    steps = [int(r["step"]) for r in read_metrics(run_dir) if "loss" in r]
    return max(steps) if steps else None
