"""The ``checkpoint`` and ``verify`` groups' rules."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from framework.config.rules.rule import MAX_STEPS, TYPED, Rule, integer, is_int, number, optional_path
from framework.config.schema import Config


def _resume_ok(v: Any, c: Config) -> bool:
    if v in ("auto", "none"):
        return True
    return isinstance(v, str) and v.strip() != "" and c.checkpoint.enabled and Path(v).is_dir()


def _resume_valid(c: Config) -> str:
    if not c.checkpoint.enabled and c.checkpoint.resume not in ("auto", "none"):
        return (
            "'auto', 'none' or a checkpoint directory; resuming from a path needs checkpointing on "
            "(checkpoint=sync or checkpoint.enabled=true), otherwise the path is ignored"
        )
    return "'auto', 'none' or an existing checkpoint directory (a step_N folder holding manifest.json)"


def _nan_steps_ok(v: Any, c: Config) -> bool:
    return all(is_int(s) and 0 <= s < c.train.steps for s in v)


CHECKPOINT_RULES: dict[str, Rule] = {
    # checkpoint
    "checkpoint.enabled": TYPED,
    "checkpoint.dir": Rule(
        "a directory that can be created",
        checked_by="framework.launch.prelaunch.check_checkpoint_dir",
        bad=("pyproject.toml/ck",),
        context=(("checkpoint.enabled", True),),
    ),  # fmt: skip
    "checkpoint.every_steps": integer(0, MAX_STEPS, what="0 = off"),
    "checkpoint.every_minutes": number(0, 10**6, what="0 = off"),
    "checkpoint.at_end": TYPED,
    "checkpoint.async_mode": TYPED,
    "checkpoint.keep_last": integer(0, 10**6, what="0 = keep all"),
    "checkpoint.keep_every": integer(0, MAX_STEPS, what="0 = none"),
    "checkpoint.resume": Rule(
        _resume_valid, _resume_ok, ("", "/nonexistent/step_5"), context=(("checkpoint.enabled", True),)
    ),
    "checkpoint.integrity": TYPED,
    "checkpoint.export_hf": TYPED,
    # verify
    "verify.enabled": TYPED,
    "verify.policy": TYPED,
    "verify.graph": TYPED,
    "verify.ladder": TYPED,
    "verify.reference": optional_path("a fingerprint.json or an earlier run dir"),
    "verify.numerics": TYPED,
    # Relative differences: 1 is already a difference as large as the value.
    "verify.loss_rtol": number(0, 1, lo_open=True),
    "verify.logits_rtol": number(0, 1, what="0 = off"),
    "verify.logits_rtol_bf16": number(0, 1, what="0 = off"),
    "verify.logits_rtol_float8": number(0, 1, what="0 = off"),
    "verify.reference_model_max_params": integer(0, 2**40),
    "verify.baseline": optional_path("a JSON baseline store"),
    "verify.save_baseline": TYPED,
    "verify.max_tokens_per_s_drop": number(0, 1, what="a fraction", bad=(-0.1, 1.5, math.nan)),
    "verify.max_p99_increase": number(0, 1000, what="a fraction"),
    "verify.max_memory_increase": number(0, 1000, what="a fraction"),
    "verify.breaker_factor": number(1, 1e6, lo_open=True, what="a multiple of the reference p99"),
    "verify.breaker_window": integer(1, MAX_STEPS),
    "verify.breaker_patience": integer(1, MAX_STEPS),
    "verify.max_bad_steps": integer(1, MAX_STEPS),
    "verify.inject_nan_steps": Rule(
        lambda c: f"0-based steps below train.steps={c.train.steps}",
        _nan_steps_ok,
        ([-1], [10**6]),
    ),
}
