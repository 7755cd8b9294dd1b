"""Pipeline stages, planned before launch: which blocks each stage holds, which stages each pp rank
runs, how many micro batches are in flight, and the bubble each schedule leaves.

Pure functions of the config (no process group), so the planner, the search and the dry run read
the same numbers the ranks run with (framework.parallel.pipeline builds the stages from them).

- **Split** (``split_layers``): contiguous blocks per stage, chosen to minimise the slowest stage's
  time under the per-layer cost model: every block costs the same; the first stage also pays for
  the embedding (its AdamW step over vocab x dim parameters and the gather / scatter of each token's
  row) and the last stage for the head (the vocab x dim output projection's 6 flops per parameter and
  token, and the memory-bound pass over the logits), so with a 128K vocabulary they hold fewer blocks.
- **Placement** (``stage_ids``): rank r of the pp axis holds stages r, r + pp, ... (interleaved), or
  r and 2 pp - 1 - r for zbv (the V of the ZB-V schedule).
- **Bubble** (``bubble_fraction``): idle time over the ideal compute time of one rank. GPipe and
  1F1B: (pp - 1) / m for m micro batches (GPipe paper, Huang et al. 2019); interleaving over v
  virtual stages divides it by v (Narayanan et al. 2021, section 2.2); the zero-bubble schedules fill
  about two thirds of what is left with deferred weight gradients (ZB-H1, Qi et al. 2024: a third
  of 1F1B's bubble; ZB-V is counted the same, at v = 2).
- **In flight** (``in_flight``): micro batches whose activations the first rank holds at its peak:
  GPipe all m; 1F1B and the zero-bubble schedules min(m, pp); interleaved 1F1B min(m, pp) x
  (1 + (pp - 1) / (pp v)) (Narayanan et al. 2021).
"""

from __future__ import annotations

import functools
import math

from framework.config.schema import Config, FusedCrossEntropy, PPSchedule
from framework.models import model_spec
from framework.planner.work import adamw_step_bytes

MULTI_STAGE = (PPSchedule["interleaved_1f1b"], PPSchedule["interleaved_zb"], PPSchedule["zbv"])
# Split backward (input, then weight gradients). With data parallelism their FSDP stages stay unsharded
# for the whole step (framework.parallel._pipeline says why torch needs it; the plan counts it).
ZERO_BUBBLE = (PPSchedule["interleaved_zb"], PPSchedule["zbv"])
# Bytes per token of the embedding's forward gather and backward scatter-add of one row (fp32: read
# and write the row forward, read the gradient and add it into the weight's gradient backward).
_EMBED_BYTES_PER_ELEM = 16.0


def held_for_step(cfg: Config, pp: int) -> bool:
    """Whether the FSDP units stay unsharded from their first forward to the step's gradient
    reduction (one all-gather per unit and step; the rank's unsharded weights live for the step):
    always under the zero-bubble schedules (framework.parallel._pipeline), and with
    ``sharding.reshard_after_forward=false`` everywhere: under every pipeline schedule torch's
    ``PipelineStage`` turns ``reshard_after_backward`` off for every backward but the step's
    ``perform_reduce_grad`` (torch/distributed/pipelining/stage.py, torch 2.13), and under gradient
    accumulation the loop does the same (framework.train.loop._no_grad_sync)."""
    return (pp > 1 and cfg.parallel.pp_schedule in ZERO_BUBBLE) or not cfg.sharding.reshard_after_forward


def num_stages(cfg: Config) -> int:
    return max(1, cfg.parallel.pp) * cfg.parallel.pp_stages_per_rank if cfg.parallel.pp > 1 else 1


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int, schedule: PPSchedule) -> list[int]:
    """The stages pp rank ``pp_rank`` runs, in order."""
    if schedule is PPSchedule["zbv"]:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def microbatches(cfg: Config, pp: int, dp: int) -> int:
    """The schedule's micro batches per step: ``parallel.pp_microbatches``; unset, the data-parallel
    rank's batch / ``train.micro_batch_size`` where that is set and gives >= pp whole micro batches
    (a recipe's micro batch is kept, as the layout search keeps it), else pp."""
    if cfg.parallel.pp_microbatches:
        return cfg.parallel.pp_microbatches
    mbs, gbs = cfg.train.micro_batch_size, cfg.train.global_batch_size
    if mbs and gbs % dp == 0 and (gbs // dp) % mbs == 0 and gbs // dp // mbs >= pp:
        return gbs // dp // mbs
    return pp


def check_pipeline(cfg: Config, pp: int, dp: int) -> None:
    """Refuse a pipeline this version cannot run, naming the value and what is valid.

    Raises ValueError for: pp or pp x stages per rank above the number of blocks (each stage needs a
    block); a schedule that needs virtual stages without them (or zbv with other than 2); micro
    batches that do not split the data-parallel rank's batch, or fewer than pp; and the features that
    do not go through a pipeline (fused cross-entropy, optimizer-in-backward: ``check_features``).
    Tied embeddings, document masks, sft's token-weighted loss, the HF export, the verifier's
    numerics check and its NaN injection do (framework.parallel.pipeline).
    """
    p, m = cfg.parallel, cfg.model
    spr, sched = p.pp_stages_per_rank, p.pp_schedule
    if spr < 1:
        raise ValueError(
            f"parallel.pp_stages_per_rank={spr}: use an integer >= 1 (virtual stages per pp rank)"
        )
    if p.pp_microbatches < 0:
        raise ValueError(
            f"parallel.pp_microbatches={p.pp_microbatches}: use 0 (= parallel.pp) or an integer >= 1"
        )
    if pp <= 1:
        return
    if pp > m.n_layers:
        raise ValueError(
            f"parallel.pp={pp} is greater than model.n_layers={m.n_layers}: each pipeline stage needs at "
            f"least one block; valid: parallel.pp <= {m.n_layers}"
        )
    if sched in MULTI_STAGE and spr < 2:
        raise ValueError(
            f"parallel.pp_schedule={sched.value} needs virtual stages (parallel.pp_stages_per_rank >= 2"
            f"{', exactly 2' if sched is PPSchedule['zbv'] else ''}), got parallel.pp_stages_per_rank={spr}: "
            f"set parallel.pp_stages_per_rank=2, or use parallel.pp_schedule=1f1b|gpipe"
        )
    if sched is PPSchedule["zbv"] and spr != 2:
        raise ValueError(
            f"parallel.pp_schedule=zbv places exactly 2 stages on each rank (a V), got "
            f"parallel.pp_stages_per_rank={spr}: set it to 2"
        )
    if sched not in MULTI_STAGE and spr != 1:
        raise ValueError(
            f"parallel.pp_stages_per_rank={spr} with parallel.pp_schedule={sched.value}: that schedule runs "
            f"one stage per rank; use parallel.pp_schedule=interleaved_1f1b|interleaved_zb (or zbv with 2), "
            f"or parallel.pp_stages_per_rank=1"
        )
    if pp * spr > m.n_layers:
        raise ValueError(
            f"parallel.pp={pp} x parallel.pp_stages_per_rank={spr} = {pp * spr} stages but model.n_layers="
            f"{m.n_layers}: each stage needs at least one block; use at most {m.n_layers // pp} stages per rank"
        )
    check_features(cfg, pp)
    _check_microbatches(cfg, pp, dp)


def check_without_pipeline(cfg: Config, pp: int | None) -> None:
    """Refuse a ``parallel.pp_*`` field set where no pipeline can run: it would do nothing.

    ``pp``: the fixed layout's pipeline degree, or None under ``sharding=auto``, where the fields
    shape the pipelines the search weighs, unless one process leaves it none to weigh.
    """
    if (pp is None and cfg.mesh.world_size > 1) or (pp is not None and pp > 1):
        return
    p, default = cfg.parallel, type(cfg.parallel)()
    why = "one process runs no pipeline" if cfg.mesh.world_size == 1 else "this layout has parallel.pp=1"
    for name in ("pp_schedule", "pp_microbatches", "pp_stages_per_rank"):
        value, unset = getattr(p, name), getattr(default, name)
        if value != unset:
            shown, unset_shown = getattr(value, "value", value), getattr(unset, "value", unset)
            raise ValueError(
                f"parallel.{name}={shown} does nothing without a pipeline ({why}): set parallel.pp >= 2 "
                f"(on a mesh of >= 2 ranks), or leave parallel.{name} at its default ({unset_shown})"
            )


def schedule_accepts(schedule: PPSchedule, pp: int, n: int) -> bool:
    """Whether torch's schedule class runs ``n`` micro batches on ``pp`` ranks: >= pp for every
    schedule here (Schedule1F1B refuses fewer, the others never fill), and for the interleaved
    ones a multiple of their rounds, max(1, n // pp) (ScheduleInterleaved1F1B and
    ScheduleInterleavedZeroBubble, torch/distributed/pipelining/schedules.py, torch 2.13)."""
    if n < pp:
        return False
    if schedule in (PPSchedule["interleaved_1f1b"], PPSchedule["interleaved_zb"]):
        return n % max(1, n // pp) == 0
    return True


def _check_microbatches(cfg: Config, pp: int, dp: int) -> None:
    """Micro batches that fill the pipeline and that the schedule runs (ValueError naming the
    minimum, or the valid counts)."""
    gbs, n = cfg.train.global_batch_size, microbatches(cfg, pp, dp)
    local = gbs // dp if gbs % dp == 0 else None
    if local is None:
        return  # the batch check names that (framework.planner.plan._check_batch)
    sched, mbs = cfg.parallel.pp_schedule, cfg.train.micro_batch_size
    if local < pp:
        raise ValueError(
            f"train.global_batch_size={gbs} gives each of the {dp} data-parallel ranks {local} "
            f"sequence(s), fewer than the parallel.pp={pp} micro batches a pipeline needs to fill: use "
            f"train.global_batch_size >= {pp * dp} (pp x dp), or a smaller parallel.pp"
        )
    if not cfg.parallel.pp_microbatches and mbs and local % mbs == 0 and local // mbs < pp:
        raise ValueError(
            f"train.micro_batch_size={mbs} cuts the data-parallel rank's batch {local} into "
            f"{local // mbs} micro batch(es), fewer than parallel.pp={pp}: the pipeline needs >= {pp} to "
            f"fill; use train.micro_batch_size <= {local // pp} that divides {local}, or 0"
        )
    if n < pp:
        raise ValueError(
            f"parallel.pp_microbatches={n} is fewer than parallel.pp={pp}: the pipeline never fills "
            f"(every schedule here needs >= pp micro batches); use parallel.pp_microbatches >= {pp} "
            f"that divides the data-parallel rank's batch {local}, or 0 (= pp)"
        )
    valid = [k for k in range(pp, local + 1) if local % k == 0 and schedule_accepts(sched, pp, k)]
    # Unset, it is pp: say so, not a value the user never wrote.
    shown = n if cfg.parallel.pp_microbatches else f"0 (= parallel.pp: {n} micro batches)"
    if local % n:
        raise ValueError(
            f"parallel.pp_microbatches={shown} does not divide the data-parallel rank's batch {local} "
            f"(train.global_batch_size={gbs} / dp {dp}): valid: {valid or 'none; raise the global batch'}"
        )
    if not schedule_accepts(sched, pp, n):
        rounds = max(1, n // pp)
        raise ValueError(
            f"parallel.pp_microbatches={shown} with parallel.pp_schedule={sched.value} on parallel.pp={pp}: "
            f"torch's schedule runs the micro batches in rounds of max(1, {n} // {pp}) = {rounds} and "
            f"needs a multiple of them; valid here: {valid or 'none; change the global batch'}"
        )
    if mbs not in (0, local // n):
        keep = (
            f", or parallel.pp_microbatches={local // mbs} to keep it"
            if local % mbs == 0 and local // mbs >= pp
            else ""
        )
        raise ValueError(
            f"train.micro_batch_size={mbs} with parallel.pp={pp}: under a pipeline each micro batch is "
            f"the rank's batch {local} / parallel.pp_microbatches ({n}) = {local // n} rows; set "
            f"train.micro_batch_size={local // n} or 0{keep}"
        )


def check_features(cfg: Config, pp: int) -> None:
    """The features that do not go through a pipeline (ValueError naming the key).

    Optimizer-in-backward (``loop.InBackward``) steps each parameter from its post-accumulate-grad
    hook, once per step. torch's ``PipelineStage`` runs one backward per micro batch (every schedule
    needs >= pp of them), each accumulating into ``.grad`` and firing the hook, so a parameter would
    be stepped pp or more times per step on partial gradients; the zero-bubble schedules' weight pass
    (``stage_backward_weight``) assigns ``.grad`` directly and fires it never. The loss, whose
    finiteness gates each update, is also only known on the last stage. Refused for good, not for now.
    """
    why = {
        f"model.fused_cross_entropy={cfg.model.fused_cross_entropy.value}": (
            cfg.model.fused_cross_entropy is not FusedCrossEntropy.none,
            "the schedule computes the loss from the last stage's logits; set model.fused_cross_entropy=none",
        ),
        "train.optimizer_in_backward=true": (
            cfg.train.optimizer_in_backward,
            "its per-parameter step runs from the gradient-accumulation hook, which a schedule fires "
            "once per micro batch (>= pp per step: each step would see a partial gradient) or, in a "
            "zero-bubble schedule's weight pass, never; set train.optimizer_in_backward=false",
        ),
    }
    for key, (on, reason) in why.items():
        if on:
            raise ValueError(f"{key} does not work with parallel.pp={pp} (pipeline parallelism): {reason}")


def layer_costs(cfg: Config, tokens: float) -> tuple[tuple[float, ...], float, float]:
    """(each block, the embedding, the head) in seconds per step for ``tokens`` tokens on one rank, at
    the declared hardware's calibrated GEMM rate and HBM bandwidth (framework.planner.cost's terms).
    Each block is costed by its layer kind (its weights and attention: a dense layer of a stack of
    dense and MoE layers costs less than an MoE one)."""
    m, hw, seq = cfg.model, cfg.mesh.hardware, cfg.train.seq_len
    peak = hw.peak_tflops * 1e12 * hw.gemm_efficiency
    hbm = hw.hbm_gbps * 1e9
    spec = model_spec(m)
    hd = spec.head_dim
    adamw = adamw_step_bytes(cfg)
    costs = {}
    for kind, _ in spec.kinds():
        block_params = sum(math.prod(w.shape) for w in kind.weights)
        heads = kind.score_width or m.n_heads * hd
        block = tokens * (6.0 * block_params + 12.0 * heads * seq) / peak
        block += (tokens * (2 * m.dim + m.ffn_dim) * 40.0 + block_params * adamw) / hbm
        costs[id(kind)] = block
    table = m.vocab_size * m.dim
    embed = (tokens * m.dim * _EMBED_BYTES_PER_ELEM + table * adamw) / hbm
    head = tokens * 6.0 * table / peak + (tokens * m.vocab_size * 12.0 + table * adamw) / hbm
    return tuple(costs[id(kind)] for kind in spec.layers), embed, head


def split_layers(cfg: Config, stages: int, tokens: float) -> tuple[tuple[int, int], ...]:
    """[start, stop) blocks of each of ``stages`` stages: contiguous, >= 1 block each, minimising the
    slowest stage's cost (blocks, plus the embedding on the first and the head on the last). Layers
    of one kind are cut by count; layers of several kinds by their cost (``layer_costs``)."""
    blocks, embed, head = layer_costs(cfg, tokens)
    # In block units (the mean block's), rounded so that the cache sees few distinct keys.
    block = sum(blocks) / len(blocks)
    weights = None if model_spec(cfg.model).uniform else tuple(round(b / block, 3) for b in blocks)
    return _split(cfg.model.n_layers, stages, round(embed / block, 3), round(head / block, 3), weights)


@functools.lru_cache(maxsize=4096)
def _split(
    n: int, stages: int, embed: float, head: float, weights: tuple[float, ...] | None = None
) -> tuple[tuple[int, int], ...]:
    assert 1 <= stages <= n, (stages, n)
    prefix = [0.0]
    for w in weights or ():
        prefix.append(prefix[-1] + w)

    def cost(i: int, j: int, s: int) -> float:  # blocks i..j-1 as stage s
        blocks = (j - i) if weights is None else prefix[j] - prefix[i]
        return blocks + (embed if s == 0 else 0.0) + (head if s == stages - 1 else 0.0)

    # best[s][j]: (slowest stage, cut) placing blocks 0..j-1 on stages 0..s.
    best = [[(math.inf, -1)] * (n + 1) for _ in range(stages)]
    for j in range(1, n - stages + 2):
        best[0][j] = (cost(0, j, 0), 0)
    for s in range(1, stages):
        for j in range(s + 1, n - stages + s + 2):
            for i in range(s, j):
                worst = max(best[s - 1][i][0], cost(i, j, s))
                if worst < best[s][j][0]:
                    best[s][j] = (worst, i)
    cuts, j = [n], n
    for s in range(stages - 1, 0, -1):
        j = best[s][j][1]
        cuts.append(j)
    cuts.append(0)
    cuts.reverse()
    return tuple((cuts[k], cuts[k + 1]) for k in range(stages))


def stage_cost_fraction(
    split: tuple[tuple[int, int], ...], ranks: list[list[int]], cfg: Config, tokens: float
) -> float:
    """The busiest pp rank's share of the whole model's cost (1 / pp when perfectly balanced)."""
    blocks, embed, head = layer_costs(cfg, tokens)
    last = len(split) - 1
    uniform = model_spec(cfg.model).uniform
    block = blocks[0]

    def layers(a: int, b: int) -> float:
        return (b - a) * block if uniform else sum(blocks[a:b])

    def stage(s: int) -> float:
        a, b = split[s]
        return layers(a, b) + (embed if s == 0 else 0.0) + (head if s == last else 0.0)

    total = layers(0, cfg.model.n_layers) + embed + head
    return max(sum(stage(s) for s in ids) for ids in ranks) / total


def bubble_fraction(schedule: PPSchedule, pp: int, stages_per_rank: int, m: int) -> float:
    """Idle time over one rank's ideal compute time (see the module docstring)."""
    if pp <= 1:
        return 0.0
    base = (pp - 1) / m
    if schedule is PPSchedule["interleaved_1f1b"]:
        return base / stages_per_rank
    if schedule in (PPSchedule["interleaved_zb"], PPSchedule["zbv"]):
        return base / (3 * stages_per_rank)
    return base


def in_flight(schedule: PPSchedule, pp: int, stages_per_rank: int, m: int) -> float:
    """Micro batches of activations the first rank holds at its peak (see the module docstring)."""
    if pp <= 1:
        return 1.0
    if schedule is PPSchedule["gpipe"]:
        return float(m)
    if schedule is PPSchedule["interleaved_1f1b"] or schedule is PPSchedule["interleaved_zb"]:
        return min(m, pp) * (1 + (pp - 1) / (pp * stages_per_rank))
    return float(min(m, pp))


def rank_stages(pp: int, stages_per_rank: int, schedule: PPSchedule) -> list[list[int]]:
    return [stage_ids(r, pp, stages_per_rank, schedule) for r in range(pp)]


def describe_split(split: tuple[tuple[int, int], ...], ranks: list[list[int]]) -> str:
    """``rank 0: stage 0 = embedding + blocks 0-5; rank 1: stage 1 = blocks 6-10 + head`` style."""
    last = len(split) - 1
    parts = []
    for r, ids in enumerate(ranks):
        descs = []
        for s in ids:
            a, b = split[s]
            what = [f"blocks {a}-{b - 1}" if b - a > 1 else f"block {a}"]
            if s == 0:
                what.insert(0, "embedding")
            if s == last:
                what.append("head")
            descs.append(f"stage {s} = {' + '.join(what)}")
        parts.append(f"rank {r}: {', '.join(descs)}")
    return "; ".join(parts)
