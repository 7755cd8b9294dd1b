"""What a recipe may contain: the checks that make a shared recipe plain configuration.

A recipe comes from another team, like a pickle from the internet. Hydra composes it with
``package=_global_`` before any of our code runs, and Hydra itself instantiates ``hydra.callbacks``,
launchers and sweepers, sets ``hydra.job.env_set`` in the process and adds ``hydra.searchpath``
sources. So what a recipe file holds is checked when it is registered, on its raw YAML, and a
refused recipe is registered empty (framework.launch.recipes); nothing of it ever reaches Hydra.

The rules, each closing one way in:
- **Bounded parsing**: at most ``MAX_RECIPE_BYTES``, UTF-8, nesting at most ``MAX_YAML_DEPTH``,
  and no YAML anchors or aliases (``&a`` / ``*a``: an alias bomb of a few hundred bytes expands
  to gigabytes). Scanned as a stream of events, so a refused file costs its length, never its
  expansion.
- **Top-level keys** are the schema's groups (``model``, ``train``...) and ``defaults``; never
  ``hydra``.
- **Defaults** entries are ``_self_`` or ``override /GROUP: OPTION`` for a config group other than
  ``recipe`` (``override /callbacks: [default, NAME]``: a list of options); no ``@package`` (which moves content anywhere, ``hydra.callbacks`` included), no
  Hydra groups, no interpolated choices.
- **No resolvers**: ``${oc.env:...}``, ``${oc.decode:...}`` and every other ``${name:...}`` call
  read or compute outside the config; a recipe may only interpolate other keys
  (``${train.seq_len}``). There is no allowlist: pass a value from the environment on the command
  line (``train.lr=$LR``), where the user sees it.
- **Bounded interpolation**: every value's expansion is estimated without resolving it
  (framework.config.interpolation): a string-doubling chain or a cycle is refused.
- **Values, not places or trust** (``COMMAND_LINE_ONLY`` of framework.launch.recipe_places, one
  table with the reason for each): every path-valued key (checkpoint and cache dirs, baselines,
  topology files, weights, resume paths, data and tokenizer files), the wandb entity, and the switches that lift a safety check
  or grant trust (``run.instantiate_allow``, ``run.oversubscribe``...) may only be set to their
  default; a callback's ``_target_`` (the code it runs) may not be set at all: a recipe picks
  callbacks by name and sets their values. Data and tokenizer paths may name a file or folder inside the recipe's own folder
  (resolved there and made absolute; ``..``, symlinks or globs leaving it are refused). Set any
  other place on the command line or in conf/, where the user sees it. In ``nccl.env`` /
  ``nccl.preset_env``: only known NCCL variables, none that loads a library or names a file
  (``CODE_LOADING_NCCL``).

- **No instructions to Hydra**: no key that starts with ``_`` at any depth (inside lists of lists
  too): ``_target_`` builds an object, ``_args_`` / ``_partial_`` / ``_recursive_`` / ``_convert_``
  change the call. The one exception, ``optimizer._target_``, must name an allowed optimizer class.

``_target_`` values are checked on the composed config (framework.config.instantiate), the ``hydra``
node included.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path
from typing import Any

import yaml

from framework.config import schema as config
from framework.config.interpolation import check_expansion, resolver_calls
from framework.launch.recipe_places import check_places

MAX_RECIPE_BYTES = 1 << 20  # 1 MiB: the largest shipped recipe is under 1 KiB
MAX_YAML_DEPTH = 32  # nested mappings/lists; a recipe needs 3

TOP_LEVEL = tuple(f.name for f in dataclasses.fields(config.Config))
# Groups a recipe may override: every group but ``recipe`` (its options are untrusted files too).
RECIPE_GROUPS = tuple(g for g in config.GROUPS if g != "recipe")
LIST_GROUPS = ("callbacks",)  # groups whose choice may be a list of options (callbacks=[default,NAME])
_DEFAULT_KEY = re.compile(r"override /(?P<group>[a-z_][a-z0-9_/]*)")
_OPTION = re.compile(r"[A-Za-z0-9_.\-]+")

# NCCL variables that make every rank load code or read more variables from a file.
CODE_LOADING_NCCL = {
    "NCCL_NET_PLUGIN": "loads a shared library into every rank",
    "NCCL_TUNER_PLUGIN": "loads a shared library into every rank",
    "NCCL_PROFILER_PLUGIN": "loads a shared library into every rank",
    "NCCL_CONF_FILE": "reads more variables (plugins included) from a file",
    "NCCL_DEBUG_FILE": "writes NCCL's log to a file anywhere",
}


class _Refused(Exception):
    """Internal: carries a refusal reason out of the YAML scan."""


def _check_events(text: str) -> None:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    depth = 0
    try:
        for event in yaml.parse(text, Loader=loader):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                raise _Refused(
                    "it uses YAML anchors/aliases (&name / *name), which can expand without bound; "
                    "write the values out"
                )
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > MAX_YAML_DEPTH:
                    raise _Refused(f"it nests deeper than {MAX_YAML_DEPTH} levels")
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise _Refused(f"it is not valid YAML: {problem}{where}") from None


def load(path: Path) -> tuple[Any, str | None]:
    """The recipe's content as a plain container, or (None, why it cannot be read safely).

    Bounded: reads at most ``MAX_RECIPE_BYTES + 1`` bytes and never expands an alias.
    """
    with path.open("rb") as f:
        data = f.read(MAX_RECIPE_BYTES + 1)
    if len(data) > MAX_RECIPE_BYTES:
        return None, f"it is larger than {MAX_RECIPE_BYTES} bytes"
    if data not in _LOADED:
        if len(_LOADED) >= 512:
            _LOADED.clear()
        _LOADED[data] = _parse(data)
    content, reason = _LOADED[data]
    return copy.deepcopy(content), reason


# A file's bytes -> what ``load`` makes of them: every compose registers every recipe again (the
# launcher, train.py, the suite's hundreds of in-process composes), and parsing the 40 shipped files
# each time was half of a compose. Keyed by the bytes themselves, so an edited file is parsed anew.
_LOADED: dict[bytes, tuple[Any, str | None]] = {}


def _parse(data: bytes) -> tuple[Any, str | None]:
    """``load``'s checks and parse of a file's bytes (at most ``MAX_RECIPE_BYTES``)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"it is not UTF-8 text ({e})"
    try:
        _check_events(text)
    except _Refused as e:
        return None, str(e)
    from omegaconf import OmegaConf

    try:
        node = OmegaConf.create(text) if text.strip() else OmegaConf.create({})
    except Exception as e:  # noqa: BLE001 - OmegaConf's YAML/grammar errors all mean "cannot be read"
        return None, f"it cannot be read ({type(e).__name__}: {' '.join(str(e).split())})"
    return OmegaConf.to_container(node, resolve=False), None


def _check_defaults(entries: Any) -> str | None:
    valid = "`override /GROUP: OPTION` with GROUP one of " + ", ".join(RECIPE_GROUPS) + ", or `_self_`"
    if not isinstance(entries, list):
        return f"its defaults must be a list of {valid}"
    for entry in entries:
        if entry == "_self_":
            continue
        text = str(entry)
        if "hydra" in text:
            return f"its defaults select a Hydra option ({text}); a recipe may not configure Hydra"
        ok = isinstance(entry, dict) and len(entry) == 1
        if ok:
            ((key, value),) = entry.items()
            m = _DEFAULT_KEY.fullmatch(str(key).strip())
            values = (
                value if isinstance(value, list) and m is not None and m["group"] in LIST_GROUPS else [value]
            )
            ok = (
                m is not None
                and m["group"] in RECIPE_GROUPS
                and bool(values)
                and all(
                    isinstance(v, (str, int))
                    and not isinstance(v, bool)
                    and _OPTION.fullmatch(str(v)) is not None
                    for v in values
                )
            )
        if not ok:
            return (
                f"its defaults entry {text} is not allowed (a package `@...`, the recipe group or an "
                f"interpolated choice can move content anywhere, hydra.* included); valid: {valid}"
            )
    return None


# The one key a recipe may set that starts with `_`: the optimizer's class, checked against the
# allowlist of exact classes like every other target (framework.config.instantiate).
RECIPE_UNDERSCORE_KEYS = ("optimizer._target_",)


def _underscore_keys(node: Any, prefix: str = "") -> list[str]:
    """Every mapping key that starts with `_`, at any depth (inside lists of lists too), as its path."""
    out: list[str] = []
    if isinstance(node, dict):
        for k, v in node.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            out += [key] if str(k).startswith("_") else []
            out += _underscore_keys(v, key)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _underscore_keys(v, f"{prefix}[{i}]")
    return out


def _check_underscore_keys(body: dict[str, Any]) -> str | None:
    """Keys that start with `_` are Hydra's instructions (``_target_`` builds an object, ``_args_``
    passes positional arguments, ``_partial_`` / ``_recursive_`` / ``_convert_`` change how): a
    recipe is values, so it sets none of them, at any depth, but ``optimizer._target_``."""
    for key in _underscore_keys(body):
        if key not in RECIPE_UNDERSCORE_KEYS:
            return (
                f"it sets {key}: a key starting with `_` is an instruction to Hydra (_target_ builds an "
                "object, _args_ / _partial_ / _recursive_ / _convert_ change the call); a recipe is "
                f"values only (the one such key it may set: {', '.join(RECIPE_UNDERSCORE_KEYS)})"
            )
    return None


def _walk_strings(node: Any, prefix: str = "") -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _walk_strings(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _walk_strings(v, f"{prefix}[{i}]")
    elif isinstance(node, str):
        out.append((prefix, node))
    return out


def _check_nccl(node: dict[str, Any]) -> str | None:
    from framework.planner.topology import check_variable_name

    nccl = node.get("nccl")
    if not isinstance(nccl, dict):
        return None
    for source in ("env", "preset_env"):
        variables = nccl.get(source) or {}
        if not isinstance(variables, dict):
            continue
        for name in variables:
            if name in CODE_LOADING_NCCL:
                return (
                    f"it sets nccl.{source}.{name}, which {CODE_LOADING_NCCL[name]}; only conf/ or the "
                    "command line may set it"
                )
            try:
                check_variable_name(str(name), f"nccl.{source}")
            except ValueError as e:
                return str(e)
    return None


def refusal(node: Any, folder: Path | None = None) -> str | None:
    """Why a recipe's raw content may not be used, or None. See the module docstring for the rules.
    ``folder``: the recipe's own folder, inside which it may name data files (COMMAND_LINE_ONLY)."""
    if not isinstance(node, dict):
        return "a recipe must be a YAML mapping"
    if "hydra" in node:
        return "it sets `hydra:` keys (a recipe may not configure Hydra: callbacks and launchers run code)"
    unknown = [str(k) for k in node if k not in TOP_LEVEL and k != "defaults"]
    if unknown:
        return f"it sets top-level key(s) {unknown}; valid: defaults, {', '.join(TOP_LEVEL)}"
    if "defaults" in node:
        reason = _check_defaults(node["defaults"])
        if reason:
            return reason
    reason = _check_nccl(node)
    if reason:
        return reason
    body = {k: v for k, v in node.items() if k != "defaults"}
    for key, value in _walk_strings(body):
        try:
            calls = resolver_calls(value)
        except ValueError as e:
            return f"{key}={value[:80]!r}: {e}"
        if calls:
            return (
                f"{key}={value[:80]!r} calls the resolver {calls[0]!r}; a recipe may interpolate other "
                "keys (${train.seq_len}) but call no resolver (oc.env, oc.decode... read outside the "
                "config): pass such a value on the command line"
            )
    try:
        check_expansion(body)
    except ValueError as e:
        return str(e)
    return check_places(node, folder)[0] or _check_underscore_keys(body)


def check_choices(choices: Any) -> None:
    """Refuse recipe content placed anywhere but the top level (``recipe@PACKAGE=NAME``).

    Applied to the composed result's ``hydra.runtime.choices``, whatever put the entry there (a
    recipe's defaults, another group, the command line): a package moves untrusted content into any
    node, ``hydra.callbacks`` included.
    """
    for key, value in dict(choices or {}).items():
        group, _, package = str(key).partition("@")
        if group.strip("/") == "recipe" and package:
            raise ValueError(
                f"the recipe {value!r} is composed into {package!r} ({key}={value}); a recipe may only be "
                "chosen as recipe=NAME (at the top level of the config)"
            )


def check_composed(dcfg: Any, hydra_cfg: Any, allow: list[str]) -> None:
    """The checks on the composed result, before anything resolves it (see the module docstring).

    ``dcfg`` is the task config, ``hydra_cfg`` the ``hydra`` node (None when composed without it).
    Order matters: the expansion bound runs before the ``_target_`` scan, which resolves values.
    """
    from omegaconf import OmegaConf

    from framework.config.instantiate import check_hydra_targets, check_targets

    if hydra_cfg is not None:
        check_choices(OmegaConf.select(hydra_cfg, "runtime.choices", default=None))
    check_expansion(OmegaConf.to_container(dcfg, resolve=False))
    check_targets(dcfg, allow)
    if hydra_cfg is not None:
        check_hydra_targets(hydra_cfg, allow)
