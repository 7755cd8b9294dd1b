"""The callback seam: code that runs at the loop's own moments, chosen in the ``callbacks`` config group.

A callback is one class with any of the hooks of :class:`Callback` and one YAML file,
``conf/callbacks/NAME.yaml`` (``NAME: {_target_: module.Class, its own values}``), in the
lightning-hydra-template layout. ``callbacks=[default,NAME]`` adds it to the shipped ones (the profiler,
wandb, fault injection, the compile cache; ``callbacks.NAME=null`` switches one off); a YAML outside
conf/ comes in with ``--config-dir DIR`` or ``hydra.searchpath=[file://DIR]``. Each is built through
the ``_target_`` allowlist (``run.instantiate_allow``, framework.config.instantiate), once before launch
to check it (an unknown name, a target off the allowlist, a value the class does not take: one line,
exit 2) and again on every rank. So construction must be cheap and touch nothing: the work starts in
``setup`` or ``on_resume``.

The hooks, in the order a run calls them (every rank calls every hook; ``run.is_main`` is rank 0).
What each sees of the learning rate: the scheduler moves inside the optimizer step, right after the
update, so from the end of step ``k`` on ``run.runner.scheduler.get_last_lr()`` (and the param
groups' ``"lr"``) are the rates of step ``k + 1``. Step ``k``'s own rates are the scheduler's in
``before_step(run, k)`` and ``run.last.result.lrs`` (one per param group) in ``on_step_read``:

- ``setup(run)``: before the model is built (``run.runner`` and ``run.metrics`` are still None);
- ``on_resume(run, step, extra)``: once, before the first step, after the checkpoint (if any) was
  loaded: ``step`` is where training continues (0: a fresh start), ``extra`` the checkpoint's extra
  state ({} when none);
- ``before_step(run, step)``: optimizer step ``step`` is about to be queued: ``run.state.step`` is
  ``step - 1``, the scheduler and the optimizer's param groups hold the rates step ``step`` will run
  with (a rate set here in ``param_groups[i]["lr"]`` is the one it runs with; the scheduler sets
  the next step's over it); the previous step's figures may not be read yet (the lag);
- ``after_step(run, step)``: optimizer step ``step`` was queued (its figures may not be read yet;
  the scheduler already holds step ``step + 1``'s rates);
- ``on_step_read(run, step)``: its figures were read, judged and logged (under the lag one step
  later, after step ``step + 1`` was queued); the runner's ``Step`` is ``run.last``:
  ``run.last.result.lrs`` are the rates it ran with, ``run.last.result.loss`` is an all-reduce (read
  it on every rank or on none);
- ``on_rebuild(run, step)``: judging step ``step`` made the fallback ladder replace the executed
  model (``run.runner.mode`` and ``run.runner.model`` are the new ones; hooks on the old model are
  gone; the new scheduler carries the old one's position); it comes just before that step's
  ``on_step_read``;
- ``on_save(run, step)``: a checkpoint of ``step`` was written (or handed to the async writer), after
  that step's ``on_step_read``;
- ``on_finish(run, summary)``: after the final evaluation, before summary.json is written (a
  callback may fill its field of the ``framework.train.summary.Summary``);
- ``close()``: always, also after an exception (the ``with`` block of the run).

A rollback (a bad step, ``verify.max_bad_steps``) loads an earlier checkpoint: the step numbers that
follow it are heard again, from ``before_step`` on, with the rates of the restored schedule.

Why these: they are the moments the loop already has (framework.train.trainer), so a callback
changes nothing of a run that does not ask for it, and the loop calls one verb per moment.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from framework.config.instantiate import TARGET_KEY, check_target, find_targets
from framework.config.schema import SHIPPED_CALLBACKS, Config, LoggerKind
from framework.record.metrics import Metrics
from framework.record.train_state import TrainState

if TYPE_CHECKING:
    from framework.train.runner import Step, StepRunner


@dataclass
class RunContext:
    """What a hook may read: the run's typed config, where it writes, this rank, the shared counters,
    the metrics (``log`` a row, rank 0 writes it) and the runner (model, optimizer, scheduler: read
    them here each time, a rebuild replaces them)."""

    cfg: Config
    run_dir: Path
    rank: int
    is_main: bool
    state: TrainState
    metrics: Metrics | None = None  # set once built, before on_resume
    runner: StepRunner | None = None
    last: Step | None = None  # the step whose figures were read last (on_step_read)


@runtime_checkable
class Callback(Protocol):
    """The hooks (see the module docstring for when each runs). Subclass it and override the ones you
    need: the others do nothing."""

    def setup(self, run: RunContext) -> None:
        return None

    def on_resume(self, run: RunContext, step: int, extra: dict[str, Any]) -> None:
        return None

    def before_step(self, run: RunContext, step: int) -> None:
        return None

    def after_step(self, run: RunContext, step: int) -> None:
        return None

    def on_step_read(self, run: RunContext, step: int) -> None:
        return None

    def on_rebuild(self, run: RunContext, step: int) -> None:
        return None

    def on_save(self, run: RunContext, step: int) -> None:
        return None

    def on_finish(self, run: RunContext, summary: Any) -> None:
        return None

    def close(self) -> None:
        return None


class Callbacks:
    """The run's callbacks in config order, each hook called on each; ``with`` closes every one (in
    reverse order, each even when another's close raised)."""

    def __init__(self, named: list[tuple[str, Callback]]) -> None:
        self.named = named
        self.run: RunContext | None = None
        self._model: object = None  # the executed model the hooks last saw (rebuild detection)

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.named]

    def _each(self) -> list[Callback]:
        return [cb for _, cb in self.named]

    def _ctx(self) -> RunContext:
        assert self.run is not None, "setup(run) first"
        return self.run

    def setup(self, run: RunContext) -> None:
        self.run = run
        for cb in self._each():
            cb.setup(run)

    def on_resume(self, step: int, extra: dict[str, Any]) -> None:
        run = self._ctx()
        self._model = run.runner.model if run.runner is not None else None
        for cb in self._each():
            cb.on_resume(run, step, extra)

    def before_step(self, step: int) -> None:
        for cb in self._each():
            cb.before_step(self._ctx(), step)

    def after_step(self, step: int) -> None:
        for cb in self._each():
            cb.after_step(self._ctx(), step)

    def on_step_read(self, s: Step) -> None:
        """Step ``s`` was read; a rebuild the verifier made while judging it comes first."""
        run = self._ctx()
        run.last = s
        model = run.runner.model if run.runner is not None else None
        if model is not self._model:
            self._model = model
            for cb in self._each():
                cb.on_rebuild(run, s.step)
        for cb in self._each():
            cb.on_step_read(run, s.step)

    def on_save(self, step: int) -> None:
        for cb in self._each():
            cb.on_save(self._ctx(), step)

    def on_finish(self, summary: Any) -> None:
        for cb in self._each():
            cb.on_finish(self._ctx(), summary)

    def __enter__(self) -> Callbacks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        error: BaseException | None = None
        for cb in reversed(self._each()):
            try:
                cb.close()
            except Exception as e:  # noqa: BLE001 - every callback is closed; the first error is raised
                error = error or e
        self.named = []
        if error is not None:
            raise error


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _plain_values(where: str, node: Mapping[str, Any]) -> dict[str, Any]:
    """A callback's values, which are data: no Hydra instantiation key (``_args_``, ``_partial_``,
    ``_recursive_``...) and no ``_target_`` at any depth (Hydra would build it and pass it in)."""
    reserved = [k for k in node if str(k).startswith("_") and k != TARGET_KEY]
    if reserved:
        raise ValueError(
            f"{where}.{reserved[0]} is refused: a callback takes keyword values only, and keys that "
            "start with `_` are Hydra's instructions (positional arguments, partial calls, recursion)"
        )
    values = {k: v for k, v in node.items() if k != TARGET_KEY}
    nested = find_targets(values, where)
    if nested:
        raise ValueError(
            f"{nested[0][0]}={nested[0][1]!r} is refused: a callback's values are plain data, never "
            "another object to build"
        )
    return values


def build_one(name: str, node: Any, allow: list[str]) -> Callback:
    """The callback ``callbacks.NAME`` describes, through the allowlist; ValueError (one line) when
    it names no class, one off the allowlist, a class that is not a callback, a value the class does
    not take, or anything but plain values. The class is called directly with those values (not
    through Hydra), so nothing else in the node is ever built or called."""
    where = f"callbacks.{name}"
    if not isinstance(node, Mapping) or TARGET_KEY not in node:
        raise ValueError(
            f"{where}={node!r} is not a callback (no {TARGET_KEY}); a callback is conf/callbacks/NAME.yaml "
            f"holding NAME: {{{TARGET_KEY}: module.Class, ...}}, added with callbacks=[default,NAME]; "
            f"callbacks.{name}=null switches a shipped one off"
        )
    values = _plain_values(where, node)
    cls = check_target(node[TARGET_KEY], allow, where=f"{where}.{TARGET_KEY}")
    if not (isinstance(cls, type) and issubclass(cls, Callback)):
        raise ValueError(
            f"{where}.{TARGET_KEY}={node[TARGET_KEY]!r} is not a callback class: it needs the hooks of "
            "framework.train.callbacks.Callback (subclass it)"
        )
    try:
        inspect.signature(cls).bind(**values)
    except TypeError as e:
        takes = ", ".join(p for p in inspect.signature(cls).parameters if p not in ("self", "args", "kwargs"))
        raise ValueError(
            f"{where}: {_one_line(e)}; {node[TARGET_KEY]} takes: {takes or 'no values'}"
        ) from None
    try:
        return cls(**values)
    except Exception as e:  # noqa: BLE001 - the class refused its values: one line, before launch
        raise ValueError(f"{where}: {node[TARGET_KEY]} refused its values: {_one_line(e)}") from None


def build_callbacks(nodes: Mapping[str, Any], allow: list[str]) -> Callbacks:
    """Every ``callbacks`` entry, in config order (a ``null`` entry is switched off)."""
    return Callbacks(
        [(str(n), build_one(str(n), node, allow)) for n, node in nodes.items() if node is not None]
    )


# The keys that ask for a shipped callback: set while that callback is switched off, they would do nothing.
ASKED_BY: dict[str, tuple[str, Callable[[Config], bool]]] = {
    "profiler": ("run.profile=true", lambda c: c.run.profile),
    "wandb": ("logger=wandb", lambda c: c.logger.kind is LoggerKind.wandb),
    "fault_injection": (
        "run.fault_kill_at_step / run.fault_raise_at_step / verify.inject_nan_steps",
        lambda c: c.run.fault_kill_at_step >= 0 or c.run.fault_raise_at_step >= 0 or bool(c.verify.inject_nan_steps),
    ),
    "compile_cache": ("executor.cache_dir", lambda c: c.executor.cache_dir is not None),
}


def check_callbacks(cfg: Config) -> None:
    """Before launch: build each callback once (and drop it), so a bad one is one line, exit 2; and
    refuse a key that asks for a shipped callback that is switched off."""
    build_callbacks(cfg.callbacks, cfg.run.instantiate_allow).named.clear()
    targets = {node.get(TARGET_KEY) for node in cfg.callbacks.values() if isinstance(node, Mapping)}
    for name, (keys, asks) in ASKED_BY.items():
        if asks(cfg) and SHIPPED_CALLBACKS[name] not in targets:
            raise ValueError(
                f"{keys} is set, but the {name} callback that acts on it is switched off "
                f"(callbacks.{name}=null or a callbacks list without it); keep callbacks=default in the list"
            )
