"""verify group on real gloo ranks: cross-rank graph/config checks stop the job before the first
training collective (within a timeout far below any collective timeout), and the numerics check
agrees on one verdict on every rank under FSDP2 and TP."""

from __future__ import annotations

import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from framework.config.schema import Config, FreezeConfig, FreezeMode, ModelConfig, Strategy
from framework.freeze import freeze
from framework.models import build_model, materialize
from framework.parallel import build_mesh, dp_mesh_info, parallelize
from framework.planner.resolve import make_plan
from framework.verify import RankMismatchError, check_numerics, check_ranks
from framework.verify.consistency import meta_example
from framework.verify.numerics import reference_model
from tests.dist import run_ranks

SMALL = ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=64)
# Two KV heads so that tensor parallelism of degree 2 holds whole heads.
TP_OK = ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=64, vocab_size=64)
SEQ = 16
# gloo's default collective timeout is 30 minutes: a rank left waiting would blow far past this.
TIMEOUT_S = 90.0


def _graph_worker(rank: int, world: int, odd_rank: int, what: str) -> str:
    cfg = SMALL
    if what == "graph" and rank == odd_rank:
        cfg = ModelConfig(**{**SMALL.__dict__, "n_layers": 2})  # one extra layer on one rank
    flat = {"train.lr": 1e-3, "model.name": "m"}
    if what == "config" and rank == odd_rank:
        flat["train.lr"] = 2e-3
    meta = build_model(cfg, SEQ)
    frozen = freeze(
        meta, meta_example(2, SEQ), FreezeConfig(mode=FreezeMode.export, check_graph_breaks=False), None
    )
    try:
        check_ranks(frozen.fingerprint, frozen.summary, f"hash-{flat['train.lr']}", flat)
    except RankMismatchError as e:
        return str(e)
    # Only reached when the check passed on this rank: the first training collective.
    model = build_model(cfg, SEQ)
    materialize(model, "cpu", 0)
    DDP(model)
    return "passed"


@pytest.mark.parametrize("what", ["graph", "config"])
def test_cross_rank_mismatch_stops_every_rank_before_training(what: str) -> None:
    t0 = time.perf_counter()
    messages = run_ranks(_graph_worker, 3, 1, what, timeout_s=TIMEOUT_S)
    assert time.perf_counter() - t0 < TIMEOUT_S
    assert len(set(messages)) == 1, messages  # the same error on every rank
    msg = messages[0]
    assert "ranks [1]" in msg and "before the first training collective" in msg
    if what == "graph":
        assert "different graph than rank 0" in msg and "first differing node" in msg
    else:
        assert "differing keys: ['train.lr']" in msg


def test_same_graph_passes_on_every_rank() -> None:
    assert run_ranks(_graph_worker, 2, -1, "graph", timeout_s=TIMEOUT_S) == ["passed", "passed"]


def _numerics_worker(rank: int, world: int, strategy: str, tp: int, sabotage: bool) -> tuple:
    cfg = Config()
    cfg.model = TP_OK
    cfg.mesh.shape = [world]
    cfg.sharding.strategy = Strategy(strategy)
    cfg.sharding.tp = tp
    cfg.train.seq_len = SEQ
    cfg.train.global_batch_size = 4
    cfg.train.micro_batch_size = 4 // (world // tp)
    plan = make_plan(cfg)
    mesh = build_mesh(plan, "cpu")
    cpu = torch.device("cpu")
    model = parallelize(
        build_model(cfg.model, SEQ), mesh, plan, cfg.sharding, cfg.bucketing, cfg.executor, cpu, 0
    )
    if sabotage and rank == 1:
        with torch.no_grad():
            w = model.layers["0"].feed_forward.w2.weight
            (w.to_local() if hasattr(w, "to_local") else w).mul_(3.0)
    dp_rank, dp_size = dp_mesh_info(mesh, plan)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, TP_OK.vocab_size, (4, SEQ + 1), generator=g)
    n = 4 // dp_size
    local = batch[dp_rank * n : (dp_rank + 1) * n]
    res = check_numerics(
        model,
        (local[:, :-1], local[:, 1:]),
        cpu,
        1e-5,
        compiled=False,
        make_reference=lambda: reference_model(build_model(TP_OK, SEQ), 0, cpu),
        logits_rtol=1e-4,
    )
    return res.passed, res.detail, res.figures["logits_rel_diff_vs_unsharded"]


@pytest.mark.parametrize("strategy, tp", [("fsdp", 1), ("tp", 2)])
def test_numerics_sharded_matches_unsharded_reference(strategy: str, tp: int) -> None:
    results = run_ranks(_numerics_worker, 2, strategy, tp, False, timeout_s=TIMEOUT_S)
    assert all(r[0] is True for r in results), results
    assert all(r[2] < 1e-5 for r in results)


def test_numerics_wrong_shard_is_one_verdict_naming_the_rank() -> None:
    results = run_ranks(_numerics_worker, 2, "fsdp", 1, True, timeout_s=TIMEOUT_S)
    assert [r[0] for r in results] == [False, False]
    assert results[0][1] == results[1][1] and "on rank" in results[0][1], results
