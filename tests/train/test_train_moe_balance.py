"""Issue 25 point 5 through ``train.py recipe=qwen3_moe_tiny`` on the CPU (tests/entry.py's forked
child): the experts' balance row of metrics.jsonl is the whole model's over the whole batch,
whatever the layout, and counts training forwards only.

- pp=2: rank 0 holds half the layers; the row still lists every MoE layer, in layer order, equal to
  one process's over the same micro batches (the dropped count too: an exact integer), validation
  through the pipeline's schedule included.
- dp_shard=2: each rank routes half the batch; the row is the total over both, one process's again.
- Validation (``train.eval_every``) forwards the model under no_grad: they add nothing to the row,
  nor to the sigmoid routers' bias update, so the rows and the biases are those of a run without it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from framework.checkpoint.export_hf import checkpoint_model_state
from framework.record.metrics import read_metrics
from tests.entry import train_forked

# 2 micro batches of 2 rows per step on every layout: the capacity (per forward) and the routed
# tokens of each forward are the same, so are the counts.
TINY = ["recipe=qwen3_moe_tiny", "train.seq_len=32", "train.global_batch_size=4", "train.eval_every=0"]
TINY += ["train.warmup_steps=1", "train.log_every=1", "data=synthetic"]
BALANCE = ("moe_load", "moe_load_max", "moe_dropped", "moe_dropped_frac")


def train(run: Path, *overrides: str) -> list[dict]:
    """The run's training rows (those with a loss)."""
    proc = train_forked(
        f"hydra.run.dir={run}", *TINY, *overrides, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [r for r in read_metrics(run) if "loss" in r]


def balance(rows: list[dict]) -> list[dict]:
    return [{k: r.get(k) for k in ("step", *BALANCE)} for r in rows]


def test_balance_row_under_pp2_and_dp2_is_one_process_row(tmp_path: Path) -> None:
    common = ["train.steps=2", "model.moe.capacity_factor=1.0", "checkpoint=none", "train.micro_batch_size=2"]
    # No load-balancing loss: with one, the layouts' gradients differ by design (a pipeline takes the
    # per-layer loss; data parallel spans the ranks' micro batch i, one process its own micro batch),
    # and so does step 2's routing
    common += ["model.moe.router_aux_loss_coef=0"]
    one = train(tmp_path / "one", *common)
    assert [len(r["moe_load"]) for r in one] == [4, 4] and one[0]["moe_dropped"] > 0, one
    # With validation before each step (the pipeline's forward-only schedule): it counts nothing
    pp = train(tmp_path / "pp", *common, "mesh='2'", "parallel.pp=2", "parallel.pp_microbatches=2",
               "train.eval_every=1", "train.eval_batches=2")  # fmt: skip
    assert any("val_loss" in r for r in read_metrics(tmp_path / "pp"))
    assert balance(pp) == balance(one), (balance(pp), balance(one))
    dp = train(tmp_path / "dp", *common, "mesh='2'")
    assert balance(dp) == balance(one), (balance(dp), balance(one))
    print(f"balance rows, pp=2 = dp_shard=2 = one process: {balance(one)}")


def test_validation_adds_nothing_to_the_load_nor_to_the_bias(tmp_path: Path) -> None:
    common = ["train.steps=3", "model.moe.router_score=sigmoid", "model.moe.bias_update_rate=0.01"]
    plain = train(tmp_path / "plain", *common)
    evaluated = train(tmp_path / "eval", *common, "train.eval_every=1", "train.eval_batches=2")
    assert any("val_loss" in r for r in read_metrics(tmp_path / "eval"))
    assert balance(evaluated) == balance(plain), (balance(evaluated), balance(plain))
    assert [r["loss"] for r in evaluated] == [r["loss"] for r in plain]
    key = "layers.{}.feed_forward.gate.expert_bias"
    biases = [
        torch.stack(
            [checkpoint_model_state(run / "checkpoints" / "step_000003")[key.format(i)] for i in range(4)]
        )
        for run in (tmp_path / "plain", tmp_path / "eval")
    ]
    assert biases[0].abs().max() > 0 and torch.equal(biases[0], biases[1]), biases
