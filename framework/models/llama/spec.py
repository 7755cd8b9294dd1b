"""The Llama layout (torchtitan's module names; Hugging Face ``LlamaForCausalLM``'s names): one
dense kind, ``dense xN``."""

from __future__ import annotations

from framework.config.schema import ModelConfig
from framework.models.llama.hf import HF_ARCHITECTURE
from framework.models.parts.layout import decoder_spec, dense_kind, head_dim, repeated
from framework.models.spec import ModelSpec


def llama_spec(m: ModelConfig) -> ModelSpec:
    hd = head_dim(m)
    return decoder_spec(m, "llama", repeated(dense_kind(m, hd), m), hd, HF_ARCHITECTURE)
