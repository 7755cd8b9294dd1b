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
- **communication**: the planner's alpha-beta collectives at ``link_efficiency`` of the link speed.
  TP's collectives (each also pays ``_TP_DISPATCH_S``), CP's K/V passes, a pipeline's
  tied-embedding transfers (between backward and the optimizer step, and after it) and an MoE
  model's load-balancing all-reduces (latency-bound: 2 E + 1 floats) and its sigmoid routers'
  bias-update all-reduces (E int64 a layer, once a step) sit on the critical path. FSDP prefetches
  the next unit while one computes, so of its all-gathers the first unit's of each pass is exposed,
  and of its reduce-scatters (and HSDP's / DDP's all-reduces) the
  last one of the step; the rest overlaps the compute by ``comm_overlap`` and never by more than
  the compute lasts (``exposed_comm``). A pipeline's stage-to-stage sends overlap the steady state;
  those of the fill and the drain (2 (pp v - 1) of them) are on the critical path.

How well it predicts the GPU runs of benchmarks/PERF.md is the table of ``benchmarks/cost_check.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from framework.config.schema import (
    ActivationCheckpointing,
    Config,
    DType,
    ExecutorMode,
    Float8Recipe,
    OptimizerName,
)
from framework.kernels.float8 import EXPERTS_RECIPE
from framework.models import active_params, flops_per_token, model_spec
from framework.models.linears import converted, converted_experts
from framework.planner.compute import ComputeTerms, table_compute
from framework.planner.confidence import describe, step_range, term_sources
from framework.planner.kernels import load_table
from framework.planner.layout import loss_head_compiled, loss_parallel_on
from framework.planner.params import lora_specs, param_specs, sum_local

if TYPE_CHECKING:
    from framework.planner.layout import Degrees


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
# Fused AdamW: reads parameter, gradient and both moments (fp32) and writes three back (28 bytes),
# plus the bf16 copy it leaves for autocast (6) and zeroing the gradient (4): 38 bytes, which is
# the 1B profile's 10 ms for 1.24B parameters at 4.8 TB/s (39 bytes).
_ADAMW_BYTES = 38.0
# optimizer.state_dtype=bfloat16 (framework.train.adamw): each moment read and written in 2 bytes, not 4.
_BF16_MOMENTS_SAVE = 8.0


def bf16_moments(cfg: Config) -> bool:
    """``optimizer.state_dtype=bfloat16`` under AdamW (framework.train.adamw)."""
    return cfg.optimizer.name is OptimizerName.adamw and cfg.optimizer.state_dtype is DType.bfloat16


def adamw_step_bytes(cfg: Config) -> float:
    """HBM bytes the optimizer step moves per parameter (``_ADAMW_BYTES``, less the bf16 moments')."""
    return _ADAMW_BYTES - (_BF16_MOMENTS_SAVE if bf16_moments(cfg) else 0.0)


def trained_share(cfg: Config) -> float:
    """The share of a rank's parameters that get gradients and an optimizer step: 1, or under
    ``peft.method=lora`` the adapters' elements over the base's (the frozen base needs neither). The
    whole model's ratio: the targets repeat in every block, so a rank's shard has about the same."""
    specs = param_specs(cfg.model)
    adapters = lora_specs(specs, cfg.model, cfg.peft)
    return sum_local(adapters, 1, 1) / sum_local(specs, 1, 1) if adapters else 1.0


def adamw_state_bytes(cfg: Config) -> int:
    """Bytes of optimizer state per parameter: two moments, fp32 or (``optimizer.state_dtype``) bf16."""
    return 2 * (2 if bf16_moments(cfg) else 4)


# Autocast casts each fp32 weight to bf16 once per forward (read 4, write 2).
_CAST_BYTES = 6.0
# Accumulating a micro batch's fp32 gradient into the previous ones: read both, write one.
_ACCUM_BYTES = 12.0
# Eager runs each pointwise op as its own kernel: the eager loop spent 3.4x (1B) and 4.8x (125M)
# the compiled loop's pointwise time (benchmarks/PERF.md, same section); we take 4.
_EAGER_POINTWISE = 4.0
# A recomputed forward is a third of the block's training flops (forward 2, backward 4); selective
# checkpointing recomputes every other block. selective_op's share is counted from the shapes
# (``recompute_fraction``), not listed here.
_RECOMPUTE = {"none": 0.0, "selective": 0.5, "full": 1.0, "budget": 0.5}
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
# Wave quantization (gemm_shape_efficiency): Hopper's cuBLAS / CUTLASS bf16 GEMMs tile the output in
# 128 x 256 blocks, one block per SM at a time (CUTLASS's default sm90 tile shape), and an H100 SXM
# or H200 has 132 SMs (NVIDIA H100 datasheet / Hopper tuning guide). Calibration: the 1B b16 profile
# (gemm_efficiency's measurement, conf/mesh/hardware/h200.yaml) ran at this shape efficiency.
_TILE_M, _TILE_N = 128, 256
_SMS = 132
_CALIBRATION_SHAPE = (16 * 2048, 2048, 8192, 16, 32, 8, 128256)  # tokens, dim, ffn, layers, heads, kv, vocab
# model.float8: the converted Linear layers' GEMMs (forward, input gradient, weight gradient) run on
# the float8 tensor cores at this multiple of the bf16 rate. Hopper's dense float8 peak is twice its
# bf16 peak (H100 / H200 datasheets: 1979 vs 989 TFLOP/s). Tensorwise: measured, not fitted: the 8B's
# float8 GEMMs ran 3.43e14 FLOP in 259 ms of `_scaled_mm` (benchmarks/PERF.md), 1,324
# TFLOP/s = 0.669 of their peak, where h200.yaml's bf16 GEMMs run at 0.68 of theirs: 2 x 0.669 /
# 0.68 = 1.97. (1.74, fitted to one full-AC pair alone, left every no-recompute float8
# run 11-17% slow in the plan; benchmarks/PERF.md.) Rowwise (the MoE experts' recipe,
# whose casts _FLOAT8_EXPERT_CAST_SLOWDOWN was fitted with) keeps 1.74.
_FLOAT8_GEMM_SPEEDUP = {Float8Recipe.tensorwise: 1.97, Float8Recipe.rowwise: 1.74}
# model.float8_fast_accum: the two backward GEMMs (2/3 of a Linear's float8 FLOPs) this much faster
# again. Llama-3-8B at 8K on one H200, tensorwise, the same machine (benchmarks/PERF.md):
# 595.1 -> 579.5 ms a step; the float8 GEMMs' backward share of the profile is ~173 ms (2/3 of
# `_scaled_mm`'s 259 ms), so 173 / (173 - 15.6) = 1.10. One measurement: a fit.
_FAST_ACCUM_BACKWARD_SPEEDUP = 1.10
# Tensorwise dynamic scaling casts every operand of a converted Linear per GEMM (torchao's
# Float8Linear): its amax (read bf16, 2 bytes) then the scaled cast (read 2, write 1): 5 bytes per
# element of the input in each forward (recomputed ones included) and of the output gradient in
# backward, plus 3 (read 2, write 1) per element of each for the transposed copies the weight
# gradient's GEMM takes. The weight: amax and cast from its fp32 master (4 + 4 + 1 = 9 bytes) per
# forward, and a transposed copy (3) in backward. Counted from the code, not fitted.
_FLOAT8_ACT_FORWARD_BYTES = 5.0
_FLOAT8_ACT_BACKWARD_BYTES = 5.0 + 3.0
_FLOAT8_WEIGHT_BYTES = 9.0
_FLOAT8_WEIGHT_BACKWARD_BYTES = 3.0
# The MoE experts' float8 grouped GEMM (torchao.prototype.moe_training, framework.kernels.float8_grouped)
# casts the bf16 copy autocast made (its fp32 -> bf16 cast is the bf16 path's too): per element of
# every expert's weight an amax and a scaled cast (read 2, read 2, write 1) in forward, the same for
# the transposed copy in backward. The activations' rowwise casts are costed as the Linear layers'
# (per routed row: top_k rows a token). Counted from the code, not fitted; the zero-row padding
# (fewer than 16 rows an expert) is not costed.
_FLOAT8_EXPERT_WEIGHT_BYTES = 5.0
_FLOAT8_EXPERT_WEIGHT_BACKWARD_BYTES = 5.0
# ... and those casts run at 1/2.4 of the bandwidth the counts above assume: Qwen3-30B-A3B cut to 8
# layers on one H200 (seq 4096 x 2, compiled; benchmarks/PERF.md) stepped 30.6 ms slower
# with float8 experts, of which the grouped GEMMs saved 7.3 ms (the profile): 37.9 ms of casts and
# padding against 15.7 ms counted (torchao's per-group rowwise scale kernels, the padding copies).
# One measurement: a fit.
_FLOAT8_EXPERT_CAST_SLOWDOWN = 2.4
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


def _recompute_flops_per_token(cfg: Config) -> float:
    """Forward flops of the blocks (what a checkpointed block runs again): 2 N_blocks + 4·L·H·Q·T."""
    m = cfg.model
    blocks = active_params(m, include_embedding=False) - (0 if m.tie_embeddings else m.vocab_size * m.dim)
    return 2.0 * blocks + 4.0 * model_spec(m).score_width(m.n_heads) * cfg.train.seq_len


def _op_recompute_flops_per_token(cfg: Config) -> float:
    """selective_op recomputes, per block, the matmuls its per-op policy does not keep (wk, wo and
    w3: framework.parallel.activation) and no attention: 2 x (dim x kv_dim + q_dim x dim + dim x
    ffn_dim) flops per token and block."""
    m = cfg.model
    hd = model_spec(m).head_dim
    q, kv = m.n_heads * hd, m.n_kv_heads * hd
    return 2.0 * m.n_layers * (m.dim * kv + q * m.dim + m.dim * m.ffn_dim)


def _expert_flops_per_token(cfg: Config, recompute: float) -> float:
    """The routed experts' GEMM flops per token: top-k of each MoE layer's experts, forward and
    backward (6 per weight) and the recomputed forward (2 x ``recompute``); 0 for a dense model."""
    k = cfg.model.moe.num_experts_per_tok
    total = 0.0
    for kind, n in model_spec(cfg.model).kinds():  # each layer kind's experts, times its layers
        per_expert = sum(math.prod(w.shape[1:]) for w in kind.weights if w.experts)
        total += (6.0 + 2.0 * recompute) * k * per_expert * n
    return total


def recompute_fraction(cfg: Config) -> float:
    """The share of the blocks' forward flops that activation checkpointing runs again (0: none)."""
    mode = cfg.sharding.activation_checkpointing.value
    if mode == ActivationCheckpointing.budget.value:
        return _RECOMPUTE["budget"] * (1.0 - cfg.sharding.activation_memory_budget)
    if mode == ActivationCheckpointing.selective_op.value:
        return _op_recompute_flops_per_token(cfg) / _recompute_flops_per_token(cfg)
    return _RECOMPUTE.get(mode, 0.0)


@dataclass(frozen=True)
class Float8Terms:
    """What ``model.float8`` converts, per token (recompute included) or per micro batch; all 0
    without float8."""

    linear_flops: float  # per token: the converted Linear layers' GEMMs (at the configured recipe)
    expert_flops: float  # per token: the converted MoE expert GEMMs (rowwise)
    act_bytes: float  # per token: the Linear layers' activation casts
    weight_bytes: float  # per micro batch: the Linear layers' weight casts
    expert_weight_bytes: float  # per micro batch: every expert's weight casts (EP: / ep)
    expert_act_bytes: float  # per token: the expert GEMMs' activation casts


def _float8_terms(cfg: Config, recompute: float) -> Float8Terms:
    """What ``model.float8`` converts (``framework.models.linears.converted`` and
    ``converted_experts``, as the swap does). The output head, when converted, is never recomputed;
    each token runs ``top_k`` rows through an expert GEMM."""
    m = cfg.model
    if m.float8 is Float8Recipe.none:
        return Float8Terms(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    blocks = f"{model_spec(m).blocks}."
    flops = act = weight = 0.0
    for s in converted(m):
        again = recompute if s.fqn.startswith(blocks) else 0.0
        w = float(s.out_features * s.in_features)
        flops += (6.0 + 2.0 * again) * w
        act += _float8_act_bytes(s.out_features, s.in_features, again)
        weight += w * (_FLOAT8_WEIGHT_BYTES * (1.0 + again) + _FLOAT8_WEIGHT_BACKWARD_BYTES)
    e_flops = e_weight = e_act = 0.0
    for g in converted_experts(m):
        w = float(g.out_features * g.in_features)
        e_flops += g.top_k * (6.0 + 2.0 * recompute) * w
        e_act += g.top_k * _float8_act_bytes(g.out_features, g.in_features, recompute)
        e_weight += (
            g.num_experts
            * w
            * (_FLOAT8_EXPERT_WEIGHT_BYTES * (1.0 + recompute) + _FLOAT8_EXPERT_WEIGHT_BACKWARD_BYTES)
        )
    return Float8Terms(flops, e_flops, act, weight, e_weight, e_act)


def _float8_act_bytes(out_features: int, in_features: int, again: float) -> float:
    """Bytes of one converted GEMM's activation casts per row (see ``_FLOAT8_ACT_FORWARD_BYTES``)."""
    forward = _FLOAT8_ACT_FORWARD_BYTES * in_features * (1.0 + again)
    return forward + _FLOAT8_ACT_BACKWARD_BYTES * out_features + 3.0 * in_features


def _wave(m: int, n: int) -> float:
    """Fraction of the SM-waves a GEMM with an m x n output keeps busy (1.0: every wave full)."""
    tiles = math.ceil(m / _TILE_M) * math.ceil(n / _TILE_N)
    return tiles / (math.ceil(tiles / _SMS) * _SMS)


def _shape_efficiency(
    tokens: int, dim: int, ffn: int, heads: int, kv_heads: int, head_dim: int, vocab: int, tp: int
) -> float:
    """Flops-weighted wave efficiency of one micro batch's GEMMs on one TP rank: per weight of
    (out, in) shape the forward (tokens x out), input-gradient (tokens x in) and weight-gradient
    (out x in) GEMMs, each a third of its flops; column-parallel weights split ``out`` by tp,
    row-parallel ones ``in``; the output projection splits the vocabulary."""
    q, kv = heads * head_dim, kv_heads * head_dim
    weights = [  # (out, in) of one rank's shard
        (q // tp, dim), (kv // tp, dim), (kv // tp, dim), (dim, q // tp),
        (ffn // tp, dim), (ffn // tp, dim), (dim, ffn // tp), (vocab // tp, dim),
    ]  # fmt: skip
    num = den = 0.0
    for out, inp in weights:
        flops = float(out * inp)
        num += flops * (_wave(tokens, out) + _wave(tokens, inp) + _wave(out, inp)) / 3.0
        den += flops
    return num / den


def gemm_shape_efficiency(cfg: Config, d: Degrees) -> float:
    """The GEMMs' wave efficiency at this layout's shapes over the calibration run's (1.0 there): the
    factor on ``gemm_efficiency``. Sequence parallelism gathers the whole micro batch before each
    GEMM, so M is the micro batch's tokens (1/cp of them under CP)."""
    m = cfg.model
    tokens = max(1, cfg.train.micro_batch_size * cfg.train.seq_len // d.cp)
    hd = model_spec(m).head_dim
    mine = _shape_efficiency(tokens, m.dim, m.ffn_dim, m.n_heads, m.n_kv_heads, hd, m.vocab_size, d.tp)
    t, dim, ffn, _, heads, kv, vocab = _CALIBRATION_SHAPE
    return mine / _shape_efficiency(t, dim, ffn, heads, kv, dim // heads, vocab, 1)


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
    window = compute_s + memory_s
    hops = 2 * (d.pp * cfg.parallel.pp_stages_per_rank - 1) if d.pp > 1 else 0
    total, exposed = exposed_comm(
        comm, max(1, len(unit_bytes)), window, hw.link_efficiency, hw.comm_overlap, hops
    )
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
    f8_casts += _FLOAT8_EXPERT_CAST_SLOWDOWN * (tokens * f8.expert_act_bytes + accum * f8.expert_weight_bytes / d.ep) / d.tp
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
