"""LoRA adapters (Hu et al. 2021, as the ``peft`` library computes them) on the model's Linear layers.

A targeted Linear keeps its weight (frozen) and gains two child Linears, ``lora_A`` (rank x in) and
``lora_B`` (out x rank), and a forward hook that adds ``scaling * lora_B(lora_A(dropout(x)))`` to
its output, ``scaling = alpha / rank``. Why a hook and children rather than a wrapper module: every
existing parameter keeps its name (``layers.0.attention.wq.weight``), so ``model.init_from``, the
HF export, the seeded init and torchao's float8 swap see the model they know; the adapters add
``...wq.lora_A.weight`` / ``...wq.lora_B.weight`` beside it (peft's names, one level down).

At the start ``lora_B`` is zero (the model is the base model) and ``lora_A`` is drawn from a
per-name generator (peft's kaiming-uniform with a=sqrt(5)), so every layout starts from the same
adapters.
"""

from __future__ import annotations

import fnmatch
import math

import torch
from torch import nn

from framework.config.schema import DType, ModelConfig, PeftConfig, PeftMethod, TrainConfig
from framework.models.parts.weights import WeightLoader

ADAPTER_KEYS = ("lora_A", "lora_B")


class LoRAHook:
    """The forward hook of one targeted Linear: base output + scaling * B(A(dropout(x))).

    With the base held in a lower precision than the input (``peft.base_dtype=bfloat16`` on CPU,
    where nothing autocasts), the pre-hook casts the input to the weight's dtype and the hook
    returns the sum in the input's dtype, so the adapters compute in float32."""

    def __init__(self, scaling: float) -> None:
        self.scaling = scaling

    def pre(self, module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...] | None:
        x = args[0]
        w = module.weight
        if x.dtype != w.dtype and not torch.is_autocast_enabled(x.device.type):
            module._lora_input = x  # type: ignore[assignment]
            return (x.to(w.dtype), *args[1:])
        module._lora_input = None  # type: ignore[assignment]
        return None

    def __call__(self, module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
        x = getattr(module, "_lora_input", None)
        if x is None:
            x = args[0]
        else:
            module._lora_input = None  # type: ignore[assignment]
        # The adapters compute in their own dtype (float32 over a bf16 base and stream); the sum
        # goes back to the dtype the layer's caller passed in.
        delta = module.lora_B(module.lora_A(module.lora_dropout(x.to(module.lora_A.weight.dtype))))
        return (out.to(delta.dtype) + self.scaling * delta).to(x.dtype)


def is_lora_name(name: str) -> bool:
    """A parameter or module name inside an adapter (``...wq.lora_A.weight``)."""
    return any(f".{k}." in f".{name}." for k in ADAPTER_KEYS)


def matches(name: str, pattern: str) -> bool:
    """``pattern`` (fnmatch) against the full module name or its last part."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name.rsplit(".", 1)[-1], pattern)


def linear_names(model: nn.Module) -> dict[str, nn.Linear]:
    """The model's Linear layers (torchao's Float8Linear is one), adapters left out."""
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and not is_lora_name(n)}


def targets(model: nn.Module, cfg: PeftConfig) -> dict[str, nn.Linear]:
    """The Linear layers ``cfg.targets`` names."""
    return {n: m for n, m in linear_names(model).items() if any(matches(n, p) for p in cfg.targets)}


def check(model: nn.Module, cfg: PeftConfig) -> None:
    """ValueError (one line) when a pattern matches no Linear layer, or the rank is not in
    [1, the smallest in/out size of a targeted layer] (a larger rank is no longer low-rank)."""
    if cfg.method is PeftMethod.none:
        return
    every = linear_names(model)
    for p in cfg.targets:
        if not any(matches(n, p) for n in every):
            leaves = sorted({n.rsplit(".", 1)[-1] for n in every})
            raise ValueError(
                f"peft.targets={list(cfg.targets)} is not valid; valid: names or fnmatch patterns of "
                f"Linear layers ({p!r} matches none), e.g. {', '.join(leaves)} or layers.0.attention.wq"
            )
    chosen = targets(model, cfg)
    most = min(min(m.in_features, m.out_features) for m in chosen.values())
    if not 1 <= cfg.rank <= most:
        raise ValueError(
            f"peft.rank={cfg.rank} is not valid; valid: an integer >= 1 and <= {most} "
            "(the smallest in/out size of the targeted layers)"
        )


def attach(model: nn.Module, cfg: PeftConfig) -> list[str]:
    """Freeze every parameter, add adapters to the targeted Linears (on the model's device: meta
    before materialisation) and return their names. A no-op (every weight trains) under
    ``peft.method=none``."""
    if cfg.method is PeftMethod.none:
        return []
    chosen = targets(model, cfg)
    for p in model.parameters():
        p.requires_grad_(False)
    hook = LoRAHook(cfg.alpha / cfg.rank)
    for m in chosen.values():
        device = m.weight.device
        m.lora_A = nn.Linear(m.in_features, cfg.rank, bias=False, device=device)
        m.lora_B = nn.Linear(cfg.rank, m.out_features, bias=False, device=device)
        m.lora_dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        if cfg.base_dtype is not DType.float32:
            # Only a lower-precision base needs the input cast (and so the saved input: an attribute
            # that the fp32 path, compiled with fullgraph, never sets).
            m.register_forward_pre_hook(hook.pre)
        m.register_forward_hook(hook)
    return sorted(chosen)


def describe(model_cfg: ModelConfig, cfg: PeftConfig, seq_len: int) -> str | None:
    """The log line of a LoRA run (None under ``peft.method=none``): rank, alpha, dropout, the
    targeted layers and the trainable parameter count in the words of peft's
    ``print_trainable_parameters`` (counted on a meta model with the adapters attached; a tied
    output head counted once)."""
    if cfg.method is PeftMethod.none:
        return None
    from framework.models import build_model

    model = build_model(model_cfg, seq_len)
    chosen = attach(model, cfg)
    params = list(model.parameters())  # each tensor once (a tied head is the embedding's)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    total = sum(p.numel() for p in params)
    kinds = sorted({n.rsplit(".", 1)[-1] for n in chosen})
    return (
        f"LoRA (peft=lora): rank {cfg.rank}, alpha {cfg.alpha:g}, dropout {cfg.dropout:g}, adapters on "
        f"{len(chosen)} layers ({', '.join(kinds)}), base frozen in {cfg.base_dtype.value}; "
        f"trainable params: {trainable:,} || all params: {total:,} || trainable%: {100 * trainable / total:.4f}"
    )


def base_dtype(cfg: PeftConfig) -> torch.dtype:
    return {DType.float32: torch.float32, DType.bfloat16: torch.bfloat16, DType.float16: torch.float16}[
        cfg.base_dtype
    ]


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """After materialisation: ``lora_B`` zero, ``lora_A`` kaiming-uniform (a=sqrt(5), as
    ``nn.Linear`` and peft draw it) from a generator seeded by (seed, name), the full tensor on
    every rank and then this rank's shard (FSDP's DTensors)."""
    for name, p in model.named_parameters():
        if ".lora_B." in name:
            _fill(p, torch.zeros(p.shape))
        elif ".lora_A." in name:
            bound = 1.0 / math.sqrt(p.shape[1])  # kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(fan_in), ...)
            g = torch.Generator().manual_seed(_seed(seed, name))
            _fill(p, (torch.rand(p.shape, generator=g) * 2 - 1) * bound)


@torch.no_grad()
def cast_base(model: nn.Module, dtype: torch.dtype) -> None:
    """Hold the frozen floating-point weights in ``dtype`` (``peft.base_dtype``); adapters stay float32."""
    if dtype == torch.float32:
        return
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point():
            p.data = p.data.to(dtype)


def _seed(seed: int, name: str) -> int:
    h = seed * 1_000_033
    for ch in name:
        h = (h * 131 + ord(ch)) % (2**61 - 1)
    return h


def _fill(p: torch.Tensor, full: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(p, DTensor):
        local = distribute_tensor(full.to(p.dtype), p.device_mesh, p.placements, src_data_rank=None)
        p.to_local().copy_(local.to_local())
    else:
        p.copy_(full.to(device=p.device, dtype=p.dtype))


def merge(state: dict[str, torch.Tensor], cfg: PeftConfig) -> dict[str, torch.Tensor]:
    """A full state dict with adapters -> the base names only, each targeted weight
    ``W + scaling * B @ A`` (computed in float32, stored in W's dtype): what ``AutoModelForCausalLM``
    loads. A state without adapters is returned as it is."""
    if not any(is_lora_name(k) for k in state):
        return state
    scaling = cfg.alpha / cfg.rank
    out = {k: v for k, v in state.items() if not is_lora_name(k)}
    for k in state:
        if k.endswith(".lora_A.weight"):
            module = k.removesuffix(".lora_A.weight")
            a, b = state[k].float(), state[f"{module}.lora_B.weight"].float()
            w = out[f"{module}.weight"]
            out[f"{module}.weight"] = (w.float() + scaling * (b @ a)).to(w.dtype)
    return out


def with_base(
    adapters: dict[str, torch.Tensor],
    cfg: PeftConfig,
    model_cfg: ModelConfig,
    init_from: str | None,
    train: TrainConfig,
    load_weights: WeightLoader,
) -> dict[str, torch.Tensor]:
    """The full state of a LoRA checkpoint (which holds the adapters only): the base rebuilt on CPU
    as the run built it (``init_from`` read by ``load_weights``, the caller's
    framework.checkpoint.init_from.load; or the seeded init of ``train.seed``), the adapters from the
    checkpoint. ValueError when the checkpoint lacks adapters that ``cfg`` asks for."""
    import dataclasses

    from framework.models import build_model, materialize

    model = build_model(dataclasses.replace(model_cfg, init_from=init_from), train.seq_len)
    attach(model, cfg)
    materialize(model, "cpu", train.seed, load_weights)
    state = dict(model.state_dict())
    missing = sorted(k for k in state if is_lora_name(k) and k not in adapters)
    if missing:
        raise ValueError(f"checkpoint lacks the adapters {missing[:3]} of peft.targets={list(cfg.targets)}")
    return state | {k: v for k, v in adapters.items() if is_lora_name(k)}


ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# The base's shape in a config.json, compared when the adapter names a local base folder.
_BASE_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)


def _pairs_from_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of an HF q/k ``lora_B`` (rotate-half order) back to our interleaved pairs, per head
    (the inverse of framework.checkpoint.export_hf.permute_rope_rows)."""
    return w.reshape(n_heads, 2, -1, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# The dtypes an adapter's weights may have (safetensors' names): floating point only. An integer
# adapter was accepted and cast, silently, into weights that train nothing like the saved ones.
ADAPTER_DTYPES = ("F16", "BF16", "F32", "F64")


def _read_adapter(path: str) -> tuple[dict, dict[str, tuple[int, ...]]]:
    """The folder's ``adapter_config.json`` (an object) and its tensors' shapes, read without
    loading them. ValueError (one line) for a folder that is not a PEFT adapter: a config that is
    not a JSON object (a list, a string: an AttributeError traceback), a weights file safetensors
    cannot read (truncated, a header past its limit: a SafetensorError traceback), integer weights."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    folder = Path(path)
    where = f"peft.adapter={path!r} is not valid; valid: a PEFT adapter folder ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS})"
    if not (folder / ADAPTER_CONFIG).is_file() or not (folder / ADAPTER_WEIGHTS).is_file():
        raise ValueError(where)
    try:
        config = json.loads((folder / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}; its {ADAPTER_CONFIG} is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}; its {ADAPTER_CONFIG} holds a {type(config).__name__}, not an object")
    try:
        with safe_open(str(folder / ADAPTER_WEIGHTS), framework="pt") as f:
            slices = {k: f.get_slice(k) for k in f.keys()}
            shapes = {k: tuple(s.get_shape()) for k, s in slices.items()}
            dtypes = {k: s.get_dtype() for k, s in slices.items()}
    except Exception as e:  # noqa: BLE001 - safetensors' own error type (SafetensorError), any cause
        reason = " ".join(str(e).split()) or type(e).__name__
        raise ValueError(
            f"{where}; its {ADAPTER_WEIGHTS} is not a readable safetensors file ({reason})"
        ) from None
    odd = {k: d for k, d in dtypes.items() if d not in ADAPTER_DTYPES}
    if odd:
        k = sorted(odd)[0]
        raise ValueError(f"{where} of floating-point weights ({', '.join(ADAPTER_DTYPES)}); {k} is {odd[k]}")
    return config, shapes


def _check_finite(path: str, names: list[str], where: str) -> None:
    """ValueError naming the first adapter tensor with a NaN or inf: with one, every step's loss is
    NaN, every step is skipped and the run exited 0 having trained nothing."""
    from pathlib import Path

    from safetensors import safe_open

    with safe_open(str(Path(path) / ADAPTER_WEIGHTS), framework="pt") as f:
        for k in names:
            if not torch.isfinite(f.get_tensor(k)).all():
                raise ValueError(
                    f"{where} finite adapter weights; {k} holds NaN or inf (an adapter saved by a "
                    "diverged run): every step of this run would be skipped"
                )


def _ours(model: nn.Module) -> dict[str, str]:
    """peft's adapter tensor name -> ours, for the adapters the model has."""
    from framework.models import model_spec

    names = model_spec(model.cfg).hf_names()
    out = {}
    for n, _ in model.named_parameters():
        if is_lora_name(n):
            module, kind = n.removesuffix(".weight").rsplit(".", 1)
            hf = names[f"{module}.weight"].removesuffix(".weight")
            out[f"base_model.model.{hf}.{kind}.weight"] = n
    return out


def check_adapter(model: nn.Module, cfg: PeftConfig, init_from: str | None) -> None:
    """ValueError (one line) unless ``cfg.adapter`` is a LoRA adapter of this base (a local base
    folder it names has this shape; every tensor has this model's shape) with this run's rank,
    alpha and layers. ``model``: the meta model with its adapters attached."""
    import json
    from pathlib import Path

    assert cfg.adapter is not None
    config, shapes = _read_adapter(cfg.adapter)
    where = f"peft.adapter={cfg.adapter!r} is not valid; valid:"
    base = config.get("base_model_name_or_path")
    if isinstance(base, str) and base and (Path(base) / "config.json").is_file():
        try:
            theirs = json.loads((Path(base) / "config.json").read_text())
        except (OSError, ValueError):
            theirs = None
        theirs = theirs if isinstance(theirs, dict) else {}  # not a base's config: nothing to compare
        ours = {"hidden_size": model.cfg.dim, "num_hidden_layers": model.cfg.n_layers}
        ours |= {"num_attention_heads": model.cfg.n_heads, "num_key_value_heads": model.cfg.n_kv_heads}
        ours |= {"vocab_size": model.cfg.vocab_size}
        differ = [
            f"{k} {theirs.get(k)} != {ours[k]}" for k in _BASE_FIELDS if theirs.get(k, ours[k]) != ours[k]
        ]
        if differ:
            raise ValueError(
                f"{where} an adapter of this base; it was trained on {base} ({', '.join(differ)}), "
                f"not model.init_from={init_from}"
            )
    if config.get("peft_type") != "LORA" or (config.get("r"), config.get("lora_alpha")) != (
        cfg.rank,
        cfg.alpha,
    ):
        raise ValueError(
            f"{where} a LORA adapter of peft.rank={cfg.rank}, peft.alpha={cfg.alpha:g}; it has "
            f"peft_type={config.get('peft_type')}, r={config.get('r')}, lora_alpha={config.get('lora_alpha')}"
        )
    names = _ours(model)
    params = dict(model.named_parameters())
    if set(shapes) != set(names):
        extra, lacking = sorted(set(shapes) - set(names)), sorted(set(names) - set(shapes))
        differ = [f"it has {len(extra)} adapter tensors they do not select (e.g. {extra[0]})"] if extra else []
        differ += [f"it lacks {len(lacking)} adapter tensors they select (e.g. {lacking[0]})"] if lacking else []
        raise ValueError(
            f"{where} adapters on the layers peft.targets={list(cfg.targets)} selects; {' and '.join(differ)}"
        )
    for k, n in names.items():
        if shapes[k] != tuple(params[n].shape):
            raise ValueError(
                f"{where} an adapter of this base; {k} is {list(shapes[k])}, this model's {list(params[n].shape)}"
            )
    _check_finite(cfg.adapter, sorted(names), where)


@torch.no_grad()
def load_adapter(model: nn.Module, path: str) -> None:
    """Fill the adapters from a PEFT folder that ``check_adapter`` accepted (before launch); each
    rank reads the (small) file and keeps its shard."""
    from pathlib import Path

    from safetensors.torch import load_file

    from framework.models import model_spec

    tensors = load_file(str(Path(path) / ADAPTER_WEIGHTS))
    rope = model_spec(model.cfg).rope_heads()
    params = dict(model.named_parameters())
    for k, n in _ours(model).items():
        v = tensors[k]
        base = n.rsplit(".", 2)[0] + ".weight"
        if ".lora_B." in n and base in rope:
            v = _pairs_from_halves(v, rope[base])
        _fill(params[n], v)
