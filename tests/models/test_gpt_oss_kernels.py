"""GPT-OSS's fast paths against its reference paths on the CPU (fp32): the grouped experts
(``torch._grouped_mm`` with each row's expert bias gathered) against the per-expert loop, forward and
every gradient; the attention with sinks through FlexAttention (its log-sum-exp scaling the output
by ``sigmoid(lse - sink)``) against the eager softmax with the sink appended, for causal and banded
layers with grouped-query heads; and both traced whole by ``torch.compile(fullgraph=True)``.

FlexAttention runs no backward on the CPU, so the gradient of the sink scaling is checked on its
formula: the plain softmax's output and log-sum-exp from the eager scores, scaled, against the
eager form with the sink, every gradient (the sinks' included)."""

from __future__ import annotations

import torch

from framework.models.gpt_oss.attention import SinkAttention, sink_block_mask
from framework.models.gpt_oss.experts import GptOssMoE
from framework.models.grouped import ExpertKernel
from framework.models.parts.masks import causal_band
from framework.models.parts.rope import rope_tables

DIM, WIDTH, EXPERTS, TOP_K = 32, 24, 6, 2


def moe_pair(dtype: torch.dtype = torch.float32) -> tuple[GptOssMoE, GptOssMoE]:
    """Two layers with the same random weights (the clamp bites), one grouped, one looped."""
    torch.manual_seed(0)
    grouped = GptOssMoE(DIM, WIDTH, EXPERTS, TOP_K, kernel=ExpertKernel.GROUPED)
    with torch.no_grad():
        for p in grouped.parameters():
            p.normal_(0.0, 0.6)
        # expert 5 gets no token: the router never ranks it in the top 2
        grouped.router.bias[5] = -1e4
    loop = GptOssMoE(DIM, WIDTH, EXPERTS, TOP_K, kernel=ExpertKernel.LOOP)
    loop.load_state_dict(grouped.state_dict())
    return grouped.to(dtype), loop.to(dtype)


def test_grouped_experts_equal_the_loop_forward_and_backward() -> None:
    grouped, loop = moe_pair()
    x = torch.randn(3, 10, DIM, generator=torch.Generator().manual_seed(1)) * 2
    outs, grads = [], []
    for layer in (grouped, loop):
        xi = x.clone().requires_grad_()
        y = layer(xi)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs.append(y.detach())
        grads.append([xi.grad] + [p.grad for p in layer.parameters()])
    h = x.reshape(-1, DIM) @ grouped.experts.gate_up_proj[0] + grouped.experts.gate_up_proj_bias[0]
    assert h.abs().max() > 7.0, "the clamp (limit 7) never bites: the test would miss it"
    assert grouped.experts.down_proj_bias.grad[5].abs().max() == 0  # no row, no gradient
    diff = (outs[0] - outs[1]).abs().max().item()
    print(f"gpt_oss experts grouped vs loop (fp32): max |out diff| {diff:.2e}")
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    for g, want in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-4)
    # the biases decide the output: without the gathered bias the grouped path would differ
    with torch.no_grad():
        grouped.experts.down_proj_bias.add_(1.0)
    assert (grouped(x) - outs[1]).abs().max() > 0.1


def test_grouped_experts_trace_whole_under_fullgraph_compile() -> None:
    """bf16 (what the grouped GEMM takes traced): no host sync, no graph break; equals eager."""
    grouped, _ = moe_pair(torch.bfloat16)
    x = torch.randn(2, 8, DIM, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(grouped, fullgraph=True, dynamic=False, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), grouped(x), rtol=0, atol=0)


HEADS, KV_HEADS, HEAD_DIM, SEQ = 4, 2, 16, 40


def attention(window: int) -> SinkAttention:
    torch.manual_seed(3)
    layer = SinkAttention(DIM, HEADS, KV_HEADS, HEAD_DIM, window)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
        layer.sinks.copy_(torch.tensor([-2.0, 0.0, 1.5, 4.0]))
    return layer


def test_flex_attention_with_sinks_equals_the_eager_form() -> None:
    """Causal and banded (window 8 over 40 tokens: blocks past the band hold no key), the decoder's
    dense band ignored in favour of the layer's block mask; max difference within fp32 rounding."""
    x = torch.randn(2, SEQ, DIM, generator=torch.Generator().manual_seed(4))
    rope = rope_tables(HEAD_DIM, SEQ, 10000.0, None)
    for window in (0, 8):
        layer = attention(window)
        band = causal_band(SEQ, SEQ, 0, window, x.device) if window else None
        with torch.no_grad():
            layer.flex = False
            want = layer(x, rope, mask=band)
            layer.flex = True
            got = layer(x, rope, mask=band)
            diff = (got - want).abs().max().item()
            print(f"gpt_oss sink attention window={window}: flex vs eager max |diff| {diff:.2e}")
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            # the sinks take probability mass: with them zeroed the output moves
            layer.sinks.zero_()
            assert (layer(x, rope, mask=band) - want).abs().max() > 1e-2
    assert sink_block_mask(SEQ, 8, x.device) is sink_block_mask(SEQ, 8, x.device)  # built once


def test_flex_attention_traces_whole_under_fullgraph_compile() -> None:
    """The block mask built inside the graph, FlexAttention's log-sum-exp requested: one graph
    (aot_eager: the CPU's Inductor lowering refuses the log-sum-exp), equal to eager."""
    layer = attention(8)
    layer.flex = True
    x = torch.randn(1, SEQ, DIM, generator=torch.Generator().manual_seed(5))
    rope = rope_tables(HEAD_DIM, SEQ, 10000.0, None)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, dynamic=False, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, rope), layer(x, rope), rtol=1e-5, atol=1e-5)


def test_sink_scaling_by_the_log_sum_exp_has_the_eager_gradients() -> None:
    """``softmax(scores) @ v * sigmoid(lse - sink)`` (what the flex path computes) against the
    softmax over [scores, sink] (the eager form): output and every gradient, sinks included."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, HEADS, 12, HEAD_DIM, generator=g) for _ in range(3))
    sinks = torch.tensor([-2.0, 0.0, 1.5, 4.0])
    mask = causal_band(12, 12, 0, 5, q.device)
    results = []
    for form in ("eager", "lse"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        qi, ki, vi, si = leaves
        scores = (qi @ ki.transpose(-1, -2) * HEAD_DIM**-0.5).masked_fill(~mask, float("-inf"))
        if form == "eager":
            logits = torch.cat([scores, si.view(1, -1, 1, 1).expand(2, HEADS, 12, 1)], dim=-1)
            out = torch.softmax(logits, dim=-1)[..., :-1] @ vi
        else:
            lse = torch.logsumexp(scores, dim=-1)
            out = (torch.softmax(scores, dim=-1) @ vi) * torch.sigmoid(lse - si.view(1, -1, 1)).unsqueeze(-1)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append([out.detach()] + [t.grad for t in leaves])
    assert results[0][4].abs().min() > 0  # every sink receives a gradient
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
