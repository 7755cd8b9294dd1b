"""The registry of families (one line each) and the cached spec of a shape.

``model_spec(cfg)`` is what the planner, the TP plan, activation checkpointing, compile, FSDP,
float8 and the Hugging Face converters read; ``framework.models.build`` builds the modules it
describes. A new family is its folder and one line in ``FAMILIES``.
"""

from __future__ import annotations

import dataclasses
import functools

from torch import nn

from framework.config.schema import ModelConfig, ModelFamily, MoEConfig
from framework.models.family import Family
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
}


def family(m: ModelConfig) -> Family:
    """``m``'s family record."""
    return FAMILIES[m.family]


@functools.lru_cache(maxsize=256)
def _spec(key: tuple) -> ModelSpec:
    values = dict(key)
    if "moe" in values:  # the MoE keys, hashed as a tuple of items (a list as a tuple)
        values["moe"] = MoEConfig(**{k: list(v) if isinstance(v, tuple) else v for k, v in values["moe"]})
    m = ModelConfig(**values)
    return FAMILIES[m.family].spec(m)


def _key_value(m: ModelConfig, k: str) -> object:
    v = getattr(m, k)
    if k == "moe":
        return tuple((f.name, _hashable(getattr(v, f.name))) for f in dataclasses.fields(v))
    return v


def _hashable(v: object) -> object:
    return tuple(v) if isinstance(v, list) else v


def model_spec(m: ModelConfig) -> ModelSpec:
    """The spec of ``m``'s shape; cached (the layout search plans the same model hundreds of times)."""
    key = tuple((k, _key_value(m, k)) for k in SHAPE_KEYS)
    return _spec(key)


def own_fields() -> tuple[str, ...]:
    """The ModelConfig fields some family has as its own (its record's ``hf_fields``: integers, 0 =
    off), in registry order: the launcher rules them (a window only where the family computes one)
    and the spec cache keys on them, with no per-field line outside the family's folder."""
    return tuple(dict.fromkeys(f for fam in FAMILIES.values() for f in fam.hf_fields))


# The ModelConfig fields a spec depends on (the cache key): the shared shape, then the families' own.
SHAPE_KEYS = (
    "family",
    "head_dim",
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "ffn_dim",
    "vocab_size",
    "tie_embeddings",
    "moe",
    *own_fields(),
)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated units (what activation checkpointing, per-block compile and FSDP wrap),
    as its spec names them; a pipeline stage holds only some of them."""
    container = model.get_submodule(model_spec(model.cfg).blocks)
    return list(container.values())
