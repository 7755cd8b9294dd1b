"""The plan: every derived number of a run, computed once from the config before any process starts.

``make_plan(cfg)`` is pure (no process group, no model, no device) and deterministic, so the same plan
is printed by the launcher, written to ``plan.json``, checked by the dry run against the real sharded
model, and compared across runs. It refuses what cannot work with a ``ValueError`` that names the bad
value, the reason and a fix; the trainer catches it before launching ranks.

The layout is a set of parallel degrees (framework.planner.layout): fixed by ``parallel.*`` or a named
``sharding`` preset, or searched (``sharding=auto``, framework.planner.search, which evaluates candidates
with ``plan_for``). Every branch here reads the degrees, never a strategy name. Each plan carries
its predicted step time (framework.planner.cost), so a forced layout can be compared with the search's.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from framework.config.schema import (
    ActivationCheckpointing,
    CompileScope,
    Config,
    DType,
    ExecutorMode,
    FusedCrossEntropy,
    ModelConfig,
    OptimizerName,
    RouterScore,
)
from framework.models import family, model_spec
from framework.models.linears import bf16_weight_copy_bytes_per_layer, saved_activation_bytes_per_layer
from framework.models.parts.layout import op_saved_values
from framework.planner import stages as pipeline_stages
from framework.planner.cost import CommEstimate, StepPrediction, adamw_state_bytes, bf16_moments, predict_step
from framework.planner.layout import (
    DP_AXES,
    Degrees,
    MeshAxis,
    Placement,
    axis_placement,
    check_cp,
    check_degrees,
    divisors,
    fixed_degrees,
    loss_head_compiled,
    loss_parallel_on,
    num_experts,
)

GIB = 1024**3
MIB = 1024**2
# Bucket sizes the auto choice may pick: below 1 MiB launches dominate, above 256 MiB nothing overlaps.
AUTO_BUCKET_MIN_MB = 1.0
AUTO_BUCKET_MAX_MB = 256.0
_DTYPE_BYTES = {DType.float32: 4, DType.bfloat16: 2, DType.float16: 2}
# Master weights and gradients are kept in fp32 (FSDP2 keeps the sharded parameter in its original
# dtype; ``param_dtype`` only changes the all-gathered compute copy); AdamW's two moments too, unless
# optimizer.state_dtype=bfloat16 (framework.planner.cost.adamw_state_bytes).
_MASTER_BYTES = 4


__all__ = ["DP_AXES", "MeshAxis"]


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of the model: its name, full shape and the tensor dim TP shards (if any)."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    unit: str  # FSDP unit that owns it: "layers.N", "root" (or _HEAD_ROOT: a second root, zbv's V)
    # False for a pipeline's copy of a tied weight: stepped through the embedding it copies.
    optimizer: bool = True
    # A routed expert stack under expert parallelism: ``shape`` is this rank's slice (E / ep experts
    # on dim 0) and FSDP2 shards it over dp_shard x cp / ep ranks (Degrees.expert_shard). 0: dense.
    ep: int = 0


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank bytes (the largest shard, which rank 0 holds under torch.chunk sharding)."""

    params: int
    grads: int
    optimizer: int
    comm_buffers: int
    activations: int
    activations_by_mode: dict[str, int]
    total: int
    device: int
    optimizer_state: str = "fp32"  # the moments' dtype (optimizer.state_dtype)


@dataclass(frozen=True)
class Plan:
    world_size: int
    nodes: int
    procs_per_node: int
    strategy: str  # the layout's name, from its degrees (Degrees.name): ddp, fsdp, hsdp_tp, ...
    degrees: dict[str, int]  # dp_replicate, dp_shard, cp, tp, pp
    mesh_shape: tuple[int, ...]
    mesh_axes: tuple[str, ...]
    placement: tuple[Placement, ...]  # where each mesh axis lands on the topology
    dp_degree: int
    tp_degree: int
    micro_batch_size: int
    global_batch_size: int
    grad_accum_steps: int
    seq_len: int
    num_params: int
    params_per_rank: int
    activation_checkpointing: str
    memory: MemoryEstimate
    comm: tuple[CommEstimate, ...]
    comm_time_s: float
    bucket_cap_mb: float
    bucket_reason: str
    bucket_sizes: tuple[int, ...]  # bytes; DDP buckets in gradient order, or FSDP units (blocks, root)
    prediction: StepPrediction
    warnings: tuple[str, ...]
    # Pipeline (pp > 1; framework.planner.stages): the schedule, its micro batches, the virtual stages per
    # rank, each stage's [start, stop) blocks (split by the per-layer cost model), the stages each pp
    # rank holds, and the bubble as a fraction of the busiest rank's compute.
    pp_schedule: str = ""
    pp_microbatches: int = 0
    pp_stages_per_rank: int = 1
    pp_split: tuple[tuple[int, int], ...] = ()
    pp_ranks: tuple[tuple[int, ...], ...] = ()
    pp_bubble: float = 0.0
    # Loss parallelism (``parallel.loss_parallel`` under tp > 1, framework.parallel.tensor): the
    # logits stay sharded over the vocabulary on each TP rank. False without TP, or when turned off.
    loss_parallel: bool = False
    # sharding.activation_memory_budget under activation_checkpointing=budget (None under any other
    # mode): the value the compiler's partitioner gets, chosen by the search under auto.
    activation_memory_budget: float | None = None

    @property
    def layout(self) -> Degrees:
        return Degrees(**self.degrees)

    def axis_size(self, axis: MeshAxis) -> int:
        return self.mesh_shape[self.mesh_axes.index(axis.value)] if axis.value in self.mesh_axes else 1


# ----------------------------------------------------------------------------------------------
# Layout
# ----------------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return divisors(n)


def check_mesh(cfg: Config) -> None:
    shape = list(cfg.mesh.shape)
    if not shape or any(s < 1 for s in shape):
        raise ValueError(
            f"mesh.shape={shape} is not valid: use [procs] for one node or [nodes, procs_per_node, ...], "
            f"all sizes >= 1"
        )


def _check_executor(cfg: Config, d: Degrees) -> None:
    """Refuse compile combinations that fail (or hang) on torch 2.13, found by the parallel tests."""
    ac = cfg.sharding.activation_checkpointing
    budget = cfg.sharding.activation_memory_budget
    if ac == ActivationCheckpointing.budget and not 0.0 <= budget <= 1.0:
        raise ValueError(
            f"sharding.activation_memory_budget={budget}: a fraction of the compiled default's saved "
            f"activations, valid values are 0.0 (recompute all it can) to 1.0 (recompute nothing extra)"
        )
    if ac == ActivationCheckpointing.selective_op and num_experts(cfg.model):
        raise ValueError(
            f"sharding.activation_checkpointing=selective_op with model.moe.num_experts="
            f"{num_experts(cfg.model)}: the planner counts what the per-op policy keeps for a dense "
            f"block only (framework.models.parts.layout.op_saved_values); use "
            f"sharding.activation_checkpointing=selective|full|none"
        )
    if cfg.executor.mode == ExecutorMode.eager:
        if ac == ActivationCheckpointing.budget:
            raise ValueError(
                "sharding.activation_checkpointing=budget with executor.mode=eager: the budget is "
                "enforced by the compiler's partitioner; use executor=compile (or cudagraphs), or "
                "sharding.activation_checkpointing=selective|full"
            )
        return
    tp = d.tp
    if (
        cfg.executor.scope == CompileScope.model
        and tp > 1
        and ac not in (ActivationCheckpointing.none, ActivationCheckpointing.budget, ActivationCheckpointing.auto)
    ):
        raise ValueError(
            f"executor.scope=model with sharding.tp={tp} and sharding.activation_checkpointing="
            f"{ac.value}: a checkpoint inside a compiled TP graph saves a DeviceMesh that AOTAutograd "
            f"refuses (torch 2.13); use executor.scope=block (checkpointing then wraps each compiled "
            f"block) or sharding.activation_checkpointing=none"
        )
    if cfg.executor.scope == CompileScope.model and not cfg.executor.compile_loss:
        raise ValueError(
            "executor.compile_loss=false with executor.scope=model: the loss head is part of the "
            "model's one compiled region; use executor.scope=block to leave the head eager"
        )
    if cfg.executor.scope == CompileScope.model and d.fsdp:
        raise ValueError(
            f"executor.scope=model with an FSDP layout ({d.name()}: {d.short()}): FSDP2's per-block hooks "
            f"are Dynamo graph breaks (torch._dynamo.disable), so no full graph spans the model; "
            f"use executor.scope=block, which compiles exactly the regions between those hooks"
        )


def _check_in_backward(cfg: Config, accum: int) -> None:
    """``train.optimizer_in_backward`` steps each parameter from its gradient hook: refuse what that breaks."""
    if not cfg.train.optimizer_in_backward:
        return
    world = cfg.mesh.world_size
    if world > 1:
        raise ValueError(
            f"train.optimizer_in_backward=true on mesh.shape={list(cfg.mesh.shape)} (world {world}): the "
            f"per-parameter step fires before DDP/FSDP/TP reduce that gradient across ranks; use it on "
            f"one device (mesh=1), or keep it off and let sharding=fsdp shard the gradients instead"
        )
    if accum > 1:
        raise ValueError(
            f"train.optimizer_in_backward=true with {accum} micro-batches per step "
            f"(train.global_batch_size={cfg.train.global_batch_size}, train.micro_batch_size="
            f"{cfg.train.micro_batch_size}): the step happens in the first backward; set "
            f"train.micro_batch_size={cfg.train.global_batch_size} (or 0)"
        )
    if cfg.train.grad_clip > 0:
        raise ValueError(
            f"train.optimizer_in_backward=true with train.grad_clip={cfg.train.grad_clip}: a global "
            f"gradient-norm clip needs every gradient before the first step; set train.grad_clip=0 "
            f"(the norm is still logged) or train.optimizer_in_backward=false"
        )


def _whole_model_backward(cfg: Config) -> bool:
    """One compiled region for the whole model: its backward hands out every gradient at once."""
    return cfg.executor.mode != ExecutorMode.eager and cfg.executor.scope == CompileScope.model


def _check_batch(cfg: Config, dp: int) -> int:
    gbs, mbs = cfg.train.global_batch_size, cfg.train.micro_batch_size
    if mbs < 1 or gbs < 1 or gbs % (dp * mbs):
        per_dp = gbs // dp if gbs % dp == 0 else None
        micro_ok = _divisors(per_dp) if per_dp else []
        step = dp * max(mbs, 1)
        raise ValueError(
            f"train.global_batch_size={gbs} is not divisible by dp_degree ({dp}) x "
            f"train.micro_batch_size ({mbs}) = {dp * mbs}: use a global batch size in "
            f"{[step * k for k in range(1, 5)]}..."
            + (f" or a micro batch size in {micro_ok}" if micro_ok else "")
        )
    return gbs // (dp * mbs)


# ----------------------------------------------------------------------------------------------
# Parameters, memory
# ----------------------------------------------------------------------------------------------


class _Memo:
    """Results keyed by the identity of an object the planner reuses (a cached spec, a cached list of
    parameters) and some hashable arguments. The object is held with its result, so its id cannot be
    reused by another while the entry lives. Why: the search plans a layout thousands of times over
    the same parameter lists (an MoE model has ~1,200 of them); summing them each time took minutes."""

    def __init__(self, size: int = 8192) -> None:
        self._size = size
        self._entries: dict[tuple[int, Any], tuple[object, Any]] = {}

    def get(self, obj: object, args: Any, compute: Any) -> Any:
        key = (id(obj), args)
        hit = self._entries.get(key)
        if hit is not None and hit[0] is obj:
            return hit[1]
        if len(self._entries) >= self._size:
            self._entries.clear()
        value = compute()
        self._entries[key] = (obj, value)
        return value


_MEMO = _Memo()


def param_specs(m: ModelConfig, ep: int = 1) -> list[ParamSpec]:
    """Parameters of the model ``m`` describes, in ``named_parameters()`` order (tied output omitted),
    from its spec (framework.models): the planner needs no model; the dry run checks they agree.
    A routed expert stack is this rank's ``E / ep`` experts (framework.parallel.expert). The list is
    shared between calls (memoized): callers do not change it."""
    spec = model_spec(m)
    return _MEMO.get(spec, ("specs", ep), lambda: _param_specs(spec, ep))


def _param_specs(spec: Any, ep: int) -> list[ParamSpec]:
    out = []
    for name, w, unit in spec.params():
        if w.experts:
            shape = (w.experts // ep, *w.shape[1:])
            out.append(ParamSpec(name, shape, w.tp_dim, unit, ep=ep))
        else:
            out.append(ParamSpec(name, w.shape, w.tp_dim, unit))
    return out


def local_numel(spec: ParamSpec, tp: int, dp_shard: int) -> int:
    """Elements of rank 0's shard: TP chunks ``tp_dim``, then FSDP2 chunks dim 0 of what is left
    (an expert stack's ``E / ep`` experts over the dp_shard x cp / ep ranks outside its ep group).

    torch.chunk gives the first ranks ceil(size / n) rows, so rank 0 holds the largest shard.
    """
    return _local(spec.shape, spec.tp_dim, spec.ep, tp, dp_shard)


def _local(shape_: tuple[int, ...], tp_dim: int | None, ep: int, tp: int, dp_shard: int) -> int:
    shape = list(shape_)
    if tp > 1 and tp_dim is not None:
        shape[tp_dim] = math.ceil(shape[tp_dim] / tp)
    shard = max(1, dp_shard // ep) if ep else dp_shard
    if shard > 1:
        shape[0] = math.ceil(shape[0] / shard)
    return math.prod(shape)


def _kinds(specs: list[ParamSpec]) -> dict[tuple[Any, ...], int]:
    """The parameters grouped by what their shard size depends on, with their counts (memoized)."""

    def count() -> dict[tuple[Any, ...], int]:
        out: dict[tuple[Any, ...], int] = {}
        for s in specs:
            k = (s.shape, s.tp_dim, s.ep, s.optimizer)
            out[k] = out.get(k, 0) + 1
        return out

    return _MEMO.get(specs, "kinds", count)


def _ep_of(specs: list[ParamSpec]) -> int:
    """The expert-parallel degree the specs were built for (1 for a dense model or ep = 1)."""
    return max((k[2] for k in _kinds(specs)), default=1) or 1


def sum_local(specs: list[ParamSpec], tp: int, dp_shard: int, which: str = "all") -> int:
    """``sum(local_numel(s, tp, dp_shard) for s in specs)`` over all of them, those with optimizer
    state (``which="optimizer"``) or the expert stacks under ep (``"experts"``); ``"max"``: the
    largest one. Memoized per list (see ``_Memo``)."""

    def compute() -> int:
        kinds = _kinds(specs)
        if which == "max":
            return max(_local(sh, td, ep, tp, dp_shard) for sh, td, ep, _ in kinds)
        keep = {
            "all": lambda ep, opt: True,
            "optimizer": lambda ep, opt: opt,
            "experts": lambda ep, opt: ep > 1,
        }[which]
        return sum(n * _local(sh, td, ep, tp, dp_shard) for (sh, td, ep, opt), n in kinds.items() if keep(ep, opt))

    return _MEMO.get(specs, ("sum", tp, dp_shard, which), compute)


# Saved-activation factors, fitted to peak memory measured on one H200 (bf16 autocast, seq 2048,
# llama_125m at batch 16 and llama1b at batch 8; benchmarks/gpu_bench.py, notes in
# benchmarks/PERF.md): `k` scales the per-layer value count below, `logit_bytes` is what the loss
# head keeps per logit. Eager keeps bf16 logits, their fp32 copy and its gradient; the compiled loss
# head keeps bf16 logits only, and Inductor recomputes cheap pointwise results instead of saving them.
# An eager head under compiled blocks (executor.compile_loss=false) keeps the eager head's bytes.
_EAGER_K, _EAGER_LOGIT_BYTES = 1.5, 10
_COMPILED_K, _COMPILED_LOGIT_BYTES = 0.72, 2
# sharding.activation_checkpointing=budget below 1.0: the share of the default partition's saved
# activations that the partitioner keeps per unit of budget. Fitted on one H200 (Llama-3-8B, seq
# 8192, micro 1, the optimizer in backward; budgets 0.8, 0.9, 0.95, 0.98 peaked at 110.9, 112.85,
# 113.85, 114.35 GiB: a slope of 19.2 GiB per unit of budget against the plan's 34.6;
# benchmarks/PERF.md, session 12). Linear in the budget was 13% over at 0.9 and 17% over on the 7B
# at 0.5 (round 5); at budget 1.0 (the default partition) the 8B ran out of memory.
_BUDGET_KEPT = 0.555
# Under TP with parallel.loss_parallel=false the output projection's local logit shard is
# all-gathered to full logits on every rank (Replicate, for the loss), and both live with their
# gradients around the loss: llama1b with sharding=tp on 2 H200s (compiled, micro 4; the gathered
# head, before loss parallelism) peaked 3.5 GiB above the plan without this term, i.e. 3.3 bytes
# per logit (one run: a fit, not a derivation). Under loss parallelism (the default) a rank keeps
# only its vocabulary shard, at the one-GPU head's bytes per logit (_EAGER/_COMPILED_LOGIT_BYTES):
# an assumption, not yet measured on several GPUs (torch's handlers decompose the log-softmax into
# pointwise ops, whose eager temporaries may peak above the fused kernel's, on 1/tp of the logits).
_TP_LOGIT_EXTRA_BYTES = 3.3


def runs_on_cpu(cfg: Config) -> bool:
    """Whether a launch of ``cfg`` runs on the CPU (``run.device``, or for ``auto`` this machine)."""
    if cfg.run.device.value != "auto":
        return cfg.run.device.value == "cpu"
    import torch

    return not torch.cuda.is_available()


def autocast_bf16(cfg: Config) -> bool:
    """The loop runs bf16 autocast on CUDA; the plan reads that from the declared hardware."""
    if cfg.run.device.value != "auto":
        return cfg.run.device.value == "cuda"
    return cfg.mesh.hardware.name != "cpu"


def offloaded_activation_bytes(cfg: Config, tp: int | None = None, cp: int = 1) -> int:
    """What ``sharding.activation_offload`` keeps in host memory for one rank: the blocks' saved
    activations of one micro batch (the head's logits stay on the device), for the configured AC
    mode (``auto``: as ``none``, the most it can pick), TP degree ``tp`` (default ``sharding.tp``),
    CP degree ``cp``."""
    mode = cfg.sharding.activation_checkpointing
    if mode is ActivationCheckpointing.auto:
        mode = ActivationCheckpointing.none
    if mode is ActivationCheckpointing.budget and cfg.executor.mode is ExecutorMode.eager:
        mode = ActivationCheckpointing.none  # refused by plan; counted as none here
    return _activation_bytes(cfg, tp or max(1, cfg.sharding.tp), mode, head=False, cp=cp)


def _activation_bytes(
    cfg: Config,
    tp: int,
    mode: ActivationCheckpointing,
    layers: int | None = None,
    in_flight: float = 1.0,
    head: bool = True,
    cp: int = 1,
) -> int:
    """Saved activations of one micro batch, per rank.

    Per token and layer the block saves the values its family's record counts
    (``Family.activation_values``; a dense block's are on the order of 10*dim + 3*kv_dim + 4*ffn_dim,
    ``framework.models.parts.layout.dense_saved_values``), scaled by a measured factor per executor
    (see above). Values are bf16 under autocast (CUDA), fp32 on the CPU. Sequence parallelism
    divides it all by the TP degree. ``full`` keeps only each block's input plus one block being
    recomputed; ``selective`` checkpoints every other block; ``selective_op`` keeps, per block, its
    input and the outputs the per-op policy keeps (``op_saved_values``: counted, not fitted, so no
    executor factor; under TP with sequence parallelism the column-parallel outputs and the
    reduce-scatters' are 1/tp, w2's partial sums before their reduce-scatter whole), plus one block's
    recompute. The logits are this TP rank's vocabulary shard (1/tp) under loss parallelism
    (``parallel.loss_parallel``, the default), else the full vocabulary gathered to every TP rank
    (``_TP_LOGIT_EXTRA_BYTES`` more per logit). Context parallelism divides the tokens by its degree (each rank keeps
    its sequence shard); the ring then holds one layer's whole K and V and their gradients
    (torch's default rotation all-gathers them), transient, on top.

    A pipeline rank holds ``layers`` blocks for ``in_flight`` micro batches (framework.planner.stages), and
    the logits of one micro batch only if it runs the ``head`` (its loss and backward follow at once).
    """
    m = cfg.model
    tokens = cfg.train.micro_batch_size * cfg.train.seq_len // cp
    bf16 = autocast_bf16(cfg)
    elem = 2 if bf16 else 4
    compiled = cfg.executor.mode != ExecutorMode.eager
    k = _COMPILED_K if compiled else _EAGER_K
    logit_bytes = _COMPILED_LOGIT_BYTES if loss_head_compiled(cfg) else _EAGER_LOGIT_BYTES
    if not bf16:
        logit_bytes = 12  # fp32 logits, their log-softmax and its gradient
    # The family's own count of what one block saves per token (its record: framework.models).
    per_layer = int(k * tokens * family(m).activation_values(m) * elem) // tp
    # model.float8: the converted Linear layers keep their inputs in float8 (framework.kernels.float8).
    per_layer -= saved_activation_bytes_per_layer(m, tokens, tp) if bf16 else 0
    block_input = tokens * m.dim * elem // tp
    if loss_parallel_on(cfg, tp):
        logits = int(tokens * m.vocab_size * logit_bytes) // tp
    else:
        logits = int(tokens * m.vocab_size * (logit_bytes + (_TP_LOGIT_EXTRA_BYTES if tp > 1 else 0)))
    if m.fused_cross_entropy is not FusedCrossEntropy.none:
        # framework.kernels.fused_ce keeps no logits: a chunk of them (about tokens x dim), the input
        # gradient, and (liger) the fp32 weight gradient and its bf16 copy until backward. An
        # estimate from the kernels' code, not a fit.
        logits = tokens * m.dim * 2 * elem + m.vocab_size * m.dim * 6
    n = m.n_layers if layers is None else layers
    logits = logits if head else 0
    if mode == ActivationCheckpointing.none:
        layers = n * per_layer
    elif mode == ActivationCheckpointing.full:
        layers = n * block_input + per_layer
    elif mode == ActivationCheckpointing.selective_op:
        values = op_saved_values(m, model_spec(m).head_dim)
        if tp > 1:  # the two reduce-scatters' outputs kept besides w2's partial sums (dim each)
            values = (values + m.dim) / tp + m.dim
        layers = n * int(tokens * values * elem) + per_layer
    elif mode == ActivationCheckpointing.budget:
        # Below 1.0 the partitioner's knapsack keeps _BUDGET_KEPT x budget of what the default
        # partition saves (1.0 is the default partition itself), and at least what a full recompute
        # keeps (each block's input); one block's recomputed rest is live in backward.
        budget = cfg.sharding.activation_memory_budget
        share = 1.0 if budget >= 1.0 else _BUDGET_KEPT * budget
        kept = max(block_input, int(share * per_layer))
        layers = n * kept + (per_layer - kept)
    else:
        kept = n - (n + 1) // 2  # odd blocks keep everything, even ones only their input
        layers = kept * per_layer + (n - kept) * block_input + per_layer
    return int(layers * in_flight) + logits + _cp_ring_bytes(cfg, tp, cp)


def _weight_copy_bytes(
    cfg: Config, tp: int, dp_shard: int, ep: int, mode: ActivationCheckpointing, layers: int | None
) -> int:
    """The bf16 copies of the blocks' weights that a compiled backward keeps (``none``: every block;
    ``selective``: the blocks it does not checkpoint), where the peak is at the forward's end (the
    optimizer steps in backward, so no whole gradient lands on top later).

    Under bf16 autocast over fp32 weights the compiled forward casts each weight to bf16 for its
    GEMM and the partitioner saves the copy for the backward's input-gradient GEMM. Measured on one
    H200 (seq 8192, micro 1, no recompute, the optimizer in backward; benchmarks/PERF.md session
    13): Llama-3-8B with 16 and 24 layers peaked 3.91 GiB a block apart where the plan without this
    term said 3.55 (0.36 GiB more a block; the block's bf16 weights are 0.41 GiB), and Qwen3-30B-A3B
    with 8 layers (its 128 experts' bf16 copies 1.1 GiB a block) peaked 84.8 GiB against 75.0
    planned without it. Counted from the weights, not fitted. Not counted: float8 layers (they keep
    their own float8 copy, inside float8's fit), FSDP gathering in bf16 (the gathered weight is
    the GEMM's operand), and a step after backward, whose peak the sum of every gradient and every
    activation already over-counts (the 7B rows of benchmarks/PERF.md's memory table)."""
    if cfg.executor.mode is ExecutorMode.eager or not autocast_bf16(cfg) or not cfg.train.optimizer_in_backward:
        return 0
    if dp_shard > 1 and cfg.sharding.param_dtype is DType.bfloat16:
        return 0
    n = cfg.model.n_layers if layers is None else layers
    kept = n if mode is ActivationCheckpointing.none else n - (n + 1) // 2
    return kept * bf16_weight_copy_bytes_per_layer(cfg.model, tp, ep)


def budget_of(cfg: Config) -> float | None:
    """``sharding.activation_memory_budget`` where it applies (activation_checkpointing=budget), else None."""
    if cfg.sharding.activation_checkpointing is ActivationCheckpointing.budget:
        return cfg.sharding.activation_memory_budget
    return None


def largest_fitting_budget(
    memory: MemoryEstimate, budget: float, low: tuple[float, int] | None = None
) -> float | None:
    """The largest ``activation_memory_budget`` in [``low``'s, ``budget``] under which the plan whose
    ``memory`` was estimated at ``budget`` fits its device, as far as the chord below shows; None
    if even ``low`` does not.

    Only the activations change with the budget (_activation_bytes): each block keeps
    max(its input, _BUDGET_KEPT x budget x what it saves by default), convex in the budget, and
    linear above the kink where the budget's share passes the block input. So the chord from ``low``
    (a budget and its activation bytes; by default ``full``'s activations at 0, above the budget's
    there, which keeps one block input less) to ``budget`` lies above the model in between: where it
    meets the room left on the device, the plan fits (a bound, never an overshoot), and from a
    ``low`` above the kink the chord is the model itself.
    """
    room = memory.device - (memory.total - memory.activations)
    top = memory.activations_by_mode["budget"]
    if memory.activations <= room:
        return budget
    b0, a0 = low if low is not None else (0.0, memory.activations_by_mode["full"])
    if room < a0 or top <= a0:
        return None
    return b0 + (budget - b0) * (room - a0) / (top - a0)


def _cp_ring_bytes(cfg: Config, tp: int, cp: int) -> int:
    """One layer's all-gathered K and V (this TP rank's KV heads, whole sequence) and their
    gradients during the ring's backward: what CP adds while one attention runs."""
    if cp <= 1:
        return 0
    m = cfg.model
    elem = 2 if autocast_bf16(cfg) else 4
    kv = cfg.train.micro_batch_size * cfg.train.seq_len * m.n_kv_heads * model_spec(m).head_dim // tp
    return 2 * 2 * kv * elem


def _moe_tokens(cfg: Config, tp: int, cp: int) -> tuple[int, int]:
    """(top-k, rows one rank dispatches per MoE layer and micro batch: its tokens x top-k); (0, 0)
    for a dense model. A rank's tokens are its micro batch's sequence shard (1/cp) and, with
    sequence parallelism, its 1/tp of those (each TP rank dispatches its own tokens)."""
    k = cfg.model.moe.num_experts_per_tok if num_experts(cfg.model) else 0
    tokens = cfg.train.micro_batch_size * cfg.train.seq_len // cp // tp
    return k, tokens * k


def _dispatch_bytes(cfg: Config, specs: list[ParamSpec], tp: int, cp: int) -> int:
    """Expert parallelism's transient buffers, one MoE layer at a time: ExpertParallel.forward
    (framework.parallel.expert) holds the received rows, their expert-major copy, the experts'
    output and its source-order copy, each (rows x dim) in the activation dtype (an estimate from
    the code, not a fit). 0 without ep."""
    if not any(ep > 1 for _, _, ep, _ in _kinds(specs)):
        return 0
    _, rows = _moe_tokens(cfg, tp, cp)
    elem = 2 if autocast_bf16(cfg) else 4
    return 4 * rows * cfg.model.dim * elem


def _memory(
    cfg: Config,
    specs: list[ParamSpec],
    tp: int,
    dp_shard: int,
    unit_bytes: list[int],
    ddp: bool = False,
    accum: int = 1,
    pipeline: tuple[int, float, bool] | None = None,
    cp: int = 1,
    held: bool = False,
) -> MemoryEstimate:
    """``held``: the FSDP units stay unsharded for the whole step (framework.planner.stages.held_for_step:
    zero-bubble schedules, or sharding.reshard_after_forward=false), so the rank's whole unsharded
    parameters replace the two units in flight."""
    local = sum_local(specs, tp, dp_shard)
    params = local * _MASTER_BYTES
    grads = local * _MASTER_BYTES
    if dp_shard > 1 and accum > 1:
        # The loop skips the reduce-scatter on all but the last micro batch
        # (FSDPModule.set_requires_gradient_sync(False)), so FSDP2 accumulates each unit's
        # unsharded gradient, in param_dtype, until then: this TP rank's whole gradient.
        full = sum_local(specs, tp, 1)
        grads += full * _DTYPE_BYTES[cfg.sharding.param_dtype]
    if cfg.train.optimizer_in_backward and not _whole_model_backward(cfg):
        # Each gradient is freed right after its parameter's step: the largest one, twice (the
        # next parameter's gradient can land before the step of the previous one is done).
        grads = 2 * sum_local(specs, tp, dp_shard, "max") * _MASTER_BYTES
    optimizer = sum_local(specs, tp, dp_shard, "optimizer") * adamw_state_bytes(cfg)
    comm_buffers = 0
    if dp_shard > 1:
        # The unit being computed plus the one prefetched (param_dtype), and one unit's unsharded
        # gradient before its reduce-scatter (reduce_dtype).
        biggest = max(unit_bytes) // _MASTER_BYTES
        p_el, r_el = _DTYPE_BYTES[cfg.sharding.param_dtype], _DTYPE_BYTES[cfg.sharding.reduce_dtype]
        comm_buffers = biggest * (2 * p_el + r_el)
        if held:
            comm_buffers = sum_local(specs, tp, 1) * p_el + biggest * r_el
    comm_buffers += _dispatch_bytes(cfg, specs, tp, cp)
    if ddp:
        # DDP's gradient buckets stay allocated between steps (grads are views into them), so they
        # coexist with the activations: llama1b with DDP on 2 H200s peaked 7.6 GiB above the same
        # micro-batch on one GPU without DDP (benchmarks/PERF.md); the buckets are 4.6 GiB of it.
        comm_buffers = grads
    layers, in_flight, head = pipeline if pipeline is not None else (None, 1.0, True)
    by_mode = {
        mode.value: _activation_bytes(cfg, tp, mode, layers, in_flight, head, cp)
        for mode in ActivationCheckpointing
        if mode != ActivationCheckpointing.auto
    }
    ep = _ep_of(specs)
    for mode in (ActivationCheckpointing.none, ActivationCheckpointing.selective):
        by_mode[mode.value] += _weight_copy_bytes(cfg, tp, dp_shard, ep, mode, layers)
    if cfg.executor.mode == ExecutorMode.eager:
        del by_mode[ActivationCheckpointing.budget.value]  # compiled executors only
    acts = by_mode[cfg.sharding.activation_checkpointing.value]
    if cfg.sharding.activation_offload:
        # framework.parallel.activation.apply_offload: the blocks' saved tensors live in host memory;
        # the device holds the block being computed (or recomputed) and the head's logits.
        mode = cfg.sharding.activation_checkpointing
        acts = min(acts, _activation_bytes(cfg, tp, mode, 1, 1.0, head, cp))
    total = params + grads + optimizer + comm_buffers + acts
    device = int(cfg.mesh.hardware.memory_gib * GIB)
    state = "bf16" if bf16_moments(cfg) else "fp32"
    return MemoryEstimate(params, grads, optimizer, comm_buffers, acts, by_mode, total, device, state)


# ----------------------------------------------------------------------------------------------
# Communication (alpha-beta) and bucketing
# ----------------------------------------------------------------------------------------------


def _axis_is_intra_node(sizes: tuple[int, ...], index: int, ppn: int) -> bool:
    """Every group of this axis lies in one node iff size * stride divides procs per node."""
    stride = math.prod(sizes[index + 1 :])
    span = sizes[index] * stride
    return sizes[index] == 1 or (span <= ppn and ppn % span == 0)


def _link(cfg: Config, intra: bool) -> tuple[float, float]:
    """(alpha seconds, beta bytes/s) of the link an axis uses."""
    hw = cfg.mesh.hardware
    if intra:
        return hw.intra_node_latency_us * 1e-6, hw.intra_node_gbps * 1e9
    return hw.inter_node_latency_us * 1e-6, hw.inter_node_gbps * 1e9


def _collective(
    cfg: Config, axis: str, kind: str, n: int, intra: bool, calls: int, payload: int
) -> CommEstimate:
    """Ring collectives: all-reduce (any ``kind`` naming one: ``aux_all_reduce``, ``bias_all_reduce``)
    sends 2(n-1)/n of the payload in 2(n-1) steps; all-gather and reduce-scatter send (n-1)/n in n-1
    steps."""
    alpha, beta = _link(cfg, intra)
    ring = "all_reduce" in kind
    steps, factor = (2 * (n - 1), 2 * (n - 1) / n) if ring else (n - 1, (n - 1) / n)
    per_call = steps * alpha + factor * payload / beta
    volume = int(factor * payload * calls)
    return CommEstimate(
        axis, kind, n, "intra" if intra else "inter", calls, payload, volume, per_call * calls
    )


def _ddp_buckets(specs: list[ParamSpec], cap_bytes: int, tp: int) -> list[int]:
    """DDP's steady-state buckets: gradients in ready order (parameter order reversed), a bucket
    closes once it reaches ``bucket_cap_mb`` (the Reducer rebuilds to this after the first step)."""
    sizes, cur = [], 0
    for s in reversed(specs):
        cur += local_numel(s, tp, 1) * _MASTER_BYTES
        if cur >= cap_bytes:
            sizes.append(cur)
            cur = 0
    if cur:
        sizes.append(cur)
    return sizes


def _fsdp_units(specs: list[ParamSpec], tp: int) -> list[int]:
    """Unsharded fp32 bytes of each FSDP unit: one per block, then the root (embeddings, norm, output;
    a pipeline rank holding both the first and the last stage has two roots, ``_rank_specs``)."""
    return list(_MEMO.get(specs, ("units", tp), lambda: tuple(_unit_bytes(specs, tp))))


def _unit_bytes(specs: list[ParamSpec], tp: int) -> list[int]:
    units: dict[str, int] = {}
    for s in specs:
        units[s.unit] = units.get(s.unit, 0) + local_numel(s, tp, 1) * _MASTER_BYTES
    roots = [units.pop(name) for name in ("root", _HEAD_ROOT) if name in units]
    return [*units.values(), *roots]


def _auto_bucket(cfg: Config, grad_bytes: int, n: int, intra: bool) -> tuple[float, str]:
    """Bucket size minimising exposed all-reduce time under the alpha-beta model.

    With k buckets the latency cost is k * 2(n-1) * alpha and the last bucket's transfer,
    2(n-1)/n * M/(k * beta), cannot overlap backward. Their sum is smallest at
    M/k = sqrt(M * n * alpha * beta).
    """
    alpha, beta = _link(cfg, intra)
    link = "intra-node" if intra else "inter-node"
    if n == 1:
        return cfg.bucketing.bucket_cap_mb, (
            f"auto: dp degree 1, no all-reduce; kept bucket_cap_mb={cfg.bucketing.bucket_cap_mb:g}"
        )
    best = math.sqrt(grad_bytes * n * alpha * beta) / MIB
    chosen = round(min(max(best, AUTO_BUCKET_MIN_MB), AUTO_BUCKET_MAX_MB), 2)
    return chosen, (
        f"auto: alpha-beta model of dp_replicate ({link}, n={n}, alpha={alpha * 1e6:g} us, "
        f"beta={beta / 1e9:g} GB/s, grads {grad_bytes / MIB:.1f} MiB): sqrt(M*n*alpha*beta) = "
        f"{best:.2f} MiB balances per-bucket latency against the exposed last bucket; "
        f"clamped to [{AUTO_BUCKET_MIN_MB:g}, {AUTO_BUCKET_MAX_MB:g}] -> {chosen:g}"
    )


def _comm(
    cfg: Config,
    specs: list[ParamSpec],
    sizes: tuple[int, ...],
    axes: tuple[MeshAxis, ...],
    accum: int,
    num_buckets: int,
    units: list[int],
    ddp: bool,
    layers: int | None = None,
    held: bool = False,
) -> list[CommEstimate]:
    """Per optimizer step. FSDP all-gathers every unit in forward and (with reshard_after_forward) again
    in backward, once per micro batch (once per step where ``held``: units kept unsharded for the
    step, framework.planner.stages.held_for_step), and reduce-scatters its gradient once per step (the loop
    turns gradient sync off on all but the last micro batch); replicated gradients are all-reduced
    once per step (DDP's no_sync, or HSDP after the reduce-scatter); TP with sequence parallelism
    all-gathers and reduce-scatters each block's activations twice forward and twice backward."""
    ppn = cfg.mesh.procs_per_node
    out: list[CommEstimate] = []
    size = dict(zip(axes, sizes, strict=True))
    intra = {a: _axis_is_intra_node(sizes, i, ppn) for i, a in enumerate(axes)}
    tp = size.get(MeshAxis.tp, 1)
    cp = size.get(MeshAxis.cp, 1)
    # FSDP2 shards over dp_shard x cp (one flattened group) when CP is on.
    shard = size.get(MeshAxis.dp_shard, 1) * cp
    shard_axis = "dp_shard_cp" if cp > 1 else "dp_shard"
    if cp > 1:
        intra[MeshAxis.dp_shard] = _group_is_intra_node(sizes, axes, (MeshAxis.dp_shard, MeshAxis.cp), ppn)
    p_el, r_el = _DTYPE_BYTES[cfg.sharding.param_dtype], _DTYPE_BYTES[cfg.sharding.reduce_dtype]
    full_local = sum_local(specs, tp, 1)  # one TP rank's unsharded parameters
    # Expert stacks under ep are gathered over their own group, dp_shard x cp / ep ranks.
    expert_local = sum_local(specs, tp, 1, "experts")
    ep = _ep_of(specs)
    groups = [(shard_axis, shard, full_local - expert_local)]
    if expert_local:
        groups.append(("dp_shard_mod_ep", max(1, shard // ep), expert_local))
    ag_calls = len(units) * (1 if held else accum * (2 if cfg.sharding.reshard_after_forward else 1))
    for axis, n, numel in groups:
        if n <= 1:
            continue
        avg_unit = numel // len(units)
        out.append(
            _collective(cfg, axis, "all_gather", n, intra[MeshAxis.dp_shard], ag_calls, avg_unit * p_el)
        )
        out.append(
            _collective(
                cfg,
                axis,
                "reduce_scatter",
                n,
                intra[MeshAxis.dp_shard],
                len(units),  # once per step: the loop skips it on all but the last micro batch
                avg_unit * r_el,
            )
        )
    rep = size.get(MeshAxis.dp_replicate, 1)
    if rep > 1:
        if ddp:
            per = full_local * _MASTER_BYTES // num_buckets
            out.append(
                _collective(
                    cfg, "dp_replicate", "all_reduce", rep, intra[MeshAxis.dp_replicate], num_buckets, per
                )
            )
        else:  # HSDP: each unit's reduce-scattered gradient shard is all-reduced across replicas
            per = sum_local(specs, tp, shard) // len(units) * r_el
            out.append(
                _collective(
                    cfg,
                    "dp_replicate",
                    "all_reduce",
                    rep,
                    intra[MeshAxis.dp_replicate],
                    len(units),  # with the reduce-scatter, on the last micro batch only
                    per,
                )
            )
    if tp > 1:
        out += _tp_comm(cfg, tp, cp, intra[MeshAxis.tp], accum, layers)
    if cp > 1:
        out += _cp_comm(cfg, cp, intra[MeshAxis.cp], accum, tp, layers)
    if ep > 1:
        out += _ep_comm(cfg, ep, tp, cp, accum, layers)
    out += _aux_comm(cfg, sizes, axes, accum, layers)
    out += _bias_comm(cfg, sizes, axes, layers)
    return out


def _tp_comm(cfg: Config, tp: int, cp: int, intra_tp: bool, accum: int, layers: int | None) -> list[CommEstimate]:
    """TP with sequence parallelism: each block's activations all-gathered and reduce-scattered twice
    forward and twice backward (again in a recomputed forward), and the loss's collectives."""
    out: list[CommEstimate] = []
    elem = 2 if autocast_bf16(cfg) else 4  # activations are in the autocast dtype
    tokens = cfg.train.micro_batch_size * cfg.train.seq_len // cp  # a CP rank's sequence shard
    act = tokens * cfg.model.dim * elem
    # 2 forward + 2 backward, each kind, and 2 more in each recomputed forward (activation
    # checkpointing); a pipeline rank runs only its own blocks.
    n = cfg.model.n_layers if layers is None else layers
    mode = cfg.sharding.activation_checkpointing
    recomputed = {ActivationCheckpointing.full: n, ActivationCheckpointing.selective: (n + 1) // 2}
    # selective_op keeps the reduce-scatters' outputs and re-gathers (every block's two
    # all-gathers run again in its recompute).
    gathers = n if mode == ActivationCheckpointing.selective_op else recomputed.get(mode, 0)
    ag_calls = (n * 4 + gathers * 2) * accum
    rs_calls = (n * 4 + recomputed.get(mode, 0) * 2) * accum
    out.append(_collective(cfg, "tp", "all_gather", tp, intra_tp, ag_calls, act))
    out.append(_collective(cfg, "tp", "reduce_scatter", tp, intra_tp, rs_calls, act))
    if loss_parallel_on(cfg, tp):
        # Loss parallelism: three all-reduces of one fp32 value per token in the loss's forward
        # (the max, the sum of exponentials, the target's logit), none in backward.
        loss = tokens * 4
        out.append(_collective(cfg, "tp", "all_reduce", tp, intra_tp, 3 * accum, loss))
    else:
        # The output projection gathers the full logits for the loss, once per micro batch.
        logits = tokens * cfg.model.vocab_size * elem
        out.append(_collective(cfg, "tp", "all_gather_logits", tp, intra_tp, accum, logits))
    return out


def _ep_comm(cfg: Config, ep: int, tp: int, cp: int, accum: int, layers: int | None) -> list[CommEstimate]:
    """Expert parallelism's all-to-alls (framework.parallel.expert): in every MoE layer's forward the
    rank's routed rows go out to their experts' ranks (dispatch) and come back (combine), and the
    backward runs both in reverse; a recomputed forward (activation checkpointing) runs them again.
    Each carries the rank's rows x top-k x dim in the activation dtype, (ep - 1) / ep of it off the
    rank (a perfectly balanced router; the per-expert counts exchanged first are E integers, in the
    latency term). The ep group is ep consecutive ranks of dp_shard x cp, tp apart (layout.check_ep)."""
    n = cfg.model.n_layers if layers is None else layers
    _, rows = _moe_tokens(cfg, tp, cp)
    elem = 2 if autocast_bf16(cfg) else 4
    payload = rows * cfg.model.dim * elem
    span, ppn = ep * tp, cfg.mesh.procs_per_node
    intra = span <= ppn and ppn % span == 0
    mode = cfg.sharding.activation_checkpointing
    recomputed = {ActivationCheckpointing.full: n, ActivationCheckpointing.selective: (n + 1) // 2}
    forward = 2 * (n + recomputed.get(mode, 0)) * accum
    backward = 2 * n * accum
    return [
        _collective(cfg, "ep", "all_to_all", ep, intra, forward, payload),
        _collective(cfg, "ep", "all_to_all_backward", ep, intra, backward, payload),
    ]


def _aux_comm(
    cfg: Config, sizes: tuple[int, ...], axes: tuple[MeshAxis, ...], accum: int, layers: int | None
) -> list[CommEstimate]:
    """The load-balancing loss's all-reduce (``model.moe.router_aux_loss_coef > 0``): each forward
    sums the MoE layers' expert counts, probability sums and token counts over the ranks holding the
    step's other tokens (framework.parallel.mesh.token_group: dp_replicate x dp_shard x cp, flattened
    as ``dp_tokens``; tp and pp ranks see the same tokens) in one fp32 all-reduce, autograd's: its
    backward all-reduces the gradient of the same size. ``aux_loss_scope=global``
    (framework.models.moe.load_balancing_loss) sends the layer-summed 2 E + 1 values; ``layer``
    (``layer_balancing_loss``, and always under a pipeline: framework.launch.entry.
    aux_scope_under_pipeline) sends 2 E + 1 per layer. Once per micro batch, outside the checkpointed
    blocks (the model's head computes it: never recomputed); under a pipeline once per stage a rank
    holds (each stage's output carries its layers' share: moe.AuxLossAutoScaler). Nothing on one
    data-parallel rank (token_group is None)."""
    experts = num_experts(cfg.model)
    if not experts or cfg.model.moe.router_aux_loss_coef <= 0:
        return []
    size = dict(zip(axes, sizes, strict=True))
    group, ranks = _token_group(size)
    if ranks <= 1:
        return []
    pp = size.get(MeshAxis.pp, 1)
    stages = cfg.parallel.pp_stages_per_rank if pp > 1 else 1
    per_layer = pp > 1 or cfg.model.moe.aux_loss_scope.name == "layer"
    n = cfg.model.n_layers if layers is None else layers  # every block of an MoE family is sparse
    values = (2 * experts + 1) * (n // stages if per_layer else 1)
    intra = _group_is_intra_node(sizes, axes, group, cfg.mesh.procs_per_node)
    calls = accum * stages
    return [
        _collective(cfg, "dp_tokens", "aux_all_reduce", ranks, intra, calls, values * 4),
        _collective(cfg, "dp_tokens", "aux_all_reduce_backward", ranks, intra, calls, values * 4),
    ]


def _token_group(size: dict[MeshAxis, int]) -> tuple[tuple[MeshAxis, ...], int]:
    """The axes and ranks of framework.parallel.mesh.token_group (``dp_tokens``): dp_replicate x
    dp_shard x cp, those of more than one rank; tp and pp ranks hold the same tokens."""
    group = tuple(a for a in (*DP_AXES, MeshAxis.cp) if size.get(a, 1) > 1)
    return group, math.prod(size[a] for a in group)


# The sigmoid router's per-expert counts are int64 (framework.models.moe.sort_by_expert scatter-adds
# into the dtype of torch.topk's indices); the bias update all-reduces them as they are.
_EXPERT_COUNT_BYTES = 8


def _bias_comm(
    cfg: Config, sizes: tuple[int, ...], axes: tuple[MeshAxis, ...], layers: int | None
) -> list[CommEstimate]:
    """The sigmoid routers' bias update (DeepSeek-V3's aux-loss-free balancing: ``model.moe.
    router_score=sigmoid`` with ``bias_update_rate > 0``): after each optimizer step (an optimizer
    step post-hook, framework.train.runner._update_biases) every MoE layer a rank holds sums the step's
    tokens per expert over ``dp_tokens`` (framework.models.parts.sparse.update_expert_biases: one
    ``dist.all_reduce`` of E int64 per layer, one layer after another), so that every data-parallel
    replica moves its biases alike. Once per step, not per micro batch (the counts accumulate over
    the step's forwards); under a pipeline each rank sums its own stages' layers. Nothing where the
    router is softmax (no bias), the rate is 0 (no hook) or one rank holds the step's tokens
    (token_group is None)."""
    moe = cfg.model.moe
    experts = num_experts(cfg.model)
    if not experts or moe.router_score is not RouterScore.sigmoid or moe.bias_update_rate <= 0:
        return []
    size = dict(zip(axes, sizes, strict=True))
    group, ranks = _token_group(size)
    if ranks <= 1:
        return []
    n = cfg.model.n_layers if layers is None else layers  # every block of an MoE family is sparse
    intra = _group_is_intra_node(sizes, axes, group, cfg.mesh.procs_per_node)
    return [_collective(cfg, "dp_tokens", "bias_all_reduce", ranks, intra, n, experts * _EXPERT_COUNT_BYTES)]


def _cp_comm(
    cfg: Config, cp: int, intra: bool, accum: int, tp: int, layers: int | None = None
) -> list[CommEstimate]:
    """Ring attention's K/V passes (torch's context_parallel): in every layer's forward each rank
    receives the other cp-1 shards of K and V (an all-gather's volume, whether rotated by
    all-gather or passed around the ring); its backward passes them again and sends the K/V
    gradients back (a reduce-scatter's volume). A fully checkpointed forward runs, and passes,
    again; selective checkpointing recomputes every other block; selective_op every block's
    passes (it keeps the attention kernels' outputs, not the gathered K and V the recompute gathers
    again). A pipeline rank (``layers``) runs
    only its own blocks, for each of its micro batches (``accum``)."""
    m = cfg.model
    n = m.n_layers if layers is None else layers
    elem = 2 if autocast_bf16(cfg) else 4
    kv = 2 * cfg.train.micro_batch_size * cfg.train.seq_len * m.n_kv_heads * model_spec(m).head_dim // tp
    mode = cfg.sharding.activation_checkpointing
    recomputed = {
        ActivationCheckpointing.full: n,
        ActivationCheckpointing.selective: (n + 1) // 2,
        ActivationCheckpointing.selective_op: n,
    }
    forward = (n + recomputed.get(mode, 0)) * accum
    backward = n * accum
    return [
        _collective(cfg, "cp", "kv_ring_forward", cp, intra, forward, kv * elem),
        _collective(cfg, "cp", "kv_ring_backward", cp, intra, backward, kv * elem),
        _collective(cfg, "cp", "dkv_ring_backward", cp, intra, backward, kv * elem),
    ]


def _group_is_intra_node(
    sizes: tuple[int, ...], axes: tuple[MeshAxis, ...], group: tuple[MeshAxis, ...], ppn: int
) -> bool:
    """Whether one group over the adjacent mesh axes ``group`` (flattened) lies in one node."""
    last = max(axes.index(a) for a in group)
    stride = math.prod(sizes[last + 1 :])
    span = stride * math.prod(sizes[axes.index(a)] for a in group)
    return span <= ppn and ppn % span == 0


# ----------------------------------------------------------------------------------------------
# make_plan
# ----------------------------------------------------------------------------------------------


def with_degrees(cfg: Config, d: Degrees) -> Config:
    """``cfg`` with its layout written as explicit ``parallel.*`` degrees (what config.yaml records)."""
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **dataclasses.asdict(d)))


def needs_search(cfg: Config) -> bool:
    """Whether the planner chooses part of the layout: the degrees (``sharding=auto`` without
    ``parallel.*``) or the activation checkpointing (``sharding.activation_checkpointing=auto``)."""
    return fixed_degrees(cfg) is None or cfg.sharding.activation_checkpointing == ActivationCheckpointing.auto


def explicit_degrees_equal(cfg: Config, d: Degrees) -> bool:
    return all(getattr(cfg.parallel, k) == v for k, v in dataclasses.asdict(d).items())


def plan_for(cfg: Config, d: Degrees, *, check_memory: bool = True) -> Plan:
    """The plan of one concrete layout: ``cfg`` has a micro batch and an activation checkpointing
    mode; ``d`` are its degrees. ``check_memory=False`` (the search) reports a layout that does not
    fit instead of refusing it."""
    check_mesh(cfg)
    warnings: list[str] = []
    world = cfg.mesh.world_size
    assert d.world_size == world, (d, cfg.mesh.shape)
    check_degrees(d, cfg.model, world)
    check_cp(d, cfg, runs_on_cpu(cfg))
    axes_sizes = d.axes()
    axes = tuple(a for a, _ in axes_sizes)
    sizes = tuple(n for _, n in axes_sizes)
    placement = axis_placement(sizes, tuple(a.value for a in axes), cfg.mesh)
    size = dict(zip(axes, sizes, strict=True))
    tp, dp, shard = d.tp, d.dp, d.fsdp_shard
    _check_executor(cfg, d)
    pipeline_stages.check_pipeline(cfg, d.pp, dp)
    accum = _check_batch(cfg, dp)
    _check_in_backward(cfg, accum)
    warnings += _layout_warnings(cfg, d, sizes, axes)
    # Fields of another option (activation_memory_budget without budget, executor.autotune or
    # cache_dir on eager) are refused before launch: framework.launch.rules.check_option_fields.
    specs = param_specs(cfg.model, d.ep)
    num_params = model_spec(cfg.model).numel[0]
    pipe = _pipeline(cfg, d, specs, tp, shard, accum) if d.pp > 1 else None
    if pipe is not None:  # the busiest pp rank's parameters, blocks and activations
        specs, memory = pipe.specs, pipe.memory
        units = _fsdp_units(specs, tp)
    else:
        units = _fsdp_units(specs, tp)
        held = pipeline_stages.held_for_step(cfg, d.pp)
        memory = _memory(cfg, specs, tp, shard, units, ddp=d.ddp, accum=accum, cp=d.cp, held=held)

    cap, reason, buckets = _buckets(cfg, d, specs, units, sizes, size, warnings)
    held = pipeline_stages.held_for_step(cfg, d.pp)
    comm = _comm(cfg, specs, sizes, axes, accum, len(buckets), units, d.ddp, pipe and pipe.layers, held)
    if pipe is not None:
        comm.append(_pp_send_recv(cfg, d, sizes, axes, accum))
        comm += _pp_tied(cfg, d, sizes, axes, pipe.ranks)
    prediction = predict_step(
        cfg,
        d,
        comm,
        accum,
        units,
        pipeline=(pipe.fraction, pipe.bubble) if pipe is not None else None,
        local_params=sum_local(specs, tp, shard),
        offload_bytes=offloaded_activation_bytes(cfg, tp, d.cp) if cfg.sharding.activation_offload else 0,
    )
    if check_memory and memory.total > memory.device and not (cfg.run.dry_run or cfg.run.allow_over_memory):
        _check_held_fits(cfg, d, memory)
    _check_fits(cfg, d, memory, check_memory, warnings)
    return Plan(
        world_size=world,
        nodes=cfg.mesh.nodes,
        procs_per_node=cfg.mesh.procs_per_node,
        strategy=d.name(),
        degrees=dataclasses.asdict(d),
        mesh_shape=sizes,
        mesh_axes=tuple(a.value for a in axes),
        placement=placement,
        dp_degree=dp,
        tp_degree=tp,
        micro_batch_size=cfg.train.micro_batch_size,
        global_batch_size=cfg.train.global_batch_size,
        grad_accum_steps=accum,
        seq_len=cfg.train.seq_len,
        num_params=num_params,
        params_per_rank=sum_local(specs, tp, shard),  # the busiest pp rank's
        activation_checkpointing=cfg.sharding.activation_checkpointing.value,
        memory=memory,
        comm=tuple(comm),
        comm_time_s=sum(c.time_s for c in comm),
        bucket_cap_mb=cap,
        bucket_reason=reason,
        bucket_sizes=tuple(buckets),
        prediction=prediction,
        warnings=tuple(warnings),
        **(pipe.fields() if pipe is not None else {}),
        loss_parallel=loss_parallel_on(cfg, tp),
        activation_memory_budget=budget_of(cfg),
    )


def _layout_warnings(
    cfg: Config, d: Degrees, sizes: tuple[int, ...], axes: tuple[MeshAxis, ...]
) -> list[str]:
    """What runs but is probably not what the user meant: TP over nodes, settings that do nothing."""
    warnings: list[str] = []
    tp = d.tp
    if tp > 1 and not _axis_is_intra_node(sizes, axes.index(MeshAxis.tp), cfg.mesh.procs_per_node):
        warnings.append(
            f"tp axis (size {tp}) spans nodes (procs per node {cfg.mesh.procs_per_node}): TP runs over "
            f"the inter-node link; use a tp degree that divides {cfg.mesh.procs_per_node}"
        )
    if cfg.train.optimizer_in_backward and _whole_model_backward(cfg):
        warnings.append(
            "train.optimizer_in_backward with executor.scope=model: the one compiled backward hands "
            "out every gradient at once, so no gradient memory is saved and no update overlaps the "
            "backward; use executor.scope=block"
        )
    if not cfg.parallel.loss_parallel and tp == 1:
        warnings.append(
            "parallel.loss_parallel=false does nothing without tensor parallelism (tp=1): every rank "
            "holds the whole vocabulary's logits either way"
        )
    if cfg.sharding.strategy.value == "hsdp" and cfg.mesh.nodes == 1 and fixed_degrees(cfg) == d:
        warnings.append("sharding=hsdp on one node has dp_replicate=1: it is fsdp")
    if not d.fsdp and (
        cfg.sharding.param_dtype != DType.float32 or cfg.sharding.reduce_dtype != DType.float32
    ):
        warnings.append(
            f"sharding.param_dtype / reduce_dtype are ignored without FSDP ({d.name()}; FSDP2 mixed "
            f"precision only)"
        )
    return warnings


def _buckets(
    cfg: Config,
    d: Degrees,
    specs: list[ParamSpec],
    units: list[int],
    sizes: tuple[int, ...],
    size: dict[MeshAxis, int],
    warnings: list[str],
) -> tuple[float, str, list[int]]:
    """(bucket_cap_mb, why, bucket sizes): DDP's buckets by the cap (``bucketing.auto`` picks it from
    the alpha-beta model), or FSDP2's units, which communicate one by one."""
    tp, shard = d.tp, d.fsdp_shard
    full_local_bytes = sum_local(specs, tp, 1) * _MASTER_BYTES
    rep = size.get(MeshAxis.dp_replicate, 1)
    if not d.fsdp:
        if cfg.bucketing.auto:
            intra = _axis_is_intra_node(sizes, 0, cfg.mesh.procs_per_node)
            cap, reason = _auto_bucket(cfg, full_local_bytes, rep, intra)
        else:
            cap, reason = (
                cfg.bucketing.bucket_cap_mb,
                f"bucketing.bucket_cap_mb={cfg.bucketing.bucket_cap_mb:g}",
            )
        buckets = _ddp_buckets(specs, int(cap * MIB), tp)
    else:
        cap = cfg.bucketing.bucket_cap_mb
        reason = f"{d.name()}: FSDP2 communicates per unit (one per block + root); bucket_cap_mb unused"
        if cfg.bucketing.auto:
            warnings.append(f"bucketing.auto does nothing under {d.name()} (dp_shard={shard}): {reason}")
        buckets = units
    return cap, reason, buckets


def _check_fits(
    cfg: Config, d: Degrees, memory: MemoryEstimate, check_memory: bool, warnings: list[str]
) -> None:
    """Refuse a launch whose per-rank memory estimate exceeds the device (or warn, see below)."""
    # Units held for the step by the user's sharding.reshard_after_forward=false (not a zero-bubble
    # schedule's own need): say what it costs and that resharding would free it.
    held = not cfg.sharding.reshard_after_forward and d.fsdp_shard > 1
    held_msg = (
        f", of it FSDP units held unsharded for the step {memory.comm_buffers / GIB:.1f}: "
        f"sharding.reshard_after_forward=true frees them"
        if held
        else ""
    )
    mem_msg = (
        f"needs {memory.total / GIB:.1f} GiB per rank, device has {cfg.mesh.hardware.memory_gib:g} "
        f"(params {memory.params / GIB:.1f}, grads {memory.grads / GIB:.1f}, optimizer "
        f"{memory.optimizer / GIB:.1f}, activations {memory.activations / GIB:.1f}, comm buffers "
        f"{memory.comm_buffers / GIB:.1f}{held_msg}): use sharding=auto "
        f"(the planner's choice), a larger parallel.dp_shard or parallel.tp, "
        f"sharding.activation_checkpointing=full, or a smaller train.micro_batch_size{moments_hint(cfg, memory)}"
    )
    if memory.total > memory.device:
        # A dry run is for planning layouts, including ones that do not fit: it reports; a launch
        # would run for minutes toward an out-of-memory kill, so it is refused unless asked for.
        # The search (check_memory=False) ranks layouts that do not fit instead of refusing them.
        if check_memory and not (cfg.run.dry_run or cfg.run.allow_over_memory):
            raise ValueError(
                f"mesh.hardware.memory_gib={cfg.mesh.hardware.memory_gib:g} "
                f"(mesh.hardware.name={cfg.mesh.hardware.name}) is too small for {d.short()}: {mem_msg}; "
                f"or set the real mesh.hardware.memory_gib, or run.allow_over_memory=true to launch anyway"
            )
        warnings.append(mem_msg)


def moments_hint(cfg: Config, memory: MemoryEstimate) -> str:
    """What ``optimizer.state_dtype=bfloat16`` would take off a plan that does not fit (AdamW's fp32
    moments only): the one memory lever that changes no layout, named with its cost (numerics)."""
    if bf16_moments(cfg) or cfg.optimizer.name is not OptimizerName.adamw or memory.optimizer == 0:
        return ""
    return (
        f", or optimizer.state_dtype=bfloat16 (AdamW's moments in bf16: {memory.optimizer / 2 / GIB:.1f} "
        f"GiB less per rank; other numerics, docs/configuration.md)"
    )


def _check_held_fits(cfg: Config, d: Degrees, memory: MemoryEstimate) -> None:
    """Refuse ``sharding.reshard_after_forward=false`` where the units it holds unsharded for the
    step are what does not fit: the layout resharding after each forward fits. One line with the
    memory per rank each policy needs against the device's. Not for a zero-bubble schedule (it
    holds its units whatever the setting: framework.planner.stages.held_for_step) or a layout
    without FSDP sharding (the setting changes nothing there); a layout too large either way gets
    ``_check_fits``'s refusal."""
    if cfg.sharding.reshard_after_forward or d.fsdp_shard == 1:
        return
    if d.pp > 1 and cfg.parallel.pp_schedule in pipeline_stages.ZERO_BUBBLE:
        return
    resharded = dataclasses.replace(cfg, sharding=dataclasses.replace(cfg.sharding, reshard_after_forward=True))
    other = plan_for(resharded, d, check_memory=False).memory
    if other.total > other.device:
        return
    device = cfg.mesh.hardware.memory_gib
    raise ValueError(
        f"sharding.reshard_after_forward=false holds {d.short()}'s FSDP units unsharded for the step: "
        f"needs {memory.total / GIB:.1f} GiB per rank (of it FSDP units held unsharded for the step "
        f"{memory.comm_buffers / GIB:.1f}), device has {device:g} (mesh.hardware.memory_gib, "
        f"mesh.hardware.name={cfg.mesh.hardware.name}); valid here: sharding.reshard_after_forward=true "
        f"({other.total / GIB:.1f} GiB per rank: each unit gathered per micro batch), or "
        f"run.allow_over_memory=true to launch anyway"
    )


@dataclass(frozen=True)
class _Pipeline:
    """The planned pipeline of one layout, and its busiest rank (framework.planner.stages)."""

    schedule: str
    microbatches: int
    stages_per_rank: int
    split: tuple[tuple[int, int], ...]
    ranks: tuple[tuple[int, ...], ...]
    specs: list[ParamSpec]  # the busiest rank's parameters
    layers: int  # its blocks
    memory: MemoryEstimate  # the rank with the most memory
    fraction: float  # the busiest rank's share of the model's cost
    bubble: float

    def fields(self) -> dict[str, Any]:
        return {
            "pp_schedule": self.schedule,
            "pp_microbatches": self.microbatches,
            "pp_stages_per_rank": self.stages_per_rank,
            "pp_split": self.split,
            "pp_ranks": self.ranks,
            "pp_bubble": self.bubble,
        }


# The FSDP unit of the last stage's final norm and output projection, where the rank also holds the
# first stage (whose root unit is the embedding): two roots, two all-gathers.
_HEAD_ROOT = "root.head"


def tied_copy(m: ModelConfig) -> ParamSpec | None:
    """Under pp, the last stage's copy of a tied embedding (framework.parallel.pipeline): a
    parameter and a gradient like the embedding's, no optimizer state. None when untied."""
    if not m.tie_embeddings:
        return None
    embedding = next(s for s in param_specs(m) if s.name.startswith("tok_embeddings"))
    return dataclasses.replace(embedding, name="output.weight", unit="root", optimizer=False)


def _rank_specs(
    specs: list[ParamSpec], split: tuple[tuple[int, int], ...], ids: list[int], tied: ParamSpec | None
) -> list[ParamSpec]:
    """The parameters of the stages ``ids``: their blocks, the embedding with stage 0, the final norm
    and output projection with the last stage (``tied``: its copy of a tied embedding). Memoized per
    parameter list (the search plans the same split many times): callers do not change the result."""
    return _MEMO.get(specs, ("rank", split, tuple(ids), tied), lambda: _stage_specs(specs, split, ids, tied))


def _stage_specs(
    specs: list[ParamSpec], split: tuple[tuple[int, int], ...], ids: list[int], tied: ParamSpec | None
) -> list[ParamSpec]:
    blocks = {i for s in ids for i in range(*split[s])}
    last = len(split) - 1
    out = []
    for spec in specs:
        if spec.unit.startswith("layers."):
            keep = int(spec.unit.split(".")[1]) in blocks
        elif spec.name.startswith("tok_embeddings"):
            keep = 0 in ids
        else:
            keep = last in ids
        if keep:
            out.append(spec)
    if tied is not None and last in ids:
        out.append(tied)
    if 0 in ids and last in ids and last > 0:  # zbv's V: each stage is fully_shard's root of its own
        out = [
            dataclasses.replace(s, unit=_HEAD_ROOT)
            if s.unit == "root" and not s.name.startswith("tok_embeddings")
            else s
            for s in out
        ]
    return out


def pp_rank_specs(cfg: Config, plan: Plan, pp_rank: int) -> list[ParamSpec]:
    """The parameters pipeline rank ``pp_rank`` holds (its stages'); every one without a pipeline."""
    if plan.layout.pp == 1:
        return param_specs(cfg.model, plan.layout.ep)
    return _rank_specs(
        param_specs(cfg.model, plan.layout.ep), plan.pp_split, list(plan.pp_ranks[pp_rank]), tied_copy(cfg.model)
    )


def pp_rank_param_bytes(cfg: Config, plan: Plan, pp_rank: int) -> int:
    """Bytes of the parameter shards one rank of pipeline rank ``pp_rank`` holds (its stages'), as
    ``MemoryEstimate.params`` counts them; the dry run measures pp rank 0 against it."""
    mine = pp_rank_specs(cfg, plan, pp_rank)
    shard = plan.degrees["dp_shard"] * plan.degrees["cp"]  # FSDP2 shards over dp_shard x cp
    return sum_local(mine, plan.tp_degree, shard) * _MASTER_BYTES


def _pipeline(cfg: Config, d: Degrees, specs: list[ParamSpec], tp: int, shard: int, accum: int) -> _Pipeline:
    p = cfg.parallel
    spr, sched = p.pp_stages_per_rank, p.pp_schedule
    m = pipeline_stages.microbatches(cfg, d.pp, d.dp)
    tokens = cfg.train.global_batch_size * cfg.train.seq_len / d.dp / d.cp  # a CP rank's sequence shard
    split = pipeline_stages.split_layers(cfg, d.pp * spr, tokens)
    ranks = pipeline_stages.rank_stages(d.pp, spr, sched)
    flight = pipeline_stages.in_flight(sched, d.pp, spr, m)
    last = len(split) - 1
    per_rank = []
    for ids in ranks:
        mine = _rank_specs(specs, split, ids, tied_copy(cfg.model))
        layers = sum(split[s][1] - split[s][0] for s in ids)
        # The first rank holds the most micro batches in flight; every rank is costed at that peak.
        mem = _memory(
            cfg,
            mine,
            tp,
            shard,
            _fsdp_units(mine, tp),
            accum=accum,
            pipeline=(layers, flight, last in ids),
            cp=d.cp,
            held=pipeline_stages.held_for_step(cfg, d.pp),
        )
        per_rank.append((mem.total, mine, layers, mem))
    _, mine, layers, memory = max(per_rank, key=lambda t: t[0])
    fraction = pipeline_stages.stage_cost_fraction(split, ranks, cfg, tokens)
    return _Pipeline(
        schedule=sched.value,
        microbatches=m,
        stages_per_rank=spr,
        split=split,
        ranks=tuple(tuple(r) for r in ranks),
        specs=mine,
        layers=layers,
        memory=memory,
        fraction=fraction,
        bubble=pipeline_stages.bubble_fraction(sched, d.pp, spr, m),
    )


def _pp_send_recv(
    cfg: Config, d: Degrees, sizes: tuple[int, ...], axes: tuple[MeshAxis, ...], accum: int
) -> CommEstimate:
    """Point-to-point between neighbouring stages: each micro batch's activations forward and their
    gradient backward, once per stage a rank holds (micro batch x seq/(tp cp) x dim each: under CP
    each rank passes its own sequence shard to the same CP rank of the next stage)."""
    intra = _axis_is_intra_node(sizes, axes.index(MeshAxis.pp), cfg.mesh.procs_per_node)
    alpha, beta = _link(cfg, intra)
    elem = 2 if autocast_bf16(cfg) else 4
    payload = cfg.train.micro_batch_size * cfg.train.seq_len * cfg.model.dim * elem // d.tp // d.cp
    calls = 2 * accum * cfg.parallel.pp_stages_per_rank
    per = alpha + payload / beta
    return CommEstimate(
        "pp", "send_recv", d.pp, "intra" if intra else "inter", calls, payload, payload * calls, per * calls
    )


def _pp_tied(
    cfg: Config,
    d: Degrees,
    sizes: tuple[int, ...],
    axes: tuple[MeshAxis, ...],
    ranks: tuple[tuple[int, ...], ...],
) -> list[CommEstimate]:
    """A tied embedding split over a pipeline (framework.parallel.pipeline.TiedWeight): once per step
    the last stage's copy sends its gradient to the embedding's rank (``dist.reduce`` over their
    group of two) and gets the stepped weight back (``dist.broadcast``), each this rank's fp32
    shard of the vocab x dim weight (TP and FSDP shards). None where one rank holds both (zbv)."""
    tied = tied_copy(cfg.model)
    last = sum(len(r) for r in ranks) - 1
    if tied is None or any(0 in r and last in r for r in ranks):
        return []
    intra = _axis_is_intra_node(sizes, axes.index(MeshAxis.pp), cfg.mesh.procs_per_node)
    alpha, beta = _link(cfg, intra)
    payload = local_numel(tied, d.tp, d.fsdp_shard) * _MASTER_BYTES
    link = "intra" if intra else "inter"
    return [
        CommEstimate("pp", kind, 2, link, 1, payload, payload, alpha + payload / beta)
        for kind in ("tied_reduce", "tied_broadcast")
    ]


def check_world_size(plan: Plan, world_size: int) -> None:
    """Refuse a launch whose real world size is not the one the plan's mesh was made for."""
    if world_size != plan.world_size:
        raise ValueError(
            f"world size {world_size} != product of mesh {list(plan.mesh_shape)} = {plan.world_size}: "
            f"launch {plan.world_size} processes or pick a mesh whose shape multiplies to {world_size}"
        )


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """JSON-ready dict (tuples become lists); ``plan_from_dict`` inverts it. The prediction's
    headline figures are repeated at the top, under the names the search's candidates use."""
    d = dataclasses.asdict(plan)
    d["predicted_step_time_s"] = plan.prediction.step_time_s
    d["predicted_mfu"] = plan.prediction.mfu
    d["memory_gib"] = plan.memory.total / GIB
    return d


def plan_from_dict(d: dict[str, Any]) -> Plan:
    memory = MemoryEstimate(**d["memory"])
    comm = tuple(CommEstimate(**c) for c in d["comm"])
    placement = tuple(Placement(**p) for p in d["placement"])
    prediction = StepPrediction(**d["prediction"])
    derived = ("predicted_step_time_s", "predicted_mfu", "memory_gib", "search")
    rest = {k: v for k, v in d.items() if k not in ("memory", "comm", "placement", "prediction", *derived)}
    for k in ("mesh_shape", "mesh_axes", "bucket_sizes", "warnings"):
        rest[k] = tuple(rest[k])
    for k in ("pp_split", "pp_ranks"):
        rest[k] = tuple(tuple(x) for x in rest.get(k, ()))
    return Plan(memory=memory, comm=comm, placement=placement, prediction=prediction, **rest)


def _gib(b: int) -> str:
    return f"{b / GIB:8.2f} GiB"


def format_plan(plan: Plan) -> str:
    """The table printed once on rank 0 before training."""
    mesh = " x ".join(f"{a}={s}" for a, s in zip(plan.mesh_axes, plan.mesh_shape, strict=True))
    m = plan.memory
    deg = " x ".join(f"{k}={v}" for k, v in plan.degrees.items())
    lines = [
        f"plan: {plan.strategy} on {plan.world_size} ranks ({plan.nodes} node(s) x {plan.procs_per_node})",
        f"  degrees         {deg}",
        f"  mesh            {mesh}",
    ]
    for p in plan.placement:
        lines.append(f"    {p.axis:<13} size {p.size:<5} stride {p.stride:<5} {p.describe()}")
    pr = plan.prediction
    lines += [
        f"  predicted step  {pr.step_time_s * 1e3:.1f} ms (compute {pr.compute_s * 1e3:.1f}, exposed comm "
        f"{pr.exposed_comm_s * 1e3:.1f}, optimizer {pr.optimizer_s * 1e3:.1f}"
        + (f", activation offload {pr.offload_s * 1e3:.1f}" if pr.offload_s else "")
        + f"); MFU {pr.mfu:.1%}, "
        f"{pr.tokens_per_s:,.0f} tokens/s",
        f"  batch           global {plan.global_batch_size} = dp {plan.dp_degree} x micro "
        f"{plan.micro_batch_size} x accum {plan.grad_accum_steps}; seq {plan.seq_len}",
        f"  params          {plan.num_params:,} total, {plan.params_per_rank:,} per rank",
        "  memory per rank",
        f"    params        {_gib(m.params)}",
        f"    grads         {_gib(m.grads)}",
        f"    optimizer     {_gib(m.optimizer)}  (AdamW, 2 {m.optimizer_state} states)",
        f"    comm buffers  {_gib(m.comm_buffers)}",
    ]
    for mode, b in m.activations_by_mode.items():
        mark = "  <- chosen" if mode == plan.activation_checkpointing else ""
        if mode == "budget" and plan.activation_memory_budget is not None:
            mark += f" (sharding.activation_memory_budget={plan.activation_memory_budget:g})"
        lines.append(f"    acts {mode:<9}{_gib(b)}{mark}")
    lines.append(f"    total         {_gib(m.total)}  of {_gib(m.device).strip()} device")
    lines.append(
        "  comm per step   axis         collective               n  link   calls   volume/rank      time"
    )
    for c in plan.comm:
        lines.append(
            f"                  {c.axis:<12} {c.collective:<23} {c.group_size:>3}  {c.link:<5} {c.calls:>6} "
            f"{c.volume_bytes / MIB:>10.1f} MiB {c.time_s * 1e3:>9.2f} ms"
        )
    lines.append(f"                  total {plan.comm_time_s * 1e3:.2f} ms")
    sizes = [round(b / MIB, 2) for b in plan.bucket_sizes]
    shown = sizes if len(sizes) <= 6 else [*sizes[:3], "...", *sizes[-2:]]
    lines.append(f"  buckets         {len(sizes)} of {shown} MiB; bucket_cap_mb={plan.bucket_cap_mb:g}")
    lines.append(f"                  {plan.bucket_reason}")
    if plan.degrees.get("pp", 1) > 1:
        lines.append(
            f"  pipeline        {plan.pp_schedule}, {plan.pp_microbatches} micro batches, "
            f"{plan.pp_stages_per_rank} stage(s) per rank, bubble {plan.pp_bubble:.1%} of compute "
            f"({plan.prediction.bubble_s * 1e3:.1f} ms)"
        )
        lines.append(f"  stages          {_describe_split(plan)}")
    lines += [f"  WARNING: {w}" for w in plan.warnings]
    return "\n".join(lines)


def _describe_split(plan: Plan) -> str:
    return pipeline_stages.describe_split(plan.pp_split, [list(r) for r in plan.pp_ranks])
