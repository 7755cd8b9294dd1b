"""``python -m framework evaluate RUN|CHECKPOINT|HF_DIR [KEY=VALUE | GROUP=OPTION ...]``: the loss,
perplexity and token count of a model on a data set, printed as one JSON line and written as a
JSON report.

Without data overrides on a run dir or checkpoint, the set is the run's own validation batches (for
a one-rank run at its last step: its final ``val_loss``). With ``data=...`` / ``data.*`` overrides,
or on a Hugging Face folder, it is that whole data set, one pass in order
(framework.generate.evaluate). The config is composed and checked as a launch does it
(framework.launch.source); a bad value, data shorter than one window or an HF folder whose
tokenizer and model disagree are one line (exit 2), and nothing is written.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

log = logging.getLogger("framework")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m framework evaluate", description=__doc__.splitlines()[0])
    parser.add_argument(
        "path", type=Path, help="a run dir (its newest checkpoint), a checkpoint dir or an HF folder"
    )
    parser.add_argument(
        "overrides", nargs="*", help="KEY=VALUE or GROUP=OPTION, as for train.py (data=sft ...)"
    )
    parser.add_argument(
        "--batches", type=int, default=None, help="at most this many micro-batches (default: the whole set)"
    )
    parser.add_argument(
        "--report",
        type=Path,
        default=None,
        help="the JSON report (default: RUN_DIR/evaluate.json for a run, ./evaluate_NAME.json otherwise)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_args(argv)


def default_report(path: Path, run_config: Path | None) -> Path:
    if run_config is not None and run_config.parent == path.resolve():
        return path / "evaluate.json"
    return Path.cwd() / f"evaluate_{path.resolve().name}.json"


def main(argv: list[str] | None = None) -> int:
    from framework.generate.decode import check_path, parse_device
    from framework.generate.evaluate import batches_of, check_batches, data_rows, score
    from framework.launch.source import load_source, override_keys

    args = parse(argv)
    try:
        if args.batches is not None and args.batches < 1:
            raise ValueError(f"--batches={args.batches} is not valid; valid: 1 or more")
        device = parse_device(args.device)
        check_path(args.path)
        keys = override_keys(args.overrides)
        whole_set = any(k == "data" or k.startswith("data.") for k in keys)
        from framework.checkpoint.import_hf import is_hf_checkpoint

        whole_set = whole_set or is_hf_checkpoint(args.path.expanduser().resolve())
        src = load_source(args.path, args.overrides, device, evaluate_data=whole_set)
        check_batches(args.batches, src.cfg)  # bounded: the batches are built up front
        if any(k == "mesh" or k.startswith("mesh.") for k in keys) and src.cfg.mesh.world_size > 1:
            log.warning(
                "mesh=%s is checked but not used: evaluate scores in one process (the checkpoint is "
                "read whole, whatever layout saved it)",
                "x".join(map(str, src.cfg.mesh.shape)),
            )
        mbs = src.cfg.train.micro_batch_size
        if whole_set:
            limit = None if args.batches is None else args.batches * mbs
            rows, what = data_rows(src.cfg, src.tokenizer, limit)
            result = score(src.model, batches_of(rows, mbs), device)
        else:
            from framework.data.pipeline import build_data

            src.cfg.train.eval_batches = args.batches or src.cfg.train.eval_batches
            pipe = build_data(src.cfg, 0, 1)
            what = f"the run's validation batches: {pipe.description}"
            result = score(src.model, pipe.val_batches, device)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = {
        "source": str(args.path.expanduser().resolve()),
        "checkpoint": str(src.weights),
        "model": src.cfg.model.name,
        "data": what,
        "seq_len": src.cfg.train.seq_len,
        "loss": result.loss,
        "perplexity": result.perplexity,
        "tokens": result.tokens,
        "windows": result.windows,
        # The names training logs (val_loss / val_ppl), for the same figure.
        "val_loss": result.loss,
        "val_ppl": result.perplexity,
    }
    out = args.report or default_report(args.path, src.run_config)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    print(f"# report: {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
