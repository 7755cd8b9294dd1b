"""``sharding=auto``: the planner chooses the layout against the declared topology, and says why.

Every feasible (dp_replicate, dp_shard, tp, pp schedule with its virtual stages and micro batches,
activation checkpointing, micro batch, FSDP reshard policy, and for an MoE family the expert-parallel
degree) for the model and the mesh is planned
with ``plan_for`` (memory per rank, communication) and costed with
``framework.planner.cost`` (step time, MFU). The fastest layout that fits the device wins; ties go to the
smaller memory. ``format_search`` prints the top 10 with the reason each loses against the choice:
memory (it does not fit), communication, compute (recompute included) or memory-bound work.

What is searched: the degrees when ``sharding=auto`` and no ``parallel.*`` is set (tp over the
divisors of the processes per node that split the heads, KV heads and FFN, so TP stays inside a
node; ``sharding.tp`` other than 1 pins it), ep for an MoE family (``_ep_options``), activation checkpointing under
``sharding.activation_checkpointing=auto`` (none, selective, selective_op, full, and under a compiled
executor the compiler's budget at the largest ``activation_memory_budget`` that fits: ``_budget_candidate``), and the micro batch when
``train.micro_batch_size=0`` (every divisor of the rank's share of the global batch), and
``sharding.reshard_after_forward`` wherever FSDP shards (False: units held unsharded for the step,
framework.planner.stages.held_for_step; chosen only where it fits and is faster). Anything else the
user set is kept. cp is searched for long sequences (``_cp_options``); pp is 1 (not implemented yet).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from framework.config.schema import (
    ActivationCheckpointing,
    AttentionBackend,
    Config,
    ExecutorMode,
    FusedCrossEntropy,
    OptimizerName,
    PPSchedule,
)
from framework.kernels import fa4
from framework.planner import stages as pipeline_stages
from framework.planner.layout import Degrees, divisors, ep_shards_experts, fixed_degrees, num_experts
from framework.planner.memory import largest_fitting_budget, moments_hint, runs_on_cpu
from framework.planner.params import GIB
from framework.planner.plan import Plan, plan_for, with_degrees

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
# sharding.activation_checkpointing=budget under auto: the budgets weighed span those measured
# (benchmarks/PERF.md): BUDGET_MIN, the lowest that fed the planner's fit (the 7B at 0.5),
# BUDGET_MAX the highest that ran (Llama-3-8B at 8K on one H200, 114.4 GiB); above it
# the partitioner nears its default partition (1.0 ran out of memory there), which the plan's
# linear _BUDGET_KEPT does not model. BUDGET_STEP: a chosen budget is rounded down to it.
BUDGET_MIN, BUDGET_MAX, BUDGET_STEP = 0.5, 0.98, 0.01
TOP = 10
# The deepest pipeline the search tries: deeper ones only add bubble at the batch sizes planned here.
MAX_PP = 16


@dataclass(frozen=True)
class Candidate:
    """One evaluated layout and its prediction."""

    degrees: dict[str, int]
    layout: str  # Degrees.name()
    activation_checkpointing: str
    micro_batch_size: int
    grad_accum_steps: int
    memory_gib: float
    fits: bool
    predicted_step_time_s: float
    predicted_mfu: float
    predicted_tokens_per_s: float
    compute_s: float
    memory_bound_s: float
    optimizer_s: float
    exposed_comm_s: float
    reason: str = ""  # why it loses against the choice ("chosen" for the choice)
    # Pipeline (pp > 1): the schedule, its micro batches, virtual stages per rank, the bubble.
    pp_schedule: str = ""
    pp_microbatches: int = 0
    pp_stages_per_rank: int = 1
    bubble_s: float = 0.0
    # FSDP: units resharded after each forward (True), or held unsharded for the step (False).
    reshard_after_forward: bool = True
    # sharding.activation_memory_budget when activation_checkpointing is budget, else None.
    activation_memory_budget: float | None = None

    @property
    def ac(self) -> str:
        """The AC column: the mode, and the compiler's budget where it has one."""
        if self.activation_memory_budget is None:
            return self.activation_checkpointing
        return f"{self.activation_checkpointing} {self.activation_memory_budget:g}"

    def short(self) -> str:
        v = f" v{self.pp_stages_per_rank}" if self.pp_schedule.startswith("interleaved") else ""
        pp = f" {self.pp_schedule}{v}/{self.pp_microbatches}" if self.pp_schedule else ""
        held = " held" if not self.reshard_after_forward and Degrees(**self.degrees).fsdp_shard > 1 else ""
        return Degrees(**self.degrees).short() + pp + held


@dataclass(frozen=True)
class SearchResult:
    chosen: Candidate
    candidates: tuple[Candidate, ...]  # fitting ones fastest first, then the rest by memory
    chosen_cfg: Config  # the input with the choice written in (explicit degrees, AC, micro batch)
    device_gib: float


def _degree_options(cfg: Config) -> list[Degrees]:
    fixed = fixed_degrees(cfg)
    if fixed is not None:
        return [fixed]
    return [e for d in _dense_degree_options(cfg) for e in _ep_options(cfg, d)]


def _ep_options(cfg: Config, d: Degrees) -> list[Degrees]:
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
            for c in _cp_options(cfg, world // t // p) if p == 1 or cfg.run.dry_run else [1]:
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


def _cp_options(cfg: Config, ranks: int) -> list[int]:
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


def _schedule_options(cfg: Config, d: Degrees) -> list[tuple[PPSchedule, int, int]]:
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


def _reshard_options(cfg: Config, d: Degrees, pipe: tuple[PPSchedule, int, int] | None) -> list[bool]:
    """``sharding.reshard_after_forward`` to weigh: both where FSDP shards and it changes anything
    (not under a zero-bubble schedule, which holds its units anyway: stages.held_for_step), unless
    the user set it to false (not the default: kept, as everything else the user set). False holds
    every unit unsharded for the step: one all-gather a step instead of one or two per micro batch,
    for the rank's whole unsharded weights in memory."""
    if d.fsdp_shard == 1 or (d.pp > 1 and pipe is not None and pipe[0] in pipeline_stages.ZERO_BUBBLE):
        return [cfg.sharding.reshard_after_forward]
    return [False] if not cfg.sharding.reshard_after_forward else [True, False]


def _ac_options(cfg: Config) -> list[ActivationCheckpointing]:
    """The user's mode, or under ``auto`` every searched one (selective_op only for a dense model:
    framework.planner.memory counts what it keeps for a dense block only)."""
    ac = cfg.sharding.activation_checkpointing
    if ac != ActivationCheckpointing.auto:
        return [ac]
    dense = not num_experts(cfg.model)
    return [a for a in SEARCHED_AC if dense or a != ActivationCheckpointing.selective_op]


def _micro_options(cfg: Config, d: Degrees) -> list[int]:
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


def _no_batch_split(cfg: Config) -> str:
    """Why no layout took the batch: the data-parallel degrees searched, and what pruned TP."""
    t = cfg.train
    degrees = sorted({d.dp for d in _degree_options(cfg)})
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


def _configure(
    cfg: Config,
    d: Degrees,
    ac: ActivationCheckpointing,
    micro: int,
    pipeline: tuple[PPSchedule, int, int] | None = None,
    reshard_after_forward: bool | None = None,
    budget: float | None = None,
) -> Config:
    """``cfg`` with one candidate's choices written in; ``budget`` (with ``ac`` budget) is its
    ``sharding.activation_memory_budget``, else the user's is kept."""
    out = with_degrees(cfg, d)
    if budget is not None:
        sharding = dataclasses.replace(out.sharding, activation_memory_budget=budget)
        out = dataclasses.replace(out, sharding=sharding)
    if reshard_after_forward is not None:
        out = dataclasses.replace(
            out, sharding=dataclasses.replace(out.sharding, reshard_after_forward=reshard_after_forward)
        )
    if pipeline is not None and d.pp > 1:
        sched, spr, m = pipeline
        parallel = dataclasses.replace(
            out.parallel, pp_schedule=sched, pp_stages_per_rank=spr, pp_microbatches=m
        )
        out = dataclasses.replace(out, parallel=parallel)
    return dataclasses.replace(
        out,
        sharding=dataclasses.replace(out.sharding, activation_checkpointing=ac),
        train=dataclasses.replace(out.train, micro_batch_size=micro),
    )


def _pipeline_of(c: Candidate) -> tuple[PPSchedule, int, int] | None:
    return (PPSchedule[c.pp_schedule], c.pp_stages_per_rank, c.pp_microbatches) if c.pp_schedule else None


def _candidate(plan: Plan, device: int, reshard_after_forward: bool = True) -> Candidate:
    p = plan.prediction
    return Candidate(
        degrees=dict(plan.degrees),
        layout=plan.strategy,
        activation_checkpointing=plan.activation_checkpointing,
        micro_batch_size=plan.micro_batch_size,
        grad_accum_steps=plan.grad_accum_steps,
        memory_gib=plan.memory.total / GIB,
        fits=plan.memory.total <= device,
        predicted_step_time_s=p.step_time_s,
        predicted_mfu=p.mfu,
        predicted_tokens_per_s=p.tokens_per_s,
        compute_s=p.compute_s,
        memory_bound_s=p.memory_s,
        optimizer_s=p.optimizer_s,
        exposed_comm_s=p.exposed_comm_s,
        pp_schedule=plan.pp_schedule,
        pp_microbatches=plan.pp_microbatches,
        pp_stages_per_rank=plan.pp_stages_per_rank,
        bubble_s=p.bubble_s,
        reshard_after_forward=reshard_after_forward,
        activation_memory_budget=plan.activation_memory_budget,
    )


def _why(c: Candidate, best: Candidate, device_gib: float) -> str:
    """The term that costs this candidate the most time against the choice."""
    if not c.fits:
        return f"memory: {c.memory_gib:.1f} GiB > {device_gib:.1f} GiB device"
    terms = {
        "communication": (c.exposed_comm_s, best.exposed_comm_s, "exposed"),
        "compute": (
            c.compute_s,
            best.compute_s,
            "recompute and TP split" if c.activation_checkpointing != "none" else "GEMMs",
        ),
        "memory-bound": (
            c.memory_bound_s + c.optimizer_s,
            best.memory_bound_s + best.optimizer_s,
            "casts, accumulation, optimizer",
        ),
        "bubble": (c.bubble_s, best.bubble_s, f"pipeline fill and drain, {c.pp_schedule or 'no pp'}"),
    }
    name, (mine, theirs, what) = max(terms.items(), key=lambda kv: kv[1][0] - kv[1][1])
    if mine - theirs <= 0 or c.predicted_step_time_s <= best.predicted_step_time_s:
        return f"ties: {c.predicted_step_time_s * 1e3:.1f} ms, more memory ({c.memory_gib:.1f} GiB)"
    return f"{name}: {mine * 1e3:.1f} vs {theirs * 1e3:.1f} ms ({what})"


def _plan(
    cfg: Config,
    d: Degrees,
    ac: ActivationCheckpointing,
    micro: int,
    pipe: tuple[PPSchedule, int, int] | None,
    raf: bool,
    errors: list[str],
    budget: float | None = None,
) -> Plan | None:
    """The plan of one set of choices, or None (its refusal appended to ``errors``)."""
    try:
        return plan_for(_configure(cfg, d, ac, micro, pipe, raf, budget), d, check_memory=False)
    except ValueError as e:
        errors.append(str(e))
        return None


def _ac_candidates(
    cfg: Config,
    d: Degrees,
    micro: int,
    pipe: tuple[PPSchedule, int, int] | None,
    device: int,
    errors: list[str],
) -> list[Candidate]:
    """Layout ``d`` at ``micro`` under each AC mode (``_ac_options``) and reshard option."""
    out = []
    for ac in _ac_options(cfg):
        if ac == ActivationCheckpointing.budget and not _budget_compiles(cfg):
            continue
        for raf in _reshard_options(cfg, d, pipe):
            plan = _plan(cfg, d, ac, micro, pipe, raf, errors)
            if plan is not None:
                out.append(_candidate(plan, device, raf))
    return out


def _searches_budget(cfg: Config) -> bool:
    """Whether auto weighs the compiler's budget: under ``activation_checkpointing=auto`` with a
    compiled executor (the partitioner enforces it; eager has none: plan._check_executor), and an
    attention op that this torch's partitioner can weigh (framework.kernels.fa4.budget_fails)."""
    return cfg.sharding.activation_checkpointing is ActivationCheckpointing.auto and _budget_compiles(cfg)


def _budget_compiles(cfg: Config) -> bool:
    """A compiled executor, and an attention op this torch's partitioner can weigh."""
    return cfg.executor.mode is not ExecutorMode.eager and not fa4.budget_fails(
        cfg.model, cfg.data.document_mask, fa4.flop_counter_takes_gqa()
    )


def _budget_candidates(
    cfg: Config,
    d: Degrees,
    micro: int,
    pipe: tuple[PPSchedule, int, int] | None,
    device: int,
    group: list[Candidate],
    errors: list[str],
) -> list[Candidate]:
    """The compiler's budget for layout ``d`` at ``micro``, one per reshard option, where the search
    weighs it (``_searches_budget``) and AC none does not fit there (``group``: this layout's
    candidates, ``_ac_candidates``): none recomputes nothing and
    keeps what a budget of 1.0 keeps, so where it fits it beats every budget."""
    if not _searches_budget(cfg):
        return []
    out = []
    none = ActivationCheckpointing.none.value
    for raf in _reshard_options(cfg, d, pipe):
        none_fits = any(
            c.fits and c.activation_checkpointing == none and c.reshard_after_forward == raf for c in group
        )
        plan = None if none_fits else _budget_plan(cfg, d, micro, pipe, raf, errors)
        if plan is not None:
            out.append(_candidate(plan, device, raf))
    return out


def _budget_plan(
    cfg: Config,
    d: Degrees,
    micro: int,
    pipe: tuple[PPSchedule, int, int] | None,
    raf: bool,
    errors: list[str],
) -> Plan | None:
    """The compiler's budget at the largest ``activation_memory_budget`` in [BUDGET_MIN, BUDGET_MAX]
    that fits (rounded down to BUDGET_STEP), or at BUDGET_MAX, not fitting, when none does.

    One budget per layout, not a list: a larger budget keeps more and recomputes less
    (cost.recompute_fraction), so of those that fit the largest is the fastest. Three plans at most:
    at BUDGET_MAX, then at the budget ``plan.largest_fitting_budget`` bounds from its memory (the
    chord from full's activations: it fits by construction, a step or so low), then at the one
    the chord from that budget gives (the memory model's own line there: the largest that fits)."""
    top = _plan(cfg, d, ActivationCheckpointing.budget, micro, pipe, raf, errors, BUDGET_MAX)
    if top is None or _fits(top):
        return top
    best, low = top, None
    for _ in range(2):
        bound = largest_fitting_budget(top.memory, BUDGET_MAX, low)
        if bound is None:
            break
        value = max(BUDGET_MIN, round(int(round(bound / BUDGET_STEP, 6)) * BUDGET_STEP, 2))
        if low is not None and value <= low[0]:
            break
        plan = _plan(cfg, d, ActivationCheckpointing.budget, micro, pipe, raf, errors, value)
        if plan is None or not _fits(plan):
            break
        best, low = plan, (value, plan.memory.activations_by_mode[ActivationCheckpointing.budget.value])
    return best


def _fits(plan: Plan) -> bool:
    return plan.memory.total <= plan.memory.device


def search(cfg: Config) -> SearchResult:
    """Plan and cost every feasible layout; choose the fastest that fits.

    Raises ValueError when no layout is feasible (the global batch splits over no data-parallel
    degree, or no TP degree divides the model), or when none fits the device: the message gives the
    smallest memory found and what would make it fit.
    """
    device = int(cfg.mesh.hardware.memory_gib * GIB)
    device_gib = cfg.mesh.hardware.memory_gib
    cands: list[Candidate] = []
    errors: list[str] = []
    for d in _degree_options(cfg):
        for pipe in _schedule_options(cfg, d):
            trial_cfg = _configure(
                cfg, d, cfg.sharding.activation_checkpointing, cfg.train.micro_batch_size, pipe
            )
            for micro in _micro_options(trial_cfg, d):
                group = _ac_candidates(cfg, d, micro, pipe, device, errors)
                cands += group + _budget_candidates(cfg, d, micro, pipe, device, group, errors)
    if not cands and errors and fixed_degrees(cfg) is not None:
        raise ValueError(errors[0])  # the user's own layout is refused: say so, not "auto found none"
    if not cands:
        why = errors[0] if errors else _no_batch_split(cfg)
        raise ValueError(f"sharding=auto found no feasible layout: {why}")
    fitting = sorted((c for c in cands if c.fits), key=lambda c: (c.predicted_step_time_s, c.memory_gib))
    others = sorted((c for c in cands if not c.fits), key=lambda c: c.memory_gib)
    if not fitting and not (cfg.run.dry_run or cfg.run.allow_over_memory):
        raise ValueError(_nothing_fits(cfg, others[0]))
    # A dry run (or run.allow_over_memory) plans even when nothing fits: the smallest layout, and
    # the plan's memory warning says by how much it misses.
    best = fitting[0] if fitting else others[0]
    ranked = tuple(
        dataclasses.replace(c, reason="chosen" if c is best else _why(c, best, device_gib))
        for c in (*fitting, *others)
    )
    chosen_cfg = _candidate_config(cfg, best)
    return SearchResult(ranked[0], ranked, chosen_cfg, device_gib)


def _candidate_config(cfg: Config, c: Candidate) -> Config:
    """``cfg`` with candidate ``c``'s choices written in (``_configure``)."""
    return _configure(
        cfg,
        Degrees(**c.degrees),
        ActivationCheckpointing(c.activation_checkpointing),
        c.micro_batch_size,
        _pipeline_of(c),
        c.reshard_after_forward,
        c.activation_memory_budget,
    )


def _nothing_fits(cfg: Config, smallest: Candidate) -> str:
    hw, world = cfg.mesh.hardware, cfg.mesh.world_size
    trial = _candidate_config(cfg, smallest)
    m = plan_for(trial, Degrees(**smallest.degrees), check_memory=False).memory
    state = (m.params + m.grads + m.optimizer) / GIB  # shrinks with more data-parallel ranks
    rest = smallest.memory_gib - state
    more = ""
    if hw.memory_gib > rest:
        factor = state / (hw.memory_gib - rest)
        more = f" or about {factor:.1f}x the ranks (mesh of >= {int(world * factor) + 1} ranks)"
    held = (
        "; sharding.reshard_after_forward=false holds the FSDP units unsharded for the step "
        "(=true gathers them per micro batch)"
        if not cfg.sharding.reshard_after_forward
        else ""
    )
    return (
        f"sharding=auto: nothing fits mesh.hardware.memory_gib={hw.memory_gib:g} (mesh.hardware.name="
        f"{hw.name}) on {world} ranks: the smallest layout ({smallest.short()}, activation_checkpointing="
        f"{smallest.ac}, micro batch {smallest.micro_batch_size}) needs "
        f"{smallest.memory_gib:.3g} GiB per rank ({state:.3g} GiB parameters, gradients and optimizer "
        f"state); it would fit a device with >= {smallest.memory_gib:.3g} GiB{more}, or a smaller "
        f"train.seq_len / model{held}{moments_hint(trial, m)}; or set the real mesh.hardware.memory_gib, "
        f"or run.allow_over_memory=true to launch anyway"
    )


def format_search(result: SearchResult, top: int = TOP) -> str:
    """The top ``top`` candidates, the choice first, each with its prediction and why it loses."""
    rows = [
        f"sharding=auto: {len(result.candidates)} layouts evaluated, "
        f"{sum(c.fits for c in result.candidates)} fit {result.device_gib:g} GiB; top {top}:",
        f"  {'#':>2} {'layout':<10} {'r x s x t':<28} {'AC':<12} {'micro':>5} {'accum':>5} {'GiB':>7} "
        f"{'step ms':>9} {'MFU':>6} {'tokens/s':>12}  why not",
    ]
    for i, c in enumerate(result.candidates[:top], 1):
        rows.append(
            f"  {i:>2} {c.layout:<10} {c.short():<28} {c.ac:<12} "
            f"{c.micro_batch_size:>5} {c.grad_accum_steps:>5} {c.memory_gib:>7.1f} "
            f"{c.predicted_step_time_s * 1e3:>9.1f} {c.predicted_mfu:>6.1%} "
            f"{c.predicted_tokens_per_s:>12,.0f}  {c.reason}"
        )
    return "\n".join(rows)


def search_to_dict(result: SearchResult) -> dict[str, Any]:
    """What plan.json records under ``search``: the choice and every candidate."""
    return {
        "chosen": dataclasses.asdict(result.chosen),
        "candidates": [dataclasses.asdict(c) for c in result.candidates],
    }


def maybe_search(cfg: Config) -> SearchResult | None:
    """The search when the planner chooses any part of the layout, else None."""
    from framework.planner.plan import needs_search

    return search(cfg) if needs_search(cfg) else None
