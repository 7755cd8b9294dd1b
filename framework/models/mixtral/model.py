"""Mixtral's block: Llama's attention (the window is the trunk's mask, from the spec), then the MoE layer."""

from __future__ import annotations

from torch import nn

from framework.config.schema import ModelConfig
from framework.models.parts.sparse import sparse_block
from framework.models.spec import LayerKind, ModelSpec


def mixtral_block(cfg: ModelConfig, spec: ModelSpec, kind: LayerKind) -> nn.Module:
    return sparse_block(cfg, spec)
