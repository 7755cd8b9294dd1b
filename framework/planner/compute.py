"""Compute time of one step on one rank from a measured kernel table (framework.planner.kernels):
every GEMM of every layer at its own shape, the experts' grouped GEMMs at the rows each expert gets,
attention at its sequence length and head dim.

Shapes are the runtime's (framework.parallel): under TP with sequence parallelism each Linear runs on
the micro batch's gathered tokens with its out (column-parallel) or in (row-parallel) dim split; an
MoE sublayer (router and experts) runs whole on every TP rank (framework.parallel.tensor.block_plan);
under expert parallelism a rank's local experts get the rows of its whole ep group; CP gives each
rank 1/cp of the tokens and of the causal attention. Activation checkpointing runs the blocks'
forward again (``recompute``: the share of it; selective_op recomputes GEMMs, no attention).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from framework.config.schema import ActivationCheckpointing, AttentionBackend, Config, Float8Recipe
from framework.models import model_spec
from framework.models.linears import converted, converted_experts, linear_shapes
from framework.models.spec import LayerKind, TPStyle
from framework.planner.kernels import KernelTable

if TYPE_CHECKING:
    from framework.planner.layout import Degrees

# The table's kernel that prices each model.attention: auto is cuDNN's (what SDPA picks on Hopper in
# torch 2.11: the 1B profile's attention ran in cuDNN's kernels, benchmarks/PERF.md), flash is torch's
# FlashAttention-2. Where the table has no kernel of its own: FlashAttention-4 at cuDNN's rates (it
# ran 9% faster than cuDNN at 8K, benchmarks/PERF.md: a pessimistic assumption, named in the plan), the
# memory-efficient and math kernels at FA2's (slower still: optimistic for them).
_ATTENTION_TABLE = {
    AttentionBackend.flash: "flash",
    AttentionBackend.efficient: "flash",
    AttentionBackend.math: "flash",
}


@dataclass(frozen=True)
class ComputeTerms:
    """Seconds a step of one rank spends in each kind of kernel (recompute included)."""

    gemm_s: float  # the Linear layers and the router (bf16 or float8)
    grouped_s: float  # the MoE experts' grouped GEMMs
    attention_s: float
    attention_kernel: str  # the table's kernel that priced attention

    @property
    def total_s(self) -> float:
        return self.gemm_s + self.grouped_s + self.attention_s


def table_compute(
    cfg: Config,
    d: Degrees,
    table: KernelTable,
    accum: int,
    recompute: float,
    fast_accum_speedup: float,
    expert_float8_speedup: float,
) -> ComputeTerms:
    """The step's compute on one rank (the whole model: a pipeline rank's share is the caller's)."""
    m = cfg.model
    tokens = max(1.0, cfg.train.micro_batch_size * cfg.train.seq_len / d.cp)  # one micro batch's GEMM rows
    block_recompute = recompute
    op = cfg.sharding.activation_checkpointing is ActivationCheckpointing.selective_op
    gemm = _linear_s(cfg, d, table, tokens, block_recompute, fast_accum_speedup)
    grouped = _experts_s(cfg, d, table, tokens, block_recompute, expert_float8_speedup)
    kernel = _ATTENTION_TABLE.get(m.attention, "cudnn")
    kernel = kernel if (kernel, True) in table.attention else "flash"  # a table without cuDNN's rows
    attention = _attention_s(cfg, d, table, kernel, 0.0 if op else block_recompute)
    return ComputeTerms(gemm * accum, grouped * accum, attention * accum, kernel)


def _linear_s(
    cfg: Config, d: Degrees, table: KernelTable, tokens: float, recompute: float, fast_accum: float
) -> float:
    """One micro batch's Linear GEMMs (blocks and head) and routers, each at its TP shard's shape."""
    m = cfg.model
    float8 = {s.fqn for s in converted(m)} if m.float8 is not Float8Recipe.none else set()
    kind = f"float8_{m.float8.value}"
    blocks = f"{model_spec(m).blocks}."
    shapes: Counter[tuple[int, int, bool, bool]] = Counter()  # layers repeat: price each shape once
    for s in linear_shapes(m):
        out, inp = s.out_features, s.in_features
        if s.tp_style == "colwise":
            out = max(1, out // d.tp)
        elif s.tp_style == "rowwise":
            inp = max(1, inp // d.tp)
        shapes[(out, inp, s.fqn.startswith(blocks), s.fqn in float8)] += 1
    total = 0.0
    for (out, inp, in_block, is_float8), count in shapes.items():
        again = recompute if in_block else 0.0
        if is_float8:  # model.float8_fast_accum speeds the two backward GEMMs up
            fwd, fwd_bwd = table.gemm_parts(kind, tokens, out, inp)
            total += count * (fwd * (1.0 + again) + (fwd_bwd - fwd) / fast_accum)
        else:
            total += count * table.gemm_s("bf16", tokens, out, inp, again)
    for layer_kind, n in model_spec(m).kinds():
        routers = [w for w in layer_kind.weights if w.tp is TPStyle.moe and not w.experts and len(w.shape) == 2]
        for w in routers:  # whole on every TP rank
            total += n * table.gemm_s("bf16", tokens, w.shape[0], w.shape[1], recompute)
    return total


def _experts_s(
    cfg: Config, d: Degrees, table: KernelTable, tokens: float, recompute: float, float8_speedup: float
) -> float:
    """One micro batch's expert GEMMs on one rank: its local experts (E / ep) get ep x tokens x top_k / E
    rows each, on every TP rank alike; the rank's forward FLOPs are those of its own tokens' rows."""
    m = cfg.model
    return sum(
        n * _layer_experts_s(cfg, d, table, tokens, recompute, float8_speedup, kind)
        for kind, n in model_spec(m).kinds()
        if kind.sparse
    )


def _layer_experts_s(
    cfg: Config,
    d: Degrees,
    table: KernelTable,
    tokens: float,
    recompute: float,
    float8_speedup: float,
    kind: LayerKind,
) -> float:
    """One MoE layer of ``kind``'s expert GEMMs and the routing around them (``_experts_s``)."""
    m = cfg.model
    stacks = [w for w in kind.weights if w.experts and len(w.shape) == 3]  # not GPT-OSS's stacked biases
    k, experts = m.moe.num_experts_per_tok, stacks[0].experts
    rows_per_expert = d.ep * tokens * k / experts
    # down_proj is (E, dim, width), or in the Hub's layout (GPT-OSS's) (E, width, dim)
    down = stacks[-1]
    dim, width = m.dim, down.shape[-1] if down.shape[1] == m.dim else down.shape[1]
    flop = sum(2.0 * tokens * k * w.shape[1] * w.shape[2] for w in stacks)  # forward, the rank's rows
    seconds = table.grouped_s(rows_per_expert, dim, width, flop, recompute)
    converted_here = bool(converted_experts(m)) and m.float8 is not Float8Recipe.none
    seconds = seconds / float8_speedup if converted_here else seconds
    # Routing, permutation and combine around the experts: the rank's routed rows (its tokens x top-k)
    # at the table's measured time per row and element of dim, and again in a recomputed forward.
    around = table.moe_overhead_s * tokens * k * dim * (1.0 + recompute / 3.0)
    return seconds + around


def _attention_s(cfg: Config, d: Degrees, table: KernelTable, kernel: str, recompute: float) -> float:
    """One micro batch's attention on one rank: its heads (n_heads / tp) over the rank's 1/cp of the
    causal work, at the table's rate for the sequence length (a sliding window: the window's)."""
    m = cfg.model
    spec = model_spec(m)
    seq, hd = cfg.train.seq_len, spec.head_dim
    heads = m.n_heads / d.tp
    total = 0.0
    for kind, n in spec.kinds():  # each layer kind's window
        window = kind.window
        span = min(window, seq) if window > 0 else seq
        # Forward FLOPs the causal mask leaves: scores and values, 2 x 2 x head_dim per (query, key) pair.
        pairs = seq * span - span * span / 2 if window > 0 else seq * seq / 2
        flop = 4.0 * cfg.train.micro_batch_size * heads * pairs * hd / d.cp
        total += n * table.attention_s(kernel, span, hd, True, flop, recompute)
    return total
