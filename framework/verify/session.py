"""``Verifier``: one run's verification state and the hooks the trainer calls, in run order.

  check_graph      after freeze, before parallelize (so before DDP's broadcast / FSDP's all-gather)
  check_numerics   after parallelize, before step 1 (its first forward is where compilation happens)
  after_step       every step: bad-step policy, latency circuit breaker
  fallback         records a change of course (event row in metrics.jsonl, printed, in the report)
  finish           performance vs the baseline, optional baseline save, the report files

The logic lives in the sibling modules; this class only keeps the state between the hooks and
applies ``verify.policy``. With ``verify.enabled=false`` every hook is a cheap no-op except
``after_step``'s bad-step tracking and ``fallback``'s recording, which the trainer always needs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from framework.config import Config, ExecutorMode, Float8Recipe, Policy
from framework.freeze import FrozenResult
from framework.model import Llama
from framework.verify import baseline as baseline_mod
from framework.verify.consistency import check_ranks, check_reference, export_fingerprint, meta_example
from framework.verify.fallback import BadStepTracker, CircuitBreaker, StepAction, max_over_ranks
from framework.verify.numerics import check_numerics, reference_model, wants_reference
from framework.verify.policy import VerificationError, apply_policy
from framework.verify.report import CheckResult, FallbackEvent, VerificationReport, write_report

log = logging.getLogger("framework")
Emit = Callable[[dict[str, Any]], None]


class Verifier:
    def __init__(self, cfg: Config, run_dir: Path, is_main: bool, emit: Emit | None = None) -> None:
        self.cfg = cfg
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
        meta_model: Llama,
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

        # The loop runs bf16 autocast on CUDA (framework.loop.autocast): rounding differs more;
        # float8 GEMMs (model.float8, in the reference model too) more still.
        logits_rtol = self.vcfg.logits_rtol_bf16 if device.type == "cuda" else self.vcfg.logits_rtol
        if self.cfg.model.float8 is not Float8Recipe.none:
            logits_rtol = max(logits_rtol, self.vcfg.logits_rtol_float8)
        check = check_numerics(model, batch, device, self.vcfg.loss_rtol, compiled, make_ref, logits_rtol)
        # Replace an earlier attempt's result (after a fallback the check runs again).
        self.report.checks = [c for c in self.report.checks if c.name != check.name]
        self.report.add(check)
        return self._decide(check, can_fall_back)

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
        key = baseline_mod.baseline_key(self.cfg, world_size, device_name, executor)
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
        key = baseline_mod.baseline_key(self.cfg, world_size, device_name, executor)
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
