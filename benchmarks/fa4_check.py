"""FlashAttention-4 on the GPU: kernel speed at the 1B's attention shape, and parity with SDPA.

    python benchmarks/fa4_check.py --out $OUT/fa4_check.md

1. Forward + backward time of causal GQA attention at Llama-3.2-1B's shape (batch 16, 32 query
   heads, 8 KV heads, seq 2048, head 64, bf16): SDPA's cuDNN kernel, torch's own flash kernel
   (FlashAttention-2), and flash-attn-4 swapped in through torch's registry (``model.attention=fa4``).
2. Output and gradient errors of each kernel against an fp32 math reference, on a small case.
3. The framework's model (head 64, 4 query heads per KV head, as the 1B) with model.attention=auto
   and =fa4 from the same weights, eager and under ``torch.compile(fullgraph=True)`` (which fails
   on a graph break): loss and gradient differences.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from framework.config.schema import AttentionBackend, ModelConfig  # noqa: E402
from framework.kernels import fa4  # noqa: E402
from framework.models import build_model, materialize  # noqa: E402


def qkv(b: int, h: int, kv: int, s: int, d: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [
        torch.randn(b, n, s, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        for n in (h, kv, kv)
    ]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: SDPBackend | None) -> torch.Tensor:
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def time_fwd_bwd(backend: SDPBackend, shape: tuple[int, ...], iters: int = 20) -> float:
    """Median ms of one forward + backward (CUDA events)."""
    q, k, v = qkv(*shape)
    dout = torch.randn_like(q)
    times = []
    for i in range(iters + 5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        attend(q, k, v, backend).backward(dout)
        end.record()
        end.synchronize()
        if i >= 5:
            times.append(start.elapsed_time(end))
        q.grad = k.grad = v.grad = None
    return sorted(times)[len(times) // 2]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def errors(backend: SDPBackend, shape: tuple[int, ...]) -> dict[str, float]:
    """Output and q/k/v gradient errors (relative L2) against SDPA's math kernel in fp32."""
    q, k, v = qkv(*shape, seed=1)
    dout = torch.randn_like(q)
    out = attend(q, k, v, backend)
    out.backward(dout)
    got = [out, q.grad, k.grad, v.grad]
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = attend(q32, k32, v32, SDPBackend.MATH)
    ref.backward(dout.float())
    return {
        n: rel(a, r)
        for n, a, r in zip(("out", "dq", "dk", "dv"), got, [ref, q32.grad, k32.grad, v32.grad], strict=True)
    }


def model_loss_grads(cfg: ModelConfig, compiled: bool, tokens: torch.Tensor) -> tuple[float, dict]:
    model = build_model(cfg, tokens.shape[1] - 1)
    materialize(model, "cuda", seed=0)
    step = torch.compile(model, fullgraph=True, dynamic=False) if compiled else model
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = step(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return float(loss), {
        n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    lines = [f"torch {torch.__version__}, {torch.cuda.get_device_name()}", ""]

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    shape_1b = (16, 32, 8, 2048, 64)
    small = (2, 8, 2, 512, 64)
    say("| kernel | fwd+bwd ms, 1B shape (b16 h32 kv8 s2048 d64) | out err | dq err | dk err | dv err |")
    say("|---|---|---|---|---|---|")

    def row(name: str, backend: SDPBackend) -> None:
        ms, err = time_fwd_bwd(backend, shape_1b), errors(backend, small)
        say(f"| {name} | {ms:.3f} | " + " | ".join(f"{err[n]:.2e}" for n in ("out", "dq", "dk", "dv")) + " |")

    row("cudnn", SDPBackend.CUDNN_ATTENTION)
    row("flash (FA2)", SDPBackend.FLASH_ATTENTION)
    t0 = time.perf_counter()
    fa4.activate()
    q, k, v = qkv(*small)
    attend(q, k, v, SDPBackend.FLASH_ATTENTION).sum().backward()  # JIT-compiles FA4's kernels
    compile_s = time.perf_counter() - t0
    row("FA4 (registry)", SDPBackend.FLASH_ATTENTION)
    say("")
    say(
        f"(errors: relative L2 against SDPA's math kernel in fp32, causal GQA, b2 h8 kv2 s512 d64; FA4's first "
        f"forward + backward, its kernels' compile: {compile_s:.1f} s)"
    )

    # The framework's model, auto (cuDNN / flash as torch picks) vs fa4, the same weights and tokens.
    cfg = ModelConfig(
        name="fa4_check", dim=512, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=1024, vocab_size=1024
    )
    tokens = torch.randint(
        0, cfg.vocab_size, (4, 1025), device="cuda", generator=torch.Generator("cuda").manual_seed(0)
    )
    say("")
    say("| model (dim 512, 2 layers, h8 kv2, b4 s1024) | loss | loss vs auto | max grad err vs auto |")
    say("|---|---|---|---|")
    torch.nn.attention.restore_flash_attention_impl()
    ref_loss, ref_grads = model_loss_grads(cfg, False, tokens)
    say(f"| auto, eager | {ref_loss:.5f} | - | - |")
    for compiled in (False, True):
        torch._dynamo.reset()
        loss, grads = model_loss_grads(
            dataclasses.replace(cfg, attention=AttentionBackend.fa4), compiled, tokens
        )
        worst = max(rel(grads[n], ref_grads[n]) for n in ref_grads)
        what = "compile fullgraph" if compiled else "eager"
        say(f"| fa4, {what} | {loss:.5f} | {abs(loss - ref_loss) / ref_loss:.2e} | {worst:.2e} |")
    say(f"current flash impl: {torch.nn.attention.current_flash_attention_impl()}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
