"""The Llama layout (torchtitan's module names; Hugging Face ``LlamaForCausalLM``'s names)."""

from __future__ import annotations

from framework.config.schema import ModelConfig
from framework.models.llama.hf import HF_ARCHITECTURE
from framework.models.parts.layout import decoder_spec, dense_block, dense_saved_values, head_dim
from framework.models.spec import ModelSpec


def llama_spec(m: ModelConfig) -> ModelSpec:
    hd = head_dim(m)
    return decoder_spec(m, "llama", dense_block(m, hd), hd, HF_ARCHITECTURE)


def activation_values(m: ModelConfig) -> int:
    """What one Llama block saves per token: the dense block's values."""
    return dense_saved_values(m, head_dim(m))
