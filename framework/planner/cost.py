"""Predicted step time of one layout: compute at a calibrated efficiency, memory-bound work, and the
communication that compute does not hide.

Why a model and not a measurement: ``sharding=auto`` ranks hundreds of layouts for clusters that
are not here, before anything runs. Each term is simple and each constant is measured (the sources
are named next to them; the hardware figures live in ``conf/mesh/hardware/*.yaml``):

- **compute**: the model's flops (``framework.models.flops_per_token``: 6N + 12·L·H·Q·T, plus the
  forward recomputed by activation checkpointing) at ``gemm_efficiency`` x ``peak_tflops``, scaled by
  the GEMMs' wave quantization on the device's SMs (``gemm_shape_efficiency``: a GEMM whose output
  tiles leave the last wave of SMs part idle runs below the rate the 1B profile measured). TP splits
  the flops of every rank's tokens by its degree; CP gives each rank 1/cp of the tokens.
- **memory-bound work** at ``hbm_gbps``: the pointwise kernels of each block (norms, RoPE, SwiGLU,
  residual adds; ``_POINTWISE_BYTES`` per element of a block's width per token), the loss head's
  pass over the logits (``_LOGIT_BYTES`` per logit), the bf16 weight casts once per micro batch, the
  gradient accumulation, and the AdamW step over this rank's parameters (``_ADAMW_BYTES``).
  Eager runs the pointwise work unfused (``_EAGER_POINTWISE``); so does an eager loss head over the
  logits under compiled blocks (``executor.compile_loss=false``).
- **float8** (``model.float8``): the converted Linear layers' GEMMs run ``_FLOAT8_GEMM_SPEEDUP``
  times faster, and their per-GEMM casts (amax, scale, cast of every operand) are memory-bound work;
  so do an MoE family's converted expert GEMMs (rowwise under either recipe), whose weight casts
  cover every local expert's weights each micro batch.
- **communication**: the planner's alpha-beta collectives at ``link_efficiency`` of the link speed,
  exposed by mechanism (framework.planner.overlap.exposed_comm): TP's collectives (each also pays
  ``_TP_DISPATCH_S``; under ``parallel.async_tp`` a share hidden by the fused matmuls), CP's K/V
  passes, EP's all-to-alls, a pipeline's tied-embedding transfers and an MoE model's router
  all-reduces sit on the critical path; FSDP's all-gathers are prefetched one unit ahead, so each
  pass exposes its first unit's gather and what of every other the unit's compute does not cover;
  the gradient collectives (FSDP's reduce-scatters, HSDP's and DDP's all-reduces) run behind the
  last micro batch's backward, the last unit's exposed. Of what the compute covers, a link hides
  ``comm_overlap`` (NVLink) or ``inter_node_comm_overlap`` (the network). A pipeline's
  stage-to-stage sends overlap the steady state; those of the fill and the drain (2 (pp v - 1) of
  them) are on the critical path.

How well it predicts the GPU runs of benchmarks/PERF.md is the table of ``benchmarks/cost_check.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from framework.config.schema import ActivationCheckpointing, Config, ExecutorMode
from framework.kernels.float8 import EXPERTS_RECIPE
from framework.models import flops_per_token
from framework.planner.compute import ComputeTerms, table_compute
from framework.planner.confidence import describe, step_range, term_sources
from framework.planner.kernels import load_table
from framework.planner.layout import loss_head_compiled, loss_parallel_on
from framework.planner.overlap import CommEstimate, Window, exposed_comm
from framework.planner.work import (
    _FAST_ACCUM_BACKWARD_SPEEDUP,
    _FLOAT8_EXPERT_CAST_SLOWDOWN,
    _FLOAT8_GEMM_SPEEDUP,
    Float8Terms,
    _expert_flops_per_token,
    _float8_terms,
    _recompute_flops_per_token,
    adamw_state_bytes,
    adamw_step_bytes,
    bf16_moments,
    gemm_shape_efficiency,
    recompute_fraction,
    trained_share,
)

if TYPE_CHECKING:
    from framework.planner.layout import Degrees

# What other modules import from here (the split into work.py and overlap.py kept the names).
__all__ = [
    "CommEstimate",
    "StepPrediction",
    "adamw_state_bytes",
    "adamw_step_bytes",
    "bf16_moments",
    "exposed_comm",
    "gemm_shape_efficiency",
    "predict_step",
    "recompute_fraction",
]

# Fitted to the one-H200 profile of llama1b (b16 compile, 476 ms step: GEMMs 345 ms + attention
# 55 ms = 400 ms of compute -> gemm_efficiency 0.68 in h200.yaml; Inductor's pointwise kernels 66 ms;
# fused AdamW 10 ms; benchmarks/PERF.md, "Where the code's constants and choices come from"): the
# pointwise kernels less the loss head's and the
# weight casts' share, over tokens x layers x (2 dim + ffn_dim) elements, is 40 bytes per element
# at the H200's 4.8 TB/s.
_POINTWISE_BYTES = 40.0
# The loss head reads and writes each logit about six times in bf16 (logits, log-softmax forward,
# its gradient, the output projection's backward input): 12 bytes per logit.
_LOGIT_BYTES = 12.0
# Autocast casts each fp32 weight to bf16 once per forward (read 4, write 2).
_CAST_BYTES = 6.0
# Accumulating a micro batch's fp32 gradient into the previous ones: read both, write one.
_ACCUM_BYTES = 12.0
# Eager runs each pointwise op as its own kernel: the eager loop spent 3.4x (1B) and 4.8x (125M)
# the compiled loop's pointwise time (benchmarks/PERF.md, same section); we take 4.
_EAGER_POINTWISE = 4.0


@dataclass(frozen=True)
class StepPrediction:
    """Seconds per optimizer step on one rank, by term, and what that means for throughput."""

    compute_s: float  # GEMMs and attention, recompute included
    memory_s: float  # pointwise, loss head, casts, gradient accumulation
    optimizer_s: float
    comm_s: float  # all communication at the achieved link speed
    exposed_comm_s: float  # what compute does not hide
    step_time_s: float
    tokens_per_s: float  # whole job
    mfu: float  # 6N + 12LHQT flops per token (no recompute) over world x peak
    bubble_s: float = 0.0  # pipeline: the busiest rank's idle time in the schedule's fill and drain
    # Of compute_s, where a kernel table priced it (framework.planner.compute): the Linear GEMMs, the
    # experts' grouped GEMMs, attention; all 0 where mesh.hardware.gemm_efficiency did.
    gemm_s: float = 0.0
    grouped_s: float = 0.0
    attention_s: float = 0.0
    compute_source: str = "gemm_efficiency"  # or "kernel_table NAME (kernel for attention)"
    # How sure (framework.planner.confidence): the step's range, each term moved by the spread of
    # what it rests on, and one line naming each term's kind (measured, counted, fitted) and source.
    low_s: float = 0.0
    high_s: float = 0.0
    sources: str = ""
    # sharding.activation_offload: the saved activations' copies to host memory and back, on the
    # compute stream (torch's saved-tensor hooks copy where they are called), so not hidden
    offload_s: float = 0.0

    @property
    def predicted_step_time_s(self) -> float:
        return self.step_time_s


def predict_step(
    cfg: Config,
    d: Degrees,
    comm: list[CommEstimate],
    accum: int,
    unit_bytes: list[int],
    pipeline: tuple[float, float] | None = None,
    local_params: int | None = None,
    offload_bytes: int = 0,
) -> StepPrediction:
    """Predicted time of one optimizer step for layout ``d`` (``cfg`` has its micro batch and AC mode).

    ``pipeline`` (pp > 1): (the busiest rank's share of the model's cost, the schedule's bubble as a
    fraction of that rank's compute; framework.planner.stages). The rank computes its share of the model's
    work and then idles for the bubble; ``unit_bytes`` and ``comm`` are that rank's already. The
    point-to-point sends between stages are on the critical path (like TP's collectives).
    ``local_params``: the elements of this rank's parameter shards (the optimizer's and the gradient
    accumulation's work); by default the unsharded units over dp_shard x cp, which under ep misses
    that the experts are sharded over fewer ranks. ``offload_bytes``: the saved activations of one
    micro batch that ``sharding.activation_offload`` moves to host memory (and back in backward).
    """
    hw, m = cfg.mesh.hardware, cfg.model
    hbm = hw.hbm_gbps * 1e9
    # Per rank: its data-parallel share, and of that its sequence shard under CP (load-balanced, so
    # each CP rank also does 1/cp of the causal attention).
    tokens = cfg.train.global_batch_size * cfg.train.seq_len / d.dp / d.cp
    recompute = recompute_fraction(cfg)
    f8 = _float8_terms(cfg, recompute)
    compute_s, terms = _compute_s(cfg, d, tokens, recompute, f8, accum)
    b = _memory_bytes(cfg, d, tokens, recompute, f8, accum, unit_bytes, local_params)
    pointwise, logits, casts, accumulate, f8_casts = b.pointwise, b.logits, b.casts, b.accumulate, b.f8_casts
    memory_s = (pointwise + logits + casts + accumulate + f8_casts) / hbm
    optimizer_s = b.trained * adamw_step_bytes(cfg) / hbm
    bubble_s = 0.0
    if pipeline is not None:
        fraction, bubble = pipeline
        # casts and accumulation above already count only this rank's parameters (unit_bytes)
        compute_s *= fraction
        memory_s = ((pointwise + logits + f8_casts) * fraction + casts + accumulate) / hbm
        bubble_s = (compute_s + memory_s) * bubble

    offload_s = 2 * accum * offload_bytes / (hw.host_link_gbps * 1e9)
    if pipeline is not None:
        offload_s *= pipeline[0]
    # The compute stream's forward and backward work (a recomputed forward runs in backward: forward
    # 2 FLOPs a weight and token, backward 4, a recompute 2 more per share recomputed).
    work = compute_s + memory_s
    window = Window(
        work / (3.0 + recompute),
        work * (2.0 + recompute) / (3.0 + recompute),
        accum,
        hw.comm_overlap,
        hw.inter_node_comm_overlap,
        bubble_s,
    )
    hops = 2 * (d.pp * cfg.parallel.pp_stages_per_rank - 1) if d.pp > 1 else 0
    total, exposed = exposed_comm(comm, max(1, len(unit_bytes)), window, hw.link_efficiency, hops)
    step = compute_s + memory_s + optimizer_s + exposed + bubble_s + offload_s
    parts = {"compute": compute_s, "memory": memory_s, "optimizer": optimizer_s, "comm": exposed,
             "bubble": bubble_s, "offload": offload_s}  # fmt: skip
    origin = term_sources(cfg)
    low, high = step_range(parts, origin)
    job_tokens = cfg.train.global_batch_size * cfg.train.seq_len
    mfu = flops_per_token(m, cfg.train.seq_len) * job_tokens / (step * hw.peak_tflops * 1e12 * d.world_size)
    return StepPrediction(
        compute_s=compute_s,
        memory_s=memory_s,
        optimizer_s=optimizer_s,
        comm_s=total,
        exposed_comm_s=exposed,
        step_time_s=step,
        tokens_per_s=job_tokens / step,
        mfu=mfu,
        bubble_s=bubble_s,
        offload_s=offload_s,
        low_s=low,
        high_s=high,
        sources=describe(origin, parts),
        **(_terms(terms, hw.kernel_table, pipeline[0] if pipeline is not None else 1.0) if terms else {}),
    )


def _compute_s(
    cfg: Config, d: Degrees, tokens: float, recompute: float, f8: Float8Terms, accum: int
) -> tuple[float, ComputeTerms | None]:
    """One step's compute on a rank: from the profile's kernel table when it names one, else its
    FLOPs at the fitted GEMM efficiency (the experts whole on every TP rank, float8 at its speedups)."""
    hw, m = cfg.mesh.hardware, cfg.model
    speedup = _FLOAT8_GEMM_SPEEDUP.get(m.float8, 1.0)
    expert_speedup = _FLOAT8_GEMM_SPEEDUP[EXPERTS_RECIPE]
    backward = _FAST_ACCUM_BACKWARD_SPEEDUP if m.float8_fast_accum else 1.0
    if hw.kernel_table:
        terms = table_compute(cfg, d, load_table(hw.kernel_table), accum, recompute, backward, expert_speedup)
        return terms.total_s, terms
    peak = hw.peak_tflops * 1e12 * hw.gemm_efficiency * gemm_shape_efficiency(cfg, d)
    flops = flops_per_token(m, cfg.train.seq_len) + recompute * _recompute_flops_per_token(cfg)
    linear = f8.linear_flops * (1 / 3 + 2 / 3 / backward) / speedup
    f8_flops = linear - f8.expert_flops + f8.expert_flops / expert_speedup
    # The MoE sublayer runs whole on every TP rank (framework.parallel.tensor.block_plan): TP divides
    # the rest of the work, never the experts'.
    experts = f8.expert_flops / expert_speedup if f8.expert_flops else _expert_flops_per_token(cfg, recompute)
    dense = flops - f8.linear_flops + f8_flops - experts
    return (dense / d.tp + experts) * tokens / peak, None


@dataclass(frozen=True)
class _MemoryBytes:
    """A step's memory-bound traffic on a rank, by what scales with a pipeline rank's share (pointwise,
    logits, float8 casts) and what does not (its own weights' casts and gradient accumulation)."""

    pointwise: float
    logits: float
    casts: float
    accumulate: float
    f8_casts: float
    trained: float  # the elements with gradients and an optimizer step


def _memory_bytes(
    cfg: Config,
    d: Degrees,
    tokens: float,
    recompute: float,
    f8: Float8Terms,
    accum: int,
    unit_bytes: list[int],
    local_params: int | None,
) -> _MemoryBytes:
    m = cfg.model
    width = m.n_layers * (2 * m.dim + m.ffn_dim)
    # A recomputed forward runs its pointwise work again (a third of the forward and backward's);
    # selective_op recomputes all of it (norms, RoPE, SiLU: it keeps only matmul and attention outputs).
    op = cfg.sharding.activation_checkpointing is ActivationCheckpointing.selective_op
    again = 1.0 if op else recompute
    pointwise = tokens * width * _POINTWISE_BYTES / d.tp * (1.0 + again / 3.0)
    # The full logits on every TP rank, or its vocabulary shard under loss parallelism.
    logits = tokens * m.vocab_size * _LOGIT_BYTES / (d.tp if loss_parallel_on(cfg, d.tp) else 1)
    if cfg.executor.mode == ExecutorMode.eager:
        pointwise *= _EAGER_POINTWISE
    if not loss_head_compiled(cfg):  # eager, or the blocks alone compiled (executor.compile_loss)
        logits *= _EAGER_POINTWISE
    unsharded = sum(unit_bytes) / 4  # this TP rank's parameters, whole (FSDP all-gathers them)
    local = unsharded / d.fsdp_shard if local_params is None else local_params
    casts = accum * unsharded * _CAST_BYTES
    # float8's casts: the activations' per token (TP: each rank casts its shard), the weights' per
    # micro batch (this TP rank's whole weights, as the bf16 casts above)
    f8_casts = (tokens * f8.act_bytes + accum * f8.weight_bytes) / d.tp
    f8_casts += (
        _FLOAT8_EXPERT_CAST_SLOWDOWN
        * (tokens * f8.expert_act_bytes + accum * f8.expert_weight_bytes / d.ep)
        / d.tp
    )
    trained = local * trained_share(cfg)
    accumulate = (accum - 1) * trained * _ACCUM_BYTES
    return _MemoryBytes(pointwise, logits, casts, accumulate, f8_casts, trained)


def _terms(terms: ComputeTerms, table: str | None, fraction: float) -> dict[str, float | str]:
    """The kernel table's compute terms for StepPrediction (a pipeline rank's share of them)."""
    return {
        "gemm_s": terms.gemm_s * fraction,
        "grouped_s": terms.grouped_s * fraction,
        "attention_s": terms.attention_s * fraction,
        "compute_source": f"kernel_table {table} (attention: {terms.attention_kernel})",
    }
