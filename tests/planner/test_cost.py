"""framework.planner.cost: what the step-time model sees (float8's GEMMs)."""

from __future__ import annotations

import pytest

from framework.launch.recipes import compose_recipe
from framework.planner.layout import fixed_degrees
from framework.planner.plan import plan_for

# Issue 28's one-H200 run: llama3_8b at 8K, micro 1, full AC, optimizer in backward.
ISSUE_28 = [
    "run.device=cuda", "mesh/hardware=h200", "executor=compile", "data=synthetic", "train.seq_len=8192",
    "train.global_batch_size=1", "train.micro_batch_size=1", "train.optimizer_in_backward=true",
    "train.grad_clip=0", "sharding.activation_checkpointing=full", "sharding=fsdp", "run.dry_run=true",
]  # fmt: skip
FLOAT8 = ["model.float8=tensorwise", "model.float8_size_filter=false"]


def _tokens_per_s(overrides: list[str]) -> float:
    cfg = compose_recipe("llama3_8b", overrides)
    d = fixed_degrees(cfg)
    assert d is not None
    return plan_for(cfg, d, check_memory=False).prediction.tokens_per_s


def test_float8_speed_up_is_seen() -> None:
    """Measured 10,814 / 8,670 tok/s = 1.247x (issue 28, full AC); the planner predicted 1.0x before
    float8's GEMMs and casts were costed, 1.318x with the GEMM rate measured in session 12's profile
    (each of the pair within 12% of its measurement). Fewer converted layers gain less."""
    bf16 = _tokens_per_s(ISSUE_28)
    f8 = _tokens_per_s(ISSUE_28 + FLOAT8)
    assert f8 / bf16 == pytest.approx(10_814 / 8_670, rel=0.07)
    assert f8 == pytest.approx(10_814, rel=0.12) and bf16 == pytest.approx(8_670, rel=0.12)
    filtered = _tokens_per_s([*ISSUE_28, "model.float8=tensorwise", "model.float8_skip=[output,w2]"])
    assert bf16 < filtered < f8


# Session 15's rows (one H200, real packed text, the document mask on FA4's varlen kernel, no
# recompute, optimizer in backward; benchmarks/PERF.md): tokens/s from the median step of 30, and
# the peak GiB; the planner within 15% and 5% (issue 28 asks 15% and 10%).
MASKED_8K = [
    "run.device=cuda", "mesh/hardware=h200", "executor=compile", "train.seq_len=8192",
    "train.optimizer_in_backward=true", "train.grad_clip=0", "data.document_mask=true",
    "model.attention=fa4", "sharding.activation_checkpointing=none", "sharding=fsdp", "run.dry_run=true",
]  # fmt: skip
ROWS_8K = [
    ([*FLOAT8, "train.global_batch_size=1", "train.micro_batch_size=1"], 14_008, 118.9),
    ([*FLOAT8, "train.global_batch_size=1", "train.micro_batch_size=1", "optimizer.state_dtype=bfloat16"], 14_244, 88.98),
    ([*FLOAT8, "train.global_batch_size=2", "train.micro_batch_size=2", "optimizer.state_dtype=bfloat16"], 16_000, 116.09),
    (["train.global_batch_size=1", "train.micro_batch_size=1", "optimizer.state_dtype=bfloat16"], 10_809, 110.97),
]  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "tokens_per_s", "peak_gib"), ROWS_8K, ids=["f8", "f8_m16", "f8_m16_b2", "bf16_m16"]
)
def test_the_8k_rows_are_planned_within_15_percent(
    overrides: list[str], tokens_per_s: float, peak_gib: float
) -> None:
    cfg = compose_recipe("llama3_8b", MASKED_8K + overrides)
    d = fixed_degrees(cfg)
    assert d is not None
    plan = plan_for(cfg, d, check_memory=False)
    assert plan.prediction.tokens_per_s == pytest.approx(tokens_per_s, rel=0.15)
    assert plan.memory.total / 2**30 == pytest.approx(peak_gib, rel=0.05)
