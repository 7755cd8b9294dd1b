"""Validation loss of a trained model: ``python -m framework evaluate RUN_DIR|CHECKPOINT``.

Why a tool and not a training run with zero steps: a run dir already holds all that validation
needs (its resolved ``config.yaml`` and its checkpoints), so this reuses the training code's own
pieces without a process group: the model and weights as ``framework.generate.decode`` loads them, the
validation batches of ``framework.data.pipeline.build_data`` and the loss of ``framework.train.loop.evaluate``.
The batches are those of one data-parallel rank, so for a one-rank run at its last step the figure is
the run's final ``val_loss``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import torch

from framework.config.schema import Config

# The bound framework.launch.rules sets on train.eval_batches, for the same reason: the validation
# batches are built up front (int64 tokens), 2**28 tokens = 2 GiB; 1e8 batches took 12 GB.
MAX_EVAL_TOKENS = 2**28


def check_batches(batches: int | None, cfg: Config) -> None:
    """``--batches``: at least one, and no more than MAX_EVAL_TOKENS of this run's batches."""
    if batches is None:
        return
    per_batch = cfg.train.global_batch_size * (cfg.train.seq_len + 1)
    most = max(1, MAX_EVAL_TOKENS // per_batch)
    if not 1 <= batches <= most:
        raise ValueError(
            f"--batches={batches} is not valid; valid: 1..{most} (the batches are built up front, at "
            f"most {MAX_EVAL_TOKENS} tokens of {per_batch} each)"
        )


def main(argv: list[str] | None = None) -> int:
    from framework.data.pipeline import build_data
    from framework.generate.decode import (
        check_path,
        find_run_config,
        load_model,
        load_run_config,
        parse_device,
        resolve_checkpoint,
    )
    from framework.train.loop import evaluate

    parser = argparse.ArgumentParser(prog="python -m framework evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="a run dir (its newest checkpoint) or a checkpoint dir")
    parser.add_argument("--batches", type=int, default=None, help="validation batches (default: the run's)")
    parser.add_argument(
        "--config", type=Path, default=None, help="the run's config.yaml (default: found above PATH)"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    try:
        device = parse_device(args.device)  # cuda on a CPU torch, or "tpu", was a traceback
        path = check_path(args.path)
        cfg = load_run_config(args.config or find_run_config(path))  # a FIFO hung, a folder raised
        check_batches(args.batches, cfg)
        checkpoint = resolve_checkpoint(path, cfg)
        batches = args.batches or cfg.train.eval_batches
        cfg.train = dataclasses.replace(
            cfg.train, eval_every=max(1, cfg.train.eval_every), eval_batches=batches
        )
        model = load_model(checkpoint, cfg, device)
        val_loss = evaluate(model, build_data(cfg, 0, 1).val_batches, device)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"checkpoint": str(checkpoint), "val_loss": val_loss, "val_ppl": math.exp(val_loss)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
