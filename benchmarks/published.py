"""Predicted (framework.planner) against published throughput of large dense Llama-family training runs
on H100 GPUs, each with its published layout forced.

Why: the planner's cost model was fitted to one- and two-GPU runs (benchmarks/cost_check.py); these
rows are what runs of hundreds to 16,384 GPUs measured. Every row is BF16 (fp8 rows, the bulk of
NVIDIA's Megatron-Bridge / NeMo tables for H100, are left out: the planner costs no float8 GEMMs yet).
Each row names its source (document and table); what the source does not state is marked
``assumed`` in ``Published.assumed`` and is the planner's choice, not a published number.

Beside each forced layout, ``sharding=auto``'s own pick for the same job (recipe, mesh, hardware,
sequence, global batch, executor, mixed precision; degrees, micro batch, schedule, activation
checkpointing and reshard policy left to the search), predicted at least as fast wherever the
published layout fits. Where the source gives the peak memory it measured, it is printed beside
the planner's.

Runs on the CPU machine in about 30 s (planner only, no training):
``python benchmarks/published.py``. ``tests/planner/test_published.py`` pins the predictions.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from framework.config.schema import ActivationCheckpointing, Config, PPSchedule  # noqa: E402
from framework.launch.recipes import compose_recipe  # noqa: E402
from framework.models import flops_per_token  # noqa: E402
from framework.planner.layout import fixed_degrees  # noqa: E402
from framework.planner.params import GIB  # noqa: E402
from framework.planner.plan import Plan, plan_for  # noqa: E402
from framework.planner.search import Candidate, search  # noqa: E402

LLAMA3_PAPER = (
    "Llama Team, The Llama 3 Herd of Models, arXiv 2407.21783, table 4 (scaling configurations and MFU "
    "of Llama 3 405B pre-training; also Balaji, SC'24 talk, as quoted at glennklockwood.com/garden/llama-3.1)"
)
TITAN_2412 = (
    "torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (github.com/pytorch/torchtitan, torchtitan "
    "9dec370, torch 1963fc8, 2024-12)"
)
TITAN_2506 = (
    "torchtitan, benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (github.com/pytorch/torchtitan, "
    "torchtitan 820504e, torch 38410cf9, 2025-06); the 'Vanilla TP' bfloat16 column"
)
# torchtitan's H100s: 96 GB HBM2e, 2.4 TB/s, 500 W power limit; "the actual peak TFLOPs number is between
# SXM and NVL, and we don't know its exact value" (the 2024-12 file's footnote 2). Predicted with
# conf/mesh/hardware/h100_96gb_500w.yaml (that memory and bandwidth; the peak that fits these six
# rows best within the footnote's interval, its lower end 835). The figures that chose that profile
# and that peak: benchmarks/PERF.md, "Session 9: the planner against published large runs (issue 26)"
# and "Session 14: issue 26's last row: the 500 W H100's peak fitted to torchtitan's six rows".
TITAN_HW = "H100 96GB HBM2e at 500 W (Grand Teton), 400 Gb/s RDMA per GPU"
TITAN_PROFILE = "h100_96gb_500w"
META_HW = "H100 SXM 80GB at 700 W (Grand Teton), 400 Gb/s RoCE per GPU"
_HELD = "FSDP units held unsharded for the step (reshard_after_forward=false)"
# torchtitan at 9dec370 compiled each TransformerBlock only (parallelize_llama.py apply_compile); its
# train.py leaves loss_fn's torch.compile commented out ("compiling loss function causes CUDA errors"),
# so the final norm, output projection and fp32 cross-entropy ran eager: executor.compile_loss=false.
# At 820504e (the 2025-06 rows) the loss function is compiled with the blocks (components/loss.py).
_EAGER_LOSS = "blocks compiled, loss head eager (9dec370's train.py: loss_fn's torch.compile commented out)"
# Every row gathers bf16 parameters and reduces fp32 gradients: torchtitan's mixed_precision_param /
# mixed_precision_reduce defaults (bfloat16 / float32), as Megatron's bf16 training does.
MIXED_PRECISION = ["sharding.param_dtype=bfloat16", "sharding.reduce_dtype=float32"]


@dataclass(frozen=True)
class Published:
    """One published run: its shape, layout and measured throughput, and where each came from."""

    label: str
    source: str  # document and table
    hardware: str
    recipe: str  # the shape: recipes/<name>.yaml (Llama 3 8B, 70B, 405B)
    gpus: int
    seq_len: int
    global_batch: int  # sequences per optimizer step
    micro_batch: int
    tp: int
    pp: int
    dp_shard: int  # FSDP degree (torchtitan's data_parallel_shard_degree; Llama 3's DP, FSDP)
    cp: int = 1
    pp_schedule: str = ""
    pp_stages_per_rank: int = 1  # 0: not published, the planner's fastest of VIRTUAL_OPTIONS
    pp_microbatches: int = 0
    # none | selective (every other block) | selective_op (torchtitan's per-op SAC, its "selective"
    # with selective_ac_option = 'op') | full, or auto (not published: the fastest that fits)
    activation_checkpointing: str = "auto"
    executor: str = "compile"  # eager | compile (torch.compile); a framework of its own: compile
    # Under compile, whether the loss head was compiled too (executor.compile_loss); a framework of
    # its own: as this framework's default, compiled.
    compile_loss: bool = True
    # FSDP units resharded after each forward (torchtitan's default without pp), or held unsharded
    # from the first forward to the step's reduction (its default under pp; framework.planner.stages)
    reshard_after_forward: bool = True
    precision: str = "bf16"
    tokens_per_s_gpu: float = 0.0  # as published
    tflops_per_gpu: float = 0.0  # as published, where the source gives model TFLOP/s instead
    flop_formula: str = ""
    assumed: tuple[str, ...] = field(default_factory=tuple)  # what the source does not state
    # Peak memory per GPU as published (GiB; 0: not published). torchtitan's is the caching
    # allocator's peak reserved memory (torch.cuda.memory_stats "reserved_bytes.all.peak", its
    # metrics.py at 9dec370), which holds the allocator's free blocks too.
    memory_gib: float = 0.0
    # Where the published run did something this framework's runtime (so its plan) does not.
    differs: str = ""
    profile: str = "h100_sxm"  # conf/mesh/hardware/<profile>.yaml

    def __post_init__(self) -> None:
        if self.hardware == TITAN_HW:  # every torchtitan row ran on its 500 W H100s
            object.__setattr__(self, "profile", TITAN_PROFILE)

    @property
    def nodes(self) -> int:
        return self.gpus // 8


ROWS: tuple[Published, ...] = (
    Published(
        "405B 8K, 8192 GPUs", LLAMA3_PAPER + ", row 1", META_HW, "llama3_405b", 8192, 8192, 2048, 1,
        tp=8, pp=16, dp_shard=64, pp_schedule="interleaved_1f1b", pp_stages_per_rank=0, pp_microbatches=32,
        tflops_per_gpu=430.0, flop_formula="paper: 430 TFLOP/s per GPU, 43% BF16 MFU of 989",
        reshard_after_forward=False,
        assumed=("virtual stages (planner: fastest of 1, 2, 4)", "micro batch 1 (batch/DP 32 = 32 micro batches)", "AC", _HELD),
    ),
    Published(
        "405B 8K, 16384 GPUs", LLAMA3_PAPER + ", row 2", META_HW, "llama3_405b", 16384, 8192, 2048, 1,
        tp=8, pp=16, dp_shard=128, pp_schedule="interleaved_1f1b", pp_stages_per_rank=0, pp_microbatches=16,
        tflops_per_gpu=400.0, flop_formula="paper: 400 TFLOP/s per GPU, 41% BF16 MFU of 989",
        reshard_after_forward=False,
        assumed=("virtual stages (planner: fastest of 1, 2, 4)", "micro batch 1 (batch/DP 16 = 16 micro batches)", "AC", _HELD),
    ),
    Published(
        "405B 128K, 16384 GPUs", LLAMA3_PAPER + ", row 3", META_HW, "llama3_405b", 16384, 131072, 128, 1,
        tp=8, pp=16, dp_shard=8, cp=16, pp_schedule="interleaved_1f1b", pp_stages_per_rank=0,
        pp_microbatches=16, tflops_per_gpu=380.0, flop_formula="paper: 380 TFLOP/s per GPU, 38% BF16 MFU of 989",
        reshard_after_forward=False,
        assumed=("virtual stages (planner: fastest of 1, 2, 4)", "micro batch 1 (batch/DP 16 = 16 micro batches)", "AC", _HELD),
    ),
    Published(
        "8B FSDP 8 GPUs, eager", TITAN_2412 + ", table 1, row FSDP", TITAN_HW, "llama3_8b", 8, 8192, 16, 2,
        tp=1, pp=1, dp_shard=8, activation_checkpointing="selective_op", executor="eager", tokens_per_s_gpu=5762.0,
        memory_gib=82.4,
        assumed=("seq 8192: train_configs/llama3_8b.toml at 9dec370 (also its selective_ac_option = 'op')",),
    ),
    Published(
        "8B FSDP 8 GPUs, compile", TITAN_2412 + ", table 1, row FSDP + torch.compile", TITAN_HW, "llama3_8b",
        8, 8192, 16, 2, tp=1, pp=1, dp_shard=8, activation_checkpointing="selective_op", tokens_per_s_gpu=6667.0,
        memory_gib=77.0, compile_loss=False,
        assumed=("seq 8192: train_configs/llama3_8b.toml at 9dec370 (also its selective_ac_option = 'op')",),
    ),
    Published(
        "8B FSDP 128 GPUs, eager", TITAN_2412 + ", table 3, row FSDP", TITAN_HW, "llama3_8b", 128, 8192, 256, 2,
        tp=1, pp=1, dp_shard=128, activation_checkpointing="selective_op", executor="eager", tokens_per_s_gpu=5605.0,
        memory_gib=67.0,
        assumed=("seq 8192: train_configs/llama3_8b.toml at 9dec370 (also its selective_ac_option = 'op')",),
    ),
    Published(
        "8B FSDP 128 GPUs, compile", TITAN_2412 + ", table 3, row FSDP + torch.compile", TITAN_HW, "llama3_8b",
        128, 8192, 256, 2, tp=1, pp=1, dp_shard=128, activation_checkpointing="selective_op",
        tokens_per_s_gpu=6514.0, memory_gib=62.0, compile_loss=False,
        assumed=("seq 8192: train_configs/llama3_8b.toml at 9dec370 (also its selective_ac_option = 'op')",),
    ),
    Published(
        "8B FSDP 8 x TP 8, 64 GPUs", TITAN_2506 + ", table 'Llama3 8b on 64 H100s'", TITAN_HW, "llama3_8b",
        64, 8192, 96, 12, tp=8, pp=1, dp_shard=8, activation_checkpointing="selective_op", tokens_per_s_gpu=4378.0,
        assumed=(
            "seq 8192: torchtitan/models/llama3/train_configs/llama3_8b.toml at 820504e",
            "global batch 96 = local batch 12 x FSDP 8",
        ),
    ),
    Published(
        "70B FSDP 32 x TP 8, 256 GPUs", TITAN_2506 + ", table 'Llama3 70b on 256 H100s'", TITAN_HW, "llama70b",
        256, 8192, 512, 16, tp=8, pp=1, dp_shard=32, activation_checkpointing="full", tokens_per_s_gpu=597.3,
        assumed=(
            "seq 8192: torchtitan/models/llama3/train_configs/llama3_70b.toml at 820504e",
            "global batch 512 = local batch 16 x FSDP 32",
        ),
    ),
)  # fmt: skip

AC_OPTIONS = ("none", "selective", "selective_op", "full")
# Where a source names the interleaved schedule but not its virtual stages per rank.
VIRTUAL_OPTIONS = (1, 2, 4)


def _job(row: Published) -> list[str]:
    """What the row's job is, whoever picks its layout: the machines, executor, sequence and batch."""
    return [
        f"mesh={row.nodes}x8",
        f"mesh/hardware={row.profile}",
        "run.device=cuda",
        "run.dry_run=true",
        f"executor={row.executor}",
        *([] if row.executor == "eager" else [f"executor.compile_loss={str(row.compile_loss).lower()}"]),
        f"train.seq_len={row.seq_len}",
        f"train.global_batch_size={row.global_batch}",
    ]


def overrides(row: Published, ac: str, virtual: int = 1) -> list[str]:
    """The command line that forces the row's layout (what ``python train.py recipe=...`` would take)."""
    out = [
        *_job(row),
        f"train.micro_batch_size={row.micro_batch}",
        f"parallel.tp={row.tp}",
        f"parallel.pp={row.pp}",
        f"parallel.cp={row.cp}",
        f"parallel.dp_shard={row.dp_shard}",
        f"sharding.activation_checkpointing={ac}",
        f"sharding.reshard_after_forward={str(row.reshard_after_forward).lower()}",
        *MIXED_PRECISION,
    ]
    if row.pp > 1:
        schedule = row.pp_schedule if virtual > 1 or row.pp_schedule != "interleaved_1f1b" else "1f1b"
        out += [
            f"parallel.pp_schedule={schedule}",
            f"parallel.pp_stages_per_rank={virtual}",
            f"parallel.pp_microbatches={row.pp_microbatches}",
        ]
    return out


def search_overrides(row: Published) -> list[str]:
    """The same job with the layout left to ``sharding=auto``: degrees, micro batch (0), pipeline
    schedule, activation checkpointing (auto) and reshard policy are the search's."""
    return [
        *_job(row),
        "train.micro_batch_size=0",
        "sharding=auto",
        *MIXED_PRECISION,
    ]


def auto_pick(row: Published) -> Candidate:
    """``sharding=auto``'s choice for the row's job (framework.planner.search)."""
    return search(compose_recipe(row.recipe, search_overrides(row))).chosen


def _variant(base: Config, row: Published, ac: str, virtual: int) -> Config:
    """``base`` with what ``overrides(row, ac, virtual)`` sets differently for each choice: the
    activation checkpointing, and under pipelining the schedule and virtual stages per rank."""
    sharding = dataclasses.replace(base.sharding, activation_checkpointing=ActivationCheckpointing(ac))
    parallel = base.parallel
    if row.pp > 1:
        schedule = row.pp_schedule if virtual > 1 or row.pp_schedule != "interleaved_1f1b" else "1f1b"
        parallel = dataclasses.replace(parallel, pp_schedule=PPSchedule(schedule), pp_stages_per_rank=virtual)
    return dataclasses.replace(base, sharding=sharding, parallel=parallel)


def _plan(cfg: Config) -> Plan:
    d = fixed_degrees(cfg)
    assert d is not None, "a published row forces its degrees"
    return plan_for(cfg, d, check_memory=False)


def predict(row: Published) -> tuple[Plan, Config]:
    """The plan of the row's forced layout; where the source gives no activation checkpointing (or no
    virtual stages), the fastest choice that fits the device (else the smallest), as
    ``sharding.activation_checkpointing=auto`` would choose."""
    modes = AC_OPTIONS if row.activation_checkpointing == "auto" else (row.activation_checkpointing,)
    virtuals = VIRTUAL_OPTIONS if row.pp > 1 and not row.pp_stages_per_rank else (row.pp_stages_per_rank,)
    # One compose per row (0.3 s each); the other choices are that config with the keys they set,
    # equal to composing ``overrides(row, ac, v)`` (checked for every row when this was written).
    base = compose_recipe(row.recipe, overrides(row, modes[0], virtuals[0]))
    plans = []
    for ac in modes:
        for v in virtuals:
            cfg = _variant(base, row, ac, v)
            plans.append((_plan(cfg), cfg))
    fitting = [pc for pc in plans if pc[0].memory.total <= pc[0].memory.device]
    if fitting:
        return min(fitting, key=lambda pc: pc[0].prediction.step_time_s)
    return min(plans, key=lambda pc: pc[0].memory.total)


def published_tokens_per_s_gpu(row: Published, cfg: Config) -> float:
    """Published tokens/s per GPU; from TFLOP/s per GPU with the planner's flops per token (6N +
    12·L·H·Q·T, framework.models.flops_per_token) where the source gives TFLOP/s (its own formula is
    not stated; so this also assumes it counts as ours does)."""
    if row.tokens_per_s_gpu:
        return row.tokens_per_s_gpu
    return row.tflops_per_gpu * 1e12 / flops_per_token(cfg.model, cfg.train.seq_len)


def layout_text(row: Published, plan: Plan) -> str:
    parts = [f"TP{row.tp}", f"PP{row.pp}", f"CP{row.cp}", f"FSDP{row.dp_shard}"]
    if row.pp > 1:
        parts.append(f"{plan.pp_schedule} v{plan.pp_stages_per_rank} m{plan.pp_microbatches}")
    parts.append(f"mbs{row.micro_batch} AC {plan.activation_checkpointing}")
    parts.append("held" if not row.reshard_after_forward else "reshard")
    return " ".join(parts)


def auto_text(c: Candidate) -> str:
    return f"{c.short()} mbs{c.micro_batch_size} AC {c.activation_checkpointing}"


def table(with_search: bool = True, search_only_fitting: bool = False) -> list[dict[str, object]]:
    """One dict per row: the layout, published and predicted tokens/s per GPU, the error, the memory
    (predicted, and published where the source gives it), and ``sharding=auto``'s pick beside it.
    ``search_only_fitting``: the search only where the forced layout fits (what auto is compared
    with, tests/planner/test_published.py); the other rows get no pick."""
    out = []
    for row in ROWS:
        plan, cfg = predict(row)
        published = published_tokens_per_s_gpu(row, cfg)
        predicted = plan.prediction.tokens_per_s / row.gpus
        fits = plan.memory.total <= plan.memory.device
        pick = auto_pick(row) if with_search and (fits or not search_only_fitting) else None
        out.append(
            {
                "label": row.label,
                "layout": layout_text(row, plan),
                "seq": row.seq_len,
                "gbs": row.global_batch,
                "executor": row.executor,
                "published": published,
                "predicted": predicted,
                "error": predicted / published - 1.0,
                "predicted_mfu": plan.prediction.mfu,
                "memory_gib": plan.memory.total / GIB,
                "published_memory_gib": row.memory_gib,
                "fits": fits,
                "step_s": plan.prediction.step_time_s,
                "compute_s": plan.prediction.compute_s,
                "exposed_comm_s": plan.prediction.exposed_comm_s,
                "bubble_s": plan.prediction.bubble_s,
                "plan": plan,
                "auto": pick,
                "auto_layout": auto_text(pick) if pick else "",
                "auto_predicted": pick.predicted_tokens_per_s / row.gpus if pick else 0.0,
            }
        )
    return out


def _memory_text(r: dict[str, object]) -> str:
    text = f"{r['memory_gib']:.1f}{'' if r['fits'] else ' (over)'}"
    mine, theirs = float(r["memory_gib"]), float(r["published_memory_gib"])  # type: ignore[arg-type]
    return text + (f" / {theirs:.1f} ({mine / theirs - 1:+.0%})" if theirs else " / -")


def winning_term(forced: Plan, pick: Candidate) -> str:
    """The term of the plan that makes ``sharding=auto``'s pick faster than the forced layout: the one
    whose seconds a step drop the most (per token: the two may differ in batch per step)."""
    p = forced.prediction
    scale = pick.predicted_tokens_per_s * pick.predicted_step_time_s / (p.tokens_per_s * p.step_time_s)
    terms = {
        "compute": (p.compute_s, pick.compute_s),
        "memory-bound": (p.memory_s, pick.memory_bound_s),
        "optimizer": (p.optimizer_s, pick.optimizer_s),
        "exposed comm": (p.exposed_comm_s, pick.exposed_comm_s),
        "bubble": (p.bubble_s, pick.bubble_s),
    }
    gains = {k: a - b / scale for k, (a, b) in terms.items()}
    best = max(gains, key=lambda k: gains[k])
    a, b = terms[best]
    return f"{best}: {a:.2f} s -> {b / scale:.2f} s a step's tokens"


def main() -> int:
    rows = table()
    print(
        "| run | layout | seq | GBS | exec | published tok/s/GPU | predicted | error | pred. MFU "
        "| GiB predicted / published | step s (compute, exposed comm, bubble) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['label']} | {r['layout']} | {r['seq']} | {r['gbs']} | {r['executor']} | "
            f"{r['published']:,.0f} | {r['predicted']:,.0f} | {r['error']:+.1%} | {r['predicted_mfu']:.1%} | "
            f"{_memory_text(r)} | {r['step_s']:.2f} "
            f"({r['compute_s']:.2f}, {r['exposed_comm_s']:.2f}, {r['bubble_s']:.2f}) |"
        )
    within = sum(abs(float(r["error"])) <= 0.20 for r in rows)  # type: ignore[arg-type]
    print(f"\n{within} of {len(rows)} within +-20%")
    print("\nsharding=auto on the same job (degrees, micro batch, schedule, AC, reshard policy free):\n")
    print("| run | auto's pick | GiB | predicted tok/s/GPU | forced (published layout) | auto / forced | wins by |")
    print("|---|---|---|---|---|---|---|")
    slower = 0
    for r in rows:
        pick: Candidate = r["auto"]  # type: ignore[assignment]
        ratio = float(r["auto_predicted"]) / float(r["predicted"])  # type: ignore[arg-type]
        note = "" if r["fits"] else " (forced does not fit)"
        slower += bool(r["fits"]) and ratio < 1.0
        print(
            f"| {r['label']} | {r['auto_layout']} | {pick.memory_gib:.1f} | {r['auto_predicted']:,.0f} | "
            f"{r['predicted']:,.0f}{note} | {ratio:.3f} | "
            f"{winning_term(r['plan'], pick) if ratio > 1.3 else ''} |"  # type: ignore[arg-type]
        )
    verdict = "yes" if not slower else f"no ({slower} slower)"
    print(f"\nauto predicted at least as fast as every forced layout that fits: {verdict}")
    print("\nSources:")
    for row in ROWS:
        assumed = f"; assumed: {', '.join(row.assumed)}" if row.assumed else ""
        if not row.compile_loss:
            assumed = f"; {_EAGER_LOSS}{assumed}"
        differs = f"; differs: {row.differs}" if row.differs else ""
        print(f"- {row.label}: {row.source}; {row.hardware}{assumed}{differs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
