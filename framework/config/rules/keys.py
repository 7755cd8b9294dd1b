"""The schema's keys: every leaf key (what each group's table must cover), a field of one option set
under another, and a composed key the schema does not have.

Keys of the composed config that the schema does not have (``+train.lrr=0.1``) are refused by
``check_known_keys`` with the nearest valid key: OmegaConf would otherwise drop them silently.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Iterator
from enum import Enum
from typing import Any

from omegaconf import DictConfig, OmegaConf

from framework.config.rules.rule import ABSENT, show, value_at
from framework.config.schema import (
    MODEL_SCHEMAS,
    Config,
    ModelConfig,
    family_of,
    model_schema,
    option_fields,
    own_keys,
    owners,
)


def schema_keys(cls: type = Config, prefix: str = "", model: type | None = None) -> Iterator[tuple[str, Any]]:
    """Every leaf key of the schema as (dotted key, type); nested dataclasses are groups. The
    ``model`` group's keys are the shared ones, then every family's own (``model.sliding_window``),
    or only ``model``'s (one family's schema) when given."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if tp is ModelConfig:
            yield from schema_keys(model or ModelConfig, f"{prefix}{f.name}.")
            if model is None:
                for fam in MODEL_SCHEMAS.values():
                    yield from _own_schema_keys(fam, f"{prefix}{f.name}.")
        elif dataclasses.is_dataclass(tp):
            yield from schema_keys(tp, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", tp


def _own_schema_keys(fam: type, prefix: str) -> Iterator[tuple[str, Any]]:
    """The leaf keys of a family's own fields (a nested block's leaves too)."""
    own = own_keys(fam)
    for key, tp in schema_keys(fam, prefix):
        if key[len(prefix) :].split(".")[0] in own:
            yield key, tp


def _choice(value: Any) -> str:
    return (
        str(value).lower()
        if isinstance(value, bool)
        else value.value
        if isinstance(value, Enum)
        else str(value)
    )


def check_option_fields(cfg: Config) -> None:
    """Refuse a field of one option set under another (``framework.config.schema.only_with``): it would do
    nothing. A field left at its default passes, so a group's other options need not mention it."""
    for key, (selector, options, default) in option_fields().items():
        value, chosen = value_at(cfg, key), value_at(cfg, selector)
        if value is ABSENT or value == default or chosen in options:
            continue
        wanted = "|".join(_choice(o) for o in options)
        raise ValueError(
            f"{key}={show(value)} does nothing with {selector}={_choice(chosen)}: it belongs to "
            f"{selector}={wanted}; set that, or leave {key} at its default ({show(default)})"
        )


def _schema_tree(model: type | None = None) -> dict[str, Any]:
    """Nested dict of the schema's group keys (``model``'s: that family's); a leaf is None (its
    value's own keys are free)."""
    tree: dict[str, Any] = {}
    for key, _tp in schema_keys(model=model):
        node = tree
        *groups, leaf = key.split(".")
        for g in groups:
            node = node.setdefault(g, {})
        node[leaf] = None
    return tree


def check_known_keys(dcfg: DictConfig) -> None:
    """Refuse a composed key the schema does not have (``+train.lrr=0.1``), naming the nearest valid key.

    OmegaConf's conversion to the typed ``Config`` drops such a key silently, so the user's setting
    would do nothing. ``hydra`` is Hydra's own; dict-valued fields (``nccl.env``) take any key.
    """
    model = dcfg.get("model") if isinstance(dcfg, DictConfig) else None
    schema = model_schema(family_of(model)) if model is not None else None
    tree = _schema_tree(schema)
    flat = list(dict(schema_keys(model=schema)))
    mine = family_of(model).value if model is not None else "llama"

    def walk(node: Any, schema: dict[str, Any], prefix: str) -> None:
        for k in node:
            key = f"{prefix}{k}"
            if k not in schema and prefix == "model." and owners(k):
                select = "|".join(owners(k))
                raise ValueError(
                    f"{key} is a key of model={select} only, not of model={mine}; select the family "
                    f"with model={select}, or drop {key}"
                )
            if k not in schema:
                near = difflib.get_close_matches(key, flat, n=1, cutoff=0.5)
                hint = f"; did you mean {near[0]}?" if near else ""
                raise ValueError(
                    f"{key} is not a config key (the schema in framework/config/schema.py has no such field, "
                    f"it would be ignored){hint}"
                )
            sub = schema[k]
            child = node[k]
            if isinstance(sub, dict) and isinstance(child, dict):
                walk(child, sub, f"{key}.")

    container = OmegaConf.to_container(dcfg, resolve=False)
    assert isinstance(container, dict)
    container.pop("hydra", None)
    walk(container, tree, "")
