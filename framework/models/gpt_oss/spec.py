"""The GPT-OSS layout: attention with biases and sinks (whole on every TP rank), the router with its
bias and the stacked experts with theirs, in the stack ``model.layer_pattern`` writes
(``[sliding, full] x12``): two kinds, equal weights, their windows differ."""

from __future__ import annotations

from framework.config.schema import GptOssConfig
from framework.models.gpt_oss.hf import HF_ARCHITECTURE
from framework.models.parts.layout import decoder_spec, head_dim
from framework.models.parts.sparse import expert_width, moe_kind
from framework.models.spec import ModelSpec, TPStyle, Weight, layer_pattern

R, M = TPStyle.replicated, TPStyle.moe


def attention_weights(m: GptOssConfig, hd: int) -> tuple[Weight, ...]:
    q, kv, d = m.n_heads * hd, m.n_kv_heads * hd, m.dim
    # The module's own parameter first, as named_parameters() lists it, then its Linears'.
    out: list[Weight] = [Weight("attention", "self_attn.sinks", (m.n_heads,), R, param="sinks")]
    for ours, theirs, rows, heads in (("wq", "q_proj", q, m.n_heads), ("wk", "k_proj", kv, m.n_kv_heads)):
        out.append(Weight(f"attention.{ours}", f"self_attn.{theirs}.weight", (rows, d), R, heads))
        out.append(Weight(f"attention.{ours}", f"self_attn.{theirs}.bias", (rows,), R, heads, param="bias"))
    for ours, theirs, shape in (("wv", "v_proj", (kv, d)), ("wo", "o_proj", (d, q))):
        out.append(Weight(f"attention.{ours}", f"self_attn.{theirs}.weight", shape, R))
        out.append(Weight(f"attention.{ours}", f"self_attn.{theirs}.bias", shape[:1], R, param="bias"))
    return tuple(out)


def moe_weights(m: GptOssConfig) -> tuple[Weight, ...]:
    e, i, d = m.moe.num_experts, expert_width(m), m.dim
    experts = "feed_forward.experts"
    return (
        # the router first, as named_parameters() lists the MoE module's children (router, experts)
        Weight("feed_forward.router", "mlp.router.weight", (e, d), M),
        Weight("feed_forward.router", "mlp.router.bias", (e,), M, param="bias"),
        Weight(experts, "mlp.experts.gate_up_proj", (e, d, 2 * i), M, param="gate_up_proj", stacked=True),
        Weight(
            experts, "mlp.experts.gate_up_proj_bias", (e, 2 * i), M, param="gate_up_proj_bias", stacked=True
        ),
        Weight(experts, "mlp.experts.down_proj", (e, i, d), M, param="down_proj", stacked=True),
        Weight(experts, "mlp.experts.down_proj_bias", (e, d), M, param="down_proj_bias", stacked=True),
    )


def gpt_oss_spec(m: GptOssConfig) -> ModelSpec:
    hd = head_dim(m)
    block = (
        Weight("attention_norm", "input_layernorm.weight", (m.dim,), TPStyle.sequence),
        *attention_weights(m, hd),
        Weight("ffn_norm", "post_attention_layernorm.weight", (m.dim,), TPStyle.sequence),
        *moe_weights(m),
    )
    kinds = {
        "sliding": moe_kind(m, block, hd, window=m.sliding_window, name="sliding"),
        "full": moe_kind(m, block, hd, name="full"),
    }
    layers = layer_pattern(m.layer_pattern, kinds, "model.layer_pattern")
    if len(layers) != m.n_layers:
        raise ValueError(
            f"model.layer_pattern={m.layer_pattern!r} gives {len(layers)} layers but model.n_layers={m.n_layers}; "
            f"valid: a pattern of {m.n_layers} layers (e.g. '[sliding, full] x{m.n_layers // 2}')"
        )
    return decoder_spec(m, "gpt_oss", layers, hd, HF_ARCHITECTURE)
