"""What of each collective the step waits for: the communication a schedule hides behind which compute.

Each ``CommEstimate`` (priced by framework.planner.comm with the alpha-beta model) is exposed here
by its mechanism; see ``exposed_comm``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CommEstimate:
    """One collective per step on one mesh axis, costed with the alpha-beta model."""

    axis: str
    collective: str
    group_size: int
    link: str  # "intra" or "inter" node
    calls: int
    bytes_per_call: int  # payload (the full tensor the collective works on)
    volume_bytes: int  # bytes each rank sends per step: ring factor x payload x calls
    time_s: float


# Collectives on the critical path: TP's, CP's K/V passes (torch's default rotation
# all-gathers K and V before the attention that needs them), and expert parallelism's all-to-alls
# (the experts wait for their rows; framework.parallel.expert runs them on the compute stream).
_BLOCKING_AXES = ("tp", "cp", "ep")
# FSDP's mesh axes (framework.planner.comm.step_comm names the flattened dp_shard x cp group dp_shard_cp,
# and the group an expert stack is sharded over under ep dp_shard_mod_ep).
_FSDP_AXES = ("dp_shard", "dp_shard_cp", "dp_shard_mod_ep")
# Each TP collective costs this much beyond its alpha-beta time: DTensor's redistribution, the
# sequence-parallel layout changes around it and the stream sync of a blocking collective. Fitted to
# the one TP run measured (benchmarks/PERF.md, multi-GPU: llama1b tp=2 on 2 H200s, micro 4,
# 224.4 ms measured against 156.8 ms predicted without it, 256 TP collectives a step: 0.26 ms each).
_TP_DISPATCH_S = 0.26e-3
# parallel.async_tp: TP's all-gathers and reduce-scatters fused with their matmuls (Inductor's
# micro-pipeline TP pass) hide this share of their time. Fitted, not derived: torchtitan's async-TP
# file (benchmarks/published_sources.py, torchtitan 2025-06) measured the bf16 8B (TP 8, 64 GPUs) at
# 4,378 -> 4,809 and the 70B (TP 8, 256 GPUs) at 597.3 -> 652 tokens/s a GPU with async TP on; at
# this share the planner's vanilla-to-async gain matches both (its float8 pairs are the check:
# benchmarks/PERF.md). One source: a fit, left out with that source (published_sources.py --loso).
ASYNC_TP_HIDDEN = 0.26
_ASYNC_TP = ("all_gather_matmul", "matmul_reduce_scatter")
# A pipeline's tied embedding: its gradient is reduced after backward and its weight sent back after
# the optimizer step, with no compute left to hide behind (framework.planner.pipeline.tied_weight_comm). An MoE
# model's load-balancing all-reduce and its backward: the loss waits on the sums (funcol.wait_tensor
# right after the all-reduce, framework.models.moe), and the routers' gradients on the backward's. The
# sigmoid routers' bias update: a blocking dist.all_reduce per layer in the optimizer step's post-hook,
# after the update, with no compute of the step left to hide it; the next forward reads the biases.
_BLOCKING_COLLECTIVES = (
    "tied_reduce",
    "tied_broadcast",
    "aux_all_reduce",
    "aux_all_reduce_backward",
    "bias_all_reduce",
)


def exposed_comm(
    comm: list[CommEstimate], units: int, window: float, link_efficiency: float, overlap: float, pp_hops: int
) -> tuple[float, float]:
    """(all communication, what the compute ``window`` does not hide), in seconds at the achieved link
    speed (see the module docstring): blocking collectives in full; of FSDP's, one unit's all-gather
    per pass and the step's last reduce-scatter / all-reduce, then the rest at ``overlap`` and never
    hidden beyond the window; of the pipeline's sends, the ``pp_hops`` of its fill and drain."""
    blocking = first = rest = 0.0
    for c in comm:
        t = c.time_s / link_efficiency
        per_call = t / max(c.calls, 1)
        if c.collective in _ASYNC_TP:  # fused with its matmul: a share of it hidden
            blocking += t * (1.0 - ASYNC_TP_HIDDEN) + c.calls * _TP_DISPATCH_S
        elif c.axis in _BLOCKING_AXES or c.collective in _BLOCKING_COLLECTIVES:
            blocking += t + (c.calls * _TP_DISPATCH_S if c.axis == "tp" else 0.0)
        elif c.axis == "pp":  # send_recv: the steady state's sends overlap the other micro batches
            blocking += min(t, per_call * pp_hops)
        else:
            passes = c.calls / units if c.axis in _FSDP_AXES and c.collective == "all_gather" else 1.0
            head = min(t, per_call * passes)
            first += head
            rest += t - head
    hidden_left = max(rest * (1.0 - overlap), rest - window)
    total = sum(c.time_s for c in comm) / link_efficiency
    return total, blocking + first + hidden_left
