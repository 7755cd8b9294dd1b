"""``python -m framework generate PATH [--prompt TEXT]``: sample text from a run dir (its newest
checkpoint), a checkpoint or a Hugging Face folder (checked as ``model.init_from`` checks it, with its
own tokenizer: framework.launch.source). Why here: composing and checking a config is the launch
layer's, which the decoder's layer (framework.generate.decode) may not import.

Without ``--prompt`` it reads prompts, one per line, until an empty line or the end of input: on a
terminal an interactive loop (as ``litgpt chat``), the model loaded once. The parser is built before
torch is imported, so ``--help`` and a bad flag answer at once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    import torch

    from framework.generate.decode import Loaded

DESCRIPTION = (
    "Sample text from a trained model: a run dir (its newest checkpoint), a checkpoint or a Hugging "
    "Face folder. Without --prompt, read prompts one per line (on a terminal: an interactive loop) "
    "until an empty line or the end of input (Ctrl-D)."
)


def load_any(path: Path, config: Path | None, device: torch.device) -> Loaded:
    """An HF folder through framework.launch.source; a run dir or checkpoint as the decoder loads it."""
    from framework.checkpoint.import_hf import is_hf_checkpoint
    from framework.generate.decode import Loaded, generation_stop_ids, load_run
    from framework.launch.source import load_source

    if config is not None or not is_hf_checkpoint(path):
        return load_run(path, config, device)
    src = load_source(path, [], device, evaluate_data=True)
    own = {src.tokenizer.eos_id} if src.tokenizer.eos_id is not None else set()
    stop = generation_stop_ids(path, src.cfg.model.vocab_size) | own
    return Loaded(src.model, src.tokenizer, stop, src.weights)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m framework generate", description=DESCRIPTION)
    parser.add_argument(
        "path", type=Path, help="a run dir (its newest checkpoint), a checkpoint dir or a Hugging Face folder"
    )
    parser.add_argument(
        "--prompt",
        default=None,
        help="the text to continue (with --chat: the user's message); without it, prompts are read "
        "from standard input, one per line",
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="apply the tokenizer's chat template to the prompt; print the reply",
    )
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = all)")
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the sampling RNG's seed (with --temperature > 0): one seed samples the same text",
    )
    parser.add_argument(
        "--config", type=Path, default=None, help="the run's config.yaml (default: found above PATH)"
    )
    parser.add_argument(
        "--device",
        default=None,
        help="where the model runs: cpu, cuda or cuda:N (default: cuda when a GPU is visible, else cpu)",
    )
    return parser


def prompts(given: str | None, stdin: TextIO) -> Iterator[str]:
    """``--prompt``, or each line of ``stdin`` (asked for on a terminal) until an empty one or EOF."""
    if given is not None:
        yield given
        return
    interactive = stdin.isatty()
    if interactive:
        print("one prompt per line; an empty line or Ctrl-D ends", file=sys.stderr)
    while True:
        if interactive:
            print(">> ", end="", file=sys.stderr, flush=True)
        line = stdin.readline()
        if not line.strip():
            return
        yield line.rstrip("\n")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from framework.generate.decode import (
        check_flags,
        check_path,
        check_top_k,
        encode_prompt,
        generate,
        load_run_config,
        parse_device,
    )

    try:
        check_flags(args.max_new_tokens, args.temperature, args.top_k)
        device = parse_device(args.device)
        if args.config is not None:
            load_run_config(args.config)  # a bad --config is refused before anything is read
        src = load_any(check_path(args.path), args.config, device)
        check_top_k(args.top_k, src.model.cfg.vocab_size)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"# {src.weights}", file=sys.stderr)
    for prompt in prompts(args.prompt, sys.stdin):
        try:
            ids = generate(
                src.model,
                encode_prompt(src.tokenizer, prompt, args.chat),
                args.max_new_tokens,
                args.temperature,
                args.top_k,
                src.stop_ids,
                args.seed,
            )
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            if args.prompt is not None:
                return 2
            continue  # the loop asks for the next prompt
        if ids and ids[-1] in src.stop_ids:
            ids = ids[:-1]  # the end of the reply, not part of it
        text = src.tokenizer.decode(ids)
        print(text if args.chat else prompt + text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
