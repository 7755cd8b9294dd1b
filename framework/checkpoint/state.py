"""What a checkpoint holds, and how each part is read back without unpickling arbitrary objects.

Three kinds of state, three carriers:

* Tensors (model parameters and buffers, optimizer moments and step counters) go through DCP, via
  ``get_state_dict`` / ``set_state_dict``: the same code path for a plain module, DDP, FSDP2 and TP
  DTensors, and DCP reshards on load when the layout or world size changed.
* Replicated plain values (the caller's ``extra``, the LR scheduler's state, the optimizer's
  ``param_groups``) go into ``extra.json``, written by rank 0. Keeping them out of DCP keeps the
  DCP payload tensor-only: DCP stores non-tensor values with ``torch.save`` and reads them back with
  ``torch.load(weights_only=False)``, i.e. arbitrary unpickling.
* Per-rank RNG states go into ``rng/rank_NNNNN.json``, one per rank, written by that rank.

DCP's ``.metadata`` file is itself a pickle; ``SafeReader`` reads it with an unpickler that only
admits DCP's own tensor metadata classes, ``torch.Size``, dtypes and layouts, and ``check_metadata``
refuses any entry that is not a tensor: DCP reads a bytes entry with ``torch.load(weights_only=False)``,
and the framework never saves one, so a checkpoint that declares one was crafted (its manifest too).

RNG on a world-size change: rank r restores ``rank_r`` when that file exists. When the new world is
larger, the new ranks keep the RNG state they were seeded with; when it is smaller, the states of
the vanished ranks are dropped. Either way the data order is unaffected (the data position is
global and replicated); only dropout-like randomness on those ranks differs from an unbroken run.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from framework.parallel.pipeline import is_pipeline

EXTRA_FILE = "extra.json"
RNG_DIR = "rng"


def rng_file(rank: int) -> str:
    return f"{RNG_DIR}/rank_{rank:05d}.json"


def tensor_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], list[dict]]:
    """The DCP payload (tensors only) and the optimizer's ``param_groups`` (plain values).

    ``get_state_dict`` names parameters by their unwrapped FQN (no ``module.`` from DDP), so a
    checkpoint saved from DDP loads into FSDP2 or a plain module. On an optimizer that has not
    stepped yet it runs one zero-lr step to allocate the moments DCP loads into.
    """
    msd, osd = get_state_dict(model, optimizer, options=_options(model))
    msd = to_dcp(model, {k: _plain(v) for k, v in msd.items()})
    return {"model": msd, "optim": {"state": osd["state"]}}, osd["param_groups"]


_EMBEDDING, _OUTPUT = "tok_embeddings.weight", "output.weight"


def _options(model: nn.Module) -> StateDictOptions:
    """Frozen weights (``peft.method=lora``: the base, rebuilt from ``model.init_from`` or the seed
    at every start) stay out of checkpoints: a LoRA checkpoint holds the adapters and their
    optimizer state only. The load is then not strict, as the state names no frozen weight."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def _tied(model: nn.Module) -> str | None:
    """How this rank holds a tied weight (``model.tie_embeddings``): "alias" (one process: its
    state dict names the embedding's parameter twice), "copy" (a pipeline's last stage holds its
    copy, without the embedding) or "both" (one pipeline rank holds the embedding and the copy:
    zbv); None: untied, or neither here."""
    if is_pipeline(model):
        return None if not model.tied_copies else ("both" if model.has_first else "copy")
    named = list(model.named_parameters(remove_duplicate=False))  # wrappers prefix the names
    out = [p for n, p in named if n.endswith(_OUTPUT)]
    emb = [p for n, p in named if n.endswith(_EMBEDDING)]
    if out and not emb and getattr(getattr(model, "cfg", None), "tie_embeddings", False):
        return "copy"  # one pipeline stage on its own (model.init_from loads each stage)
    return "alias" if out and emb and out[0] is emb[0] else None


def to_dcp(model: nn.Module, msd: dict[str, Any]) -> dict[str, Any]:
    """The model's DCP payload: a tied weight once, as ``tok_embeddings.weight``, at any pp degree
    (a pipeline's last stage offers its copy under that name: DCP writes one replica, and reads the
    embedding into it). ``from_dcp`` undoes it after a load."""
    how, out = _tied(model), dict(msd)
    if how == "copy" and _OUTPUT in out:  # a frozen copy (peft=lora) is not in the state
        out[_EMBEDDING] = out.pop(_OUTPUT)
    elif how is not None:
        out.pop(_OUTPUT, None)
    return out


def from_dcp(model: nn.Module, loaded: dict[str, Any]) -> dict[str, Any]:
    """The model state dict to set from a payload that ``to_dcp`` made and DCP filled:
    ``output.weight`` again, with the embedding's value."""
    how, out = _tied(model), dict(loaded)
    if how == "copy" and _EMBEDDING in out:
        out[_OUTPUT] = out.pop(_EMBEDDING)
    elif how is not None and _EMBEDDING in out:  # a frozen embedding is not in a LoRA checkpoint
        out[_OUTPUT] = out[_EMBEDDING]
    return out


def _plain(t: Any) -> Any:
    """A weight that FSDP2 all-gathers in float8 (model.float8=tensorwise) has a torchao subclass,
    ``WeightWithDynamicFloat8CastTensor``, as its local shard: DCP would pickle that class into the
    checkpoint, and ``torch.load(weights_only=True)`` refuses it wherever torchao's float8 module is
    not imported (a resume with float8 off). The DTensor of the plain fp32 shard it wraps (the same
    storage, so a load writes into the parameter) keeps the files plain tensors."""
    if isinstance(t, DTensor) and type(t._local_tensor).__name__ == "WeightWithDynamicFloat8CastTensor":
        return DTensor.from_local(
            t._local_tensor._tensor,
            t.device_mesh,
            t.placements,
            run_check=False,
            shape=t.shape,
            stride=t.stride(),
        )
    return t


def apply_tensor_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    payload: dict[str, Any],
    param_groups: list[dict],
    names: list[dict] | None = None,
) -> None:
    """Load a filled DCP payload and the saved ``param_groups`` into the model and optimizer.

    ``names``: this rank's own groups from ``tensor_state`` (parameter names). The saved groups are
    rank 0's; their hyper-parameters hold on every rank, but under pipeline parallelism each rank's
    groups list other parameters (its own stages'), and a resume on another pp degree regroups them,
    so each group takes this rank's parameter names.
    """
    current = optimizer.state_dict()["param_groups"]
    if len(current) != len(param_groups):
        raise ValueError(
            f"checkpoint has {len(param_groups)} optimizer param groups, the optimizer has {len(current)}"
        )
    groups = [_retype_like(saved, now) for saved, now in zip(param_groups, current, strict=True)]
    if names is not None:
        groups = [{**g, "params": own["params"]} for g, own in zip(groups, names, strict=True)]
    osd = {"state": payload["optim"]["state"], "param_groups": groups}
    set_state_dict(
        model,
        optimizer,
        model_state_dict=from_dcp(model, payload["model"]),
        optim_state_dict=osd,
        options=_options(model),
    )


def _retype_like(saved: dict, now: dict) -> dict:
    """JSON turned tuples (AdamW's ``betas``) into lists: give values back the current types."""
    out = dict(saved)
    for k, v in now.items():
        if isinstance(v, tuple) and isinstance(out.get(k), list):
            out[k] = tuple(out[k])
    return out


def check_json(name: str, value: object) -> str:
    """Serialise ``value`` or raise ValueError naming the part that is not a plain JSON value."""
    try:
        return json.dumps(value, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"checkpoint {name} must hold plain JSON values (str, int, float, bool, None, lists, dicts "
            f"with str keys): {e}"
        ) from e


_EXTRA_TYPES: dict[str, type | tuple[type, ...]] = {
    "extra": dict,
    "scheduler": dict,
    "param_groups": list,
    "step": int,
    "world_size": int,
}


def read_extra(step_dir: Path) -> dict[str, Any]:
    """``step_dir/extra.json``, or ValueError saying what is wrong with it: one that parses but
    holds other types (a list, ``"extra": 5``) was an AttributeError traceback on every resume."""
    path = Path(step_dir) / EXTRA_FILE
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: {e!r}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path} holds a {type(doc).__name__}, expected an object")
    for key, kind in _EXTRA_TYPES.items():
        if not isinstance(doc.get(key), kind) or isinstance(doc.get(key), bool):
            raise ValueError(
                f"{path}: {key!r} is {doc.get(key)!r:.60}, expected a {getattr(kind, '__name__', kind)}"
            )
    if not all(isinstance(g, dict) for g in doc["param_groups"]):
        raise ValueError(f"{path}: 'param_groups' must be a list of objects")
    why = _trainer_extra_error(doc["extra"], doc["step"], Path(step_dir).name)
    if why is not None:
        raise ValueError(f"{path}: {why}")
    return doc


# What a resume reads from the ``extra`` the trainer writes (framework.checkpoint.session).
RESUMED_KEYS = ("step", "data")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _trainer_extra_error(extra: dict[str, Any], step: int, name: str) -> str | None:
    """What is wrong with the trainer's part of extra.json (None: nothing), for the keys it holds.
    Why: they were taken as they were: ``extra.step=1000`` in step_000002 "resumed" at step 1000
    and trained nothing (exit 0), -3 ran until the kernel killed it, "2" (a string) passed through
    ``int``, and a string ``tokens_seen`` or a config hash that is a number were tracebacks."""
    if step < 0 or (name.startswith("step_") and name[5:].isdigit() and int(name[5:]) != step):
        return f"'step' is {step}, not this step dir's ({name})"
    missing = [k for k in RESUMED_KEYS if k not in extra]
    if (
        "config_hash" in extra and missing
    ):  # the trainer's (framework.checkpoint.session): a KeyError on resume
        return f"'extra' lacks {missing}, which the trainer writes and a resume reads"
    if "step" in extra and (not _count(extra["step"]) or extra["step"] != step):
        return f"'extra.step' is {extra['step']!r:.40}, not the checkpoint's step {step}"
    if "tokens_seen" in extra and not _count(extra["tokens_seen"]):
        return f"'extra.tokens_seen' is {extra['tokens_seen']!r:.40}, expected an integer >= 0"
    data = extra.get("data", {})
    if not isinstance(data, dict) or not _count(data.get("consumed_batches", 0)):
        return f"'extra.data' is {data!r:.60}, expected the sampler's state (consumed_batches >= 0)"
    if "seed" in data and not _count(data["seed"]):
        return f"'extra.data.seed' is {data['seed']!r:.40}, expected an integer >= 0"
    for key, kind in (("config_hash", str), ("wandb_run_id", str), ("model", dict)):
        if extra.get(key) is not None and not isinstance(extra[key], kind):
            return f"'extra.{key}' is {extra[key]!r:.40}, expected a {kind.__name__} or null"
    return None


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def capture_rng() -> dict[str, Any]:
    """This rank's torch CPU RNG state, and every CUDA device's when CUDA is initialised."""
    state: dict[str, Any] = {"torch": _b64(torch.get_rng_state()), "cuda": []}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(_unb64(state["torch"]))
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            raise ValueError(
                f"checkpoint has CUDA RNG states for {len(cuda)} devices, this process sees "
                f"{torch.cuda.device_count()}"
            )
        torch.cuda.set_rng_state_all([_unb64(s) for s in cuda])


# DCP's .metadata pickle refers to exactly these globals (checked with pickletools on torch 2.13).
_META = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    (_META, n)
    for n in (
        "Metadata",
        "MetadataIndex",
        "ChunkStorageMetadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class UnsafeCheckpoint(ValueError, pickle.UnpicklingError):
    """A checkpoint whose metadata names something a framework checkpoint never holds."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


def check_metadata(metadata: object, path: Path) -> Metadata:
    """``metadata`` if it is DCP Metadata of tensors only, else UnsafeCheckpoint naming ``path``."""
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"{path} holds a {type(metadata).__name__}, not DCP Metadata")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise UnsafeCheckpoint(
                f"{path}: entry {key!r} is a {type(entry).__name__}, not a tensor; a framework "
                "checkpoint holds only tensors (a non-tensor entry would be unpickled), refused"
            )
    return metadata


def read_metadata(step_dir: Path) -> Metadata:
    """The checked metadata of a DCP checkpoint (UnsafeCheckpoint, a ValueError, when refused;
    OSError when unreadable)."""
    path = Path(step_dir) / ".metadata"
    try:
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except UnsafeCheckpoint as e:
        raise UnsafeCheckpoint(f"{path}: {e}, refused") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, TypeError) as e:
        raise UnsafeCheckpoint(f"{path} is not a DCP metadata pickle: {e!r}") from None
    return check_metadata(metadata, path)


class SafeReader(FileSystemReader):
    """DCP's file reader with an allowlisting unpickler for ``.metadata`` (``read_metadata``)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load_dcp(payload: dict[str, Any], step_dir: Path, **kwargs: Any) -> None:
    """``dcp.load`` from ``step_dir`` through ``SafeReader``, its metadata checked first: DCP wraps
    a refusal inside ``read_metadata`` into a multi-line CheckpointException; this is one ValueError."""
    import torch.distributed.checkpoint as dcp

    read_metadata(Path(step_dir))
    dcp.load(payload, storage_reader=SafeReader(step_dir), **kwargs)
