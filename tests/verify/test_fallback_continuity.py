"""A fallback goes on exactly where an unbroken run on the lower rung would be: every row after it
(loss, gradient norm, learning rate and an MoE model's balance figures) is bitwise that of the same
config run on ``executor=eager`` from the start, for a dense and an MoE recipe.

- At step 0: the compiled first step fails to compile (``Ladder.guard``) and runs again on eager.
  The backend here compiles the blocks and fails on the loss head, the last region, so the failed
  try ran the whole forward first: the MoE layers counted their routing, and under the sigmoid
  router the optimizer's step hook moves the routers' bias. (Before the fix the eager rung's
  optimizer started at step 1: DCP's state-dict read of an optimizer that never stepped runs a
  zero-lr step, which also ran that hook on the failed step's counts.)
- Later: the latency circuit breaker (a stored baseline no step meets) steps compile -> eager
  mid-run (``Ladder.take``). The compiled rung is Dynamo's ``eager`` backend, bitwise the eager
  executor here, so the whole run matches, the fallback step's row included.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch._dynamo.backends.debugging import aot_eager
from torch._dynamo.backends.registry import register_backend

from framework.planner.resolve import resolve
from framework.record.metrics import read_metrics
from framework.verify import PerfFigures, baseline_key, save_baseline
from framework.verify.baseline import device_name
from tests.config.test_config import compose_config
from tests.train.test_train import train

SMALL = ["train.steps=8", "train.log_every=1", "train.eval_every=0", "train.seq_len=64"]
SMALL += ["logger.plot=false", "checkpoint=none", "freeze=none"]
RECIPES = {
    "dense": ["recipe=llama_tiny"],
    # The sigmoid router moves its selection bias after each optimizer step (a step hook).
    "moe": ["recipe=qwen3_moe_tiny", "model.moe.router_score=sigmoid", "model.moe.bias_update_rate=0.01"],
}
ROW_KEYS = ("loss", "grad_norm", "lr", "moe_load", "moe_load_max", "moe_aux_loss")


@register_backend
def fails_on_the_loss_head(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
    """The blocks compile (aot_eager); the loss head's region, compiled last, does not. Registered
    in this process: the runs are forked from it (tests.entry.train_forked)."""
    if "cross_entropy" in str(gm.graph):
        raise RuntimeError("injected: the loss head fails to compile")
    return aot_eager(gm, example_inputs)


def rows(run: Path) -> list[tuple]:
    return [tuple([r["step"]] + [r.get(k) for k in ROW_KEYS]) for r in read_metrics(run) if "loss" in r]


def fallbacks(run: Path) -> list[tuple[int, str]]:
    return [(r["step"], r["event"]) for r in read_metrics(run) if r.get("event", "").startswith("fallback/")]


def run_ok(run: Path, *overrides: str) -> Path:
    proc = train(run, *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_fallback_at_step_0_trains_as_the_eager_run(tmp_path: Path, recipe: str) -> None:
    common = [*SMALL, *RECIPES[recipe]]
    eager = run_ok(tmp_path / "eager", *common, "executor=eager")
    fell = run_ok(tmp_path / "fell", *common, "executor=compile", "executor.backend=fails_on_the_loss_head")
    assert fallbacks(fell) == [(0, "fallback/compile_error")]
    assert json.loads((fell / "summary.json").read_text())["executor"] == "eager"
    expected = rows(eager)
    assert len(expected) == 8 and (recipe == "dense") == (expected[0][-1] is None)
    assert rows(fell) == expected


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_fallback_mid_run_trains_on_as_the_eager_run(tmp_path: Path, recipe: str) -> None:
    # verify=on in both runs: the baseline needs it, and its numerics check runs a forward before
    # step 1 (an MoE layer counts its routing there).
    common = [*SMALL, *RECIPES[recipe], "verify=on"]
    compiled = [*common, "executor=compile", "executor.backend=eager"]
    resolved = resolve(compose_config(*compiled))
    store = tmp_path / "baselines.json"
    c, cpu = resolved.cfg, device_name(torch.device("cpu"))
    key = baseline_key(c.model.name, c.mesh.shape, resolved.plan.layout, 1, cpu, c.executor.mode)
    save_baseline(store, key, PerfFigures(1e-9, 1e-9, 1e9, None, None), {})
    eager = run_ok(tmp_path / "eager", *common, "executor=eager")
    breaker = [f"verify.baseline={store}", "verify.breaker_window=2", "verify.breaker_patience=1"]
    fell = run_ok(tmp_path / "fell", *compiled, *breaker)
    events = fallbacks(fell)
    assert [e for _, e in events] == ["fallback/circuit_breaker"] and 1 < events[0][0] < 8, events
    assert rows(fell) == rows(eager)
