"""Causal attention's rate by head dim and sequence length: the sweep the planner's attention cost needs.

The planner costs attention as 12·L·H·Q·T flops a token at the GEMM rate (framework.planner.cost),
which is 0.34 of the peak on the causal count; what it runs at by shape is this sweep's question
(benchmarks/PERF.md, "Session 16"). This prints, per SDPA
backend, the forward + backward time of one layer's causal attention at a fixed number of tokens a
call (GQA 32 / 8 heads), and the rate on the causal count: 6·H·Q·T flops a token over the peak.

    python benchmarks/attn_sweep.py                       # the GPU sweep (one H200: ~1 min)
    python benchmarks/attn_sweep.py --device cpu --seqs 64,128 --head-dims 16 --tokens 256 --peak 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {
    "auto": None,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def timed_ms(fn: Callable[[], None], device: torch.device, warmup: int, reps: int) -> float:
    """Median wall time of ``fn`` in ms, the device synchronised around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def one_row(backend: str, seq: int, head_dim: int, args: argparse.Namespace) -> dict:
    """One layer's causal attention, forward + backward, at ``seq`` with ``args.tokens`` tokens a call."""
    dev, heads, kv = torch.device(args.device), args.heads, args.kv_heads
    batch = max(1, args.tokens // seq)
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(h: int) -> torch.Tensor:
        return torch.randn(batch, h, seq, head_dim, device=dev, dtype=torch.bfloat16, generator=g)

    q, k, v = (rand(h).requires_grad_() for h in (heads, kv, kv))
    grad_out = rand(heads)
    row = {"backend": backend, "seq": seq, "head_dim": head_dim, "batch": batch}

    def step() -> None:
        chosen = BACKENDS[backend]
        ctx = sdpa_kernel(chosen) if chosen is not None else nullcontext()
        with ctx:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(grad_out)
        q.grad = k.grad = v.grad = None

    try:
        ms = timed_ms(step, dev, args.warmup, args.reps)
    except (RuntimeError, NotImplementedError) as e:  # a backend that cannot take the shape is a row
        return {**row, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
    causal_flops = 6 * heads * head_dim * seq * batch * seq  # 6·H·Q·T a token, batch·seq tokens
    return {**row, "fwd_bwd_ms": ms, "causal_rate": causal_flops / (ms * 1e-3) / (args.peak * 1e12)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--backends", default="auto,cudnn,flash")
    p.add_argument("--seqs", default="2048,4096,8192,16384,32768")
    p.add_argument("--head-dims", default="64,128")
    p.add_argument("--tokens", type=int, default=32768, help="tokens a call (batch = tokens / seq)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--peak", type=float, default=989.0, help="dense bf16 TFLOP/s (H200: 989)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = p.parse_args()
    rows = [
        one_row(b, s, d, args)
        for b in args.backends.split(",")
        for d in map(int, args.head_dims.split(","))
        for s in map(int, args.seqs.split(","))
    ]
    print("| backend | head dim | seq | batch | fwd+bwd ms | rate on the causal count |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        tail = r["error"] if "error" in r else f"{r['fwd_bwd_ms']:.3f} | {r['causal_rate']:.3f}"
        print(f"| {r['backend']} | {r['head_dim']} | {r['seq']} | {r['batch']} | {tail} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
