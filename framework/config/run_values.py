"""The values a rank uses that are derived from the resolved config, derived once (``run_values``).

Why: the sequence length, the batch sizes, the tokens an optimizer step sees and the checkpoint root
were each re-derived where they were used (``cfg.train.global_batch_size * cfg.train.seq_len``,
``cfg.checkpoint.dir or run_dir / "checkpoints"``), from a whole config handed down for one number.
The rank entry (``framework.train.trainer.run``) derives this record once from the run dir's resolved
config, its plan and its device, hands it to the parts that need those values, and rank 0 writes it
beside plan.json (``run_values.json``: what the ranks ran with, for a reader of the run dir); the
launcher derives the checkpoint root it locks and reports with the same function (``checkpoint_root``).
The data side reads its own view of the run (``DataRun``), derived here too.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from framework.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    EvalSet,
    TokenizerConfig,
    TrainConfig,
)

CHECKPOINTS = "checkpoints"  # the checkpoint root under the run dir when checkpoint.dir is unset
RUN_VALUES = "run_values.json"  # the record, beside plan.json in the run dir (rank 0 writes it)


@dataclass(frozen=True)
class BatchShape:
    """The sequence length and batch sizes of a resolved run, derived once (``batch_shape``): what
    the data pipeline, the freeze and graph check's example input and the step's token count use."""

    seq_len: int  # tokens a model input holds (train.seq_len)
    window: int  # seq_len + 1 tokens per sampled row: inputs and their next-token targets
    micro_batch_size: int  # rows per forward/backward on one rank (resolved: never 0 here)
    global_batch_size: int  # rows per optimizer step, over every data-parallel rank
    tokens_per_step: int  # global_batch_size * seq_len: the input tokens an optimizer step trains on
    eval_rows: int  # eval_batches * global_batch_size: the rows a validation or eval set holds at most


@dataclass(frozen=True)
class RunValues:
    """What every rank derives from a resolved config, once (``run_values``)."""

    batch: BatchShape
    checkpoint_root: Path  # checkpoint.dir, or <run dir>/checkpoints
    grad_accum_steps: int  # micro batches per optimizer step on one rank (the plan's)
    data_shards: int  # the data-parallel ranks a global batch is split over (the plan's dp degree)
    compute_dtype: str  # what a step autocasts to on the run's device: bfloat16 on CUDA, else float32


def batch_shape(train: TrainConfig) -> BatchShape:
    """The one derivation of ``BatchShape`` from a resolved train group (``train.micro_batch_size`` is
    explicit once ``framework.planner.resolve`` has run)."""
    return BatchShape(
        seq_len=train.seq_len,
        window=train.seq_len + 1,
        micro_batch_size=train.micro_batch_size,
        global_batch_size=train.global_batch_size,
        tokens_per_step=train.global_batch_size * train.seq_len,
        eval_rows=train.eval_batches * max(1, train.global_batch_size),
    )


def checkpoint_root(checkpoint: CheckpointConfig, run_dir: Path) -> Path:
    """The one derivation of the checkpoint root: ``checkpoint.dir``, else the run dir's."""
    return Path(checkpoint.dir) if checkpoint.dir else Path(run_dir) / CHECKPOINTS


def run_values(
    cfg: Config, run_dir: Path, grad_accum_steps: int, data_shards: int, compute_dtype: str
) -> RunValues:
    """The one derivation of ``RunValues`` from a resolved ``cfg`` and its run dir; the plan's
    accumulation and data-parallel degree, and the dtype the run's device computes in (the config
    layer knows neither plans nor devices: the rank entry reads them and passes them in)."""
    root = checkpoint_root(cfg.checkpoint, run_dir)
    return RunValues(batch_shape(cfg.train), root, grad_accum_steps, data_shards, compute_dtype)


def write_run_values(run_dir: Path, values: RunValues) -> Path:
    """``run_dir/run_values.json``: the record as JSON (paths as strings), beside plan.json."""
    record = dataclasses.asdict(values)
    record["checkpoint_root"] = str(values.checkpoint_root)
    path = Path(run_dir) / RUN_VALUES
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


@dataclass(frozen=True)
class DataRun:
    """What the data side reads of a run (``data_run``): its own group, the tokenizer's, and the few
    values of other groups its sources and checks depend on; never the whole config."""

    data: DataConfig
    tokenizer: TokenizerConfig
    vocab_size: int  # model.vocab_size: token ids must fit it
    init_from: str | None  # model.init_from: the vocabulary check reads whether a checkpoint sets it
    seed: int  # train.seed: the sampler's draws
    eval_every: int  # train.eval_every: whether validation data is held out and built
    eval_batches: int  # train.eval_batches: the validation set's global batches
    eval_sets: tuple[EvalSet, ...]  # train.eval_sets: the named sets scored at each evaluation


def data_run(cfg: Config) -> DataRun:
    """The one derivation of ``DataRun`` from a run config."""
    t = cfg.train
    return DataRun(
        cfg.data, cfg.tokenizer, cfg.model.vocab_size, cfg.model.init_from, t.seed, t.eval_every,
        t.eval_batches, tuple(t.eval_sets),
    )  # fmt: skip
