"""Rank layouts on 4 gloo ranks: the planner's predicted step time against the measured one.

For each layout (dp_replicate x dp_shard x tp), 4 forked gloo ranks build the model through the
real plan -> mesh -> parallelize path and time AdamW steps (the fastest step after warm-up, of the slowest rank: the machine is shared); the planner
predicts the same step with ``mesh/hardware=cpu``. The script also measures what the CPU profile
needs (one process's step for gemm_efficiency; a gloo all-reduce for the link figures) and prints
the values it would set, so conf/mesh/hardware/cpu.yaml can be refitted on another machine.

    python benchmarks/cpu_layouts.py [--steps 6] [--ranks 4]

Numbers depend on the machine's load (the CI machine has 2 cores shared by several users: 4
ranks oversubscribe it); compare rankings within one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from framework.config.schema import Config, HardwareConfig, ModelConfig, ParallelConfig  # noqa: E402
from framework.models import build_model, materialize  # noqa: E402
from framework.models.parts.loss import loss_parallel_scope  # noqa: E402
from framework.parallel import build_mesh, dp_mesh_info, parallelize  # noqa: E402
from framework.planner.resolve import make_plan  # noqa: E402
from tests.dist import run_ranks  # noqa: E402

# Communication-heavy on purpose (15M parameters, 256 tokens per step): the layouts' collectives
# then cost as much as their compute, so their differences stand above the shared machine's noise.
MODEL = ModelConfig(dim=512, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=1536, vocab_size=8192)
SEQ, GLOBAL_BATCH = 32, 8
LAYOUTS = [(4, 1, 1), (1, 4, 1), (2, 2, 1), (1, 2, 2), (2, 1, 2), (1, 1, 4)]  # (dp_replicate, dp_shard, tp)


CPU = HardwareConfig(**OmegaConf.to_container(OmegaConf.load(ROOT / "conf/mesh/hardware/cpu.yaml")))


def make_cfg(r: int, s: int, t: int) -> Config:
    cfg = Config(model=MODEL)
    cfg.mesh.hardware = CPU  # the shipped profile (mesh/hardware=cpu), as train.py composes it
    cfg.mesh.shape = [r * s * t]
    cfg.parallel = ParallelConfig(dp_replicate=r, dp_shard=s, tp=t)
    cfg.sharding.activation_checkpointing = cfg.sharding.activation_checkpointing.none
    cfg.train.seq_len, cfg.train.global_batch_size = SEQ, GLOBAL_BATCH
    cfg.train.micro_batch_size = GLOBAL_BATCH // (r * s)
    return cfg


def _steps(model: torch.nn.Module, dp_rank: int, dp_size: int, steps: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    g = torch.Generator().manual_seed(0)
    n = GLOBAL_BATCH // dp_size
    times = []
    for _ in range(steps):
        batch = torch.randint(0, MODEL.vocab_size, (GLOBAL_BATCH, SEQ + 1), generator=g)
        x = batch[dp_rank * n : (dp_rank + 1) * n]
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        with loss_parallel_scope([model]):  # TP's vocabulary-sharded loss: forward and backward
            model(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
        if dist.is_initialized():
            dist.barrier()
        times.append(time.perf_counter() - t0)
    return times


def _layout_worker(rank: int, world: int, cfg: Config, steps: int) -> float:
    plan = make_plan(cfg)
    mesh = build_mesh(plan, "cpu")
    model = parallelize(
        build_model(cfg.model, SEQ),
        mesh,
        plan,
        cfg.sharding,
        cfg.bucketing,
        cfg.executor,
        torch.device("cpu"),
        0,
    )
    times = _steps(model, *dp_mesh_info(mesh, plan), steps)
    return min(times[1:])  # the least-disturbed step: the machine is shared


def _allreduce_worker(rank: int, world: int) -> tuple[float, float]:
    """(seconds for a 4-byte all-reduce, seconds for a 16 MiB one), medians of 10."""
    out = []
    for numel in (1, 4 * 2**20):
        t = torch.ones(numel)
        times = []
        for _ in range(10):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
    return out[0], out[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)

    single = make_cfg(1, 1, 1)
    single.mesh.shape = [1]
    model = build_model(MODEL, SEQ)
    materialize(model, "cpu", 0)
    t1 = min(_steps(model, 0, 1, args.steps)[1:])
    pred1 = make_plan(single).prediction
    hw = single.mesh.hardware
    fitted_eff = hw.gemm_efficiency * pred1.compute_s / max(t1 - pred1.memory_s - pred1.optimizer_s, 1e-9)
    lat, big = run_ranks(_allreduce_worker, 4)[0]
    alpha = lat / 6  # ring all-reduce: 2(n-1) steps
    busbw = 2 * 3 / 4 * 16 * 2**20 / max(big - 6 * alpha, 1e-9)
    print(f"one process, one step: {t1 * 1e3:.1f} ms (predicted {pred1.step_time_s * 1e3:.1f})")
    print(
        f"fits for cpu.yaml: gemm_efficiency ~{fitted_eff:.2f}; gloo all-reduce on 4 ranks: "
        f"alpha ~{alpha * 1e6:.0f} us, {busbw / 1e9:.2f} GB/s achieved "
        f"(intra_node_gbps x link_efficiency = {hw.intra_node_gbps * hw.link_efficiency:.2f})"
    )

    rows = []
    for r, s, t in LAYOUTS:
        cfg = make_cfg(r, s, t)
        measured = max(run_ranks(_layout_worker, 4, cfg, args.steps, timeout_s=600))  # the slowest rank
        plan = make_plan(cfg)
        rows.append((plan.strategy, f"r{r} s{s} t{t}", measured, plan.prediction))
    by_measured = sorted(rows, key=lambda x: x[2])
    by_predicted = sorted(rows, key=lambda x: x[3].step_time_s)
    print("\n| layout | degrees | measured ms | rank | predicted ms | rank | exposed comm ms |")
    print("|---|---|---|---|---|---|---|")
    for name, deg, measured, pred in rows:
        print(
            f"| {name} | {deg} | {measured * 1e3:.1f} | {by_measured.index((name, deg, measured, pred)) + 1} "
            f"| {pred.step_time_s * 1e3:.1f} | {by_predicted.index((name, deg, measured, pred)) + 1} "
            f"| {pred.exposed_comm_s * 1e3:.1f} |"
        )
    same = [a[1] for a in by_measured] == [b[1] for b in by_predicted]
    pairs = [(i, j) for i in range(len(rows)) for j in range(i + 1, len(rows))]
    agree = sum(
        (rows[i][2] < rows[j][2]) == (rows[i][3].step_time_s < rows[j][3].step_time_s) for i, j in pairs
    )
    print(f"\nranking identical: {same}; pairwise order agrees on {agree} of {len(pairs)} pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
