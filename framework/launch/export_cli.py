"""``python -m framework export-hf CHECKPOINT OUT``: any framework checkpoint -> a Hugging Face
folder (safetensors, config.json, generation_config.json, tokenizer files).

Its help answers before torch is imported: the exporter is imported once the arguments parsed."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m framework",
        description="Export a framework checkpoint as a Hugging Face folder (safetensors, config.json, "
        "generation_config.json, tokenizer files), or a LoRA run's PEFT adapter folder.",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    exp = sub.add_parser(
        "export-hf",
        help="write a checkpoint's model as a Hugging Face LlamaForCausalLM folder",
        description=parser.description,
    )
    exp.add_argument("checkpoint", type=Path, help="a step_N dir, a checkpoint root or a run dir")
    exp.add_argument("out", type=Path, help="the folder to write")
    exp.add_argument(
        "--config",
        type=Path,
        default=None,
        help="the run's config.yaml (default: two levels above the step dir)",
    )
    exp.add_argument(
        "--force", action="store_true", help="replace the files of an OUT folder export-hf did not write"
    )
    exp.add_argument(
        "--adapter",
        action="store_true",
        help="LoRA runs: write the PEFT adapter folder (adapter_config.json, adapter_model.safetensors) "
        "instead of merged weights",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from framework.launch.export_run import export_adapter_checkpoint, export_checkpoint

    export = export_adapter_checkpoint if args.adapter else export_checkpoint
    try:
        out = export(args.checkpoint, args.out, args.config, args.force)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
