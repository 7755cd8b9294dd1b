"""The schema by concern (framework/config/: data, train, run, parallel, execution, checkpoint,
kernels, options, command_line, model; schema.py keeps the root and the conversion): every
name that framework.config.schema held before the split still imports from it, as the same object, and
each group's dataclass lives in its concern's module."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

from framework.config import schema

# Every public name of framework/config/schema.py before the split (issue 41).
NAMES = """
Device Strategy ActivationCheckpointing PPSchedule ResidualDtype ModelFamily AttentionBackend FusedCrossEntropy
Float8Recipe Float8GradDtype DType PeftMethod FreezeMode ExecutorMode CompileScope TokenizerKind DataSource
AsyncMode Integrity Policy LoggerKind WandbMode OptimizerName MuonAdjustLR LRSchedulerName ProfileRanks
only_with option_fields RouterScore ExpertKernel AuxLossScope MoEConfig ModelConfig LlamaConfig Qwen3Config
MistralConfig Qwen3MoeConfig MixtralConfig MODEL_SCHEMAS own_keys owners model_schema check_family_schema
replace_model family_of TokenizerConfig MixEntry EvalSet DataConfig TrainConfig OptimizerConfig
LRSchedulerConfig RunConfig HardwareConfig MeshConfig ParallelConfig ShardingConfig BucketingConfig
NcclConfig FreezeConfig PeftConfig ExecutorConfig CheckpointConfig VerifyConfig LoggerConfig
SHIPPED_CALLBACKS default_callbacks Config register to_config flatten to_yaml GROUPS MESH_DIR
mesh_shape_overrides family_choice_overrides quote_numeric_choices
""".split()

HOME = {
    "tokenizer": "data",
    "data": "data",
    "train": "train",
    "optimizer": "train",
    "lr_scheduler": "train",
    "run": "run",
    "logger": "run",
    "mesh": "parallel",
    "parallel": "parallel",
    "sharding": "parallel",
    "bucketing": "parallel",
    "nccl": "parallel",
    "freeze": "execution",
    "peft": "execution",
    "executor": "execution",
    "checkpoint": "checkpoint",
    "verify": "checkpoint",
    "model": "model",
}


def test_every_name_of_the_schema_still_imports_from_it() -> None:
    missing = [n for n in NAMES if not hasattr(schema, n)]
    assert not missing, f"framework.config.schema lost {missing}"


def test_each_group_schema_lives_in_its_concerns_module() -> None:
    hints = typing.get_type_hints(schema.Config)
    for f in dataclasses.fields(schema.Config):
        tp = hints[f.name]
        if not dataclasses.is_dataclass(tp):
            continue  # callbacks: a mapping, not a schema
        assert tp.__module__ == f"framework.config.{HOME[f.name]}", (f.name, tp.__module__)
        assert getattr(schema, tp.__name__) is tp


def test_no_config_module_over_500_lines() -> None:
    root = Path(schema.__file__).parent
    long = {p.name: n for p in root.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long
