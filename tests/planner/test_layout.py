"""Parallel degrees: presets, explicit degrees (-1 = the rest), refusals, and where each axis lands."""

from __future__ import annotations

import pytest

from framework.config.schema import Config, Device, HardwareConfig, ModelConfig, ParallelConfig, Strategy
from framework.planner.cost import gemm_shape_efficiency
from framework.planner.layout import (
    Degrees,
    MeshAxis,
    axis_placement,
    check_dense_ep,
    fixed_degrees,
    from_parallel,
)
from framework.planner.resolve import make_plan


def cfg_for(shape: list[int], strategy: str = "auto", sharding_tp: int = 1, **degrees: int) -> Config:
    cfg = Config()
    cfg.mesh.shape = shape
    cfg.sharding.strategy = Strategy(strategy)
    cfg.sharding.tp = sharding_tp
    cfg.parallel = ParallelConfig(**degrees)
    cfg.train.global_batch_size = 32
    return cfg


@pytest.mark.parametrize(
    ("strategy", "shape", "tp", "expected"),
    [
        ("ddp", [2, 4], 1, Degrees(dp_replicate=8)),
        ("fsdp", [2, 4], 1, Degrees(dp_shard=8)),
        ("hsdp", [2, 4], 1, Degrees(dp_replicate=2, dp_shard=4)),
        ("tp", [2], 2, Degrees(tp=2)),
        ("fsdp_tp", [2, 4], 2, Degrees(dp_shard=4, tp=2)),
    ],
)
def test_presets_are_degrees(strategy: str, shape: list[int], tp: int, expected: Degrees) -> None:
    assert fixed_degrees(cfg_for(shape, strategy, tp)) == expected
    assert fixed_degrees(cfg_for([1], "auto")) is None  # the search decides


def test_explicit_degrees_win_and_fill_the_rest() -> None:
    # A preset is overridden by explicit degrees; an unset dp_shard takes the rest.
    assert fixed_degrees(cfg_for([2, 4], "ddp", dp_replicate=2, tp=2)) == Degrees(2, 2, 1, 2, 1)
    assert from_parallel(cfg_for([16, 8], tp=8, dp_shard=-1, dp_replicate=4)) == Degrees(4, 4, 1, 8, 1)
    assert from_parallel(cfg_for([8], dp_replicate=-1, dp_shard=2)) == Degrees(dp_replicate=4, dp_shard=2)


@pytest.mark.parametrize(
    ("degrees", "message"),
    [
        (
            {"dp_replicate": 3, "dp_shard": 2},
            r"parallel.dp_replicate=3 x parallel.dp_shard=2 multiply to 6, not the world size 8 "
            r"\(mesh.shape=\[2, 4\]\)",
        ),
        ({"tp": 3}, r"multiply to 3, which does not divide the world size 8"),
        ({"dp_replicate": -1, "tp": -1}, r"only one degree may take the rest"),
        ({"pp": 8}, r"parallel.pp=8 is greater than model.n_layers=4: each pipeline stage needs"),
        (
            {"cp": 2},
            r"parallel.cp=2 on the CPU: torch's context_parallel \(ring attention\) runs only SDPA's CUDA "
            r"kernels.*_scaled_dot_product_flash_attention_for_cpu.*valid here: parallel.cp=1",
        ),
        (
            {"cp": 4, "seq_len": 12},
            r"parallel.cp=4 does not split train.seq_len=12: .* 2 x cp = 8 equal chunks; valid cp "
            r"degrees here are \[1, 2\]",
        ),
        ({"cp": 2, "document_mask": True}, r"parallel.cp=2 with data.document_mask=true: ring attention"),
        (
            {"cp": 2, "pp": 2},
            r"parallel.cp=2 with parallel.pp=2 is planned \(run.dry_run=true\) but cannot be launched",
        ),
        ({"tp": 4}, r"parallel.tp=4 does not divide model.n_kv_heads=2.*valid TP degrees here are \[1, 2\]"),
        ({"dp_shard": -2}, r"parallel.dp_shard=-2 is not valid"),
    ],
)
def test_bad_degrees_are_refused(degrees: dict[str, int], message: str) -> None:
    seq_len, mask = degrees.pop("seq_len", None), degrees.pop("document_mask", False)
    cfg = cfg_for([2, 4], **degrees)
    cfg.run.device = Device.cpu
    cfg.train.seq_len = seq_len or cfg.train.seq_len
    cfg.data.document_mask = mask
    with pytest.raises(ValueError, match=message) as e:
        make_plan(cfg)
    assert "\n" not in str(e.value)


def test_cp_is_planned_in_a_dry_run() -> None:
    """cp=2 on CUDA hardware, planned on this CPU machine: sequence-sharded activations, parameters
    sharded over dp_shard x cp, and the ring's K/V passes in every layer, forward and backward."""
    base = cfg_for([2, 4], dp_shard=4, tp=2)
    base.mesh.hardware = HardwareConfig(name="h100_sxm", memory_gib=80.0)
    base.train.seq_len = 64
    base.train.micro_batch_size = 4
    base.run.dry_run = True
    one = make_plan(base)
    shape_one = gemm_shape_efficiency(base, one.layout)
    base.parallel = ParallelConfig(dp_shard=2, cp=2, tp=2)
    two = make_plan(base)
    shape_two = gemm_shape_efficiency(base, two.layout)
    assert two.strategy == "fsdp_tp_cp" and two.mesh_axes == ("dp_shard", "cp", "tp")
    assert two.params_per_rank == one.params_per_rank  # FSDP shards over dp_shard x cp = 4 either way
    # Half the tokens per micro batch (the ring's gathered K/V of one layer on top); a data-parallel
    # degree of 2 instead of 4 gives each rank the same tokens per step, so the same compute.
    assert two.memory.activations < 0.6 * one.memory.activations
    assert two.grad_accum_steps == 2 * one.grad_accum_steps
    ring = {c.collective: c for c in two.comm if c.axis == "cp"}
    layers = base.model.n_layers
    assert sorted(ring) == ["dkv_ring_backward", "kv_ring_backward", "kv_ring_forward"]
    assert ring["kv_ring_forward"].calls == ring["kv_ring_backward"].calls == layers * two.grad_accum_steps
    assert {c.axis for c in two.comm} >= {"dp_shard_cp", "cp", "tp"}
    # (at the GEMM rate of each one's shapes: CP halves the micro batch's GEMM rows)
    assert two.prediction.compute_s * shape_two == pytest.approx(one.prediction.compute_s * shape_one)


def test_cp_with_pp_is_planned_in_a_dry_run() -> None:
    """cp x pp (Llama 3's long-context layout), planned on this CPU machine: against pp=2 x dp_shard=4,
    pp=2 x dp_shard=2 x cp=2 keeps the parameters per rank (FSDP2 shards over dp_shard x cp), halves
    the activations and the stage-to-stage sends of a micro batch, and passes K/V around the ring in
    each of the pipeline rank's own blocks only, for each micro batch."""
    base = cfg_for([8], pp=2, dp_shard=4)
    base.model = ModelConfig(n_layers=4, tie_embeddings=False)
    base.mesh.hardware = HardwareConfig(name="h100_sxm", memory_gib=80.0)
    base.train.seq_len = 64
    base.run.dry_run = True
    one = make_plan(base)  # 32 rows / dp 4 = 8 per rank, in 2 micro batches of 4
    base.parallel = ParallelConfig(pp=2, dp_shard=2, cp=2, pp_microbatches=4)  # 16 per rank: 4 x 4
    two = make_plan(base)
    assert two.strategy == "fsdp_cp_pp" and two.mesh_axes == ("pp", "dp_shard", "cp")
    assert two.params_per_rank == one.params_per_rank
    assert two.memory.activations < 0.6 * one.memory.activations
    sends = {p.strategy: next(c for c in p.comm if c.axis == "pp") for p in (one, two)}
    assert sends["fsdp_cp_pp"].bytes_per_call * 2 == sends["fsdp_pp"].bytes_per_call
    ring = {c.collective: c for c in two.comm if c.axis == "cp"}
    stage_blocks = base.model.n_layers // 2
    assert ring["kv_ring_forward"].calls == stage_blocks * two.grad_accum_steps
    assert two.pp_split == one.pp_split
    base.run.dry_run = False
    with pytest.raises(ValueError, match="parallel.cp=2 with parallel.pp=2 is planned"):
        make_plan(base)


def test_tp_must_split_heads() -> None:
    cfg = cfg_for([2, 4], tp=2)
    cfg.model = ModelConfig(n_heads=3, n_kv_heads=1, dim=96)
    with pytest.raises(ValueError, match="parallel.tp=2 does not divide model.n_heads=3"):
        make_plan(cfg)
    cfg.model = ModelConfig(n_heads=6, n_kv_heads=3, dim=96)
    with pytest.raises(ValueError, match="parallel.tp=2 does not divide model.n_kv_heads=3"):
        make_plan(cfg)


def test_axes_and_placement_on_16x8() -> None:
    """TP inside a node, dp_shard across 8 nodes (stride 8), dp_replicate across the node pairs."""
    d = Degrees(dp_replicate=2, dp_shard=8, tp=8)
    axes = d.axes()
    assert axes == ((MeshAxis.dp_replicate, 2), (MeshAxis.dp_shard, 8), (MeshAxis.tp, 8))
    cfg = cfg_for([16, 8])
    place = axis_placement(tuple(n for _, n in axes), tuple(a.value for a, _ in axes), cfg.mesh)
    assert [(p.axis, p.stride, p.intra_node, p.nodes_spanned) for p in place] == [
        ("dp_replicate", 64, False, 2),
        ("dp_shard", 8, False, 8),
        ("tp", 1, True, 1),
    ]
    assert "inside a node" in place[2].describe() and "across 8 nodes" in place[1].describe()


def test_wrappers_follow_the_degrees() -> None:
    assert Degrees(dp_replicate=4).ddp and not Degrees(dp_replicate=4).fsdp
    assert Degrees(dp_replicate=2, tp=2).fsdp  # HSDP over a size-1 dp_shard axis (DDP cannot wrap DTensors)
    assert Degrees(dp_replicate=2, tp=2).axes() == (
        (MeshAxis.dp_replicate, 2),
        (MeshAxis.dp_shard, 1),
        (MeshAxis.tp, 2),
    )
    assert Degrees().axes() == ((MeshAxis.dp_replicate, 1),) and Degrees().name() == "single"
    assert Degrees(dp_replicate=2, dp_shard=2, tp=2).name() == "hsdp_tp"
    # CP ranks share parameters: FSDP2 over dp_shard x cp (a size-1 dp_shard axis names it).
    assert Degrees(cp=2).fsdp and Degrees(dp_shard=2, cp=2).fsdp_shard == 4
    assert Degrees(cp=2).name() == "fsdp_cp" and Degrees(dp_replicate=2, cp=2).name() == "hsdp_cp"
    assert Degrees(cp=2).axes() == ((MeshAxis.dp_shard, 1), (MeshAxis.cp, 2))
    plan = make_plan(cfg_for([2, 4], dp_replicate=2, dp_shard=2, tp=2))
    assert plan.strategy == "hsdp_tp" and plan.degrees == {
        "dp_replicate": 2,
        "dp_shard": 2,
        "cp": 1,
        "tp": 2,
        "pp": 1,
        "ep": 1,
    }


def test_ep_is_borrowed_from_dp_shard_and_refused_where_it_cannot_run() -> None:
    """``parallel.ep`` splits dp_shard (not a factor of the world size): 4 ranks with ep=2 are
    dp_shard=4 (2 replicas x ep 2); with tp=2 dp_shard is 2, so ep=2 fits and ep=4 does not."""
    plan = make_plan(cfg_for([4], ep=2))
    assert plan.layout == Degrees(dp_shard=4, ep=2) and plan.mesh_axes == ("dp_shard",)
    assert plan.strategy == "fsdp_ep" and plan.layout.short() == "r1 s4 t1 e2"
    # (the token exchange's cost, on an MoE model: tests/planner/test_moe_plan.py; this dense model has none)
    assert not [c for c in plan.comm if c.axis == "ep"]
    assert make_plan(cfg_for([4], tp=2, ep=2)).layout == Degrees(dp_shard=2, tp=2, ep=2)
    for degrees, msg in (
        ({"tp": 2, "ep": 4}, "parallel.ep=4 does not divide parallel.dp_shard=2: the ep ranks are borrowed"),
        ({"ep": 3}, "parallel.ep=3 does not divide parallel.dp_shard=4"),
        ({"ep": -1}, "parallel.ep=-1 is not valid"),
        ({"dp_replicate": 4, "ep": 2}, "parallel.ep=2 does not divide parallel.dp_shard=1"),
        ({"cp": 2, "ep": 2}, "parallel.ep=2 with parallel.cp=2"),
    ):
        with pytest.raises(ValueError, match=msg):
            make_plan(cfg_for([4], **degrees))
    with pytest.raises(ValueError, match=r"parallel.ep=2 with model.family=llama, a dense model"):
        check_dense_ep(Degrees(dp_shard=2, ep=2), Config().model)
