"""Training data: token sources, packing, mixtures and a resumable, rank-independent sampler.

Modules, one concern each:
- ``records``: documents from text / jsonl / parquet files and ``datasets`` as ordered records;
- ``tokens``: token files (``.bin`` + JSON sidecar with the tokenizer's digest);
- ``sampler``: random windows over a flat token array (stdlib, tokens, synthetic), as before packing;
- ``stream``: on-the-fly tokenization, packing with EOS, mixtures, background prefetch;
- ``sft``: chat / instruction records packed whole per row (each its own document), the loss
  masked on prompt tokens;
- ``pipeline``: the data side's view of a run (``DataRun``) -> sampler, on every rank;
- ``checks``: every data check that runs before launch;
- ``prepare``: ``python -m framework data prepare`` (its command line: framework.launch.data_cli).

The invariant every source keeps: a sample is a function of (seed, global batch index, position in
the global batch) and the small replicated data state, never of the rank or the number of ranks, so
a checkpoint resumes on any number of data-parallel ranks with no sample skipped or repeated.
"""

from framework.data.checks import check_data, check_document_kernel, follow_tokenizer_vocab
from framework.data.pipeline import Pipeline, build_data, document_eos
from framework.data.prepare import prepare
from framework.data.sampler import (
    BatchSampler,
    Corpus,
    load_corpus,
    load_stdlib,
    stdlib_files,
    validation_batches,
)
from framework.data.stream import StreamSampler
from framework.data.tokens import TOKEN_DTYPES, open_tokens, write_tokens

__all__ = [
    "TOKEN_DTYPES",
    "BatchSampler",
    "Corpus",
    "Pipeline",
    "StreamSampler",
    "build_data",
    "check_data",
    "check_document_kernel",
    "follow_tokenizer_vocab",
    "document_eos",
    "load_corpus",
    "load_stdlib",
    "open_tokens",
    "prepare",
    "stdlib_files",
    "validation_batches",
    "write_tokens",
]
