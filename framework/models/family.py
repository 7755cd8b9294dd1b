"""A model family's record: what the rest of the framework reads to build, shard, convert and plan
one family, so that a new family is one folder under ``framework.models`` plus one registry line.

Why a record rather than ``family ==`` checks: the HF converters, the planner and the generator
used to spell each family's differences out where they were needed (adding Qwen3 edited 9
modules); they now read the record's fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from framework.config.schema import ModelConfig
from framework.models.spec import ModelSpec


@dataclass(frozen=True)
class Family:
    """``spec``: the layout of one shape. ``hf_fields``: the family's own ModelConfig field -> its
    HF ``config.json`` key, beyond the fields every family here shares (``import_hf.SHAPE_FIELDS``);
    0 in ours is ``null`` in HF's (off), both ways."""

    name: str
    spec: Callable[[ModelConfig], ModelSpec]
    hf_architecture: str
    hf_fields: dict[str, str] = field(default_factory=dict)
