"""framework.kernels.saved_copy: the float8 blocks' norm outputs are saved for backward, not
recomputed there, and no value changes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from framework.config.schema import Float8Recipe, ModelConfig
from framework.models import build_model, materialize

CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=128)
COPY = torch.ops.framework.saved_copy.default


def test_float8_turns_it_on_and_nothing_else_does() -> None:
    on = build_model(dataclasses.replace(CFG, float8=Float8Recipe.tensorwise), 16)
    off = build_model(CFG, 16)
    assert all(b.save_norms for b in on.layers.values())
    assert not any(b.save_norms for b in off.layers.values())


def _loss_and_grads(save: bool, compile_backend: object | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model = build_model(CFG, 16)
    materialize(model, "cpu", 0)
    for block in model.layers.values():
        block.save_norms = save  # what model.float8 sets; float8 itself needs a CUDA GPU
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


def test_compiled_forward_copies_each_norm_output_and_backward_reads_the_copies() -> None:
    graphs: dict[str, list[torch.fx.GraphModule]] = {"fw": [], "bw": []}

    def keep(kind: str):  # noqa: ANN202
        def compiler(gm: torch.fx.GraphModule, _inputs: list) -> object:
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)

        return compiler

    _loss_and_grads(True, aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw")))
    assert graphs["fw"] and len(graphs["fw"]) == len(graphs["bw"])  # the blocks share one graph
    for fw, bw in zip(graphs["fw"], graphs["bw"], strict=True):
        copies = [n.name for n in fw.graph.nodes if n.target is COPY]
        assert len(copies) == 2  # the attention norm's and the MLP norm's
        assert all(n.target is not COPY for n in bw.graph.nodes)  # not recomputed in backward
        saved = {n.name for n in bw.graph.find_nodes(op="placeholder")}
        nodes = {n.name: n for n in fw.graph.nodes}
        roots = {_through_views(nodes[name]).name for name in saved if name in nodes}
        assert set(copies) <= roots, (copies, roots)


def _through_views(node: torch.fx.Node) -> torch.fx.Node:
    """The tensor a saved node views (a Linear saves its input reshaped to 2-D)."""
    aten = torch.ops.aten
    views = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default,
             aten.permute.default, aten.detach.default, aten.alias.default}  # fmt: skip
    while node.op == "call_function" and node.target in views:
        node = node.args[0]
    return node
