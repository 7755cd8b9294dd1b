"""Mistral's block: Llama's (the window is the trunk's mask, from the spec)."""

from __future__ import annotations

from torch import nn

from framework.config.schema import ModelConfig
from framework.models.parts.decoder import dense_block
from framework.models.spec import LayerKind, ModelSpec


def mistral_block(cfg: ModelConfig, spec: ModelSpec, kind: LayerKind) -> nn.Module:
    return dense_block(cfg, spec)
