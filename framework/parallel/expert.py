"""Expert parallelism: the experts of each MoE layer sharded over the ep ranks, tokens moved by all-to-all.

Why a runner in place of ``MoE.experts``: the layer already sorts its assignments by expert and calls
``experts(x_sorted, counts)``; with ep ranks, expert ``e`` lives on rank ``e // (E / ep)``, so the sorted
rows are already in destination-rank order. ``ExpertParallel`` keeps the call and does, per forward:

1. exchange the per-expert counts (``all_to_all_single`` on an ``(E,)`` int tensor), so that each rank
   knows how many rows every other rank sends it for each of its local experts;
2. dispatch: ``all_to_all_single`` of the rows with those split sizes (one host sync for the sizes);
3. regroup the received rows (source-major) expert-major, run the local ``GroupedExperts``, undo it;
4. combine: the reverse ``all_to_all_single`` brings each row back to the rank and position it came from.

Both transfers go through ``torch.distributed._functional_collectives.all_to_all_single_autograd``, whose
backward is the reverse all-to-all: an expert's weight gradient sums every rank's tokens, as one process
would. Measured on gloo (torch 2.13, CPU): ``all_to_all_single`` with uneven split sizes works; the list
form ``dist.all_to_all`` refuses uneven sizes ("ProcessGroupGloo::alltoall: invalid tensor size"), and
``torch.distributed.nn.functional.all_to_all_single`` works but is deprecated for the functional one.

Left for the families' integration: the weights here are plain local slices; for DCP resharding across
ep degrees they become DTensors ``Shard(0)`` on the ep mesh axis (the router and shared experts stay
replicated over ep and are reduced by data parallel like any other parameter).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from framework.models.moe import GroupedExperts, MoE, check_moe


class ExpertParallel(nn.Module):
    """This rank's ``E / ep`` experts, reached from every ep rank by all-to-all."""

    def __init__(self, local: GroupedExperts, group: dist.ProcessGroup, num_experts: int) -> None:
        super().__init__()
        self.local = local
        self.group = group
        self.ep = dist.get_world_size(group)
        self.num_local = num_experts // self.ep

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, nl = self.ep, self.num_local
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=self.group)  # recv[s*nl + j]: rows of rank s for my j
        recv = recv.view(ep, nl)
        send_splits = counts.view(ep, nl).sum(1).tolist()
        recv_splits = recv.sum(1).tolist()
        routed = all_to_all_single_autograd(x, recv_splits, send_splits, self.group)
        order = expert_major_order(recv)
        y = self.local(routed[order], recv.sum(0))
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return all_to_all_single_autograd(y[back], send_splits, recv_splits, self.group)


def expert_major_order(recv: torch.Tensor) -> torch.Tensor:
    """Row indices that turn the received rows, laid out source rank by source rank and within each by
    local expert (``recv (ep, nl)`` counts), into local expert by local expert (source order kept)."""
    ep, nl = recv.shape
    block = torch.arange(ep * nl, device=recv.device)
    key = (block % nl) * ep + block // nl  # block s*nl + j sorts by (j, s)
    return torch.argsort(torch.repeat_interleave(key, recv.reshape(-1)), stable=True)


def apply_ep(moe: MoE, group: dist.ProcessGroup) -> MoE:
    """Shard ``moe``'s experts over ``group``: keep this rank's contiguous slice of the stacked weights
    and route through ``ExpertParallel``. Every rank must call it (same config, same full weights: the
    model is built from one seed, or loaded, before). A no-op at ep=1, as every ``apply_*`` is.
    Raises ValueError when ep does not divide the number of experts."""
    ep = dist.get_world_size(group)
    check_moe(moe.cfg, ep)
    if ep == 1:
        return moe
    full = moe.experts
    assert isinstance(full, GroupedExperts), "apply_ep runs once, on the layer as built"
    nl = moe.cfg.num_experts // ep
    lo = dist.get_rank(group) * nl
    local = GroupedExperts(nl, moe.cfg.dim, moe.cfg.moe_intermediate_size, full.kernel)
    with torch.no_grad():
        local.gate_up_proj.copy_(full.gate_up_proj[lo : lo + nl])
        local.down_proj.copy_(full.down_proj[lo : lo + nl])
    moe.experts = ExpertParallel(local, group, moe.cfg.num_experts)
    return moe
