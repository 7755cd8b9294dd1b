"""``python -m framework data``: ``prepare`` (text -> token file) and ``tokenizer train`` (a BPE).

Its help answers before torch is imported: the tools are imported once the arguments parsed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from framework.config.schema import DataSource, TokenizerConfig, TokenizerKind
from framework.record.outputs import check_output_file

# Token ids are stored as uint16/uint32, as model.vocab_size's rule says (framework.config.rules.model); 1e22
# overflowed inside the tokenizers trainer (a traceback).
MAX_VOCAB = 2**32


def vocab_size(text: str) -> int:
    """``--vocab-size``: an integer (``1e5`` is accepted when it is one) in 1..MAX_VOCAB."""
    try:
        value = float(text) if any(c in text for c in ".eE") else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if isinstance(value, float) and not (
        value == value and abs(value) != float("inf") and value.is_integer()
    ):
        raise argparse.ArgumentTypeError(f"{text} is not an integer")
    if not 1 <= value <= MAX_VOCAB:
        raise argparse.ArgumentTypeError(f"{text} is out of range; valid: 1..{MAX_VOCAB} (uint32 token ids)")
    return int(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m framework data",
        description="Prepare token files (text, jsonl or parquet -> OUT.bin) and train a byte-level BPE tokenizer.",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser(
        "prepare", help="tokenize text / jsonl / parquet files into OUT.bin (+ OUT.json sidecar)"
    )
    p.add_argument("out", type=Path)
    p.add_argument("inputs", nargs="+", help="files, folders or globs (.txt/.md: one document per file)")
    p.add_argument("--tokenizer", default="bytes", choices=[k.value for k in TokenizerKind])
    p.add_argument("--tokenizer-path", default=None, help="tokenizer.json / tokenizer.model, or a folder")
    p.add_argument("--source", default=None, choices=["text", "jsonl", "parquet"], help="default: by suffix")
    p.add_argument("--field", default="text", help="jsonl: the key of the document text")
    p.add_argument("--column", default="text", help="parquet: the column of the document text")
    p.add_argument("--workers", type=int, default=0, help="encoding processes (0 = one per core, at most 8)")
    p.add_argument("--add-bos", action="store_true", help="put BOS before every document")
    p.add_argument("--force", action="store_true", help="replace an OUT / OUT.json prepare did not write")
    t = sub.add_parser("tokenizer", help="tokenizer tools")
    tsub = t.add_subparsers(dest="tcmd", required=True)
    tr = tsub.add_parser("train", help="train a byte-level BPE (tokenizers) on files; writes OUT.json")
    tr.add_argument("out", type=Path)
    tr.add_argument("inputs", nargs="+", help="files, folders or globs (.txt/.md, .jsonl, .parquet)")
    tr.add_argument("--vocab-size", type=vocab_size, required=True)
    tr.add_argument("--field", default="text")
    tr.add_argument("--column", default="text")
    tr.add_argument("--force", action="store_true", help="replace an OUT that is not a trained tokenizer")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "prepare":
            from framework.data.prepare import check_workers

            check_workers(args.workers)  # before anything is read or written
        check_output_file("OUT", args.out)
        if args.cmd == "prepare":
            return _prepare(args)
        return _train(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _prepare(args: argparse.Namespace) -> int:
    from framework.data.prepare import prepare

    tok = TokenizerConfig(kind=TokenizerKind(args.tokenizer), path=args.tokenizer_path)
    source = DataSource(args.source) if args.source else None
    n = prepare(
        args.out,
        args.inputs,
        tok,
        source,
        args.field,
        args.column,
        args.workers,
        args.add_bos,
        force=args.force,
    )
    print(f"wrote {n} tokens to {args.out} (sidecar {args.out.with_suffix('.json')})")
    return 0


def _train(args: argparse.Namespace) -> int:
    from framework.data.prepare import check_outputs, input_files, records_of, refuse_foreign
    from framework.data.tokenizer import is_trained_bpe, train_bpe

    files = input_files(args.inputs, None)
    check_outputs([args.out], files)
    if args.out.exists() and not is_trained_bpe(args.out):
        refuse_foreign(args.out, "not a tokenizer `tokenizer train` wrote", args.force)
    texts = (text for text, _, _ in records_of(files, args.field, args.column))
    tok = train_bpe(args.out, texts, args.vocab_size)
    print(
        f"wrote {args.out}: a byte-level BPE of {tok.vocab_size} tokens (BOS {tok.bos_token}, EOS {tok.eos_token}); "
        f"use it with tokenizer=hf tokenizer.path={args.out}"
    )
    return 0
