"""The ``tokenizer`` and ``data`` groups' rules; the files themselves are read by framework.data before launch."""

from __future__ import annotations

import math

from framework.config.rules.rule import (
    MAX_PREFETCH,
    TYPED,
    Rule,
    integer,
    name,
    number,
    optional_name,
    optional_path,
)
from framework.config.schema import MixEntry

DATA_RULES: dict[str, Rule] = {
    "tokenizer.kind": TYPED,
    "tokenizer.path": optional_path("framework.data.tokenizer reads the file"),
    "tokenizer.bos_token": optional_name("unset (null: the tokenizer's own) or a token of its vocabulary"),
    "tokenizer.eos_token": optional_name("unset (null: the tokenizer's own) or a token of its vocabulary"),
    "tokenizer.add_bos": TYPED,
    "data.source": TYPED,
    "data.path": optional_path("framework.data.checks.check_data reads the files"),
    "data.val_path": optional_path("framework.data.checks.check_data reads the files"),
    "data.val_fraction": number(0, 1, lo_open=True, hi_open=True, bad=(0.0, 1.0, 1.5, math.nan)),
    "data.field": name("a non-empty key of each jsonl line"),
    "data.column": name("a non-empty column name"),
    "data.name": optional_name("unset (null) or a dataset configuration name"),
    "data.split": name("a split name (train, validation, ...)"),
    "data.streaming": TYPED,
    "data.sft_pack": TYPED,  # data=sft only; packing marks examples itself (framework.data.sft)
    "data.document_mask": TYPED,  # needs an EOS and a masking kernel: framework.data.pipeline
    # There the error names the entry (data.mix[1].weight=-1.0), not the list's dataclass repr.
    "data.mix": Rule(
        "[] (no mix) or entries {source, path, weight, ...} whose weights are finite numbers >= 0 "
        "summing to > 0",
        checked_by="framework.data.checks.check_mix",
        bad=([MixEntry(path="a.jsonl", weight=-1.0)], [MixEntry(path="a.jsonl", weight=0.0)]),
    ),
    "data.prefetch": integer(1, MAX_PREFETCH, what="global batches held ahead in memory"),
    "data.encode_batch": integer(1, 2**20),
    "data.messages_field": name("a non-empty key of each jsonl line"),
    "data.prompt_field": name("a non-empty key of each jsonl line"),
    "data.response_field": name("a non-empty key of each jsonl line"),
}
