"""Loss, perplexity and token count of a model on a data set: what ``python -m framework evaluate``
computes (its command line, which composes the config and loads the model from a run dir, a
checkpoint or a Hugging Face folder, is ``framework.launch.evaluate``).

Two evaluation sets:

- ``run_validation``: a run's own validation batches (``framework.data.pipeline.build_data``, one
  data-parallel rank), so that for a one-rank run at its last step the figure is its final ``val_loss``.
- ``data_windows``: a whole data set in order, one pass: ``data.val_path`` if set, else every record
  of ``data.path`` (no hold-out), cut into consecutive windows of ``train.seq_len + 1`` tokens as
  training packs them (documents with EOS; SFT examples masked on their prompts). The tokens past
  the last full window are not scored, and no window is repeated (training's sources wrap around to
  the next epoch; here the first row that reaches into it ends the set). Data shorter than one
  window is refused.

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

from framework.config.schema import Config, DataConfig, DataSource, TokenizerKind
from framework.data.records import Records, SourceSpec, resolve_files
from framework.data.sampler import load_corpus, stdlib_files
from framework.data.sft import IGNORE_INDEX, ChatFormat, Fields, SFTWindows, split_rows
from framework.data.stream import PackedWindows
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


def keep_all(_n: int) -> bool:
    return True


def _sequential(tokens: np.ndarray, window: int) -> np.ndarray:
    n = tokens.size // window
    return np.asarray(tokens[: n * window], dtype=np.int64).reshape(n, window)


def one_pass(source: PackedWindows | SFTWindows, limit: int | None) -> np.ndarray:
    """Rows of ``source`` from its start until its first epoch ends (or ``limit`` rows): a row that
    reaches into the next epoch would score some tokens twice, so it is not taken."""
    rows = []
    while limit is None or len(rows) < limit:
        row = source.take(1)
        if source.state()["epoch"] > 0:
            break
        rows.append(row[0])
    return np.stack(rows) if rows else np.empty((0, 0), dtype=np.int64)


def data_rows(cfg: Config, tok: Tokenizer, limit: int | None = None) -> tuple[np.ndarray, str]:
    """The evaluation set's rows (signed: ``framework.data.sft`` masks) and what it is. ValueError
    for data shorter than one window or a source with nothing to evaluate."""
    data, window = cfg.data, cfg.train.seq_len + 1
    if data.mix:
        raise ValueError("evaluate takes one data set: set data.path (or data.val_path), not data.mix")
    if data.source is DataSource.synthetic:
        raise ValueError(
            "data=synthetic is random tokens: evaluate a data set (data=jsonl|text|tokens|sft ...)"
        )
    path = data.val_path or data.path
    what = f"data.{'val_path' if data.val_path else 'path'}={path!r}"
    spec = SourceSpec(data.source, path, data.field, data.column, data.name, data.split, data.streaming)
    if data.source is DataSource.tokens or (
        data.source is DataSource.stdlib and tok.kind is TokenizerKind.bytes
    ):
        one = DataConfig(source=data.source, path=path, val_fraction=data.val_fraction)
        corpus = load_corpus(one, cfg.model.vocab_size, cfg.train.seq_len)
        assert corpus is not None  # synthetic was refused above
        tokens = np.concatenate([np.asarray(corpus.train), np.asarray(corpus.val)])
        rows, what = _sequential(tokens, window), f"{corpus.description} ({tokens.size} tokens)"
        rows = rows[:limit] if limit is not None else rows
    elif data.source is DataSource.sft:
        fmt = ChatFormat(tok, cfg.tokenizer.add_bos)
        files = resolve_files(spec)
        source = SFTWindows(
            files, Fields.of(data), fmt, window, keep_all, data.encode_batch, what, data.sft_pack
        )
        rows = one_pass(source, limit)
        what = f"sft {what} ({fmt.description})"
    else:
        if data.source is DataSource.stdlib:
            records = Records(SourceSpec(DataSource.text, None), files=stdlib_files())
        else:
            records = Records(spec)
        source = PackedWindows(records, tok, window, keep_all, cfg.tokenizer.add_bos, data.encode_batch, what)
        rows = one_pass(source, limit)
        what = f"{data.source.value} {what} ({tok.kind.value} tokens, packed with EOS)"
    if rows.shape[0] == 0:
        raise ValueError(
            f"{what} is shorter than one window of train.seq_len+1={window} tokens: nothing to evaluate; "
            "lower train.seq_len or give more data"
        )
    return rows, what


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
