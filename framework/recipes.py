"""The ``recipe`` config group: YAML files outside ``conf/``, registered into Hydra's ConfigStore.

A recipe is configuration, never code: it pins the model shape, data, optimiser and schedule, and may
override other groups' defaults (``defaults: [override /mesh: 2x4]``). Registering each file as an
option of the group ``recipe`` (package ``_global_``) makes ``recipe=NAME`` a real Hydra group, so
``-m recipe=a,b``, ``--cfg job`` and ``--help`` work. Extra roots (team folders) come from the
``FRAMEWORK_RECIPE_PATH`` environment variable (``os.pathsep``-separated); a name in an earlier root
wins over the same name in a later one, and the shipped ``recipes/`` folder comes last.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

SHIPPED_ROOT = Path(__file__).resolve().parent.parent / "recipes"


@dataclass(frozen=True)
class Recipe:
    name: str
    path: Path
    description: str
    sha256: str


def recipe_roots() -> list[Path]:
    extra = [Path(p) for p in os.environ.get("FRAMEWORK_RECIPE_PATH", "").split(os.pathsep) if p]
    return [*extra, SHIPPED_ROOT]


def discover(roots: list[Path] | None = None) -> dict[str, Recipe]:
    found: dict[str, Recipe] = {}
    for root in roots if roots is not None else recipe_roots():
        if not root.is_dir():
            raise ValueError(f"recipe root {str(root)!r} is not a directory (check FRAMEWORK_RECIPE_PATH)")
        for path in sorted(root.glob("*.yaml")):
            if path.stem in found:
                continue
            text = path.read_text()
            first = text.splitlines()[0] if text else ""
            desc = first.lstrip("# ").strip() if first.startswith("#") else ""
            found[path.stem] = Recipe(path.stem, path, desc, hashlib.sha256(text.encode()).hexdigest())
    return found


def register(roots: list[Path] | None = None) -> dict[str, Recipe]:
    """Store every recipe as an option of the ``recipe`` group; returns what was registered."""
    recipes = discover(roots)
    cs = ConfigStore.instance()
    for r in recipes.values():
        cs.store(group="recipe", name=r.name, node=OmegaConf.load(r.path), package="_global_")
    return recipes
