"""Llama's block: pre-norm grouped-query attention and SwiGLU, from the shared parts."""

from __future__ import annotations

from torch import nn

from framework.config.schema import ModelConfig
from framework.models.parts.decoder import dense_block
from framework.models.spec import LayerKind, ModelSpec


def llama_block(cfg: ModelConfig, spec: ModelSpec, kind: LayerKind) -> nn.Module:
    return dense_block(cfg, spec)
