"""The planner under loss parallelism (``parallel.loss_parallel``): each TP rank holds its vocabulary
shard of the logits (memory), and the loss's three per-token all-reduces replace the logits' gather
(communication); with it off, the gathered logits as before."""

from __future__ import annotations

import json

import pytest

from framework.config.schema import ExecutorMode
from framework.planner.memory import _TP_LOGIT_EXTRA_BYTES, activation_bytes
from framework.planner.report import plan_from_dict, plan_to_dict
from framework.planner.resolve import make_plan
from tests.planner.test_plan import BIG, GPU, cfg_for

TP, SEQ, MBS = 8, 8192, 2


def big_tp(loss_parallel: bool, executor: ExecutorMode = ExecutorMode.compile):
    """70B shape, fsdp_tp on 16 x 8 H100s (tp 8), seq 8192, micro 2, full AC."""
    cfg = cfg_for("fsdp_tp", [16, 8], tp=TP, gbs=64, mbs=MBS)
    cfg.model, cfg.train.seq_len, cfg.mesh.hardware = BIG, SEQ, GPU
    cfg.executor.mode = executor
    cfg.sharding.activation_checkpointing = cfg.sharding.activation_checkpointing.full
    cfg.parallel.loss_parallel = loss_parallel
    return cfg


@pytest.mark.parametrize(("executor", "per_logit"), [(ExecutorMode.compile, 2), (ExecutorMode.eager, 10)])
def test_logits_are_a_vocabulary_shard_per_rank(executor: ExecutorMode, per_logit: int) -> None:
    """Off: the full logits on every TP rank, plus the gathered copy's term; on: 1/tp of them."""
    logits = MBS * SEQ * BIG.vocab_size
    mode = big_tp(True).sharding.activation_checkpointing
    on = activation_bytes(big_tp(True, executor), TP, mode)
    off = activation_bytes(big_tp(False, executor), TP, mode)
    assert off - on == int(logits * (per_logit + _TP_LOGIT_EXTRA_BYTES)) - logits * per_logit // TP
    plan_on, plan_off = make_plan(big_tp(True, executor)), make_plan(big_tp(False, executor))
    assert plan_off.memory.total - plan_on.memory.total == off - on
    # No TP: the setting changes nothing.
    one = lambda lp: activation_bytes(big_tp(lp, executor), 1, mode)  # noqa: E731
    assert one(True) == one(False)


def test_comm_has_the_loss_all_reduces_instead_of_the_logit_gather() -> None:
    tokens = MBS * SEQ
    on = {(c.axis, c.collective): c for c in make_plan(big_tp(True)).comm}
    off = {(c.axis, c.collective): c for c in make_plan(big_tp(False)).comm}
    accum = make_plan(big_tp(True)).grad_accum_steps
    loss = on[("tp", "all_reduce")]
    assert (loss.calls, loss.bytes_per_call) == (3 * accum, tokens * 4)  # max, sum of exp, target logit
    assert ("tp", "all_gather_logits") not in on and ("tp", "all_reduce") not in off
    assert off[("tp", "all_gather_logits")].bytes_per_call == tokens * BIG.vocab_size * 2  # bf16
    assert make_plan(big_tp(True)).prediction.step_time_s < make_plan(big_tp(False)).prediction.step_time_s


def test_plan_records_it_and_warns_where_off_does_nothing() -> None:
    plan = make_plan(big_tp(True))
    assert plan.loss_parallel and not make_plan(big_tp(False)).loss_parallel
    assert plan_from_dict(json.loads(json.dumps(plan_to_dict(plan)))) == plan
    no_tp = cfg_for("fsdp", [2])
    assert not make_plan(no_tp).loss_parallel and not make_plan(no_tp).warnings
    no_tp.parallel.loss_parallel = False
    assert make_plan(no_tp).warnings == (
        "parallel.loss_parallel=false does nothing without tensor parallelism (tp=1): every rank "
        "holds the whole vocabulary's logits either way",
    )
