"""``Verifier``: one run's verification state and the hooks the trainer calls, in run order.

  check_graph      after freeze, before parallelize (so before DDP's broadcast / FSDP's all-gather)
  judge_build      each rung the ladder builds, before step 1: the numerics check (verify=on)
  observe          every step read: bad-step policy, latency circuit breaker
  fallback         records a change of course (event row in metrics.jsonl, printed, in the report)
  finish           performance vs the baseline, optional baseline save, the report files

The verifier only judges: each hook returns a decision (a ``Verdict`` that asks for a lower rung, a
``StepAction``, a policy), and never builds a model. The trainer drives the ladder
(``fallback.Ladder``), which has the runner rebuild on the verdict's rung. The logic lives in the
sibling modules; this class keeps the state between the hooks (the bad-step tracker, the breaker)
and applies ``verify.policy``.

What runs when: the cheap hooks by default (``verify.graph``: the ranks' frozen graph
fingerprints and config hashes in one ``all_gather_object``; ``verify.ladder``: the executor rungs
on a compile error in the first step or a tripped breaker, and that breaker); the costly ones with
``verify.enabled`` (``verify=on``: the numerics check, a graph exported only to be fingerprinted,
the reference graph, the performance baseline and the report files). The bad-step tracking (with
the float8 rung) and ``fallback``'s recording always run: the trainer needs them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from framework.config.run_values import BatchShape
from framework.config.schema import ExecutorMode, Float8Recipe, ModelConfig, Policy, VerifyConfig
from framework.freeze import FrozenResult
from framework.planner.layout import Degrees
from framework.verify import baseline as baseline_mod
from framework.verify.consistency import check_ranks, check_reference, export_fingerprint, meta_example
from framework.verify.fallback import BadStepTracker, CircuitBreaker, StepAction, Verdict, max_over_ranks
from framework.verify.numerics import check_numerics, wants_reference
from framework.verify.policy import VerificationError, apply_policy
from framework.verify.report import CheckResult, FallbackEvent, VerificationReport, write_report

log = logging.getLogger("framework")
Emit = Callable[[dict[str, Any]], None]


class Built(Protocol):
    """A rung the runner built (``framework.train.runner.StepRunner``), as the verifier judges it."""

    model: nn.Module
    device: torch.device

    @property
    def mode(self) -> ExecutorMode: ...

    def reference(self) -> nn.Module:
        """The unsharded eager model with the run's initial weights, for the numerics check."""
        ...


class Verifier:
    def __init__(
        self,
        verify: VerifyConfig,
        model: ModelConfig,
        run_dir: Path,
        is_main: bool,
        emit: Emit | None = None,
        world_size: int = 1,
        device_name: str = "",
        *,
        layout: Degrees,
        batch: BatchShape,
        mesh_shape: Sequence[int],
    ) -> None:
        self.model_cfg = model  # its name keys the baseline; its size and float8 recipe the numerics
        self.mesh_shape = tuple(mesh_shape)  # the declared ``mesh.shape``, part of the baseline's key
        self.batch = batch  # the run's batch shape: the graph check exports the model at it
        self.layout = layout  # the plan's, part of the performance baseline's key (``verify.enabled``)
        self.world_size = world_size
        self.device_name = device_name  # with world_size, part of the performance baseline's key
        self.vcfg = verify
        self.enabled = verify.enabled
        self.run_dir = Path(run_dir)
        self.is_main = is_main
        self.emit = emit
        self.report = VerificationReport(verify.policy.value)
        self.bad_steps = BadStepTracker(verify.max_bad_steps)
        self.breaker: CircuitBreaker | None = None
        self.fingerprint: str | None = None
        self._pending_rows: list[dict[str, Any]] = []

    # -- reporting -----------------------------------------------------------------------------

    def attach(self, emit: Emit) -> None:
        """Send event rows to ``emit`` (``Metrics.log``) from now on, and those recorded before."""
        self.emit = emit
        for row in self._pending_rows:
            emit(row)
        self._pending_rows.clear()

    def _event(self, row: dict[str, Any]) -> None:
        if self.emit is None:
            self._pending_rows.append(row)
        else:
            self.emit(row)

    def write(self) -> None:
        if self.enabled and self.is_main:
            write_report(self.run_dir, self.report)

    def _decide(self, check: CheckResult, can_fall_back: bool) -> Policy | None:
        try:
            return apply_policy(check, self.vcfg.policy, can_fall_back)
        except VerificationError:
            self.write()
            raise

    def fallback(self, step: int, trigger: str, action: str, detail: str = "") -> FallbackEvent:
        event = FallbackEvent(step, trigger, action, detail)
        self.report.fallbacks.append(event)
        log.warning("fallback at step %d (%s): %s %s", step, trigger, action, detail)
        self._event(event.row())
        self.write()
        return event

    # -- hooks ---------------------------------------------------------------------------------

    def check_graph(
        self,
        meta_model: nn.Module,
        frozen: FrozenResult,
        config_hash: str,
        flat_config: dict[str, Any],
        can_fall_back: bool,
    ) -> Verdict | None:
        """Cross-rank graph + config check (fatal on mismatch), then the reference check (policy).

        Collective. Returns a verdict when the reference check asks to fall back (run eager).
        Cheap, on by default (``verify.graph``): it compares the fingerprints ``freeze`` made. With
        ``freeze=none`` there is none; ``verify=on`` then exports the meta model to get one (about
        1.5 s for the tiny recipe), the default skips the check.
        """
        if not self.vcfg.graph:
            return None
        fp, summary = frozen.fingerprint, frozen.summary
        if fp is None:
            if not self.enabled:
                return None
            fp, summary = export_fingerprint(
                meta_model, meta_example(self.batch.micro_batch_size, self.batch.seq_len)
            )
        self.fingerprint = fp
        try:
            self.report.add(check_ranks(fp, summary, config_hash, flat_config))
        except VerificationError as e:
            self.report.add(CheckResult("graph (cross-rank)", False, str(e), action="fail"))
            self.write()
            raise
        if not self.enabled or self.vcfg.reference is None:
            return None
        check = self.report.add(check_reference(fp, summary, self.vcfg.reference))
        if self._decide(check, can_fall_back) is Policy.fallback:
            return Verdict("graph", "reference graph differs")
        return None

    def check_numerics(
        self,
        model: nn.Module,
        batch: tuple[torch.Tensor, torch.Tensor],
        device: torch.device,
        compiled: bool,
        can_fall_back: bool,
        make_reference: Callable[[], nn.Module] | None = None,
    ) -> Policy | None:
        """Executed vs eager (and vs ``make_reference()``, the unsharded eager model, when the model
        is small: ``verify.reference_model_max_params``). Collective."""
        if not (self.enabled and self.vcfg.numerics):
            return None
        if not wants_reference(self.model_cfg, self.vcfg.reference_model_max_params):
            make_reference = None
        # The loop runs bf16 autocast on CUDA (framework.train.loop.autocast): rounding differs more;
        # float8 GEMMs (model.float8, in the reference model too) more still.
        logits_rtol = self.vcfg.logits_rtol_bf16 if device.type == "cuda" else self.vcfg.logits_rtol
        if self.model_cfg.float8 is not Float8Recipe.none:
            logits_rtol = max(logits_rtol, self.vcfg.logits_rtol_float8)
        rtol = self.vcfg.loss_rtol
        check = check_numerics(model, batch, device, rtol, compiled, make_reference, logits_rtol)
        # Replace an earlier attempt's result (after a fallback the check runs again).
        self.report.checks = [c for c in self.report.checks if c.name != check.name]
        self.report.add(check)
        return self._decide(check, can_fall_back)

    def judge_build(
        self,
        built: Built,
        first_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
        can_fall_back: bool,
    ) -> Verdict | None:
        """Judge a rung the ladder just built, before step 1: a verdict when it must step down.

        With ``verify=on`` this is the numerics check, whose first forward is where torch.compile
        compiles (a compile error is raised from here; the ladder catches it). By default nothing
        runs here: a forward of its own would compile a second, gradient-free graph (measured in
        benchmarks/PERF.md), so the ladder catches a compile error in the first step instead
        (``Ladder.guard``)."""
        if not (self.enabled and self.vcfg.numerics):
            return None
        compiled = built.mode is not ExecutorMode.eager
        x, y = first_batch()
        policy = self.check_numerics(
            built.model, (x, y), built.device, compiled, can_fall_back, built.reference
        )
        return Verdict("numerics", "executed != eager") if policy is Policy.fallback else None

    def observe(
        self, finite: bool, seconds: float | None, mode: ExecutorMode, can_fall_back: bool
    ) -> tuple[StepAction, Verdict | None]:
        """Judge one step read; ``seconds`` is its time, None during warm-up or when non-finite.

        Bad steps: the ``max_bad_steps``-th non-finite step in a row asks the caller for a rollback,
        with a ``bad_steps`` verdict (a float8 run first steps down to bf16: float8's 3 mantissa
        bits and per-tensor scales are the likeliest cause of a run that goes non-finite and stays
        so). The breaker, armed at the first timed step (by default only where ``can_fall_back``;
        with ``verify=on`` always, to report), trips on slow windows: a ``circuit_breaker``
        verdict, and the breaker starts afresh.
        """
        if seconds is not None and self.breaker is None and self._breaker_wanted(can_fall_back):
            self.start_timing(self.baseline_p99(self.world_size, self.device_name, mode))
        action, tripped = self.after_step(finite, seconds)
        if action is StepAction.rollback:
            return action, Verdict("bad_steps", f"{self.vcfg.max_bad_steps} non-finite steps in a row")
        if tripped:
            assert self.breaker is not None
            self.breaker.reset()
            return action, Verdict("circuit_breaker", f"window p99 {self.breaker.last_p99_s}")
        return action, None

    def _breaker_wanted(self, can_fall_back: bool) -> bool:
        return self.enabled or (self.vcfg.ladder and can_fall_back)

    def start_timing(self, baseline_p99_s: float | None) -> None:
        """Arm the circuit breaker (after warm-up): reference p99 from the baseline, else the first window."""
        self.breaker = CircuitBreaker(
            self.vcfg.breaker_factor,
            self.vcfg.breaker_window,
            self.vcfg.breaker_patience,
            baseline_p99_s,
            max_over_ranks,
        )

    def after_step(self, finite: bool, seconds: float | None) -> tuple[StepAction, bool]:
        """(bad-step action, circuit breaker tripped). ``seconds`` is None during warm-up."""
        action = self.bad_steps.observe(finite)
        tripped = False
        if self.breaker is not None and seconds is not None:
            tripped = self.breaker.observe(seconds)
        return action, tripped

    def _key(self, world_size: int, device_name: str, executor: ExecutorMode) -> str:
        name, shape = self.model_cfg.name, self.mesh_shape
        return baseline_mod.baseline_key(name, shape, self.layout, world_size, device_name, executor)

    def baseline_p99(self, world_size: int, device_name: str, executor: ExecutorMode) -> float | None:
        if not self.enabled:
            return None
        key = self._key(world_size, device_name, executor)
        figures = baseline_mod.load_baseline(baseline_mod.store_path(self.vcfg), key)
        return None if figures is None else figures.step_p99_s

    def finish(
        self,
        figures: baseline_mod.PerfFigures | None,
        world_size: int,
        device_name: str,
        meta: dict[str, Any],
        executor: ExecutorMode,
        can_fall_back: bool,
    ) -> Policy | None:
        """Compare with the baseline (policy), save one if asked (rank 0), write the report."""
        if not self.enabled:
            return None
        if figures is None:
            self.report.add(CheckResult("performance", None, "no post-warm-up steps to measure"))
            self.write()
            return None
        key = self._key(world_size, device_name, executor)
        path = baseline_mod.store_path(self.vcfg)
        check = baseline_mod.compare_perf(figures, baseline_mod.load_baseline(path, key), self.vcfg)
        check.figures["key"] = key
        self.report.add(check)
        action = self._decide(check, can_fall_back)
        if self.vcfg.save_baseline and self.is_main:
            baseline_mod.save_baseline(path, key, figures, meta)
            log.info("saved the performance baseline %s in %s", key, path)
        self.write()
        return action
