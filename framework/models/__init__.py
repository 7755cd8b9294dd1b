"""Model families: one folder each (``llama/``, ``qwen3/``, ``mistral/``: spec, block, HF fields,
the planner's activation term, brought together in a ``Family`` record), on shared pieces
(``parts/``: norm, RoPE, attention and its masks, MLP, the decoder trunk, the KV-cache decode, the
sparse block on ``moe.py``'s MoE layer for ``qwen3_moe/`` and ``mixtral/``).

The rest of the framework reads the family record (``family(cfg)``), the spec (``model_spec(cfg)``)
and the decoder interface (``Decoder``), never a family's module.
"""

from __future__ import annotations

from framework.models.build import active_params, build_model, decoder, flops_per_token, num_params
from framework.models.family import Family
from framework.models.parts.cache import KVCache
from framework.models.parts.decoder import Decoder, forward_cached
from framework.models.parts.mtp import take_mtp
from framework.models.parts.sparse import (
    RoutingState,
    balance_row,
    routing_state,
    routing_unchanged,
    set_routing_state,
    take_aux,
    token_group_of,
    update_expert_biases,
)
from framework.models.parts.weights import WeightLoader, compute_dtype, materialize, tie
from framework.models.registry import FAMILIES, SHAPE_KEYS, blocks, family, model_spec, own_fields
from framework.models.spec import AttentionKind, LayerKind, MLPKind, ModelSpec, TPStyle, Weight, layer_pattern

__all__ = [
    "FAMILIES",
    "balance_row",
    "RoutingState",
    "routing_state",
    "routing_unchanged",
    "set_routing_state",
    "take_aux",
    "take_mtp",
    "token_group_of",
    "update_expert_biases",
    "SHAPE_KEYS",
    "Decoder",
    "Family",
    "KVCache",
    "ModelSpec",
    "AttentionKind",
    "LayerKind",
    "MLPKind",
    "layer_pattern",
    "TPStyle",
    "Weight",
    "WeightLoader",
    "active_params",
    "blocks",
    "build_model",
    "compute_dtype",
    "decoder",
    "family",
    "flops_per_token",
    "forward_cached",
    "materialize",
    "model_spec",
    "num_params",
    "own_fields",
    "tie",
]
