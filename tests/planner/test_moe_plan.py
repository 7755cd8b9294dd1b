"""The planner on an MoE model (issue 25 point 4): experts over ep, the all-to-all, active flops, ep searched."""

from __future__ import annotations

import math

import pytest

from framework.config.schema import Config, ModelConfig, ModelFamily, MoEConfig, Strategy
from framework.models import active_params, flops_per_token, num_params
from framework.planner.layout import Degrees
from framework.planner.report import format_plan
from framework.planner.resolve import make_plan
from framework.planner.search import search
from framework.planner.search_space import ep_options

E, K, D, W, L = 8, 2, 64, 48, 3  # experts, top-k, dim, expert width, layers
MOE = ModelConfig(
    family=ModelFamily.qwen3_moe,
    dim=D,
    n_layers=L,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    ffn_dim=128,
    vocab_size=200,
    tie_embeddings=False,
    moe=MoEConfig(num_experts=E, num_experts_per_tok=K, moe_intermediate_size=W),
)
EXPERT_NUMEL = L * E * 3 * W * D  # gate_up (E, 2W, D) and down (E, D, W) per layer


def moe_cfg(shape: list[int], **degrees: int) -> Config:
    cfg = Config(model=MOE)
    cfg.mesh.shape = shape
    for k, v in degrees.items():
        setattr(cfg.parallel, k, v)
    cfg.train.seq_len = 32
    cfg.train.global_batch_size = cfg.mesh.world_size
    cfg.train.micro_batch_size = 1
    return cfg


def test_active_parameters_count_top_k_of_the_experts() -> None:
    total = num_params(MOE)
    assert active_params(MOE) == total - EXPERT_NUMEL + EXPERT_NUMEL * K // E
    n = active_params(MOE, include_embedding=False)
    assert flops_per_token(MOE, 32) == 6.0 * n + 12.0 * L * 4 * 16 * 32
    plan = make_plan(moe_cfg([8], dp_shard=8, ep=4))
    assert plan.num_params == total  # all experts, counted once over the ep ranks


def test_experts_sharded_over_ep_and_the_all_to_all_costed() -> None:
    """ep=4 of dp_shard=8: each rank holds E/4 experts, FSDP halves them; the dense weights are
    sharded 8 ways. The comm table carries the dispatch and combine of every layer, forward and
    backward, and the experts' FSDP traffic over their own 2-rank group."""
    plan = make_plan(moe_cfg([8], dp_shard=8, ep=4))
    dense = num_params(MOE) - EXPERT_NUMEL
    # dense: rank 0's chunk of each weight's dim 0 over 8; experts: E/ep = 2 over 2 ranks -> 1 each
    assert plan.params_per_rank < math.ceil(dense / 8) + EXPERT_NUMEL // E + 8 * 64
    assert plan.params_per_rank >= EXPERT_NUMEL // E + dense // 8
    by = {(c.axis, c.collective): c for c in plan.comm}
    rows = 32 * K  # a rank's tokens x top-k
    a2a = by[("ep", "all_to_all")]
    assert (a2a.group_size, a2a.link, a2a.calls) == (4, "intra", 2 * L)
    assert a2a.bytes_per_call == rows * D * 4  # fp32 on the CPU profile
    assert a2a.volume_bytes == int(3 / 4 * a2a.bytes_per_call * a2a.calls)
    assert by[("ep", "all_to_all_backward")].calls == 2 * L
    assert by[("dp_shard_mod_ep", "all_gather")].group_size == 2
    assert plan.memory.comm_buffers > 0
    assert "all_to_all" in format_plan(plan)


def test_all_to_all_over_nodes_when_the_ep_group_spans_them() -> None:
    """An ep group over 2 nodes of 4: 3/8 of each call's payload goes over NVLink, 4/8 over the
    network, at once; the call lasts as long as the network's share."""
    plan = make_plan(moe_cfg([2, 4], dp_shard=8, ep=8))
    a2a = next(c for c in plan.comm if c.collective == "all_to_all")
    assert (a2a.group_size, a2a.link) == (8, "mixed")
    assert a2a.volume_bytes == int(7 / 8 * a2a.bytes_per_call * a2a.calls)
    hw = moe_cfg([2, 4]).mesh.hardware
    network = a2a.bytes_per_call * 4 / 8 / (hw.inter_node_gbps * 1e9) + 7 * hw.inter_node_latency_us * 1e-6
    assert a2a.time_s == pytest.approx(network * a2a.calls)
    assert not any(c.axis == "dp_shard_mod_ep" for c in plan.comm)  # each expert on one rank


def test_auto_weighs_ep_with_the_other_degrees() -> None:
    """sharding=auto on 16 ranks (2 nodes): ep 1, the largest in a node and the largest overall."""
    cfg = moe_cfg([2, 8])
    cfg.sharding.strategy = Strategy.auto
    cfg.train.global_batch_size = 16
    result = search(cfg)
    eps = {
        (c.degrees["tp"], c.degrees["dp_shard"], c.degrees["ep"])
        for c in result.candidates
        if c.degrees["pp"] == 1 and c.degrees["dp_replicate"] == 1
    }
    assert {(1, 16, 1), (1, 16, 8)} <= eps  # 8 experts: the largest ep divides them
    # tp is not searched for an MoE family (its MoE sublayer runs whole on each TP rank, work the cost
    # model does not count); a declared tp still runs. The in-node ep, at tp 2: ep 4 keeps 8 ranks in a node.
    assert all(c.degrees["tp"] == 1 for c in result.candidates)
    tp2 = Degrees(dp_replicate=1, dp_shard=8, cp=1, tp=2, pp=1)
    assert [d.ep for d in ep_options(cfg, tp2)] == [1, 4, 8]
    assert result.chosen_cfg.parallel.ep == result.chosen.degrees["ep"]


def _tiny_plan(*overrides: str):  # type: ignore[no-untyped-def]
    from framework.launch.recipes import compose_recipe

    return make_plan(compose_recipe("qwen3_moe_tiny", ["run.dry_run=true", *overrides]))


def _aux_rows(plan) -> dict[str, object]:  # type: ignore[no-untyped-def]
    return {c.collective: c for c in plan.comm if c.collective.startswith("aux_all_reduce")}


def test_aux_loss_all_reduce_listed_with_its_bytes_and_group() -> None:
    """Issue 25: qwen3_moe_tiny (8 experts, 4 layers, router_aux_loss_coef 0.01) on dp_shard=4: each
    micro batch's forward all-reduces the layer-summed counts, probability sums and token count
    (2 E + 1 fp32, aux_loss_scope=global), and its backward the gradient of the same size, over the
    4 data-parallel ranks; scope layer sends 2 E + 1 per layer. On the critical path: in the step time."""
    e, layers = 8, 4
    plan = _tiny_plan("mesh=4", "parallel.dp_shard=4", "train.micro_batch_size=2")
    rows = _aux_rows(plan)
    assert set(rows) == {"aux_all_reduce", "aux_all_reduce_backward"}
    accum = plan.grad_accum_steps
    assert accum == 2  # 16 sequences over 4 ranks in micro batches of 2: the all-reduce per micro batch
    for c in rows.values():
        assert (c.axis, c.group_size, c.link, c.calls) == ("dp_tokens", 4, "intra", accum)
        assert c.bytes_per_call == (2 * e + 1) * 4
    layer = _aux_rows(_tiny_plan("mesh=4", "parallel.dp_shard=4", "model.moe.aux_loss_scope=layer"))
    assert layer["aux_all_reduce"].bytes_per_call == layers * (2 * e + 1) * 4
    off = _tiny_plan("mesh=4", "parallel.dp_shard=4", "model.moe.router_aux_loss_coef=0")
    assert plan.prediction.exposed_comm_s > off.prediction.exposed_comm_s
    assert "aux_all_reduce" in format_plan(plan)


def test_aux_loss_all_reduce_per_stage_under_a_pipeline() -> None:
    """Under pp the term is each stage's layers' (scope layer, whatever the config says): pp=2 on 4
    ranks, dp_shard=2, 1F1B over 8 micro batches: 8 calls each way of 2 layers x (2 E + 1) fp32."""
    plan = _tiny_plan("mesh=4", "parallel.dp_shard=2", "parallel.pp=2", "train.micro_batch_size=1")
    rows = _aux_rows(plan)
    assert plan.pp_stages_per_rank == 1 and plan.grad_accum_steps == 8
    for c in rows.values():
        assert (c.group_size, c.calls, c.bytes_per_call) == (2, 8, 2 * (2 * 8 + 1) * 4)


def test_no_aux_all_reduce_without_the_loss_or_other_data_ranks() -> None:
    assert not _aux_rows(_tiny_plan("mesh=4", "parallel.dp_shard=4", "model.moe.router_aux_loss_coef=0"))
    assert not _aux_rows(_tiny_plan("mesh=1"))  # dp = 1: token_group is None
    assert not _aux_rows(_tiny_plan("mesh=2", "parallel.tp=2"))  # tp ranks hold the same tokens


SIGMOID = ("model.moe.router_score=sigmoid", "model.moe.bias_update_rate=0.001")


def _bias_rows(plan) -> list[object]:  # type: ignore[no-untyped-def]
    return [c for c in plan.comm if c.collective == "bias_all_reduce"]


def test_bias_update_all_reduce_listed_once_a_step_per_layer() -> None:
    """Issue 25: qwen3_moe_tiny (8 experts, 4 layers) with the sigmoid router and bias_update_rate >
    0 on dp_shard=4: after each optimizer step every layer all-reduces its E int64 token counts over
    the 4 data-parallel ranks (framework.models.parts.sparse.update_expert_biases): 4 calls of 64
    bytes a step, however many micro batches; on the critical path: in the step time."""
    from framework.launch.recipes import compose_recipe

    e, layers = 8, 4
    plan = _tiny_plan("mesh=4", "parallel.dp_shard=4", "train.micro_batch_size=2", *SIGMOID)
    assert plan.grad_accum_steps == 2  # the counts accumulate over the micro batches: still once
    (row,) = _bias_rows(plan)
    assert (row.axis, row.group_size, row.link, row.calls) == ("dp_tokens", 4, "intra", layers)
    assert row.bytes_per_call == e * 8
    assert row.volume_bytes == int(2 * 3 / 4 * e * 8 * layers)  # a ring all-reduce: 2 (n-1)/n
    # against a fixed bias (same router, no update): the whole row is exposed, at link_efficiency
    cfg = compose_recipe("qwen3_moe_tiny", ["run.dry_run=true", "mesh=4"])
    fixed = _tiny_plan("mesh=4", "parallel.dp_shard=4", "train.micro_batch_size=2", SIGMOID[0])
    assert plan.prediction.exposed_comm_s - fixed.prediction.exposed_comm_s == pytest.approx(
        row.time_s / cfg.mesh.hardware.link_efficiency
    )
    assert "bias_all_reduce" in format_plan(plan)


def test_bias_update_all_reduce_per_rank_layers_under_a_pipeline() -> None:
    """pp=2 on 4 ranks, dp_shard=2: each rank sums its stage's 2 layers over its 2 data ranks, once
    a step (8 micro batches)."""
    plan = _tiny_plan("mesh=4", "parallel.dp_shard=2", "parallel.pp=2", "train.micro_batch_size=1", *SIGMOID)
    (row,) = _bias_rows(plan)
    assert plan.grad_accum_steps == 8
    assert (row.group_size, row.calls, row.bytes_per_call) == (2, 2, 8 * 8)


def test_no_bias_all_reduce_without_the_update_or_other_data_ranks() -> None:
    assert not _bias_rows(_tiny_plan("mesh=4", "parallel.dp_shard=4"))  # softmax: no bias
    assert not _bias_rows(_tiny_plan("mesh=4", "parallel.dp_shard=4", SIGMOID[0]))  # rate 0: fixed bias
    assert not _bias_rows(_tiny_plan("mesh=1", *SIGMOID))  # dp = 1: token_group is None
    assert not _bias_rows(_tiny_plan("mesh=2", "parallel.tp=2", *SIGMOID))  # tp ranks hold the same tokens
    # peft=lora: the biases are part of the frozen base (framework.train.runner registers no update)
    assert not _bias_rows(
        _tiny_plan("mesh=4", "parallel.dp_shard=4", *SIGMOID, "peft=lora", "peft.targets=[wq]")
    )
