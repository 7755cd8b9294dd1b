"""Expert parallelism (framework/parallel/expert.py) on real gloo ranks: the ep=2 layer, and ep=2 x dp=2 on
4 ranks (ep on subgroups), equal one process on outputs and on every gradient (rtol 1e-5)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from framework.models.moe import ExpertKernel, MoE, MoEConfig
from framework.parallel.expert import apply_ep, expert_major_order
from tests.dist import run_ranks

TOKENS = 24  # per rank


def _cfg(kernel: ExpertKernel, shared: int) -> MoEConfig:
    return MoEConfig(
        dim=16, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2, num_shared_experts=shared,
        kernel=kernel,
    )


def _inputs(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(world * TOKENS, 16, generator=g), torch.randn(world * TOKENS, 16, generator=g)


def _reference(world: int, kernel: ExpertKernel, shared: int) -> dict[str, torch.Tensor]:
    """One process, the whole batch, every expert."""
    torch.manual_seed(0)
    moe = MoE(_cfg(kernel, shared))
    x, g = _inputs(world)
    x.requires_grad_()
    out = moe(x)
    (out * g).sum().backward()
    grads = {n: p.grad for n, p in moe.named_parameters()}
    return {"out": out.detach(), "x.grad": x.grad, **grads}


def _ep_rank(rank: int, world: int, kernel: ExpertKernel, shared: int) -> dict[str, torch.Tensor]:
    """This rank's tokens, this rank's experts; the replicated parameters' gradients all-reduced, as the
    data-parallel wrapper over the ep axis does."""
    torch.manual_seed(0)
    moe = apply_ep(MoE(_cfg(kernel, shared)), dist.group.WORLD)
    x, g = (t[rank * TOKENS : (rank + 1) * TOKENS] for t in _inputs(world))
    x.requires_grad_()
    out = moe(x)
    (out * g).sum().backward()
    grads = {}
    for n, p in moe.named_parameters():
        if not n.startswith("experts."):
            dist.all_reduce(p.grad)
        grads[n] = p.grad
    # numpy, pickled by value: a torch tensor crosses the queue as a shared-memory handle that the parent
    # fetches from this process, which may already have exited ("Connection reset by peer")
    return {k: v.numpy() for k, v in {"out": out.detach(), "x.grad": x.grad, **grads}.items()}


@pytest.mark.parametrize("kernel,shared", [(ExpertKernel.AUTO, 0), (ExpertKernel.LOOP, 1)])
def test_ep2_equals_one_process(kernel: ExpertKernel, shared: int) -> None:
    world = 2
    ref = _reference(world, kernel, shared)
    ranks = [{k: torch.from_numpy(v) for k, v in r.items()} for r in run_ranks(_ep_rank, world, kernel, shared)]
    nl = 8 // world
    for r, got in enumerate(ranks):
        rows = slice(r * TOKENS, (r + 1) * TOKENS)
        torch.testing.assert_close(got["out"], ref["out"][rows], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["x.grad"], ref["x.grad"][rows], rtol=1e-5, atol=1e-6)
        for name in ("experts.gate_up_proj", "experts.down_proj"):
            local = got[name.replace("experts.", "experts.local.")]
            torch.testing.assert_close(local, ref[name][r * nl : (r + 1) * nl], rtol=1e-5, atol=1e-6)
        for name in ref:
            if name.startswith(("gate.", "shared_experts.")):
                torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6)
    assert ref["experts.down_proj"].abs().sum() > 0


def _ep_dp_rank(rank: int, world: int) -> dict:
    """ep=2 x dp=2 on 4 ranks: ep groups {0, 1} and {2, 3}; an expert's replicas ({0, 2} or {1, 3})
    all-reduce its gradient over dp, the router's over every rank."""
    ep_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    torch.manual_seed(0)
    moe = apply_ep(MoE(_cfg(ExpertKernel.AUTO, 0)), ep_groups[rank // 2])
    x, g = (t[rank * TOKENS : (rank + 1) * TOKENS] for t in _inputs(world))
    out = moe(x)
    (out * g).sum().backward()
    for n, p in moe.named_parameters():
        dist.all_reduce(p.grad, group=dp_groups[rank % 2] if n.startswith("experts.") else None)
    return {k: v.numpy() for k, v in {"out": out.detach(), **{n: p.grad for n, p in moe.named_parameters()}}.items()}


def test_ep2_by_dp2_equals_one_process() -> None:
    world = 4
    ref = _reference(world, ExpertKernel.AUTO, 0)
    for r, got in enumerate(run_ranks(_ep_dp_rank, world)):
        ep_rank = r % 2
        torch.testing.assert_close(
            torch.from_numpy(got["out"]), ref["out"][r * TOKENS : (r + 1) * TOKENS], rtol=1e-5, atol=1e-6
        )
        torch.testing.assert_close(torch.from_numpy(got["gate.weight"]), ref["gate.weight"], rtol=1e-5, atol=1e-6)
        local = torch.from_numpy(got["experts.local.down_proj"])
        torch.testing.assert_close(local, ref["experts.down_proj"][ep_rank * 4 : ep_rank * 4 + 4], rtol=1e-5, atol=1e-6)


def test_expert_major_order() -> None:
    # 2 source ranks x 2 local experts: rows arrive (s0 e0: 2, s0 e1: 1, s1 e0: 1, s1 e1: 3)
    recv = torch.tensor([[2, 1], [1, 3]])
    assert expert_major_order(recv).tolist() == [0, 1, 3, 2, 4, 5, 6]


def _bad_ep(rank: int, world: int) -> str:
    cfg = MoEConfig(dim=16, moe_intermediate_size=24, num_experts=3, num_experts_per_tok=2)
    try:
        apply_ep(MoE(cfg), dist.group.WORLD)
    except ValueError as e:
        return str(e)
    return "no error"


def test_ep_not_dividing_experts_is_one_line() -> None:
    lines = run_ranks(_bad_ep, 2)
    assert lines == ["parallel.ep=2 does not divide model.moe.num_experts=3: valid ep are 1, 3"] * 2
