"""Mistral (Hugging Face ``MistralForCausalLM``): Llama's layout with sliding-window attention.

transformers' window (``masking_utils.sliding_window_overlay``): query ``q`` sees key ``k`` when
``q - sliding_window < k <= q``, i.e. itself and the ``sliding_window - 1`` positions before it;
``sliding_window: null`` is full causal attention (our 0).
"""

from __future__ import annotations

import dataclasses

from framework.config.schema import ModelConfig
from framework.models.family import Family
from framework.models.llama import decoder_spec, head_dim, llama_block
from framework.models.spec import ModelSpec


def mistral_spec(m: ModelConfig) -> ModelSpec:
    hd = head_dim(m)
    spec = decoder_spec(m, "mistral", llama_block(m, hd), hd, "MistralForCausalLM")
    return dataclasses.replace(spec, sliding_window=m.sliding_window)


MISTRAL = Family("mistral", mistral_spec, "MistralForCausalLM", {"sliding_window": "sliding_window"})
