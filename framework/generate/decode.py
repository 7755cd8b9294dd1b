"""Sample text from a trained model: ``python -m framework.generate RUN_DIR|CHECKPOINT --prompt ...``.

Why a KV cache here rather than in ``framework.model``: training runs whole sequences through one
causal SDPA call, and a cache would put a branch and per-call state into the graphs that freeze,
export and compile see. Decoding instead walks the same modules (the same weights, norms, RoPE and
SwiGLU) step by step, keeping each layer's keys and values. The tests check it against re-running
the full forward for every new token.

The model is rebuilt from the run's resolved ``config.yaml`` and its weights are read from a DCP
checkpoint in one process (DCP reshards whatever layout saved them); the tokenizer is the run's.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from framework.config.schema import Config, to_config
from framework.model import (
    Attention,
    Llama,
    TransformerBlock,
    apply_rope,
    build_model,
    causal_band,
    rope_tables,
)
from framework.models import model_spec


@dataclass
class KVCache:
    """Keys and values per layer, (batch, kv_heads, capacity, head_dim); ``length`` positions filled."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    rope: torch.Tensor
    length: int = 0
    window: int = 0  # the family's sliding window (0: every cached key is seen)

    @classmethod
    def empty(cls, model: Llama, batch: int, capacity: int) -> KVCache:
        cfg = model.cfg
        head_dim = model_spec(cfg).head_dim
        p = model.tok_embeddings.weight
        shape = (batch, cfg.n_kv_heads, capacity, head_dim)
        keys = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in model.layers]
        values = [torch.zeros(shape, dtype=p.dtype, device=p.device) for _ in model.layers]
        # Tables for the whole capacity: a prompt plus its continuation may be longer than training's seq_len.
        rope = rope_tables(head_dim, capacity, cfg.rope_theta, p.device, cfg)
        return cls(keys, values, rope, window=model_spec(cfg).sliding_window)


def _attend(attn: Attention, x: torch.Tensor, cache: KVCache, layer: int) -> torch.Tensor:
    b, s, _ = x.shape
    start, end = cache.length, cache.length + s
    q, k, v = attn.heads(x)
    rope = cache.rope[start:end]
    q, k = apply_rope(q, rope), apply_rope(k, rope)
    cache.keys[layer][:, :, start:end] = k.transpose(1, 2)
    cache.values[layer][:, :, start:end] = v.transpose(1, 2)
    keys, values = cache.keys[layer][:, :, :end], cache.values[layer][:, :, :end]
    # Query i sits at position start + i and sees keys 0..start + i (causal, offset by the cache),
    # the last ``sliding_window`` of them where the family has a window.
    mask = causal_band(s, end, start, cache.window, x.device)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=attn.gqa)
    return attn.wo(out.transpose(1, 2).reshape(b, s, -1))


def _block(block: TransformerBlock, x: torch.Tensor, cache: KVCache, layer: int) -> torch.Tensor:
    h = x + _attend(block.attention, block.attention_norm(x), cache, layer)
    return h + block.feed_forward(block.ffn_norm(h))


@torch.no_grad()
def forward_cached(model: Llama, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits of the last position for ``tokens`` (batch, new) appended after the cached ones."""
    h = model.tok_embeddings(tokens)
    for i, block in enumerate(model.layers.values()):
        h = _block(block, h, cache, i)
    cache.length += tokens.shape[1]
    return model.output(model.norm(h[:, -1]))


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
    model: Llama,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    eos_id: int | None = None,
    seed: int = 0,
) -> list[int]:
    """The tokens generated after ``prompt`` (not including it); stops early at ``eos_id``."""
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token (e.g. --prompt 'def ')")
    device = model.tok_embeddings.weight.device
    cache = KVCache.empty(model, 1, len(prompt) + max_new_tokens)
    generator = torch.Generator(device=device).manual_seed(seed)
    logits = forward_cached(model, torch.tensor([prompt], device=device), cache)
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = sample_next(logits, temperature, top_k, generator)
        out.append(int(nxt.item()))
        if eos_id is not None and out[-1] == eos_id:
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


def parse_device(name: str) -> torch.device:
    """``--device`` as a torch device that exists here (``cuda`` on a CPU-only torch failed deep in
    the weight load)."""
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
    file) is one line naming the file rather than a parser traceback."""
    from omegaconf.errors import OmegaConfBaseException
    from yaml import YAMLError

    if not path.is_file():
        what = (
            "does not exist"
            if not path.exists()
            else "is a folder"
            if path.is_dir()
            else "is not a regular file (a FIFO, a socket or a device)"
        )
        raise ValueError(f"--config={path} {what}; valid: a run's config.yaml")
    try:
        return to_config(OmegaConf.load(path))
    except (YAMLError, OmegaConfBaseException, UnicodeDecodeError, TypeError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--config={path} is not a run's config.yaml ({why})") from None


def check_path(path: Path) -> Path:
    """PATH must be a folder: one that does not exist, or a file, was reported as "no config.yaml in
    PATH or the three folders above it", which sends the user looking for a config."""
    valid = "valid: a run dir (its newest checkpoint) or a checkpoint dir"
    if not path.exists():
        raise ValueError(f"PATH={str(path)!r} does not exist; {valid}")
    if not path.is_dir():
        raise ValueError(f"PATH={str(path)!r} is not a folder; {valid}")
    return path.resolve()


def check_top_k(top_k: int, cfg: Config) -> None:
    """``--top-k`` above the vocabulary sampled from every token silently (as 0 does): say so."""
    if top_k > cfg.model.vocab_size:
        raise ValueError(
            f"--top-k={top_k} is more than the model's {cfg.model.vocab_size} tokens; valid: "
            f"0..{cfg.model.vocab_size} (0 = all tokens)"
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
    from framework.checkpoint.manager import check_step_dir

    if (path / ".metadata").is_file():
        return check_step_dir(path, "PATH")
    root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else path / "checkpoints"
    found = find_latest(root, Channel(None), cfg.checkpoint.integrity) if root.is_dir() else None
    if found is None:
        raise ValueError(
            f"{path} is neither a checkpoint (no .metadata) nor a run dir with a checkpoint under {root}"
        )
    return found


def load_model(checkpoint: Path, cfg: Config, device: torch.device) -> Llama:
    """A plain, unsharded model on ``device`` with the checkpoint's weights (model state only)."""
    from framework.checkpoint.state import from_dcp, load_dcp, to_dcp

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


def main(argv: list[str] | None = None) -> int:
    from framework.data.tokenizer import load_tokenizer

    parser = argparse.ArgumentParser(prog="python -m framework.generate", description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="a run dir (its newest checkpoint) or a checkpoint dir")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0 = all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--config", type=Path, default=None, help="the run's config.yaml (default: found above PATH)"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    try:
        check_flags(args.max_new_tokens, args.temperature, args.top_k)
        device = parse_device(args.device)
        path = check_path(args.path)
        cfg = load_run_config(args.config or find_run_config(path))
        check_top_k(args.top_k, cfg)
        checkpoint = resolve_checkpoint(path, cfg)
        tokenizer = load_tokenizer(cfg.tokenizer)
        model = load_model(checkpoint, cfg, device)
        ids = generate(
            model,
            tokenizer.encode(args.prompt),
            args.max_new_tokens,
            args.temperature,
            args.top_k,
            tokenizer.eos_id,
            args.seed,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"# {checkpoint}", file=sys.stderr)
    print(args.prompt + tokenizer.decode(ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
