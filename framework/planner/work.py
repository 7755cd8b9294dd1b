"""The work one step does, counted from the model and the config: the FLOPs activation checkpointing
runs again, what ``model.float8`` converts (its GEMM FLOPs and the bytes of its casts), the GEMMs'
wave-quantization efficiency on the device's SMs, and the optimizer step's bytes per parameter.
framework.planner.cost prices them; each constant says where it comes from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from framework.config.schema import (
    ActivationCheckpointing,
    Config,
    DType,
    Float8Recipe,
    OptimizerName,
)
from framework.models import active_params, model_spec
from framework.models.linears import converted, converted_experts
from framework.planner.params import lora_specs, param_specs, sum_local

if TYPE_CHECKING:
    from framework.planner.layout import Degrees

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


# A recomputed forward is a third of the block's training flops (forward 2, backward 4); selective
# checkpointing recomputes every other block. selective_op's share is counted from the shapes
# (``recompute_fraction``), not listed here.
_RECOMPUTE = {"none": 0.0, "selective": 0.5, "full": 1.0, "budget": 0.5}
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
