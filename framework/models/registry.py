"""The registry of families (one line each) and the cached spec of a shape.

``model_spec(cfg)`` is what the planner, the TP plan, activation checkpointing, compile, FSDP,
float8 and the Hugging Face converters read; ``framework.models.build`` builds the modules it
describes. A new family is its folder and one line in ``FAMILIES``.
"""

from __future__ import annotations

import dataclasses
import functools
from enum import Enum
from typing import Any

from torch import nn

from framework.config.schema import ModelConfig, ModelFamily, model_schema, own_keys
from framework.models.deepseek_v3 import DEEPSEEK_V3
from framework.models.family import Family
from framework.models.gpt_oss import GPT_OSS
from framework.models.llama import LLAMA
from framework.models.mistral import MISTRAL
from framework.models.mixtral import MIXTRAL
from framework.models.qwen3 import QWEN3
from framework.models.qwen3_moe import QWEN3_MOE
from framework.models.spec import ModelSpec

# The registry: one line per family.
FAMILIES: dict[ModelFamily, Family] = {
    ModelFamily.llama: LLAMA,
    ModelFamily.qwen3: QWEN3,
    ModelFamily.mistral: MISTRAL,
    ModelFamily.qwen3_moe: QWEN3_MOE,
    ModelFamily.mixtral: MIXTRAL,
    ModelFamily.deepseek_v3: DEEPSEEK_V3,
    ModelFamily.gpt_oss: GPT_OSS,
}


def family(m: ModelConfig) -> Family:
    """``m``'s family record."""
    return FAMILIES[m.family]


def own_fields() -> tuple[str, ...]:
    """The ModelConfig keys some family's schema has as its own (``Family.config``: Mistral's
    ``sliding_window``), in registry order: the launcher's rule table and the config reference list
    them, and the spec cache keys on the family's, with no per-field line outside its schema."""
    return tuple(dict.fromkeys(f for fam in FAMILIES.values() for f in own_keys(fam.config)))


# The ModelConfig fields every family's spec depends on (the cache key), then the families' own.
SHARED_SHAPE_KEYS = (
    "family",
    "head_dim",
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_dim",
    "vocab_size",
    "tie_embeddings",
    "moe",  # the sparse families' block (num_experts 0: dense)
)
SHAPE_KEYS = (*SHARED_SHAPE_KEYS, *own_fields())


def shape_keys(m: ModelConfig) -> tuple[str, ...]:
    """The keys ``m``'s spec depends on: the shared ones and its family's own."""
    return _shape_keys(model_schema(m))


@functools.cache
def _shape_keys(schema: type[ModelConfig]) -> tuple[str, ...]:
    return (*SHARED_SHAPE_KEYS, *own_keys(schema))


_SCALARS = (int, float, str, bool, Enum, type(None))


def _frozen(v: Any) -> Any:
    """A hashable stand-in for a key's value (a family's nested block, a list). Scalars first: the
    layout search asks for the spec hundreds of thousands of times (model_spec)."""
    if isinstance(v, _SCALARS):
        return v
    names = _field_names(type(v))
    if names is not None:
        return (type(v).__name__, *(_frozen(getattr(v, n)) for n in names))
    return tuple(_frozen(x) for x in v) if isinstance(v, list) else v


@functools.cache
def _field_names(tp: type) -> tuple[str, ...] | None:
    """A dataclass type's field names (None for any other type)."""
    return tuple(f.name for f in dataclasses.fields(tp)) if dataclasses.is_dataclass(tp) else None


_SPECS: dict[tuple, ModelSpec] = {}
_MAX_SPECS = 256


def model_spec(m: ModelConfig) -> ModelSpec:
    """The spec of ``m``'s shape; cached (the layout search plans the same model hundreds of times).
    Built from the shape keys alone (the family's schema, every other key at its default), so a
    spec cannot depend on a key the cache does not see."""
    keys = shape_keys(m)
    key = tuple((k, _frozen(getattr(m, k))) for k in keys)
    spec = _SPECS.get(key)
    if spec is None:
        if len(_SPECS) >= _MAX_SPECS:
            _SPECS.clear()
        shape = model_schema(m)(**{k: getattr(m, k) for k in keys})
        spec = _SPECS[key] = FAMILIES[m.family].spec(shape)
    return spec


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated units (what activation checkpointing, per-block compile and FSDP wrap),
    as its spec names them; a pipeline stage holds only some of them."""
    container = model.get_submodule(model_spec(model.cfg).blocks)
    return list(container.values())
