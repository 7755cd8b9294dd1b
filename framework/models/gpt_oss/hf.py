"""GPT-OSS in ``transformers`` (``GptOssForCausalLM``, 5.x): its class, its config.json fields and the
Hub files' names.

``GptOssConfig``: ``layer_types`` (``sliding_attention`` / ``full_attention`` per layer: our
``model.layer_pattern``), ``sliding_window``, ``attention_bias: true``, ``num_local_experts`` of
``intermediate_size`` (the experts' width: there is no dense MLP), ``num_experts_per_tok``,
``swiglu_limit`` (``swiglu_alpha`` 1.702 fixed), RoPE in ``rope_parameters`` (``yarn`` with
``factor``, ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``, ``truncate``). The
Hub files keep the experts stacked: ``mlp.experts.gate_up_proj`` (E, dim, 2 x width, gate and up
columns interleaved), ``down_proj`` (E, width, dim) and their biases; the router ``mlp.router``
with a bias; the per-head ``self_attn.sinks``. q/k rotate halves (permuted per head on the way, as
Llama's).
"""

from __future__ import annotations

from typing import Any

from framework.models.spec import LayerKind

HF_ARCHITECTURE = "GptOssForCausalLM"
HF_FIELDS = {"sliding_window": "sliding_window"}
HF_MOE_FIELDS = {
    "num_experts": "num_local_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "moe_intermediate_size": "intermediate_size",
}
# What GptOssForCausalLM computes: biases on attention (the shared import refuses them elsewhere).
HF_FIXED: dict[str, object] = {"attention_bias": True}
SWIGLU_ALPHA = 1.702  # transformers' swiglu_alpha, the published models' (not a config key here)
MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "expert_kernel")
_LAYER = {"sliding_attention": "sliding", "full_attention": "full"}
_YARN = {
    "rope_yarn_factor": "factor",
    "rope_yarn_original_max_position": "original_max_position_embeddings",
    "rope_yarn_beta_fast": "beta_fast",
    "rope_yarn_beta_slow": "beta_slow",
}


def hf_read(c: dict[str, Any], where: str) -> dict[str, Any]:
    """Our fields that config.json holds in its own form: the layer pattern (``layer_types``), YaRN
    (``rope_parameters``), ``swiglu_limit``. ValueError for a value our model would compute otherwise."""
    n, types = c.get("num_hidden_layers"), c.get("layer_types")
    if not isinstance(types, list) or len(types) != n or any(t not in _LAYER for t in types):
        raise ValueError(
            f"{where}: config.json has layer_types={types!r}; valid: num_hidden_layers={n} entries of "
            f"{'|'.join(_LAYER)}"
        )
    alpha = c.get("swiglu_alpha", SWIGLU_ALPHA)
    if alpha != SWIGLU_ALPHA:
        raise ValueError(
            f"{where}: config.json has swiglu_alpha={alpha!r}; valid: {SWIGLU_ALPHA} (GPT-OSS's)"
        )
    out: dict[str, Any] = {"layer_pattern": ", ".join(_LAYER[t] for t in types)}
    limit = c.get("swiglu_limit", 7.0)
    if isinstance(limit, bool) or not isinstance(limit, (int, float)):
        raise ValueError(f"{where}: config.json has swiglu_limit={limit!r}; valid: a number")
    out["swiglu_limit"] = float(limit)
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "yarn":
        for ours, theirs in _YARN.items():
            value = rope.get(theirs)
            if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(
                    f"{where}: config.json's rope_parameters has {theirs}={value!r}; valid: a number"
                )
            out[ours] = int(value) if ours == "rope_yarn_original_max_position" else float(value)
        out["rope_yarn_truncate"] = bool(rope.get("truncate", True))
    elif kind != "default":
        raise ValueError(
            f"{where}: config.json has RoPE scaling {rope!r}; valid: rope_type 'default' or 'yarn'"
        )
    theta = rope.get("rope_theta", c.get("rope_theta"))
    if theta is not None:
        out["rope_theta"] = float(theta)
    return out


def hf_write(m: Any, layers: tuple[LayerKind, ...]) -> dict[str, Any]:
    """config.json's own form of the layer pattern, YaRN, the experts' width and the SwiGLU."""
    names = {v: k for k, v in _LAYER.items()}
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_yarn_factor != 1.0:
        rope = {"rope_type": "yarn", "rope_theta": m.rope_theta, "truncate": m.rope_yarn_truncate}
        rope |= {t: getattr(m, o) for o, t in _YARN.items()}
    return {
        "layer_types": [names[kind.name] for kind in layers],
        "rope_parameters": rope,
        "rope_scaling": rope if rope["rope_type"] != "default" else None,
        "intermediate_size": m.moe.moe_intermediate_size or m.ffn_dim,
        "swiglu_limit": m.swiglu_limit,
        "swiglu_alpha": SWIGLU_ALPHA,
        "attention_bias": True,
    }
