"""Import a Hugging Face checkpoint (a safetensors folder) of a registered family (``LlamaForCausalLM``,
``Qwen3ForCausalLM``, ``MistralForCausalLM``, ``Qwen3MoeForCausalLM``, ``MixtralForCausalLM``) into our model.

The inverse of ``export_hf.py``: names map one to one. This module reads the folder: config.json
(the model's shape, ``model_shape``), generation_config.json, and the safetensors headers (each
tensor's file and shape, checked against the model's: ``check_against``). The tensors themselves
are read by framework.checkpoint.hf_weights, each rank only its own chunk.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from framework.checkpoint.quantized import Quantized, logical_tensors
from framework.config.schema import ModelFamily
from framework.data.folder_links import check_inside
from framework.models import FAMILIES

log = logging.getLogger("framework")

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
GENERATION_CONFIG = "generation_config.json"

# ModelConfig field -> LlamaConfig field: the shape that ``model.init_from`` takes from config.json.
SHAPE_FIELDS = {
    "family": "model_type",
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "ffn_dim": "intermediate_size",
    "vocab_size": "vocab_size",
    "norm_eps": "rms_norm_eps",
    "rope_theta": "rope_theta",
    "tie_embeddings": "tie_word_embeddings",
    # Llama 3.1's RoPE scaling (rope_type "llama3"), inside rope_parameters (or v4's rope_scaling).
    "rope_scaling_factor": "rope_parameters.factor",
    "rope_low_freq_factor": "rope_parameters.low_freq_factor",
    "rope_high_freq_factor": "rope_parameters.high_freq_factor",
    "rope_original_max_position": "rope_parameters.original_max_position_embeddings",
    # Not a shape, but the source's context length: carried so that the export writes it back.
    "max_position_embeddings": "max_position_embeddings",
}
# LlamaConfig's defaults for the fields a config.json may leave out (transformers' LlamaConfig).
_HF_DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": None,  # None means num_attention_heads
    "head_dim": None,  # None means hidden_size / num_attention_heads
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "max_position_embeddings": 0,  # unknown: the export then writes the training seq_len
}


@dataclass(frozen=True)
class HFCheckpoint:
    """A safetensors folder: its config.json and, per tensor name, the file and shape. A quantized
    folder's shapes are its logical tensors' (framework.checkpoint.quantized), read dequantized."""

    path: Path
    config: dict[str, Any]
    files: dict[str, str]  # tensor name (stored or logical) -> file name inside ``path``
    shapes: dict[str, tuple[int, ...]]
    quantized: dict[str, Quantized] = field(default_factory=dict)


def is_hf_checkpoint(path: Path) -> bool:
    """A folder with a config.json and no DCP metadata: what ``model.init_from`` reads as HF."""
    return path.is_dir() and (path / CONFIG_FILE).is_file() and not (path / ".metadata").is_file()


def read_hf_checkpoint(path: Path, key: str = "model.init_from") -> HFCheckpoint:
    """Read config.json and the safetensors headers (no tensor data). ValueError naming ``key``
    and the path when the folder has no config.json, no safetensors weights, or a broken index."""
    from safetensors import safe_open

    path = Path(path)
    where = f"{key}={str(path)!r}"
    if not path.is_dir():
        raise ValueError(f"{where} is not a directory (expected a Hugging Face safetensors folder)")
    if not (path / CONFIG_FILE).is_file() and not any(path.glob("*.safetensors")):
        raise ValueError(
            f"{where} holds no weights; valid: a Hugging Face folder (config.json + *.safetensors) "
            "or a framework checkpoint (step dir with manifest.json, checkpoint root or run dir)"
        )
    if (path / CONFIG_FILE).is_symlink():
        check_inside(path, CONFIG_FILE, where)
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise ValueError(f"{where} has no {CONFIG_FILE} (expected a Hugging Face model folder)") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: {CONFIG_FILE} does not parse: {e}") from None
    if not isinstance(config, dict):  # a list or a string: an AttributeError traceback at its first field
        raise ValueError(f"{where}: {CONFIG_FILE} is a JSON {type(config).__name__}; valid: a JSON object")
    if (path / INDEX_FILE).is_file():
        check_inside(path, INDEX_FILE, where)
        try:
            weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{where}: {INDEX_FILE} has no readable weight_map: {e!r}") from None
        names = sorted(set(weight_map.values()))
        _check_names(names, where)
    else:
        weight_map = None
        names = sorted(p.name for p in path.glob("*.safetensors"))
    if not names:
        other = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        hint = f" (found {other}: only safetensors are read; save_pretrained writes them)" if other else ""
        raise ValueError(f"{where} holds no *.safetensors weights{hint}")
    files: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for name in names:
        if not (path / name).is_file():
            raise ValueError(f"{where}: {INDEX_FILE} names {name}, which is not in the folder")
        check_inside(path, name, where)
        try:
            with safe_open(str(path / name), framework="pt") as f:
                for t in f.keys():
                    files[t] = name
                    shapes[t] = tuple(f.get_slice(t).get_shape())
        except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError
            raise ValueError(f"{where}: {name} is not a readable safetensors file: {e}") from None
    if weight_map is not None:
        missing = sorted(t for t, f in weight_map.items() if files.get(t) != f)
        if missing:
            raise ValueError(f"{where}: {INDEX_FILE} lists tensors its files do not hold: {missing[:5]}")
    shapes, stored, quantized = logical_tensors(config, shapes, where)
    files |= {name: files[t] for name, t in stored.items()}
    return HFCheckpoint(path, config, files, shapes, quantized)


def _check_names(names: list[object], where: str) -> None:
    """The index's file names must be plain names of files in the folder: a path (``..``, absolute,
    a subfolder) would read weights from anywhere the index's author chose."""
    for name in names:
        if not isinstance(name, str) or not name or name in (".", "..") or Path(name).name != name:
            raise ValueError(
                f"{where}: {INDEX_FILE} names {name!r} in its weight_map; valid: the file name of a "
                "*.safetensors file in the folder itself (no path, no '..')"
            )


def read_generation_config(folder: Path, key: str, vocab_size: int | None = None) -> dict[str, object] | None:
    """An HF folder's ``generation_config.json`` as a dict; None when it has none. ValueError naming
    ``key`` and the file when it is not a JSON object (transformers would refuse it too), or when its
    ``eos_token_id`` is not a token id of ``vocab_size`` (``check_eos_ids``)."""
    path = Path(folder) / GENERATION_CONFIG
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{key}={str(folder)!r}: {GENERATION_CONFIG} does not parse: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(
            f"{key}={str(folder)!r}: {GENERATION_CONFIG} is {type(value).__name__}; valid: a JSON object"
        )
    check_eos_ids(value.get("eos_token_id"), vocab_size, f"{key}={str(folder)!r}: {GENERATION_CONFIG}")
    return value


def check_eos_ids(value: object, vocab_size: int | None, where: str) -> set[int]:
    """The stop ids an ``eos_token_id`` names (null: none). ValueError (``where`` has
    eos_token_id=VALUE; what is valid) for anything but a token id below ``vocab_size`` (2**32 when
    unknown) or a non-empty list of them: a string, a bool, -1 or an id past the vocabulary were
    dropped silently, so decoding never stopped where the model's authors meant it to."""
    if value is None:
        return set()
    top = vocab_size or 2**32
    ids = value if isinstance(value, list) else [value]
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < top for i in ids):
        raise ValueError(
            f"{where} has eos_token_id={value!r}; valid: null, a token id in 0..{top - 1} or a non-empty "
            "list of them"
        )
    return set(ids)


def model_shape(ckpt: HFCheckpoint, key: str = "model.init_from") -> dict[str, Any]:
    """The ``ModelConfig`` shape fields from config.json (LlamaConfig's defaults where absent).

    The family is the ``model_type`` (framework.models). Raises ValueError for what our model does
    not compute (another architecture, biases, sliding-window attention, RoPE scaling other than
    Llama 3.1's, another activation): its logits would differ.
    """
    c = ckpt.config
    where = f"{key}={str(ckpt.path)!r}"
    families = [f.value for f in ModelFamily]
    if c.get("model_type") not in families:
        raise ValueError(f"{where}: config.json has model_type={c.get('model_type')!r}; valid: {families}")
    own = FAMILIES[ModelFamily(c["model_type"])]
    if own.hf_read is not None:  # the family reads its RoPE (and its own fields) itself
        c = {k: v for k, v in c.items() if k not in ("rope_parameters", "rope_scaling")}
    for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if c.get(flag) and flag not in own.hf_fixed:  # GPT-OSS's attention has biases
            raise ValueError(f"{where}: config.json has {flag}=true; valid: false (not in our models)")
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: config.json has hidden_act={c['hidden_act']!r}; valid: 'silu'")
    # transformers >= 5 writes RoPE settings as rope_parameters {rope_type, rope_theta, ...}; older
    # releases and Meta's conversions write rope_theta and rope_scaling at the top level.
    params, scaling = c.get("rope_parameters") or {}, c.get("rope_scaling") or {}
    for name, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(value, dict):  # a string ("linear"): an AttributeError traceback
            raise ValueError(
                f"{where}: config.json has {name}={value!r}; valid: null or an object such as "
                '{"rope_type": "llama3", "factor": 8.0, ...}'
            )
    kinds = {d.get("rope_type", d.get("type", "default")) for d in (params, scaling)} - {"default"}
    rope_type = next(iter(kinds)) if len(kinds) == 1 else "default" if not kinds else "mixed"
    rope = {**params, **scaling} if scaling and rope_type != "default" else params
    if rope_type not in ("default", "llama3"):
        raise ValueError(
            f"{where}: config.json has RoPE scaling {scaling or params!r}; valid: rope_type 'default' or 'llama3' "
            "(Llama 3.1's)"
        )
    try:
        out: dict[str, Any] = {}
        for ours, theirs in SHAPE_FIELDS.items():
            if theirs.startswith("rope_parameters."):
                if rope_type == "llama3":
                    out[ours] = rope[theirs.removeprefix("rope_parameters.")]
            elif theirs == "rope_theta" and "rope_theta" in rope:
                out[ours] = rope["rope_theta"]
            else:
                out[ours] = c[theirs] if theirs in c else _HF_DEFAULTS[theirs]
        if rope_type == "default":
            out["rope_scaling_factor"] = 1.0  # off, whatever the recipe said
        if out["n_kv_heads"] is None:
            out["n_kv_heads"] = out["n_heads"]
        if out["head_dim"] is None or out["head_dim"] * out["n_heads"] == out["dim"]:
            out["head_dim"] = 0  # hidden_size / heads: the default
        ints = (
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "ffn_dim",
            "vocab_size",
            "rope_original_max_position",
            "max_position_embeddings",
        )
        for k, v in out.items():
            if k != "family":
                out[k] = _typed_field(k, v, ints, where)
        # The family's own integer fields (its record), 0 where HF's is null or absent (off).
        fam = FAMILIES[ModelFamily(out["family"])]
        for ours, theirs in fam.hf_fields.items():
            out[ours] = int(c.get(theirs) or 0)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: config.json lacks or mangles a shape field: {e!r}") from None
    if fam.hf_moe_fields:
        out["moe"] = moe_fields(c, fam.hf_moe_fields, fam.hf_fixed, where) | dict(fam.hf_moe_values)
    if fam.hf_read is not None:
        out |= fam.hf_read(ckpt.config, where)
    out["family"] = ModelFamily(out["family"])
    return out


# transformers' attribute_map of Qwen3MoeConfig and MixtralConfig: either name is read (transformers
# 5 saves Qwen3-MoE's expert count as num_local_experts; the published config.json has num_experts).
HF_ALIASES = {"num_experts": "num_local_experts", "num_local_experts": "num_experts"}


def moe_fields(
    c: dict[str, Any], fields: dict[str, str], fixed: dict[str, object], where: str
) -> dict[str, Any]:
    """An MoE family's ``model.moe`` values from config.json (its record's ``hf_moe_fields``), each of
    the schema's type; ValueError for a missing or mistyped one, or a ``hf_fixed`` field holding
    another value (``mlp_only_layers``: a layer our block would compute as sparse)."""
    from framework.config.schema import MoEConfig

    defaults = MoEConfig()
    out: dict[str, Any] = {}
    for ours, theirs in fields.items():
        if theirs not in c and HF_ALIASES.get(theirs) in c:
            theirs = HF_ALIASES[theirs]
        if theirs not in c:
            raise ValueError(f"{where}: config.json lacks {theirs} (model.moe.{ours})")
        v, kind = c[theirs], type(getattr(defaults, ours))
        if kind is bool:
            ok = isinstance(v, bool)
        elif kind is int:
            ok = isinstance(v, int) and not isinstance(v, bool)
        else:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        if not ok:
            raise ValueError(
                f"{where}: config.json has {theirs}={v!r}; valid: a JSON {kind.__name__} (model.moe.{ours})"
            )
        out[ours] = kind(v)
    for theirs, want in fixed.items():
        got = c.get(theirs, want)
        if (got or want) and got != want:  # null and [] are the same here
            raise ValueError(
                f"{where}: config.json has {theirs}={got!r}; valid: {json.dumps(want)} (every layer sparse: "
                "the only layout this family computes)"
            )
    return out


def _typed_field(k: str, v: Any, ints: tuple[str, ...], where: str) -> Any:
    """config.json's value for our field ``k``, refused unless it has the field's type: int(2.5) made
    a 2-layer model and bool("false") a tied one, silently."""
    name = SHAPE_FIELDS[k]
    if k == "tie_embeddings":
        if not isinstance(v, bool):
            raise ValueError(f"{where}: config.json has {name}={v!r}; valid: true or false (a JSON boolean)")
        return v
    if k in ints:
        if isinstance(v, bool) or not (isinstance(v, int) or (isinstance(v, float) and v.is_integer())):
            raise ValueError(f"{where}: config.json has {name}={v!r}; valid: an integer")
        return int(v)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{where}: config.json has {name}={v!r}; valid: a number")
    return float(v)


def check_against(
    ckpt: HFCheckpoint,
    expected: dict[str, tuple[int, ...]],
    names: dict[str, str],
    key: str = "model.init_from",
    experts: dict[str, tuple[str, ...]] | None = None,
) -> None:
    """``expected``: our parameter name -> shape; ``names``: ours -> HF's (the spec's ``hf_names``);
    ``experts``: stacked expert weights -> their per-expert Hub names (the spec's ``hf_experts``): a
    checkpoint with another number of experts misses or has unknown ``experts.{e}`` tensors.
    ValueError naming the first tensor whose shape differs (both shapes), or the tensors missing
    from the checkpoint / unknown to our model.

    A tied model ignores a stored ``lm_head.weight`` (transformers ties it to the embedding too).
    """
    where = f"{key}={str(ckpt.path)!r}"
    want = hf_shapes(expected, names, experts or {})
    for name, shape in want.items():
        got = ckpt.shapes.get(name)
        if got is not None and tuple(got) != tuple(shape):
            raise ValueError(f"{where}: tensor {name} has shape {list(got)}, the model expects {list(shape)}")
    missing = sorted(set(want) - set(ckpt.shapes))
    unknown = sorted(set(ckpt.shapes) - set(want) - {"lm_head.weight"})
    if "lm_head.weight" in ckpt.shapes and "lm_head.weight" not in want and "output.weight" in expected:
        unknown.append("lm_head.weight")
    # Buffers some exporters add; recomputed here from the shape.
    unknown = [n for n in unknown if not n.endswith("rotary_emb.inv_freq")]
    mtp = mtp_layer_names(ckpt.config, unknown)
    if mtp and mtp_layer_names(ckpt.config, list(want)):
        # the model reads the MTP layers (model.mtp_layers): what is left of them are their copies of
        # the shared embedding and head (ModelSpec.mtp_shared), equal to the tensors read
        unknown = [n for n in unknown if n not in mtp]
    elif mtp:
        unknown = [n for n in unknown if n not in mtp]
        log.warning(
            "%s: the checkpoint's %d multi-token prediction tensors (config.json's num_nextn_predict_layers, "
            "e.g. %s) are not read: multi-token prediction is not built here",
            where,
            len(mtp),
            min(mtp),
        )
    if missing or unknown:
        raise ValueError(
            f"{where}: tensor names do not match the model: missing {missing[:5]}, unknown {unknown[:5]}"
        )


def mtp_layer_names(config: dict[str, Any], names: list[str]) -> set[str]:
    """Among ``names``, the tensors of DeepSeek-V3's multi-token prediction layers: the Hub files store
    them as the ``num_nextn_predict_layers`` layers after ``num_hidden_layers`` (the published
    DeepSeek-V3 and Kimi K2 hold one, ``model.layers.61.*``)."""
    n, k = config.get("num_hidden_layers"), config.get("num_nextn_predict_layers")
    if not isinstance(n, int) or not isinstance(k, int) or isinstance(k, bool) or k <= 0:
        return set()
    prefixes = tuple(f"model.layers.{i}." for i in range(n, n + k))
    return {t for t in names if t.startswith(prefixes)}


def hf_shapes(
    expected: dict[str, tuple[int, ...]], names: dict[str, str], experts: dict[str, tuple[str, ...]]
) -> dict[str, tuple[int, ...]]:
    """The Hub tensors a model of ``expected`` shapes reads: one per parameter, or for stacked experts
    ``(E, rows, cols)`` one ``(rows / parts, cols)`` tensor per expert and part."""
    out = {}
    for n, shape in expected.items():
        if n not in experts:
            out[names[n]] = shape
            continue
        e, rows, *rest = shape
        parts = experts[n]
        for i in range(e):
            out |= {t.format(e=i): (rows // len(parts), *rest) for t in parts}
    return out
