"""The command line's shorthands, rewritten into Hydra overrides before composition: any mesh shape
(``mesh=4x8``), ``model.family=NAME`` as the group choice, numeric group choices quoted.
"""

from __future__ import annotations

import re
from pathlib import Path

GROUPS = (
    "recipe",
    "model",
    "tokenizer",
    "data",
    "optimizer",
    "lr_scheduler",
    "mesh",
    "mesh/hardware",
    "sharding",
    "bucketing",
    "nccl",
    "freeze",
    "peft",
    "executor",
    "checkpoint",
    "verify",
    "logger",
    "callbacks",
)


MESH_DIR = Path(__file__).resolve().parents[2] / "conf" / "mesh"


_SHAPE = re.compile(r"[1-9]\d*(x[1-9]\d*)*")


def mesh_shape_overrides(args: list[str], shipped: set[str] | None = None) -> list[str]:
    """Any mesh shape works as written: ``mesh=4x8`` -> ``mesh.shape=[4,8]``, ``mesh=6`` -> ``mesh.shape=[6]``.

    The ``mesh`` group ships a file per common shape (conf/mesh/); any other ``NxM...`` has no file,
    and Hydra would stop with "Could not find 'mesh/4x8'". A shape without a file becomes the
    ``mesh.shape`` list it names; a sweep (``mesh=2x4,4x8``) with any such shape becomes a sweep
    over ``mesh.shape`` lists. Shapes with a file, and anything that is not a shape, pass unchanged.
    """
    if shipped is None:
        shipped = {p.stem for p in MESH_DIR.glob("*.yaml")}
    out = []
    for arg in args:
        key, sep, value = arg.partition("=")
        parts = value.split(",") if sep and key == "mesh" else []
        if parts and all(_SHAPE.fullmatch(p) for p in parts) and not set(parts) <= shipped:
            lists = ",".join("[" + ",".join(p.split("x")) + "]" for p in parts)
            arg = f"mesh.shape={lists}"
        out.append(arg)
    return out


def family_choice_overrides(args: list[str]) -> list[str]:
    """``model.family=qwen3`` (the surface before the model group) selects the group's option:
    ``model=qwen3``; a sweep ``model.family=llama,qwen3`` is ``model=llama,qwen3``. Left as written
    beside an explicit ``model=NAME`` (the two then disagree or repeat: ``check_family_schema``
    refuses a disagreement in one line)."""
    if any(a.partition("=")[0] == "model" for a in args):
        return list(args)
    return [f"model={a.partition('=')[2]}" if a.partition("=")[0] == "model.family" else a for a in args]


def quote_numeric_choices(args: list[str]) -> list[str]:
    """Quote numeric group choices on the command line: ``mesh=4`` -> ``mesh='4'``, after
    ``mesh_shape_overrides`` has turned shapes without a file into ``mesh.shape`` lists.

    Hydra's override parser reads ``4`` as an int and then refuses it as a group choice ("Config group
    override must be a string or a list. Got int"); our mesh options are named by their shape
    (``1``, ``4``, ``2x4``). Sweeps (``mesh=2,4``) are quoted choice by choice. ``model.family=NAME``
    becomes the group choice ``model=NAME`` first (``family_choice_overrides``).
    """
    out = []
    for arg in mesh_shape_overrides(family_choice_overrides(args)):
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+~") in GROUPS and value:
            parts = value.split(",")
            if all(p.isdigit() for p in parts):
                arg = f"{key}=" + ",".join(f"'{p}'" for p in parts)
        out.append(arg)
    return out
