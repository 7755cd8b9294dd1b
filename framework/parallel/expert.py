"""Expert parallelism: the experts of each MoE layer sharded over the ep ranks, tokens moved by all-to-all.

Why a runner in place of ``MoE.experts``: the layer already sorts its assignments by expert and calls
``experts(x_sorted, counts)``; with ep ranks, expert ``e`` lives on rank ``e // (E / ep)``, so the sorted
rows are already in destination-rank order. ``ExpertParallel`` keeps the call and does, per forward:

1. exchange the per-expert counts (``all_to_all_single`` on an ``(E,)`` int tensor), so that each rank
   knows how many rows every other rank sends it for each of its local experts;
2. dispatch: ``all_to_all_single`` of the rows with those split sizes (one host sync for the sizes);
3. regroup the received rows (source-major) expert-major, run the local ``GroupedExperts``, undo it;
4. combine: the reverse ``all_to_all_single`` brings each row back to the rank and position it came from.

Every collective here is one of ``torch.distributed._functional_collectives``, which Dynamo traces
(torchtitan's ``expert_parallel.py`` does the same), so a compiled block holds the whole exchange in its
one graph: the counts by ``all_to_all_single``, the rows both ways by ``all_to_all_single_autograd``,
whose backward is the reverse all-to-all: an expert's weight gradient sums every rank's tokens, as one
process would. The split sizes are read on the host (``tolist``): traced, they are unbacked sizes,
as the per-expert counts are in the layer. (Why the block also needs FSDP2's per-parameter mesh to stay
one graph: ``framework.parallel.data_parallel.ExpertShards``.) Measured on gloo (torch 2.13, CPU): ``all_to_all_single`` with uneven split sizes works; the list
form ``dist.all_to_all`` refuses uneven sizes ("ProcessGroupGloo::alltoall: invalid tensor size"), and
``torch.distributed.nn.functional.all_to_all_single`` works but is deprecated for the functional one.

The weights are DTensors ``Shard(0)`` on the ep mesh (``framework.parallel.mesh.expert_meshes``) under
the single-process names (``...experts.gate_up_proj``): a checkpoint holds the global stacked tensor,
so DCP reshards it across ep degrees, and ``init_weights`` slices each rank's experts from the one
full draw. The router and shared experts stay plain parameters, replicated over ep and reduced by
data parallelism like any other. ``apply_fsdp`` shards the experts a second time over the replicas of
each expert shard (``dp_shard_mod_ep``, and dp_replicate), with the gradient divided by the whole
data-parallel degree (``expert_grad_divide``).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from framework.models.moe import MoE, StackedExperts, check_moe


class ExpertParallel(nn.Module):
    """This rank's ``E / ep`` experts, reached from every ep rank by all-to-all. Every parameter of
    the experts it replaces (``gate_up_proj`` and ``down_proj``; GPT-OSS's biases too) is the global
    ``(E, ...)`` stack as a DTensor ``Shard(0)`` on the ep mesh, under the same name; the local rows
    run the experts' own math (``StackedExperts.compute``) on the local slices."""

    def __init__(self, experts: StackedExperts, ep_mesh: DeviceMesh) -> None:
        super().__init__()
        self.kernel = experts.kernel
        self.float8 = experts.float8  # framework.parallel.float8 ran first (parallelize's order)
        self.compute = experts.compute()
        self.ep_mesh = ep_mesh
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()
        self.names = tuple(name for name, _ in experts.named_parameters(recurse=False))
        self.num_local = getattr(experts, self.names[0]).shape[0] // self.ep
        for name in self.names:
            full = getattr(experts, name)
            # src_data_rank=None: every rank holds the same full tensor (one seed, or meta): slice locally
            dt = distribute_tensor(full.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
            setattr(self, name, nn.Parameter(dt, requires_grad=full.requires_grad))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep, nl = self.ep, self.num_local
        # recv[s*nl + j]: the rows rank s sends for my local expert j (no gradient: counts)
        recv = funcol.wait_tensor(funcol.all_to_all_single(counts, None, None, self.group)).view(ep, nl)
        send_splits = counts.view(ep, nl).sum(1).tolist()
        recv_splits = recv.sum(1).tolist()
        routed = all_to_all_single_autograd(x, recv_splits, send_splits, self.group)
        order = expert_major_order(recv)
        y = self.compute(
            routed[order], recv.sum(0), [_local(getattr(self, name)) for name in self.names], self.float8
        )
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return all_to_all_single_autograd(y[back], send_splits, recv_splits, self.group)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def expert_major_order(recv: torch.Tensor) -> torch.Tensor:
    """Row indices that turn the received rows, laid out source rank by source rank and within each by
    local expert (``recv (ep, nl)`` counts), into local expert by local expert (source order kept)."""
    ep, nl = recv.shape
    block = torch.arange(ep * nl, device=recv.device)
    key = (block % nl) * ep + block // nl  # block s*nl + j sorts by (j, s)
    return torch.argsort(torch.repeat_interleave(key, recv.reshape(-1)), stable=True)


def moe_layers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE layers, in module order: ``MoE`` and a family's own layer (GPT-OSS's) alike,
    any module whose ``experts`` are stacked (``StackedExperts``, or the runner that replaced them)."""
    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "experts", None), (StackedExperts, ExpertParallel))
    ]


def shard_experts(moe: nn.Module, ep_mesh: DeviceMesh) -> nn.Module:
    """Shard ``moe``'s experts over ``ep_mesh`` (every ep rank calls it, with the same full weights,
    or on meta). Raises ValueError when ep does not divide the number of experts."""
    ep = ep_mesh.size()
    full = moe.experts
    assert isinstance(full, StackedExperts), "shard_experts runs once, on the layer as built"
    if isinstance(moe, MoE):
        check_moe(moe.cfg, ep)
    else:
        e = next(full.parameters()).shape[0]
        if e % ep:
            valid = ", ".join(str(d) for d in range(1, e + 1) if e % d == 0)
            raise ValueError(
                f"parallel.ep={ep} does not divide model.moe.num_experts={e}: valid ep are {valid}"
            )
    moe.experts = ExpertParallel(full, ep_mesh)
    return moe


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh | None) -> None:
    """Expert parallelism on every MoE layer of ``model`` (a decoder or a pipeline stage): step 1b of
    ``framework.parallel.parallelize``, after TP (whose plan leaves the experts alone) and before AC,
    compile and FSDP (which wrap and shard the ``ExpertParallel`` modules). A no-op without an ep
    axis (or of size 1). Raises ValueError for an ep that does not divide a layer's experts. A
    stage may hold no MoE layer (dense layers only), so finding none is no error here: a dense
    model under ``parallel.ep`` is refused before launch (framework.planner.layout.check_ep)."""
    if ep_mesh is None or ep_mesh.size() == 1:
        return
    for moe in moe_layers(model):
        shard_experts(moe, ep_mesh)


def expert_modules(model: nn.Module) -> list[ExpertParallel]:
    """The expert-parallel runners of ``model`` (their weights: FSDP2 shards them over the experts' mesh)."""
    return [m for m in model.modules() if isinstance(m, ExpertParallel)]
