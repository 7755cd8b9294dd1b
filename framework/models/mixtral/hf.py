"""Mixtral in ``transformers``: its class, its own config.json fields and the Hub files' names.

``MixtralConfig``: ``num_local_experts``, ``num_experts_per_tok``, ``intermediate_size`` (one expert's
width: our ``model.ffn_dim``), ``router_aux_loss_coef``, ``sliding_window`` (null: off, our 0); the
router always renormalises its top-k weights. The Hub files keep one tensor per expert:
``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down), the router
``block_sparse_moe.gate.weight``.
"""

HF_ARCHITECTURE = "MixtralForCausalLM"
HF_FIELDS = {"sliding_window": "sliding_window"}
HF_MOE_FIELDS = {
    "num_experts": "num_local_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "router_aux_loss_coef": "router_aux_loss_coef",
}
HF_FIXED: dict[str, object] = {}
HF_PREFIX = "block_sparse_moe"
HF_EXPERT_PARTS = ("w1.weight", "w3.weight", "w2.weight")
# The model.moe keys the family reads: not moe_intermediate_size (the width is model.ffn_dim) nor
# norm_topk_prob (always on).
MOE_KEYS = (
    "num_experts",
    "num_experts_per_tok",
    "router_score",
    "routed_scaling_factor",
    "bias_update_rate",
    "capacity_factor",
    "router_aux_loss_coef",
    "aux_loss_scope",
    "num_shared_experts",
    "shared_intermediate_size",
    "expert_kernel",
)
