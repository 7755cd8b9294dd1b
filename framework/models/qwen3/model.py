"""Qwen3's block: Llama's, with an RMSNorm over each query and key head before RoPE."""

from __future__ import annotations

from torch import nn

from framework.config.schema import ModelConfig
from framework.models.parts.decoder import dense_block
from framework.models.spec import LayerKind, ModelSpec


def qwen3_block(cfg: ModelConfig, spec: ModelSpec, kind: LayerKind) -> nn.Module:
    return dense_block(cfg, spec, qk_norm=True)
