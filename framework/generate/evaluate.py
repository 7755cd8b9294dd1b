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
from omegaconf import OmegaConf

from framework.config.schema import to_config


def main(argv: list[str] | None = None) -> int:
    from framework.data.pipeline import build_data
    from framework.generate.decode import find_run_config, load_model, resolve_checkpoint
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
        if args.batches is not None and args.batches < 1:
            raise ValueError(f"--batches={args.batches} must be >= 1")
        cfg = to_config(OmegaConf.load(args.config or find_run_config(args.path.resolve())))
        checkpoint = resolve_checkpoint(args.path.resolve(), cfg)
        batches = args.batches or cfg.train.eval_batches
        cfg.train = dataclasses.replace(
            cfg.train, eval_every=max(1, cfg.train.eval_every), eval_batches=batches
        )
        device = torch.device(args.device)
        model = load_model(checkpoint, cfg, device)
        val_loss = evaluate(model, build_data(cfg, 0, 1).val_batches, device)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"checkpoint": str(checkpoint), "val_loss": val_loss, "val_ppl": math.exp(val_loss)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
