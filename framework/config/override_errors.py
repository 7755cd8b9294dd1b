"""A command-line override that Hydra or OmegaConf rejects at compose time, as one line and exit 2.

Hydra 1.3 reports a composition error in ``run_and_report``: several lines (OmegaConf's message, its
``full_key`` / ``reference_type`` / ``object_type``, the search path, a pointer to
``HYDRA_FULL_ERROR``) and exit status 1. Every other bad input of this project is one line naming the
value and what is valid, exit status 2, nothing written. Hydra has no hook for composition errors,
so ``one_line_errors`` wraps its config loader for the length of one ``train.py`` launch: every
composition goes through ``ConfigLoaderImpl.load_configuration`` (the run, a sweep's master config,
the sweeper's check of each job, ``--cfg``, ``--help``, ``--info``), and a rejected override ends
the launch there. It adds no composition: a launch costs what it did. ``HYDRA_FULL_ERROR=1`` leaves
Hydra as it is (its full traceback, for debugging), and so does shell completion, which composes
partial command lines and expects them to fail. An error that no override caused, in a file the
user may have written (a recipe on ``FRAMEWORK_RECIPE_PATH`` whose defaults list names an option that
does not exist, ``callbacks: [default, nosuch]``, or sets a key or value the schema refuses), is one
line too, naming the file as Hydra does (``recipe/NAME``): it was Hydra's report and exit status 1.
Anything else keeps Hydra's report.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    ConfigTypeError,
    OmegaConfBaseException,
    ValidationError,
)

from framework.config.schema import GROUPS, family_of, owners

# Keys listed in full up to this many; beyond, the closest ones and where to see them all.
LIST_AT_MOST = 30
# What a group accepts besides its files (framework.config.schema.mesh_shape_overrides).
GROUP_HINTS = {"mesh": "or any shape of positive integers such as 6 or 4x8 (it sets mesh.shape)"}
SYNTAX = (
    "an override is KEY=VALUE, GROUP=OPTION, +KEY=VALUE or ~KEY; a list is KEY=[a,b]; "
    "quote a string with special characters: KEY='a,b'"
)
SWEEP_FILE = "multirun.yaml"


class Rejected(SystemExit):
    """A rejected override: exit status 2 and its line. A ``SystemExit`` so that Hydra's
    ``except Exception`` handlers (``get_mode``, ``run_and_report``) let it through."""

    def __init__(self, line: str) -> None:
        super().__init__(2)
        self.line = line


@contextlib.contextmanager
def one_line_errors(argv: Sequence[str]) -> Iterator[None]:
    """Within: a rejected override prints ``error: <line>`` on stderr and exits 2, having written
    nothing (a sweep dir holding only the ``multirun.yaml`` Hydra's sweeper writes before it checks
    the jobs is removed). ``argv``: the command line, for ``-sc`` (shell completion)."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1" or {"-sc", "--shell-completion"} & set(argv):
        yield
        return
    load, load_sweep = ConfigLoaderImpl.load_configuration, ConfigLoaderImpl.load_sweep_config

    def load_configuration(
        self: ConfigLoaderImpl,
        config_name: str | None,
        overrides: list[str],
        run_mode: RunMode,
        *args: Any,
        **kwargs: Any,
    ) -> DictConfig:
        try:
            return load(self, config_name, overrides, run_mode, *args, **kwargs)
        except Exception as e:
            if isinstance(e, MissingConfigException) and e.options is None and e.missing_cfg_file:
                # A list choice (callbacks=[default,typo]): Hydra names the file, not the options.
                group = e.missing_cfg_file.rpartition("/")[0]
                e.options = sorted(self.get_group_options(group)) if group else None
            line = explain(e, overrides)
            if line is None:
                line = explain_file_error(e, overrides)
            if line is None:
                raise
            raise Rejected(line) from e

    def load_sweep_config(
        self: ConfigLoaderImpl, master_config: DictConfig, sweep_overrides: list[str]
    ) -> DictConfig:
        try:
            return load_sweep(self, master_config, sweep_overrides)
        except Rejected:
            discard_sweep_dir(Path(master_config.hydra.sweep.dir))
            raise

    ConfigLoaderImpl.load_configuration = load_configuration
    ConfigLoaderImpl.load_sweep_config = load_sweep_config
    try:
        yield
    except Rejected as e:
        print(f"error: {e.line}", file=sys.stderr)
        sys.exit(2)
    finally:
        ConfigLoaderImpl.load_configuration, ConfigLoaderImpl.load_sweep_config = load, load_sweep


def discard_sweep_dir(sweep_dir: Path) -> None:
    """Remove a sweep dir that holds only the ``multirun.yaml`` written for this invocation, and its
    parent when that is left empty (``multirun/``); never anything else."""
    if sweep_dir.is_dir() and {p.name for p in sweep_dir.iterdir()} <= {SWEEP_FILE}:
        shutil.rmtree(sweep_dir, ignore_errors=True)
        parent = sweep_dir.parent
        if parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()


def explain(error: BaseException, overrides: Sequence[str]) -> str | None:
    """The one line (without ``error:``) for a composition error one of ``overrides`` caused, or
    None when none did. It names the override as written and what is valid."""
    if isinstance(error, OverrideParseException):
        return _unparsable(error)
    parsed = _parse(overrides)
    for o in parsed:
        if not o.key_or_group:
            return f"{o.input_line}: no key before '='; {SYNTAX}"
    if isinstance(error, MissingConfigException):
        return _missing_option(error, parsed)
    cause = error.__cause__
    if isinstance(error, ConfigCompositionException) and isinstance(cause, OmegaConfBaseException):
        o = _culprit(parsed, str(error))
        if o is None:
            return _other_family(str(error), parsed)
        return f"{o.input_line}: {_rejected_value(cause, o.key_or_group)}"
    if isinstance(error, ConfigCompositionException):
        return _other_family(str(error), parsed) or _composition(str(error), parsed)
    if isinstance(error, ValueError) and "Config group override must be a string" in str(error):
        for o in (
            parsed
        ):  # a number as a group's option (framework.config.schema.quote_numeric_choices quotes ours)
            if not isinstance(o.value(), (str, list)) and (o.key_or_group in GROUPS or "/" in o.key_or_group):
                return f"{o.input_line}: an option of a config group is a name; quote it: {o.key_or_group}='{o.value()}'"
    return None


def explain_file_error(error: BaseException, overrides: Sequence[str]) -> str | None:
    """The one line (without ``error:``) for a composition error in a config file, not in an
    override (``explain`` found none): ``FILE: KEY: what is wrong; ...``, FILE as Hydra names it
    (``recipe/NAME``; ``config`` for an ``override /GROUP`` of the recipe, named by the recipe chosen).
    None when the error names no file, or is neither a missing option nor a refused key or value."""
    found = re.match(r"In '([^']+)'", str(error))
    if found is None:
        return None
    where = found.group(1)
    chosen = [
        o.value() for o in _parse(overrides) if o.key_or_group == "recipe" and not o.is_sweep_override()
    ]
    if where == "config" and chosen:
        where = f"recipe/{chosen[-1]}"
    if isinstance(error, MissingConfigException):
        group, _, name = (error.missing_cfg_file or "").rpartition("/")
        if not group or error.options is None:
            return None
        options = list(error.options)
        return (
            f"{where}: {group}={name}: no such option in group '{group}'{_did_you_mean(name, options)}; "
            f"available: {', '.join(options)}"
        )
    cause = error.__cause__ or error.__context__  # Hydra raises a file's error without ``from``
    if not isinstance(error, ConfigCompositionException) or not isinstance(cause, OmegaConfBaseException):
        return None
    key = cause.full_key or "?"
    reason = _rejected_value(cause, "")  # no key set by an override: the message shows the value
    return f"{where}: {key}: {reason}"


def _parse(overrides: Sequence[str]) -> list[Override]:
    try:
        return OverridesParser.create().parse_overrides(list(overrides))
    except OverrideParseException:
        return []


def _unparsable(error: OverrideParseException) -> str:
    text = error.override
    if "=" not in text and not text.startswith("~"):
        return f"{text}: not an override (no '='); {SYNTAX}"
    lines = [ln for ln in error.message.splitlines() if ln and not ln.startswith(("See ", "Error parsing"))]
    reason = f" ({lines[0]})" if lines else ""
    return f"{text}: cannot be parsed{reason}; {SYNTAX}"


def _missing_option(error: MissingConfigException, parsed: list[Override]) -> str | None:
    group, _, name = (error.missing_cfg_file or "").rpartition("/")
    if not group or error.options is None or not any(o.key_or_group == group for o in parsed):
        return None  # a missing primary config, or an option a YAML file's defaults list names
    options = list(error.options)
    valid = f"available: {', '.join(options)}"
    if group in GROUP_HINTS:
        valid += f"; {GROUP_HINTS[group]}"
    what = "no option given" if not name else "no such option"
    return f"{group}={name}: {what} in group '{group}'{_did_you_mean(name, options)}; {valid}"


def _culprit(parsed: list[Override], message: str) -> Override | None:
    """The override Hydra's merge of the command line names (``Error merging override LINE``,
    ``Could not override 'KEY'.``); None for an error in a YAML file, which names none."""
    for o in reversed(parsed):
        if message == f"Error merging override {o.input_line}":
            return o
        if message.startswith(f"Could not override '{o.key_or_group}'."):
            return o
    return None


def _other_family(message: str, parsed: list[Override]) -> str | None:
    """A recipe's family key (``model.sliding_window`` in mistral_tiny) under the family the command
    line chose (``model=llama``, or ``model.family=llama``): the choice caused it, so one line."""
    found = re.search(r"Key '(\w+)' not in '\w+'\s+full_key: model\.(\w+)", message)
    chosen = [o for o in parsed if o.key_or_group == "model" and not o.is_sweep_override()]
    if found is None or found.group(1) != found.group(2) or not owners(found.group(1)) or not chosen:
        return None
    name, line = found.group(1), chosen[-1].input_line
    select = "|".join(owners(name))
    return (
        f"{line}: the recipe sets model.{name}, a key of model={select} only; keep the recipe's "
        f"family (drop {line}) or pick a recipe of model={chosen[-1].value()}"
    )


def _rejected_value(cause: OmegaConfBaseException, set_key: str) -> str:
    """What is valid for the key an override (or a config file) set, ``set_key``, from OmegaConf's
    error (its first line, whose wording OmegaConf 2.3 fixes per error)."""
    key = cause.full_key or set_key
    first = (cause.msg or str(cause)).splitlines()[0]
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and "not in" in first:
        return _unknown_key(cause, key, set_key)
    if isinstance(cause, ConfigTypeError) and "does not support deletion" in first:
        return f"a key of the schema cannot be deleted; set a value instead ({key}=VALUE)"
    if isinstance(cause, ValidationError):
        return _bad_value(cause, key, set_key, first)
    return first


def _bad_value(cause: ValidationError, key: str, set_key: str, first: str) -> str:
    """``key``: the rejected value's full key: the override's, an element of its list
    (``mesh.shape[1]``) or, inside a list of sections, the bare key (``weight`` of ``data.mix=[...]``)."""
    kind = re.search(r"could not be converted to (Integer|Float)", first)
    if kind:
        noun, type_ = ("an integer", "int") if kind.group(1) == "Integer" else ("a number", "float")
        value = "" if key == set_key else f"'{cause.value}' is "
        field = re.sub(r"\[\d+\]$", "", key)
        if field != key:
            return f"{value}not {noun} ({field} is a list of {type_}s)"
        return f"{value}not {noun} ({key} is {'an' if type_ == 'int' else 'a'} {type_})"
    if "is not a valid bool" in first:
        return "not a boolean; valid values are true, false"
    choices = re.search(r"expected one of \[(.*)\]", first)
    if choices:
        return f"valid values are {choices.group(1)}"
    if "is not Optional" in first:
        return f"{key} cannot be null"
    section = re.search(r"is not a subclass of (\w+)", first)
    if section and isinstance(cause.child_node, DictConfig):
        keys = _list_keys(list(cause.child_node.keys()), "")
        return f"{key} is a section, not a value: set its keys as {key}.KEY=VALUE; {keys}"
    return first


def _unknown_key(cause: OmegaConfBaseException, key: str, set_key: str) -> str:
    """``key``: the full key OmegaConf could not find; inside a list of sections it is the bare
    name (``data.mix=[{nosuch: 1}]`` -> ``nosuch``), and the section is the override's key."""
    section, _, name = key.rpartition(".")
    # Inside a list of sections the bare name is not the override's first component; a top-level
    # typo (``trian.steps=5`` -> ``trian``) is, and has no section.
    if not section and key != set_key and not set_key.startswith(f"{key}."):
        section = set_key
    parent = cause.parent_node
    keys = list(parent.keys()) if isinstance(parent, DictConfig) else []
    if not section:
        keys = sorted(set(keys) | set(GROUPS))
        return f"unknown config group or key '{name}'; {_list_keys(keys, name)}"
    if section == "model" and owners(name) and isinstance(parent, DictConfig):
        # A family's own key under another family (model.sliding_window on a Llama recipe).
        mine = family_of(parent).value
        select = "|".join(owners(name))
        return (
            f"a key of model={select} only, not of model={mine} (this recipe's "
            f"family); select the family with model={select}, or drop the override"
        )
    return f"no key '{name}' in {section}; {_list_keys(keys, name)}"


def _list_keys(keys: list[str], name: str) -> str:
    if not keys:
        return "python train.py --cfg job shows the valid keys"
    near = _did_you_mean(name, keys)
    if len(keys) <= LIST_AT_MOST:
        return f"valid keys: {', '.join(str(k) for k in keys)}{near}"
    return f"{near.lstrip('; ')}{'; ' if near else ''}{len(keys)} valid keys (python train.py --cfg job shows them)"


def _did_you_mean(name: str, valid: list[str]) -> str:
    near = difflib.get_close_matches(name, [str(v) for v in valid], n=1, cutoff=0.6) if name else []
    return f"; did you mean {near[0]}?" if near else ""


def _composition(message: str, parsed: list[Override]) -> str | None:
    """Hydra's own refusals, without an OmegaConf cause: a sweep without ``-m``, ``+GROUP=...`` on a
    group that has an option, ``+KEY=...`` on a key that has a value, and the rest by its message."""
    several = re.match(r"Multiple values for (\S+)\.", message)
    if several:  # +GROUP=OPTION where the defaults list already chose one
        added = [o for o in parsed if o.is_add() and o.key_or_group == several.group(1)]
        if added:
            o = added[-1]
            return f"{o.input_line}: group '{o.key_or_group}' already has an option; choose it with {o.input_line[1:]}"
    quoted = [o for o in parsed if o.input_line in message or f"'{o.key_or_group}'" in message]
    if not quoted:
        return None
    o = quoted[-1]
    if message.startswith("Could not append to config. An item is already at"):
        return f"{o.input_line}: {o.key_or_group} already has a value; set it with {o.input_line[1:]}"
    if o.is_sweep_override():
        return (
            f"{o.input_line}: a comma-separated value (or range, choice, glob) is a sweep: add -m to run one "
            f"job per value; a list is written {o.key_or_group}=[a,b], a string with a comma quoted: "
            f"{o.key_or_group}='a,b'"
        )
    lines = [ln.rstrip(".") for ln in message.splitlines() if ln.strip()]
    return f"{o.input_line}: {'; '.join(lines)}"
