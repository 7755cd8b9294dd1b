"""The Mistral layout: Llama's block with the attention window, ``dense xN``. What a block saves is
the dense block's values (the banded mask is one seq x seq boolean per forward, shared by every
layer, not per layer)."""

from __future__ import annotations

from framework.config.schema import MistralConfig
from framework.models.mistral.hf import HF_ARCHITECTURE
from framework.models.parts.layout import decoder_spec, dense_kind, head_dim, repeated
from framework.models.spec import ModelSpec


def mistral_spec(m: MistralConfig) -> ModelSpec:
    hd = head_dim(m)
    kind = dense_kind(m, hd, window=m.sliding_window)
    return decoder_spec(m, "mistral", repeated(kind, m), hd, HF_ARCHITECTURE)
