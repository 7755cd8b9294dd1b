"""Qwen3 dense (Hugging Face ``Qwen3ForCausalLM``): the record the registry lists."""

from __future__ import annotations

from framework.config.schema import Qwen3Config
from framework.models.family import Family
from framework.models.qwen3.hf import HF_ARCHITECTURE, HF_FIELDS
from framework.models.qwen3.model import qwen3_block
from framework.models.qwen3.spec import qwen3_spec

QWEN3 = Family(
    "qwen3",
    qwen3_spec,
    qwen3_block,
    HF_ARCHITECTURE,
    HF_FIELDS,
    config=Qwen3Config,
    # q/k norms, and heads wider than dim / n_heads (4 x 32 = 128 > 64)
    tiny=dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=96),
)
