"""The MoE layer (framework/models/moe.py): parity with transformers 5's Qwen3-MoE and Mixtral sparse
blocks (fp32, CPU, 1e-5), the grouped GEMM against the per-expert loop, routing, capacity, balance, and
the bad-input lines."""

from __future__ import annotations

import pytest
import torch
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock, load_balancing_loss_func

from framework.models.moe import (
    HF_MOE_NAMES,
    ExpertKernel,
    GroupedExperts,
    MoE,
    MoEConfig,
    RouterScore,
    check_moe,
    expert_load,
    grouped_mm_supported,
    load_balancing_loss,
    sort_by_expert,
    stack_hf_experts,
    update_expert_bias,
)

D, FF, E, K = 16, 24, 8, 2


def _hf_block(family: str, norm: bool = True) -> tuple[torch.nn.Module, MoEConfig]:
    if family == "qwen3_moe":
        hf_cfg = Qwen3MoeConfig(
            hidden_size=D, moe_intermediate_size=FF, num_experts=E, num_experts_per_tok=K, norm_topk_prob=norm
        )
        block = Qwen3MoeSparseMoeBlock(hf_cfg)
    else:
        hf_cfg = MixtralConfig(hidden_size=D, intermediate_size=FF, num_local_experts=E, num_experts_per_tok=K)
        block = MixtralSparseMoeBlock(hf_cfg)
    for p in block.parameters():  # transformers leaves them empty (torch.empty): fill them
        torch.nn.init.normal_(p, std=0.3)
    cfg = MoEConfig(
        dim=D, moe_intermediate_size=FF, num_experts=E, num_experts_per_tok=K, norm_topk_prob=norm,
        router_aux_loss_coef=hf_cfg.router_aux_loss_coef,
    )
    return block.eval(), cfg


def _ours_from(block: torch.nn.Module, cfg: MoEConfig, kernel: ExpertKernel = ExpertKernel.AUTO) -> MoE:
    moe = MoE(MoEConfig(**{**cfg.__dict__, "kernel": kernel}))
    hf = block.state_dict()
    moe.load_state_dict({ours: hf[name] for name, ours in HF_MOE_NAMES.items()})  # strict: the same keys
    return moe


@pytest.mark.parametrize("family,norm", [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True)])
@pytest.mark.parametrize("kernel", [ExpertKernel.GROUPED, ExpertKernel.LOOP])
def test_parity_with_transformers_blocks(family: str, norm: bool, kernel: ExpertKernel) -> None:
    torch.manual_seed(0)
    block, cfg = _hf_block(family, norm)
    moe = _ours_from(block, cfg, kernel)
    x = torch.randn(3, 11, D)
    with torch.no_grad():
        ref = block(x)
        ref_logits, _, _ = block.gate(x.reshape(-1, D))
        out = moe(x)
    assert ref.abs().max().item() > 0.1  # a real output, not two zeros
    assert (out - ref).abs().max().item() < 1e-5
    assert (moe.stats.router_logits - ref_logits).abs().max().item() < 1e-6
    ref_aux = load_balancing_loss_func((ref_logits,), E, K)
    assert abs(load_balancing_loss([moe.stats]).item() - ref_aux.item()) < 1e-6
    # the gradients of a loss with the aux term, as the families will train it
    g = torch.randn_like(x)
    hf_logits = block.gate(x.reshape(-1, D))[0]  # what transformers' output recorder keeps
    ((block(x) * g).sum() + cfg.router_aux_loss_coef * load_balancing_loss_func((hf_logits,), E, K)).backward()
    ((moe(x) * g).sum() + cfg.router_aux_loss_coef * load_balancing_loss([moe.stats])).backward()
    for name, ours in HF_MOE_NAMES.items():
        hf_grad = block.get_parameter(name).grad
        assert hf_grad.abs().max() > 0
        torch.testing.assert_close(moe.get_parameter(ours).grad, hf_grad, rtol=1e-5, atol=1e-6)


def test_aux_loss_over_layers_matches_transformers_and_has_a_gradient() -> None:
    """transformers concatenates all layers' router logits into one f and one P: so do we."""
    torch.manual_seed(1)
    layers = [_ours_from(*_hf_block("qwen3_moe")) for _ in range(2)]
    x = torch.randn(2, 9, D)
    stats = []
    h = x
    for layer in layers:
        h = layer(h)
        stats.append(layer.stats)
    ours = load_balancing_loss(stats)
    ref = load_balancing_loss_func(tuple(s.router_logits for s in stats), E, K)
    assert abs(ours.item() - ref.item()) < 1e-6
    ours.backward()
    assert layers[0].gate.weight.grad.abs().sum() > 0  # P carries the router's gradient


def test_grouped_equals_loop_forward_and_backward() -> None:
    torch.manual_seed(2)
    grouped = GroupedExperts(E, D, FF, ExpertKernel.GROUPED)
    loop = GroupedExperts(E, D, FF, ExpertKernel.LOOP)
    loop.load_state_dict(grouped.state_dict())
    counts = torch.tensor([3, 0, 5, 1, 0, 7, 2, 4])  # empty experts included
    x = torch.randn(int(counts.sum()), D)
    g = torch.randn(int(counts.sum()), D)
    grads = []
    for m in (grouped, loop):
        xr = x.clone().requires_grad_()
        y = m(xr, counts)
        (y * g).sum().backward()
        grads.append((y.detach(), xr.grad, m.gate_up_proj.grad, m.down_proj.grad))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_grouped_backward_takes_a_broadcast_gradient() -> None:
    """``y.sum().backward()`` hands grouped_mm a stride-0 gradient, which its backward refuses alone."""
    experts = GroupedExperts(E, D, FF, ExpertKernel.GROUPED)
    counts = torch.tensor([2, 0, 1, 1, 0, 3, 0, 1])
    x = torch.randn(int(counts.sum()), D, requires_grad=True)
    experts(x, counts).sum().backward()
    assert x.grad.abs().sum() > 0 and experts.down_proj.grad.abs().sum() > 0


def test_grouped_mm_support_check() -> None:
    w = torch.zeros(E, FF, D)
    assert grouped_mm_supported(torch.zeros(4, D), w)
    assert not grouped_mm_supported(torch.zeros(4, D, dtype=torch.float64), w.double())  # refused by torch
    assert not grouped_mm_supported(torch.zeros(4, 6), torch.zeros(E, FF, 6))  # 24-byte rows
    with pytest.raises(ValueError, match="expert kernel 'grouped' cannot run"):
        GroupedExperts(E, 6, FF, ExpertKernel.GROUPED)(torch.zeros(4, 6), torch.tensor([4] + [0] * (E - 1)))
    out = GroupedExperts(E, 6, 10)(torch.randn(4, 6), torch.tensor([4] + [0] * (E - 1)))  # auto: the loop
    assert out.shape == (4, 6)


def test_no_token_dropped_by_default_and_capacity_drops_the_latest() -> None:
    indices = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 0]])  # expert 0 chosen 4 times
    d = sort_by_expert(indices, 4, capacity=None)
    assert d.dropped.item() == 0 and d.counts.tolist() == [4, 2, 1, 1]
    d = sort_by_expert(indices, 4, capacity=2)
    assert d.dropped.item() == 2 and d.counts.tolist() == [2, 2, 1, 1]
    kept0 = d.token[: 2].tolist()
    assert kept0 == [0, 1]  # tokens 2 and 3 lose their expert-0 slot
    moe = MoE(MoEConfig(dim=D, moe_intermediate_size=FF, num_experts=E, num_experts_per_tok=K, capacity_factor=0.5))
    moe(torch.randn(64, D))
    assert moe.stats.dropped.item() > 0
    assert moe.stats.tokens_per_expert.sum().item() == 64 * K  # the balance counts what the router chose


def test_sigmoid_router_bias_moves_selection_not_weights() -> None:
    """DeepSeek-V3's aux-loss-free balancing: the bias steers the choice towards the idle experts; the
    weights stay the unbiased sigmoid scores."""
    torch.manual_seed(3)
    cfg = MoEConfig(
        dim=D, moe_intermediate_size=FF, num_experts=E, num_experts_per_tok=K, score=RouterScore.SIGMOID,
        norm_topk_prob=False, bias_update_rate=0.01,
    )
    moe = MoE(cfg)
    torch.nn.init.normal_(moe.gate.weight, std=0.3)
    x = torch.randn(256, D) + torch.randn(D)  # a shared offset: a skewed router
    first = moe.gate(x)
    for _ in range(30):
        counts = torch.bincount(moe.gate(x).indices.reshape(-1), minlength=E)
        update_expert_bias(moe.gate, counts)
    last = moe.gate(x)
    scores = torch.sigmoid(first.logits)
    for r in (first, last):
        torch.testing.assert_close(r.weights, scores.gather(-1, r.indices))
    load = [torch.bincount(r.indices.reshape(-1), minlength=E).max().item() for r in (first, last)]
    assert load[1] < 0.8 * load[0], load


def test_shared_experts_add_a_dense_path() -> None:
    torch.manual_seed(4)
    cfg = MoEConfig(dim=D, moe_intermediate_size=FF, num_experts=E, num_experts_per_tok=K, num_shared_experts=2)
    moe = MoE(cfg)
    x = torch.randn(5, D)
    routed_only = MoE(MoEConfig(**{**cfg.__dict__, "num_shared_experts": 0}))
    routed_only.load_state_dict({k: v for k, v in moe.state_dict().items() if "shared" not in k})
    assert moe.shared_experts.gate_proj.weight.shape == (2 * FF, D)
    torch.testing.assert_close(moe(x), routed_only(x) + moe.shared_experts(x))


def test_expert_load_figures() -> None:
    assert expert_load(torch.tensor([2, 2, 2, 2])) == {"max": 2.0, "mean": 2.0, "max_over_mean": 1.0}
    assert expert_load(torch.tensor([8, 0, 0, 0]))["max_over_mean"] == 4.0


def test_stack_hf_experts_matches_transformers_layout() -> None:
    torch.manual_seed(5)
    files = {}
    for e in range(E):
        files[f"{e}.w1.weight"] = torch.randn(FF, D)
        files[f"{e}.w3.weight"] = torch.randn(FF, D)
        files[f"{e}.w2.weight"] = torch.randn(D, FF)
    st = stack_hf_experts(files, E, "mixtral")
    assert st["gate_up_proj"].shape == (E, 2 * FF, D) and st["down_proj"].shape == (E, D, FF)
    torch.testing.assert_close(st["gate_up_proj"][3, FF:], files["3.w3.weight"])
    with pytest.raises(ValueError, match=r"lacks experts.8.w1.weight: the config has num_experts=9"):
        stack_hf_experts(files, E + 1, "mixtral")


@pytest.mark.parametrize(
    "change,ep,line",
    [
        ({"num_experts_per_tok": 9}, 1, r"^model.moe.num_experts_per_tok=9 must be in 1..8 \(num_experts=8\)$"),
        ({"capacity_factor": 0.0}, 1, r"^model.moe.capacity_factor=0.0 must be > 0 \(or null: no token dropped\)$"),
        ({"capacity_factor": float("nan")}, 1, r"^model.moe.capacity_factor=nan must be > 0"),
        ({"router_aux_loss_coef": -0.1}, 1, r"^model.moe.router_aux_loss_coef=-0.1 must be >= 0$"),
        ({}, 3, r"^parallel.ep=3 does not divide model.moe.num_experts=8: valid ep are 1, 2, 4, 8$"),
    ],
)
def test_bad_inputs_one_line_each(change: dict, ep: int, line: str) -> None:
    cfg = MoEConfig(dim=D, moe_intermediate_size=FF, num_experts=E, **change)
    with pytest.raises(ValueError, match=line):
        check_moe(cfg, ep)
    check_moe(MoEConfig(dim=D, moe_intermediate_size=FF, num_experts=E), 4)  # a good one passes


def test_softmax_router_has_no_bias_to_update() -> None:
    moe = MoE(MoEConfig(dim=D, moe_intermediate_size=FF, num_experts=E))
    assert "gate.expert_bias" not in moe.state_dict()  # the state dict is transformers' exactly
    with pytest.raises(ValueError, match="needs the sigmoid router; this one scores by softmax"):
        update_expert_bias(moe.gate, torch.ones(E))
