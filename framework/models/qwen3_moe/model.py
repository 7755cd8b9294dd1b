"""Qwen3-MoE's block: Qwen3's attention (per-head q/k norms), then the MoE layer."""

from __future__ import annotations

from torch import nn

from framework.config.schema import ModelConfig
from framework.models.parts.sparse import sparse_block
from framework.models.spec import LayerKind, ModelSpec


def qwen3_moe_block(cfg: ModelConfig, spec: ModelSpec, kind: LayerKind) -> nn.Module:
    return sparse_block(cfg, spec, qk_norm=True)
