"""``Verifier``: one run's verification state and the hooks the trainer calls, in run order.

  check_graph      after freeze, before parallelize (so before DDP's broadcast / FSDP's all-gather)
  start            the start of the ladder: build each rung until one compiles (and passes numerics)
    check_numerics   after parallelize, before step 1 (its first forward is where compilation happens)
  observe          every step read: bad-step policy (and the float8 rung), latency circuit breaker
                   (and the executor rungs)
  fallback         records a change of course (event row in metrics.jsonl, printed, in the report)
  finish           performance vs the baseline, optional baseline save, the report files

The logic lives in the sibling modules; this class keeps the state between the hooks (the bad-step
tracker, the breaker), applies ``verify.policy`` and decides the ladder's rungs; the runner
(``fallback.Rungs``) builds them. With ``verify.enabled=false`` every hook is a cheap no-op except
the bad-step tracking (with the float8 rung) and ``fallback``'s recording, which the trainer always
needs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from framework.config.schema import Config, ExecutorMode, Float8Recipe, Policy
from framework.freeze import FrozenResult
from framework.models import Decoder
from framework.planner.layout import Degrees
from framework.verify import baseline as baseline_mod
from framework.verify.consistency import check_ranks, check_reference, export_fingerprint, meta_example
from framework.verify.fallback import (
    BadStepTracker,
    CircuitBreaker,
    Rungs,
    StepAction,
    max_over_ranks,
    next_float8,
    next_mode,
)
from framework.verify.numerics import batch_logits, check_numerics, reference_model, wants_reference
from framework.verify.policy import VerificationError, apply_policy
from framework.verify.report import CheckResult, FallbackEvent, VerificationReport, write_report

log = logging.getLogger("framework")
Emit = Callable[[dict[str, Any]], None]


class Verifier:
    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        is_main: bool,
        emit: Emit | None = None,
        world_size: int = 1,
        device_name: str = "",
        *,
        layout: Degrees,
    ) -> None:
        self.cfg = cfg
        self.layout = layout  # the plan's, part of the performance baseline's key (``verify.enabled``)
        self.world_size = world_size
        self.device_name = device_name  # with world_size, part of the performance baseline's key
        self.vcfg = cfg.verify
        self.enabled = cfg.verify.enabled
        self.run_dir = Path(run_dir)
        self.is_main = is_main
        self.emit = emit
        self.report = VerificationReport(cfg.verify.policy.value)
        self.bad_steps = BadStepTracker(cfg.verify.max_bad_steps)
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
        meta_model: Decoder,
        frozen: FrozenResult,
        config_hash: str,
        flat_config: dict[str, Any],
        can_fall_back: bool,
    ) -> Policy | None:
        """Cross-rank graph + config check (fatal on mismatch), then the reference check (policy).

        Collective. Returns the policy action of the reference check (``Policy.fallback``: run eager).
        With ``freeze=none`` the meta model is exported here to get a fingerprint.
        """
        if not (self.enabled and self.vcfg.graph):
            return None
        fp, summary = frozen.fingerprint, frozen.summary
        if fp is None:
            fp, summary = export_fingerprint(
                meta_model, meta_example(self.cfg.train.micro_batch_size, self.cfg.train.seq_len)
            )
        self.fingerprint = fp
        try:
            self.report.add(check_ranks(fp, summary, config_hash, flat_config))
        except VerificationError as e:
            self.report.add(CheckResult("graph (cross-rank)", False, str(e), action="fail"))
            self.write()
            raise
        if self.vcfg.reference is None:
            return None
        check = self.report.add(check_reference(fp, summary, self.vcfg.reference))
        return self._decide(check, can_fall_back)

    def check_numerics(
        self,
        model: nn.Module,
        batch: tuple[torch.Tensor, torch.Tensor],
        device: torch.device,
        compiled: bool,
        can_fall_back: bool,
    ) -> Policy | None:
        """Executed vs eager (and vs an unsharded eager model when small). Collective."""
        if not (self.enabled and self.vcfg.numerics):
            return None
        make_ref = None
        if wants_reference(self.cfg.model, self.vcfg.reference_model_max_params):
            from framework.parallel.data_parallel import TORCH_DTYPES

            dtype = TORCH_DTYPES[self.cfg.sharding.param_dtype]

            def make_ref() -> nn.Module:
                ref = reference_model(
                    self.cfg.model, self.cfg.train.seq_len, self.cfg.train.seed, device, dtype
                )
                from framework.data import document_eos

                ref.document_eos = document_eos(self.cfg)  # the same attention mask as the run's model
                return ref

        # The loop runs bf16 autocast on CUDA (framework.train.loop.autocast): rounding differs more;
        # float8 GEMMs (model.float8, in the reference model too) more still.
        logits_rtol = self.vcfg.logits_rtol_bf16 if device.type == "cuda" else self.vcfg.logits_rtol
        if self.cfg.model.float8 is not Float8Recipe.none:
            logits_rtol = max(logits_rtol, self.vcfg.logits_rtol_float8)
        check = check_numerics(model, batch, device, self.vcfg.loss_rtol, compiled, make_ref, logits_rtol)
        # Replace an earlier attempt's result (after a fallback the check runs again).
        self.report.checks = [c for c in self.report.checks if c.name != check.name]
        self.report.add(check)
        return self._decide(check, can_fall_back)

    def start(self, rungs: Rungs, first_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Build the configured rung; with verify on, the start of the fallback ladder.

        The first forward (where torch.compile compiles) and the numerics check run before step 1. A
        compile/capture error, or a numerics failure under ``policy=fallback``, rebuilds from a fresh
        meta model with the next rung (cudagraphs -> compile -> eager); nothing has trained yet, so
        the run restarts cleanly at step 0. The ranks agree on the outcome (one all_gather_object); a
        compile error that hits only some ranks inside a collective is not covered (it would hang).
        """
        mode = rungs.mode
        while True:
            lower = next_mode(mode)
            error, action = None, None
            try:
                rungs.build(mode)
                if not self.enabled:
                    return
                x, y = first_batch()
                if self.vcfg.numerics:
                    compiled = mode is not ExecutorMode.eager
                    action = self.check_numerics(
                        rungs.model, (x, y), rungs.device, compiled, lower is not None
                    )
                else:
                    batch_logits(rungs.model, x, rungs.device, y)
            except Exception as e:  # noqa: BLE001 - any compile/capture error moves down the ladder
                if lower is None or not self.enabled:
                    raise
                error = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            errors: list[str | None] = [error]
            if dist.is_initialized() and dist.get_world_size() > 1:
                errors = [None] * dist.get_world_size()
                dist.all_gather_object(errors, error)
            failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
            if not failed and action is not Policy.fallback:
                return
            assert lower is not None
            trigger, detail = ("compile_error", failed[0]) if failed else ("numerics", "executed != eager")
            self.fallback(0, trigger, f"executor {mode.value} -> {lower.value}", detail)
            mode = lower

    def observe(self, step: int, finite: bool, seconds: float | None, rungs: Rungs) -> StepAction:
        """Judge one step read; ``seconds`` is its time, None during warm-up or when non-finite.

        Bad steps: the ``max_bad_steps``-th non-finite step in a row asks the caller for a rollback;
        a float8 run first steps down to bf16 (float8's 3 mantissa bits and per-tensor scales are
        the likeliest cause of a run that goes non-finite and stays so). The breaker, armed at the
        first timed step, trips on slow windows: the run steps down the executor ladder, keeping its
        trained state, and the breaker starts afresh.
        """
        if seconds is not None and self.enabled and self.breaker is None:
            self.start_timing(self.baseline_p99(self.world_size, self.device_name, rungs.mode))
        action, tripped = self.after_step(finite, seconds)
        if action is StepAction.rollback and next_float8(rungs.float8) is not None:
            left = rungs.float8
            rungs.build(float8=next_float8(left), carry=True)
            self.fallback(
                step,
                "bad_steps",
                f"model.float8 {left.value} -> none (bf16)",
                f"{self.vcfg.max_bad_steps} non-finite steps in a row under float8 {left.value}",
            )
        if tripped:
            assert self.breaker is not None
            lower = next_mode(rungs.mode)
            if lower is not None:
                rungs.build(lower, carry=True)
            what = f"executor {lower.value}" if lower else "none (already eager)"
            self.fallback(
                step, "circuit_breaker", f"fallback: {what}", f"window p99 {self.breaker.last_p99_s}"
            )
            self.breaker.reset()
        return action

    def start_timing(self, baseline_p99_s: float | None) -> None:
        """Arm the circuit breaker (after warm-up): reference p99 from the baseline, else the first window."""
        if not self.enabled:
            return
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

    def baseline_p99(self, world_size: int, device_name: str, executor: ExecutorMode) -> float | None:
        if not self.enabled:
            return None
        key = baseline_mod.baseline_key(self.cfg, self.layout, world_size, device_name, executor)
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
        key = baseline_mod.baseline_key(self.cfg, self.layout, world_size, device_name, executor)
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
