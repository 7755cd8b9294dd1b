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
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

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


@torch.no_grad()
def score(model: torch.nn.Module, batches: Iterator[Batch] | list[Batch], device: torch.device) -> Score:
    """Token-weighted mean cross-entropy (fp32 log-softmax, as the model's loss head) over ``batches``."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    tokens = windows = 0
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        logits = model(x)
        loss = F.cross_entropy(
            logits.flatten(0, 1).float(), y.flatten(), reduction="sum", ignore_index=IGNORE_INDEX
        )
        total += loss.double()
        tokens += int((y != IGNORE_INDEX).sum())
        windows += x.shape[0]
    model.train(was_training)
    if tokens == 0:
        raise ValueError("the evaluation set has no scored target token (every target is masked)")
    return Score(float(total) / tokens, tokens, windows)
