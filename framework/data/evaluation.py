"""Evaluation sets: a data set read once, in order, as rows of ``seq_len + 1`` tokens.

What ``python -m framework evaluate`` scores (framework.generate.evaluate) and what each of
``train.eval_sets`` is (framework.data.pipeline.eval_set_batches). Unlike training's sources, which
hold out every N-th record and wrap around to the next epoch, an evaluation set is every record of
its path, one pass: documents packed with EOS (SFT examples masked on their prompts) into
consecutive windows; token files cut into consecutive windows. The tokens past the last full window
are not scored and no row reaches into a second pass. Data shorter than one window is refused.
"""

from __future__ import annotations

import numpy as np

from framework.config.schema import DataConfig, DataSource, TokenizerKind
from framework.data.records import Records, SourceSpec, resolve_files
from framework.data.sampler import load_corpus, stdlib_files
from framework.data.sft import ChatFormat, Fields, SFTWindows
from framework.data.stream import PackedWindows
from framework.data.tokenizer import Tokenizer


def keep_all(_n: int) -> bool:
    return True


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


def eval_rows(
    data: DataConfig,
    tok: Tokenizer,
    vocab_size: int,
    seq_len: int,
    add_bos: bool = False,
    limit: int | None = None,
    label: str = "data",
) -> tuple[np.ndarray, str]:
    """The set's rows (signed: ``framework.data.sft`` masks), at most ``limit``, and what it is:
    ``data.val_path`` if set, else ``data.path``. ValueError for a mixture, synthetic data, or data
    shorter than one window; ``label`` names the setting in the message."""
    window = seq_len + 1
    if data.mix:
        raise ValueError(f"{label}: an evaluation set is one data set: set its path, not a data.mix")
    if data.source is DataSource.synthetic:
        raise ValueError(
            f"{label}: data=synthetic is random tokens: evaluate a data set (jsonl|text|tokens|sft ...)"
        )
    path = data.val_path or data.path
    what = f"{label}.{'val_path' if data.val_path else 'path'}={path!r}"
    spec = SourceSpec(
        data.source, path, data.field, data.column, data.name, data.split, data.streaming, key=label
    )
    if data.source is DataSource.tokens or (
        data.source is DataSource.stdlib and tok.kind is TokenizerKind.bytes
    ):
        one = DataConfig(source=data.source, path=path, val_fraction=data.val_fraction)
        corpus = load_corpus(one, vocab_size, seq_len)
        assert corpus is not None  # synthetic was refused above
        tokens = np.concatenate([np.asarray(corpus.train), np.asarray(corpus.val)])
        n = tokens.size // window if limit is None else min(limit, tokens.size // window)
        rows = tokens[: n * window].astype(np.int64).reshape(n, window)
        what = f"{corpus.description} ({tokens.size} tokens)"
    elif data.source is DataSource.sft:
        fmt = ChatFormat(tok, add_bos)
        source = SFTWindows(
            resolve_files(spec),
            Fields.of(data),
            fmt,
            window,
            keep_all,
            data.encode_batch,
            what,
            data.sft_pack,
        )
        rows = one_pass(source, limit)
        what = f"sft {what} ({fmt.description})"
    else:
        if data.source is DataSource.stdlib:
            records = Records(SourceSpec(DataSource.text, None, key=label), files=stdlib_files())
        else:
            records = Records(spec)
        rows = one_pass(
            PackedWindows(records, tok, window, keep_all, add_bos, data.encode_batch, what), limit
        )
        what = f"{data.source.value} {what} ({tok.kind.value} tokens, packed with EOS)"
    if rows.shape[0] == 0:
        raise ValueError(
            f"{what} is shorter than one window of train.seq_len+1={window} tokens: nothing to evaluate; "
            "lower train.seq_len or give more data"
        )
    return rows, what
