"""Every data check before launch: ``check_data`` runs in the launcher (framework.launch.prelaunch)
before any rank starts and before the run dir is written: the tokenizer parses and fits
``model.vocab_size``, every file exists and reads (UTF-8, JSON lines with the field, parquet with
the column), token files match their sidecar, the vocab and this run's tokenizer, mixture weights
are valid, and ``data.document_mask`` can work. The ranks then build what these vouched for
(framework.data.pipeline).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from pathlib import Path

from framework.config.run_values import BatchShape, DataRun
from framework.config.schema import (
    AttentionBackend,
    CompileScope,
    DataConfig,
    DataSource,
    ExecutorConfig,
    ExecutorMode,
    ModelConfig,
    TokenizerConfig,
    TokenizerKind,
)
from framework.data.evaluation import eval_rows
from framework.data.pipeline import document_eos_of_sft, entries, eval_set_data, val_every
from framework.data.records import (
    CHECK_ALL_BYTES,
    SourceSpec,
    check_disjoint,
    check_source,
    resolve_files,
)
from framework.data.sampler import load_corpus, token_files
from framework.data.sft import ChatFormat, Fields, check_sft
from framework.data.tokenizer import Tokenizer, check_vocab, eos_fix, load_tokenizer
from framework.data.tokens import tokenizer_digest

log = logging.getLogger("framework")


EVAL_SET_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


def check_data(run: DataRun, batch: BatchShape) -> None:
    """Every data and tokenizer check, once, before launch; raises ValueError with one clear line.
    ``batch``: the run's sequence length and evaluation rows (framework.config.run_values)."""
    d = run.data
    if d.prefetch < 1 or d.encode_batch < 1:
        raise ValueError(
            f"data.prefetch={d.prefetch} and data.encode_batch={d.encode_batch} must both be >= 1"
        )
    if not (0.0 <= d.val_fraction < 1.0):
        raise ValueError(f"data.val_fraction={d.val_fraction} must be in [0, 1)")
    tok = load_tokenizer(run.tokenizer)
    reads_text = any(spec.source is not DataSource.synthetic for spec, _ in entries(run.data))
    check_vocab(tok, run.vocab_size, run.init_from, reads_text)
    if run.tokenizer.add_bos and tok.bos_id is None:
        raise ValueError(
            f"tokenizer.add_bos=true, but tokenizer={tok.kind.value} has no BOS token: {eos_fix(tok, 'bos')}"
        )
    check_mix(run.data)
    for spec, _ in entries(run.data):
        _check_entry(spec, tok, run, batch.seq_len)
    check_document_mask(run, tok)
    check_eval_sets(run, batch, tok)


def _check_entry(spec: SourceSpec, tok: Tokenizer, run: DataRun, seq_len: int) -> None:
    data = run.data
    val_path = None if data.mix else data.val_path
    if spec.source is DataSource.synthetic:
        return
    if spec.source is DataSource.tokens or (
        spec.source is DataSource.stdlib and tok.kind is TokenizerKind.bytes
    ):
        one = DataConfig(
            source=spec.source, path=spec.path, val_path=val_path, val_fraction=data.val_fraction
        )
        load_corpus(one, run.vocab_size, seq_len, scan=True)
        if spec.source is DataSource.tokens:
            assert spec.path is not None  # load_corpus refused a missing one
            paths = token_files(spec, spec.path) + (token_files(spec, val_path) if val_path else [])
            for f in paths:
                check_token_digest(f, tok)
        return
    if spec.source is DataSource.stdlib:
        return  # the standard library's files, tokenized as text by this tokenizer
    if spec.source is DataSource.sft:
        fmt, fields, window = ChatFormat(tok, run.tokenizer.add_bos), Fields.of(data), seq_len + 1
        n = check_sft(resolve_files(spec), fields, fmt, window, CHECK_ALL_BYTES)
        if val_path is not None:
            check_sft(resolve_files(spec, val_path), fields, fmt, window, CHECK_ALL_BYTES)
            check_disjoint(spec, val_path)
    else:
        holds_out = val_path is None and run.eval_every > 0
        n = check_source(spec, at_least=max(1, val_every(data.val_fraction)) if holds_out else 1)
        if val_path is not None:
            check_source(spec, val_path)
            if spec.source is not DataSource.hf:
                check_disjoint(spec, val_path)
    if val_path is None and run.eval_every > 0:
        every = val_every(data.val_fraction)
        if every == 0:
            raise ValueError(
                f"train.eval_every={run.eval_every} needs validation data: set data.val_path, "
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


def check_document_mask(run: DataRun, tok: Tokenizer) -> None:
    """``data.document_mask``: an EOS to split on, data that has documents. (Its kernel under
    ``model.attention=flash|fa4`` is checked against the device: ``check_document_kernel``.)"""
    if not run.data.document_mask:
        return
    if tok.eos_id is None:
        raise ValueError(
            f"data.document_mask=true needs an EOS token between documents; tokenizer={tok.kind.value} has "
            f"none: {eos_fix(tok)}"
        )
    if not run.data.mix and run.data.source is DataSource.sft:
        raise ValueError(
            "data.document_mask=true with data=sft: attention never crosses examples (packed rows mask "
            "each example by itself, data.sft_pack), and an EOS mask would also cut a conversation at "
            "every EOS inside it: leave data.document_mask=false"
        )
    if not run.data.mix and run.data.source is DataSource.synthetic:
        raise ValueError("data.document_mask=true with data=synthetic: random tokens have no documents")


def check_document_kernel(
    data: DataConfig, attention: AttentionBackend, executor: ExecutorConfig, device_type: str
) -> None:
    """Document masks (``data.document_mask``, packed SFT rows) under ``model.attention=flash|fa4``
    run the flash kernel's variable-length form (framework.models.parts.attention), which is CUDA's
    only, and count the documents on the host before each forward, which a whole-model graph cannot
    hold. ``device_type``: where the run's attention runs (the declared hardware's in a dry run);
    ``attention`` and ``executor``: the model's kernel and the executor that would hold its graph."""
    masked = data.document_mask or document_eos_of_sft(data) is not None
    if not masked or attention not in (AttentionBackend.flash, AttentionBackend.fa4):
        return
    what = "data.document_mask=true" if data.document_mask else "data=sft with data.sft_pack=true"
    if device_type != "cuda":
        raise ValueError(
            f"{what} with model.attention={attention.value} on {device_type}: the flash kernel's "
            "variable-length form runs on CUDA only; use model.attention=auto (SDPA with a dense mask "
            "here), efficient or math"
        )
    if executor.mode is not ExecutorMode.eager and executor.scope is CompileScope.model:
        raise ValueError(
            f"{what} with model.attention={attention.value} and executor.scope=model: the flash "
            "kernel's document spans are counted on the host before each forward, which one whole-model "
            "graph cannot hold; use executor.scope=block, or model.attention=auto (FlexAttention)"
        )


def check_eval_sets(run: DataRun, batch: BatchShape, tok: Tokenizer) -> None:
    """Each named set: a unique name usable as a metric key, and data of at least one window
    (read through once here, before launch, as the ranks will read it)."""
    sets = run.eval_sets
    if sets and run.eval_every <= 0:
        raise ValueError(
            f"train.eval_sets has {len(sets)} sets but train.eval_every={run.eval_every}: they are "
            "scored at each evaluation; set train.eval_every>0 or drop train.eval_sets"
        )
    seen: set[str] = set()
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
        eval_rows(eval_set_data(run, i), tok, run.vocab_size, batch.seq_len, run.tokenizer.add_bos,
                  batch.eval_rows, key)  # fmt: skip


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


def follow_tokenizer_vocab(
    model: ModelConfig, tokenizer: TokenizerConfig, set_on_command_line: bool
) -> ModelConfig:
    """``model.vocab_size`` grows to the tokenizer's vocabulary when the user did not set it.

    Why: the default recipe's 256 is the byte tokenizer's; a user who brings a 512-token BPE
    (``tokenizer=hf tokenizer.path=...``) was told to also set ``model.vocab_size>=512``. A value set
    on the command line is the user's: it stays, and one smaller than the tokenizer's vocabulary is
    refused by ``check_data`` (exit 2). Under ``model.init_from`` the size is the checkpoint's. A
    recipe value at least the tokenizer's stays (a recipe may round it up: sft_tiny's 384 holds its
    tokenizer's 379); the rows past the tokenizer's are then never read (a warning says how many).
    Returns the model group, its vocabulary followed. Raises ValueError (one line) for a tokenizer
    that does not load."""
    if set_on_command_line or model.init_from:
        return model
    tok = load_tokenizer(tokenizer)
    if tok.vocab_size <= model.vocab_size:
        return model
    log.info(
        "model.vocab_size=%d: the tokenizer's vocabulary (tokenizer=%s; the recipe had %d; "
        "model.vocab_size=N on the command line sets it)",
        tok.vocab_size,
        tok.kind.value,
        model.vocab_size,
    )
    return dataclasses.replace(model, vocab_size=tok.vocab_size)
