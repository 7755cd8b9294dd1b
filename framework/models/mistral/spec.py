"""The Mistral layout: Llama's block; the spec carries the attention window."""

from __future__ import annotations

import dataclasses

from framework.config.schema import MistralConfig
from framework.models.mistral.hf import HF_ARCHITECTURE
from framework.models.parts.layout import decoder_spec, dense_block, dense_saved_values, head_dim
from framework.models.spec import ModelSpec


def mistral_spec(m: MistralConfig) -> ModelSpec:
    hd = head_dim(m)
    spec = decoder_spec(m, "mistral", dense_block(m, hd), hd, HF_ARCHITECTURE)
    return dataclasses.replace(spec, sliding_window=m.sliding_window)


def activation_values(m: MistralConfig) -> int:
    """What one Mistral block saves per token: the dense block's values (the banded mask is one
    seq x seq boolean per forward, shared by every layer, not per layer)."""
    return dense_saved_values(m, head_dim(m))
