"""Fault injection, to test recovery on your own setup: the shipped ``fault_injection`` callback.

``run.fault_kill_at_step=N``: rank ``run.fault_rank`` (-1: every rank) SIGKILLs itself once step N
was read (no cleanup, like a node failure), on the launcher's first attempt only, so the restarted
job resumes from its checkpoint. ``run.fault_raise_at_step=N``: the forward of step N raises
``InjectedFault`` from inside the model on that rank, as a bug in a step would, to test that every
part is closed on the way out. ``verify.inject_nan_steps=[N, ...]``: the forward output of the steps
on batches N, ... (0-based batch indices: a rollback does not revisit a batch, so each fires once) is
NaN on every rank, to test the bad-step policy (skip, rollback, fallback). The keys stay on the command
line only (a shared recipe may not set them: framework.launch.recipe_check).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from framework.parallel.pipeline import called_modules, logit_modules
from framework.train.callbacks import Callback, RunContext

log = logging.getLogger("framework")


class InjectedFault(RuntimeError):
    """``run.fault_raise_at_step``: the exception a step raises on purpose (to test cleanup)."""


def poison_logits(model: nn.Module, active: Callable[[], bool]) -> list[RemovableHandle]:
    """Forward hooks that, while ``active()``, multiply ``model``'s output (the logits) by NaN, so the
    loss, the gradients and their norm all become NaN through the real code path, exactly as a
    numerical blow-up would. Under a pipeline the schedule calls the stages, never the model: the
    hook goes on the stage that makes the logits (on the last stage's rank; other pp ranks hook
    nothing). Its NaN loss reaches every pp rank through the loss's sum over the pp axis, and its NaN
    input gradients flow back through every stage, so all ranks see the same non-finite step."""

    def poison(_m: nn.Module, _inputs: tuple, output: torch.Tensor) -> torch.Tensor | None:
        return output * float("nan") if active() else None

    return [m.register_forward_hook(poison) for m in logit_modules(model)]


class FaultInjection(Callback):
    """Kill, raise or make steps NaN as configured (see the module docstring); a no-op (no hook on the
    model) when none is asked for."""

    def __init__(self) -> None:
        self.handles: list[RemovableHandle] = []

    def on_resume(self, run: RunContext, step: int, extra: dict[str, Any]) -> None:
        self._arm(run)

    def on_rebuild(self, run: RunContext, step: int) -> None:
        self._arm(run)  # the hooks went with the replaced model

    def _arm(self, run: RunContext) -> None:
        self.close()
        if run.runner is None:
            return
        self._arm_raise(run)
        nan = set(run.cfg.verify.inject_nan_steps)
        if nan:
            runner = run.runner
            self.handles += poison_logits(runner.model, lambda: runner.running_batch in nan)

    def _arm_raise(self, run: RunContext) -> None:
        """A forward pre-hook that raises in the training forward of step ``run.fault_raise_at_step``
        (the loop's ``state.step`` is the step before while it runs)."""
        cfg = run.cfg.run
        if cfg.fault_raise_at_step < 0 or cfg.fault_rank not in (-1, run.rank) or run.runner is None:
            return
        at, state, rank = cfg.fault_raise_at_step, run.state, run.rank

        def fail(module: nn.Module, _inputs: tuple) -> None:
            if module.training and state.step + 1 == at:
                raise InjectedFault(f"run.fault_raise_at_step={at}: injected fault on rank {rank}")

        # A pipeline's schedule calls its stages, never the model (framework.parallel.pipeline).
        self.handles += [m.register_forward_pre_hook(fail) for m in called_modules(run.runner.model)]

    def on_step_read(self, run: RunContext, step: int) -> None:
        cfg = run.cfg.run
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if step == cfg.fault_kill_at_step and cfg.fault_rank in (-1, run.rank) and first_attempt:
            log.warning("run.fault_kill_at_step=%d: rank %d kills itself", step, run.rank)
            os.kill(os.getpid(), signal.SIGKILL)

    def close(self) -> None:
        handles, self.handles = self.handles, []
        for h in handles:
            h.remove()
