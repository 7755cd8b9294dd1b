"""``model.init_from``: start training from existing weights instead of a random init.

Two kinds of source, told apart by their files:

* a Hugging Face Llama or Qwen3 folder (``config.json`` + safetensors, sharded with
  ``model.safetensors.index.json`` or not), read by ``framework.checkpoint.import_hf``;
* a framework checkpoint: a DCP ``step_N`` directory of another run, its checkpoint root, or that
  run's dir (then its newest complete checkpoint). Only the model is read: the optimizer, schedule,
  data position and step start afresh (fine-tuning, not resuming).

Two stages, as everywhere: ``resolve`` runs in the entry point, before the plan. It takes the model
shape from the source (config.json, or the shape the run saved), so ``model.init_from=PATH`` alone
is enough, refuses a command-line shape override that contradicts it, and checks every tensor's
name and shape against the model, all without reading tensor data. ``load`` runs on every rank
after the (possibly sharded) model is placed (``framework.models.materialize``): each rank reads only
its own shards, and no collective runs.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn

from framework.checkpoint import hf_weights, import_hf
from framework.config.schema import (
    Integrity,
    ModelConfig,
    ModelFamily,
    RouterScore,
    own_keys,
    replace_model,
)
from framework.models import SHAPE_KEYS, family, model_spec

KEY = "model.init_from"
RUN_CONFIG = "config.yaml"


# The model.moe keys that decide the tensors (the others, top-k or capacity, may change at a resume).
MOE_SHAPE = (
    "num_experts",
    "moe_intermediate_size",
    "num_shared_experts",
    "shared_intermediate_size",
    "router_score",
)


def shape_of(model_cfg: ModelConfig) -> dict[str, Any]:
    """The shape fields of a model config (what a checkpoint records about its model), as JSON values:
    the shared ones and every key of the family's own schema (DeepSeek-V3's latent ranks and layer
    pattern, GPT-OSS's window): ``model.init_from`` of a checkpoint builds the model from them, as
    the run's recipe is not there to give them."""
    fields = [*import_hf.SHAPE_FIELDS, *family(model_cfg).hf_fields, *own_keys(type(model_cfg))]
    shape = {k: getattr(model_cfg, k) for k in dict.fromkeys(fields)}
    if model_cfg.moe.num_experts:  # an MoE family: the keys that decide its tensors
        shape["moe"] = {
            k: getattr(getattr(model_cfg.moe, k), "value", getattr(model_cfg.moe, k)) for k in MOE_SHAPE
        }
    # The name is not a shape (saved_shape leaves it out): a run started from this one logs it.
    return shape | {"family": model_cfg.family.value, "name": model_cfg.name}


def _typed(shape: dict[str, Any]) -> dict[str, Any] | None:
    """A recorded shape back as ``ModelConfig`` values (the family is an Enum); None when empty."""
    if "family" in shape:
        shape["family"] = ModelFamily(shape["family"])
    return shape or None


def with_shape(model_cfg: ModelConfig, shape: dict[str, Any] | None, **more: Any) -> ModelConfig:
    """``model_cfg`` with a recorded or read ``shape`` (and ``more``) put in; its ``moe`` entry (a dict
    of ``model.moe`` keys) over ``model_cfg.moe``'s others."""
    shape = dict(shape or {})
    if isinstance(shape.get("moe"), dict):
        moe = {k: RouterScore(v) if k == "router_score" else v for k, v in shape["moe"].items()}
        shape["moe"] = dataclasses.replace(model_cfg.moe, **moe)
    return replace_model(model_cfg, **shape, **more)  # across families: that family's schema


def framework_checkpoint(path: Path, key: str = KEY) -> Path | None:
    """The DCP step dir ``path`` names (itself, or the newest complete one under a checkpoint root
    or a run dir), or None when ``path`` is not a framework checkpoint at all. ValueError when it is
    a checkpoint root with no complete, intact checkpoint."""
    from framework.checkpoint.group import Channel
    from framework.checkpoint.resolve import check_step_dir, find_latest
    from framework.checkpoint.store import MANIFEST, committed

    if (path / ".metadata").is_file() or (path / MANIFEST).is_file():
        return check_step_dir(path, key)
    for root in (path, path / "checkpoints"):
        if committed(root):
            latest = find_latest(root, Channel(None), Integrity.sha256)
            if latest is None:
                raise ValueError(f"{key}={str(path)!r}: no complete, intact checkpoint under {root}")
            return latest
    return None


# The keys ``saved_shape`` reads back: the shared shape fields, every family's own keys, the MoE entry.
_RECORDED = frozenset((*import_hf.SHAPE_FIELDS, *SHAPE_KEYS))


def saved_shape(step_dir: Path) -> dict[str, Any] | None:
    """The model shape a framework checkpoint was saved with: ``extra.json``'s ``model`` (written
    since init_from exists), else the run's ``config.yaml`` two levels up (the default layout)."""
    from framework.checkpoint.state import read_extra

    try:
        extra = read_extra(step_dir)["extra"]
    except ValueError:  # a malformed one: the load refuses it (auto resume then tries an older one)
        extra = {}
    if isinstance(extra.get("model"), dict):
        return _typed({k: v for k, v in extra["model"].items() if k in _RECORDED})
    run_config = step_dir.parent.parent / RUN_CONFIG
    if run_config.is_file():
        try:
            model = OmegaConf.to_container(OmegaConf.load(run_config)).get("model", {})
        except Exception:  # noqa: BLE001 - an unreadable config.yaml just gives no shape
            return None
        shape = {k: model[k] for k in _RECORDED if k in model and k != "moe"}
        if isinstance(model.get("moe"), dict) and model["moe"].get("num_experts"):
            shape["moe"] = {k: model["moe"][k] for k in MOE_SHAPE if k in model["moe"]}
        return _typed(shape)
    return None


def saved_name(step_dir: Path) -> str | None:
    """The model name of the run that saved ``step_dir``: ``extra.json``'s ``model.name``, else the
    run's ``config.yaml`` two levels up; None when neither says."""
    from framework.checkpoint.state import read_extra

    try:
        name = (read_extra(step_dir)["extra"].get("model") or {}).get("name")
    except (ValueError, AttributeError):
        name = None
    run_config = step_dir.parent.parent / RUN_CONFIG
    if name is None and run_config.is_file():
        try:
            name = (OmegaConf.to_container(OmegaConf.load(run_config)).get("model") or {}).get("name")
        except Exception:  # noqa: BLE001 - an unreadable config.yaml just gives no name
            return None
    return name if isinstance(name, str) and name else None


def check_resume_model(step_dir: Path, model_cfg: ModelConfig, key: str) -> None:
    """Refuse resuming ``step_dir`` into a model of another shape, naming each differing field.

    Why before launch: such a resume either fails to load in every rank (the checkpoint is then
    moved to ``corrupt/`` as if damaged, and the run trains from step 0) or, for an untied
    checkpoint resumed with ``model.tie_embeddings=true``, loads in silence without the trained
    output head. The head size is compared as the model uses it (``head_dim=0`` is dim / n_heads).
    """
    saved = saved_shape(step_dir)
    if not saved:
        return  # a checkpoint from before shapes were recorded: the load itself checks
    theirs = with_shape(model_cfg, saved)

    def value(m: ModelConfig, k: str) -> Any:
        if k.startswith("moe."):
            v = getattr(m.moe, k.removeprefix("moe."))
        else:
            v = (
                model_spec(m).head_dim if k == "head_dim" else getattr(m, k, None)
            )  # another family's key: none
        return str(v).lower() if isinstance(v, bool) else getattr(v, "value", v)

    keys = [k for k in SHAPE_KEYS if k != "moe"] + [f"moe.{k}" for k in MOE_SHAPE]
    recorded = set(saved) | {f"moe.{k}" for k in saved.get("moe") or {}}
    differ = [k for k in keys if k in recorded and value(theirs, k) != value(model_cfg, k)]
    if differ:
        diffs = ", ".join(f"model.{k}={value(theirs, k)} there, {value(model_cfg, k)} here" for k in differ)
        raise ValueError(
            f"{key}: {step_dir} holds another model ({diffs}); resume with the checkpoint's model "
            "settings, or start afresh with checkpoint.resume=none or another checkpoint.dir"
        )


def command_line_keys(overrides: list[str]) -> dict[str, str]:
    """``model.X`` keys set on the command line (``model.dim=64``, ``+model.dim=64``) -> their text.
    The model group's choice ``model=NAME`` (what ``model.family=NAME`` becomes) sets the family."""
    out = {}
    for o in overrides:
        key, sep, value = o.partition("=")
        key = key.lstrip("+~")
        if sep and key.startswith("model."):
            out[key.removeprefix("model.")] = value
        elif sep and key == "model":
            out["family"] = value
    return out


def expected_shapes(model_cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of the model ``model_cfg`` builds, read from its spec (framework.models,
    the source of ``named_parameters()``'s names): no model is built, and checkpoint/ needs no model.
    The persistent buffers too (DeepSeek-V3's routers' selection biases): the Hub files and a DCP
    checkpoint hold them, and a source without them would load a model that routes otherwise."""
    return {name: w.shape for name, w, _ in model_spec(model_cfg).tensors()}


def resolve(
    model: ModelConfig, overrides: list[str], *, check_shape: Callable[[ModelConfig], None]
) -> ModelConfig:
    """Take the model shape from ``model.init_from`` and check the source against it.

    Returns ``model`` with the shape fields replaced and ``init_from`` made absolute (for a run dir or
    a checkpoint root: the concrete step dir, so every rank and ``config.yaml`` name the same one).
    Raises ValueError (one line) for a missing path, a folder with no weights, a contradicting
    command-line override (naming the key and both values), and a tensor of another name or shape.
    ``check_shape``: the launcher's rules for the ``model`` group (framework.launch.rules, a layer
    above this one), run on the shape read from the source before anything is listed per layer.
    """
    if model.init_from is None or not model.init_from.strip():
        return model  # unset; an empty string is refused by its rule (framework.launch.rules)
    path = Path(model.init_from).expanduser().resolve()
    if not path.exists():
        raise ValueError(
            f"{KEY}={model.init_from!r} does not exist; valid: a Hugging Face safetensors folder, "
            "or a framework checkpoint (step dir, checkpoint root or run dir)"
        )
    hf = None
    step_dir = None if import_hf.is_hf_checkpoint(path) else framework_checkpoint(path)
    if step_dir is None:
        hf = import_hf.read_hf_checkpoint(path, KEY)
        shape = import_hf.model_shape(hf, KEY)
    else:
        shape = saved_shape(step_dir) or {}
    set_on_cli = command_line_keys(overrides)
    if "moe" in shape:  # an MoE family's keys (config.json's), over the recipe's others
        for k, v in shape["moe"].items():
            here = getattr(model.moe, k)
            if f"moe.{k}" in set_on_cli and getattr(here, "value", here) != v:
                raise ValueError(
                    f"model.moe.{k}={set_on_cli[f'moe.{k}']} on the command line contradicts {KEY}={str(path)!r}, "
                    f"whose {'config.json' if hf else 'checkpoint'} has {v}; drop the override (init_from sets the shape)"
                )
    for k, v in shape.items():
        if k == "moe":
            continue
        if k in set_on_cli and getattr(model, k, None) != v:
            v = getattr(v, "value", v)  # the family: its name
            theirs = f"config.json has {import_hf.SHAPE_FIELDS[k]}={v}" if hf else f"checkpoint has {k}={v}"
            raise ValueError(
                f"model.{k}={set_on_cli[k]} on the command line contradicts {KEY}={str(path)!r}, whose "
                f"{theirs}; drop the override (init_from sets the shape)"
            )
    if "name" not in set_on_cli:  # logs and the plan name the model loaded, not the recipe's
        name = path.name if hf is not None else saved_name(step_dir)  # type: ignore[arg-type]
        if name is not None:
            shape["name"] = name
    model_cfg = with_shape(model, shape, init_from=str(step_dir or path))
    try:  # before anything is listed per layer: the shape is untrusted input too (the launcher's
        # rules, passed in: this layer sits below them)
        check_shape(model_cfg)
    except ValueError as e:
        raise ValueError(f"{KEY}={str(path)!r} gives a model shape that is not valid: {e}") from None
    expected = expected_shapes(model_cfg)
    if hf is not None:
        spec = model_spec(model_cfg)
        import_hf.check_against(hf, expected, spec.hf_names(), KEY, experts=spec.hf_experts())
        check_float_weights(hf)
        # The export carries it through (and generate stops on its eos ids): refused now.
        import_hf.read_generation_config(path, KEY, model_cfg.vocab_size)
    else:
        assert step_dir is not None
        check_dcp_shapes(step_dir, expected)
    return model_cfg


# safetensors dtype names of floating-point tensors: weights of any other dtype (I8, BOOL) were cast
# into the model silently and trained from garbage.
FINITE_CHECK_ELEMENTS = 2**26  # per block read: 128 MiB of bf16
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")


def check_float_weights(hf: import_hf.HFCheckpoint) -> None:
    """Every tensor of an HF folder is floating point (from the safetensors headers) and finite (read
    in blocks of rows, so memory stays bounded): int8/bool weights were cast and NaN weights trained
    on silently, a NaN loss at every step."""
    from safetensors import safe_open

    for name in sorted(set(hf.files.values())):
        with safe_open(str(hf.path / name), framework="pt") as f:
            for t in f.keys():
                sl = f.get_slice(t)
                dtype = sl.get_dtype()
                where = f"{KEY}={str(hf.path)!r}: tensor {t} in {name}"
                if dtype not in FLOAT_DTYPES:
                    raise ValueError(
                        f"{where} is {dtype}; valid: floating-point weights ({', '.join(FLOAT_DTYPES)})"
                    )
                shape = sl.get_shape()
                rows = shape[0] if shape else 1
                step = max(1, FINITE_CHECK_ELEMENTS // max(1, math.prod(shape[1:])))
                for i in range(0, rows, step):
                    block = sl[i : i + step] if shape else sl[:]
                    if not bool(torch.isfinite(block).all()):
                        raise ValueError(f"{where} holds NaN or inf; valid: finite weights")


def check_dcp_shapes(step_dir: Path, expected: dict[str, tuple[int, ...]]) -> None:
    """Every model tensor of a DCP checkpoint has the expected name and shape (ValueError otherwise)."""
    from framework.checkpoint.state import read_metadata

    where = f"{KEY}={str(step_dir)!r}"
    try:
        meta = read_metadata(step_dir).state_dict_metadata
    except Exception as e:  # noqa: BLE001 - a missing or refused .metadata: one line
        raise ValueError(f"{where} is not a readable DCP checkpoint: {e!r}") from None
    stored = {k.removeprefix("model."): tuple(v.size) for k, v in meta.items() if k.startswith("model.")}
    for name, shape in expected.items():
        if name in stored and stored[name] != shape:
            raise ValueError(
                f"{where}: tensor {name} has shape {list(stored[name])}, the model expects {list(shape)}"
            )
    missing = sorted(set(expected) - set(stored))
    # A tied model's state dict also names output.weight (the same tensor); an untied one needs it.
    unknown = sorted(set(stored) - set(expected) - {"output.weight"})
    if missing or unknown:
        raise ValueError(
            f"{where}: tensor names do not match the model: missing {missing[:5]}, unknown {unknown[:5]}"
        )


@torch.no_grad()
def load(model: nn.Module, path: str) -> None:
    """Fill a materialised (possibly sharded) model from ``path`` as ``resolve`` left it; every rank
    reads its own shards, no collective runs."""
    source = Path(path)
    if import_hf.is_hf_checkpoint(source):
        hf_weights.load_hf_weights(model, import_hf.read_hf_checkpoint(source, KEY))
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from framework.checkpoint.state import from_dcp, load_dcp, to_dcp
    from framework.models.lora import is_lora_name

    full = get_model_state_dict(model)
    own = {k: v for k, v in full.items() if not is_lora_name(k)}  # the base only: adapters start fresh
    payload = {"model": to_dcp(model, own)}  # a tied weight is stored once
    # no_dist: each rank plans and reads its own chunks; the ranks need not agree on anything here.
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninit")
        load_dcp(payload, source, no_dist=True)
    set_model_state_dict(
        model, from_dcp(model, payload["model"]), options=StateDictOptions(strict=own == full)
    )


@torch.no_grad()
def load_adapters(model: nn.Module, step_dir: Path) -> None:
    """Fill a placed model's LoRA adapters from a LoRA run's checkpoint ``step_dir``, which holds the
    adapters and no frozen weight (the base comes from that run's ``model.init_from`` or seed, loaded
    first); every rank reads its own shards, no collective runs. ValueError (one line) when the
    checkpoint lacks an adapter of the model or holds it in another shape (another ``peft.rank``)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from framework.checkpoint.state import load_dcp, read_metadata
    from framework.models.lora import is_lora_name

    own = {k: v for k, v in get_model_state_dict(model).items() if is_lora_name(k)}
    meta = read_metadata(step_dir).state_dict_metadata
    stored = {k.removeprefix("model."): tuple(v.size) for k, v in meta.items() if k.startswith("model.")}
    missing = sorted(set(own) - set(stored))
    if missing:
        raise ValueError(
            f"{step_dir} lacks the LoRA adapters {missing[:3]}; valid: a checkpoint of this LoRA run"
        )
    differ = [k for k, v in own.items() if tuple(v.shape) != stored[k]]
    if differ:
        k = sorted(differ)[0]
        raise ValueError(
            f"{step_dir}: adapter {k} has shape {list(stored[k])}, the model's is {list(own[k].shape)} "
            "(another peft.rank?); valid: the run's own peft settings"
        )
    payload = {"model": own}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninit")
        load_dcp(payload, step_dir, no_dist=True)
    set_model_state_dict(model, payload["model"], options=StateDictOptions(strict=False))
