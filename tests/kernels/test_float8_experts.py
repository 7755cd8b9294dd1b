"""model.float8 on the MoE experts (issue 25, point 6): the token-group padding that torchao's float8
grouped GEMM needs is exact against the unpadded grouped path, which experts convert, what is refused
before launch, the swap's mark, the planner's terms; and on a Hopper or Blackwell GPU with torchao, a
tiny Qwen3-MoE forward and backward in float8 close to bf16, through torchao's kernel."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from pathlib import Path

import pytest
import torch

from framework.config.schema import ExpertKernel, Float8Recipe, ModelConfig
from framework.kernels import float8
from framework.launch.prelaunch import check_float8
from framework.models import build_model, linears, materialize
from framework.models.moe import ExpertKernel as LayerKernel
from framework.models.moe import GroupedExperts, _grouped_mm, pad_groups, padded_experts, run_experts
from framework.planner.cost import _float8_terms
from framework.planner.resolve import make_plan
from tests.config.test_config import compose_config
from tests.entry import train_main
from tests.kernels.test_target import on

TINY = compose_config("recipe=qwen3_moe_tiny").model  # dim 128, 8 experts of width 96, top-2
# The size filter off (the tiny experts are below rowwise's threshold: test_size_filter_keeps_small_experts),
# the attention's Linear layers skipped: the experts alone convert.
ROWWISE = dataclasses.replace(
    TINY, float8=Float8Recipe.rowwise, float8_size_filter=False, float8_skip=["output", "attention"]
)
COUNTS = torch.tensor([3, 0, 17, 16, 1, 0])  # groups of 0, 1, 16 and 17 rows


def test_pad_groups_layout() -> None:
    """Each group starts at a multiple of 16 in order; the bound is static: rows + G x 15, rounded."""
    dest, offs, total = pad_groups(COUNTS, int(COUNTS.sum()), 16)
    assert offs.dtype == torch.int32 and offs.tolist() == [16, 16, 48, 64, 80, 80]
    assert total == 128  # ceil((37 + 6 * 15) / 16) * 16
    starts = [0, 16, 16, 48, 64, 80]
    expected = [starts[g] + i for g, n in enumerate(COUNTS.tolist()) for i in range(n)]
    assert dest.tolist() == expected
    empty = pad_groups(torch.zeros(4, dtype=torch.int64), 0, 16)
    assert empty[0].numel() == 0 and empty[1].tolist() == [0] * 4 and empty[2] == 64


def test_pad_groups_traces_without_a_graph_break() -> None:
    """No data-dependent shape and no host sync: compiled fullgraph (the eager backend: the trace only)."""
    traced = torch.compile(lambda c: pad_groups(c, 37, 16)[:2], fullgraph=True, backend="eager")
    for got, want in zip(traced(COUNTS), pad_groups(COUNTS, 37, 16)[:2], strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_padded_groups_are_exact(dtype: torch.dtype) -> None:
    """The padded experts (``mm`` = the bf16 grouped GEMM here, torchao's float8 one on a GPU) against
    the unpadded grouped path: forward and every gradient bitwise in bf16, within fp32 rounding in
    fp32 (the CPU kernel blocks a longer M differently)."""
    g, d, i = COUNTS.numel(), 32, 48
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(int(COUNTS.sum()), d, generator=gen).to(dtype).requires_grad_()
    gate_up = (0.1 * torch.randn(g, 2 * i, d, generator=gen)).to(dtype).requires_grad_()
    down = (0.1 * torch.randn(g, d, i, generator=gen)).to(dtype).requires_grad_()
    ref = run_experts(x, COUNTS, gate_up, down, LayerKernel.GROUPED)
    out = padded_experts(x, COUNTS, gate_up, down, _grouped_mm, 16)
    grad = torch.randn(ref.shape, generator=gen).to(dtype)
    want = torch.autograd.grad(ref, (x, gate_up, down), grad)
    got = torch.autograd.grad(out, (x, gate_up, down), grad)
    if dtype is torch.bfloat16:
        assert torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    else:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_which_experts_convert() -> None:
    """Every recipe converts the experts (the size filter off); float8_skip keeps them by name; a dim
    that is not a multiple of 16 keeps them; the Linear layers keep their own rules."""
    assert [g.param for g in linears.converted_experts(ROWWISE)] == ["gate_up_proj", "down_proj"] * 4
    assert linears.converted(ROWWISE) == []  # the attention skipped, the head skipped
    tw = dataclasses.replace(ROWWISE, float8=Float8Recipe.tensorwise)
    assert len(linears.converted_experts(tw)) == 8
    for skip in (["output", "experts"], ["feed_forward.experts"]):
        assert linears.converted_experts(dataclasses.replace(ROWWISE, float8_skip=skip)) == []
    odd = dataclasses.replace(ROWWISE, moe=dataclasses.replace(TINY.moe, moe_intermediate_size=40))
    assert linears.converted_experts(odd) == []
    assert linears.converted_experts(TINY) == [] and linears.converted_experts(ModelConfig()) == []
    assert float8.EXPERTS_RECIPE is Float8Recipe.rowwise


def test_size_filter_keeps_small_experts() -> None:
    """Under model.float8_size_filter (the default) the experts convert only where every expert GEMM
    passes rowwise's size threshold: Qwen3-30B-A3B's (2048 x 768, measured slower in float8) stay
    bf16, a DeepSeek-V3-sized expert (7168 x 2048) converts; the filter off converts both."""
    big = compose_config("recipe=qwen3_30b_a3b").model
    on_30b = dataclasses.replace(big, float8=Float8Recipe.rowwise)
    assert linears.converted_experts(on_30b) == []
    assert len(linears.converted_experts(dataclasses.replace(on_30b, float8_size_filter=False))) == 2 * big.n_layers
    wide = dataclasses.replace(on_30b, dim=7168, moe=dataclasses.replace(big.moe, moe_intermediate_size=2048))
    assert len(linears.converted_experts(wide)) == 2 * big.n_layers
    assert linears.converted_experts(dataclasses.replace(ROWWISE, float8_size_filter=True)) == []


def test_refusals_before_launch(caplog: pytest.LogCaptureFixture) -> None:
    cpu = torch.device("cpu")
    loop = dataclasses.replace(ROWWISE, moe=dataclasses.replace(TINY.moe, expert_kernel=ExpertKernel.loop))
    with pytest.raises(
        ValueError, match=r"^model.float8=rowwise trains the MoE experts .* model.moe.expert_kernel=loop runs"
    ):
        linears.check_shapes(loop)
    # kept in bf16, the loop is fine (the Linear layers then convert nothing: refused for that)
    skipped = dataclasses.replace(loop, float8_skip=["output", "experts", "attention"])
    with pytest.raises(ValueError, match=r"converts no Linear layer and no MoE experts of qwen3_moe_tiny"):
        linears.check_shapes(skipped)
    linears.check_shapes(dataclasses.replace(skipped, float8_skip=["output", "experts"]))
    linears.check_shapes(ROWWISE)  # the experts alone are enough
    with pytest.raises(ValueError, match=r"needs compute capability 9.x or 10.x .* NVIDIA L40S is 8.9: add"):
        float8.check_experts_device(Float8Recipe.rowwise, (8, 9), "NVIDIA L40S")
    float8.check_experts_device(Float8Recipe.rowwise, (9, 0), "NVIDIA H200")
    experts_only = ("model.float8_size_filter=false", "model.float8_skip=[output,attention]")
    cfg = compose_config("recipe=qwen3_moe_tiny", "model.float8=rowwise", *experts_only)
    # Without torchao on this host, a dry run adds one "dry run: ... torchao" line per check (the
    # launch would refuse); those are counted apart from the experts' lines.
    missing = 0 if importlib.util.find_spec("torchao") else 1
    with caplog.at_level(logging.WARNING, logger="framework"):
        check_float8(on(cfg, "h100_sxm"), cpu, 1)  # a dry run for Hopper: planned, no line
        assert _framework_lines(caplog) == ([], missing)
        tw = compose_config("recipe=qwen3_moe_tiny", "model.float8=tensorwise", *experts_only)
        check_float8(on(tw, "h100_sxm"), cpu, 1)
    lines, dry = _framework_lines(caplog)
    assert dry == 2 * missing
    assert len(lines) == 1 and lines[0].startswith("model.float8=tensorwise: the MoE experts' grouped GEMMs")


def _framework_lines(caplog: pytest.LogCaptureFixture) -> tuple[list[str], int]:
    """The framework's warning lines other than a dry run's missing-package line, and how many of those."""
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("framework")]
    dry = [m for m in lines if m.startswith("dry run: ") and "torchao" in m]
    return [m for m in lines if m not in dry], len(dry)


def test_train_py_refuses_float8_experts_on_the_loop(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    code = train_main(
        f"hydra.run.dir={run}",
        "recipe=qwen3_moe_tiny",
        "model.float8=rowwise",
        "model.float8_size_filter=false",
        "model.float8_skip=[output,attention]",
        "model.moe.expert_kernel=loop",
    )
    err = capfd.readouterr().err
    assert code == 2, err[-2000:]
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "model.moe.expert_kernel=loop runs them one by one" in errors[0]
    assert not run.exists()


def test_apply_float8_marks_the_planned_experts() -> None:
    pytest.importorskip("torchao.float8", reason="torchao is the float8 extra (CI installs it)")
    from framework.parallel.float8 import apply_float8

    model = build_model(ROWWISE, 32)
    assert apply_float8(model, ROWWISE) == []  # no Linear converts; the experts do, so no error
    marked = [n for n, m in model.named_modules() if isinstance(m, GroupedExperts) and m.float8]
    assert marked == sorted({g.fqn for g in linears.converted_experts(ROWWISE)})
    skipped = dataclasses.replace(ROWWISE, float8_skip=["experts"], float8_size_filter=False)
    model = build_model(skipped, 32)
    assert apply_float8(model, skipped)  # Linear layers only
    assert not any(isinstance(m, GroupedExperts) and m.float8 for m in model.modules())
    # float8 experts off CUDA: a clear error (the launcher refuses float8 on the CPU first)
    experts = GroupedExperts(4, 32, 32)
    experts.float8 = True
    with pytest.raises(ValueError, match="float8 MoE experts need a CUDA GPU"):
        experts(torch.randn(8, 32), torch.tensor([2, 2, 2, 2]))


def test_planner_counts_the_expert_gemms() -> None:
    """qwen3_30b_a3b (8 layers, no AC): the expert GEMMs' flops per token (top-8 rows through each)
    and every expert's weight casts per micro batch; none once the experts are skipped."""
    cfg = compose_config(
        "recipe=qwen3_30b_a3b",
        "model.n_layers=8",
        "mesh/hardware=h200",
        "train.seq_len=4096",
        "train.global_batch_size=2",
        "train.micro_batch_size=2",
        "sharding.activation_checkpointing=none",
        "model.float8=rowwise",
        "model.float8_size_filter=false",  # these experts are below rowwise's threshold
    )
    terms = _float8_terms(cfg, 0.0)
    per_expert = 2 * 768 * 2048 + 2048 * 768
    assert terms.expert_flops == 8 * 8 * 6 * per_expert
    assert terms.expert_weight_bytes == 8 * 128 * per_expert * 10
    skipped = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, float8_skip=["output", "experts"])
    )
    assert _float8_terms(skipped, 0.0).expert_flops == 0
    fp8, bf16 = make_plan(cfg).prediction, make_plan(skipped).prediction
    assert fp8.compute_s < bf16.compute_s and fp8.memory_s > bf16.memory_s
    assert make_plan(cfg).memory == make_plan(skipped).memory  # torchao keeps bf16 inputs for backward


def _float8_grouped_gpu() -> str | None:
    """Why the GPU test cannot run here, or None."""
    if not torch.cuda.is_available():
        return "needs CUDA"
    major, minor = torch.cuda.get_device_capability()
    if major not in float8.EXPERTS_CAPABILITY_MAJORS:
        return f"needs compute capability 9.x or 10.x (torch._scaled_grouped_mm), this GPU is {major}.{minor}"
    try:
        import torchao.prototype.moe_training  # noqa: F401
    except ImportError:
        return "needs torchao.prototype.moe_training"
    return None


@pytest.mark.skipif(_float8_grouped_gpu() is not None, reason=str(_float8_grouped_gpu()))
def test_float8_experts_train_close_to_bf16_on_gpu() -> None:
    """A tiny Qwen3-MoE (2 layers, dims multiples of 16) forward and backward under bf16 autocast,
    float8 experts against bf16 ones from the same weights: loss within 5e-2 relative; every expert
    weight's gradient within 0.2 relative (norm of the difference: e4m3 keeps 3 mantissa bits, about
    3% per cast, and the gate/up weights' gradient passes through three float8 GEMMs) and pointing the
    same way (cosine > 0.99); and torchao's float8 grouped GEMM (``aten::_scaled_grouped_mm``) ran,
    forward and backward."""
    from torch.profiler import ProfilerActivity, profile

    from framework.kernels.float8_grouped import is_float8_kernel
    from framework.parallel.float8 import apply_float8

    m = dataclasses.replace(
        ROWWISE, n_layers=2, dim=256, moe=dataclasses.replace(TINY.moe, moe_intermediate_size=128)
    )
    runs = {}
    for float8_on in (False, True):
        model = build_model(m, 64)
        if float8_on:
            apply_float8(model, m)
        materialize(model, "cuda", seed=0)
        tokens = torch.randint(
            0, m.vocab_size, (8, 65), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0)
        )
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
        calls = sum(e.count for e in prof.key_averages() if is_float8_kernel(e.key))
        grads = {n: p.grad.float() for n, p in model.named_parameters() if "experts" in n}
        runs[float8_on] = (loss.item(), grads, calls)
    (loss16, g16, calls16), (loss8, g8, calls8) = runs[False], runs[True]
    # 2 layers x 2 GEMMs x (forward, input gradient, weight gradient)
    assert calls16 == 0 and calls8 == 2 * 2 * 3, (calls16, calls8)
    assert abs(loss8 - loss16) <= 5e-2 * abs(loss16)
    errors = {
        name: (
            round(((g8[name] - g).norm() / g.norm()).item(), 4),
            round(torch.nn.functional.cosine_similarity(g8[name].flatten(), g.flatten(), dim=0).item(), 5),
        )
        for name, g in g16.items()
    }
    # Measured on an H200 (torch 2.11, torchao 0.18): relative 0.074 / 0.074 (layer 0) and 0.133 /
    # 0.127 (layer 1), cosine >= 0.991: float8's rounding (e4m3, 3 mantissa bits), not a wrong GEMM.
    assert all(rel < 0.2 and cos > 0.99 for rel, cos in errors.values()), errors
