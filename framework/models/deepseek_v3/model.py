"""DeepSeek-V3's blocks: multi-head latent attention (framework.models.parts.mla), then SwiGLU (kind
``dense``) or the MoE layer with shared experts (kind ``moe``)."""

from __future__ import annotations

from torch import nn

from framework.config.schema import DeepseekV3Config
from framework.models.parts.decoder import TransformerBlock
from framework.models.parts.mla import LatentAttention, softmax_scale
from framework.models.parts.mlp import FeedForward
from framework.models.parts.sparse import SparseMLP, layer_config, sparse
from framework.models.spec import LayerKind, ModelSpec


def latent_attention(m: DeepseekV3Config) -> LatentAttention:
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    return LatentAttention(
        m.dim,
        m.n_heads,
        m.q_lora_rank,
        m.kv_lora_rank,
        m.qk_nope_head_dim,
        m.qk_rope_head_dim,
        m.v_head_dim,
        m.norm_eps,
        softmax_scale(qk, m.rope_yarn_factor, m.rope_yarn_mscale_all_dim),
        m.attention,
    )


def deepseek_v3_block(cfg: DeepseekV3Config, spec: ModelSpec, kind: LayerKind) -> nn.Module:
    if not kind.sparse:
        return TransformerBlock(cfg, latent_attention(cfg), FeedForward(cfg.dim, cfg.ffn_dim))
    return sparse(TransformerBlock(cfg, latent_attention(cfg), SparseMLP(layer_config(cfg))))
