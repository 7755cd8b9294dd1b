"""GPT-OSS's MoE layer (transformers' ``GptOssMLP``): a router with a bias whose top-k logits are
softmaxed (softmax after the top-k, not before), and experts with biases and GPT-OSS's clamped SwiGLU:
the gate clamped above at ``limit``, the up projection to [-limit, limit], ``(up + 1) * gate *
sigmoid(alpha * gate)`` (alpha 1.702, limit 7.0 in the published models).

The stacked weights keep the Hub files' layout, so import and export copy them whole:
``gate_up_proj`` (E, dim, 2 x width) with gate and up columns interleaved (gate the even ones),
``down_proj`` (E, width, dim), their biases (E, 2 x width) and (E, dim). Each expert runs on the rows
routed to it (a loop over the experts that got rows): the reference path; the grouped GEMM and expert
parallelism of framework.models.moe do not take biases or this activation yet.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's activation over interleaved (gate, up) columns: (..., 2 x width) -> (..., width)."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssMoE(nn.Module):
    """``forward(x)`` (batch, seq, dim) -> the same shape: each token's top-k experts, weighted."""

    def __init__(
        self, dim: int, width: int, num_experts: int, top_k: int, alpha: float = 1.702, limit: float = 7.0
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.alpha, self.limit = num_experts, top_k, alpha, limit
        self.router = nn.Linear(dim, num_experts, bias=True)
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, dim, 2 * width))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * width))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, width, dim))
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, dim))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, indices), each (tokens, top_k): the top-k router logits, softmaxed among themselves."""
        top, indices = torch.topk(self.router(x), self.top_k, dim=-1)
        return F.softmax(top, dim=-1, dtype=top.dtype), indices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, indices = self.route(flat)
        out = torch.zeros_like(flat)
        for e in torch.unique(indices).tolist():
            token, slot = torch.where(indices == e)
            h = flat[token] @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
            y = clamped_swiglu(h, self.alpha, self.limit) @ self.down_proj[e] + self.down_proj_bias[e]
            out.index_add_(0, token, y * weights[token, slot, None])
        return out.reshape(shape)
