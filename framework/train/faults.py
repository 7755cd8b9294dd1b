"""Fault injection, to test recovery on your own setup: the shipped ``fault_injection`` callback.

``run.fault_kill_at_step=N``: rank ``run.fault_rank`` (-1: every rank) SIGKILLs itself once step N
was read (no cleanup, like a node failure), on the launcher's first attempt only, so the restarted
job resumes from its checkpoint. ``run.fault_raise_at_step=N``: the forward of step N raises
``InjectedFault`` from inside the model on that rank, as a bug in a step would, to test that every
part is closed on the way out. Both keys stay on the command line only (a shared recipe may not set
them: framework.launch.recipe_check).
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from framework.parallel.pipeline import called_modules
from framework.train.callbacks import Callback, RunContext

log = logging.getLogger("framework")


class InjectedFault(RuntimeError):
    """``run.fault_raise_at_step``: the exception a step raises on purpose (to test cleanup)."""


class FaultInjection(Callback):
    """Kill or raise at the configured step (see the module docstring); a no-op when both are -1."""

    def __init__(self) -> None:
        self.handles: list[RemovableHandle] = []

    def on_resume(self, run: RunContext, step: int, extra: dict[str, Any]) -> None:
        self._arm(run)

    def on_rebuild(self, run: RunContext, step: int) -> None:
        self._arm(run)  # the hooks went with the replaced model

    def _arm(self, run: RunContext) -> None:
        """A forward pre-hook that raises in the training forward of step ``run.fault_raise_at_step``
        (the loop's ``state.step`` is the step before while it runs)."""
        self.close()
        cfg = run.cfg.run
        if cfg.fault_raise_at_step < 0 or cfg.fault_rank not in (-1, run.rank) or run.runner is None:
            return
        at, state, rank = cfg.fault_raise_at_step, run.state, run.rank

        def fail(module: nn.Module, _inputs: tuple) -> None:
            if module.training and state.step + 1 == at:
                raise InjectedFault(f"run.fault_raise_at_step={at}: injected fault on rank {rank}")

        # A pipeline's schedule calls its stages, never the model (framework.parallel.pipeline).
        self.handles = [m.register_forward_pre_hook(fail) for m in called_modules(run.runner.model)]

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
