"""How much of each Linear's output gradient a tensorwise float8 cast loses, e4m3 vs e5m2 (the
``model.float8_grad_dtype`` question, PERF.md round 15), on the CPU in fp32.

    python benchmarks/float8_grad_range.py [--recipe llama_125m] [--seq 256] [--batch 2] [--steps 0]

The recipe's model (vocabulary 256) on bytes of the stdlib corpus, after ``--steps`` fp32 AdamW steps
at the recipe's lr: one more forward/backward keeps each block Linear's input and output gradient,
and the gradient is cast as torchao's tensorwise recipe casts it (one scale: the format's max over
the tensor's amax). Per layer kind: the share of non-zero elements flushed to zero, the cast's
relative L2 error, and the weight gradient's (input^T @ cast gradient) relative error per output row:
the median and the share of rows off by more than 10%. Adam scales each element's step by its own
gradient history, so a row whose gradient is small next to the tensor's largest counts as much as
any other row, while the tensor-wide L2 error hides it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from framework.data.sampler import load_stdlib  # noqa: E402
from framework.launch import recipes  # noqa: E402
from framework.models import build_model, materialize  # noqa: E402


def cast(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A tensorwise float8 round trip, as torchao scales it."""
    scale = torch.finfo(dtype).max / g.abs().max().clamp(min=1e-12)
    return (g * scale).to(dtype).float() / scale


def figures(x: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> tuple[float, float, float, float]:
    q = cast(g, dtype)
    nz = g != 0
    flushed = float(((q == 0) & nz).sum() / nz.sum().clamp(min=1))
    gw, gw_q = g.T @ x, q.T @ x
    row_err = (gw_q - gw).norm(dim=1) / gw.norm(dim=1).clamp(min=1e-30)
    return (
        flushed,
        float((q - g).norm() / g.norm()),
        float(row_err.median()),
        float((row_err > 0.1).float().mean()),
    )


def batches(seq: int, batch: int):  # noqa: ANN201 - an iterator of (batch, seq + 1) token tensors
    data = torch.from_numpy(load_stdlib(0.01, max_bytes=8 * 1024 * 1024).train.astype("int64"))
    n = batch * (seq + 1)
    for i in range(len(data) // n):
        yield data[i * n : (i + 1) * n].view(batch, seq + 1)


def loss_of(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits = model(x[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="llama_125m")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=0, help="fp32 AdamW steps before the measurement")
    args = p.parse_args()
    cfg = recipes.compose_recipe(args.recipe, ["model.vocab_size=256"])
    model = build_model(cfg.model, args.seq)
    materialize(model, "cpu", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    data = batches(args.seq, args.batch)
    for step in range(args.steps):
        opt.zero_grad()
        loss = loss_of(model, next(data))
        loss.backward()
        opt.step()
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.3f}", file=sys.stderr)
    kept: dict[str, list[torch.Tensor]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "output":
            mod.register_forward_hook(lambda _m, inp, _o, n=name: kept.__setitem__(n, [inp[0].detach()]))
            mod.register_full_backward_hook(lambda _m, _gi, go, n=name: kept[n].append(go[0].detach()))
    opt.zero_grad()
    loss_of(model, next(data)).backward()
    kinds: dict[str, list[tuple[float, ...]]] = {}
    for name, (x, g) in kept.items():
        x, g = x.flatten(0, 1), g.flatten(0, 1)
        row = (*figures(x, g, torch.float8_e4m3fn), *figures(x, g, torch.float8_e5m2))
        kinds.setdefault(name.rsplit(".", 1)[-1], []).append(row)
    print(f"{args.recipe}, vocab 256, b{args.batch} x {args.seq}, after {args.steps} steps")
    cols = ["flushed", "L2 error", "row error p50", "rows > 10%"]
    print(
        "| layer | "
        + " | ".join(f"e4m3 {c}" for c in cols)
        + " | "
        + " | ".join(f"e5m2 {c}" for c in cols)
        + " |"
    )
    print("|---|" + "---|" * 8)
    for kind, vals in kinds.items():
        m = [statistics.mean(v[i] for v in vals) for i in range(8)]
        cells = [
            f"{m[0]:.2%}",
            f"{m[1]:.3f}",
            f"{m[2]:.3f}",
            f"{m[3]:.1%}",
            f"{m[4]:.2%}",
            f"{m[5]:.3f}",
            f"{m[6]:.3f}",
            f"{m[7]:.1%}",
        ]
        print(f"| {kind} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
