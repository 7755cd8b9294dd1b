"""Typed configuration: one dataclass per config group, registered in Hydra's ConfigStore. Here: the
root ``Config`` and the conversion; each group in its concern's module (framework/config/model.py:
the model group, one schema per family; data.py, train.py, run.py, parallel.py, execution.py,
checkpoint.py).

Why dataclasses and Enums: Hydra merges every group's YAML into these schemas, so a misspelled key,
a wrong type or an unknown choice fails at compose time, before any rank starts. OmegaConf 2.3
rejects ``typing.Literal``, so closed choices are Enums. The untyped ``DictConfig`` never leaves the
entry point: ``to_config`` converts it once, and library code takes the narrowest typed sub-config.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

# Every name stays importable from here.
from framework.config.checkpoint import (  # noqa: F401 - re-exported
    AsyncMode,
    CheckpointConfig,
    Integrity,
    Policy,
    VerifyConfig,
)
from framework.config.command_line import (  # noqa: F401 - re-exported
    GROUPS,
    MESH_DIR,
    family_choice_overrides,
    mesh_shape_overrides,
    quote_numeric_choices,
)
from framework.config.data import (  # noqa: F401 - re-exported
    DataConfig,
    DataSource,
    EvalSet,
    MixEntry,
    TokenizerConfig,
    TokenizerKind,
)
from framework.config.execution import (  # noqa: F401 - re-exported
    CompileScope,
    ExecutorConfig,
    ExecutorMode,
    FreezeConfig,
    FreezeMode,
    PeftConfig,
    PeftMethod,
)
from framework.config.kernels import (  # noqa: F401 - re-exported
    Float8GradDtype,
    Float8Recipe,
    FusedCrossEntropy,
)
from framework.config.model import (  # noqa: F401 - re-exported
    MODEL_SCHEMAS,
    AttentionBackend,
    AuxLossScope,
    DeepseekV3Config,
    ExpertKernel,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    ModelConfig,
    ModelFamily,
    MoEConfig,
    Qwen3Config,
    Qwen3MoeConfig,
    ResidualDtype,
    RouterScore,
    check_family_schema,
    family_of,
    model_schema,
    own_keys,
    owners,
    replace_model,
)
from framework.config.options import only_with  # noqa: F401 - re-exported
from framework.config.parallel import (  # noqa: F401 - re-exported
    ActivationCheckpointing,
    BucketingConfig,
    DType,
    HardwareConfig,
    MeshConfig,
    NcclConfig,
    ParallelConfig,
    PPSchedule,
    ShardingConfig,
    Strategy,
)
from framework.config.run import (  # noqa: F401 - re-exported
    SHIPPED_CALLBACKS,
    Device,
    LoggerConfig,
    LoggerKind,
    ProfileRanks,
    RunConfig,
    WandbMode,
    default_callbacks,
)
from framework.config.train import (  # noqa: F401 - re-exported
    LRSchedulerConfig,
    LRSchedulerName,
    MuonAdjustLR,
    OptimizerConfig,
    OptimizerName,
    TrainConfig,
)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    run: RunConfig = field(default_factory=RunConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    bucketing: BucketingConfig = field(default_factory=BucketingConfig)
    nccl: NcclConfig = field(default_factory=NcclConfig)
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    # The callbacks group (conf/callbacks/NAME.yaml): name -> {_target_: CLASS, its own values};
    # NAME=null switches one off. Built through run.instantiate_allow (framework.train.callbacks).
    callbacks: dict[str, Any] = field(default_factory=default_callbacks)


def option_fields(cls: type = None, prefix: str = "") -> dict[str, tuple[str, tuple[Any, ...], Any]]:  # type: ignore[assignment]
    """Every ``only_with`` field of the schema: key -> (selector key, its options, the default)."""
    out: dict[str, tuple[str, tuple[Any, ...], Any]] = {}
    for f in dataclasses.fields(cls or Config):
        key = f"{prefix}{f.name}"
        if "only_with" in f.metadata:
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            out[key] = (*f.metadata["only_with"], default)
        tp = f.type if not isinstance(f.type, str) else None
        nested = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if tp is None and nested is not None and dataclasses.is_dataclass(nested):
            tp = nested
        if tp is not None and dataclasses.is_dataclass(tp):
            out.update(option_fields(tp, f"{key}."))
        if tp is ModelConfig:  # the model group: every family's own fields too
            for fam in MODEL_SCHEMAS.values():
                out.update({k: v for k, v in option_fields(fam, f"{key}.").items() if k not in out})
    return out


# The model group (a recipe, recipes/NAME.yaml, pins it): the MoE block, the shared keys, each family's.


def register() -> None:
    """Store the root schema; every group's YAML is merged into (and validated by) its field type.

    The ``model`` group's options bring their family's schema: conf/model/NAME.yaml lists
    ``/NAME_model_schema@_here_`` (stored here, at the root so that ``--help`` lists only the
    options), which turns the shared ``ModelConfig`` node into the family's subclass.
    """
    store("base_config", Config)
    for fam, cls in MODEL_SCHEMAS.items():
        store(f"{fam.value}_model_schema", cls)


# (group, file name, package) -> (repr of what was stored, the ConfigNode the store made of it)
_STORED: dict[tuple[str | None, str, str | None], tuple[str, Any]] = {}


def store(name: str, node: Any, group: str | None = None, package: str | None = None) -> None:
    """``ConfigStore.store``, skipped while the store still holds the node it made of this very
    content. Every compose (train.py, the launcher's checks, each in-process compose of the suite)
    registers the root schema and every recipe again; converting them into OmegaConf nodes anew was
    most of a compose's time. ``repr`` compares the content with its types (``1`` is not ``True``)."""
    cs = ConfigStore.instance()
    file = name if name.endswith(".yaml") else f"{name}.yaml"
    key, content = (group, file, package), repr(node)
    held: Any = cs.repo
    for d in group.split("/") if group else []:
        held = held.get(d, {}) if isinstance(held, dict) else {}
    held = held.get(file) if isinstance(held, dict) else None
    last = _STORED.get(key)
    if last is not None and held is last[1] and last[0] == content:
        return
    cs.store(name=name, node=node, group=group, package=package)
    made: Any = cs.repo
    for d in group.split("/") if group else []:
        made = made[d]
    _STORED[key] = (content, made[file])


@functools.cache
def _schema(family: ModelFamily = ModelFamily.llama) -> DictConfig:
    """The structured root schema with ``family``'s model schema, built once per family (30 ms per
    build; the launcher converts several configs)."""
    return OmegaConf.structured(Config(model=MODEL_SCHEMAS[family]()))


def to_config(cfg: DictConfig | dict[str, Any]) -> Config:
    """Convert a composed (possibly untyped) config into the typed ``Config``, validating it.

    The ``model`` node is checked against its family's schema (``family_of``): a run's untyped
    config.yaml with ``family: mistral`` gets ``MistralConfig``, a Llama's ``sliding_window`` is refused.
    """
    model = cfg.get("model") if isinstance(cfg, (dict, DictConfig)) else None
    schema = _schema(family_of(model) if model is not None else ModelFamily.llama)
    family = family_of(model) if model is not None else ModelFamily.llama
    if isinstance(cfg, DictConfig) and OmegaConf.get_type(cfg, "model") not in (
        None,
        dict,
        MODEL_SCHEMAS[family],
    ):
        # a node typed as another schema (Config()'s base one, or a family changed in place): it
        # cannot merge into the family's class, its values can
        cfg = OmegaConf.to_container(cfg, resolve=False)
    merged = OmegaConf.merge(schema, cfg)  # merge copies its first argument: the cache stays clean
    obj = OmegaConf.to_object(merged)
    assert isinstance(obj, Config)
    return obj


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level of dotted keys (``{"train": {"lr": 1}}`` -> ``{"train.lr": 1}``),
    for naming the keys that differ between two configs."""
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
