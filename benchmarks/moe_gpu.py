"""Qwen3-30B-A3B's MoE shape on one GPU (issue 25, point 6): a hand-written loop of the same model,
with the grouped GEMM's share of its step, for the table beside ``python train.py`` (moe_gpu.sh).

    python benchmarks/moe_gpu.py hand --layers 8 --seq 4096 --batch 2 --out hand.json
    python benchmarks/moe_gpu.py table --hand hand.json --runs RUN_DIR... > table.md

The hand loop is the strongest simple loop written without the framework's training code (it builds
the same module, ``framework.models``, like benchmarks/llama8b_8k.py's): bf16 autocast over fp32
master weights, each block and the loss head compiled (``torch.compile``, fullgraph), fused AdamW
stepped per parameter from its post-accumulate-grad hook on a side stream, random tokens (the same
generator as ``data=synthetic``: the speed does not depend on them). The grouped GEMM's share is the
device time of ``aten::_grouped_mm`` (forward and backward) per profiled step over the step's time,
with ``--float8`` of ``aten::_scaled_grouped_mm`` (torchao's float8 rowwise grouped GEMM on the
experts, which every ``GroupedExperts`` then runs: ``GroupedExperts.float8``; its casts are not in
the share). ``train.py`` with ``model.float8=rowwise`` does the same at this shape (the size filter
keeps every Linear layer bf16).

MFU: 6N + 12·L·H·Q·T per token with N the active parameters (top-8 of 128 experts; the framework's
``flops_per_token``), over 989 TFLOP/s dense bf16.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

PEAK_TFLOPS = 989.0
# the grouped GEMMs' operators: bf16 (torch's grouped_mm) and float8 (torchao's, through torch)
GROUPED_OPS = ("aten::_grouped_mm", "aten::_scaled_grouped_mm")


def grouped_share(step: callable, steps: int = 2) -> tuple[float, float]:  # type: ignore[valid-type]
    """(grouped GEMM device ms per step, its share of the step's device time) over ``steps`` steps."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = p.key_averages()
    gemm = sum(e.device_time_total for e in events if e.key in GROUPED_OPS)
    # the kernels' own rows: an operator's self device time is its kernels', counted there already
    kernels = sum(
        e.self_device_time_total
        for e in events
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
    )
    return gemm / steps / 1e3, gemm / kernels if kernels else 0.0


def hand(args: argparse.Namespace) -> None:
    from gpu_bench import compose_cfg
    from llama8b_8k import _sync, _Timer, attach_optimizer_in_backward, compile_model

    from framework.config import schema as config_mod
    from framework.launch import recipes
    from framework.launch.ranks import register_resolvers
    from framework.models import active_params, build_model, flops_per_token, materialize, num_params

    config_mod.register()
    recipes.register()
    register_resolvers()
    t_start = time.perf_counter()
    dev = torch.device("cuda")
    over = [f"recipe={args.recipe}", f"model.n_layers={args.layers}", f"train.seq_len={args.seq}"]
    cfg = compose_cfg(over + ([f"model.layer_pattern='{args.pattern}'"] if args.pattern else []))
    m = cfg.model
    m = dataclasses.replace(
        m, moe=dataclasses.replace(m.moe, expert_kernel=config_mod.ExpertKernel(args.kernel))
    )
    model = build_model(m, args.seq)
    if args.float8:
        from framework.models.moe import GroupedExperts

        for mod in model.modules():
            if isinstance(mod, GroupedExperts):
                mod.float8 = True  # run_experts: torchao's float8 rowwise grouped GEMM, groups padded to 16
    materialize(model, dev, seed=0)
    handles, side = attach_optimizer_in_backward(model, 3e-4, guard=args.guard)
    if args.compile:
        compile_model(model)
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = torch.randint(
        0, m.vocab_size, (args.steps + 2, args.batch, args.seq + 1), device=dev, generator=gen
    )
    torch.cuda.reset_peak_memory_stats()

    def step(i: int = 0) -> torch.Tensor:
        b = rows[i % rows.shape[0]]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(b[:, :-1], b[:, 1:])
        loss.backward()
        _sync(side)
        return loss.detach()

    events, losses, first = [], [], None
    for i in range(args.steps):
        timer = _Timer(True)
        timer.start()
        losses.append(step(i))
        timer.stop()
        if first is None:
            torch.cuda.synchronize()
            first = time.perf_counter() - t_start
        events.append(timer)
    torch.cuda.synchronize()
    step_s = statistics.median(t.seconds() for t in events[args.warmup :])
    tps = args.batch * args.seq / step_s
    gemm_ms, _ = grouped_share(step)
    share = gemm_ms / (step_s * 1e3)
    row = {
        "what": f"hand {args.recipe} {'compile' if args.compile else 'eager'} expert_kernel={args.kernel}"
        + (" +norm/found_inf" if args.guard else "")
        + (" float8 experts" if args.float8 else ""),
        "layers": args.layers, "seq": args.seq, "batch": args.batch,
        "params_b": num_params(m) / 1e9, "active_b": active_params(m) / 1e9,
        "tokens_per_s": tps, "step_ms": step_s * 1e3,
        "mfu": flops_per_token(m, args.seq) * tps / (PEAK_TFLOPS * 1e12),
        "grouped_mm_ms": gemm_ms, "grouped_mm_share": share,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "first_step_s": first, "loss_first_last": [float(losses[0]), float(losses[-1])],
    }  # fmt: skip
    print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps([row], indent=1))


def table(args: argparse.Namespace) -> None:
    rows = []
    for h in args.hand:
        if Path(h).exists():
            rows += json.loads(Path(h).read_text())
    for r in args.runs:
        s = Path(r) / "summary.json"
        if not s.exists():
            rows.append({"what": f"train.py {Path(r).name}: no summary"})
            continue
        d = json.loads(s.read_text())
        top = Path(r) / "profile" / "top_ops_rank0.json"
        share = None
        if top.exists() and d.get("step_p50_s"):  # one profiled step (run.profile_active=1)
            ms = sum(o["self_ms"] for o in json.loads(top.read_text()) if o["name"] in GROUPED_OPS)
            share = ms / (1e3 * d["step_p50_s"])
        rows.append({
            "what": f"train.py {Path(r).name}", "tokens_per_s": d.get("tokens_per_s"),
            "step_ms": 1e3 * d["step_p50_s"] if d.get("step_p50_s") else None, "mfu": d.get("mfu"),
            "grouped_mm_share": share, "peak_gib": d.get("peak_mem_gib"),
            "first_step_s": d.get("time_to_first_step_s"), "loss_first_last": [None, d.get("final_loss")],
        })  # fmt: skip
    print("| run | tokens/s | step ms | MFU (active) | grouped GEMM share | peak GiB | first step s |")
    print("|---|---|---|---|---|---|---|")

    def f(v: object, fmt: str) -> str:
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    for r in rows:
        print(f"| {r['what']} | {f(r.get('tokens_per_s'), ',.0f')} | {f(r.get('step_ms'), '.1f')} | "
              f"{f(r.get('mfu'), '.1%')} | {f(r.get('grouped_mm_share'), '.1%')} | {f(r.get('peak_gib'), '.1f')} | "
              f"{f(r.get('first_step_s'), '.0f')} |")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("hand")
    h.add_argument("--recipe", default="qwen3_30b_a3b")
    h.add_argument("--layers", type=int, default=8)
    h.add_argument("--pattern", default="", help="model.layer_pattern for --layers (e.g. 'dense x1, moe x7')")
    h.add_argument("--seq", type=int, default=4096)
    h.add_argument("--batch", type=int, default=2)
    h.add_argument("--steps", type=int, default=12)
    h.add_argument("--warmup", type=int, default=4)
    h.add_argument("--kernel", default="grouped", choices=["grouped", "loop", "auto"])
    h.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    h.add_argument("--guard", action="store_true", help="the framework's per-gradient norm and skip")
    h.add_argument(
        "--float8", action="store_true", help="the experts in torchao's float8 rowwise grouped GEMM"
    )
    h.add_argument("--out", type=Path, required=True)
    t = sub.add_parser("table")
    t.add_argument("--hand", nargs="*", default=[])
    t.add_argument("--runs", nargs="*", default=[])
    args = p.parse_args()
    if args.cmd == "hand" and args.float8 and args.kernel == "loop":
        p.error("--float8 runs the experts by the grouped GEMM: use --kernel grouped or auto")
    {"hand": hand, "table": table}[args.cmd](args)


if __name__ == "__main__":
    main()
