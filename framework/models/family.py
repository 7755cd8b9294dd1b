"""A model family's record: what the rest of the framework reads to build, shard, convert and plan
one family, so that a new family is one folder under ``framework.models`` plus one registry line.

Why a record rather than ``family ==`` checks: the HF converters, the planner and the generator
used to spell each family's differences out where they were needed (adding Qwen3 edited 9
modules); they now read the record's fields, and the modules are the shared decoder trunk
(``framework.models.parts.decoder.Decoder``) around the family's own block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from framework.config.schema import ModelConfig
from framework.models.parts.decoder import BlockFactory
from framework.models.spec import LayerKind, ModelSpec


@dataclass(frozen=True)
class Family:
    """One family, from its folder.

    ``spec``: the layout of one shape (weights, TP styles, HF names, head size, attention window).
    ``block``: (config, spec, a layer's kind) -> that layer's module (``spec.layers``: one kind per
    layer, the family's pattern).
    ``hf_architecture``: its ``transformers`` class. ``hf_fields``: the family's own ModelConfig field
    -> its HF ``config.json`` key, beyond the fields every family here shares
    (``import_hf.SHAPE_FIELDS``); 0 in ours is ``null`` in HF's (off), both ways.
    ``config``: its schema, the option ``model=NAME`` (``framework.config.schema.MODEL_SCHEMAS``):
    the shared ``ModelConfig`` keys plus the family's own (Mistral's ``sliding_window``). The config
    layer sits below the models, so the class is declared there and the record points at it.
    ``moe_keys``: the ``model.moe`` keys the family reads (``framework.config.schema.MoEConfig``); empty
    for a dense family. The launcher refuses any other MoE key changed from its default.
    ``hf_moe_fields``: ``model.moe`` key -> its config.json key (both ways); ``hf_fixed``: config.json
    keys that must hold these values (what the family's block computes), written by the export and
    checked by the import.
    ``cannot_run``: the layouts the family cannot run, as a parallel axis (a field of
    ``framework.planner.layout.Degrees``: ``tp``, ``pp``, ``cp``, ``ep``) -> why (its TP plan does not
    exist, its blocks cannot be split into stages); the launcher refuses a degree above 1 on such an
    axis in one line before launch (``framework.launch.rules.check_family_layout``). Empty: every
    layout the planner allows.
    ``tiny``: a tiny shape of the family (its schema's fields over their defaults) that builds and
    steps in a unit test in well under a second; the tests over families build it for every registry
    entry (``tiny_config``).
    ``hf_moe_values``: ``model.moe`` values the HF class computes (DeepSeek-V3's
    sigmoid router), set by the import and required by the export.
    ``hf_read(config_json, where)``: the family's fields that config.json holds in its own form (a
    layer pattern from ``first_k_dense_replace``, YaRN); ``hf_write(model_cfg, layers)``: the inverse,
    config.json entries of the export (it refuses what the HF class cannot build). None: none.
    ``expert_parallel``: False where ``parallel.ep`` cannot shard the family's experts (refused).
    """

    name: str
    spec: Callable[[ModelConfig], ModelSpec]
    block: BlockFactory
    hf_architecture: str
    hf_fields: dict[str, str] = field(default_factory=dict)
    config: type[ModelConfig] = ModelConfig
    moe_keys: tuple[str, ...] = ()
    hf_moe_fields: dict[str, str] = field(default_factory=dict)
    hf_fixed: dict[str, object] = field(default_factory=dict)
    cannot_run: dict[str, str] = field(default_factory=dict)
    tiny: dict[str, object] = field(default_factory=dict)
    hf_moe_values: dict[str, object] = field(default_factory=dict)
    hf_read: Callable[[dict[str, Any], str], dict[str, Any]] | None = None
    hf_write: Callable[[Any, tuple[LayerKind, ...]], dict[str, Any]] | None = None
    # Whether expert parallelism (framework.parallel.expert, which shards any layer whose experts are
    # framework.models.grouped.StackedExperts, GPT-OSS's biased ones included) runs the family's experts.
    expert_parallel: bool = True

    def tiny_config(self) -> ModelConfig:
        """The family's tiny test shape, as its schema."""
        return self.config(**self.tiny)
