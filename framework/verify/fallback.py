"""The fallback ladder and its triggers: executor rungs, latency circuit breaker, bad-step policy.

Ladder: cudagraphs -> compile -> eager. A float8 run (``model.float8``) has one more rung, taken
first when its loss stays non-finite (the bad-step trigger): float8 -> bf16, same executor. A
fallback rebuilds the model from the meta model with the next rung's executor (the runner re-runs
``parallelize``) and carries the trained state over with ``carry_state`` (the weights, and an
optimizer state only once it has stepped), so the run goes on exactly where a run on the lower rung
would be; a failed first step is retried from the state before it (``Ladder.guard``).

Who does what: the verifier judges (``framework.verify.session``: a ``Verdict`` or None), the
runner builds (``Rungs``), and ``Ladder`` sits between them: the trainer drives it, it picks the
rung below for a verdict, has the runner rebuild on it and records why.

The decisions here are pure (figures in, decision out) so they are unit-tested without a model;
the trainer feeds them figures that all ranks agree on (see ``max_over_ranks``), so every rank
takes the same decision at the same step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol, TypeVar

import torch
import torch._functorch.config as functorch_config
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim.optimizer import register_optimizer_step_pre_hook

from framework.config.schema import ExecutorMode, Float8Recipe
from framework.verify.baseline import percentile

T = TypeVar("T")
E = TypeVar("E")
LADDER = (ExecutorMode.cudagraphs, ExecutorMode.compile, ExecutorMode.eager)


def next_mode(mode: ExecutorMode) -> ExecutorMode | None:
    """The next rung down the ladder, or None on eager (the last rung)."""
    i = LADDER.index(mode)
    return LADDER[i + 1] if i + 1 < len(LADDER) else None


class Rungs(Protocol):
    """What the ladder acts on (``framework.train.runner.StepRunner``): the executed model, its executor
    and float8 rungs, and a rebuild for another rung (``carry``: keep the trained state)."""

    model: nn.Module
    float8: Float8Recipe
    device: torch.device

    @property
    def mode(self) -> ExecutorMode: ...

    def build(
        self, mode: ExecutorMode | None = None, float8: Float8Recipe | None = None, carry: bool = False
    ) -> None: ...

    def snapshot(self) -> Callable[[], None]:
        """Take what a failing step can change that ``build(carry=True)`` would carry over; the
        returned call puts it back."""
        ...


@dataclass(frozen=True)
class Verdict:
    """A judgement that asks for a lower rung: its trigger (``compile_error``, ``numerics``,
    ``graph``, ``circuit_breaker``, ``bad_steps``) and why."""

    trigger: str
    detail: str


# Record a change of course: (step, trigger, action, detail); ``Verifier.fallback``.
Record = Callable[[int, str, str, str], object]


class Ladder:
    """The fallback ladder as one small component, driven by the trainer.

    ``start`` builds the configured rung (or eager, after a graph verdict) and has the verifier
    judge it; a compile error there (on any rank: the ranks agree in one ``all_gather_object``) or
    a verdict steps one executor rung down and builds again, before step 1. ``guard`` does the
    same for a compile error in the first step (by default nothing compiles before it) and in a
    validation (the run's first one, at step 0 by default, compiles the eval graph). ``take`` acts on a
    verdict read mid-run: the float8 rung for bad steps, the executor rung for the breaker, each
    rebuilt with the trained state carried over. ``on=False`` (``verify.ladder=false``): the
    executor rungs are never taken (a compile error is raised); the float8 rung of the bad-step
    policy stays, as it always was.
    """

    def __init__(self, rungs: Rungs, record: Record, on: bool) -> None:
        self.rungs = rungs
        self.record = record
        self.on = on

    def lower(self, mode: ExecutorMode | None = None) -> ExecutorMode | None:
        """The executor rung below ``mode`` (default: the current one), or None (eager, or off)."""
        return next_mode(mode or self.rungs.mode) if self.on else None

    def start(self, judge: Callable[[bool], Verdict | None], graph: Verdict | None = None) -> None:
        """Build the first rung that builds and passes ``judge`` (called with whether a lower rung
        exists; it runs the first forward, where torch.compile compiles). ``graph``: the reference
        graph check asked to fall back, so the run starts on eager."""
        mode = self.rungs.mode
        if graph is not None and mode is not ExecutorMode.eager:
            self.record(0, graph.trigger, f"executor {mode.value} -> eager", graph.detail)
            mode = ExecutorMode.eager
        while True:
            lower = self.lower(mode)
            error, verdict = None, None
            try:
                self.rungs.build(mode)
                verdict = judge(lower is not None)
            except Exception as e:  # noqa: BLE001 - any compile/capture error moves down the ladder
                if lower is None:
                    raise
                error = _first_line(e)
            failed = [f"rank {r}: {e}" for r, e in enumerate(_gather_errors(error, lower)) if e is not None]
            if not failed and verdict is None:
                return
            assert lower is not None
            if failed:
                verdict = Verdict("compile_error", failed[0])
            assert verdict is not None
            self.record(0, verdict.trigger, f"executor {mode.value} -> {lower.value}", verdict.detail)
            mode = lower

    def guard(self, attempt: Callable[[], T], step: int = 0) -> T:
        """Run the run's first step (``attempt``), where torch.compile compiles by default (no
        forward of its own runs before it: that would compile a second, gradient-free graph), or a
        validation (the trainer's, at ``step``: its gradient-free graph compiles at the first one,
        step 0 by default, before the first training step). A
        compile error on every rank steps every rank down one executor rung and runs the same batch
        again, from the state before the attempt: the rebuild carries the weights and optimizer
        state (none has stepped), and what the failed forward changed (RNG, MoE routing sums) is
        put back first (``Rungs.snapshot``), so the run goes on as a run on the lower rung would.
        One ``all_gather_object`` lets the ranks agree.

        The attempt lowers each compiled region's backward when its forward compiles (torch
        compiles it lazily, at the first backward, by default), so that a compile error comes
        before any gradient or, under ``train.optimizer_in_backward``, any update. An error on some
        ranks only, or after an optimizer stepped (a later error of that step), stops every rank:
        a step cannot be taken back."""
        while True:
            mode, lower = self.rungs.mode, self.lower()
            error, result, undo = None, None, self.rungs.snapshot()
            stepped: list[object] = []
            try:
                with _backward_lowered_with_forward(), _watch_optimizer_steps(stepped):
                    result = attempt()
            except Exception as e:  # noqa: BLE001 - any compile/capture error moves down the ladder
                if lower is None:
                    raise
                error = _first_line(e)
            errors = _gather_errors((error, bool(stepped)) if error else None, lower)
            failed = [f"rank {r}: {e[0]}" for r, e in enumerate(errors) if e is not None]
            if not failed:
                return result  # type: ignore[return-value]
            if len(failed) < len(errors):
                raise RuntimeError(
                    f"the first step failed on {len(failed)} of {len(errors)} ranks ({failed[0]}); the "
                    "others stepped and cannot step back, so no rank falls back: fix the error, or set "
                    "a lower executor.mode"
                )
            if any(e[1] for e in errors if e is not None):
                raise RuntimeError(
                    f"the first step failed after its optimizer had stepped ({failed[0]}): the updated "
                    "weights cannot step back, so no rank falls back: fix the error, or set a lower "
                    "executor.mode"
                )
            assert lower is not None
            undo()
            self.record(step, "compile_error", f"executor {mode.value} -> {lower.value}", failed[0])
            self.rungs.build(lower, carry=True)

    def take(self, step: int, verdict: Verdict | None) -> None:
        """Act on a verdict read at ``step``: rebuild on the rung below, keeping the trained state."""
        if verdict is None:
            return
        rungs = self.rungs
        if verdict.trigger == "bad_steps":
            left = rungs.float8
            if next_float8(left) is None:
                return  # no float8 rung: the checkpointer's rollback is the whole answer
            rungs.build(float8=next_float8(left), carry=True)
            action = f"model.float8 {left.value} -> none (bf16)"
            self.record(step, verdict.trigger, action, f"{verdict.detail} under float8 {left.value}")
            return
        lower = self.lower()
        if lower is not None:
            rungs.build(lower, carry=True)
        what = f"executor {lower.value}" if lower else "none (already eager)"
        self.record(step, verdict.trigger, f"fallback: {what}", verdict.detail)


def _first_line(e: BaseException) -> str:
    """The error's type and first line; where that line only introduces the cause (Dynamo's
    ``BackendCompilerFailed: backend='inductor' raised:``), the cause's line too: the record must
    say what failed, not only that the compiler did."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if text.endswith(":") and len(lines) > 1:
        text = f"{text} {lines[1]}"
    return f"{type(e).__name__}: {text[:300]}"


def _gather_errors(error: E | None, lower: ExecutorMode | None) -> list[E | None]:
    """Every rank's build error (None: built), so that all ranks take the same rung; nothing to
    gather when there is no rung below (an error was raised)."""
    if lower is None or not (dist.is_initialized() and dist.get_world_size() > 1):
        return [error]
    errors: list[E | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return errors


@contextlib.contextmanager
def _backward_lowered_with_forward() -> Iterator[None]:
    """Compile each region's backward graph together with its forward (AOTAutograd lowers it lazily,
    at its first backward, by default: a backward that fails to compile would fail after the
    forward and part of the backward ran). The same compile work, at another moment. A torch without
    the switch lowers lazily; a backward compile error then still refuses the fallback when an
    optimizer stepped (``_watch_optimizer_steps``)."""
    if not hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        yield
        return
    with functorch_config.patch(force_non_lazy_backward_lowering=True):
        yield


@contextlib.contextmanager
def _watch_optimizer_steps(stepped: list[object]) -> Iterator[None]:
    """Note in ``stepped`` each optimizer step taken in the block (any optimizer: the per-parameter
    ones of ``train.optimizer_in_backward`` too)."""
    handle = register_optimizer_step_pre_hook(lambda opt, _args, _kwargs: stepped.append(opt))
    try:
        yield
    finally:
        handle.remove()


def max_over_ranks(value: float) -> float:
    """The largest value over all ranks (identity on one rank): the worst rank decides."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def next_float8(recipe: Float8Recipe) -> Float8Recipe | None:
    """The float8 rung: a float8 recipe steps down to ``none`` (bf16 autocast); None when off."""
    return Float8Recipe.none if recipe is not Float8Recipe.none else None


@dataclass
class CircuitBreaker:
    """Trips when the p99 step time of ``patience`` consecutive windows of ``window`` steps is above
    ``factor`` x ``reference_p99_s``. Without a baseline, the first full window sets the reference.

    ``reduce`` combines the window's p99 across ranks (``max_over_ranks`` in a multi-rank run): a
    collective once per window, on every rank at the same step.
    """

    factor: float
    window: int
    patience: int
    reference_p99_s: float | None = None
    reduce: Callable[[float], float] = lambda v: v
    _times: list[float] = field(default_factory=list)
    _strikes: int = 0
    last_p99_s: float | None = None

    def __post_init__(self) -> None:
        if self.factor <= 1.0 or self.window < 1 or self.patience < 1:
            raise ValueError(
                f"circuit breaker factor={self.factor}, window={self.window}, patience={self.patience}: "
                "valid values are factor > 1, window >= 1, patience >= 1"
            )

    def observe(self, seconds: float) -> bool:
        """Feed one post-warm-up step time; True when the breaker trips (then it resets)."""
        self._times.append(seconds)
        if len(self._times) < self.window:
            return False
        p99 = self.reduce(percentile(self._times, 99))
        self._times.clear()
        self.last_p99_s = p99
        if self.reference_p99_s is None:
            self.reference_p99_s = p99
            return False
        self._strikes = self._strikes + 1 if p99 > self.factor * self.reference_p99_s else 0
        if self._strikes >= self.patience:
            self._strikes = 0
            return True
        return False

    def reset(self) -> None:
        """Forget the current window and strikes (after a fallback the new executor starts afresh)."""
        self._times.clear()
        self._strikes = 0


class StepAction(Enum):
    ok = "ok"
    skip = "skip"  # non-finite: the optimiser step was skipped (train_step already did)
    rollback = "rollback"  # max_bad_steps non-finite steps in a row


@dataclass
class BadStepTracker:
    """Counts consecutive non-finite steps; the ``max_bad_steps``-th in a row asks for a rollback."""

    max_bad_steps: int
    consecutive: int = 0
    total: int = 0

    def __post_init__(self) -> None:
        if self.max_bad_steps < 1:
            raise ValueError(f"verify.max_bad_steps={self.max_bad_steps}: valid values are >= 1")

    def observe(self, finite: bool) -> StepAction:
        if finite:
            self.consecutive = 0
            return StepAction.ok
        self.consecutive += 1
        self.total += 1
        if self.consecutive >= self.max_bad_steps:
            self.consecutive = 0
            return StepAction.rollback
        return StepAction.skip


def carry_state(
    src_model: nn.Module, src_opt: torch.optim.Optimizer, dst_model: nn.Module, dst_opt: torch.optim.Optimizer
) -> None:
    """Copy the trained weights and optimiser state into a model rebuilt for another executor.

    Through ``torch.distributed.checkpoint.state_dict``: names are the unwrapped FQNs (no DDP
    ``module.`` prefix, no compile wrapper), so the same code serves DDP, FSDP2 and TP layouts.
    The source optimiser's state must be read before the destination's is written (they share
    nothing, but both are live on the device for a moment).

    An optimiser that has not stepped (a fallback in the run's first step) has no state to carry,
    and must not be read through DCP: ``get_optimizer_state_dict`` allocates the missing moments with
    a zero-lr ``step()`` of its own, which leaves AdamW's step counter at 1 (the rebuilt rung's
    first update then used the second step's bias correction) and runs the optimiser's step hooks
    (the MoE routers' bias update, from a failed step's loads). Only the hyper-parameters are
    copied then (the learning rate the scheduler set).
    """
    set_model_state_dict(dst_model, get_model_state_dict(src_model))
    if not src_opt.state:
        for src, dst in zip(src_opt.param_groups, dst_opt.param_groups, strict=True):
            dst.update({k: v for k, v in src.items() if k != "params"})
        return
    osd = get_optimizer_state_dict(src_model, src_opt)
    set_optimizer_state_dict(dst_model, dst_opt, osd)
