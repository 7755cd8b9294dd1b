"""Dry-run time and planner-vs-measured parameter bytes for a Llama-3-70B shape at 128 to 8192 ranks.

Run: ``python benchmarks/dry_run_bench.py [--worlds 16x8,128x8,1024x8]``. Target: <= 15 s at 1024
ranks. Not a test: it takes tens of seconds. Hardware figures are H100-class (80 GiB, NVLink
~450 GB/s one direction, 400 Gb/s InfiniBand = 50 GB/s per GPU); they only feed the estimates.
"""

from __future__ import annotations

import argparse

from framework.config import ActivationCheckpointing, Config, HardwareConfig, ModelConfig, Strategy
from framework.dry_run import dry_run, format_dry_run
from framework.plan import GIB, format_plan

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", default="16x8,128x8,1024x8")
    ap.add_argument("--plan", action="store_true", help="also print the full plan table")
    args = ap.parse_args()
    rows = []
    for spec in args.worlds.split(","):
        nodes, procs = (int(x) for x in spec.split("x"))
        report = dry_run(bench_config(nodes, procs))
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
