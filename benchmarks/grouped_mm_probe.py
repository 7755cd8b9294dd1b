"""What ``grouped_mm`` accepts on this machine's torch and device, and how fast it is against a loop.

Why: ``framework.models.moe.grouped_mm_supported`` encodes these facts; this re-measures them on a new
torch or device (torch only, no framework import, so it runs on the bare GPU image):
dtypes, backward, 16-byte row strides, int32 offsets, empty groups, a transposed weight view, and the
grouped vs per-expert loop time of forward+backward at a Qwen3-30B-A3B expert shape.

    python benchmarks/grouped_mm_probe.py [--device cuda]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def _gmm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return (getattr(F, "grouped_mm", None) or torch._grouped_mm)(x, w, offs=offs)


def _try(name: str, fn) -> None:
    try:
        fn()
        print(f"  {name}: ok")
    except Exception as e:  # noqa: BLE001 - the probe reports every refusal
        print(f"  {name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")


def _check(dev: str, dtype: torch.dtype, dim: int = 64, hidden: int = 96) -> None:
    """Forward and backward of one grouped GEMM against a loop, groups [3, 0, 4, 3] (one empty)."""
    x = torch.randn(10, dim, device=dev, dtype=dtype, requires_grad=True)
    w = torch.randn(4, hidden, dim, device=dev, dtype=dtype, requires_grad=True)
    offs = torch.tensor([3, 3, 7, 10], device=dev, dtype=torch.int32)
    y = _gmm(x, w.transpose(-2, -1), offs)
    ref = torch.cat([x[a:b] @ w[e].T for e, (a, b) in enumerate(zip([0, 3, 3, 7], [3, 3, 7, 10], strict=True))])
    g = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    rx, rw = torch.autograd.grad(ref, (x, w), g)
    err = max((a - b).abs().max().item() for a, b in ((y, ref), (gx, rx), (gw, rw)))
    assert err < (1e-1 if dtype != torch.float32 else 1e-3), err


def _bench(dev: str, dtype: torch.dtype, tokens: int, dim: int, hidden: int, experts: int, k: int) -> None:
    torch.manual_seed(0)
    counts = torch.bincount(torch.randint(experts, (tokens * k,)), minlength=experts)
    x = torch.randn(tokens * k, dim, device=dev, dtype=dtype, requires_grad=True)
    w1 = torch.randn(experts, 2 * hidden, dim, device=dev, dtype=dtype, requires_grad=True)
    w2 = torch.randn(experts, dim, hidden, device=dev, dtype=dtype, requires_grad=True)
    offs = torch.cumsum(counts, 0).to(device=dev, dtype=torch.int32)
    splits = counts.tolist()

    def grouped() -> torch.Tensor:
        gate, up = _gmm(x, w1.transpose(-2, -1), offs).chunk(2, -1)
        return _gmm(F.silu(gate) * up, w2.transpose(-2, -1), offs)

    def loop() -> torch.Tensor:
        outs = []
        for e, part in enumerate(x.split(splits)):
            gate, up = F.linear(part, w1[e]).chunk(2, -1)
            outs.append(F.linear(F.silu(gate) * up, w2[e]))
        return torch.cat(outs)

    times = {}
    for name, fn in (("grouped", grouped), ("loop", loop)):
        for i in range(8):
            if i == 3:
                if dev == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
            fn().square().mean().backward()
        if dev == "cuda":
            torch.cuda.synchronize()
        times[name] = (time.perf_counter() - start) / 5 * 1e3
    print(f"  T={tokens} D={dim} I={hidden} E={experts} k={k} {dtype}: fwd+bwd grouped {times['grouped']:.2f} ms, "
          f"loop {times['loop']:.2f} ms, loop/grouped {times['loop'] / times['grouped']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    dev = ap.parse_args().device
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"torch {torch.__version__} on {name}; F.grouped_mm: {hasattr(F, 'grouped_mm')}")
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        _try(f"{dtype} forward+backward", lambda dtype=dtype: _check(dev, dtype))
    _try("bf16 dim 60 (120-byte rows)", lambda: _check(dev, torch.bfloat16, dim=60))
    _try("fp32 dim 6 (24-byte rows)", lambda: _check(dev, torch.float32, dim=6))
    big = (8192, 2048, 768, 128, 8) if dev == "cuda" else (1024, 256, 128, 32, 4)
    for dtype in (torch.bfloat16, torch.float32):
        _try(f"bench {dtype}", lambda dtype=dtype: _bench(dev, dtype, *big))


if __name__ == "__main__":
    main()
