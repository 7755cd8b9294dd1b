"""DeepSeek-V3 in ``transformers`` (``DeepseekV3ForCausalLM``, 5.x): its class, its config.json fields
and the Hub files' names.

``DeepseekV3Config``: the attention's ``q_lora_rank`` (null: one full q projection), ``kv_lora_rank``,
``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``; RoPE in ``rope_parameters`` (rope_type
``yarn`` with ``factor``, ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``,
``mscale``, ``mscale_all_dim``), ``rope_interleave: true`` (the pairs interleaved: our order);
``first_k_dense_replace`` dense layers (``intermediate_size`` wide) then MoE ones: ``n_routed_experts``
of ``moe_intermediate_size``, ``n_shared_experts`` beside them, sigmoid scores with the selection bias
``e_score_correction_bias``, ``n_group`` / ``topk_group``, ``norm_topk_prob``, ``routed_scaling_factor``.
The Hub files keep one tensor per expert: ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``.
Multi-token prediction layers (``model.layers.{num_hidden_layers}.*``, ``num_nextn_predict_layers``):
read into the MTP layer with ``model.mtp_layers=1`` (the spec's ``mtp``), skipped with one warning
without it (``framework.checkpoint.import_hf.mtp_layer_names``); the export writes them back, with
their copies of the embedding and head, and ``num_nextn_predict_layers: model.mtp_layers``.
"""

from __future__ import annotations

from typing import Any

from framework.config.schema import RouterScore
from framework.models.spec import MLPKind

HF_ARCHITECTURE = "DeepseekV3ForCausalLM"
# Our field -> config.json key (integers; 0 is HF's null).
HF_FIELDS = {
    "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim",
}
HF_MOE_FIELDS = {
    "num_experts": "n_routed_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "moe_intermediate_size": "moe_intermediate_size",
    "norm_topk_prob": "norm_topk_prob",
    "routed_scaling_factor": "routed_scaling_factor",
    "num_shared_experts": "n_shared_experts",
    "n_group": "n_group",
    "topk_group": "topk_group",
}
# What DeepseekV3ForCausalLM computes: interleaved RoPE pairs, SiLU, no biases; the sigmoid router.
HF_FIXED: dict[str, object] = {"rope_interleave": True}
HF_MOE_VALUES: dict[str, object] = {"router_score": RouterScore.sigmoid, "shared_intermediate_size": 0}
HF_PREFIX = "mlp"
HF_EXPERT_PARTS = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
MOE_KEYS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "router_score",
    "routed_scaling_factor",
    "bias_update_rate",
    "capacity_factor",
    "router_aux_loss_coef",
    "aux_loss_scope",
    "num_shared_experts",
    "n_group",
    "topk_group",
    "expert_kernel",
)
_YARN = {
    "rope_yarn_factor": "factor",
    "rope_yarn_original_max_position": "original_max_position_embeddings",
    "rope_yarn_beta_fast": "beta_fast",
    "rope_yarn_beta_slow": "beta_slow",
    "rope_yarn_mscale": "mscale",
    "rope_yarn_mscale_all_dim": "mscale_all_dim",
}
_YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}


def hf_read(c: dict[str, Any], where: str) -> dict[str, Any]:
    """Our fields that config.json holds in its own form: the layer pattern (from
    ``first_k_dense_replace``) and YaRN (from ``rope_parameters``, or v4's ``rope_scaling``). ValueError
    for a value our model would compute otherwise."""
    n, k = c.get("num_hidden_layers"), c.get("first_k_dense_replace", 3)
    if not isinstance(k, int) or isinstance(k, bool) or not isinstance(n, int) or not 0 <= k <= n:
        raise ValueError(
            f"{where}: config.json has first_k_dense_replace={k!r}; valid: an integer in 0..num_hidden_layers={n}"
        )
    pattern = ", ".join(p for p in (f"dense x{k}" if k else "", f"moe x{n - k}" if n > k else "") if p)
    out: dict[str, Any] = {"layer_pattern": pattern, "head_dim": 0}
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "yarn":
        for ours, theirs in _YARN.items():
            value = rope.get(theirs, _YARN_DEFAULTS.get(theirs))
            if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(
                    f"{where}: config.json's rope_parameters has {theirs}={value!r}; valid: a number"
                )
            out[ours] = int(value) if ours == "rope_yarn_original_max_position" else float(value)
    elif kind != "default":
        raise ValueError(
            f"{where}: config.json has RoPE scaling {rope!r}; valid: rope_type 'default' or 'yarn'"
        )
    theta = rope.get("rope_theta", c.get("rope_theta"))
    if theta is not None:
        out["rope_theta"] = float(theta)
    return out


def hf_write(m: Any, layers: tuple) -> dict[str, Any]:
    """config.json's own form of the layer pattern and YaRN; ValueError for a stack transformers'
    class cannot build (a dense layer after an MoE one: its only layout is first_k_dense_replace dense
    layers, then MoE ones)."""
    sparse = [kind.mlp is not MLPKind.dense for kind in layers]
    k = sparse.index(True) if True in sparse else len(sparse)
    if any(not s for s in sparse[k:]):
        raise ValueError(
            f"export-hf: model.layer_pattern={m.layer_pattern!r} has a dense layer after an MoE one; valid for "
            f"DeepseekV3ForCausalLM: dense layers first, then MoE ones ('dense xK, moe xN')"
        )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_yarn_factor != 1.0:
        rope = {"rope_type": "yarn", "rope_theta": m.rope_theta} | {
            t: getattr(m, o) for o, t in _YARN.items()
        }
    return {
        "first_k_dense_replace": k,
        "rope_parameters": rope,
        "rope_scaling": rope if rope["rope_type"] != "default" else None,
        "head_dim": m.qk_rope_head_dim,
        "qk_head_dim": m.qk_nope_head_dim + m.qk_rope_head_dim,
        "num_nextn_predict_layers": getattr(m, "mtp_layers", 0),
    }
