"""GPT-OSS's MoE layer (transformers' ``GptOssMLP``): a router with a bias whose top-k logits are
softmaxed (softmax after the top-k, not before), and experts with biases and GPT-OSS's clamped SwiGLU:
the gate clamped above at ``limit``, the up projection to [-limit, limit], ``(up + 1) * gate *
sigmoid(alpha * gate)`` (alpha 1.702, limit 7.0 in the published models).

The stacked weights keep the Hub files' layout, so import and export copy them whole:
``gate_up_proj`` (E, dim, 2 x width) with gate and up columns interleaved (gate the even ones),
``down_proj`` (E, width, dim), their biases (E, 2 x width) and (E, dim); they live in the layer's
``experts`` (``GptOssExperts``), which expert parallelism swaps for its all-to-all runner as it does
the other MoE families' (framework.parallel.expert).

The layer routes, sorts the assignments by expert (framework.models.moe.sort_by_expert) and runs
the experts on the sorted rows by ``model.moe.expert_kernel``: ``grouped`` (``auto`` where the device's
kernel takes the operands: CUDA sm80+, and CPU outside torch.compile) two grouped GEMMs
(``torch._grouped_mm``, as the other families') with each row's expert bias gathered and added after
its GEMM; ``loop`` one expert at a time (the reference; one host sync for the split sizes). Grouped,
the layer has no host sync and no data-dependent Python branch, so a compiled block traces it whole.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from framework.models.grouped import ExpertCompute, ExpertKernel, StackedExperts, _grouped_mm, use_grouped
from framework.models.moe import sort_by_expert


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's activation over interleaved (gate, up) columns: (..., 2 x width) -> (..., width)."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gpt_oss_compute(
    x: torch.Tensor,
    counts: torch.Tensor,
    weights: Sequence[torch.Tensor],
    float8: bool,
    kernel: ExpertKernel,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """``GptOssExperts``' math on ``x`` (N, dim), rows sorted by expert (``counts`` (G,)), ``weights``
    = (gate_up_proj (G, dim, 2W), gate_up_proj_bias (G, 2W), down_proj (G, W, dim), down_proj_bias
    (G, dim)): the whole stack, or an ep rank's slice. Under autocast the operands are cast to its
    dtype first, as ``F.linear``'s would be (``grouped_mm`` is not on autocast's list). ``float8`` is
    not taken: GPT-OSS's experts run in the weights' dtype (framework.parallel.float8 marks
    ``GroupedExperts`` only)."""
    gate_up, gate_up_bias, down, down_bias = weights
    device = x.device.type
    # meta (the freeze traces the meta-device model) has no autocast state: asking raises
    if device != "meta" and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, gate_up, gate_up_bias, down, down_bias = (
            t.to(dtype) for t in (x, gate_up, gate_up_bias, down, down_bias)
        )
    # use_grouped reads (G, out, in) stacks (the other families' layout); these are (G, in, out):
    # the transposed views have the same sizes to check
    if use_grouped(kernel, x, gate_up.transpose(-2, -1), down.transpose(-2, -1)):
        return grouped_gpt_oss(x, counts, gate_up, gate_up_bias, down, down_bias, alpha, limit)
    return loop_gpt_oss(x, counts, gate_up, gate_up_bias, down, down_bias, alpha, limit)


def grouped_gpt_oss(
    x: torch.Tensor,
    counts: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_bias: torch.Tensor,
    down: torch.Tensor,
    down_bias: torch.Tensor,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """Both GEMMs of every expert at once: ``grouped_mm`` over the groups that ``counts`` cut (the
    stacks are already (G, in, out), the kernel's right operand), each row's expert bias gathered
    (``bias[expert_of_row]``) and added after its GEMM. ``repeat_interleave`` with ``output_size``
    names the rows' expert without reading the counts on the host."""
    offs = torch.cumsum(counts, 0).to(torch.int32)
    expert = torch.repeat_interleave(
        torch.arange(counts.numel(), device=counts.device), counts, output_size=x.shape[0]
    )
    h = _grouped_mm(x, gate_up, offs) + gate_up_bias[expert]
    y = _grouped_mm(clamped_swiglu(h, alpha, limit), down, offs) + down_bias[expert]
    if y.requires_grad:
        # grouped_mm's backward refuses a broadcast gradient (framework.models.grouped.run_experts)
        y.register_hook(torch.Tensor.contiguous)
    return y


def loop_gpt_oss(
    x: torch.Tensor,
    counts: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_bias: torch.Tensor,
    down: torch.Tensor,
    down_bias: torch.Tensor,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """One expert at a time on its rows (one host sync for the split sizes): the reference."""
    outs = []
    for e, part in enumerate(x.split(counts.tolist())):
        h = clamped_swiglu(part @ gate_up[e] + gate_up_bias[e], alpha, limit)
        outs.append(h @ down[e] + down_bias[e])
    return torch.cat(outs) if outs else x.new_zeros(0, x.shape[-1])


class GptOssExperts(StackedExperts):
    """The stacked experts with their biases, called as ``experts(x_sorted, counts)``."""

    def __init__(
        self,
        dim: int,
        width: int,
        num_experts: int,
        alpha: float = 1.702,
        limit: float = 7.0,
        kernel: ExpertKernel = ExpertKernel.AUTO,
    ) -> None:
        super().__init__()
        self.alpha, self.limit, self.kernel, self.float8 = alpha, limit, kernel, False
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, dim, 2 * width))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * width))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, width, dim))
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, dim))

    def compute(self) -> ExpertCompute:
        return functools.partial(gpt_oss_compute, kernel=self.kernel, alpha=self.alpha, limit=self.limit)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        weights = (self.gate_up_proj, self.gate_up_proj_bias, self.down_proj, self.down_proj_bias)
        return gpt_oss_compute(x, counts, weights, False, self.kernel, self.alpha, self.limit)


class GptOssMoE(nn.Module):
    """``forward(x)`` (batch, seq, dim) -> the same shape: each token's top-k experts, weighted."""

    def __init__(
        self,
        dim: int,
        width: int,
        num_experts: int,
        top_k: int,
        alpha: float = 1.702,
        limit: float = 7.0,
        kernel: ExpertKernel = ExpertKernel.AUTO,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.router = nn.Linear(dim, num_experts, bias=True)
        self.experts: nn.Module = GptOssExperts(dim, width, num_experts, alpha, limit, kernel)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, indices), each (tokens, top_k): the top-k router logits, softmaxed among themselves."""
        top, indices = torch.topk(self.router(x), self.top_k, dim=-1)
        return F.softmax(top, dim=-1, dtype=top.dtype), indices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, indices = self.route(flat)
        d = sort_by_expert(indices, self.num_experts, None)
        y = self.experts(flat[d.token], d.counts)
        y = y * weights[d.token, d.slot].unsqueeze(-1)
        out = torch.zeros_like(flat).index_add_(0, d.token, y.to(flat.dtype))
        return out.reshape(shape)
