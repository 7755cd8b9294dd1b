"""Memory per rank: parameters, gradients, optimizer state, communication buffers and saved
activations, by activation checkpointing mode; and the refusal when a layout does not fit.

Parameter terms are counted from the specs (framework.planner.params); the saved-activation factors
are measured on one GPU (each constant says where). ``rank_memory`` is the one estimate every
layout, pipeline rank and search candidate gets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from framework.config.schema import (
    ActivationCheckpointing,
    CompileScope,
    Config,
    DType,
    ExecutorMode,
    FusedCrossEntropy,
    OptimizerName,
)
from framework.models import model_spec
from framework.models.linears import bf16_weight_copy_bytes_per_layer, saved_activation_bytes_per_layer
from framework.models.parts.layout import op_saved_values
from framework.planner.layout import (
    Degrees,
    loss_head_compiled,
    loss_parallel_on,
    num_experts,
)
from framework.planner.params import (
    DTYPE_BYTES,
    GIB,
    MASTER_BYTES,
    ParamSpec,
    ep_of,
    lora_specs,
    param_kinds,
    sum_local,
)
from framework.planner.work import adamw_state_bytes, bf16_moments


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
# benchmarks/PERF.md). Linear in the budget was 13% over at 0.9 and 17% over on the 7B
# at 0.5; at budget 1.0 (the default partition) the 8B ran out of memory.
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


def whole_model_backward(cfg: Config) -> bool:
    """One compiled region for the whole model: its backward hands out every gradient at once."""
    return cfg.executor.mode != ExecutorMode.eager and cfg.executor.scope == CompileScope.model


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
    return activation_bytes(cfg, tp or max(1, cfg.sharding.tp), mode, head=False, cp=cp)


def activation_bytes(
    cfg: Config,
    tp: int,
    mode: ActivationCheckpointing,
    layers: Sequence[int] | None = None,
    in_flight: float = 1.0,
    head: bool = True,
    cp: int = 1,
) -> int:
    """Saved activations of one micro batch, per rank.

    Per token and layer the block saves the values its layer kind counts (``LayerKind.saved_values``,
    summed over the layers of each kind; a dense block's are on the order of 10*dim + 3*kv_dim + 4*ffn_dim,
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

    A pipeline rank holds the blocks ``layers`` (their indices) for ``in_flight`` micro batches (framework.planner.stages), and
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
    # Each layer kind's own count of what one block saves per token (framework.models.LayerKind),
    # less what model.float8's converted Linear layers keep in float8 (framework.kernels.float8).
    spec = model_spec(m)
    saved = [
        (
            int(k * tokens * kind.saved_values * elem) // tp
            - (saved_activation_bytes_per_layer(m, tokens, tp, spec.first_of(kind)) if bf16 else 0),
            count,
        )
        for kind, count in spec.kinds(layers)
    ]
    every = sum(v * c for v, c in saved)  # all the blocks' saved values
    per_layer = max(v for v, _ in saved)  # one block being (re)computed: the largest kind
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
    n = sum(c for _, c in saved)
    logits = logits if head else 0
    if mode == ActivationCheckpointing.none:
        acts = every
    elif mode == ActivationCheckpointing.full:
        acts = n * block_input + per_layer
    elif mode == ActivationCheckpointing.selective_op:
        values = op_saved_values(m, model_spec(m).head_dim)
        if tp > 1:  # the two reduce-scatters' outputs kept besides w2's partial sums (dim each)
            values = (values + m.dim) / tp + m.dim
        acts = n * int(tokens * values * elem) + per_layer
    elif mode == ActivationCheckpointing.budget:
        # Below 1.0 the partitioner's knapsack keeps _BUDGET_KEPT x budget of what the default
        # partition saves (1.0 is the default partition itself), and at least what a full recompute
        # keeps (each block's input); one block's recomputed rest is live in backward.
        budget = cfg.sharding.activation_memory_budget
        share = 1.0 if budget >= 1.0 else _BUDGET_KEPT * budget
        acts = sum(c * max(block_input, int(share * v)) for v, c in saved)
        acts += per_layer - max(block_input, int(share * per_layer))
    else:
        kept = n - (n + 1) // 2  # odd blocks keep everything, even ones only their input
        acts = kept * every // n + (n - kept) * block_input + per_layer
    return int(acts * in_flight) + logits + _cp_ring_bytes(cfg, tp, cp)


def _weight_copy_bytes(
    cfg: Config,
    tp: int,
    dp_shard: int,
    ep: int,
    mode: ActivationCheckpointing,
    layers: Sequence[int] | None,
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
    if (
        cfg.executor.mode is ExecutorMode.eager
        or not autocast_bf16(cfg)
        or not cfg.train.optimizer_in_backward
    ):
        return 0
    if dp_shard > 1 and cfg.sharding.param_dtype is DType.bfloat16:
        return 0
    spec = model_spec(cfg.model)
    kinds = spec.kinds(layers)
    n = sum(c for _, c in kinds)
    kept = n if mode is ActivationCheckpointing.none else n - (n + 1) // 2
    copies = [(bf16_weight_copy_bytes_per_layer(cfg.model, tp, ep, spec.first_of(k)), c) for k, c in kinds]
    if len(copies) == 1:
        return kept * copies[0][0]
    return kept * sum(b * c for b, c in copies) // n  # the kept blocks at the mean kind


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

    Only the activations change with the budget (activation_bytes): each block keeps
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


def moe_tokens(cfg: Config, tp: int, cp: int) -> tuple[int, int]:
    """(top-k, rows one rank dispatches per MoE layer and micro batch: its tokens x top-k); (0, 0)
    for a dense model. A rank's tokens are its micro batch's sequence shard (1/cp), all of them
    under TP: the MoE sublayer runs whole on every TP rank, on the gathered sequence
    (framework.parallel.tensor.block_plan), so ``tp`` divides nothing."""
    del tp
    k = cfg.model.moe.num_experts_per_tok if num_experts(cfg.model) else 0
    tokens = cfg.train.micro_batch_size * cfg.train.seq_len // cp
    return k, tokens * k


def _dispatch_bytes(cfg: Config, specs: list[ParamSpec], tp: int, cp: int) -> int:
    """Expert parallelism's transient buffers, one MoE layer at a time: ExpertParallel.forward
    (framework.parallel.expert) holds the received rows, their expert-major copy, the experts'
    output and its source-order copy, each (rows x dim) in the activation dtype (an estimate from
    the code, not a fit). 0 without ep."""
    if not any(ep > 1 for _, _, ep, _ in param_kinds(specs)):
        return 0
    _, rows = moe_tokens(cfg, tp, cp)
    elem = 2 if autocast_bf16(cfg) else 4
    return 4 * rows * cfg.model.dim * elem


def rank_memory(
    cfg: Config,
    specs: list[ParamSpec],
    tp: int,
    dp_shard: int,
    unit_bytes: list[int],
    ddp: bool = False,
    accum: int = 1,
    pipeline: tuple[Sequence[int], float, bool] | None = None,
    cp: int = 1,
    held: bool = False,
) -> MemoryEstimate:
    """``held``: the FSDP units stay unsharded for the whole step (framework.planner.stages.held_for_step:
    zero-bubble schedules, or sharding.reshard_after_forward=false), so the rank's whole unsharded
    parameters replace the two units in flight.

    Under ``peft.method=lora`` only the adapters train (framework.planner.params.lora_specs): the
    frozen base is held (in ``peft.base_dtype``) and gets no gradient and no optimizer state; the
    adapters are fp32 parameters with both."""
    local = sum_local(specs, tp, dp_shard)
    params = local * MASTER_BYTES
    adapters = lora_specs(specs, cfg.model, cfg.peft)
    trains = adapters or specs  # what gets gradients and optimizer state
    if adapters:
        params = local * DTYPE_BYTES[cfg.peft.base_dtype] + sum_local(adapters, tp, dp_shard) * MASTER_BYTES
    grads = sum_local(trains, tp, dp_shard) * MASTER_BYTES
    if dp_shard > 1 and accum > 1:
        # The loop skips the reduce-scatter on all but the last micro batch
        # (FSDPModule.set_requires_gradient_sync(False)), so FSDP2 accumulates each unit's
        # unsharded gradient, in param_dtype, until then: this TP rank's whole gradient.
        full = sum_local(trains, tp, 1)
        grads += full * DTYPE_BYTES[cfg.sharding.param_dtype]
    if cfg.train.optimizer_in_backward and not whole_model_backward(cfg):
        # Each gradient is freed right after its parameter's step: the largest one, twice (the
        # next parameter's gradient can land before the step of the previous one is done).
        grads = 2 * sum_local(trains, tp, dp_shard, "max") * MASTER_BYTES
    optimizer = sum_local(trains, tp, dp_shard, "optimizer") * adamw_state_bytes(cfg)
    comm_buffers = 0
    if dp_shard > 1:
        # The unit being computed plus the one prefetched (param_dtype), and one unit's unsharded
        # gradient before its reduce-scatter (reduce_dtype).
        biggest = max(unit_bytes) // MASTER_BYTES
        p_el, r_el = DTYPE_BYTES[cfg.sharding.param_dtype], DTYPE_BYTES[cfg.sharding.reduce_dtype]
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
        mode.value: activation_bytes(cfg, tp, mode, layers, in_flight, head, cp)
        for mode in ActivationCheckpointing
        if mode != ActivationCheckpointing.auto
    }
    ep = ep_of(specs)
    for mode in (ActivationCheckpointing.none, ActivationCheckpointing.selective):
        by_mode[mode.value] += _weight_copy_bytes(cfg, tp, dp_shard, ep, mode, layers)
    if cfg.executor.mode == ExecutorMode.eager:
        del by_mode[ActivationCheckpointing.budget.value]  # compiled executors only
    acts = by_mode[cfg.sharding.activation_checkpointing.value]
    if cfg.sharding.activation_offload:
        # framework.parallel.activation.apply_offload: the blocks' saved tensors live in host memory;
        # the device holds the block being computed (or recomputed) and the head's logits.
        mode = cfg.sharding.activation_checkpointing
        spec = model_spec(cfg.model)
        heaviest = max(range(spec.n_layers), key=lambda i: spec.layers[i].saved_values)
        acts = min(acts, activation_bytes(cfg, tp, mode, (heaviest,), 1.0, head, cp))
    total = params + grads + optimizer + comm_buffers + acts
    device = int(cfg.mesh.hardware.memory_gib * GIB)
    state = "bf16" if bf16_moments(cfg) else "fp32"
    return MemoryEstimate(params, grads, optimizer, comm_buffers, acts, by_mode, total, device, state)


def check_fits(
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
