"""``python -m framework generate PATH --prompt ...``: framework.generate.decode's command line, with a
loader that also takes a Hugging Face folder (checked as ``model.init_from`` checks it, its own
tokenizer: framework.launch.source). Why here: composing and checking a config is the launch
layer's, which the decoder's layer may not import."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from framework.generate.decode import Loaded


def load_any(path: Path, config: Path | None, device: torch.device) -> Loaded:
    """An HF folder through framework.launch.source; a run dir or checkpoint as the decoder loads it."""
    from framework.checkpoint.import_hf import is_hf_checkpoint
    from framework.generate.decode import generation_stop_ids, load_run
    from framework.launch.source import load_source

    if config is not None or not is_hf_checkpoint(path):
        return load_run(path, config, device)
    src = load_source(path, [], device, evaluate_data=True)
    own = {src.tokenizer.eos_id} if src.tokenizer.eos_id is not None else set()
    stop = generation_stop_ids(path, src.cfg.model.vocab_size) | own
    return Loaded(src.model, src.tokenizer, stop, src.weights)


def main(argv: list[str] | None = None) -> int:
    from framework.generate.decode import main as decode_main

    return decode_main(argv, load=load_any)


if __name__ == "__main__":
    sys.exit(main())
