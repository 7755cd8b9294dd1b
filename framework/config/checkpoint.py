"""The ``checkpoint`` and ``verify`` groups' schemas: what a run saves and how it is checked."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from framework.config.options import only_with


class AsyncMode(Enum):
    none = "none"
    thread = "thread"
    process = "process"


class Integrity(Enum):
    """How a checkpoint's manifest is checked before it is trusted (framework.checkpoint)."""

    sha256 = "sha256"
    size = "size"


class Policy(Enum):
    warn = "warn"
    fail = "fail"
    fallback = "fallback"


def _saving(default: Any) -> Any:
    """A checkpoint field: it means something with checkpoint.enabled=true (checkpoint=sync|async|large)."""
    return only_with("checkpoint.enabled", True, default=default)


@dataclass
class CheckpointConfig:
    """Fault-tolerant DCP checkpoints (framework.checkpoint): atomic commit, manifest, retention."""

    # python train.py composes checkpoint=final (enabled, one save at the end); a Config() built in
    # code saves only when asked. checkpoint=none turns it off.
    enabled: bool = False
    dir: Optional[str] = _saving(None)  # default: <run dir>/checkpoints
    every_steps: int = _saving(0)  # 0 = off
    every_minutes: float = _saving(0.0)  # 0 = off; rank 0's clock decides, all ranks follow
    at_end: bool = _saving(True)
    async_mode: AsyncMode = _saving(AsyncMode.none)
    keep_last: int = _saving(2)  # 0 = keep all; the newest complete checkpoint is never deleted
    keep_every: int = _saving(0)  # also keep steps that are multiples of this forever (0 = none)
    resume: str = "auto"  # auto | none | <path>
    # sha256: hash every file at commit and verify before resume; size: sizes only (huge checkpoints).
    integrity: Integrity = _saving(Integrity.sha256)
    # Write the final model (or the preempted one) as a Hugging Face folder into <run dir>/hf: safetensors,
    # config.json, generation_config.json, tokenizer files. Any checkpoint later: python -m
    # framework.checkpoint export-hf CHECKPOINT OUT.
    export_hf: bool = False


def _verifying(default: Any) -> Any:
    """A verification field: it means something with verify.enabled=true (verify=on)."""
    return only_with("verify.enabled", True, default=default)


@dataclass
class VerifyConfig:
    """Verification hooks of the migration checklist (framework.verify).

    The cheap hooks run by default: ``graph`` and ``ladder`` (benchmarks/PERF.md measures them).
    ``enabled`` (``verify=on``) adds the costly ones: the numerics check, the reference graph, the
    performance baseline and the report files. ``policy`` says what a failed check of those does:
    ``warn`` reports it and trains on, ``fail`` stops the run, ``fallback`` steps down the executor
    ladder (cudagraphs -> compile -> eager). A cross-rank mismatch always stops the job (ranks that
    disagree would hang in their first collective).
    """

    enabled: bool = False
    policy: Policy = _verifying(Policy.warn)
    # Cross-rank graph fingerprint + config hash before the first training collective (the
    # fingerprints freeze made: one all_gather_object of two short strings; with freeze=none only
    # under verify=on, which exports the model to get one).
    graph: bool = True
    # The fallback ladder: a compile error at the first forward (run before step 1 where a lower
    # rung exists) or a tripped latency circuit breaker steps down cudagraphs -> compile -> eager.
    ladder: bool = True
    # A fingerprint.json file or an earlier run dir (its frozen/fingerprint.json) to compare the graph with.
    reference: Optional[str] = _verifying(None)
    # Executed (compiled / parallelized) model vs eager on the first batch: relative loss difference.
    numerics: bool = _verifying(True)
    loss_rtol: float = _verifying(1e-4)
    # ... and the logits: max |difference| / max |logit| (0 = off). fp32 agrees to ~1e-6; under bf16
    # autocast (CUDA) compiled vs eager differ by rounding alone: 2.4e-2 measured for llama1b on an
    # H200, so the bf16 bound is looser. A miscompile shows up far above either.
    logits_rtol: float = _verifying(1e-2)
    logits_rtol_bf16: float = _verifying(6e-2)
    # ... and under model.float8 (the reference model is float8 too; compiled and eager casts can
    # round an element to neighbouring float8 values, 3 mantissa bits, so the bound is looser still).
    logits_rtol_float8: float = _verifying(0.15)
    # Also compare with an unsharded eager model built from the same config and seed, up to this size.
    reference_model_max_params: int = _verifying(50_000_000)
    # Baseline store (JSON); default outputs/baselines.json. ``save_baseline`` records this run in it.
    baseline: Optional[str] = _verifying(None)
    save_baseline: bool = _verifying(False)
    # Regression thresholds against the baseline (fractions): tokens/s drop, p99 step time, peak memory.
    max_tokens_per_s_drop: float = _verifying(0.10)
    max_p99_increase: float = _verifying(0.20)
    max_memory_increase: float = _verifying(0.10)
    # Latency circuit breaker: p99 of each window of ``breaker_window`` steps above ``breaker_factor`` x
    # the baseline p99 (or this run's first window) for ``breaker_patience`` windows in a row.
    breaker_factor: float = _verifying(3.0)
    breaker_window: int = _verifying(10)
    breaker_patience: int = _verifying(2)
    # Non-finite steps are skipped; this many in a row roll back to the last checkpoint.
    max_bad_steps: int = 3
    # Debugging knob: make the forward output NaN at these (0-based) steps, to test the bad-step policy.
    inject_nan_steps: list[int] = field(default_factory=list)
