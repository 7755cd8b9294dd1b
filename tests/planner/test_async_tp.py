"""``parallel.async_tp``: TP's sequence-parallel collectives fused with their matmuls (framework.parallel.tensor.
enable_async_tp), planned with a share of them hidden (framework.planner.overlap.ASYNC_TP_HIDDEN) and refused
where it cannot run. The fused run itself needs 2+ CUDA GPUs and NCCL: benchmarks/multi_gpu.sh tp_async."""

from __future__ import annotations

import pytest

from framework.launch.recipes import compose_recipe
from framework.planner import overlap
from framework.planner.resolve import make_plan

GPU_TP = ["mesh=8", "mesh/hardware=h100_sxm", "run.dry_run=true", "sharding=tp", "sharding.tp=8",
          "executor=compile", "train.global_batch_size=8", "train.micro_batch_size=8"]  # fmt: skip


def _plan(*extra: str):  # noqa: ANN202 - a Plan
    return make_plan(compose_recipe("llama3_8b", [*GPU_TP, *extra]))


def test_async_tp_fuses_the_tp_collectives_and_hides_a_share_of_them() -> None:
    vanilla, fused = _plan(), _plan("parallel.async_tp=true")
    assert not vanilla.async_tp and fused.async_tp
    kinds = {c.collective: c for c in fused.comm if c.axis == "tp"}
    assert {"all_gather_matmul", "matmul_reduce_scatter"} <= set(kinds)
    before = {c.collective: c for c in vanilla.comm if c.axis == "tp"}
    # The same bytes and calls: only how much of them the matmuls hide changes.
    assert kinds["all_gather_matmul"].volume_bytes == before["all_gather"].volume_bytes
    tp_s = sum(c.time_s for c in vanilla.comm if c.collective in ("all_gather", "reduce_scatter") and c.axis == "tp")
    hidden = tp_s / _link_efficiency() * overlap.ASYNC_TP_HIDDEN
    saved = vanilla.prediction.exposed_comm_s - fused.prediction.exposed_comm_s
    assert saved == pytest.approx(hidden, rel=1e-6)
    assert fused.prediction.compute_s == vanilla.prediction.compute_s


def _link_efficiency() -> float:
    return compose_recipe("llama3_8b", GPU_TP).mesh.hardware.link_efficiency


@pytest.mark.parametrize(
    "extra, message",
    [
        (["executor=eager"], "parallel.async_tp=true with executor.mode=eager (tp=8)"),
        (["mesh/hardware=cpu", "mesh.hardware.memory_gib=1000"], "parallel.async_tp=true on mesh/hardware=cpu"),
    ],
)
def test_async_tp_is_refused_where_it_cannot_run(extra: list[str], message: str) -> None:
    with pytest.raises(ValueError, match="parallel.async_tp=true") as err:
        _plan("parallel.async_tp=true", *extra)
    assert message in str(err.value)


def test_async_tp_on_a_cpu_launch_is_refused() -> None:
    cfg = compose_recipe(
        "llama_tiny", ["mesh=2", "sharding=tp", "sharding.tp=2", "executor=compile", "run.device=cpu",
                       "parallel.async_tp=true"],  # fmt: skip
    )
    with pytest.raises(ValueError, match=r"parallel.async_tp=true on a CPU launch \(gloo\)"):
        make_plan(cfg)


def test_async_tp_without_tp_warns_that_it_does_nothing() -> None:
    plan = make_plan(compose_recipe("llama_tiny", ["parallel.async_tp=true"]))
    assert not plan.async_tp
    assert any("parallel.async_tp=true does nothing without tensor parallelism" in w for w in plan.warnings)
