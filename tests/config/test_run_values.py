"""The run's derived values come from one function (``run_values``), from the resolved config and its
plan; a run writes them beside plan.json (``run_values.json``)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from framework.config.run_values import RUN_VALUES, batch_shape, checkpoint_root, data_run, run_values
from framework.planner.resolve import resolve
from tests.config.test_config import compose_config


def test_the_values_are_those_of_the_resolved_config(tmp_path: Path) -> None:
    resolved = resolve(compose_config("recipe=llama_tiny", "train.seq_len=64", "train.global_batch_size=8"))
    cfg, plan = resolved.cfg, resolved.plan
    values = run_values(cfg, tmp_path, plan.grad_accum_steps, plan.dp_degree, "float32")
    b = values.batch
    assert (b.seq_len, b.window, b.global_batch_size) == (64, 65, 8)
    assert b.micro_batch_size == cfg.train.micro_batch_size > 0  # resolved: never 0
    assert b.tokens_per_step == 8 * 64
    assert b.eval_rows == cfg.train.eval_batches * 8
    assert values.checkpoint_root == tmp_path / "checkpoints"
    assert batch_shape(cfg.train) == b
    assert (values.grad_accum_steps, values.data_shards, values.compute_dtype) == (plan.grad_accum_steps, 1, "float32")


def test_checkpoint_dir_is_the_root_when_set(tmp_path: Path) -> None:
    cfg = compose_config("recipe=llama_tiny")
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, dir=str(tmp_path / "elsewhere")))
    assert checkpoint_root(cfg.checkpoint, tmp_path / "run") == tmp_path / "elsewhere"


def test_the_record_is_frozen(tmp_path: Path) -> None:
    values = run_values(compose_config("recipe=llama_tiny"), tmp_path, 1, 1, "float32")
    with pytest.raises(dataclasses.FrozenInstanceError):
        values.batch.seq_len = 1  # type: ignore[misc]


def test_the_data_side_reads_its_view_of_the_run() -> None:
    cfg = compose_config("recipe=llama_tiny", "train.seed=7", "train.eval_every=5")
    view = data_run(cfg)
    assert (view.data, view.tokenizer, view.vocab_size) == (cfg.data, cfg.tokenizer, cfg.model.vocab_size)
    assert (view.seed, view.eval_every, view.eval_batches) == (7, 5, cfg.train.eval_batches)


def test_a_run_writes_the_record_beside_plan_json(tmp_path: Path) -> None:
    """A real short run (train.py, two DDP ranks of accumulated micro batches): rank 0 writes
    run_values.json beside plan.json, with the plan's accumulation and shard count and the values
    derived from the resolved config."""
    from tests.train.test_train import train

    run = tmp_path / "run"
    proc = train(run, "train.steps=2", "train.eval_every=0", "train.seq_len=32", "train.global_batch_size=8",
                 "train.micro_batch_size=2", "mesh=2", "freeze=none", "logger.plot=false", "checkpoint=none")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "plan.json").is_file()
    record = json.loads((run / RUN_VALUES).read_text())
    plan = json.loads((run / "plan.json").read_text())
    assert record["batch"] == {"seq_len": 32, "window": 33, "micro_batch_size": 2, "global_batch_size": 8,
                               "tokens_per_step": 256, "eval_rows": record["batch"]["eval_rows"]}  # fmt: skip
    assert (record["grad_accum_steps"], record["data_shards"]) == (plan["grad_accum_steps"], plan["dp_degree"]) == (2, 2)
    assert record["compute_dtype"] == "float32"  # CPU ranks
    assert record["checkpoint_root"] == str(run / "checkpoints")
