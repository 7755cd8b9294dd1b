"""Communication per optimizer step (alpha-beta ring model over the link each mesh axis crosses)
and DDP's bucketing: FSDP all-gathers and reduce-scatters, DDP/HSDP all-reduces, TP with sequence
parallelism, context parallelism's ring, expert parallelism's all-to-alls and the MoE routers'
all-reduces. Each ``CommEstimate`` is priced here and exposed by its mechanism in framework.planner.overlap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from framework.config.schema import (
    ActivationCheckpointing,
    Config,
    Float8Recipe,
    PeftMethod,
    RouterScore,
)
from framework.models import model_spec
from framework.models.linears import converted, expert_gemms
from framework.planner.layout import (
    DP_AXES,
    Degrees,
    MeshAxis,
    async_tp_on,
    loss_parallel_on,
    num_experts,
)
from framework.planner.memory import autocast_bf16, moe_tokens
from framework.planner.overlap import CommEstimate
from framework.planner.params import DTYPE_BYTES, MASTER_BYTES, MIB, ParamSpec, ep_of, local_numel, sum_local

# Bucket sizes the auto choice may pick: below 1 MiB launches dominate, above 256 MiB nothing overlaps.
AUTO_BUCKET_MIN_MB = 1.0
AUTO_BUCKET_MAX_MB = 256.0


def axis_is_intra_node(sizes: tuple[int, ...], index: int, ppn: int) -> bool:
    """Every group of this axis lies in one node iff size * stride divides procs per node."""
    stride = math.prod(sizes[index + 1 :])
    span = sizes[index] * stride
    return sizes[index] == 1 or (span <= ppn and ppn % span == 0)


def link_of(cfg: Config, intra: bool) -> tuple[float, float]:
    """(alpha seconds, beta bytes/s) of the link an axis uses."""
    hw = cfg.mesh.hardware
    if intra:
        return hw.intra_node_latency_us * 1e-6, hw.intra_node_gbps * 1e9
    return hw.inter_node_latency_us * 1e-6, hw.inter_node_gbps * 1e9


def collective(
    cfg: Config, axis: str, kind: str, n: int, intra: bool, calls: int, payload: int
) -> CommEstimate:
    """Ring collectives: all-reduce (any ``kind`` naming one: ``aux_all_reduce``, ``bias_all_reduce``)
    sends 2(n-1)/n of the payload in 2(n-1) steps; all-gather and reduce-scatter send (n-1)/n in n-1
    steps."""
    alpha, beta = link_of(cfg, intra)
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
        cur += local_numel(s, tp, 1) * MASTER_BYTES
        if cur >= cap_bytes:
            sizes.append(cur)
            cur = 0
    if cur:
        sizes.append(cur)
    return sizes


def _auto_bucket(cfg: Config, grad_bytes: int, n: int, intra: bool) -> tuple[float, str]:
    """Bucket size minimising exposed all-reduce time under the alpha-beta model.

    With k buckets the latency cost is k * 2(n-1) * alpha and the last bucket's transfer,
    2(n-1)/n * M/(k * beta), cannot overlap backward. Their sum is smallest at
    M/k = sqrt(M * n * alpha * beta).
    """
    alpha, beta = link_of(cfg, intra)
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


def bucket_plan(
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
    full_local_bytes = sum_local(specs, tp, 1) * MASTER_BYTES
    rep = size.get(MeshAxis.dp_replicate, 1)
    if not d.fsdp:
        if cfg.bucketing.auto:
            intra = axis_is_intra_node(sizes, 0, cfg.mesh.procs_per_node)
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


def step_comm(
    cfg: Config,
    specs: list[ParamSpec],
    sizes: tuple[int, ...],
    axes: tuple[MeshAxis, ...],
    accum: int,
    num_buckets: int,
    units: list[int],
    ddp: bool,
    layers: Sequence[int] | None = None,
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
    intra = {a: axis_is_intra_node(sizes, i, ppn) for i, a in enumerate(axes)}
    tp = size.get(MeshAxis.tp, 1)
    cp = size.get(MeshAxis.cp, 1)
    # FSDP2 shards over dp_shard x cp (one flattened group) when CP is on.
    shard = size.get(MeshAxis.dp_shard, 1) * cp
    shard_axis = "dp_shard_cp" if cp > 1 else "dp_shard"
    if cp > 1:
        intra[MeshAxis.dp_shard] = _group_is_intra_node(sizes, axes, (MeshAxis.dp_shard, MeshAxis.cp), ppn)
    p_el, r_el = DTYPE_BYTES[cfg.sharding.param_dtype], DTYPE_BYTES[cfg.sharding.reduce_dtype]
    full_local = sum_local(specs, tp, 1)  # one TP rank's unsharded parameters
    # Expert stacks under ep are gathered over their own group, dp_shard x cp / ep ranks.
    expert_local = sum_local(specs, tp, 1, "experts")
    ep = ep_of(specs)
    groups = [(shard_axis, shard, full_local - expert_local)]
    ag_el = float8_gather_bytes(cfg, p_el)
    if expert_local:
        groups.append(("dp_shard_mod_ep", max(1, shard // ep), expert_local))
    ag_calls = len(units) * (1 if held else accum * (2 if cfg.sharding.reshard_after_forward else 1))
    for axis, n, numel in groups:
        if n <= 1:
            continue
        avg_unit = numel // len(units)
        out.append(
            collective(
                cfg,
                axis,
                "all_gather",
                n,
                intra[MeshAxis.dp_shard],
                ag_calls,
                int(avg_unit * (ag_el if axis == shard_axis else p_el)),
            )
        )
        out.append(
            collective(
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
            per = full_local * MASTER_BYTES // num_buckets
            out.append(
                collective(
                    cfg, "dp_replicate", "all_reduce", rep, intra[MeshAxis.dp_replicate], num_buckets, per
                )
            )
        else:  # HSDP: each unit's reduce-scattered gradient shard is all-reduced across replicas
            per = sum_local(specs, tp, shard) // len(units) * r_el
            out.append(
                collective(
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


def float8_gather_bytes(cfg: Config, p_el: int) -> float:
    """Bytes an FSDP all-gather moves per element of the dense units: ``sharding.param_dtype``'s,
    except that under ``model.float8=tensorwise`` the converted Linear weights go in float8, one byte
    (framework.parallel.float8: torchao's enable_fsdp_float8_all_gather, tensorwise only), the
    converted share of the dense parameters counted from the model."""
    m = cfg.model
    if m.float8 is not Float8Recipe.tensorwise or p_el <= 1:
        return float(p_el)
    experts = sum(g.num_experts * g.out_features * g.in_features for g in expert_gemms(m))
    dense = model_spec(m).numel[0] - experts
    share = sum(s.out_features * s.in_features for s in converted(m)) / dense if dense else 0.0
    return p_el - share * (p_el - 1)


def sparse_layers(cfg: Config, layers: Sequence[int] | None) -> int:
    """The MoE layers among ``layers`` (block indices; None: the whole model), by their layer kind:
    every layer of Qwen3-MoE and Mixtral, all but the first dense ones of DeepSeek-V3."""
    return sum(c for kind, c in model_spec(cfg.model).kinds(layers) if kind.sparse)


def _tp_comm(
    cfg: Config, tp: int, cp: int, intra_tp: bool, accum: int, layers: Sequence[int] | None
) -> list[CommEstimate]:
    """TP with sequence parallelism: each block's activations all-gathered and reduce-scattered twice
    forward and twice backward (again in a recomputed forward), and the loss's collectives."""
    out: list[CommEstimate] = []
    elem = 2 if autocast_bf16(cfg) else 4  # activations are in the autocast dtype
    tokens = cfg.train.micro_batch_size * cfg.train.seq_len // cp  # a CP rank's sequence shard
    act = tokens * cfg.model.dim * elem
    # 2 forward + 2 backward, each kind, and 2 more in each recomputed forward (activation
    # checkpointing); a pipeline rank runs only its own blocks.
    n = cfg.model.n_layers if layers is None else len(layers)
    mode = cfg.sharding.activation_checkpointing
    recomputed = {ActivationCheckpointing.full: n, ActivationCheckpointing.selective: (n + 1) // 2}
    # selective_op keeps the reduce-scatters' outputs and re-gathers (every block's two
    # all-gathers run again in its recompute).
    gathers = n if mode == ActivationCheckpointing.selective_op else recomputed.get(mode, 0)
    ag_calls = (n * 4 + gathers * 2) * accum
    rs_calls = (n * 4 + recomputed.get(mode, 0) * 2) * accum
    # Under async TP (parallel.async_tp) Inductor fuses each with its matmul (torch's
    # fused_all_gather_matmul / fused_matmul_reduce_scatter): the same bytes, overlapped
    # (framework.planner.overlap.exposed_comm).
    fused = async_tp_on(cfg, tp)
    ag, rs = ("all_gather_matmul", "matmul_reduce_scatter") if fused else ("all_gather", "reduce_scatter")
    out.append(collective(cfg, "tp", ag, tp, intra_tp, ag_calls, act))
    out.append(collective(cfg, "tp", rs, tp, intra_tp, rs_calls, act))
    if loss_parallel_on(cfg, tp):
        # Loss parallelism: three all-reduces of one fp32 value per token in the loss's forward
        # (the max, the sum of exponentials, the target's logit), none in backward.
        loss = tokens * 4
        out.append(collective(cfg, "tp", "all_reduce", tp, intra_tp, 3 * accum, loss))
    else:
        # The output projection gathers the full logits for the loss, once per micro batch.
        logits = tokens * cfg.model.vocab_size * elem
        out.append(collective(cfg, "tp", "all_gather_logits", tp, intra_tp, accum, logits))
    return out


def _ep_comm(
    cfg: Config, ep: int, tp: int, cp: int, accum: int, layers: Sequence[int] | None
) -> list[CommEstimate]:
    """Expert parallelism's all-to-alls (framework.parallel.expert): in every MoE layer's forward the
    rank's routed rows go out to their experts' ranks (dispatch) and come back (combine), and the
    backward runs both in reverse; a recomputed forward (activation checkpointing) runs them again.
    Each carries the rank's rows x top-k x dim in the activation dtype, (ep - 1) / ep of it off the
    rank (a perfectly balanced router; the per-expert counts exchanged first are E integers, in the
    latency term). The ep group is ep consecutive ranks of dp_shard x cp, tp apart (layout.check_ep)."""
    n = sparse_layers(cfg, layers)
    _, rows = moe_tokens(cfg, tp, cp)
    elem = 2 if autocast_bf16(cfg) else 4
    payload = rows * cfg.model.dim * elem
    ppn = cfg.mesh.procs_per_node
    # The group's ranks on this rank's node, itself included: ep ranks tp apart fill ppn / tp slots.
    local = max(1, min(ep, ppn // tp)) if ppn % tp == 0 else 1
    mode = cfg.sharding.activation_checkpointing
    recomputed = {ActivationCheckpointing.full: n, ActivationCheckpointing.selective: (n + 1) // 2}
    forward = 2 * (n + recomputed.get(mode, 0)) * accum
    backward = 2 * n * accum
    return [
        all_to_all(cfg, "ep", "all_to_all", ep, local, forward, payload),
        all_to_all(cfg, "ep", "all_to_all_backward", ep, local, backward, payload),
    ]


def all_to_all(cfg: Config, axis: str, kind: str, n: int, local: int, calls: int, payload: int) -> CommEstimate:
    """An all-to-all over ``n`` ranks, ``local`` of them (this one included) on this rank's node:
    1/n of the payload stays, (local - 1)/n goes over NVLink and (n - local)/n over the network, both
    at once (NCCL posts every peer's transfer together), so a call lasts as long as the slower of
    the two; one latency a peer, the network's where any peer is off the node."""
    intra_bytes = payload * (local - 1) / n
    inter_bytes = payload * (n - local) / n
    a_in, b_in = link_of(cfg, True)
    a_out, b_out = link_of(cfg, False)
    per_call = (n - 1) * (a_out if inter_bytes else a_in) + max(intra_bytes / b_in, inter_bytes / b_out)
    link = "intra" if not inter_bytes else ("inter" if not intra_bytes else "mixed")
    volume = int((intra_bytes + inter_bytes) * calls)
    return CommEstimate(axis, kind, n, link, calls, payload, volume, per_call * calls)


def _aux_comm(
    cfg: Config, sizes: tuple[int, ...], axes: tuple[MeshAxis, ...], accum: int, layers: Sequence[int] | None
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
    n = sparse_layers(cfg, layers)
    values = (2 * experts + 1) * (n // stages if per_layer else 1)
    intra = _group_is_intra_node(sizes, axes, group, cfg.mesh.procs_per_node)
    calls = accum * stages
    return [
        collective(cfg, "dp_tokens", "aux_all_reduce", ranks, intra, calls, values * 4),
        collective(cfg, "dp_tokens", "aux_all_reduce_backward", ranks, intra, calls, values * 4),
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
    cfg: Config, sizes: tuple[int, ...], axes: tuple[MeshAxis, ...], layers: Sequence[int] | None
) -> list[CommEstimate]:
    """The sigmoid routers' bias update (DeepSeek-V3's aux-loss-free balancing: ``model.moe.
    router_score=sigmoid`` with ``bias_update_rate > 0``): after each optimizer step (an optimizer
    step post-hook, framework.train.runner._update_biases) every MoE layer a rank holds sums the step's
    tokens per expert over ``dp_tokens`` (framework.models.parts.sparse.update_expert_biases: one
    ``dist.all_reduce`` of E int64 per layer, one layer after another), so that every data-parallel
    replica moves its biases alike. Once per step, not per micro batch (the counts accumulate over
    the step's forwards); under a pipeline each rank sums its own stages' layers. Nothing where the
    router is softmax (no bias), the rate is 0 or ``peft.method=lora`` (no hook: the biases are part
    of the frozen base) or one rank holds the step's tokens (token_group is None)."""
    moe = cfg.model.moe
    experts = num_experts(cfg.model)
    if not experts or moe.router_score is not RouterScore.sigmoid or moe.bias_update_rate <= 0:
        return []
    if cfg.peft.method is not PeftMethod.none:
        return []
    size = dict(zip(axes, sizes, strict=True))
    group, ranks = _token_group(size)
    if ranks <= 1:
        return []
    n = sparse_layers(cfg, layers)
    intra = _group_is_intra_node(sizes, axes, group, cfg.mesh.procs_per_node)
    return [collective(cfg, "dp_tokens", "bias_all_reduce", ranks, intra, n, experts * _EXPERT_COUNT_BYTES)]


def _cp_comm(
    cfg: Config, cp: int, intra: bool, accum: int, tp: int, layers: Sequence[int] | None = None
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
    n = m.n_layers if layers is None else len(layers)
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
        collective(cfg, "cp", "kv_ring_forward", cp, intra, forward, kv * elem),
        collective(cfg, "cp", "kv_ring_backward", cp, intra, backward, kv * elem),
        collective(cfg, "cp", "dkv_ring_backward", cp, intra, backward, kv * elem),
    ]


def _group_is_intra_node(
    sizes: tuple[int, ...], axes: tuple[MeshAxis, ...], group: tuple[MeshAxis, ...], ppn: int
) -> bool:
    """Whether one group over the adjacent mesh axes ``group`` (flattened) lies in one node."""
    last = max(axes.index(a) for a in group)
    stride = math.prod(sizes[last + 1 :])
    span = stride * math.prod(sizes[axes.index(a)] for a in group)
    return span <= ppn and ppn % span == 0
