"""Each group's rules beside its schema (framework.config.rules), tested without the launcher.

Every table of ``framework.config.rules`` holds keys of its own groups only, each a schema key; each
value rule's out-of-range values, set on the typed default config (under the family its context names),
are refused by that table alone with one line naming the key. The assembled table and the rules that
need a layer above (a family's record, the meta model, the loop's optimizer) are tested end to end
through the launcher's checks in tests/launch/test_rules.py.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from typing import Any

import pytest
from omegaconf import OmegaConf

from framework.config import schema
from framework.config.rules import checkpoint, data, model, parallel, run, train
from framework.config.rules.keys import check_known_keys, check_option_fields, schema_keys
from framework.config.rules.rule import ABSENT, Rule, check_table, value_at
from framework.config.schema import Config, ModelConfig

# module -> (its tables, the groups their keys belong to)
TABLES: dict[str, tuple[dict[str, Rule], tuple[str, ...]]] = {
    "model.MODEL_RULES": (model.MODEL_RULES, ("model",)),
    "model.MOE_RULES": (model.MOE_RULES, ("model",)),
    "data.DATA_RULES": (data.DATA_RULES, ("tokenizer", "data")),
    "train.TRAIN_RULES": (train.TRAIN_RULES, ("train",)),
    "train.OPTIMIZER_RULES": (train.OPTIMIZER_RULES, ("optimizer",)),
    "train.LR_SCHEDULER_RULES": (train.LR_SCHEDULER_RULES, ("lr_scheduler",)),
    "train.PEFT_RULES": (train.PEFT_RULES, ("peft",)),
    "run.RUN_RULES": (run.RUN_RULES, ("run",)),
    "run.FREEZE_RULES": (run.FREEZE_RULES, ("freeze",)),
    "run.EXECUTOR_RULES": (run.EXECUTOR_RULES, ("executor",)),
    "run.LOGGER_RULES": (run.LOGGER_RULES, ("logger", "callbacks")),
    "parallel.PARALLEL_RULES": (
        parallel.PARALLEL_RULES,
        ("mesh", "parallel", "sharding", "bucketing", "nccl"),
    ),
    "checkpoint.CHECKPOINT_RULES": (checkpoint.CHECKPOINT_RULES, ("checkpoint", "verify")),
}


def test_each_table_holds_schema_keys_of_its_own_groups_once() -> None:
    keys = dict(schema_keys())
    seen: dict[str, str] = {}
    for where, (table, groups) in TABLES.items():
        for key in table:
            assert key in keys, f"{where}: {key} is not a schema key"
            assert key.split(".")[0] in groups, f"{where}: {key} belongs to another group's module"
            assert key not in seen, f"{key} has a rule in {seen[key]} and in {where}"
            seen[key] = where


def _typed_default(family: str | None) -> Config:
    fam = schema.ModelFamily(family) if family else schema.ModelFamily.llama
    return Config(model=schema.MODEL_SCHEMAS[fam]())


def _set(cfg: Config, key: str, value: Any) -> None:
    group, _, leaf = key.rpartition(".")
    obj = value_at(cfg, group) if group else cfg
    current = getattr(obj, leaf)
    if isinstance(current, enum.Enum) and isinstance(value, str):
        value = type(current)(value)
    setattr(obj, leaf, value)


def _owner_family(key: str) -> str | None:
    """The first family whose schema has ``key`` (a family's own key, ``model.sliding_window``)."""
    leaf = key.split(".")[1] if key.startswith("model.") else ""
    shared = {f.name for f in dataclasses.fields(ModelConfig)}
    return schema.owners(leaf)[0] if leaf and leaf not in shared else None


CASES = [
    (where, key, bad)
    for where, (table, _) in TABLES.items()
    if where != "model.MOE_RULES"  # a range there holds on the families that read the key: its context
    for key, rule in table.items()
    if rule.ok is not None
    for bad in rule.bad
]


@pytest.mark.parametrize("where, key, bad", CASES, ids=[f"{k}={b!r}"[:60] for _, k, b in CASES])
def test_each_value_rule_refuses_its_out_of_range_values_alone(where: str, key: str, bad: Any) -> None:
    table, _ = TABLES[where]
    rule = table[key]
    context = dict(rule.context)
    cfg = _typed_default(context.pop("model.family", None) or _owner_family(key))
    for k, v in (*context.items(), (key, bad)):
        _set(cfg, k, v)
    with pytest.raises(ValueError, match=rf"^{key}=.* is not valid; valid: ") as info:
        check_table(cfg, table)
    assert "\n" not in str(info.value)


def test_each_moe_range_refuses_on_a_family_that_reads_it() -> None:
    for key, rule in model.MOE_RULES.items():
        context = dict(rule.context)
        if "model.family" not in context:
            continue  # a choice (router_score) or a switch: only the family's gate refuses it
        family = context.pop("model.family")
        for bad in rule.bad:
            cfg = _typed_default(family)
            for k, v in (*context.items(), (key, bad)):
                _set(cfg, k, v)
            with pytest.raises(ValueError, match=rf"^{key}="):
                check_table(cfg, model.MOE_RULES)


def test_the_default_config_of_every_family_passes_every_table() -> None:
    for fam in schema.MODEL_SCHEMAS:
        cfg = _typed_default(fam.value)
        for table, _ in TABLES.values():
            if table is model.MOE_RULES:
                continue  # a dense family's defaults (no experts) are the gate's to accept
            check_table(cfg, table)


def test_a_key_of_another_family_is_absent_not_checked() -> None:
    cfg = Config()  # a Llama: no model.sliding_window
    assert value_at(cfg, "model.sliding_window") is ABSENT
    check_table(cfg, model.MODEL_RULES)


def test_a_group_alone_is_checked() -> None:
    cfg = copy.deepcopy(Config())
    cfg.train.lr = float("nan")
    check_table(cfg, train.TRAIN_RULES, group="model")  # another group's key: not looked at
    with pytest.raises(
        ValueError, match=r"^train.lr=nan is not valid; valid: a finite number > 0 and <= 10$"
    ):
        check_table(cfg, train.TRAIN_RULES, group="train")


def test_unknown_key_is_refused_with_the_nearest_valid_key() -> None:
    d = OmegaConf.structured(Config())
    OmegaConf.set_struct(d, False)
    OmegaConf.update(d, "train.lrr", 0.1, force_add=True)
    with pytest.raises(ValueError, match=r"train.lrr is not a config key .*did you mean train.lr\?"):
        check_known_keys(d)
    d = OmegaConf.structured(Config())
    OmegaConf.update(d, "nccl.env", {"NCCL_DEBUG": "WARN"}, merge=False)
    check_known_keys(d)  # a free-form dict field takes any key


def test_a_field_of_another_option_is_refused_naming_the_option() -> None:
    with pytest.raises(
        ValueError, match=r"^model.float8_fast_accum=True does nothing with model.float8=none"
    ):
        check_option_fields(Config(model=ModelConfig(float8_fast_accum=True)))
