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


@dataclass(frozen=True)
class Window:
    """What the compute stream gives FSDP's and DDP's collectives to hide behind, in seconds of one
    step on one rank: its forward work (GEMMs, attention, memory-bound kernels) and its backward
    work (recomputed forwards included) over ``micro_batches`` micro batches, and the share of a
    collective each link class may hide (``mesh.hardware.comm_overlap`` over the node's own links,
    ``inter_node_comm_overlap`` over the network)."""

    forward_s: float
    backward_s: float
    micro_batches: int
    intra_overlap: float
    inter_overlap: float
    # A pipeline's idle time before its first forward (fill) and after its last backward (drain):
    # the step's first gathers and last gradient collectives run in it.
    bubble_s: float = 0.0

    def share(self, c: CommEstimate) -> float:
        return self.intra_overlap if c.link == "intra" else self.inter_overlap


def _left(c: float, w: float, share: float) -> float:
    """What of ``c`` seconds of communication a window of ``w`` seconds leaves exposed when the link
    hides ``share`` of it: never less than what the window cannot cover."""
    return max(c * (1.0 - share), c - w)


def exposed_comm(
    comm: list[CommEstimate], units: int, window: Window, link_efficiency: float, pp_hops: int
) -> tuple[float, float]:
    """(all communication, what the compute does not hide), in seconds at the achieved link speed, by
    mechanism:

    - **blocking** (TP's collectives, each with ``_TP_DISPATCH_S``; CP's K/V passes; EP's
      all-to-alls; ``_BLOCKING_COLLECTIVES``): in full; under async TP (``_ASYNC_TP``) less
      ``ASYNC_TP_HIDDEN`` of the link time.
    - **pipeline sends** (``send_recv``): the steady state's overlap the other micro batches; the
      ``pp_hops`` of the fill and the drain are exposed.
    - **FSDP's all-gathers, prefetched**: each pass over the ``units`` gathers unit i + 1 while unit
      i computes, so a pass exposes its first unit's gather and, of every other, what that unit's
      share of the pass's compute (``window``) does not cover. A pass is a micro batch's forward and,
      resharded after forward, its backward (held for the step: one forward pass, framework.planner.
      stages.held_for_step).
    - **gradient collectives** (FSDP's reduce-scatters, HSDP's and DDP's all-reduces) run in the
      step's last backward, unit by unit behind the next unit's backward (sharing its window with that
      pass's prefetched gather); the last unit's is exposed. Under a pipeline the first forward's
      gathers also hide in the schedule's fill and the last backward's collectives in its drain.

    Of what a window covers, a link hides its ``Window.share``: 0 leaves every FSDP / DDP collective
    on the critical path."""
    blocking = 0.0
    gathers: list[tuple[CommEstimate, float]] = []
    grads: list[tuple[CommEstimate, float]] = []
    for c in comm:
        t = c.time_s / link_efficiency
        if c.collective in _ASYNC_TP:  # fused with its matmul: a share of it hidden
            blocking += t * (1.0 - ASYNC_TP_HIDDEN) + c.calls * _TP_DISPATCH_S
        elif c.axis in _BLOCKING_AXES or c.collective in _BLOCKING_COLLECTIVES:
            blocking += t + (c.calls * _TP_DISPATCH_S if c.axis == "tp" else 0.0)
        elif c.axis == "pp":  # send_recv: the steady state's sends overlap the other micro batches
            blocking += min(t, t / max(c.calls, 1) * pp_hops)
        elif c.axis in _FSDP_AXES and c.collective == "all_gather":
            gathers.append((c, t))
        else:
            grads.append((c, t))
    total = sum(c.time_s for c in comm) / link_efficiency
    return total, blocking + _prefetched(gathers, grads, units, window)


def _prefetched(
    gathers: list[tuple[CommEstimate, float]],
    grads: list[tuple[CommEstimate, float]],
    units: int,
    window: Window,
) -> float:
    """FSDP's and DDP's exposed seconds (``exposed_comm``'s last two mechanisms)."""
    if not gathers and not grads:
        return 0.0
    m = max(1, window.micro_batches)
    forward, backward = window.forward_s / m / units, window.backward_s / m / units
    edge = window.bubble_s / 2 / units  # a unit's share of the fill, and of the drain
    exposed = 0.0
    # Per unit of a backward pass: the gathers' seconds and what of them the links may hide.
    ag_backward = hide_backward = 0.0
    backward_passes = 0.0
    for c, t in gathers:
        passes = c.calls / units
        forward_passes = passes if passes <= 1 else passes / 2  # held: one forward gather a step
        per = t / max(c.calls, 1)
        if passes > forward_passes:
            ag_backward += per
            hide_backward += per * window.share(c)
            backward_passes = max(backward_passes, passes - forward_passes)
        # the first forward pass also has the fill to hide in
        first = per + (units - 1) * _left(per, forward + edge, window.share(c))
        exposed += first + (forward_passes - 1) * (per + (units - 1) * _left(per, forward, window.share(c)))
    # Backward passes before the last: the next unit's gather behind this unit's backward.
    if ag_backward:
        share = hide_backward / ag_backward
        exposed += (backward_passes - 1) * (ag_backward + (units - 1) * _left(ag_backward, backward, share))
    # The last backward: the gather (if resharded) and this unit's gradient collectives.
    g = sum(t for _, t in grads) / units
    hide_g = sum(t * window.share(c) for c, t in grads) / units
    per_unit = ag_backward + g
    if per_unit:
        share = (hide_backward + hide_g) / per_unit
        exposed += ag_backward + (units - 1) * _left(per_unit, backward + edge, share) + g
    return exposed
