"""Export to Hugging Face (``LlamaForCausalLM``, ...): ``model.safetensors``, ``config.json``,
``generation_config.json`` and the tokenizer's files, so that ``AutoModelForCausalLM`` and
``AutoTokenizer`` load the folder as it is.

Names map one to one (torchtitan -> HF, as the model's spec in framework.models lists them),
except for one numerical subtlety: our RoPE rotates interleaved pairs ``(x[2i], x[2i+1])`` as
Meta's original code does, while HF rotates halves ``(x[i], x[i + d/2])``. Permuting the rows of
``wq`` and ``wk`` inside each head (pairs -> halves; the spec's ``rope_heads``) makes HF's
attention compute the same scores; this is the permutation of HF's own
``convert_llama_weights_to_hf.py``. ``wv``/``wo`` are not rotated and are copied as they are.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from framework.config.schema import ModelConfig
from framework.data.tokenizer import Tokenizer
from framework.models import family, model_spec
from framework.record.run_dir import check_creatable

log = logging.getLogger("framework")
# Written into every export: ``export-hf`` replaces a folder holding it, and refuses another model's.
EXPORT_MARKER = "framework_export.json"


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full, unsharded model state on CPU, on rank 0 (``{}`` on the others). Collective for
    FSDP/TP models and pipelines (each rank holds its stages: ``pipeline_full_state``): call it on
    every rank."""
    from framework.parallel.pipeline import is_pipeline
    from framework.parallel.pipeline_run import pipeline_full_state

    if is_pipeline(model):
        return pipeline_full_state(model)
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def permute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows (dim 0) of a q/k projection, or entries of a per-head q/k norm, from interleaved-pair
    to rotate-half order, per head (HF's permute)."""
    return w.reshape(n_heads, -1, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def to_hf_state_dict(model_state: dict[str, torch.Tensor], model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename (and for q/k permute) a full state dict to the HF names of the model's spec
    (framework.models); contiguous copies.

    Raises ValueError naming keys that are missing or that the export does not know.
    """
    spec = model_spec(model_cfg)
    every = spec.hf_names()
    names = {ours: every[ours] for ours, _, _ in spec.tensors()}
    rope = spec.rope_heads()
    # A tied model's state dict also names output.weight: the embedding's tensor, not exported.
    allowed = set(names) | ({"output.weight"} if model_cfg.tie_embeddings else set())
    missing = sorted(set(names) - set(model_state))
    unknown = sorted(set(model_state) - allowed)
    if missing or unknown:
        raise ValueError(f"model state does not match {model_cfg.name}: missing {missing}, unknown {unknown}")
    experts = spec.hf_experts()
    out = {}
    for ours, theirs in names.items():
        w = model_state[ours]
        if ours in experts:  # stacked (E, rows, cols): one tensor per expert and part, as the Hub keeps them
            parts = experts[ours]
            for e, stacked in enumerate(w):
                out |= {
                    t.format(e=e): chunk for t, chunk in zip(parts, stacked.chunk(len(parts)), strict=True)
                }
            continue
        out[theirs] = permute_rope_rows(w, rope[ours]) if ours in rope else w
    # the multi-token prediction layers' copies of the shared embedding and head, as the Hub files keep them
    for theirs, ours in spec.hf_copies().items():
        out[theirs] = model_state.get(ours, model_state["tok_embeddings.weight"])
    # safetensors refuses tensors that share storage (tied weights, views): save independent copies.
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in out.items()}


def hf_config(
    model_cfg: ModelConfig,
    dtype: torch.dtype,
    max_position_embeddings: int,
    bos_id: int | None = None,
    eos_id: int | None = None,
    pad_id: int | None = None,
) -> dict[str, object]:
    """``config.json`` for the spec's HF class (transformers' LlamaConfig field names)."""
    spec = model_spec(model_cfg)
    rope: dict[str, object] = {"rope_type": "default"}
    if model_cfg.rope_scaling_factor != 1.0:
        rope = {
            "rope_type": "llama3",
            "factor": model_cfg.rope_scaling_factor,
            "low_freq_factor": model_cfg.rope_low_freq_factor,
            "high_freq_factor": model_cfg.rope_high_freq_factor,
            "original_max_position_embeddings": model_cfg.rope_original_max_position,
        }
    # The family's own fields (its record): our 0 (off) is HF's null.
    fam = family(model_cfg)
    own = {theirs: getattr(model_cfg, ours) or None for ours, theirs in fam.hf_fields.items()}
    if fam.hf_moe_fields:
        own |= moe_config(model_cfg)
    # the family's own config.json entries (DeepSeek-V3's first_k_dense_replace, YaRN) last: they win
    own_form = fam.hf_write(model_cfg, spec.layers) if fam.hf_write is not None else {}
    out = own | {
        "architectures": [spec.hf_architecture],
        "model_type": spec.hf_model_type,
        "hidden_size": model_cfg.dim,
        "intermediate_size": model_cfg.ffn_dim,
        "num_hidden_layers": model_cfg.n_layers,
        "num_attention_heads": model_cfg.n_heads,
        "num_key_value_heads": model_cfg.n_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": model_cfg.vocab_size,
        "rms_norm_eps": model_cfg.norm_eps,
        # transformers < 5 reads rope_theta and rope_scaling, >= 5 rope_parameters.
        "rope_theta": model_cfg.rope_theta,
        "rope_scaling": rope if rope["rope_type"] != "default" else None,
        "rope_parameters": {**rope, "rope_theta": model_cfg.rope_theta},
        "tie_word_embeddings": model_cfg.tie_embeddings,
        "max_position_embeddings": max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": model_cfg.init_std,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    return out | own_form


def moe_config(model_cfg: ModelConfig) -> dict[str, object]:
    """An MoE family's config.json fields (its record's ``hf_moe_fields`` and ``hf_fixed``). ValueError
    for what its ``transformers`` class cannot compute: a sigmoid router, a routed scaling factor,
    shared experts (its logits would differ)."""
    fam, moe = family(model_cfg), model_cfg.moe
    unsupported = {
        "router_score": (moe.router_score.value, "softmax"),
        "routed_scaling_factor": (moe.routed_scaling_factor, 1.0),
        "num_shared_experts": (moe.num_shared_experts, 0),
    }
    for key, want in fam.hf_moe_values.items():  # what the HF class computes, fixed
        value = getattr(moe, key)
        unsupported[key] = (getattr(value, "value", value), getattr(want, "value", want))
    for key, (value, want) in unsupported.items():
        if key in fam.hf_moe_fields:  # the HF class computes it (DeepSeek-V3's shared experts)
            continue
        if value != want:
            raise ValueError(
                f"export-hf: model.moe.{key}={value} has no {fam.hf_architecture} counterpart; valid for an HF "
                f"export: {want}"
            )
    values = {ours: getattr(moe, ours) for ours in fam.hf_moe_fields}
    if "moe_intermediate_size" in values:
        values["moe_intermediate_size"] = moe.moe_intermediate_size or model_cfg.ffn_dim
    return (
        {fam.hf_moe_fields[k]: v for k, v in values.items()}
        | dict(fam.hf_fixed)
        | {"output_router_logits": False}
    )


def generation_config(
    bos_id: int | None, eos_id: int | None, pad_id: int | None = None, source: dict[str, object] | None = None
) -> dict[str, object]:
    """``generation_config.json`` (transformers' GenerationConfig fields): the special tokens that
    ``generate`` starts, stops and pads on. ``source``: the generation config of the model the run
    started from (``source_generation_config``), carried through as it is (its eos list, e.g. Llama
    3 Instruct's end-of-turn tokens, its sampling defaults); the tokenizer's ids fill only what it
    leaves unset. Without one, the sampling settings stay transformers' defaults."""
    if source is not None:
        ids = {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id}
        return dict(source) | {k: v for k, v in ids.items() if source.get(k) is None and v is not None}
    out: dict[str, object] = {"_from_model_config": True, "bos_token_id": bos_id, "eos_token_id": eos_id}
    return out | ({"pad_token_id": pad_id} if pad_id is not None else {})


def source_generation_config(init_from: str | None) -> dict[str, object] | None:
    """The generation config of the HF folder a run started from (``model.init_from``); None when
    it started from a framework checkpoint or a random init, or the folder has no such file. A folder
    gone since the run started: a warning, and the export writes its own."""
    from framework.checkpoint.import_hf import GENERATION_CONFIG, is_hf_checkpoint, read_generation_config

    if not init_from:
        return None
    folder = Path(init_from)
    if not folder.is_dir():
        log.warning(
            "model.init_from=%s is gone: the export's %s is not the source's", folder, GENERATION_CONFIG
        )
        return None
    return read_generation_config(folder, "model.init_from") if is_hf_checkpoint(folder) else None


def special_ids(tokenizer: Tokenizer | None) -> tuple[int | None, int | None, int | None]:
    """(bos, eos, pad) token ids of the tokenizer (None each without one, or without a tokenizer)."""
    if tokenizer is None:
        return None, None, None
    pad = tokenizer.special_tokens.get("pad")
    return tokenizer.bos_id, tokenizer.eos_id, None if pad is None else tokenizer.token_id(pad)


def save_tokenizer(tokenizer: Tokenizer | None, out_dir: Path) -> list[str]:
    """The tokenizer's own files (``Tokenizer.save`` writes what ``AutoTokenizer`` loads); [] when
    the export has no tokenizer (then ``AutoTokenizer`` cannot load the folder, and the caller says so)."""
    return list(tokenizer.save(out_dir)) if tokenizer is not None else []


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """``safetensors.torch.save_file``, then the mode the folder's other files get (0644 under the
    usual umask 022): safetensors creates its file 0600, so a shared export's weights were the one
    file the group could not read."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})
    mask = os.umask(0)  # read the process's umask (setting it is the only way), then put it back
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def export_hf(
    model_state: dict[str, torch.Tensor],
    model_cfg: ModelConfig,
    out_dir: Path,
    max_position_embeddings: int = 2048,
    tokenizer: Tokenizer | None = None,
    source: str | None = None,
) -> Path:
    """Write the model, ``config.json``, ``generation_config.json`` and (when ``tokenizer`` can
    save itself) its files into ``out_dir``; return ``out_dir``.

    ``model_state`` is the full, unsharded state (``full_model_state`` on rank 0); call this on
    rank 0 only. Pass the longest context the model is meant for (``model.max_position_embeddings``,
    else the training ``seq_len``) as ``max_position_embeddings``. ``tokenizer`` is a
    ``framework.data.tokenizer.Tokenizer``; its bos/eos/pad ids go into both configs. ``source``:
    the run's ``model.init_from``; when it is an HF folder, its ``generation_config.json`` is carried
    through (``generation_config``).
    """
    tensors = to_hf_state_dict(model_state, model_cfg)
    dtype = tensors["model.embed_tokens.weight"].dtype
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, out_dir / "model.safetensors")
    bos, eos, pad = special_ids(tokenizer)
    cfg = hf_config(model_cfg, dtype, max_position_embeddings, bos, eos, pad)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = generation_config(bos, eos, pad, source_generation_config(source))
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tokenizer_files = save_tokenizer(tokenizer, out_dir)
    if not tokenizer_files:
        log.warning("HF export %s: no tokenizer given, so AutoTokenizer will not load the folder", out_dir)
    written = ["model.safetensors", "config.json", "generation_config.json", *tokenizer_files]
    marker = {"written_by": "framework.checkpoint export-hf", "architecture": cfg["architectures"]}
    finish_export(out_dir, marker, written)
    return out_dir


# What an export's marker lists before it named its files: its ``written_by`` -> the files it wrote.
_UNLISTED_FILES = {
    "framework.checkpoint export-hf": ("model.safetensors", "config.json", "generation_config.json"),
    "framework.checkpoint export-hf --adapter": ("adapter_model.safetensors", "adapter_config.json"),
}


def earlier_export_files(out_dir: Path) -> set[str]:
    """The files an earlier export into ``out_dir`` says it wrote (its marker's ``files``; for a
    marker older than that list, the files its kind writes), as plain names: a marker is a file
    anyone could edit, so a name with a path in it (``../x``) is never one of ours."""
    try:
        marker = json.loads((out_dir / EXPORT_MARKER).read_text())
    except (OSError, ValueError):
        return set()
    if not isinstance(marker, dict):
        return set()
    files = marker.get("files", _UNLISTED_FILES.get(str(marker.get("written_by")), ()))
    if not isinstance(files, list | tuple):
        return set()
    return {f for f in files if isinstance(f, str) and f not in ("", ".", "..") and Path(f).name == f}


def finish_export(out_dir: Path, marker: dict[str, object], written: list[str]) -> None:
    """Write the export's marker (with the ``files`` it wrote) and remove what an earlier export
    into the same folder wrote that this one did not: an adapter's ``adapter_config.json`` left
    beside merged weights makes transformers apply the adapter a second time. Files the marker does
    not name (the user's own) stay."""
    stale = earlier_export_files(out_dir) - set(written) - {EXPORT_MARKER}
    marker = {**marker, "files": sorted(written)}
    (out_dir / EXPORT_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    for name in sorted(stale):
        path = out_dir / name
        if path.is_file() or path.is_symlink():
            path.unlink()
            log.info(
                "HF export %s: removed %s, which an earlier export wrote and this one does not", out_dir, name
            )


def checkpoint_model_state(step_dir: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a framework (DCP) checkpoint, read in one process without building the
    model: empty tensors shaped from DCP's metadata, filled by ``dcp.load``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from framework.checkpoint.state import load_dcp, read_metadata

    meta = read_metadata(step_dir).state_dict_metadata
    # The trainer saves {"model": {name: tensor}, "optim": ...}; DCP stores it flat as "model.NAME".
    state = {
        k.removeprefix("model."): torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in meta.items()
        if k.startswith("model.") and isinstance(v, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninit")
        load_dcp({"model": state}, step_dir, no_dist=True)
    return state


def check_out_dir(out_dir: Path, step_dir: Path, force: bool = False) -> None:
    """OUT must be a folder outside the checkpoint root: an existing file was a FileExistsError
    traceback, and files written into a step dir lie beside its manifest, so that checkpoint would
    be rejected as foreign at the next resume. A non-empty folder without ``EXPORT_MARKER`` (another
    model's, whose weights and config the export overwrote) is refused unless ``force``."""
    out = out_dir.expanduser().resolve()
    if out.exists() and not out.is_dir():
        raise ValueError(
            f"OUT={str(out_dir)!r} is a file; valid: a folder to write (new, or an earlier export)"
        )
    check_writable_folder(out_dir, out)
    root = step_dir.parent
    if out == root or root in out.parents:
        raise ValueError(
            f"OUT={str(out_dir)!r} is inside the checkpoint root {str(root)!r}: files beside a checkpoint "
            "make it fail its manifest check; valid: a folder outside it (e.g. RUN_DIR/hf)"
        )
    if not force and out.is_dir() and any(out.iterdir()) and not (out / EXPORT_MARKER).is_file():
        raise ValueError(
            f"OUT={str(out_dir)!r} is a folder export-hf did not write (no {EXPORT_MARKER}): refusing to "
            "overwrite it; valid: a new or empty folder, an earlier export, or --force to replace its files"
        )


def check_writable_folder(out_dir: Path, out: Path) -> None:
    """OUT (resolved: ``out``) must be a folder this user can create or fill: under a file it was a
    FileExistsError traceback, in a read-only folder a PermissionError after the weights were read."""
    check_creatable(f"OUT={str(out_dir)!r}", out, "folder")
