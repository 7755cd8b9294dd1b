"""The ``mesh``, ``parallel``, ``sharding``, ``bucketing`` and ``nccl`` groups' rules. The degrees and their
combinations are the planner's (framework.planner.layout, stages, topology): those keys name it.
"""

from __future__ import annotations

import math
from typing import Any

from framework.config.rules.rule import (
    MAX_RATE_GBPS,
    MAX_TIMEOUT_S,
    TYPED,
    Rule,
    integer,
    is_int,
    name,
    number,
    optional_path,
)


def _capability_ok(v: Any) -> bool:
    """Empty, or a CUDA compute capability: major >= 1, minor 0-9 (8.9, 9.0, 10.0, 12.0 ...)."""
    if len(v) == 0:
        return True
    return len(v) == 2 and all(is_int(x) for x in v) and 1 <= v[0] <= 99 and 0 <= v[1] <= 9


PARALLEL_RULES: dict[str, Rule] = {
    # mesh
    "mesh.shape": Rule(
        "a list of positive integers, e.g. [8] or [2, 4]",
        checked_by="framework.planner.topology.validate_mesh (ranks vs cores: framework.launch.ranks)",
        bad=([0], [], [2, -1], [100_000], [99_999_999_999], [2**11, 2**10]),
        context=(("run.device", "cpu"),),
    ),
    "mesh.hardware.name": name("a non-empty name ('cpu' or a conf/mesh/hardware option)"),
    # A device's figures (GiB, TFLOP/s, GB/s, microseconds), each bounded at about 1000 times the
    # largest shipped one (B200: 180 GiB, 4500 TFLOP/s, 8000 GB/s): beyond, the planner's times round to 0.
    "mesh.hardware.memory_gib": number(0, 2**18, lo_open=True),
    "mesh.hardware.peak_tflops": number(0, 1e7, lo_open=True),
    "mesh.hardware.intra_node_gbps": number(0, MAX_RATE_GBPS, lo_open=True),
    "mesh.hardware.inter_node_gbps": number(0, MAX_RATE_GBPS, lo_open=True),
    "mesh.hardware.intra_node_latency_us": number(0, 1e6),
    "mesh.hardware.inter_node_latency_us": number(0, 1e6),
    "mesh.hardware.numa_per_host": integer(1, 1024),
    "mesh.hardware.gemm_efficiency": number(0, 1, lo_open=True),
    "mesh.hardware.hbm_gbps": number(0, MAX_RATE_GBPS, lo_open=True),
    "mesh.hardware.host_link_gbps": number(0, MAX_RATE_GBPS, lo_open=True),
    "mesh.hardware.link_efficiency": number(0, 1, lo_open=True),
    "mesh.hardware.comm_overlap": number(0, 1),
    "mesh.hardware.inter_node_comm_overlap": number(0, 1),
    "mesh.hardware.kernel_table": Rule(
        "null or the name of a measured table, conf/mesh/hardware/tables/NAME.json (benchmarks/kernel_tables.py)",
        checked_by="framework.planner.kernels.load_table (via the planner: every entry a finite rate above 0)",
        bad=("nosuch", "../h100_sxm"),
    ),
    "mesh.hardware.compute_capability": Rule(
        "[] (no CUDA GPU) or [major, minor] of a CUDA GPU, e.g. [9, 0] for Hopper, [8, 0] for A100",
        lambda v, _c: _capability_ok(v),
        ([9], [9, 0, 1], [0, 0], [9, 10]),
    ),
    # parallel: the degrees (framework.planner.layout)
    **{
        f"parallel.{n}": Rule(
            "0 (unset), -1 (the rest) or a degree >= 1; the degrees multiply to the world size "
            "(pp: at most model.n_layers; cp: 2 x cp divides train.seq_len, on CUDA or in a dry run)",
            checked_by="framework.planner.layout.from_parallel / check_degrees / check_cp (via the planner)",
            bad=(-2, 3),
        )
        for n in ("dp_replicate", "dp_shard", "cp", "tp", "pp")
    },
    "parallel.loss_parallel": TYPED,
    # The combinations (eager, a CPU launch) are the planner's: framework.planner.plan._check_async_tp.
    "parallel.async_tp": TYPED,
    "parallel.ep": Rule(
        "0 or 1 (off), or an expert-parallel degree >= 2 that divides parallel.dp_shard (the ep ranks "
        "are borrowed from it) and model.moe.num_experts, with a sparse family and parallel.cp=1",
        checked_by="framework.planner.layout.from_parallel / check_ep (via the planner), check_dense_ep (check_layout)",
        bad=(-1, 3),
        context=(("mesh.shape", [2]),),
    ),
    # the pipeline (framework.planner.stages): bad values are refused under a 2-stage pipeline; any of the
    # three set where no pipeline runs (a layout with pp=1, one process) by check_without_pipeline
    "parallel.pp_schedule": TYPED,
    "parallel.pp_microbatches": Rule(
        "0 (= the rank's batch / train.micro_batch_size, or parallel.pp) or an integer >= parallel.pp "
        "that divides the data-parallel rank's batch",
        checked_by="framework.planner.stages.check_pipeline (via the planner), check_without_pipeline (entry)",
        bad=(-1, 1, 3),
        context=(("mesh.shape", [2]), ("parallel.pp", 2), ("model.tie_embeddings", False)),
    ),
    "parallel.pp_stages_per_rank": Rule(
        "an integer >= 1: 1 for gpipe / 1f1b, >= 2 for interleaved_1f1b / interleaved_zb, 2 for zbv; "
        "parallel.pp x it <= model.n_layers",
        checked_by="framework.planner.stages.check_pipeline (via the planner)",
        bad=(0, 2),
        context=(("mesh.shape", [2]), ("parallel.pp", 2), ("model.tie_embeddings", False)),
    ),
    # sharding
    "sharding.strategy": TYPED,
    "sharding.tp": Rule(
        "an integer >= 1 that divides the world size, model.n_heads, n_kv_heads and ffn_dim",
        checked_by="framework.planner.plan (layout and TP degree)",
        bad=(0, 3),
        context=(("sharding.strategy", "fsdp_tp"),),
    ),
    "sharding.reshard_after_forward": TYPED,
    "sharding.param_dtype": TYPED,
    "sharding.reduce_dtype": TYPED,
    "sharding.activation_checkpointing": TYPED,  # budget needs a compiled executor: framework.planner.plan
    "sharding.activation_memory_budget": Rule(
        "0.0 to 1.0, a fraction of the compiled default's saved activations",
        checked_by="framework.planner.plan (with activation_checkpointing=budget; else a warning)",
        bad=(-0.1, 1.5, math.nan),
        context=(("sharding.activation_checkpointing", "budget"), ("executor.mode", "compile")),
    ),
    # the host memory the saved activations need: framework.launch.ranks.check_offload_memory
    "sharding.activation_offload": TYPED,
    # bucketing
    "bucketing.bucket_cap_mb": number(0, 2**20, lo_open=True),
    "bucketing.gradient_as_bucket_view": TYPED,
    "bucketing.static_graph": TYPED,
    "bucketing.auto": TYPED,
    # nccl: the variables themselves are checked against NCCL's table in framework.planner.topology
    "nccl.preset": name(),
    "nccl.preset_env": Rule(
        "NCCL variables NCCL accepts",
        checked_by="framework.planner.topology.nccl_environment",
        bad=({"NCCL_DEBUG": "LOUD"},),
    ),  # fmt: skip
    "nccl.env": Rule(
        "NCCL variables NCCL accepts",
        checked_by="framework.planner.topology.nccl_environment",
        bad=({"NCCL_ALGO": "Bogus"},),
    ),  # fmt: skip
    "nccl.topo_file": Rule(
        "an NCCL topology XML file",
        checked_by="framework.planner.topology.nccl_environment",
        bad=("/nonexistent/topo.xml",),
    ),  # fmt: skip
    "nccl.topo_dump_file": optional_path("relative paths land in the run dir"),
    "nccl.socket_ifname": optional_path("interface prefixes, ^exclude or =exact"),
    "nccl.require_socket_ifname": TYPED,
    "nccl.timeout_s": number(
        0, MAX_TIMEOUT_S, lo_open=True, what="a week at most", bad=(0.0, -1.0, math.nan, math.inf, 1e300)
    ),
    "nccl.async_error_handling": Rule(
        "0, 1, 2 or 3 (TORCH_NCCL_ASYNC_ERROR_HANDLING)",
        checked_by="framework.planner.topology.nccl_environment",
        bad=(-1, 4),
    ),  # fmt: skip
}
