"""The ``recipe`` config group: YAML files outside ``conf/``, registered into Hydra's ConfigStore.

A recipe is configuration, never code: it pins the model shape, data, optimiser and schedule, and may
override other groups' defaults (``defaults: [override /mesh: 2x4]``). Registering each file as an
option of the group ``recipe`` (package ``_global_``) makes ``recipe=NAME`` a real Hydra group, so
``-m recipe=a,b``, ``--cfg job`` and ``--help`` work.

Roots: ``FRAMEWORK_RECIPE_PATH`` (``os.pathsep``-separated) lists extra roots, each a folder or an
installed package's folder as ``pkg://package.subdir`` (a team's recipes shipped as a wheel). A name
in an earlier root wins over the same name in a later one; the shipped ``recipes/`` folder comes last,
and a root's file with a shipped recipe's name is refused (it would replace that recipe silently,
the default ``llama_tiny`` included), as is a file symlinked from outside its root (never read).

Safety: a recipe is untrusted input. Each file is read with a bounded parser and its content checked
(framework.launch.recipe_check: no Hydra keys or groups, no ``@package`` defaults, no resolvers, bounded
interpolation, no keys that reach code or the process) before Hydra sees it. A refused recipe is
registered empty and recorded in ``REFUSED``; ``framework.launch.entry`` refuses to run it, and checks the
composed result again. ``python -m framework recipes list | validate NAME`` (framework.launch.recipe_cli) inspects
the roots.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from framework.config import schema as config
from framework.launch import recipe_check, recipe_places

SHIPPED_ROOT = Path(__file__).resolve().parents[2] / "recipes"
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
PKG_PREFIX = "pkg://"


class RecipeRefused(ValueError):
    """The composed result of a recipe failed a safety check (framework.launch.recipe_check.check_composed)."""


# name -> why it was refused; filled by ``register``.
REFUSED: dict[str, str] = {}


@dataclass(frozen=True)
class Recipe:
    name: str
    path: Path
    description: str
    sha256: str
    root: str = ""  # the root as the user wrote it (a folder or pkg://...)
    refused: str = ""  # why the file is not even read (a symlink out of its root, a shipped name)


def package_root(spec: str) -> Path:
    """``pkg://team_recipes.llama`` -> the folder ``llama`` inside the installed package ``team_recipes``.

    The longest importable package prefix is located without being imported (find_spec imports only
    the parents); the rest of the dotted path names folders inside it.
    """
    dotted = spec[len(PKG_PREFIX) :].strip("/").replace("/", ".")
    parts = [p for p in dotted.split(".") if p]
    if not parts:
        raise ValueError(f"recipe root {spec!r}: expected pkg://package[.subdir]")
    for i in range(len(parts), 0, -1):
        try:
            found = importlib.util.find_spec(".".join(parts[:i]))
        except (ImportError, ValueError):
            found = None
        if found is not None and found.submodule_search_locations:
            base = Path(next(iter(found.submodule_search_locations)))
            return base.joinpath(*parts[i:])
    raise ValueError(
        f"recipe root {spec!r}: no installed package {parts[0]!r} (pip install it, or fix the path)"
    )


def split_path(value: str) -> list[str]:
    """Split on ``os.pathsep``, keeping ``pkg://x`` whole (on POSIX the separator is ``:`` too)."""
    out: list[str] = []
    for part in value.split(os.pathsep):
        if out and out[-1] == PKG_PREFIX.split(":")[0] and part.startswith("//"):
            out[-1] += os.pathsep + part
        else:
            out.append(part)
    return [p for p in out if p]


def recipe_roots() -> list[tuple[str, Path]]:
    """(root as written, folder) for every root, extra roots first, the shipped folder last."""
    roots: list[tuple[str, Path]] = []
    for entry in split_path(os.environ.get("FRAMEWORK_RECIPE_PATH", "")):
        if entry:
            roots.append((entry, package_root(entry) if entry.startswith(PKG_PREFIX) else Path(entry)))
    roots.append(("recipes/", SHIPPED_ROOT))
    return roots


def _unreadable(path: Path, root: Path) -> str:
    """Why a root's file is refused before it is read: a symlink that leaves the root, or the name
    of a shipped recipe in another root (it would replace that recipe silently, the default included)."""
    base = root.resolve()
    if not path.resolve().is_relative_to(base):
        return (
            f"it is a symlink that leaves its root {str(root)!r} (-> {path.resolve()}); a recipe is "
            "read only from inside its root: copy the file in"
        )
    shipped = SHIPPED_ROOT / path.name
    if base != SHIPPED_ROOT.resolve() and shipped.is_file():
        return (
            f"it has the name of the shipped recipe {shipped}, which it would replace; a root may not "
            "replace a shipped recipe: rename the root's file"
        )
    return ""


def discover(roots: list[Path] | list[tuple[str, Path]] | None = None) -> dict[str, Recipe]:
    """Every ``*.yaml`` of every root, first root winning; reads at most ``MAX_RECIPE_BYTES`` of each.
    A symlink out of its root, or a shipped name in another root, is listed refused and not read."""
    found: dict[str, Recipe] = {}
    for item in roots if roots is not None else recipe_roots():
        label, root = item if isinstance(item, tuple) else (str(item), item)
        if not root.is_dir():
            raise ValueError(f"recipe root {label!r} is not a directory (check FRAMEWORK_RECIPE_PATH)")
        for path in sorted(root.glob("*.yaml")):
            if path.stem in found or not path.is_file():
                continue
            why = _unreadable(path, root)
            if why:
                found[path.stem] = Recipe(path.stem, path, "", "", label, why)
                continue
            with path.open("rb") as f:
                data = f.read(recipe_check.MAX_RECIPE_BYTES + 1)  # a larger file is refused on load
            text = data.decode("utf-8", errors="replace")
            first = text.splitlines()[0] if text else ""
            desc = first.lstrip("# ").strip() if first.startswith("#") else ""
            found[path.stem] = Recipe(path.stem, path, desc, hashlib.sha256(data).hexdigest(), label)
    return found


def refusal(node: Any, folder: Path | None = None) -> str | None:
    """Why a recipe's content may not be used, or None (the rules: framework.launch.recipe_check)."""
    return recipe_check.refusal(node, folder)


def register(roots: list[Path] | None = None) -> dict[str, Recipe]:
    """Store every recipe as an option of the ``recipe`` group; returns what was registered.

    Each file is read with a bounded parser (framework.launch.recipe_check.load) and checked before Hydra
    sees it. A refused or unreadable recipe is stored empty (so that composing it cannot run
    anything) and recorded in ``REFUSED``; ``framework.launch.entry`` stops before running it, and the
    other recipes of the root are unaffected.
    """
    recipes = discover(roots)
    for r in recipes.values():
        content, reason = (None, r.refused) if r.refused else recipe_check.load(r.path)
        if reason is None:
            reason = refusal(content, r.path.parent)
        if reason is not None:
            REFUSED[r.name] = f"recipe {r.name!r} ({r.path}) is refused: {reason}"
            content = {}
        else:
            REFUSED.pop(r.name, None)
            content = recipe_places.localized(content, r.path.parent)  # data next to it, made absolute
            content = family_default(content)
        config.store(r.name, content, group="recipe", package="_global_")
    return recipes


def family_default(content: dict[str, Any]) -> dict[str, Any]:
    """A recipe that names its family as a value (``model: {family: qwen3}``, the form before the
    ``model`` group) selects the group's option as well (``override /model: qwen3``), unless its
    defaults list picks one: the family's own keys (``model.sliding_window``) exist only under it."""
    model = content.get("model")
    family = model.get("family") if isinstance(model, dict) else None
    defaults = content.get("defaults") or []
    picks = [str(k).strip() for d in defaults if isinstance(d, dict) for k in d]
    if not isinstance(family, str) or "override /model" in picks:
        return content
    return {**content, "defaults": [{"override /model": family}, *defaults]}


def git_commit(path: Path = SHIPPED_ROOT.parent) -> str | None:
    """The framework checkout's commit (``+dirty`` with local changes), or None outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.TimeoutExpired):
        return None


def provenance(recipe_name: str | None, config_yaml: str) -> dict[str, Any]:
    """What ``provenance.json`` records: which recipe file (and which bytes) made this run, and the code."""
    recipe = discover().get(recipe_name) if recipe_name else None
    return {
        "recipe": recipe_name,
        "recipe_source": str(recipe.path) if recipe else None,
        "recipe_root": recipe.root if recipe else None,
        "recipe_sha256": recipe.sha256 if recipe else None,
        "config_sha256": hashlib.sha256(config_yaml.encode()).hexdigest(),
        "framework_commit": git_commit(),
    }


def compose_nodes(name: str, overrides: list[str] | None = None) -> tuple[Any, Any]:
    """``recipe=NAME`` composed with the shipped conf/ through Hydra's compose API: (the task config,
    the ``hydra`` node), both untyped and unchecked; a refused recipe raises ValueError first."""
    from hydra import compose, initialize_config_dir

    from framework.launch.ranks import register_resolvers

    config.register()
    register()
    register_resolvers()
    if name in REFUSED:
        raise ValueError(REFUSED[name])
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        dcfg = compose(
            "config",
            overrides=config.quote_numeric_choices([f"recipe={name}", *(overrides or [])]),
            return_hydra_config=True,
        )
    return OmegaConf.masked_copy(dcfg, [k for k in dcfg if k != "hydra"]), dcfg.hydra


def compose_recipe(name: str, overrides: list[str] | None = None) -> Any:
    """Compose ``recipe=NAME`` with the shipped conf/ (returns the typed Config), after the checks on
    the composed result (RecipeRefused) and on its keys."""
    task, hydra_cfg = compose_nodes(name, overrides)
    allow = OmegaConf.select(task, "run.instantiate_allow", default=None)
    allow = list(allow) if allow is not None else config.RunConfig().instantiate_allow
    try:
        recipe_check.check_composed(task, hydra_cfg, allow)
    except ValueError as e:
        raise RecipeRefused(str(e)) from None
    from framework.launch.rules import check_known_keys

    check_known_keys(task)
    return config.to_config(task)
