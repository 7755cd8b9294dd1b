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
node; ``sharding.tp`` other than 1 pins it), ep for an MoE family (``search_space.ep_options``), activation checkpointing under
``sharding.activation_checkpointing=auto`` (none, selective, selective_op, full, and under a compiled
executor the compiler's budget at the largest ``activation_memory_budget`` that fits: ``_budget_plan``), and the micro batch when
``train.micro_batch_size=0`` (every divisor of the rank's share of the global batch), and
``sharding.reshard_after_forward`` wherever FSDP shards (False: units held unsharded for the step,
framework.planner.stages.held_for_step; chosen only where it fits and is faster). Anything else the
user set is kept. cp is searched for long sequences (``search_space.cp_options``); pp is 1 (not implemented yet).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from framework.config.schema import ActivationCheckpointing, Config, ExecutorMode, PPSchedule
from framework.kernels import fa4
from framework.planner.layout import Degrees, fixed_degrees
from framework.planner.memory import largest_fitting_budget, moments_hint
from framework.planner.params import GIB
from framework.planner.plan import Plan, plan_for, with_degrees
from framework.planner.search_space import (
    ac_options,
    degree_options,
    micro_options,
    no_batch_split,
    reshard_options,
    schedule_options,
)

# sharding.activation_checkpointing=budget under auto: the budgets weighed span those measured
# (benchmarks/PERF.md): BUDGET_MIN, the lowest that fed the planner's fit (the 7B at 0.5),
# BUDGET_MAX the highest that ran (Llama-3-8B at 8K on one H200, 114.4 GiB); above it
# the partitioner nears its default partition (1.0 ran out of memory there), which the plan's
# linear _BUDGET_KEPT does not model. BUDGET_STEP: a chosen budget is rounded down to it.
BUDGET_MIN, BUDGET_MAX, BUDGET_STEP = 0.5, 0.98, 0.01
TOP = 10


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


# A pipeline's (schedule, virtual stages per rank, micro batches).
Pipe = tuple[PPSchedule, int, int]


@dataclass(frozen=True)
class Choice:
    """One candidate's choices, as ``_configure`` writes them into the config: the degrees, the AC
    mode and micro batch, and where set the pipeline, the FSDP reshard policy and the compiler's
    budget (None: the user's is kept). One value, because each stage of the search (the layout, then
    its AC modes, then the budget) fills in more of it."""

    degrees: Degrees
    ac: ActivationCheckpointing
    micro: int
    pipeline: Pipe | None = None
    reshard_after_forward: bool | None = None
    budget: float | None = None


def _configure(cfg: Config, choice: Choice) -> Config:
    """``cfg`` with one candidate's choices written in; ``choice.budget`` (with AC budget) is its
    ``sharding.activation_memory_budget``, else the user's is kept."""
    d = choice.degrees
    out = with_degrees(cfg, d)
    if choice.budget is not None:
        sharding = dataclasses.replace(out.sharding, activation_memory_budget=choice.budget)
        out = dataclasses.replace(out, sharding=sharding)
    if choice.reshard_after_forward is not None:
        raf = choice.reshard_after_forward
        out = dataclasses.replace(out, sharding=dataclasses.replace(out.sharding, reshard_after_forward=raf))
    if choice.pipeline is not None and d.pp > 1:
        sched, spr, m = choice.pipeline
        parallel = dataclasses.replace(
            out.parallel, pp_schedule=sched, pp_stages_per_rank=spr, pp_microbatches=m
        )
        out = dataclasses.replace(out, parallel=parallel)
    return dataclasses.replace(
        out,
        sharding=dataclasses.replace(out.sharding, activation_checkpointing=choice.ac),
        train=dataclasses.replace(out.train, micro_batch_size=choice.micro),
    )


def _pipeline_of(c: Candidate) -> Pipe | None:
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


def _plan(cfg: Config, choice: Choice, errors: list[str]) -> Plan | None:
    """The plan of one set of choices, or None (its refusal appended to ``errors``)."""
    try:
        return plan_for(_configure(cfg, choice), choice.degrees, check_memory=False)
    except ValueError as e:
        errors.append(str(e))
        return None


def _ac_candidates(cfg: Config, at: Choice, device: int, errors: list[str]) -> list[Candidate]:
    """Layout ``at`` (its degrees, pipeline and micro batch) under each AC mode (``ac_options``) and
    reshard option."""
    out = []
    for ac in ac_options(cfg):
        if ac == ActivationCheckpointing.budget and not _budget_compiles(cfg):
            continue
        for raf in reshard_options(cfg, at.degrees, at.pipeline):
            plan = _plan(cfg, dataclasses.replace(at, ac=ac, reshard_after_forward=raf), errors)
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
    cfg: Config, at: Choice, device: int, group: list[Candidate], errors: list[str]
) -> list[Candidate]:
    """The compiler's budget for layout ``at``, one per reshard option, where the search
    weighs it (``_searches_budget``) and AC none does not fit there (``group``: this layout's
    candidates, ``_ac_candidates``): none recomputes nothing and
    keeps what a budget of 1.0 keeps, so where it fits it beats every budget."""
    if not _searches_budget(cfg):
        return []
    out = []
    none = ActivationCheckpointing.none.value
    for raf in reshard_options(cfg, at.degrees, at.pipeline):
        none_fits = any(
            c.fits and c.activation_checkpointing == none and c.reshard_after_forward == raf for c in group
        )
        at_raf = dataclasses.replace(at, reshard_after_forward=raf)
        plan = None if none_fits else _budget_plan(cfg, at_raf, errors)
        if plan is not None:
            out.append(_candidate(plan, device, raf))
    return out


def _budget_plan(cfg: Config, at: Choice, errors: list[str]) -> Plan | None:
    """The compiler's budget at the largest ``activation_memory_budget`` in [BUDGET_MIN, BUDGET_MAX]
    that fits (rounded down to BUDGET_STEP), or at BUDGET_MAX, not fitting, when none does.

    One budget per layout, not a list: a larger budget keeps more and recomputes less
    (cost.recompute_fraction), so of those that fit the largest is the fastest. Three plans at most:
    at BUDGET_MAX, then at the budget ``plan.largest_fitting_budget`` bounds from its memory (the
    chord from full's activations: it fits by construction, a step or so low), then at the one
    the chord from that budget gives (the memory model's own line there: the largest that fits)."""
    budget = dataclasses.replace(at, ac=ActivationCheckpointing.budget)
    top = _plan(cfg, dataclasses.replace(budget, budget=BUDGET_MAX), errors)
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
        plan = _plan(cfg, dataclasses.replace(budget, budget=value), errors)
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
    for d in degree_options(cfg):
        for pipe in schedule_options(cfg, d):
            trial = Choice(d, cfg.sharding.activation_checkpointing, cfg.train.micro_batch_size, pipe)
            for micro in micro_options(_configure(cfg, trial), d):
                at = dataclasses.replace(trial, micro=micro)
                group = _ac_candidates(cfg, at, device, errors)
                cands += group + _budget_candidates(cfg, at, device, group, errors)
    if not cands and errors and fixed_degrees(cfg) is not None:
        raise ValueError(errors[0])  # the user's own layout is refused: say so, not "auto found none"
    if not cands:
        why = errors[0] if errors else no_batch_split(cfg)
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
    choice = Choice(
        Degrees(**c.degrees),
        ActivationCheckpointing(c.activation_checkpointing),
        c.micro_batch_size,
        _pipeline_of(c),
        c.reshard_after_forward,
        c.activation_memory_budget,
    )
    return _configure(cfg, choice)


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
