"""Kernel tables for the planner: measured rates of the GEMMs, grouped GEMMs and attention kernels a
training step runs, by shape, on one GPU.

The planner (framework.planner.kernels) interpolates these instead of applying one efficiency to every
FLOP: a GEMM's rate depends on its shape (wave quantization, small K), an MoE's expert GEMMs on the
rows each expert gets, attention on the sequence length and head dim. Each entry is timed forward and
forward + backward through autograd, as the training step runs it (bf16 operands; float8 through
``torch._scaled_mm`` where torch has it), back to back so the clocks are the sustained ones, never
the idle boost.

    python benchmarks/kernel_tables.py --out conf/mesh/hardware/tables/h100_sxm.json   # one GPU, ~4 min
    python benchmarks/kernel_tables.py --smoke --device cpu --out /tmp/t.json          # the code path only

The file records the device, torch, the command and the date beside the numbers; the profile
``conf/mesh/hardware/NAME.yaml`` names its table with ``kernel_table: NAME``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# Rows (tokens) of a GEMM: a micro batch's tokens on one rank (1K to 64K covers seq 1K-8K x micro
# 1-8 and a CP shard of 128K). Widths: every projection of the shipped families after a TP split
# (128 = 4096 / 32 at tp 32) up to a vocabulary (152K).
TOKENS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
WIDTHS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
MAX_GEMM_FLOP = 1.5e14  # forward + backward of one entry; larger ones run at the same rate
# Attention: one layer, 32 query / 8 KV heads (the rate is per FLOP: heads scale it linearly).
SEQS = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
HEAD_DIMS = (64, 128, 256)
ATTN_TOKENS = 65536  # batch = tokens / seq (one sequence from 64K up)
# Grouped GEMM (torch._grouped_mm, the MoE experts): rows per expert x (dim, expert width).
ROWS_PER_EXPERT = (16, 64, 256, 1024, 4096, 16384)
EXPERT_SHAPES = ((2048, 768), (4096, 1536), (4096, 14336), (7168, 2048), (2880, 2880), (1024, 512))
EXPERTS = 16  # experts timed a call (the rate depends on rows per expert, not on their count)


def sustained_ms(fn: Callable[[], object], device: torch.device, min_ms: float = 20.0) -> float:
    """Mean ms of ``fn`` over back-to-back calls lasting at least ``min_ms`` (after a warm-up)."""
    fn()
    fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    one = max(time.perf_counter() - t0, 1e-6) * 1e3
    reps = max(2, min(200, math.ceil(min_ms / one)))
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3 / reps


def gemm_row(tokens: int, out: int, inp: int, device: torch.device) -> dict:
    """A Linear layer's GEMMs: forward ``x @ w.T`` and forward + backward (input and weight gradients)."""
    x = torch.randn(tokens, inp, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(out, inp, device=device, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(tokens, out, device=device, dtype=torch.bfloat16)

    def fwd() -> None:
        with torch.no_grad():
            x @ w.t()

    def fwd_bwd() -> None:
        y = x @ w.t()
        torch.autograd.backward(y, gy, inputs=[x, w])

    flop = 2.0 * tokens * out * inp
    f, fb = sustained_ms(fwd, device), sustained_ms(fwd_bwd, device)
    return {"tokens": tokens, "out": out, "in": inp, "fwd_tflops": flop / f / 1e9, "fwd_bwd_tflops": 3 * flop / fb / 1e9}


def float8_row(tokens: int, out: int, inp: int, device: torch.device, rowwise: bool) -> dict | None:
    """The same three GEMMs in float8 through ``torch._scaled_mm`` (tensorwise: one scale a tensor;
    rowwise: one a row), operands already cast (the casts are memory-bound work the planner counts apart)."""
    if not hasattr(torch, "_scaled_mm") or device.type != "cuda":
        return None
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2

    def operands(m: int, n: int, k: int, a_dtype: torch.dtype) -> Callable[[], object]:
        a = torch.randn(m, k, device=device).to(a_dtype)
        b = torch.randn(n, k, device=device).to(e4).t()  # column-major, as _scaled_mm wants
        sa = torch.ones(m, 1, device=device) if rowwise else torch.ones((), device=device)
        sb = torch.ones(1, n, device=device) if rowwise else torch.ones((), device=device)
        return lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

    try:
        # forward (tokens x out, K = in); input gradient (tokens x in, K = out); weight gradient
        # (out x in, K = tokens); the gradients in e5m2 (torchao's float8 training casts them so).
        calls = [operands(tokens, out, inp, e4), operands(tokens, inp, out, e5), operands(out, inp, tokens, e5)]
        if rowwise:  # rowwise _scaled_mm takes e4m3 on both sides on sm90
            calls = [operands(tokens, out, inp, e4), operands(tokens, inp, out, e4), operands(out, inp, tokens, e4)]
        times = [sustained_ms(c, device) for c in calls]
    except (RuntimeError, NotImplementedError) as e:
        return {"tokens": tokens, "out": out, "in": inp, "error": " ".join(str(e).split())[:200]}
    flop = 2.0 * tokens * out * inp
    return {"tokens": tokens, "out": out, "in": inp, "fwd_tflops": flop / times[0] / 1e9,
            "fwd_bwd_tflops": 3 * flop / sum(times) / 1e9}  # fmt: skip


def attention_row(
    backend: str, seq: int, head_dim: int, causal: bool, device: torch.device, tokens: int = ATTN_TOKENS
) -> dict:
    """One layer's attention (32 query / 8 KV heads, GQA without expansion), forward and forward +
    backward; the rate counts the FLOPs the mask leaves (half of the square under ``causal``)."""
    heads, kv = 32, 8
    batch = max(1, tokens // seq)

    def rand(h: int) -> torch.Tensor:
        return torch.randn(batch, h, seq, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)

    q, k, v = rand(heads), rand(kv), rand(kv)
    go = torch.randn(batch, heads, seq, head_dim, device=device, dtype=torch.bfloat16)
    kernel = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
              "math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]  # fmt: skip

    def call() -> torch.Tensor:
        with sdpa_kernel(kernel):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    def fwd() -> None:
        with torch.no_grad():
            call()

    def fwd_bwd() -> None:
        torch.autograd.backward(call(), go, inputs=[q, k, v])

    flop = 4.0 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)
    row = {"seq": seq, "head_dim": head_dim, "causal": causal}
    try:
        f, fb = sustained_ms(fwd, device), sustained_ms(fwd_bwd, device)
    except (RuntimeError, NotImplementedError) as e:
        return {**row, "error": " ".join(str(e).split())[:200]}
    return {**row, "fwd_tflops": flop / f / 1e9, "fwd_bwd_tflops": 3 * flop / fb / 1e9}


def grouped_row(rows: int, dim: int, width: int, device: torch.device) -> dict | None:
    """The experts' SwiGLU GEMMs as the framework runs them (framework.models.moe): ``x @ gate_up`` (dim ->
    2 width) and ``h @ down`` (width -> dim) through ``torch._grouped_mm``, ``rows`` a expert."""
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        return None
    total = rows * EXPERTS
    x = torch.randn(total, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    h = torch.randn(total, width, device=device, dtype=torch.bfloat16, requires_grad=True)
    gate_up = torch.randn(EXPERTS, 2 * width, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    down = torch.randn(EXPERTS, dim, width, device=device, dtype=torch.bfloat16, requires_grad=True)
    offs = torch.arange(1, EXPERTS + 1, device=device, dtype=torch.int32) * rows
    g1 = torch.randn(total, 2 * width, device=device, dtype=torch.bfloat16)
    g2 = torch.randn(total, dim, device=device, dtype=torch.bfloat16)

    def fwd() -> None:
        with torch.no_grad():
            fn(x, gate_up.transpose(-2, -1), offs=offs)
            fn(h, down.transpose(-2, -1), offs=offs)

    def fwd_bwd() -> None:
        a = fn(x, gate_up.transpose(-2, -1), offs=offs)
        b = fn(h, down.transpose(-2, -1), offs=offs)
        torch.autograd.backward([a, b], [g1, g2], inputs=[x, h, gate_up, down])

    flop = 2.0 * total * dim * width * 3  # gate_up (2 width) + down (width)
    row = {"rows_per_expert": rows, "dim": dim, "width": width}
    try:
        f, fb = sustained_ms(fwd, device), sustained_ms(fwd_bwd, device)
    except (RuntimeError, NotImplementedError) as e:
        return {**row, "error": " ".join(str(e).split())[:200]}
    return {**row, "fwd_tflops": flop / f / 1e9, "fwd_bwd_tflops": 3 * flop / fb / 1e9}


# The MoE sublayer around its experts (router, sort by expert, gather, weighting, scatter-add): the
# framework's own layer (framework/models/moe.py, loaded by path: it imports torch only), compiled as
# a block is, forward + backward, against its experts alone on the same rows.
MOE_SHAPES = ((2048, 768, 128, 8), (4096, 1536, 128, 8), (4096, 14336, 8, 2), (7168, 2048, 256, 8))
MOE_TOKENS = (4096, 16384)


def _moe_module():  # noqa: ANN202 - the module framework/models/moe.py
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "framework" / "models" / "moe.py"
    spec = importlib.util.spec_from_file_location("framework_moe_standalone", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def moe_row(tokens: int, dim: int, width: int, experts: int, k: int, device: torch.device) -> dict:
    """One MoE sublayer, compiled, forward + backward, and its experts alone on the rows it routed:
    the difference is what routing, permutation and combine cost."""
    moe = _moe_module()
    layer = moe.MoE(moe.MoEConfig(dim, width, experts, k)).to(device, torch.bfloat16)
    x = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16)
    compiled, experts_compiled = torch.compile(layer), torch.compile(layer.experts)
    with torch.no_grad():
        routing = layer.gate(x)
        d = moe.sort_by_expert(routing.indices, experts, None)
        rows = x[d.token].detach().requires_grad_()
    gy = torch.randn(rows.shape[0], dim, device=device, dtype=torch.bfloat16)

    def whole() -> None:
        torch.autograd.backward(compiled(x), g)

    def experts_only() -> None:
        torch.autograd.backward(experts_compiled(rows, d.counts), gy)

    row = {"tokens": tokens, "dim": dim, "width": width, "experts": experts, "top_k": k}
    try:
        total, alone = sustained_ms(whole, device), sustained_ms(experts_only, device)
    except (RuntimeError, NotImplementedError) as e:
        return {**row, "error": " ".join(str(e).split())[:200]}
    return {**row, "layer_ms": total, "experts_ms": alone, "overhead_ms": total - alone}


def gemm_shapes(smoke: bool, float8: bool = False) -> list[tuple[int, int, int]]:
    """The (tokens, out, in) entries timed; float8 on every other token count from 512 wide (its
    small GEMMs lose to the casts anyway, which the planner counts apart)."""
    tokens, widths = (TOKENS[:2], WIDTHS[:3]) if smoke else (TOKENS, WIDTHS)
    if float8 and not smoke:
        tokens, widths = TOKENS[1::2], tuple(w for w in WIDTHS if w >= 512)
    return [
        (t, o, i)
        for t in tokens
        for o in widths
        for i in widths
        if i <= 32768 and 6.0 * t * o * i <= MAX_GEMM_FLOP
    ]


def measure(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    small = args.smoke
    table: dict = {"gemm": {"bf16": []}, "attention": {}, "grouped_gemm": {"bf16": []}}
    start = time.time()
    for t, o, i in gemm_shapes(small):
        table["gemm"]["bf16"].append(gemm_row(t, o, i, device))
    print(f"gemm bf16: {len(table['gemm']['bf16'])} shapes, {time.time() - start:.0f}s", flush=True)
    if device.type == "cuda":
        for name, rowwise in (("float8_tensorwise", False), ("float8_rowwise", True)):
            rows = [float8_row(t, o, i, device, rowwise) for t, o, i in gemm_shapes(small, float8=True)]
            table["gemm"][name] = [r for r in rows if r is not None]
            print(f"gemm {name}: {time.time() - start:.0f}s", flush=True)
        torch.cuda.empty_cache()
    backends = ("cudnn", "flash") if device.type == "cuda" else ("math",)
    seqs, dims = (SEQS[:2], HEAD_DIMS[:1]) if small else (SEQS, HEAD_DIMS)
    # causal at every length; the full square (a bidirectional or sliding-window bound) to 8K, head
    # dim 256 to 16K: past them the time goes quadratic and the rate is flat
    points = [(s, hd, c) for s in seqs for hd in dims for c in (True, False)
              if (c or s <= 8192) and (hd < 256 or s <= 16384)]  # fmt: skip
    for backend in backends:
        table["attention"][backend] = [
            attention_row(backend, s, hd, c, device, 2048 if small else ATTN_TOKENS) for s, hd, c in points
        ]
        print(f"attention {backend}: {time.time() - start:.0f}s", flush=True)
    if device.type == "cuda":
        for dim, width in EXPERT_SHAPES[-1:] if small else EXPERT_SHAPES:
            for rows in ROWS_PER_EXPERT:
                if 18.0 * rows * EXPERTS * dim * width > MAX_GEMM_FLOP:
                    continue
                row = grouped_row(rows, dim, width, device)
                if row is not None:
                    table["grouped_gemm"]["bf16"].append(row)
        print(f"grouped gemm: {time.time() - start:.0f}s", flush=True)
        shapes = [] if args.no_moe else MOE_SHAPES[:1] if small else MOE_SHAPES
        table["moe_overhead"] = [
            moe_row(t, *shape, device) for shape in shapes for t in (MOE_TOKENS[:1] if small else MOE_TOKENS)
        ]
        print(f"moe overhead: {time.time() - start:.0f}s", flush=True)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="a few shapes: the code path, not a table")
    parser.add_argument("--no-moe", action="store_true", help="skip the MoE layer's overhead (its compiles: ~6 min)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    table = measure(args)
    record = {
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/kernel_tables.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "units": "TFLOP/s achieved (forward; forward + backward), bf16 unless named",
        **table,
    }
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
