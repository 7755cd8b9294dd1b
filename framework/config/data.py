"""The ``tokenizer`` and ``data`` groups' schemas: where training tokens come from (framework.data)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Optional

from framework.config.options import only_with


class TokenizerKind(Enum):
    """``bytes``: one token per byte (vocab 256, nothing to download); ``hf``: a Hugging Face
    ``tokenizer.json`` (the ``tokenizers`` library); ``sentencepiece``: a ``tokenizer.model``."""

    bytes = "bytes"
    hf = "hf"
    sentencepiece = "sentencepiece"


class DataSource(Enum):
    """``stdlib``: the standard library's source, byte-level (default); ``text`` / ``jsonl`` /
    ``parquet``: documents from files, tokenized on the fly and packed with EOS; ``hf``: a
    ``datasets.load_dataset`` dataset; ``tokens``: a token file from ``python -m framework data
    prepare``; ``synthetic``: random tokens (benchmarks); ``sft``: chat / instruction records (jsonl)
    for fine-tuning, one example per row, the loss masked on prompt tokens (framework.data.sft)."""

    stdlib = "stdlib"
    text = "text"
    jsonl = "jsonl"
    parquet = "parquet"
    hf = "hf"
    tokens = "tokens"
    synthetic = "synthetic"
    sft = "sft"


@dataclass
class TokenizerConfig:
    """Text -> token ids (framework.data.tokenizer). Its vocabulary is checked against ``model.vocab_size``."""

    kind: TokenizerKind = TokenizerKind.bytes
    # hf: a tokenizer.json or a folder holding one; sentencepiece: a tokenizer.model file.
    path: Optional[str] = None
    # The BOS / EOS tokens by name (e.g. "<|end_of_text|>"); None = the tokenizer's own (its
    # tokenizer_config.json, the SentencePiece model's ids, or a well-known name). bytes has neither.
    bos_token: Optional[str] = None
    eos_token: Optional[str] = None
    # Put BOS before every document (EOS always follows every document when the tokenizer has one).
    add_bos: bool = False


@dataclass
class MixEntry:
    """One source of a ``data.mix``: the same keys as ``data`` for that source, plus its weight."""

    source: DataSource = DataSource.jsonl
    path: Optional[str] = None
    field: str = "text"
    column: str = "text"
    name: Optional[str] = None
    split: str = "train"
    streaming: bool = False
    # Relative share of the samples (normalised over the mix; > 0).
    weight: float = 1.0


@dataclass
class EvalSet:
    """One named validation set of ``train.eval_sets``: its own data (read with the run's tokenizer
    and seq_len, from its start, in order), scored at every evaluation and logged as ``val_loss/NAME``."""

    name: str = ""
    source: DataSource = DataSource.jsonl
    # A file, a folder or a glob, as data.path (text, jsonl, parquet, tokens, sft).
    path: Optional[str] = None
    field: str = "text"  # jsonl: the key of each line's text
    column: str = "text"  # parquet: the column of the text


@dataclass
class DataConfig:
    """Where training tokens come from (framework.data). Pick a source with ``data=NAME``."""

    # The source kind; data=NAME sets it (data.source=NAME, the spelling before the group, still works).
    source: DataSource = DataSource.stdlib
    # text/jsonl/parquet/tokens: a file, a folder (its files with the source's suffixes) or a glob;
    # hf: a dataset folder, a data file, or a hub name. tokens: a .bin from `framework.data prepare`.
    path: Optional[str] = None
    # A separate validation set (same kind as path); None = hold out val_fraction of the data.
    val_path: Optional[str] = None
    # Fraction held out for validation: the last files (stdlib), the last tokens (tokens), every
    # 1/val_fraction-th record (text, jsonl, parquet, hf).
    val_fraction: float = 0.05
    # jsonl: the key of each line's document text.
    field: str = only_with("data.source", DataSource.jsonl, default="text")
    # parquet and hf: the column of the document text.
    column: str = only_with("data.source", DataSource.parquet, DataSource.hf, default="text")
    # hf: the dataset's configuration name (load_dataset's `name`) and split.
    name: Optional[str] = only_with("data.source", DataSource.hf, default=None)
    split: str = only_with("data.source", DataSource.hf, default="train")
    # hf: stream records (datasets' IterableDataset) instead of building the Arrow cache: for
    # corpora larger than disk or RAM. Resume skips records without tokenizing them.
    streaming: bool = only_with("data.source", DataSource.hf, default=False)
    # Attention stops at document boundaries (EOS) and RoPE positions restart at each document:
    # FlexAttention with a block mask on CUDA (model.attention=auto), the flash kernel's
    # variable-length form over the documents (model.attention=flash|fa4, CUDA; fa4 is the fastest),
    # else SDPA with a dense mask (CPU: FlexAttention has no backward there).
    document_mask: bool = False
    # Several sources with weights; when set, it replaces source/path. The source of each sample is a
    # deterministic function of (train.seed, sample index).
    mix: list[MixEntry] = dataclasses.field(default_factory=list)
    # Global batches tokenized ahead in a background thread (text/jsonl/parquet/hf and mixes).
    prefetch: int = 4
    # Documents encoded per tokenizer call (hf/sentencepiece encode a batch on their own threads).
    encode_batch: int = 256
    # sft: the key of each jsonl line's conversation, a list of {"role", "content"} messages (roles:
    # system, user, assistant); a line without it is read as a prompt/response pair (the next keys).
    messages_field: str = only_with("data.source", DataSource.sft, default="messages")
    # sft: the keys of a prompt/response line (read as one user and one assistant message).
    prompt_field: str = only_with("data.source", DataSource.sft, default="prompt")
    response_field: str = only_with("data.source", DataSource.sft, default="response")
    # sft: pack several whole examples per row (up to train.seq_len), each one attending only to
    # itself with its own RoPE positions (document masking) and the loss still on responses only;
    # false: one example per row, padded.
    sft_pack: bool = only_with("data.source", DataSource.sft, default=True)
