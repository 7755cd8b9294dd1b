"""Qwen3-MoE in ``transformers``: its class, its MoE config.json fields and the Hub files' names.

``Qwen3MoeConfig``: ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size`` (one expert's
width; ``intermediate_size`` is the dense MLP's, which only ``mlp_only_layers`` would use),
``norm_topk_prob``, ``router_aux_loss_coef``; every layer sparse (``decoder_sparse_step: 1``,
``mlp_only_layers: []``, the published models' values; other values are refused by the importer).
The Hub files keep one tensor per expert: ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``,
the router ``mlp.gate.weight``.
"""

HF_ARCHITECTURE = "Qwen3MoeForCausalLM"
HF_FIELDS: dict[str, str] = {}
# model.moe key -> config.json key (both ways).
HF_MOE_FIELDS = {
    "num_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "moe_intermediate_size": "moe_intermediate_size",
    "norm_topk_prob": "norm_topk_prob",
    "router_aux_loss_coef": "router_aux_loss_coef",
}
# config.json fields that must hold these values (what our block computes).
HF_FIXED = {"decoder_sparse_step": 1, "mlp_only_layers": []}
HF_PREFIX = "mlp"  # the layer's module in the Hub files
HF_EXPERT_PARTS = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
# The model.moe keys the family reads (framework.launch.rules refuses the others changed).
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
    "shared_intermediate_size",
    "expert_kernel",
)
