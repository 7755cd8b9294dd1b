"""What every config key accepts: one table, checked once in the launcher before any rank starts.

Why a table: the schema (framework.config.schema) types every key, but a type says nothing about range,
sign or the relation to other keys. ``train.lr=nan`` is a float, ``model.dim=0`` an int, and each
used to fail minutes later inside a rank (or never: ``train.steps=-5`` trained nothing and exited 0).
Every schema key has exactly one entry; ``check`` runs them all from ``framework.launch.prelaunch`` before
the run files are written, and each failure is one ``ValueError`` line naming the key, its value and
what is valid. ``tests/launch/test_rules.py`` is generated from this table and fails when a schema key has
no entry, so a field added later without a rule is caught.

Where the rules live: beside their keys, one module per concern under ``framework.config.rules`` (the
entry kinds are ``framework.config.rules.rule``'s). This module holds only the rules that need a layer
above the config: which family reads which ``model.moe`` key and what it cannot run (its record,
``framework.models``), the LoRA targets against the meta model, the optimizer probed through the
training loop (``framework.launch.optimizer_rules``) and the layout the launcher read (the planner's).
It assembles the table in the order the checks run: a relation (``model.n_kv_heads`` divides
``model.n_heads``) runs after the keys it reads passed their own rule.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from framework.config.rules.checkpoint import CHECKPOINT_RULES
from framework.config.rules.data import DATA_RULES
from framework.config.rules.keys import check_known_keys, check_option_fields, schema_keys
from framework.config.rules.model import MODEL_RULES, MOE_RULES
from framework.config.rules.parallel import PARALLEL_RULES
from framework.config.rules.rule import (
    MAX_WIDTH,
    TYPED,
    Rule,
    check_table,
    family_name,
    is_int,
    show,
    value_at,
)
from framework.config.rules.run import EXECUTOR_RULES, FREEZE_RULES, LOGGER_RULES, RUN_RULES
from framework.config.rules.train import LR_SCHEDULER_RULES, OPTIMIZER_RULES, PEFT_RULES, TRAIN_RULES
from framework.config.schema import Config, MoEConfig, OptimizerName
from framework.launch.optimizer_rules import OPTIMIZER_PROBED_RULES, muon_valid
from framework.models import FAMILIES, model_spec
from framework.planner.layout import Degrees, check_dense_ep

__all__ = [
    "RULES",
    "TYPED",
    "Rule",
    "check",
    "check_group",
    "check_known_keys",
    "check_family_layout",
    "check_layout",
    "check_model_shape",
    "check_option_fields",
    "schema_keys",
    "show",
    "value_at",
]

_MOE_DEFAULT = MoEConfig()


def _moe_keys(c: Config) -> tuple[str, ...]:
    fam = next((f for f in FAMILIES.values() if f.name == family_name(c)), None)
    return fam.moe_keys if fam is not None else ()


def family_gated(key: str, rule: Rule) -> Rule:
    """``model.moe.<leaf>``: its default on a family whose record does not list it, else ``rule``."""
    leaf = key.rpartition(".")[2]
    default = getattr(_MOE_DEFAULT, leaf)

    def check_value(v: Any, c: Config) -> bool:
        if leaf not in _moe_keys(c):
            return v == default
        assert rule.ok is not None
        return rule.ok(v, c)

    def text(c: Config) -> str:
        if leaf not in _moe_keys(c):
            owners = "|".join(f.name for f in FAMILIES.values() if leaf in f.moe_keys) or "none"
            return (
                f"{show(default)} (the default) with model.family={family_name(c)}, which does not read it; "
                f"model.moe.{leaf} is for model.family={owners}"
            )
        return rule.valid(c) if callable(rule.valid) else rule.valid

    return Rule(text, check_value, rule.bad, context=rule.context)


def _lora_error(c: Config) -> str | None:
    """``framework.models.lora.check`` on the meta model of ``c``: its one line, or None."""
    from framework.models import build_model, lora

    if getattr(c.peft.method, "value", c.peft.method) == "none":
        return None
    try:
        lora.check(build_model(c.model, c.train.seq_len), c.peft)
    except ValueError as e:
        return str(e)
    return None


def _adapter_error(c: Config) -> str | None:
    """``framework.models.lora.check_adapter``: the folder against this run's base and adapters."""
    from framework.models import build_model, lora

    if c.peft.adapter is None:
        return None
    try:
        model = build_model(c.model, c.train.seq_len)
        lora.attach(model, c.peft)
        lora.check_adapter(model, c.peft, c.model.init_from)
    except ValueError as e:
        return str(e)
    return None


# An MoE family's per-expert counts decide the experts' shapes: torch.export traces them as
# unbacked sizes (framework.freeze), TorchScript cannot (script and trace are for dense families).
FREEZE_MODE = Rule(
    lambda c: (
        f"none or export with model.family={family_name(c)} (an MoE family: its per-expert sizes are "
        "data-dependent, which torch.export traces and TorchScript does not); script or trace "
        "with a dense family"
    ),
    lambda v, c: getattr(v, "value", v) in ("none", "export") or not _moe_keys(c),
    ("script", "trace"),
    context=(("model.family", "qwen3_moe"), ("model.moe.num_experts", 4)),
)

# peft (framework.models.lora): the patterns and the rank against the model's own Linears
LORA_RULES: dict[str, Rule] = {
    "peft.targets": Rule(
        lambda c: (_lora_error(c) or "patterns of Linear layers").split("valid: ", 1)[-1],
        lambda v, c: _lora_error(c) is None or not _lora_error(c).startswith("peft.targets"),
        (["no_such_layer"],),
        context=(("peft.method", "lora"),),
    ),
    "peft.rank": Rule(
        lambda c: (_lora_error(c) or f"an integer in 1..{MAX_WIDTH}").split("valid: ", 1)[-1],
        lambda v, c: is_int(v) and 1 <= v <= MAX_WIDTH and _lora_error(c) is None,
        (0, -1, 100000),
        context=(("peft.method", "lora"),),
    ),
    "peft.adapter": Rule(
        lambda c: (_adapter_error(c) or "a PEFT adapter folder").split("valid: ", 1)[-1],
        lambda v, c: v is None or _adapter_error(c) is None,
        ("/nonexistent/adapter",),
        context=(("peft.method", "lora"),),
    ),
}


def _pattern_layers(c: Config) -> int:
    """The layers model.layer_pattern gives (-1: it does not parse; the spec's refusal says where)."""
    try:
        return model_spec(c.model).n_layers
    except ValueError:
        return -1


# A family's stack of layer kinds (framework.models.spec: DeepSeek-V3's dense then MoE layers, GPT-OSS's
# sliding and full attention): parsed by the family's spec, so it is judged here, after model.n_layers.
LAYER_PATTERN = Rule(
    lambda c: (
        f"a stack of model.n_layers={c.model.n_layers} layers: items KIND or KIND xN separated by commas, "
        "KIND the family's (deepseek_v3: dense|moe, e.g. 'dense x1, moe x3'; gpt_oss: sliding|full, "
        "e.g. '[sliding, full] x2')"
    ),
    lambda v, c: isinstance(v, str) and _pattern_layers(c) == c.model.n_layers,
    ("dense x1, moe x2", "dense x1, mo x3", "dense x5"),
)


def _in_order() -> Iterator[tuple[str, Rule]]:
    """The groups' tables in the order the checks run (a rule after the keys it reads)."""
    yield from MODEL_RULES.items()
    yield "model.layer_pattern", LAYER_PATTERN
    yield from ((k, family_gated(k, r)) for k, r in MOE_RULES.items())
    yield from DATA_RULES.items()
    yield from TRAIN_RULES.items()
    probed = dict(OPTIMIZER_PROBED_RULES)
    state_dtype = probed.pop("optimizer.state_dtype")
    yield from probed.items()  # name, _target_, kwargs: before the values they are built with
    yield from OPTIMIZER_RULES.items()
    yield "optimizer.state_dtype", state_dtype
    yield from LR_SCHEDULER_RULES.items()
    yield from RUN_RULES.items()
    yield from PARALLEL_RULES.items()
    yield "freeze.mode", FREEZE_MODE
    yield from FREEZE_RULES.items()
    yield from LORA_RULES.items()
    yield from PEFT_RULES.items()
    yield from EXECUTOR_RULES.items()
    yield from CHECKPOINT_RULES.items()
    yield from LOGGER_RULES.items()


RULES: dict[str, Rule] = dict(_in_order())


def check_layout(cfg: Config, declared: Degrees | None) -> None:
    """The rules that read the layout the user fixed (``declared``: read once by the launcher,
    framework.launch.prelaunch.validate; None under ``sharding=auto``, whose search then keeps to layouts
    these rules allow, framework.planner.search). Raises ValueError in the table's one-line form.

    Muon orthogonalizes each weight matrix whole: no ``dp_shard`` or ``tp``. Expert parallelism needs
    experts (``check_dense_ep``). The family runs the layout (``check_family_layout``)."""
    if declared is not None:
        check_dense_ep(declared, cfg.model)
        check_family_layout(cfg, declared)
    if cfg.optimizer.name is OptimizerName.muon and declared is not None:
        if declared.dp_shard != 1 or declared.tp != 1:
            raise ValueError(
                f"optimizer.name={show(cfg.optimizer.name)} is not valid; valid: {muon_valid(cfg)}"
            )


def check_family_layout(cfg: Config, degrees: Degrees, searched: bool = False) -> None:
    """Refuse a layout the model's family declares it cannot run (its record's ``cannot_run``: an axis
    without a TP plan, a family that cannot be staged), in one line before launch, rather than a
    traceback from inside the ranks or the dry run. ``searched``: the degrees are the ``sharding=auto``
    search's (framework.launch.prelaunch checks the resolved plan too)."""
    fam = FAMILIES[cfg.model.family]
    mtp = getattr(cfg.model, "mtp_layers", 0)
    if mtp:
        # The MTP layer reads the embedding and the head of the trunk's ends (a pipeline's first and
        # last stages) and the whole sequence shifted by one (context parallelism); the TP plan and
        # expert parallelism shard the trunk's layers only.
        for axis in ("pp", "tp", "cp", "ep"):
            degree = getattr(degrees, axis)
            if degree > 1:
                how = " (chosen by sharding=auto)" if searched else ""
                raise ValueError(
                    f"model.mtp_layers={mtp} is not valid with parallel.{axis}={degree}{how}: the multi-token "
                    f"prediction layer runs without {axis}; valid: model.mtp_layers=0, or a layout with {axis}=1"
                )
    for axis, why in fam.cannot_run.items():
        degree = getattr(degrees, axis)
        if degree > 1:
            able = "|".join(f.name for f in FAMILIES.values() if axis not in f.cannot_run) or "none"
            how = " (chosen by sharding=auto)" if searched else ""
            raise ValueError(
                f"parallel.{axis}={degree}{how} is not valid with model.family={fam.name}: {why}; valid: a "
                f"layout with {axis}=1 (parallel.{axis}=1, or a sharding preset without it), or "
                f"model.family={able}"
            )


def check_group(cfg: Config, group: str) -> None:
    """``check`` for the keys of one group only (``model``): for values read from a file before the
    whole config is checked (framework.checkpoint.init_from takes the shape from a checkpoint's config.json)."""
    check_table(cfg, RULES, group)


def check(cfg: Config) -> None:
    """Raise ValueError (one line: key, value, what is valid) at the first key whose rule fails, in
    table order; then ``check_option_fields``."""
    check_table(cfg, RULES)
    check_option_fields(cfg)


def check_model_shape(cfg: Config) -> None:
    """The ``model`` group's rules, for a shape read from a checkpoint (``init_from.resolve`` calls it)."""
    check_group(cfg, "model")
