"""From the typed config to a sampler: which sources, which tokenizer, and every check before launch.

``check_data`` runs in the launcher (framework.launch.entry) before any rank starts and before the run dir
is written: the tokenizer parses and fits ``model.vocab_size``, every file exists and reads (UTF-8,
JSON lines with the field, parquet with the column), token files match their sidecar, the vocab and
this run's tokenizer, mixture weights are valid, and ``data.document_mask`` can work. ``build_data``
runs on every rank and builds the sampler the checks vouched for.

The embedded default (``stdlib`` with ``tokenizer=bytes``), ``tokens`` and ``synthetic`` keep the
random-window ``BatchSampler`` (framework.data.sampler), so their batches are those of before;
document sources and mixtures go through the packing ``StreamSampler`` (framework.data.stream).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from framework.config.run_values import BatchShape, batch_shape
from framework.config.schema import (
    AttentionBackend,
    CompileScope,
    Config,
    DataConfig,
    DataSource,
    ExecutorMode,
    TokenizerKind,
)
from framework.data.evaluation import eval_rows
from framework.data.records import (
    CHECK_ALL_BYTES,
    Records,
    SourceSpec,
    check_disjoint,
    check_source,
    resolve_files,
)
from framework.data.sampler import BatchSampler, load_corpus, stdlib_files, token_files, validation_batches
from framework.data.sft import ChatFormat, Fields, SFTWindows, check_sft, split_rows
from framework.data.stream import (
    PackedWindows,
    RandomWindows,
    StreamSampler,
    WindowSource,
    fixed_windows,
    holdout,
)
from framework.data.tokenizer import Tokenizer, check_vocab, eos_fix, load_tokenizer
from framework.data.tokens import tokenizer_digest
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


EVAL_SET_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


def eval_set_data(cfg: Config, i: int) -> DataConfig:
    """``train.eval_sets[i]`` as a data config: its source and path, the run's other data settings
    (SFT fields, encode batch) and no hold-out or mixture. SFT examples one per row: packed rows
    carry document-start flags that only a model built for packed SFT (the run's data) reads."""
    e = cfg.train.eval_sets[i]
    return dataclasses.replace(
        cfg.data, source=e.source, path=e.path, val_path=None, field=e.field, column=e.column, mix=[],
        sft_pack=False,
    )  # fmt: skip


def check_eval_sets(cfg: Config, tok: Tokenizer) -> None:
    """Each named set: a unique name usable as a metric key, and data of at least one window
    (read through once here, before launch, as the ranks will read it)."""
    sets = cfg.train.eval_sets
    if sets and cfg.train.eval_every <= 0:
        raise ValueError(
            f"train.eval_sets has {len(sets)} sets but train.eval_every={cfg.train.eval_every}: they are "
            "scored at each evaluation; set train.eval_every>0 or drop train.eval_sets"
        )
    seen: set[str] = set()
    shape = batch_shape(cfg.train)
    for i, e in enumerate(sets):
        key = f"train.eval_sets[{i}]"
        if not EVAL_SET_NAME.fullmatch(e.name or "") or e.name in seen:
            raise ValueError(
                f"{key}.name={e.name!r}: valid: a unique non-empty name of letters, digits, '_', '.' or '-' "
                f"(logged as val_loss/NAME); taken: {sorted(seen)}"
            )
        seen.add(e.name)
        if not e.path:
            raise ValueError(f"{key}.path is unset; valid: a file, folder or glob of {e.source.value} data")
        eval_rows(eval_set_data(cfg, i), tok, cfg.model.vocab_size, shape.seq_len, cfg.tokenizer.add_bos,
                  shape.eval_rows, key)  # fmt: skip


def eval_set_batches(
    cfg: Config, batch: BatchShape, tok: Tokenizer, dp_rank: int, dp_size: int
) -> dict[str, list]:
    """This rank's batches of each named set: the set's first ``eval_batches * global_batch_size``
    rows, as the validation set (the same tokens on every layout), cut to whole global batches when
    the set is shorter (to a multiple of the dp degree when it is shorter than one); the same number
    on every rank (each rank's forward is a collective under FSDP/TP), ``micro_batch_size`` at a time."""
    out = {}
    for i, e in enumerate(cfg.train.eval_sets):
        key = f"train.eval_sets[{i}]"
        rows, _ = eval_rows(eval_set_data(cfg, i), tok, cfg.model.vocab_size, batch.seq_len, cfg.tokenizer.add_bos,
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


def check_mix(data: DataConfig) -> None:
    if not data.mix:
        return
    for i, e in enumerate(data.mix):
        if not math.isfinite(e.weight) or e.weight < 0:
            raise ValueError(f"data.mix[{i}].weight={e.weight}: a weight must be a finite number >= 0")
    for i, e in enumerate(data.mix):
        if e.source is DataSource.sft:
            raise ValueError(
                f"data.mix[{i}].source=sft: SFT examples cannot be mixed yet; use data=sft on its own"
            )
    total = sum(e.weight for e in data.mix)
    if total <= 0:
        raise ValueError(
            f"data.mix weights sum to {total} ({[e.weight for e in data.mix]}): at least one weight must be > 0"
        )
    if data.path is not None or data.val_path is not None:
        raise ValueError(
            "data.mix replaces data.path / data.val_path: set each source's path inside data.mix"
        )


def val_every(fraction: float) -> int:
    """Hold out every N-th record for validation (N from data.val_fraction; 0 = none)."""
    if fraction <= 0:
        return 0
    return max(2, round(1 / fraction))


def uses_batch_sampler(cfg: Config, tok: Tokenizer) -> bool:
    """Sources read as one flat token array by random windows (the behaviour before packing)."""
    source = cfg.data.source
    return not cfg.data.mix and (
        source in (DataSource.tokens, DataSource.synthetic)
        or (source is DataSource.stdlib and tok.kind is TokenizerKind.bytes)
    )


def follow_tokenizer_vocab(cfg: Config, set_on_command_line: bool) -> Config:
    """``model.vocab_size`` grows to the tokenizer's vocabulary when the user did not set it.

    Why: the default recipe's 256 is the byte tokenizer's; a user who brings a 512-token BPE
    (``tokenizer=hf tokenizer.path=...``) was told to also set ``model.vocab_size>=512``. A value set
    on the command line is the user's: it stays, and one smaller than the tokenizer's vocabulary is
    refused by ``check_data`` (exit 2). Under ``model.init_from`` the size is the checkpoint's. A
    recipe value at least the tokenizer's stays (a recipe may round it up: sft_tiny's 384 holds its
    tokenizer's 379); the rows past the tokenizer's are then never read (a warning says how many).
    Raises ValueError (one line) for a tokenizer that does not load."""
    if set_on_command_line or cfg.model.init_from:
        return cfg
    tok = load_tokenizer(cfg.tokenizer)
    if tok.vocab_size <= cfg.model.vocab_size:
        return cfg
    log.info(
        "model.vocab_size=%d: the tokenizer's vocabulary (tokenizer=%s; the recipe had %d; "
        "model.vocab_size=N on the command line sets it)",
        tok.vocab_size,
        tok.kind.value,
        cfg.model.vocab_size,
    )
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=tok.vocab_size))


def check_data(cfg: Config) -> None:
    """Every data and tokenizer check, once, before launch; raises ValueError with one clear line."""
    d = cfg.data
    if d.prefetch < 1 or d.encode_batch < 1:
        raise ValueError(
            f"data.prefetch={d.prefetch} and data.encode_batch={d.encode_batch} must both be >= 1"
        )
    if not (0.0 <= d.val_fraction < 1.0):
        raise ValueError(f"data.val_fraction={d.val_fraction} must be in [0, 1)")
    tok = load_tokenizer(cfg.tokenizer)
    reads_text = any(spec.source is not DataSource.synthetic for spec, _ in entries(cfg.data))
    check_vocab(tok, cfg.model.vocab_size, cfg.model.init_from, reads_text)
    if cfg.tokenizer.add_bos and tok.bos_id is None:
        raise ValueError(
            f"tokenizer.add_bos=true, but tokenizer={tok.kind.value} has no BOS token: {eos_fix(tok, 'bos')}"
        )
    check_mix(cfg.data)
    for spec, _ in entries(cfg.data):
        _check_entry(spec, tok, cfg)
    check_document_mask(cfg, tok)
    check_eval_sets(cfg, tok)


def _check_entry(spec: SourceSpec, tok: Tokenizer, cfg: Config) -> None:
    data, seq_len = cfg.data, cfg.train.seq_len
    val_path = None if data.mix else data.val_path
    if spec.source is DataSource.synthetic:
        return
    if spec.source is DataSource.tokens or (
        spec.source is DataSource.stdlib and tok.kind is TokenizerKind.bytes
    ):
        one = DataConfig(
            source=spec.source, path=spec.path, val_path=val_path, val_fraction=data.val_fraction
        )
        load_corpus(one, cfg.model.vocab_size, seq_len, scan=True)
        if spec.source is DataSource.tokens:
            assert spec.path is not None  # load_corpus refused a missing one
            paths = token_files(spec, spec.path) + (token_files(spec, val_path) if val_path else [])
            for f in paths:
                check_token_digest(f, tok)
        return
    if spec.source is DataSource.stdlib:
        return  # the standard library's files, tokenized as text by this tokenizer
    if spec.source is DataSource.sft:
        fmt, fields, window = ChatFormat(tok, cfg.tokenizer.add_bos), Fields.of(data), seq_len + 1
        n = check_sft(resolve_files(spec), fields, fmt, window, CHECK_ALL_BYTES)
        if val_path is not None:
            check_sft(resolve_files(spec, val_path), fields, fmt, window, CHECK_ALL_BYTES)
            check_disjoint(spec, val_path)
    else:
        holds_out = val_path is None and cfg.train.eval_every > 0
        n = check_source(spec, at_least=max(1, val_every(data.val_fraction)) if holds_out else 1)
        if val_path is not None:
            check_source(spec, val_path)
            if spec.source is not DataSource.hf:
                check_disjoint(spec, val_path)
    if val_path is None and cfg.train.eval_every > 0:
        every = val_every(data.val_fraction)
        if every == 0:
            raise ValueError(
                f"train.eval_every={cfg.train.eval_every} needs validation data: set data.val_path, "
                "data.val_fraction>0, or train.eval_every=0"
            )
        if n is not None and n < every:
            raise ValueError(
                f"{spec.key}.path={spec.path!r} has {n} records: too few to hold out every {every}-th "
                f"for validation (data.val_fraction={data.val_fraction}); set data.val_path, a larger "
                "data.val_fraction, or train.eval_every=0"
            )


def check_token_digest(path: Path, tok: Tokenizer) -> None:
    made_with = tokenizer_digest(path)
    if made_with is None:
        raise ValueError(
            f"{path}: its sidecar does not record the tokenizer that wrote it; re-run "
            "`python -m framework data prepare` with this run's tokenizer"
        )
    if made_with != tok.digest():
        raise ValueError(
            f"{path} was made with another tokenizer (digest {made_with[:16]}) than this run's "
            f"tokenizer={tok.kind.value} (digest {tok.digest()[:16]}): use the tokenizer that prepared it, "
            "or prepare the data again with this one"
        )


def check_document_mask(cfg: Config, tok: Tokenizer) -> None:
    """``data.document_mask``: an EOS to split on, data that has documents. (Its kernel under
    ``model.attention=flash|fa4`` is checked against the device: ``check_document_kernel``.)"""
    if not cfg.data.document_mask:
        return
    if tok.eos_id is None:
        raise ValueError(
            f"data.document_mask=true needs an EOS token between documents; tokenizer={tok.kind.value} has "
            f"none: {eos_fix(tok)}"
        )
    if not cfg.data.mix and cfg.data.source is DataSource.sft:
        raise ValueError(
            "data.document_mask=true with data=sft: attention never crosses examples (packed rows mask "
            "each example by itself, data.sft_pack), and an EOS mask would also cut a conversation at "
            "every EOS inside it: leave data.document_mask=false"
        )
    if not cfg.data.mix and cfg.data.source is DataSource.synthetic:
        raise ValueError("data.document_mask=true with data=synthetic: random tokens have no documents")


def check_document_kernel(cfg: Config, device_type: str) -> None:
    """Document masks (``data.document_mask``, packed SFT rows) under ``model.attention=flash|fa4``
    run the flash kernel's variable-length form (framework.models.parts.attention), which is CUDA's
    only, and count the documents on the host before each forward, which a whole-model graph cannot
    hold. ``device_type``: where the run's attention runs (the declared hardware's in a dry run)."""
    attention = cfg.model.attention
    masked = cfg.data.document_mask or document_eos_of_sft(cfg) is not None
    if not masked or attention not in (AttentionBackend.flash, AttentionBackend.fa4):
        return
    what = "data.document_mask=true" if cfg.data.document_mask else "data=sft with data.sft_pack=true"
    if device_type != "cuda":
        raise ValueError(
            f"{what} with model.attention={attention.value} on {device_type}: the flash kernel's "
            "variable-length form runs on CUDA only; use model.attention=auto (SDPA with a dense mask "
            "here), efficient or math"
        )
    if cfg.executor.mode is not ExecutorMode.eager and cfg.executor.scope is CompileScope.model:
        raise ValueError(
            f"{what} with model.attention={attention.value} and executor.scope=model: the flash "
            "kernel's document spans are counted on the host before each forward, which one whole-model "
            "graph cannot hold; use executor.scope=block, or model.attention=auto (FlexAttention)"
        )


def document_eos(cfg: Config) -> int | None:
    """The EOS id the model's document mask splits on (None when data.document_mask is off); with
    packed SFT rows (data.sft_pack) ``NO_EOS``: the examples are marked by DOC_START, not split at EOS."""
    sft = document_eos_of_sft(cfg)
    if sft is not None:
        return sft
    return load_tokenizer(cfg.tokenizer).eos_id if cfg.data.document_mask else None


def document_eos_of_sft(cfg: Config) -> int | None:
    """``NO_EOS`` for packed SFT rows (their examples are masked each by itself), else None."""
    return NO_EOS if not cfg.data.mix and cfg.data.source is DataSource.sft and cfg.data.sft_pack else None


def _sources(
    spec: SourceSpec, index: int, tok: Tokenizer, cfg: Config, batch: BatchShape
) -> tuple[WindowSource, WindowSource, str]:
    """(train source, validation source, description) for one entry."""
    data, window, seed = cfg.data, batch.window, cfg.train.seed
    val_path = None if data.mix else data.val_path
    if spec.source in (DataSource.synthetic, DataSource.tokens) or (
        spec.source is DataSource.stdlib and tok.kind is TokenizerKind.bytes
    ):
        one = DataConfig(
            source=spec.source, path=spec.path, val_path=val_path, val_fraction=data.val_fraction
        )
        corpus = load_corpus(one, cfg.model.vocab_size, batch.seq_len)
        train = None if corpus is None else corpus.train
        val = None if corpus is None else corpus.val
        desc = "synthetic tokens" if corpus is None else corpus.description
        windows = RandomWindows(train, cfg.model.vocab_size, window, seed, index)
        windows.stamps = [] if corpus is None else corpus.stamps
        return (
            windows,
            RandomWindows(val, cfg.model.vocab_size, window, VAL_SEED, index),
            desc,
        )
    if spec.source is DataSource.sft:
        return _sft_sources(spec, tok, cfg, batch.window)
    if spec.source is DataSource.stdlib:
        records = Records(SourceSpec(DataSource.text, None, key=spec.key), files=stdlib_files())
    else:
        records = Records(spec)
    every = 0 if val_path is not None else val_every(data.val_fraction)
    val_records = Records(spec, val_path) if val_path is not None else records
    add_bos, batch, label = cfg.tokenizer.add_bos, data.encode_batch, f"{spec.key}.path={spec.path!r}"
    train = PackedWindows(records, tok, window, holdout(every, False), add_bos, batch, label)
    val = PackedWindows(
        val_records, tok, window, holdout(every, True) if every else holdout(0, False), add_bos, batch, label
    )
    what = "stdlib source as text" if spec.source is DataSource.stdlib else f"{spec.source.value} {spec.path}"
    return train, val, f"{what} ({tok.kind.value} tokens, packed with EOS)"


def _sft_sources(
    spec: SourceSpec, tok: Tokenizer, cfg: Config, window: int
) -> tuple[WindowSource, WindowSource, str]:
    data = cfg.data
    fmt, fields = ChatFormat(tok, cfg.tokenizer.add_bos), Fields.of(data)
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


def build_data(cfg: Config, batch: BatchShape, dp_rank: int, dp_size: int) -> Pipeline:
    """The sampler, this rank's fixed validation batches and those of each ``train.eval_sets`` set
    (checked before launch by check_data). ``batch``: the run's sequence length and batch sizes,
    derived once (framework.config.run_values)."""
    pipe = _build_data(cfg, batch, dp_rank, dp_size)
    if cfg.train.eval_sets and cfg.train.eval_every > 0:
        pipe.eval_sets = eval_set_batches(cfg, batch, load_tokenizer(cfg.tokenizer), dp_rank, dp_size)
    return pipe


def _build_data(cfg: Config, shape: BatchShape, dp_rank: int, dp_size: int) -> Pipeline:
    tok = load_tokenizer(cfg.tokenizer)
    t = cfg.train
    if uses_batch_sampler(cfg, tok):
        corpus = load_corpus(cfg.data, cfg.model.vocab_size, shape.seq_len)
        tokens = None if corpus is None else corpus.train
        sampler = BatchSampler(
            tokens,
            cfg.model.vocab_size,
            shape.seq_len,
            shape.global_batch_size,
            shape.micro_batch_size,
            dp_rank,
            dp_size,
            t.seed,
        )
        sampler.stamps = [] if corpus is None else corpus.stamps
        val = []
        if t.eval_every > 0:
            val = validation_batches(
                corpus,
                cfg.model.vocab_size,
                shape.seq_len,
                shape.global_batch_size,
                shape.micro_batch_size,
                t.eval_batches,
                dp_rank,
                dp_size,
            )
        if corpus is None:
            return Pipeline(sampler, val, "synthetic tokens")
        desc = f"{corpus.description}, {corpus.train.size} train / {corpus.val.size} val tokens"
        return Pipeline(sampler, val, desc)
    built = [_sources(spec, i, tok, cfg, shape) for i, (spec, _) in enumerate(entries(cfg.data))]
    weights = [w for _, w in entries(cfg.data)]
    sampler = StreamSampler(
        [b[0] for b in built],
        weights,
        shape.seq_len,
        shape.global_batch_size,
        shape.micro_batch_size,
        dp_rank,
        dp_size,
        t.seed,
        cfg.data.prefetch,
    )
    val = (
        stream_validation(built, weights, shape, t.eval_batches, dp_rank, dp_size) if t.eval_every > 0 else []
    )
    if len(built) == 1:
        desc = built[0][2]
    else:
        desc = "mix of " + ", ".join(f"{w:g} x {b[2]}" for b, w in zip(built, weights, strict=True))
    return Pipeline(sampler, val, desc)
