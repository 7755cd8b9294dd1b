"""The run's derived values come from one function (``run_values``), from the resolved config."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from framework.config.run_values import batch_shape, run_values
from framework.planner.resolve import resolve
from tests.config.test_config import compose_config


def test_the_values_are_those_of_the_resolved_config(tmp_path: Path) -> None:
    cfg = resolve(compose_config("recipe=llama_tiny", "train.seq_len=64", "train.global_batch_size=8")).cfg
    values = run_values(cfg, tmp_path)
    b = values.batch
    assert (b.seq_len, b.window, b.global_batch_size) == (64, 65, 8)
    assert b.micro_batch_size == cfg.train.micro_batch_size > 0  # resolved: never 0
    assert b.tokens_per_step == 8 * 64
    assert b.eval_rows == cfg.train.eval_batches * 8
    assert values.checkpoint_root == tmp_path / "checkpoints"
    assert batch_shape(cfg.train) == b


def test_checkpoint_dir_is_the_root_when_set(tmp_path: Path) -> None:
    cfg = compose_config("recipe=llama_tiny")
    cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, dir=str(tmp_path / "elsewhere")))
    assert run_values(cfg, tmp_path / "run").checkpoint_root == tmp_path / "elsewhere"


def test_the_record_is_frozen(tmp_path: Path) -> None:
    values = run_values(compose_config("recipe=llama_tiny"), tmp_path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        values.batch.seq_len = 1  # type: ignore[misc]
