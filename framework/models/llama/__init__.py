"""Llama 2/3 (Hugging Face ``LlamaForCausalLM``): the record the registry lists."""

from __future__ import annotations

from framework.config.schema import LlamaConfig
from framework.models.family import Family
from framework.models.llama.hf import HF_ARCHITECTURE, HF_FIELDS
from framework.models.llama.model import llama_block
from framework.models.llama.spec import llama_spec

LLAMA = Family(
    "llama",
    llama_spec,
    llama_block,
    HF_ARCHITECTURE,
    HF_FIELDS,
    config=LlamaConfig,
    tiny=dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96),
)
