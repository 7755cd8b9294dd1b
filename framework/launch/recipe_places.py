"""Values, not places or trust: the keys a shared recipe may not set, and the data it may name.

``COMMAND_LINE_ONLY`` is the one table, with the reason for each: every path-valued key (checkpoint
and cache dirs, baselines, topology files, weights, resume paths, data and tokenizer files), the
wandb entity, and the switches that lift a safety check or grant trust may only be set to their
default by a recipe (framework.launch.recipe_check applies this with its other rules). Data and
tokenizer paths (``Guard.local``) may name a file or folder inside the recipe's own folder, resolved
there and made absolute (``localized``); ``..``, symlinks or globs leaving it are refused.
``NOT_PLACES`` names the string keys that are values, so that the tests' schema walk classifies
every new field.
"""

from __future__ import annotations

import copy
import os
import re
import typing
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from framework.config import schema as config


@dataclass(frozen=True)
class Guard:
    """A key a recipe may not set (to anything but its schema default): it names a place or grants trust.

    ``local``: a relative path to a file or folder inside the recipe's own folder is allowed (data
    shipped next to the recipe); it is resolved there, and refused when ``..``, a symlink or a
    glob leaves the folder. ``also``: other harmless values. ``example``: a value the generated test
    sets in a recipe (refused) and on the command line (accepted), with ``context`` keys.
    """

    why: str
    example: Any
    local: bool = False
    also: tuple[Any, ...] = ()
    context: tuple[tuple[str, Any], ...] = ()


_CK = (("checkpoint.enabled", True),)
_VERIFY = (("verify.enabled", True),)
_PEFT = (("peft.method", "lora"),)
# Recipes may set values, not places or trust: the one table of what only conf/ or the command line
# may set, and why. tests/launch/test_recipe_check.py walks the schema so that a new path-like field
# cannot be missing here (or from NOT_PLACES below).
COMMAND_LINE_ONLY: dict[str, Guard] = {
    # Places that are written (or deleted).
    "checkpoint.dir": Guard(
        "is where checkpoints are written and retention deletes old steps (another run's would go)",
        "/tmp/team_b/checkpoints",
        context=_CK,
    ),
    "verify.baseline": Guard("is a file the run writes (the baseline store)", "/tmp/b.json", context=_VERIFY),
    "nccl.topo_dump_file": Guard("is a file NCCL writes", "/tmp/topo.xml"),
    "executor.cache_dir": Guard(
        "is a compile cache: compiled code that torch unpickles",
        "/tmp/cache",
        context=(("executor.mode", "compile"),),
    ),
    # Places that are read.
    "data.path": Guard("is a file read as training data", "/etc/passwd", local=True),
    "data.val_path": Guard("is a file read as validation data", "/etc/passwd", local=True),
    "data.mix[].path": Guard("is a file read as training data", "/etc/passwd", local=True),
    "train.eval_sets[].path": Guard("is a file read as validation data", "/etc/passwd", local=True),
    "tokenizer.path": Guard("is a tokenizer file read", "/etc/passwd", local=True),
    "model.init_from": Guard(
        "is a checkpoint or weights folder read (a checkpoint can carry code)", "/tmp/w"
    ),
    "peft.adapter": Guard(
        "is an adapter folder read into the model (weights another party chose)", "/tmp/a", context=_PEFT
    ),
    "checkpoint.resume": Guard(
        "names a checkpoint to load (a checkpoint can carry code)", "/tmp", also=("auto", "none"), context=_CK
    ),
    "verify.reference": Guard("is a fingerprint file read", "/tmp/f.json", context=_VERIFY),
    "nccl.topo_file": Guard("is a topology file NCCL reads", "/tmp/topo.xml"),
    # Other parties: an online account.
    "logger.entity": Guard("is a wandb account the metrics are sent to", "team-b"),
    # Trust: code, safety switches, what later runs are judged by.
    "run.instantiate_allow": Guard(
        "widens the _target_ allowlist (code that is run)", ["framework.", "torch."]
    ),
    "run.oversubscribe": Guard("lifts the CPU rank cap (gloo ranks starve and hang)", True),
    "run.allow_over_memory": Guard("launches a plan over the device memory", True),
    "verify.save_baseline": Guard(
        "records this run as the baseline later runs are judged by", True, context=_VERIFY
    ),
    "run.fault_kill_at_step": Guard("kills a rank on purpose (fault injection)", 2),
    "run.fault_raise_at_step": Guard("raises in a rank on purpose (fault injection)", 2),
    "verify.inject_nan_steps": Guard("makes steps NaN on purpose (fault injection)", [1]),
    # Any callback (``*``: each name), at any depth: a callback is code run at every step.
    "callbacks.*._target_": Guard(
        "names the code a callback runs (a recipe may pick shipped callbacks and set their values)",
        "framework.train.profiling.Profiling",
    ),
}
# Keys that hold strings (or are named like a place) but name no place: values. The schema walk in
# the tests requires each such field to be here or in COMMAND_LINE_ONLY, so a new one is classified.
NOT_PLACES: dict[str, str] = {
    "verify.reference_model_max_params": "a parameter count",
    "model.name": "a label",
    "tokenizer.bos_token": "a token of the vocabulary",
    "tokenizer.eos_token": "a token of the vocabulary",
    "data.field": "a key of each record",
    "data.column": "a column name",
    "data.name": "a dataset configuration name",
    "data.split": "a split name",
    "data.messages_field": "a key of each record",
    "data.prompt_field": "a key of each record",
    "data.response_field": "a key of each record",
    "data.mix[].field": "a key of each record",
    "train.eval_sets[].name": "a label (the metric is val_loss/NAME)",
    "train.eval_sets[].field": "a key of each record",
    "train.eval_sets[].column": "a column name",
    "data.mix[].column": "a column name",
    "data.mix[].name": "a dataset configuration name",
    "data.mix[].split": "a split name",
    "optimizer._target_": "a class, checked against the allowlist",
    "optimizer.kwargs": "keyword values of the optimizer class (names checked against its signature)",
    "mesh.hardware.name": "a label",
    "mesh.hardware.kernel_table": "a table's name inside conf/mesh/hardware/tables (no path: refused)",
    "nccl.preset": "a label",
    "nccl.socket_ifname": "interface names",
    "executor.backend": "a registered torch.compile backend",
    "logger.project": "a project of the user's own account",
    "model.float8_skip": "layer name fragments",
    "freeze.ignore": "module paths inside the model",
    "peft.targets": "module-name patterns inside the model",
    "freeze.export_methods": "method names",
    "logger.tags": "labels",
    "nccl.env": "NCCL variables, checked by name (CODE_LOADING_NCCL)",
    "nccl.preset_env": "NCCL variables, checked by name (CODE_LOADING_NCCL)",
    "callbacks.*": "a callback's own values (a shipped callback reads its places from the keys above)",
}
# Mappings whose keys are names (``callbacks.NAME``): the table says ``*`` for every name.
NAMED = ("callbacks",)
_GLOB = re.compile(r"[*?\[]")
MAX_LOCAL_ENTRIES = 100_000  # a local data folder is walked once for symlinks that leave it


_NO_DEFAULT = object()  # what no recipe value equals: a ``*`` key has no default to keep


def schema_key(pattern: str) -> str:
    """The table's key for a recipe's setting: ``callbacks.NAME.x`` -> ``callbacks.*.x``, and a
    ``_target_`` at any depth below a callback -> ``callbacks.*._target_`` (Hydra builds nested ones)."""
    head, _, rest = pattern.partition(".")
    if head not in NAMED or not rest:
        return pattern
    tail = rest.partition(".")[2]
    if tail.rsplit(".", 1)[-1] == "_target_":
        tail = "_target_"
    return f"{head}.*.{tail}" if tail else f"{head}.*"


def schema_default(key: str) -> Any:
    """The schema's default of a dotted key (``data.mix[].path``: a fresh list entry's)."""
    if "*" in key:
        return _NO_DEFAULT
    obj: Any = config.Config()
    for part in key.split("."):
        if part.endswith("[]"):
            part = part[:-2]
            hint = typing.get_type_hints(type(obj))[part]
            obj = typing.get_args(hint)[0]()
        else:
            obj = getattr(obj, part)
    return obj.value if isinstance(obj, Enum) else obj


def _settings(
    node: Any, pattern: str = "", written: str = "", at: tuple = ()
) -> list[tuple[str, str, tuple, Any]]:
    """Every leaf of a recipe as (schema key, ``[]`` for list entries; key as written; path in the node; value).
    A list is a leaf unless it holds mappings (``data.mix``)."""
    out: list[tuple[str, str, tuple, Any]] = []
    if isinstance(node, dict):
        for k, v in node.items():
            sep = "." if pattern else ""
            out += _settings(v, f"{pattern}{sep}{k}", f"{written}{sep}{k}", (*at, k))
    elif isinstance(node, list) and any(isinstance(v, dict) for v in node):
        for i, v in enumerate(node):
            out += _settings(v, f"{pattern}[]", f"{written}[{i}]", (*at, i))
    else:
        out.append((pattern, written, at, node))
    return out


def _local_path(value: Any, folder: Path | None) -> tuple[str | None, str]:
    """``value`` resolved inside the recipe's ``folder``, or (None, why it may not be used)."""
    if not isinstance(value, str) or not value.strip():
        return None, "is not a path"
    if folder is None:
        return None, "is relative to no recipe folder"
    if "${" in value:
        return None, "is interpolated"
    if value.startswith("~") or Path(value).is_absolute():
        return None, "is not a relative path"
    if _GLOB.search(value):
        return None, "is a glob (name the folder instead)"
    base = folder.resolve()
    target = (base / value).resolve()
    if not target.is_relative_to(base):
        return None, f"leaves the recipe's folder {str(base)!r} (through .. or a symlink)"
    if not target.exists():
        return None, f"does not exist in the recipe's folder {str(base)!r}"
    seen = 0
    for dirpath, dirnames, filenames in os.walk(target) if target.is_dir() else ():
        for name in (*dirnames, *filenames):
            seen += 1
            entry = Path(dirpath, name)
            if seen > MAX_LOCAL_ENTRIES:
                return None, f"holds more than {MAX_LOCAL_ENTRIES} entries"
            if entry.is_symlink() and not entry.resolve().is_relative_to(base):
                return None, f"holds a symlink that leaves the recipe's folder ({entry})"
    return str(target), ""


def check_places(node: dict[str, Any], folder: Path | None) -> tuple[str | None, list[tuple[tuple, str]]]:
    """Why the recipe sets a ``COMMAND_LINE_ONLY`` key (None: it does not), and the local paths
    resolved inside ``folder`` as (path in the node, absolute path) to write back."""
    rewrites: list[tuple[tuple, str]] = []
    for raw, written, at, value in _settings({k: v for k, v in node.items() if k != "defaults"}):
        pattern = schema_key(raw)
        if isinstance(value, str) and "${" in value:
            covers = [
                k for k in COMMAND_LINE_ONLY if k == pattern or k.startswith((f"{pattern}.", f"{pattern}["))
            ]
            if covers:
                return (
                    f"it sets {written}={value[:80]!r}, an interpolation that would set {covers[0]}, which "
                    f"{COMMAND_LINE_ONLY[covers[0]].why}; a recipe may set values, not places or trust: "
                    f"set {covers[0]} on the command line"
                ), []
        guard = COMMAND_LINE_ONLY.get(pattern)
        if guard is None or value == schema_default(pattern) or value in guard.also:
            continue
        problem = ""
        if guard.local:
            resolved, problem = _local_path(value, folder)
            if resolved is not None:
                rewrites.append((at, resolved))
                continue
            problem = f" (a recipe may name a file or folder inside its own folder; this path {problem})"
        return (
            f"it sets {written}={value!r}, which {guard.why}{problem}; a recipe may set values, not places "
            f"or trust: set {written} on the command line"
        ), []
    return None, rewrites


def localized(node: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The recipe with its local paths (data next to it) made absolute inside ``folder``."""
    _, rewrites = check_places(node, folder)
    out = copy.deepcopy(node)
    for at, resolved in rewrites:
        parent = out
        for k in at[:-1]:
            parent = parent[k]
        parent[at[-1]] = resolved
    return out
