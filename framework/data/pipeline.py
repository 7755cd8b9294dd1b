"""From the data side's view of a run to a sampler: which sources, which tokenizer, which rows.

``build_data`` runs on every rank and builds the sampler the checks vouched for (framework.data.checks,
run in the launcher before any rank starts). It takes ``DataRun`` (the data and tokenizer groups and
the few values of others it reads) and the run's batch shape, both derived once
(framework.config.run_values), and this rank's data shard.

The embedded default (``stdlib`` with ``tokenizer=bytes``), ``tokens`` and ``synthetic`` keep the
random-window ``BatchSampler`` (framework.data.sampler), so their batches are those of before;
document sources and mixtures go through the packing ``StreamSampler`` (framework.data.stream).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np
import torch

from framework.config.run_values import BatchShape, DataRun
from framework.config.schema import (
    DataConfig,
    DataSource,
    TokenizerConfig,
    TokenizerKind,
)
from framework.data.evaluation import eval_rows
from framework.data.records import (
    Records,
    SourceSpec,
    resolve_files,
)
from framework.data.sampler import BatchSampler, load_corpus, stdlib_files, validation_batches
from framework.data.sft import ChatFormat, Fields, SFTWindows, split_rows
from framework.data.stream import (
    PackedWindows,
    RandomWindows,
    StreamSampler,
    WindowSource,
    fixed_windows,
    holdout,
)
from framework.data.tokenizer import Tokenizer, load_tokenizer
from framework.models.parts.masks import NO_EOS

log = logging.getLogger("framework")

VAL_SEED = 12345  # the validation set is the same in every run (as validation_batches' seed)
DOCUMENT_SOURCES = (DataSource.text, DataSource.jsonl, DataSource.parquet, DataSource.hf)


@dataclass
class Pipeline:
    sampler: BatchSampler | StreamSampler
    val_batches: list[tuple[torch.Tensor, torch.Tensor]]
    description: str
    # train.eval_sets: name -> this rank's batches (framework.data.evaluation rows, split over ranks)
    eval_sets: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = dataclasses.field(default_factory=dict)


def build_data(run: DataRun, batch: BatchShape, dp_rank: int, dp_size: int) -> Pipeline:
    """The sampler, this rank's fixed validation batches and those of each ``train.eval_sets`` set
    (checked before launch by check_data). ``batch``: the run's sequence length and batch sizes,
    derived once (framework.config.run_values)."""
    pipe = _build_data(run, batch, dp_rank, dp_size)
    if run.eval_sets and run.eval_every > 0:
        pipe.eval_sets = eval_set_batches(run, batch, load_tokenizer(run.tokenizer), dp_rank, dp_size)
    return pipe


def _build_data(run: DataRun, shape: BatchShape, dp_rank: int, dp_size: int) -> Pipeline:
    tok = load_tokenizer(run.tokenizer)
    if uses_batch_sampler(run.data, tok):
        corpus = load_corpus(run.data, run.vocab_size, shape.seq_len)
        tokens = None if corpus is None else corpus.train
        sampler = BatchSampler(
            tokens,
            run.vocab_size,
            shape.seq_len,
            shape.global_batch_size,
            shape.micro_batch_size,
            dp_rank,
            dp_size,
            run.seed,
        )
        sampler.stamps = [] if corpus is None else corpus.stamps
        val = []
        if run.eval_every > 0:
            val = validation_batches(
                corpus,
                run.vocab_size,
                shape.seq_len,
                shape.global_batch_size,
                shape.micro_batch_size,
                run.eval_batches,
                dp_rank,
                dp_size,
            )
        if corpus is None:
            return Pipeline(sampler, val, "synthetic tokens")
        desc = f"{corpus.description}, {corpus.train.size} train / {corpus.val.size} val tokens"
        return Pipeline(sampler, val, desc)
    built = [_sources(spec, i, tok, run, shape) for i, (spec, _) in enumerate(entries(run.data))]
    weights = [w for _, w in entries(run.data)]
    sampler = StreamSampler(
        [b[0] for b in built],
        weights,
        shape.seq_len,
        shape.global_batch_size,
        shape.micro_batch_size,
        dp_rank,
        dp_size,
        run.seed,
        run.data.prefetch,
    )
    val = (
        stream_validation(built, weights, shape, run.eval_batches, dp_rank, dp_size) if run.eval_every > 0 else []
    )
    if len(built) == 1:
        desc = built[0][2]
    else:
        desc = "mix of " + ", ".join(f"{w:g} x {b[2]}" for b, w in zip(built, weights, strict=True))
    return Pipeline(sampler, val, desc)
def _sources(
    spec: SourceSpec, index: int, tok: Tokenizer, run: DataRun, batch: BatchShape
) -> tuple[WindowSource, WindowSource, str]:
    """(train source, validation source, description) for one entry."""
    data, window, seed = run.data, batch.window, run.seed
    val_path = None if data.mix else data.val_path
    if spec.source in (DataSource.synthetic, DataSource.tokens) or (
        spec.source is DataSource.stdlib and tok.kind is TokenizerKind.bytes
    ):
        one = DataConfig(
            source=spec.source, path=spec.path, val_path=val_path, val_fraction=data.val_fraction
        )
        corpus = load_corpus(one, run.vocab_size, batch.seq_len)
        train = None if corpus is None else corpus.train
        val = None if corpus is None else corpus.val
        desc = "synthetic tokens" if corpus is None else corpus.description
        windows = RandomWindows(train, run.vocab_size, window, seed, index)
        windows.stamps = [] if corpus is None else corpus.stamps
        return (
            windows,
            RandomWindows(val, run.vocab_size, window, VAL_SEED, index),
            desc,
        )
    if spec.source is DataSource.sft:
        return _sft_sources(spec, tok, run, batch.window)
    if spec.source is DataSource.stdlib:
        records = Records(SourceSpec(DataSource.text, None, key=spec.key), files=stdlib_files())
    else:
        records = Records(spec)
    every = 0 if val_path is not None else val_every(data.val_fraction)
    val_records = Records(spec, val_path) if val_path is not None else records
    add_bos, batch, label = run.tokenizer.add_bos, data.encode_batch, f"{spec.key}.path={spec.path!r}"
    train = PackedWindows(records, tok, window, holdout(every, False), add_bos, batch, label)
    val = PackedWindows(
        val_records, tok, window, holdout(every, True) if every else holdout(0, False), add_bos, batch, label
    )
    what = "stdlib source as text" if spec.source is DataSource.stdlib else f"{spec.source.value} {spec.path}"
    return train, val, f"{what} ({tok.kind.value} tokens, packed with EOS)"


def _sft_sources(
    spec: SourceSpec, tok: Tokenizer, run: DataRun, window: int
) -> tuple[WindowSource, WindowSource, str]:
    data = run.data
    fmt, fields = ChatFormat(tok, run.tokenizer.add_bos), Fields.of(data)
    every = 0 if data.val_path is not None else val_every(data.val_fraction)
    files = resolve_files(spec)
    val_files = resolve_files(spec, data.val_path) if data.val_path is not None else files
    label = f"data.path={spec.path!r}"
    pack = data.sft_pack
    train = SFTWindows(files, fields, fmt, window, holdout(every, False), data.encode_batch, label, pack)
    keep_val = holdout(every, True) if every else holdout(0, False)
    val = SFTWindows(val_files, fields, fmt, window, keep_val, data.encode_batch, label, pack)
    rows = "examples packed per row" if pack else "one example per row"
    desc = f"sft {spec.path} ({tok.kind.value} tokens, {fmt.description}, {rows}, loss on responses only)"
    return train, val, desc


def stream_validation(
    built: list[tuple[WindowSource, WindowSource, str]],
    weights: list[float],
    batch: BatchShape,
    eval_batches: int,
    dp_rank: int,
    dp_size: int,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's validation micro batches: ``train.eval_batches`` global batches of fixed windows
    (the same on every layout, as ``validation_batches``), each rank taking its contiguous share."""
    per_batch, share = batch.global_batch_size, batch.global_batch_size // dp_size
    rows = fixed_windows([b[1] for b in built], weights, per_batch * eval_batches, VAL_SEED)
    val = []
    for b in range(eval_batches):
        mine = torch.from_numpy(np.ascontiguousarray(rows[b * per_batch + dp_rank * share :][:share]))
        val += [split_rows(m) for m in mine.split(batch.micro_batch_size)]
    return val


def eval_set_data(run: DataRun, i: int) -> DataConfig:
    """``train.eval_sets[i]`` as a data config: its source and path, the run's other data settings
    (SFT fields, encode batch) and no hold-out or mixture. SFT examples one per row: packed rows
    carry document-start flags that only a model built for packed SFT (the run's data) reads."""
    e = run.eval_sets[i]
    return dataclasses.replace(
        run.data, source=e.source, path=e.path, val_path=None, field=e.field, column=e.column, mix=[],
        sft_pack=False,
    )  # fmt: skip


def eval_set_batches(
    run: DataRun, batch: BatchShape, tok: Tokenizer, dp_rank: int, dp_size: int
) -> dict[str, list]:
    """This rank's batches of each named set: the set's first ``eval_batches * global_batch_size``
    rows, as the validation set (the same tokens on every layout), cut to whole global batches when
    the set is shorter (to a multiple of the dp degree when it is shorter than one); the same number
    on every rank (each rank's forward is a collective under FSDP/TP), ``micro_batch_size`` at a time."""
    out = {}
    for i, e in enumerate(run.eval_sets):
        key = f"train.eval_sets[{i}]"
        rows, _ = eval_rows(eval_set_data(run, i), tok, run.vocab_size, batch.seq_len, run.tokenizer.add_bos,
                            batch.eval_rows, key)  # fmt: skip
        whole = rows.shape[0] // batch.global_batch_size * batch.global_batch_size
        per_rank = (whole or rows.shape[0]) // dp_size
        if per_rank == 0:
            raise ValueError(
                f"{key} ({e.name}) has {rows.shape[0]} windows of train.seq_len+1={batch.window} tokens, "
                f"fewer than the {dp_size} data-parallel ranks; give it more data"
            )
        mine = torch.from_numpy(np.ascontiguousarray(rows[dp_rank * per_rank : (dp_rank + 1) * per_rank]))
        out[e.name] = [
            split_rows(mine[j : j + batch.micro_batch_size])
            for j in range(0, per_rank, batch.micro_batch_size)
        ]
    return out


def entries(data: DataConfig) -> list[tuple[SourceSpec, float]]:
    """The sources of a run with their weights: ``data`` itself, or each ``data.mix`` entry."""
    if not data.mix:
        spec = SourceSpec(
            data.source, data.path, data.field, data.column, data.name, data.split, data.streaming
        )
        return [(spec, 1.0)]
    return [
        (
            SourceSpec(
                e.source, e.path, e.field, e.column, e.name, e.split, e.streaming, key=f"data.mix[{i}]"
            ),
            e.weight,
        )
        for i, e in enumerate(data.mix)
    ]


def val_every(fraction: float) -> int:
    """Hold out every N-th record for validation (N from data.val_fraction; 0 = none)."""
    if fraction <= 0:
        return 0
    return max(2, round(1 / fraction))


def uses_batch_sampler(data: DataConfig, tok: Tokenizer) -> bool:
    """Sources read as one flat token array by random windows (the behaviour before packing)."""
    source = data.source
    return not data.mix and (
        source in (DataSource.tokens, DataSource.synthetic)
        or (source is DataSource.stdlib and tok.kind is TokenizerKind.bytes)
    )


def document_eos(data: DataConfig, tokenizer: TokenizerConfig) -> int | None:
    """The EOS id the model's document mask splits on (None when data.document_mask is off); with
    packed SFT rows (data.sft_pack) ``NO_EOS``: the examples are marked by DOC_START, not split at EOS."""
    sft = document_eos_of_sft(data)
    if sft is not None:
        return sft
    return load_tokenizer(tokenizer).eos_id if data.document_mask else None


def document_eos_of_sft(data: DataConfig) -> int | None:
    """``NO_EOS`` for packed SFT rows (their examples are masked each by itself), else None."""
    return NO_EOS if not data.mix and data.source is DataSource.sft and data.sft_pack else None
