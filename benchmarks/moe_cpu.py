"""The MoE experts' grouped GEMM against the per-expert loop (issue 25 points 1 and 6, CPU slice).

Why: the issue's speed goal is the grouped path at least 1.5x the per-expert loop on the GPU; this
prints the same comparison on whatever device runs it (CPU here, ``--device cuda`` on the H200), forward
and forward+backward of ``GroupedExperts`` on the rows a real router sorted, with the same weights.

    python benchmarks/moe_cpu.py [--tokens 2048 --dim 256 --hidden 512 --experts 16 --top-k 2 --dtype fp32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from framework.models.moe import ExpertKernel, GroupedExperts, MoE, MoEConfig, sort_by_expert

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _time(fn, repeats: int, device: str) -> float:
    """Median wall time in ms of ``repeats`` calls after two warm-up calls."""
    times = []
    for i in range(repeats + 2):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args()
    torch.manual_seed(0)
    dtype, dev = DTYPES[a.dtype], a.device
    cfg = MoEConfig(dim=a.dim, moe_intermediate_size=a.hidden, num_experts=a.experts, num_experts_per_tok=a.top_k)
    moe = MoE(cfg).to(dev, dtype)
    x = torch.randn(a.tokens, a.dim, device=dev, dtype=dtype)
    d = sort_by_expert(moe.gate(x).indices, a.experts, None)
    rows = x[d.token].detach()
    print(f"torch {torch.__version__} {dev} {a.dtype} threads={torch.get_num_threads()}: T={a.tokens} D={a.dim} "
          f"I={a.hidden} E={a.experts} k={a.top_k}; rows per expert max/mean "
          f"{d.counts.max().item()}/{d.counts.float().mean().item():.0f}")
    results = {}
    for kernel in (ExpertKernel.GROUPED, ExpertKernel.LOOP):
        experts = GroupedExperts(a.experts, a.dim, a.hidden, kernel).to(dev, dtype)
        experts.load_state_dict(moe.experts.state_dict())
        inp = rows.clone().requires_grad_()

        def fwd(experts: GroupedExperts = experts) -> None:
            with torch.no_grad():
                experts(rows, d.counts)

        def fwd_bwd(experts: GroupedExperts = experts, inp: torch.Tensor = inp) -> None:
            experts(inp, d.counts).square().mean().backward()

        results[kernel] = (_time(fwd, a.repeats, dev), _time(fwd_bwd, a.repeats, dev))
        print(f"  {kernel.value:8s} forward {results[kernel][0]:8.2f} ms   forward+backward {results[kernel][1]:8.2f} ms")
    g, lp = results[ExpertKernel.GROUPED], results[ExpertKernel.LOOP]
    print(f"  loop / grouped: forward {lp[0] / g[0]:.2f}x   forward+backward {lp[1] / g[1]:.2f}x")


if __name__ == "__main__":
    main()
