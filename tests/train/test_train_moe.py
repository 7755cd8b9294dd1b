"""``python train.py recipe=qwen3_moe_tiny`` on the CPU (forked from this process, tests/entry.py):
the experts' balance in metrics.jsonl, the console line and metrics.png; the export after a few steps
loads in transformers with our logits; the sigmoid router's selection bias moves at each step."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from framework.checkpoint.export_hf import checkpoint_model_state
from framework.config.schema import to_config
from framework.models import build_model, materialize
from framework.record.metrics import read_metrics
from tests.entry import train_forked, train_main

TINY = ["recipe=qwen3_moe_tiny", "train.seq_len=32", "train.global_batch_size=4", "train.eval_every=0"]
TINY += ["train.warmup_steps=1"]


def train(run: Path, *overrides: str) -> None:
    proc = train_forked(
        f"hydra.run.dir={run}", *TINY, *overrides, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_balance_is_logged_and_the_export_after_training_equals_ours(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    train(
        run,
        "train.steps=6",
        "train.log_every=3",
        "model.moe.capacity_factor=1.0",
        "checkpoint.export_hf=true",
    )
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [3, 6]
    for r in rows:
        assert len(r["moe_load"]) == 4 and all(x >= 1.0 for x in r["moe_load"])  # 1.0: balanced
        assert r["moe_load_max"] == max(r["moe_load"]) and r["moe_aux_loss"] > 0
        assert 0 <= r["moe_dropped_frac"] < 1 and r["moe_dropped"] >= 0
    assert any(r["moe_dropped"] > 0 for r in rows)  # capacity 1.0 with an untrained router drops some
    log = (run / "train.log").read_text()
    assert "| experts max/mean " in log and "| aux " in log and "| dropped " in log
    assert (run / "metrics.png").is_file()
    # The export of step 6 in transformers, against our model from the step's checkpoint.
    # transformers drops no token: ours without the capacity (inference), the same weights.
    cfg = to_config(OmegaConf.load(run / "config.yaml")).model
    cfg = dataclasses.replace(cfg, init_from=None, moe=dataclasses.replace(cfg.moe, capacity_factor=0.0))
    model = build_model(cfg, 32)
    materialize(model, "cpu", seed=0)
    missing, unknown = model.load_state_dict(
        checkpoint_model_state(run / "checkpoints" / "step_000006"), strict=False
    )
    assert missing == ["output.weight"] and not unknown  # tied: the embedding's tensor, stored once
    hf = AutoModelForCausalLM.from_pretrained(run / "hf").eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(x).logits - model.eval()(x)).abs().max().item()
    print(f"export after 6 steps: max |logits diff| transformers vs ours {diff:.2e}")
    assert diff <= 1e-5


def test_sigmoid_router_bias_moves_each_step_and_another_expert_count_cannot_resume(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    rate = 0.01
    train(run, "train.steps=3", "model.moe.router_score=sigmoid", f"model.moe.bias_update_rate={rate}")
    state = checkpoint_model_state(run / "checkpoints" / "step_000003")
    bias = state["layers.0.feed_forward.gate.expert_bias"]
    steps = bias / rate  # each step moves each entry by -rate, 0 or +rate (the sign of mean - load)
    assert bias.abs().max() > 0 and torch.allclose(steps, steps.round(), atol=1e-4), bias
    assert steps.abs().max() <= 3 and abs(bias.sum().item()) < 3 * rate * bias.numel()
    # Resuming that checkpoint with another expert count (and router): one line, exit 2, nothing written.
    again = tmp_path / "again"
    step = run / "checkpoints" / "step_000003"
    code = train_main(f"hydra.run.dir={again}", *TINY, f"checkpoint.resume={step}", "model.moe.num_experts=4")
    errors = [line for line in capfd.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and not again.exists(), errors
    assert "model.moe.num_experts=8 there, 4 here" in errors[0] and "router_score=sigmoid there" in errors[0]
