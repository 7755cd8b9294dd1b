"""The ``model`` group's rules: the shape (so a bad one never reaches the model code), the families' own
keys, and the range of each ``model.moe`` key on a family that reads it.

Which family reads which ``model.moe`` key is its record's (``framework.models``, a layer above):
``framework.launch.rules.family_gated`` wraps each range here with that gate.
"""

from __future__ import annotations

import math
from typing import Any

from framework.config.rules.rule import (
    MAX_EXPERTS,
    MAX_HEADS,
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_WIDTH,
    TYPED,
    Rule,
    integer,
    is_int,
    is_number,
    name,
    names_list,
    number,
    optional_path,
)
from framework.config.schema import Config


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if 0 < n <= 1_000_000 else []


def _head_dim_ok(v: Any, c: Config) -> bool:
    if not is_int(v) or not 1 <= v <= MAX_WIDTH:
        return False
    return c.model.head_dim > 0 or (v % c.model.n_heads == 0 and (v // c.model.n_heads) % 2 == 0)


def _dim_valid(c: Config) -> str:
    h = c.model.n_heads
    if c.model.head_dim > 0:
        return f"an integer in 1..{MAX_WIDTH}"
    return (
        f"a positive multiple of model.n_heads={h} up to {MAX_WIDTH} whose head dim (dim / n_heads) is even for rotary "
        f"embeddings, e.g. {[2 * h * k for k in (16, 32, 64)]}"
    )


def _kv_ok(v: Any, c: Config) -> bool:
    return is_int(v) and 1 <= v <= c.model.n_heads and c.model.n_heads % v == 0


MODEL_RULES: dict[str, Rule] = {
    # model: the shape is checked here so a bad one never reaches the model code (model.dim=0 was a
    # 253-line traceback from inside a rank).
    "model.name": name(),
    "model.family": TYPED,
    # Before model.dim, whose rule reads it. RoPE rotates pairs of features: an even size.
    "model.head_dim": Rule(
        "0 (= model.dim / model.n_heads) or an even integer >= 2",
        lambda v, _c: is_int(v) and 0 <= v <= 2**20 and v % 2 == 0,
        (-2, 3),
    ),
    "model.n_heads": integer(1, MAX_HEADS),  # before model.dim and model.n_kv_heads, whose rules divide by it
    "model.dim": Rule(_dim_valid, _head_dim_ok, (0, 130, 132, MAX_WIDTH * 2)),
    # Bounded: the launcher lists every layer's tensors (num_hidden_layers: 50000000 in an HF
    # config.json hung it); the largest published models have ~128 layers.
    "model.n_layers": integer(1, MAX_LAYERS),
    "model.n_kv_heads": Rule(
        lambda c: f"a divisor of model.n_heads={c.model.n_heads}: {_divisors(c.model.n_heads)}",
        _kv_ok,
        (0, 3, 8),
    ),
    "model.ffn_dim": integer(1, MAX_WIDTH),
    # The families' own keys (framework.config.schema.MODEL_SCHEMAS): each exists only under its
    # family's option (model=mistral), so a rule here reads it only there.
    "model.sliding_window": integer(
        0, MAX_POSITIONS, what="0 = off, full causal attention; >= 1: the window"
    ),
    # DeepSeek-V3's multi-head latent attention (framework.models.deepseek_v3) and YaRN.
    "model.q_lora_rank": integer(0, MAX_WIDTH, what="0 = one full query projection"),
    "model.kv_lora_rank": integer(1, MAX_WIDTH),
    "model.qk_nope_head_dim": integer(1, MAX_WIDTH),
    # RoPE rotates pairs of features: an even size.
    "model.qk_rope_head_dim": Rule(
        "an even integer >= 2 (RoPE rotates pairs of features)",
        lambda v, _c: is_int(v) and 2 <= v <= MAX_WIDTH and v % 2 == 0,
        (0, 7, MAX_WIDTH + 2),
    ),
    "model.v_head_dim": integer(1, MAX_WIDTH),
    "model.rope_yarn_factor": number(1, 1024, what="1 = no YaRN", bad=(math.nan, math.inf, 0.5, 1e18)),
    "model.rope_yarn_original_max_position": integer(1, MAX_POSITIONS),
    "model.rope_yarn_beta_fast": number(0, 1e4, lo_open=True),
    "model.rope_yarn_beta_slow": number(0, 1e4, lo_open=True),
    "model.rope_yarn_mscale": number(0, 1e4),
    "model.rope_yarn_mscale_all_dim": number(0, 1e4),
    "model.rope_yarn_truncate": TYPED,
    # DeepSeek-V3's multi-token prediction; its layouts are checked by
    # framework.launch.rules.check_family_layout (no pipeline: the last stage would need the embedding).
    "model.mtp_layers": integer(0, 1, what="0 = off, 1 = one multi-token prediction layer"),
    "model.mtp_loss_weight": number(0, 1e4),
    # GPT-OSS's own (framework.models.gpt_oss): the experts' SwiGLU clamp.
    "model.swiglu_limit": number(0, 1e4, lo_open=True),
    "model.vocab_size": integer(1, 2**32, what="token ids are stored as uint16/uint32"),
    "model.norm_eps": number(0, 1, lo_open=True),
    "model.rope_theta": number(0, 1e12, lo_open=True),  # published: 1e4 to 1e7
    "model.rope_scaling_factor": number(
        1, 1024, what="1 = no RoPE scaling", bad=(math.nan, math.inf, 0.5, 1e18)
    ),
    "model.rope_low_freq_factor": number(0, 1e4, lo_open=True),
    # The interpolation divides by (high - low): equal factors would divide by zero.
    "model.rope_high_freq_factor": Rule(
        lambda c: f"a finite number > model.rope_low_freq_factor={c.model.rope_low_freq_factor:g} and <= 1e4",
        lambda v, c: is_number(v) and math.isfinite(v) and c.model.rope_low_freq_factor < v <= 1e4,
        (1.0, math.nan, 1e5),
    ),
    "model.rope_original_max_position": integer(1, MAX_POSITIONS),
    "model.max_position_embeddings": integer(0, MAX_POSITIONS, what="0 = train.seq_len"),
    "model.tie_embeddings": TYPED,
    "model.init_std": number(0, 1, lo_open=True),
    # fa4 off CUDA, off sm90/sm100, with an unsupported head size, with context parallelism, without
    # torch's registry or the package is refused by framework.kernels.fa4 before launch (with
    # data.document_mask, by framework.data).
    "model.attention": TYPED,
    "model.residual_dtype": TYPED,
    # CPU, GPUs below sm89 and shapes float8 cannot handle are refused by framework.kernels.float8 before launch.
    "model.float8": TYPED,
    "model.float8_skip": names_list(
        "Linear name fragments (non-empty strings); [] converts every eligible layer"
    ),
    "model.float8_size_filter": TYPED,
    "model.float8_grad_dtype": Rule(
        "e5m2 (default) or e4m3, only with model.float8=tensorwise (rowwise casts gradients to e4m3)",
        checked_by="framework.config.rules.keys.check_option_fields (model.float8_grad_dtype is only_with tensorwise)",
        bad=("e4m3",),
    ),
    "model.float8_fast_accum": Rule(
        "true or false (default), only with model.float8=tensorwise or rowwise",
        checked_by="framework.config.rules.keys.check_option_fields (model.float8_fast_accum is only_with float8)",
        bad=(True,),
    ),
    # Off CUDA (in a dry run: the declared hardware), a missing package (a dry run warns), executor.scope=model
    # and TP are refused by framework.kernels.fused_ce before launch.
    "model.fused_cross_entropy": TYPED,
    "model.init_from": optional_path(
        "framework.checkpoint.init_from reads the checkpoint and checks every tensor"
    ),
}


# The context the range of a key is tested in: a sparse family with 4 experts.
_SPARSE = (("model.family", "qwen3_moe"), ("model.moe.num_experts", 4))
# DeepSeek-V3's routing keys are tested on its family with 8 experts.
_DEEPSEEK = (("model.family", "deepseek_v3"), ("model.moe.num_experts", 8))


def _n_group_ok(g: int, experts: int) -> bool:
    return g == 1 or (1 < g and experts % g == 0 and experts // g >= 2)


def _topk_group_ok(tg: int, moe: Any) -> bool:
    g = moe.n_group
    return 1 <= tg <= g and moe.num_experts_per_tok <= tg * (moe.num_experts // max(g, 1))


# model.moe: the range of each key (and its relation to the others) on a family that reads it; on a
# family that does not, the key must stay at its default (framework.launch.rules.family_gated).
MOE_RULES: dict[str, Rule] = {
    "model.moe.num_experts": Rule(
        f"an integer in 1..{MAX_EXPERTS} (a sparse family has experts)",
        lambda v, _c: is_int(v) and 1 <= v <= MAX_EXPERTS,
        (0, -1, MAX_EXPERTS + 1),
        context=(("model.family", "qwen3_moe"),),
    ),
    "model.moe.num_experts_per_tok": Rule(
        lambda c: f"an integer in 1..model.moe.num_experts={c.model.moe.num_experts} (top-k of the experts)",
        lambda v, c: is_int(v) and 1 <= v <= c.model.moe.num_experts,
        (0, 5),
        context=_SPARSE,
    ),
    "model.moe.moe_intermediate_size": Rule(
        f"0 (= model.ffn_dim) or an integer in 1..{MAX_WIDTH}",
        lambda v, _c: is_int(v) and 0 <= v <= MAX_WIDTH,
        (-1, MAX_WIDTH + 1),
        context=_SPARSE,
    ),
    "model.moe.norm_topk_prob": Rule("true or false", lambda v, _c: isinstance(v, bool), (False,)),
    "model.moe.router_score": Rule("softmax or sigmoid", lambda v, _c: True, ("sigmoid",)),
    "model.moe.routed_scaling_factor": Rule(
        "a finite number > 0 and <= 1000 (1 = off)",
        lambda v, _c: is_number(v) and math.isfinite(v) and 0 < v <= 1000,
        (0.0, -1.0, math.nan, 1e18),
        context=_SPARSE,
    ),
    "model.moe.bias_update_rate": Rule(
        "a finite number >= 0 and <= 1 (0 = a fixed zero selection bias)",
        lambda v, _c: is_number(v) and math.isfinite(v) and 0 <= v <= 1,
        (-0.001, math.nan, 1e18),
        context=(*_SPARSE, ("model.moe.router_score", "sigmoid")),
    ),
    "model.moe.capacity_factor": Rule(
        f"0 (no token dropped) or a finite number > 0 and <= {MAX_EXPERTS} (the experts' count)",
        lambda v, _c: is_number(v) and math.isfinite(v) and 0 <= v <= MAX_EXPERTS,
        (-1.0, math.nan, math.inf, 1e18),
        context=_SPARSE,
    ),
    "model.moe.router_aux_loss_coef": Rule(
        "a finite number >= 0 and <= 1 (0 = no load-balancing loss; published: 0.001 to 0.02)",
        lambda v, _c: is_number(v) and math.isfinite(v) and 0 <= v <= 1,
        (-0.1, math.nan, 1e18),
        context=_SPARSE,
    ),
    "model.moe.aux_loss_scope": Rule("global or layer", lambda v, _c: True, ("layer",)),
    "model.moe.num_shared_experts": Rule(
        f"an integer in 0..{MAX_EXPERTS}",
        lambda v, _c: is_int(v) and 0 <= v <= MAX_EXPERTS,
        (-1, MAX_EXPERTS + 1),
        context=_SPARSE,
    ),
    "model.moe.shared_intermediate_size": Rule(
        f"0 (= the routed experts' width) or an integer in 1..{MAX_WIDTH}",
        lambda v, _c: is_int(v) and 0 <= v <= MAX_WIDTH,
        (-1, MAX_WIDTH + 1),
        context=_SPARSE,
    ),
    "model.moe.expert_kernel": Rule("auto, grouped or loop", lambda v, _c: True, ("loop",)),
    # DeepSeek-V3's group-limited routing (framework.models.moe.check_moe says why each bound).
    "model.moe.n_group": Rule(
        lambda c: (
            f"a divisor of model.moe.num_experts={c.model.moe.num_experts} leaving >= 2 experts a group, "
            "or 1 (no group limit)"
        ),
        lambda v, c: is_int(v) and _n_group_ok(v, c.model.moe.num_experts),
        (0, 3, 8),
        context=_DEEPSEEK,
    ),
    "model.moe.topk_group": Rule(
        lambda c: (
            f"an integer in 1..model.moe.n_group={c.model.moe.n_group}, its groups holding at least "
            f"model.moe.num_experts_per_tok={c.model.moe.num_experts_per_tok} experts"
        ),
        lambda v, c: is_int(v) and _topk_group_ok(v, c.model.moe),
        (0, 5),
        context=(*_DEEPSEEK, ("model.moe.n_group", 4)),
    ),
}
