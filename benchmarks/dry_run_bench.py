"""Dry-run time and planner-vs-measured parameter bytes for a Llama-3-70B shape at 128 to 8192 ranks.

Run: ``python benchmarks/dry_run_bench.py [--worlds 16x8,128x8,1024x8]``. Target: <= 15 s at 1024
ranks. ``--recipe llama3_405b mesh=2048x8 mesh/hardware=h100_sxm sharding=auto`` times a shipped
recipe's search and the dry run of its choice (targets: <= 60 s together, <= 30 s the dry run). Not a test: it takes tens of seconds. Hardware figures are H100-class (80 GiB, NVLink
~450 GB/s one direction, 400 Gb/s InfiniBand = 50 GB/s per GPU); they only feed the estimates.
"""

from __future__ import annotations

import argparse
import time

from framework.config.schema import ActivationCheckpointing, Config, HardwareConfig, ModelConfig, Strategy
from framework.launch.dry_run import dry_run, format_dry_run
from framework.planner.params import GIB
from framework.planner.report import format_plan
from framework.planner.resolve import resolve

LLAMA70B = ModelConfig(
    name="llama70b",
    dim=8192,
    n_layers=80,
    n_heads=64,
    n_kv_heads=8,
    ffn_dim=28672,
    vocab_size=128256,
    rope_theta=500000,
    tie_embeddings=False,
)
H100 = HardwareConfig(
    name="h100",
    memory_gib=80.0,
    peak_tflops=989.0,
    intra_node_gbps=450.0,
    inter_node_gbps=50.0,
    intra_node_latency_us=5.0,
    inter_node_latency_us=15.0,
    numa_per_host=2,
)


def bench_config(nodes: int, procs: int) -> Config:
    cfg = Config(model=LLAMA70B)
    cfg.mesh.shape = [nodes, procs]
    cfg.mesh.hardware = H100
    cfg.sharding.strategy = Strategy.fsdp_tp
    cfg.sharding.tp = 8
    cfg.sharding.activation_checkpointing = ActivationCheckpointing.full
    cfg.train.seq_len = 8192
    cfg.train.micro_batch_size = 1
    cfg.train.global_batch_size = nodes  # dp degree = nodes (tp=8 fills a node): one sequence per dp rank
    return cfg


def bench_recipe(recipe: str, overrides: list[str]) -> None:
    """A shipped recipe as ``train.py recipe=NAME OVERRIDES run.dry_run=true`` plans it: the search
    (when the layout is left to it) and the fake-backend dry run of the chosen layout, timed apart."""
    from framework.launch.recipes import compose_recipe
    from framework.planner.search import format_search

    cfg = compose_recipe(recipe, [*overrides, "run.dry_run=true"])
    start = time.perf_counter()
    resolved = resolve(cfg)  # the search (when the layout is left to it) and the chosen layout's plan
    search_s = time.perf_counter() - start
    if resolved.search is not None:
        print(format_search(resolved.search))
    report = dry_run(resolved.cfg, resolved.plan)
    print(format_dry_run(report))
    exact = report.measured_param_bytes == report.estimated_param_bytes
    print(
        f"\n{recipe} {' '.join(overrides)}: resolve (search + plan) {search_s:.2f} s + dry run "
        f"{report.wall_s:.2f} s = "
        f"{search_s + report.wall_s:.2f} s; params per rank measured == estimated: {exact}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", default="16x8,128x8,1024x8")
    ap.add_argument("--plan", action="store_true", help="also print the full plan table")
    ap.add_argument("--recipe", help="time a shipped recipe instead (search + dry run), e.g. llama3_405b")
    ap.add_argument("overrides", nargs="*", help="with --recipe: overrides, e.g. mesh=2048x8 sharding=auto")
    args = ap.parse_args()
    if args.recipe:
        bench_recipe(args.recipe, args.overrides)
        return
    rows = []
    for spec in args.worlds.split(","):
        nodes, procs = (int(x) for x in spec.split("x"))
        resolved = resolve(bench_config(nodes, procs))
        report = dry_run(resolved.cfg, resolved.plan)
        print(format_dry_run(report))
        if args.plan:
            print(format_plan(report.plan))
        rows.append((spec, report))
    print(
        f"\n{'mesh':>8} {'ranks':>6} {'time s':>7} {'estimate GiB':>13} {'measured GiB':>13} {'rel err':>9}"
    )
    for spec, r in rows:
        print(
            f"{spec:>8} {r.plan.world_size:>6} {r.wall_s:>7.2f} {r.estimated_param_bytes / GIB:>13.4f} "
            f"{r.measured_param_bytes / GIB:>13.4f} {r.rel_error:>9.2e}"
        )


if __name__ == "__main__":
    main()
