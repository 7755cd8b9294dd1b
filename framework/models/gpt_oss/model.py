"""GPT-OSS's block: attention with sinks (its kind's window), then the MoE layer with biased experts."""

from __future__ import annotations

from torch import nn

from framework.config.schema import GptOssConfig
from framework.models.gpt_oss.attention import SinkAttention
from framework.models.gpt_oss.experts import GptOssMoE
from framework.models.gpt_oss.hf import SWIGLU_ALPHA
from framework.models.grouped import ExpertKernel
from framework.models.parts.decoder import TransformerBlock
from framework.models.parts.sparse import expert_width
from framework.models.spec import LayerKind, ModelSpec


def gpt_oss_block(cfg: GptOssConfig, spec: ModelSpec, kind: LayerKind) -> nn.Module:
    attention = SinkAttention(cfg.dim, cfg.n_heads, cfg.n_kv_heads, spec.head_dim, kind.window, cfg.attention)
    moe = cfg.moe
    experts = GptOssMoE(
        cfg.dim,
        expert_width(cfg),
        moe.num_experts,
        moe.num_experts_per_tok,
        SWIGLU_ALPHA,
        cfg.swiglu_limit,
        ExpertKernel(moe.expert_kernel.value),
    )
    return TransformerBlock(cfg, attention, experts)
