"""Mistral (Hugging Face ``MistralForCausalLM``): Llama's layout with sliding-window attention.

transformers' window (``masking_utils.sliding_window_overlay``): query ``q`` sees key ``k`` when
``q - sliding_window < k <= q``, i.e. itself and the ``sliding_window - 1`` positions before it;
``sliding_window: null`` is full causal attention (our 0). The decoder trunk applies the spec's
window (``framework.models.parts.masks.causal_band``), in training and in the KV cache.
"""

from __future__ import annotations

from framework.config.schema import MistralConfig
from framework.models.family import Family
from framework.models.mistral.hf import HF_ARCHITECTURE, HF_FIELDS
from framework.models.mistral.model import mistral_block
from framework.models.mistral.spec import mistral_spec

MISTRAL = Family(
    "mistral",
    mistral_spec,
    mistral_block,
    HF_ARCHITECTURE,
    HF_FIELDS,
    config=MistralConfig,
    tiny=dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, sliding_window=8),  # 8 < a test's seq
)
