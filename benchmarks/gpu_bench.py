"""GPU benchmark: the framework's training step vs a hand-written loop of the same model, one process.

    python benchmarks/gpu_bench.py --models llama_125m,llama1b --modes eager,compile,cudagraphs

For each recipe and executor mode it composes the real config (Hydra compose API, the same groups
as ``train.py``), runs ``framework.train.trainer.run`` in this process on one GPU (world 1 goes through
the same path as N ranks: DDP over a one-rank group), and reads the run's summary. In the same
process it times a hand-written loop of the same model (same Llama module, fused AdamW, bf16
autocast, fp32 master weights; by default the whole model compiled as one graph, the strongest
simple loop; float8 through torchao directly with ``model.float8=...`` in a variant line). Prints tokens/s, step ms,
MFU (vs 989 TFLOP/s dense bf16, flops/token = 6N + 12·L·H·Q·T) from the median step (the mean
beside it), peak memory, the planner's
predicted peak, time to first step and compile time (the first step less a median step); writes the table as JSON and markdown under ``--out``.
Measure ratios side by side in one run: the machines are noisy.

``--data jsonl|text`` trains the framework runs on real packed text instead of the recipe's data:
the standard library's source written as documents (``--data-mb``), tokenized on the fly by a
byte-level BPE that ``python -m framework.data tokenizer train`` builds here first (no download).
The "data wait" column is the loader's wait as a share of the step time (framework.data times
each ``next_batch``; the trainer reports it in metrics.jsonl and summary.json):

    python benchmarks/gpu_bench.py --models llama1b --modes compile --hand '' --data jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hydra import compose, initialize_config_dir  # noqa: E402

from framework.config import schema as config_mod  # noqa: E402
from framework.config.schema import Config, Float8Recipe, ModelConfig, quote_numeric_choices, to_config  # noqa: E402
from framework.launch import recipes  # noqa: E402
from framework.launch.ranks import apply_allocator_environment, register_resolvers  # noqa: E402
from framework.models import build_model, flops_per_token, materialize  # noqa: E402
from framework.parallel.step import loss_fn  # noqa: E402
from framework.planner.resolve import resolve  # noqa: E402

PEAK_TFLOPS = 989.0  # H100/H200 SXM dense bf16 datasheet figure


def compose_cfg(overrides: list[str]) -> Config:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return to_config(compose("config", overrides=quote_numeric_choices(overrides)))


def reset() -> None:
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def write_documents(out: Path, kind: str, megabytes: float) -> Path:
    """The standard library's source as documents (real text every machine has), cycled to the size
    asked for: one jsonl file (``{"text": ...}`` per line), or a folder of .txt files."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    path = out / ("docs.jsonl" if kind == "jsonl" else "docs")
    written, n = 0, 0
    (path if kind == "text" else out).mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        f = stack.enter_context(path.open("w")) if kind == "jsonl" else None
        while written < megabytes * 1e6:
            for src in files:
                text = src.read_text(encoding="utf-8", errors="replace")
                if f is not None:
                    written += f.write(json.dumps({"text": text}) + "\n")
                else:
                    written += (path / f"{n:06d}.txt").write_text(text)
                n += 1
                if written >= megabytes * 1e6:
                    break
    return path


def packed_source(out: Path, kind: str, megabytes: float, vocab_size: int) -> list[str]:
    """Documents and a BPE trained on a 4 MB sample of them by the framework's own command; the
    overrides that train on them, packed on the fly."""
    out.mkdir(parents=True, exist_ok=True)
    docs = write_documents(out, kind, megabytes)
    sample = write_documents(out / "sample", "jsonl", min(4.0, megabytes))
    bpe = out / "bpe.json"
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "framework.data", "tokenizer", "train", str(bpe), str(sample)]
    subprocess.run([*cmd, "--vocab-size", str(vocab_size)], check=True, cwd=ROOT)
    print(f"data: {megabytes:g} MB of {kind} at {docs}; BPE of {vocab_size} trained in "
          f"{time.perf_counter() - t0:.1f}s", flush=True)  # fmt: skip
    return [
        f"data={kind}",
        f"data.path={docs}",
        "tokenizer=hf",
        f"tokenizer.path={bpe}",
    ]


def framework_run(
    recipe: str, mode: str, steps: int, out: Path, extra: list[str], name: str | None = None
) -> dict:
    from framework.train import trainer

    base = [
        f"recipe={recipe}",
        f"executor={mode}",
        f"train.steps={steps}",
        f"train.log_every={steps}",
        "train.eval_every=0",
        "run.device=cuda",
        "mesh/hardware=h200",
        "checkpoint=none",  # the default saves at the end: not what is measured
    ]
    # A key in ``extra`` replaces the default here (Hydra refuses a key given twice).
    given = {e.split("=", 1)[0] for e in extra}
    overrides = [o for o in base if o.split("=", 1)[0] not in given] + extra
    cfg = compose_cfg(overrides)
    apply_allocator_environment(cfg.run)  # as train.py does, before the first CUDA allocation
    run_dir = out / (name or f"{recipe}-{mode}")
    run_dir.mkdir(parents=True, exist_ok=True)
    reset()
    resolved = resolve(cfg)  # as the launcher does, once
    cfg, plan = resolved.cfg, resolved.plan
    summary = trainer.run(cfg, plan, run_dir)
    tokens = cfg.train.global_batch_size * cfg.train.seq_len
    # The median step, as for the hand loop (robust to a shared host's hiccups); the mean beside it.
    p50 = summary.step_p50_s
    tps = tokens / p50 if p50 else 0.0
    return {
        # Paths stay out of the label (the data's kind is in it: data=jsonl).
        "what": " ".join([f"framework {mode}", *(e for e in extra if "path=" not in e)]),
        "recipe": recipe,
        "tokens_per_s": tps,
        "tokens_per_s_mean": summary.tokens_per_s,
        "step_ms": 1e3 * p50 if p50 else None,
        "mfu": flops_per_token(cfg.model, cfg.train.seq_len) * tps / (PEAK_TFLOPS * 1e12),
        "peak_gib": summary.peak_mem_gib,
        "predicted_gib": plan.memory.total / 2**30,
        "first_step_s": summary.time_to_first_step_s,
        "compile_s": summary.compile_s,
        "final_loss": summary.final_loss,
        "data_wait_ms": summary.data_wait_ms,
        "data_wait_share": summary.data_wait_share,
    }


def hand_loop(recipe: str, variant: str, steps: int, warmup: int, extra: list[str] | None = None) -> dict:
    """The loop a user would write by hand, timed with CUDA events.

    ``variant``: ``model`` (the strongest simple loop: the whole model compiled as one graph, the
    loss computed inside ``model(tokens, targets)``, fused AdamW, foreach clip); ``eager``;
    ``compile`` (each block compiled, the loss computed from the logits outside, as many
    hand-written loops do); ``compile_head`` (each block and the loss head compiled: the
    framework's default executor without the framework). ``model.float8=tensorwise|rowwise`` in
    ``extra`` converts every Linear but the output head with torchao directly (no framework code,
    no size filter), as a user would. Events are recorded every step and read after one
    synchronize at the end, so the loop keeps the CPU ahead of the GPU as the framework's does.
    """
    cfg = compose_cfg([f"recipe={recipe}", *(extra or [])])
    apply_allocator_environment(cfg.run)
    m, t = cfg.model, cfg.train
    reset()
    device = torch.device("cuda")
    t0 = time.perf_counter()
    model = build_model(dataclasses.replace(m, float8=Float8Recipe.none), t.seq_len)
    if m.float8 is not Float8Recipe.none:
        from torchao.float8 import convert_to_float8_training

        from framework.parallel.float8 import float8_config  # the recipe and model.float8_grad_dtype

        convert_to_float8_training(
            model, config=float8_config(m, False), module_filter_fn=lambda mod, fqn: fqn != "output"
        )
    materialize(model, device, seed=t.seed)
    step_model = model
    if variant == "model":
        step_model = torch.compile(model, fullgraph=True, dynamic=False)
    if variant in ("compile", "compile_head"):
        for block in model.layers.values():
            block.forward = torch.compile(block.forward, fullgraph=True, dynamic=False)
    if variant == "compile_head":
        model.head_loss = torch.compile(model.head_loss, fullgraph=True, dynamic=False)
    opt = torch.optim.AdamW(
        model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay, fused=True
    )
    g = torch.Generator(device="cpu").manual_seed(0)
    batches = [
        torch.randint(0, m.vocab_size, (t.micro_batch_size, t.seq_len + 1), generator=g).to(device)
        for _ in range(4)
    ]
    events = []
    first = None
    for i in range(steps):
        b = batches[i % len(batches)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if variant in ("model", "compile_head"):
                loss = step_model(b[:, :-1], b[:, 1:])
            else:
                loss = loss_fn(model(b[:, :-1]), b[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        end.record()
        if first is None:
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
        events.append((start, end))
    torch.cuda.synchronize()
    times = [s.elapsed_time(e) / 1e3 for s, e in events[warmup:]]
    step_s = statistics.median(times)
    tps = t.micro_batch_size * t.seq_len / step_s
    return {
        "what": f"hand-written {variant}" + (f" {' '.join(extra)}" if extra else ""),
        "recipe": recipe,
        "tokens_per_s": tps,
        "tokens_per_s_mean": t.micro_batch_size * t.seq_len / statistics.mean(times),
        "step_ms": step_s * 1e3,
        "mfu": flops_per_token(m, t.seq_len) * tps / (PEAK_TFLOPS * 1e12),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "predicted_gib": None,
        "first_step_s": first,
        "final_loss": float(loss),
    }


def float8_diagnostics(marks: list[str]) -> None:
    """A diagnostic float8 numerics for the parity question (float8_gpu.sh parity_levers), not a config
    option: ``bench:no_fast_accum`` accumulates the forward float8 GEMM at full precision. The
    gradients' float8 format is the option ``model.float8_grad_dtype``."""
    if "bench:no_fast_accum" not in marks:
        return
    import framework.parallel.float8 as f8

    plain = f8.float8_config

    def patched(m: ModelConfig, fsdp_all_gather: bool):  # noqa: ANN202 - torchao's config
        from torchao.float8.config import Float8GemmConfig

        config = dataclasses.replace(
            plain(m, fsdp_all_gather), gemm_config_output=Float8GemmConfig(use_fast_accum=False)
        )
        print(f"float8 diagnostic no_fast_accum: {config}", flush=True)
        return config

    f8.float8_config = patched


def fmt(rows: list[dict]) -> str:
    head = (
        "| recipe | what | tok/s (p50) | tok/s (mean) | step ms (p50) | MFU (p50) | peak GiB | planned GiB "
        "| first step s | compile s | loss | data wait ms | data wait % |"
    )
    lines = [head, "|" + "---|" * 13]
    for r in rows:

        def f(key: str, spec: str, r: dict = r) -> str:
            v = r.get(key)
            return format(v, spec) if isinstance(v, (int, float)) else "-"

        lines.append(
            f"| {r['recipe']} | {r['what']} | {f('tokens_per_s', ',.0f')} | {f('tokens_per_s_mean', ',.0f')} "
            f"| {f('step_ms', '.1f')} | "
            f"{f('mfu', '.1%')} | {f('peak_gib', '.1f')} | {f('predicted_gib', '.1f')} | "
            f"{f('first_step_s', '.1f')} | {f('compile_s', '.1f')} | {f('final_loss', '.3f')} | "
            f"{f('data_wait_ms', '.2f')} | {f('data_wait_share', '.2%')} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama_125m,llama1b")
    p.add_argument("--modes", default="eager,compile,cudagraphs")
    p.add_argument(
        "--hand",
        default="model",
        help="hand-written loop variants: model,eager,compile,compile_head ('' for none)",
    )
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "outputs/bench")))
    p.add_argument("--extra", default="", help="extra overrides for the framework runs, space-separated")
    p.add_argument(
        "--variants",
        type=Path,
        help="file of runs, one per line: RECIPE MODE [OVERRIDE ...] ('#' comments; MODE is an "
        "executor, or hand:model|hand:eager|hand:compile|hand:compile_head for the hand-written loop); "
        "replaces --models/--modes/--hand. Each line runs in its own process, so one that runs out of "
        "memory leaves nothing behind for the next",
    )
    p.add_argument(
        "--data",
        default="recipe",
        choices=["recipe", "jsonl", "text"],
        help="the framework runs' data: the recipe's own (llama1b: synthetic), or the stdlib's source "
        "as jsonl / text packed on the fly with a BPE trained here",
    )
    p.add_argument("--data-mb", type=float, default=20.0, help="--data: megabytes of documents")
    p.add_argument("--vocab-size", type=int, default=32000, help="--data: the BPE's vocabulary")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one variant line, write --row
    p.add_argument("--row", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_bench.py needs a CUDA device")
    config_mod.register()
    recipes.register()
    register_resolvers()
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    data_overrides: list[str] = []
    if args.data != "recipe" and args.one is None:
        data_overrides = packed_source(args.out / "data", args.data, args.data_mb, args.vocab_size)
    if args.one is not None:  # a child of --variants
        recipe, mode, *extra = args.one.split()
        if "bench:same_stream" in extra:  # diagnostic: the optimiser in backward without its own stream
            import framework.train.loop

            framework.train.loop.OPTIMIZER_SIDE_STREAM = False
        float8_diagnostics([e for e in extra if e.startswith("bench:")])
        extra = [e for e in extra if not e.startswith("bench:")]
        name = f"{args.row.stem}-{recipe}-{mode.replace(':', '_')}"
        if mode.startswith("hand:"):
            row = hand_loop(recipe, mode.removeprefix("hand:"), args.steps, 5, extra)
        else:
            row = framework_run(recipe, mode, args.steps, args.out, extra, name)
        args.row.write_text(json.dumps(row))
        return
    if args.variants:
        lines = [" ".join(ln.split("#")[0].split()) for ln in args.variants.read_text().splitlines()]
        for i, line in enumerate(filter(None, lines)):
            row_file = args.out / f"v{i:02d}.json"
            cmd = [
                sys.executable,
                __file__,
                "--one",
                line if line.split()[1].startswith("hand:") else " ".join([line, *data_overrides]),
                "--row",
                str(row_file),
                "--steps",
                str(args.steps),
            ]
            proc = subprocess.run([*cmd, "--out", str(args.out)], capture_output=True, text=True)
            (args.out / f"v{i:02d}.log").write_text(proc.stdout + proc.stderr)
            if proc.returncode == 0 and row_file.is_file():
                row = json.loads(row_file.read_text())
                marks = [e for e in line.split() if e.startswith("bench:")]
                row["what"] += "".join(f" {m}" for m in marks)
                rows.append(row)
            else:  # a failed variant is a row, not the end of the benchmark
                tail = " ".join(proc.stderr.strip().splitlines()[-1:])[:300]
                recipe, mode, *extra = line.split()
                rows.append({"what": f"framework {mode} {' '.join(extra)} FAILED: {tail}", "recipe": recipe})
            print(fmt(rows[-1:]), flush=True)
        args.models = ""
    for recipe in filter(None, args.models.split(",")):
        for variant in filter(None, args.hand.split(",")):
            rows.append(hand_loop(recipe, variant, args.steps, warmup=5))
            print(fmt(rows[-1:]), flush=True)
        for mode in args.modes.split(","):
            try:
                extra = [*args.extra.split(), *data_overrides]
                rows.append(framework_run(recipe, mode, args.steps, args.out, extra))
            except Exception as e:  # noqa: BLE001 - a failed variant is a row, not the end of the benchmark
                rows.append(
                    {"what": f"framework {mode} FAILED: {type(e).__name__}: {str(e)[:200]}", "recipe": recipe}
                )
            print(fmt(rows[-1:]), flush=True)
    table = fmt(rows)
    (args.out / "bench.json").write_text(json.dumps(rows, indent=2))
    (args.out / "bench.md").write_text(table + "\n")
    print("\n" + table)


if __name__ == "__main__":
    main()
