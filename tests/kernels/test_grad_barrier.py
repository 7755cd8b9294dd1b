"""framework.kernels.grad_barrier: the float8 blocks' backward copy changes no value, and in a compiled
block it stands in the backward graph as the opaque op that keeps Inductor's kernels apart."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from framework.config.schema import Float8Recipe, ModelConfig
from framework.models import build_model, materialize

CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=128)
COPY = torch.ops.framework.copy_grad.default


def test_float8_turns_it_on_and_nothing_else_does() -> None:
    on = build_model(dataclasses.replace(CFG, float8=Float8Recipe.tensorwise), 16)
    off = build_model(CFG, 16)
    assert all(b.grad_barrier for b in on.layers.values())
    assert not any(b.grad_barrier for b in off.layers.values())


def _loss_and_grads(barrier: bool, compile_backend: object | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model = build_model(CFG, 16)
    materialize(model, "cpu", 0)
    for block in model.layers.values():
        block.grad_barrier = barrier  # what model.float8 sets; float8 itself needs a CUDA GPU
        if compile_backend is not None:
            block.forward = torch.compile(block.forward, fullgraph=True, backend=compile_backend)
    x = torch.randint(0, CFG.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("backend", [None, "inductor"], ids=["eager", "inductor"])
def test_loss_and_gradients_are_bitwise_those_without_it(backend: str | None) -> None:
    loss_on, grads_on = _loss_and_grads(True, backend)
    loss_off, grads_off = _loss_and_grads(False, backend)
    assert torch.equal(loss_on, loss_off)
    assert len(grads_on) == len(grads_off) and all(map(torch.equal, grads_on, grads_off))


def test_compiled_backward_copies_each_sublayer_gradient_and_forward_does_not() -> None:
    graphs: dict[str, list[torch.fx.GraphModule]] = {"fw": [], "bw": []}

    def keep(kind: str):  # noqa: ANN202
        def compiler(gm: torch.fx.GraphModule, _inputs: list) -> object:
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)

        return compiler

    _loss_and_grads(True, aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw")))

    def copies(gm: torch.fx.GraphModule) -> int:
        return sum(n.target is COPY for n in gm.graph.nodes)

    assert graphs["bw"] and graphs["fw"]
    assert [copies(g) for g in graphs["bw"]] == [2] * len(graphs["bw"])  # attention's and the MLP's
    assert all(copies(g) == 0 for g in graphs["fw"])
