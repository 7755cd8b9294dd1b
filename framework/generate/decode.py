"""Sample text from a trained model (the command line: framework.launch.generate, ``python -m framework
generate RUN_DIR|CHECKPOINT|HF_DIR [--prompt ...]``).

Decoding walks the model's own modules step by step with a KV cache (``framework.models.KVCache``
and ``forward_cached``: each block's cached step sits beside its ``forward``, in its family's parts,
so a family's decoding is the family's own). The tests check it against re-running the full forward
for every new token.

The model is rebuilt from the run's resolved ``config.yaml`` and its weights are read from a DCP
checkpoint in one process (DCP reshards whatever layout saved them); the tokenizer is the run's. A
Hugging Face folder is loaded by the command line's ``load`` (framework.launch.generate passes
framework.launch.source's, which checks it as ``model.init_from`` does), with its own tokenizer.
Decoding stops at the tokenizer's EOS (and, for an HF folder, at every ``eos_token_id`` of its
``generation_config.json``: chat models end a turn on another token), which is not printed.
``--chat`` renders the prompt as one user message through the tokenizer's chat template
(``add_generation_prompt``) and prints the reply only.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from framework.config.run_values import checkpoint_root
from framework.config.schema import Config, PeftMethod
from framework.data.tokenizer import Tokenizer
from framework.models import Decoder, KVCache, build_model, forward_cached


def sample_next(
    logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator
) -> torch.Tensor:
    """Greedy when ``temperature`` is 0; else softmax sampling over the ``top_k`` best (0 = all)."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: Decoder,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    eos_id: int | Collection[int] | None = None,
    seed: int = 0,
) -> list[int]:
    """The tokens generated after ``prompt`` (not including it); stops early at ``eos_id`` (one id
    or several), which ends the list."""
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token (e.g. --prompt 'def ')")
    device = model.tok_embeddings.weight.device
    cache = KVCache.empty(model, 1, len(prompt) + max_new_tokens)
    generator = torch.Generator(device=device).manual_seed(seed)
    logits = forward_cached(model, torch.tensor([prompt], device=device), cache)
    stop = set() if eos_id is None else {eos_id} if isinstance(eos_id, int) else set(eos_id)
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = sample_next(logits, temperature, top_k, generator)
        out.append(int(nxt.item()))
        if out[-1] in stop:
            break
        logits = forward_cached(model, nxt.view(1, 1), cache)
    return out


# The KV cache holds prompt + new tokens for every layer: 2**17 is a long context's worth; 1e9 tried
# to allocate the cache (and RoPE tables) for a billion positions.
MAX_NEW_TOKENS = 2**17


def check_flags(max_new_tokens: int, temperature: float, top_k: int) -> None:
    """Refuse a flag that would crash or hang later: one line naming it and what is valid."""
    if not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise ValueError(f"--max-new-tokens={max_new_tokens} is not valid; valid: 1..{MAX_NEW_TOKENS}")
    if not (math.isfinite(temperature) and temperature >= 0):  # nan made softmax sample garbage
        raise ValueError(
            f"--temperature={temperature} is not valid; valid: a finite number >= 0 (0 = greedy)"
        )
    if top_k < 0:
        raise ValueError(f"--top-k={top_k} is not valid; valid: an integer >= 0 (0 = all tokens)")


def parse_device(name: str | None) -> torch.device:
    """``--device`` as a torch device that exists here (``cuda`` on a CPU-only torch failed deep in
    the weight load); None (the flag's default): ``cuda`` when a GPU is visible, else ``cpu``."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device={name!r} is not a torch device; valid: cpu or cuda[:N]") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(
                f"--device={name} but this torch {torch.__version__} sees no CUDA GPU; valid here: cpu"
            )
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"--device={name} but this host has {count} CUDA GPU(s); valid: cuda:0..{count - 1}"
            )
    elif device.type != "cpu":
        raise ValueError(f"--device={name} is not supported; valid: cpu or cuda[:N]")
    return device


def load_run_config(path: Path) -> Config:
    """The typed config of a run's ``config.yaml``; anything else (a folder, another YAML, a TOML
    file, /etc/passwd) is one line naming the file, never quoting it (framework.config.run_file)."""
    from framework.config.run_file import read_run_config

    return read_run_config(path, f"--config={path}")


def check_path(path: Path) -> Path:
    """PATH must be a folder: one that does not exist, or a file, was reported as "no config.yaml in
    PATH or the three folders above it", which sends the user looking for a config."""
    valid = "valid: a run dir (its newest checkpoint), a checkpoint dir or a Hugging Face folder"
    if not path.exists():
        raise ValueError(f"PATH={str(path)!r} does not exist; {valid}")
    if not path.is_dir():
        raise ValueError(f"PATH={str(path)!r} is not a folder; {valid}")
    return path.resolve()


def check_top_k(top_k: int, vocab_size: int) -> None:
    """``--top-k`` above the vocabulary sampled from every token silently (as 0 does): say so."""
    if top_k > vocab_size:
        raise ValueError(
            f"--top-k={top_k} is more than the model's {vocab_size} tokens; valid: 0..{vocab_size} (0 = all tokens)"
        )


def find_run_config(path: Path) -> Path:
    """The ``config.yaml`` of the run that wrote ``path`` (a run dir, or a checkpoint inside one)."""
    for d in [path, *path.parents][:4]:
        if (d / "config.yaml").is_file():
            return d / "config.yaml"
    raise ValueError(
        f"no config.yaml in {path} or the three folders above it: pass --config RUN_DIR/config.yaml"
    )


def resolve_checkpoint(path: Path, cfg: Config) -> Path:
    """``path`` itself when it is a checkpoint (has DCP ``.metadata``), else the run's newest verified one."""
    from framework.checkpoint import find_latest
    from framework.checkpoint.group import Channel
    from framework.checkpoint.resolve import check_step_dir

    if (path / ".metadata").is_file():
        return check_step_dir(path, "PATH")
    root = checkpoint_root(cfg.checkpoint, path)  # ``path`` is the run dir here
    found = find_latest(root, Channel(None), cfg.checkpoint.integrity) if root.is_dir() else None
    if found is None:
        raise ValueError(
            f"{path} is neither a checkpoint (no .metadata) nor a run dir with a checkpoint under {root}"
        )
    return found


def load_model(checkpoint: Path, cfg: Config, device: torch.device) -> Decoder:
    """A plain, unsharded model on ``device`` with the checkpoint's weights (model state only); for
    a LoRA run (``peft=lora``), its base with the checkpoint's adapters (``lora_model``)."""
    from framework.checkpoint.state import from_dcp, load_dcp, to_dcp

    if cfg.peft.method is PeftMethod.lora:
        return lora_model(cfg, device, checkpoint).eval()
    model = build_model(cfg.model, cfg.train.seq_len)
    model.to_empty(device=device)
    if cfg.model.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    state = {"model": to_dcp(model, get_model_state_dict(model))}  # a tied weight is stored once
    with warnings.catch_warnings():  # DCP says it assumes one process: that is the intent here
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        load_dcp(state, checkpoint, no_dist=True)
    set_model_state_dict(model, from_dcp(model, state["model"]))
    # Non-persistent buffers are not restored by to_empty: without this, model(tokens) read garbage
    # RoPE tables (decoding was right only because the KV cache builds its own).
    model.rope = model._rope_tables(device)
    return model.eval()


def lora_model(cfg: Config, device: torch.device, adapters: Path, document_eos: int | None = None) -> Decoder:
    """A LoRA run's model, unsharded on ``device``, as the run built it: the base from its
    ``model.init_from`` (or the seeded init of ``train.seed``), adapters attached (their hooks: the
    run's forward, not merged weights), then the adapters of the checkpoint ``adapters``. A LoRA
    checkpoint holds the adapters only (framework.checkpoint.state). ValueError (one line) when the
    base is gone or the checkpoint lacks an adapter."""
    import dataclasses

    from framework.checkpoint.init_from import load, load_adapters
    from framework.models import materialize
    from framework.parallel.lora import after_materialize, apply_lora

    base = cfg.model.init_from
    if base is not None and not Path(base).exists():
        raise ValueError(
            f"the LoRA run's base model.init_from={base!r} does not exist; valid: the base it trained "
            "on, at that path (its checkpoint holds the adapters only)"
        )
    peft = dataclasses.replace(cfg.peft, adapter=None)  # the checkpoint's adapters, not the start's
    model = build_model(cfg.model, cfg.train.seq_len, document_eos)
    apply_lora(model, peft, tp=1, fsdp=False)
    materialize(model, device, cfg.train.seed, load)
    after_materialize(model, peft, cfg.train.seed)
    load_adapters(model, adapters)
    return model


@dataclass
class Loaded:
    """What the command line samples from: the model, its tokenizer, the ids that end a reply and what the
    weights were read from (printed on stderr)."""

    model: Decoder
    tokenizer: Tokenizer
    stop_ids: set[int]
    weights: Path


def load_run(path: Path, config: Path | None, device: torch.device) -> Loaded:
    """A run dir's newest verified checkpoint, or one checkpoint, with the run's tokenizer."""
    from framework.data.tokenizer import load_tokenizer

    cfg = load_run_config(config or find_run_config(path))
    checkpoint = resolve_checkpoint(path, cfg)
    tokenizer = load_tokenizer(cfg.tokenizer)
    stop = {tokenizer.eos_id} if tokenizer.eos_id is not None else set()
    return Loaded(load_model(checkpoint, cfg, device), tokenizer, stop, checkpoint)


def generation_stop_ids(folder: Path, vocab_size: int | None = None) -> set[int]:
    """``eos_token_id`` of an HF folder's generation_config.json (an id or a list; Llama 3's instruct
    models end a turn on <|eot_id|>, not on the tokenizer's EOS); empty when it has none. ValueError
    (one line) for a file that does not parse or an id that is not one of ``vocab_size``'s: such
    values were dropped silently (framework.checkpoint.import_hf.check_eos_ids)."""
    from framework.checkpoint.import_hf import check_eos_ids, read_generation_config

    config = read_generation_config(folder, "PATH", vocab_size)
    return set() if config is None else check_eos_ids(config.get("eos_token_id"), vocab_size, str(folder))


def encode_prompt(tokenizer: Tokenizer, prompt: str, chat: bool) -> list[int]:
    """The prompt's ids; with ``chat``, of the chat template's rendering of it as one user message."""
    if not chat:
        return tokenizer.encode(prompt)
    from framework.data.sft import ChatFormat

    return tokenizer.encode(
        ChatFormat(tokenizer, add_bos=False).prompt([{"role": "user", "content": prompt}])
    )
