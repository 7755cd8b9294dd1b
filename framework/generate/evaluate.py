"""Loss, perplexity and token count of a model on a data set: what ``python -m framework evaluate``
computes (its command line, which composes the config and loads the model from a run dir, a
checkpoint or a Hugging Face folder, is ``framework.launch.evaluate``).

Two evaluation sets:

- the run's own validation batches (``framework.data.pipeline.build_data``, one
  data-parallel rank), so that for a one-rank run at its last step the figure is its final ``val_loss``.
- ``data_rows``: a whole data set in order, one pass (framework.data.evaluation): ``data.val_path``
  if set, else every record of ``data.path`` (no hold-out), in consecutive windows of
  ``train.seq_len + 1`` tokens as training packs them. Data shorter than one window is refused.

The loss is the mean cross-entropy (fp32) over every scored target token of the whole set (token
weighted, not a mean of batch means), the figure transformers' causal-LM loss gives on the same
tokens.

On N ranks (``mesh=N``, any layout training has: DDP, FSDP, TP, pp) the model is placed as
training places it (``place_model``: every rank reads only its own shards) and scored through the
training loop's ``evaluate``, which adds each rank's loss sums and target counts in one all-reduce.
The windows are dealt out to the data-parallel ranks in micro batches (``rank_batches``); the last
ones are filled up with fully masked rows, so that every rank runs the same number of forwards
(FSDP's all-gathers, the pipeline's sends) and the fill adds nothing. One process scores the whole
model the same way, without a process group.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from framework.config.run_values import batch_shape
from framework.config.schema import Config
from framework.data.evaluation import eval_rows
from framework.data.sft import IGNORE_INDEX, split_rows
from framework.data.tokenizer import Tokenizer

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Score:
    """The result of one evaluation."""

    loss: float  # mean cross-entropy per scored token, nats
    tokens: int  # scored target tokens (masked SFT prompt tokens are not counted)
    windows: int  # rows of train.seq_len + 1 tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf


def data_rows(cfg: Config, tok: Tokenizer, limit: int | None = None) -> tuple[np.ndarray, str]:
    """The evaluation set of ``cfg.data`` (framework.data.evaluation.eval_rows) with the run's
    seq_len, vocabulary and BOS setting."""
    t = cfg.train
    return eval_rows(cfg.data, tok, cfg.model.vocab_size, t.seq_len, cfg.tokenizer.add_bos, limit)


def batches_of(rows: np.ndarray, micro_batch_size: int) -> Iterator[Batch]:
    """(inputs, targets) of ``micro_batch_size`` rows at a time (the last batch may be smaller)."""
    for i in range(0, rows.shape[0], micro_batch_size):
        yield split_rows(torch.from_numpy(np.ascontiguousarray(rows[i : i + micro_batch_size])))


# A row of fill: token 0 everywhere, every target masked (framework.data.sft's ``~t`` marks).
FILL = ~0


def rank_batches(
    rows: np.ndarray, micro_batch_size: int, dp_rank: int, dp_size: int
) -> tuple[list[Batch], int]:
    """This data-parallel rank's micro batches of ``rows`` and how many real windows they hold.

    Batch ``i`` of rank ``r`` is rows ``[(i * dp_size + r) * mbs, ... + mbs)``; the rows are first
    filled up with FILL rows to a multiple of ``mbs * dp_size``, so every batch has the training
    shape (a pipeline's schedule needs it) and every rank the same number of batches."""
    per_round = micro_batch_size * dp_size
    fill = -len(rows) % per_round
    padded = np.concatenate([rows, np.full((fill, rows.shape[1]), FILL, dtype=rows.dtype)]) if fill else rows
    batches, real = [], 0
    for start in range(dp_rank * micro_batch_size, len(padded), per_round):
        batches.append(
            split_rows(torch.from_numpy(np.ascontiguousarray(padded[start : start + micro_batch_size])))
        )
        real += max(0, min(micro_batch_size, len(rows) - start))
    return batches, real


@torch.no_grad()
def score(
    model: torch.nn.Module,
    batches: list[Batch],
    device: torch.device,
    windows: int | None = None,
    replicas: int = 1,
) -> Score:
    """Token-weighted mean cross-entropy over ``batches`` on every rank (the training loop's
    ``evaluate``: fp32 loss, summed over ranks in float64), with the scored target tokens and the
    windows of all ranks. ``windows``: this rank's real rows (default: all of its batches' rows);
    ``replicas``: ranks that score the same batches (world size / data-parallel size: tp and pp ranks),
    by which the summed counts are divided. ValueError when no target is scored."""
    from framework.train.loop import evaluate

    loss = evaluate(model, batches, device)
    mine = sum(int((y != IGNORE_INDEX).sum()) for _, y in batches)
    counts = torch.tensor(
        [mine, sum(x.shape[0] for x, _ in batches) if windows is None else windows], dtype=torch.int64
    )
    if dist.is_initialized() and dist.get_world_size() > 1:
        counts = counts.to(device)
        dist.all_reduce(counts)
    tokens, rows = (int(c) // replicas for c in counts.tolist())
    if tokens == 0:
        raise ValueError("the evaluation set has no scored target token (every target is masked)")
    return Score(loss, tokens, rows)


def place_model(
    cfg: Config, device: torch.device, adapters: Path | None = None
) -> tuple[torch.nn.Module, int, int, int]:
    """The model of ``cfg`` (weights: its ``model.init_from``; for a LoRA run, ``peft=lora``, that is
    the base, and ``adapters`` the run's checkpoint) on this rank, (data-parallel rank, data-parallel
    size) and the ranks that score the same batches (tp x pp: world / dp size).

    On a process group: placed as training places it (the plan of ``cfg``'s mesh, each rank reading
    only its own shards). Without one: the whole model in this process, whatever layout saved it."""
    from framework.checkpoint.init_from import load, load_adapters
    from framework.data.pipeline import document_eos
    from framework.models import build_model, materialize

    if not dist.is_initialized():
        if adapters is not None:
            from framework.generate.decode import lora_model

            return lora_model(cfg, device, adapters, document_eos(cfg.data, cfg.tokenizer)), 0, 1, 1
        meta = build_model(cfg.model, cfg.train.seq_len, document_eos(cfg.data, cfg.tokenizer))
        materialize(meta, device, cfg.train.seed, load)
        return meta, 0, 1, 1
    meta = build_model(cfg.model, cfg.train.seq_len, document_eos(cfg.data, cfg.tokenizer))
    from framework.parallel import build_mesh, parallelize
    from framework.parallel.mesh import dp_mesh_info
    from framework.planner.resolve import make_plan

    plan = make_plan(cfg)
    mesh = build_mesh(plan, device.type)
    args = (cfg.sharding, cfg.bucketing, cfg.executor, device, cfg.train.seed)
    peft = cfg.peft if adapters is not None else None  # source_config took its peft.adapter out
    model = parallelize(meta, mesh, plan, *args, peft=peft, load_weights=load)
    if adapters is not None:
        load_adapters(model, adapters)
    dp_rank, dp_size = dp_mesh_info(mesh, plan)
    return model, dp_rank, dp_size, dist.get_world_size() // dp_size


# The bound framework.config.rules.train sets on train.eval_batches, for the same reason: the validation
# batches are built up front (int64 tokens), 2**28 tokens = 2 GiB; 1e8 batches took 12 GB.
MAX_EVAL_TOKENS = 2**28


def check_batches(batches: int | None, cfg: Config) -> None:
    """``--batches``: at least one, and no more than MAX_EVAL_TOKENS of this run's batches."""
    if batches is None:
        return
    shape = batch_shape(cfg.train)
    per_batch = shape.global_batch_size * shape.window
    most = max(1, MAX_EVAL_TOKENS // per_batch)
    if not 1 <= batches <= most:
        raise ValueError(
            f"--batches={batches} is not valid; valid: 1..{most} (the batches are built up front, at "
            f"most {MAX_EVAL_TOKENS} tokens of {per_batch} each)"
        )
