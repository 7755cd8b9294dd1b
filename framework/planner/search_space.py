"""What ``sharding=auto`` weighs: the options of each axis of the search (framework.planner.search).

Each function lists one axis's values for a config (and a layout): the degrees (tp inside a node
over the divisors that split the heads, KV heads and FFN; pp up to ``MAX_PP``; cp for long
sequences; dp_replicate x dp_shard over the rest; ep for an MoE family), the pipeline schedules
and their micro batches, the FSDP reshard policy, the activation checkpointing modes and the
micro batch. What the user set is kept: an axis the config pins has one option. Why apart from
the search itself: these are the rules of what is feasible, the search is how the fastest of
their product is found and explained.
"""

from __future__ import annotations

import dataclasses

from framework.config.schema import (
    ActivationCheckpointing,
    AttentionBackend,
    Config,
    FusedCrossEntropy,
    OptimizerName,
    PPSchedule,
)
from framework.planner import stages as pipeline_stages
from framework.planner.layout import Degrees, divisors, ep_shards_experts, fixed_degrees, num_experts
from framework.planner.memory import runs_on_cpu

# Context parallelism is searched for sequences of at least CP_MIN_SEQ tokens: below that, a
# sequence's activations fit with checkpointing and TP, and the K/V passes only cost (Llama 3 ran
# its 8K pre-training without CP and its 128K stage with CP 16: arXiv 2407.21783, table 4). Each
# rank keeps at least CP_MIN_CHUNK tokens, so every ring step's attention has work to hide a pass.
CP_MIN_SEQ = 16384
CP_MIN_CHUNK = 2048
CP_MAX = 32
SEARCHED_AC = (
    ActivationCheckpointing.none,
    ActivationCheckpointing.selective,
    ActivationCheckpointing.selective_op,
    ActivationCheckpointing.full,
)
# The deepest pipeline the search tries: deeper ones only add bubble at the batch sizes planned here.
MAX_PP = 16


def degree_options(cfg: Config) -> list[Degrees]:
    fixed = fixed_degrees(cfg)
    if fixed is not None:
        return [fixed]
    return [e for d in _dense_degree_options(cfg) for e in ep_options(cfg, d)]


def ep_options(cfg: Config, d: Degrees) -> list[Degrees]:
    """``d`` at each expert-parallel degree worth weighing (``d`` as it is for a dense model; a
    ``parallel.ep`` the user set fixes the layout). Of the degrees that split both dp_shard and the experts
    (framework.planner.layout.check_ep), three: 1 (experts sharded by FSDP like any weight, no
    all-to-all), the largest whose group stays in a node (ep x tp ranks), and the largest. Why only
    these: a rank's expert bytes are the same at every ep (E / ep experts over dp_shard / ep ranks), and the all-to-all's bytes are (ep - 1) / ep of the rows, nearly flat in ep; what a
    larger ep buys is less FSDP traffic on the experts (fewer of them gathered), so within one
    link (intra- or inter-node) the largest ep is the fastest, and the search weighs the largest
    of each link. Each degree in between multiplied the search (a 235B MoE on 128 ranks: 4,677
    layouts, 45 s)."""
    experts = num_experts(cfg.model)
    if (
        not experts or d.cp > 1 or not ep_shards_experts(cfg.model)
    ):  # ep is borrowed from dp_shard, and not combined with cp (check_ep)
        return [d]
    valid = [e for e in divisors(d.dp_shard) if experts % e == 0]
    ppn = cfg.mesh.procs_per_node
    intra = [e for e in valid if e * d.tp <= ppn and ppn % (e * d.tp) == 0]
    keep = sorted({1, max(intra, default=1), max(valid)})
    return [dataclasses.replace(d, ep=e) for e in keep]


def _dense_degree_options(cfg: Config) -> list[Degrees]:
    m, world, ppn = cfg.model, cfg.mesh.world_size, cfg.mesh.procs_per_node
    tps = [
        t
        for t in divisors(world)
        if ppn % t == 0 and m.n_heads % t == 0 and m.n_kv_heads % t == 0 and m.ffn_dim % t == 0
    ]
    if cfg.sharding.tp != 1:
        tps = [t for t in tps if t == cfg.sharding.tp]
        if not tps:
            raise ValueError(
                f"sharding=auto with sharding.tp={cfg.sharding.tp}: that TP degree does not divide the "
                f"processes per node ({ppn}), model.n_heads, model.n_kv_heads and model.ffn_dim; "
                f"valid: sharding.tp=1 (let the planner choose) or one of "
                f"{[t for t in divisors(ppn) if m.n_heads % t == 0 and m.n_kv_heads % t == 0]}"
            )
    out = []
    pps = [1] + [p for p in divisors(world) if 1 < p <= min(m.n_layers, MAX_PP) and _pipeline_ok(cfg, p)]
    for t in tps:
        for p in (q for q in pps if (world // t) % q == 0):
            # CP runs per micro batch, outside a pipeline's schedule: both only in a dry run's
            # plan (layout.check_cp refuses to launch them together).
            for c in cp_options(cfg, world // t // p) if p == 1 or cfg.run.dry_run else [1]:
                for r in divisors(world // t // p // c):
                    out.append(Degrees(dp_replicate=r, dp_shard=world // t // p // c // r, cp=c, tp=t, pp=p))
    if cfg.optimizer.name is OptimizerName.muon:  # Muon orthogonalizes whole matrices: no sharded ones
        out = [d for d in out if d.dp_shard == 1 and d.tp == 1 and d.cp == 1]
    if (
        cfg.model.fused_cross_entropy is not FusedCrossEntropy.none
    ):  # the whole head: framework.kernels.fused_ce
        out = [d for d in out if d.tp == 1]
    # An MoE block under TP runs its MoE sublayer whole on every TP rank (framework.parallel.tensor),
    # work the cost model does not count: the search keeps tp=1 there (a declared tp runs).
    if cfg.model.moe.num_experts:
        out = [d for d in out if d.tp == 1]
    return out


def cp_options(cfg: Config, ranks: int) -> list[int]:
    """CP degrees worth searching over ``ranks`` (the world over TP): 1, and for long sequences
    (``train.seq_len >= CP_MIN_SEQ``) each degree up to ``CP_MAX`` whose load-balanced chunks
    (2 x cp of them) split the sequence into pieces of at least ``CP_MIN_CHUNK`` tokens; never
    where CP cannot run (a CPU launch: framework.planner.layout.check_cp; model.attention=fa4: framework.kernels.fa4)."""
    seq = cfg.train.seq_len
    if (
        seq < CP_MIN_SEQ
        or (runs_on_cpu(cfg) and not cfg.run.dry_run)
        or cfg.model.attention is AttentionBackend.fa4
    ):
        return [1]
    return [c for c in divisors(ranks) if c <= CP_MAX and seq % (2 * c) == 0 and seq // c >= CP_MIN_CHUNK]


def _pipeline_ok(cfg: Config, pp: int) -> bool:
    """Whether a pipeline of ``pp`` stages can run this config at all (tied embeddings, document
    masks, ... cannot: framework.planner.stages); the search then leaves pp out rather than list failures."""
    try:
        pipeline_stages.check_features(cfg, pp)
    except ValueError:
        return False
    return True


def schedule_options(cfg: Config, d: Degrees) -> list[tuple[PPSchedule, int, int]]:
    """(schedule, virtual stages per rank, micro batches) to try for ``d``: the user's when the degrees
    are theirs, else 1F1B, GPipe, interleaved 1F1B and ZB-V (2 stages per rank where the blocks
    allow), or the user's schedule when ``parallel.pp_schedule`` / ``pp_stages_per_rank`` are set;
    each at the user's micro batch size (``train.micro_batch_size``), or else at up to three micro-batch
    counts (so micro batch sizes): the smallest that divides the rank's batch at or above each of pp,
    2 pp and 4 pp (pp itself and its multiples where they divide; a batch of 24 on 16 stages weighs
    24), each where torch's schedule runs it (stages.schedule_accepts)."""
    p = cfg.parallel
    if d.pp == 1:
        return [(p.pp_schedule, p.pp_stages_per_rank, p.pp_microbatches)]
    if fixed_degrees(cfg) is not None:
        return [(p.pp_schedule, p.pp_stages_per_rank, p.pp_microbatches)]
    local = cfg.train.global_batch_size // d.dp
    cuts = [c for c in divisors(local) if c >= d.pp]
    counts = sorted({min((c for c in cuts if c >= k * d.pp), default=0) for k in (1, 2, 4)} - {0})
    mbs = cfg.train.micro_batch_size
    if mbs and local % mbs == 0 and local // mbs >= d.pp:  # the user's micro batch, pipelined
        counts = [local // mbs]
    if p.pp_microbatches:
        counts = [p.pp_microbatches]
    scheds = [(PPSchedule["1f1b"], 1), (PPSchedule["gpipe"], 1)]
    if 2 * d.pp <= cfg.model.n_layers:
        scheds += [(PPSchedule["interleaved_1f1b"], 2), (PPSchedule["zbv"], 2)]
    if 4 * d.pp <= cfg.model.n_layers:  # more virtual stages: a smaller bubble, more sends
        scheds.append((PPSchedule["interleaved_1f1b"], 4))
    unset = type(p)()
    if (p.pp_schedule, p.pp_stages_per_rank) != (unset.pp_schedule, unset.pp_stages_per_rank):
        scheds = [(p.pp_schedule, p.pp_stages_per_rank)]  # the user's schedule: weighed, not replaced
    return [(s, v, m) for s, v in scheds for m in counts if pipeline_stages.schedule_accepts(s, d.pp, m)]


def reshard_options(cfg: Config, d: Degrees, pipe: tuple[PPSchedule, int, int] | None) -> list[bool]:
    """``sharding.reshard_after_forward`` to weigh: both where FSDP shards and it changes anything
    (not under a zero-bubble schedule, which holds its units anyway: stages.held_for_step), unless
    the user set it to false (not the default: kept, as everything else the user set). False holds
    every unit unsharded for the step: one all-gather a step instead of one or two per micro batch,
    for the rank's whole unsharded weights in memory."""
    if d.fsdp_shard == 1 or (d.pp > 1 and pipe is not None and pipe[0] in pipeline_stages.ZERO_BUBBLE):
        return [cfg.sharding.reshard_after_forward]
    return [False] if not cfg.sharding.reshard_after_forward else [True, False]


def ac_options(cfg: Config) -> list[ActivationCheckpointing]:
    """The user's mode, or under ``auto`` every searched one (selective_op only for a dense model:
    framework.planner.memory counts what it keeps for a dense block only)."""
    ac = cfg.sharding.activation_checkpointing
    if ac != ActivationCheckpointing.auto:
        return [ac]
    dense = not num_experts(cfg.model)
    return [a for a in SEARCHED_AC if dense or a != ActivationCheckpointing.selective_op]


def micro_options(cfg: Config, d: Degrees) -> list[int]:
    gbs = cfg.train.global_batch_size
    if gbs % d.dp:
        return []
    if d.pp > 1:  # the schedule's micro batches cut the rank's batch (framework.planner.stages)
        pieces = pipeline_stages.microbatches(cfg, d.pp, d.dp)
        # One option; one that does not divide, or a train.micro_batch_size the user set that is
        # not the rank's batch / pieces, is refused by plan_for (framework.planner.stages), naming the
        # valid values: never overwritten in silence.
        return [cfg.train.micro_batch_size or max(1, gbs // d.dp // pieces)]
    if cfg.train.micro_batch_size != 0:
        return [cfg.train.micro_batch_size] if (gbs // d.dp) % cfg.train.micro_batch_size == 0 else []
    return sorted(divisors(gbs // d.dp), reverse=True)


def no_batch_split(cfg: Config) -> str:
    """Why no layout took the batch: the data-parallel degrees searched, and what pruned TP."""
    t = cfg.train
    degrees = sorted({d.dp for d in degree_options(cfg)})
    micro = f" in micro batches of train.micro_batch_size={t.micro_batch_size}" if t.micro_batch_size else ""
    no_tp = (
        " (model.fused_cross_entropy keeps tensor parallelism off)"
        if cfg.model.fused_cross_entropy is not FusedCrossEntropy.none
        else ""
    )
    return (
        f"train.global_batch_size={t.global_batch_size}{micro} splits over none of the data-parallel "
        f"degrees {degrees} of {cfg.mesh.world_size} ranks{no_tp}: set train.global_batch_size or "
        "train.micro_batch_size (0: the rank's whole share)"
    )
