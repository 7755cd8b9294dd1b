"""Pipeline parallelism on real gloo ranks reproduces one process (framework.parallel.pipeline).

Each case trains the tiny Llama (untied embeddings, seq 16) for 4 steps of the framework's own
``train_step`` (AdamW, gradient clipping that does clip: train.grad_clip=0.3) on the same global
batch of 8 sequences, and compares the loss and the gradient norm of every step with one process
training on the whole batch: rtol 1e-5 (fp32; micro batches and the reductions sum in another order).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from framework.checkpoint import Checkpointer
from framework.config.schema import Config, PPSchedule
from framework.models import build_model, materialize
from framework.parallel import build_mesh, dp_mesh_info, parallelize
from framework.parallel.pipeline import PipelineModel
from framework.planner.resolve import make_plan
from framework.train.loop import train_step
from framework.train.optimizers import build_optimizer, build_scheduler
from tests.dist import run_ranks

SEQ, GLOBAL_BATCH, STEPS, RTOL = 16, 8, 4, 1e-5
CPU = torch.device("cpu")


def make_cfg(world: int, **parallel: object) -> Config:
    cfg = Config()
    cfg.mesh.shape = [world]
    cfg.model.tie_embeddings = False
    cfg.train.seq_len = SEQ
    cfg.train.global_batch_size = GLOBAL_BATCH
    cfg.train.grad_clip = 0.3
    cfg.train.warmup_steps = 0
    for k, v in parallel.items():
        setattr(cfg.parallel, k, PPSchedule[v] if k == "pp_schedule" else v)
    if parallel:
        cfg.parallel.dp_shard = cfg.parallel.dp_shard or 1
    return cfg


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def run_steps(
    model: torch.nn.Module,
    cfg: Config,
    dp_rank: int,
    dp_size: int,
    micro: int,
    steps: slice = slice(None),
    ckpt: tuple[str, str] | None = None,
) -> list[tuple]:
    """The framework's train_step over ``batches()[steps]``; ``ckpt=("load"|"save", root)`` resumes
    from the latest checkpoint under root before, or saves one after."""
    opt = build_optimizer(model, cfg.train, CPU)
    sched = build_scheduler(opt, cfg.train)
    checkpointer = Checkpointer(cfg.checkpoint, Path(ckpt[1])) if ckpt else None
    if ckpt and ckpt[0] == "load":
        assert checkpointer is not None and checkpointer.latest() is not None
        checkpointer.load(checkpointer.latest(), model, opt, sched)
    out = []
    n = GLOBAL_BATCH // dp_size
    for b in batches()[steps]:
        mine = b[dp_rank * n : (dp_rank + 1) * n]
        mbs = [(mine[i : i + micro, :-1], mine[i : i + micro, 1:]) for i in range(0, n, micro)]
        r = train_step(model, opt, sched, mbs, cfg.train.grad_clip, CPU)
        out.append((r.loss, r.grad_norm))
    if ckpt and ckpt[0] == "save":
        assert checkpointer is not None
        done = len(batches()[steps])
        checkpointer.save(done, model, opt, sched, {"step": done})  # extra.step is the checkpoint's step
        assert checkpointer.last_error is None, checkpointer.last_error
    if checkpointer is not None:
        checkpointer.close()
    return out


@pytest.fixture(scope="module")
def reference() -> list[tuple]:
    cfg = make_cfg(1)
    model = build_model(cfg.model, SEQ)
    materialize(model, "cpu", 0)
    return run_steps(model, cfg, 0, 1, GLOBAL_BATCH)


def _worker(
    rank: int, world: int, cfg: Config, steps: slice = slice(None), ckpt: tuple | None = None
) -> dict:
    plan = make_plan(cfg)
    mesh = build_mesh(plan, "cpu")
    model = parallelize(
        build_model(cfg.model, SEQ), mesh, plan, cfg.sharding, cfg.bucketing, cfg.executor, CPU, 0
    )
    assert isinstance(model, PipelineModel) == (plan.layout.pp > 1)
    dp_rank, dp_size = dp_mesh_info(mesh, plan)
    steps = run_steps(model, cfg, dp_rank, dp_size, plan.micro_batch_size, steps, ckpt)
    return {
        "steps": steps,
        "stages": getattr(model, "stage_ids", None),
        "params": sorted(n for n, _ in model.named_parameters()),
    }


def _check(results: list[dict], reference: list[tuple]) -> float:
    worst = 0.0
    for r in results:
        for (loss, norm), (ref_loss, ref_norm) in zip(r["steps"], reference, strict=True):
            assert loss == pytest.approx(ref_loss, rel=RTOL), (r["stages"], loss, ref_loss)
            assert norm == pytest.approx(ref_norm, rel=RTOL), (r["stages"], norm, ref_norm)
            worst = max(worst, abs(loss - ref_loss) / ref_loss, abs(norm - ref_norm) / ref_norm)
    return worst


SCHEDULE_CASES = [
    ("gpipe", 1, 2),
    ("1f1b", 1, 4),
    ("interleaved_1f1b", 2, 2),
    ("interleaved_zb", 2, 2),
    ("zbv", 2, 2),
]


@pytest.mark.parametrize(("schedule", "spr", "microbatches"), SCHEDULE_CASES)
def test_pp2_schedules_match_one_process(
    reference: list[tuple], schedule: str, spr: int, microbatches: int
) -> None:
    cfg = make_cfg(2, pp=2, pp_schedule=schedule, pp_stages_per_rank=spr, pp_microbatches=microbatches)
    results = run_ranks(_worker, 2, cfg)
    # Every parameter lives on exactly one pp rank, under its single-process name.
    names = results[0]["params"] + results[1]["params"]
    assert sorted(names) == sorted(n for n, _ in build_model(cfg.model, SEQ).named_parameters())
    print(f"pp=2 {schedule}: max rel diff {_check(results, reference):.2e}")


@pytest.mark.parametrize(("other", "degree"), [("dp_shard", 2), ("tp", 2), ("dp_replicate", 2)])
def test_pp_with_data_or_tensor_parallel_matches_one_process(
    reference: list[tuple], other: str, degree: int
) -> None:
    cfg = make_cfg(4, pp=2, **{other: degree})
    results = run_ranks(_worker, 4, cfg)
    print(f"pp=2 x {other}={degree}: max rel diff {_check(results, reference):.2e}")


def test_zero_bubble_with_data_parallel_matches_one_process(reference: list[tuple]) -> None:
    """pp=2 interleaved_zb x dp_replicate=2 (zbv x dp_shard=2, tied: test_pipeline_features). The
    split backward found no weight of a stage whose FSDP units had resharded after their forward,
    so the last stage got no weight gradients (and the middle stages lost some micro batches'):
    the stages now stay unsharded for the step (framework.parallel._pipeline). A lost gradient
    shows in the first step's norm (3.29 one process, 2.42 before the fix)."""
    cfg = make_cfg(
        4, pp=2, pp_schedule="interleaved_zb", pp_stages_per_rank=2, pp_microbatches=2, dp_replicate=2
    )
    results = run_ranks(_worker, 4, cfg)
    print(f"pp=2 interleaved_zb x dp_replicate=2: max rel diff {_check(results, reference):.2e}")


def test_checkpoint_saved_at_pp2_resumes_at_pp1(reference: list[tuple], tmp_path: Path) -> None:
    """DCP by parameter name: 2 steps at pp=2 (1f1b), saved; steps 3-4 resumed on one process (pp=1)
    continues exactly as the unbroken single-process run (weights, AdamW moments, LR schedule)."""
    saved = run_ranks(_worker, 2, make_cfg(2, pp=2), slice(0, 2), ("save", str(tmp_path)))
    _check([{**saved[0], "steps": saved[0]["steps"]}], reference[:2])
    resumed = run_ranks(_worker, 1, make_cfg(1), slice(2, 4), ("load", str(tmp_path)))
    print(f"pp=2 -> pp=1 resume: max rel diff {_check(resumed, reference[2:]):.2e}")


# Bad input: one line naming the value and what is valid, refused before launch, nothing written.
ROOT = Path(__file__).resolve().parents[2]
PP2 = {"mesh.shape": [2], "parallel.pp": 2}
BAD = [
    ({**PP2, "model.n_layers": 1}, "parallel.pp=2 is greater than model.n_layers=1"),
    (
        {**PP2, "parallel.pp_schedule": "interleaved_1f1b"},
        "needs virtual stages (parallel.pp_stages_per_rank >= 2",
    ),
    (
        {**PP2, "parallel.pp_schedule": "zbv", "parallel.pp_stages_per_rank": 3},
        "exactly 2 stages on each rank",
    ),
    (
        {**PP2, "parallel.pp_schedule": "interleaved_1f1b", "parallel.pp_stages_per_rank": 4},
        "= 8 stages but model.n_layers=4",
    ),
    (
        {**PP2, "parallel.pp_microbatches": 3},
        "parallel.pp_microbatches=3 does not divide the data-parallel rank's batch 16",
    ),
    ({**PP2, "parallel.pp_microbatches": 1}, "parallel.pp_microbatches=1 is fewer than parallel.pp=2"),
    (
        {**PP2, "train.optimizer_in_backward": True},
        "train.optimizer_in_backward=true does not work with parallel.pp=2 (pipeline parallelism): its "
        "per-parameter step runs from the gradient-accumulation hook, which a schedule fires once per "
        "micro batch",
    ),
    # The search (activation_checkpointing=auto) used to overwrite the user's micro batch with 8.
    (
        {**PP2, "parallel.pp_microbatches": 2, "train.micro_batch_size": 4},
        "train.micro_batch_size=4 with parallel.pp=2: under a pipeline each micro batch is the rank's "
        "batch 16 / parallel.pp_microbatches (2) = 8 rows; set train.micro_batch_size=8 or 0, or "
        "parallel.pp_microbatches=4 to keep it",
    ),
    # A pipeline field where no pipeline runs did nothing, and the run trained without a word.
    (
        {"parallel.pp_microbatches": 4},
        "parallel.pp_microbatches=4 does nothing without a pipeline (one process runs no pipeline)",
    ),
    (
        {"mesh.shape": [2], "sharding.strategy": "ddp", "parallel.pp_schedule": "zbv"},
        "parallel.pp_schedule=zbv does nothing without a pipeline (this layout has parallel.pp=1)",
    ),
    (
        {"mesh.shape": [2], "parallel.dp_shard": 2, "parallel.pp_stages_per_rank": 2},
        "parallel.pp_stages_per_rank=2 does nothing without a pipeline (this layout has parallel.pp=1)",
    ),
    # A forced layout whose micro batches cannot fill its pipeline: one line naming the minimum.
    (
        {"mesh.shape": [4], "parallel.pp": 4, "train.micro_batch_size": 8},
        "train.micro_batch_size=8 cuts the data-parallel rank's batch 16 into 2 micro batch(es), fewer than "
        "parallel.pp=4: the pipeline needs >= 4 to fill; use train.micro_batch_size <= 4 that divides 16, or 0",
    ),
    (
        {"mesh.shape": [4], "parallel.pp": 4, "train.global_batch_size": 2},
        "train.global_batch_size=2 gives each of the 1 data-parallel ranks 2 sequence(s), fewer than the "
        "parallel.pp=4 micro batches a pipeline needs to fill: use train.global_batch_size >= 4 (pp x dp)",
    ),
    # What torch's interleaved schedules need beyond pp micro batches (it raised in every rank).
    (
        {
            **PP2, "parallel.pp_schedule": "interleaved_1f1b", "parallel.pp_stages_per_rank": 2,
            "parallel.pp_microbatches": 5, "train.global_batch_size": 10,
        },
        "parallel.pp_microbatches=5 with parallel.pp_schedule=interleaved_1f1b on parallel.pp=2: torch's "
        "schedule runs the micro batches in rounds of max(1, 5 // 2) = 2 and needs a multiple of them; "
        "valid here: [2, 10]",
    ),
    (
        {"mesh.shape": [3], "parallel.pp": 3, "run.oversubscribe": True},
        "parallel.pp_microbatches=0 (= parallel.pp: 3 micro batches) does not divide the data-parallel "
        "rank's batch 16",
    ),
]


@pytest.fixture(scope="module")
def composed() -> object:
    from hydra import compose, initialize_config_dir

    from framework.config import schema as config
    from framework.launch import recipes
    from framework.launch.ranks import register_resolvers

    config.register()
    recipes.register()
    register_resolvers()
    with initialize_config_dir(config_dir=str(recipes.CONF_DIR), version_base="1.3"):
        return compose("config")


@pytest.mark.parametrize(("values", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_pipeline_refused_before_launch(
    composed: object, tmp_path: Path, values: dict, message: str
) -> None:
    import copy

    from omegaconf import OmegaConf

    from framework.launch.prelaunch import prelaunch

    d = copy.deepcopy(composed)
    for k, v in values.items():
        OmegaConf.update(d, k, v, merge=False)
    run = tmp_path / "run"
    with pytest.raises(ValueError) as info:
        prelaunch(d, run, "llama_tiny")
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert not run.exists()


def test_a_set_micro_batch_size_gives_the_pipelines_micro_batches(composed: object, tmp_path: Path) -> None:
    """parallel.pp_microbatches unset: the rank's batch / train.micro_batch_size (a recipe's micro
    batch is kept, as the search keeps it), not pp with the micro batch overwritten."""
    import copy

    from omegaconf import OmegaConf

    from framework.launch.prelaunch import prelaunch

    d = copy.deepcopy(composed)
    for k, v in {**PP2, "train.micro_batch_size": 4}.items():
        OmegaConf.update(d, k, v, merge=False)
    cfg, plan, _ = prelaunch(d, tmp_path / "run", "llama_tiny")
    assert (cfg.train.micro_batch_size, plan.pp_microbatches) == (4, 4)


def test_pipeline_fields_shape_the_search_under_sharding_auto(composed: object, tmp_path: Path) -> None:
    """Under sharding=auto on 2 ranks the search weighs pipelines: parallel.pp_schedule=gpipe is
    theirs (not refused as unused), and a pp layout the search lists uses it."""
    import copy

    from omegaconf import OmegaConf

    from framework.launch.prelaunch import prelaunch_with_search

    d = copy.deepcopy(composed)
    for k, v in {"mesh.shape": [2], "parallel.pp_schedule": "gpipe"}.items():
        OmegaConf.update(d, k, v, merge=False)
    _, _, _, found = prelaunch_with_search(d, tmp_path / "run", "llama_tiny")
    assert found is not None
    pipelined = [c for c in found.candidates if c.pp_schedule]
    assert pipelined and all(c.pp_schedule == "gpipe" for c in pipelined)


# train.py itself refuses what stays refused under pp with exit 2 (tests/train/test_train.py).


def test_train_py_runs_a_pipeline_end_to_end(tmp_path: Path) -> None:
    """``python train.py mesh=2 parallel.pp=2`` on the default (tied) recipe with an interleaved
    schedule: trains, evaluates through the schedule, saves a checkpoint (each pp rank its own
    stages' tensors), writes the split, and exports the whole model to Hugging Face's format."""
    import json
    import os

    from tests.entry import train_forked

    run = tmp_path / "run"
    args = [
        "mesh=2",
        "parallel.pp=2",
        "parallel.pp_schedule=interleaved_1f1b",
        "parallel.pp_stages_per_rank=2",
    ]
    args += ["freeze.mode=none", "train.steps=4", "train.seq_len=32"]
    args += ["train.log_every=2", "train.eval_every=2", "train.eval_batches=3", "checkpoint.enabled=true"]
    args += ["checkpoint.export_hf=true"]
    # python train.py, forked from this process (tests/entry.py): the launcher and its 2 ranks are real.
    proc = train_forked(f"hydra.run.dir={run}", *args, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads((run / "plan.json").read_text())
    assert plan["pp_split"] == [[0, 1], [1, 2], [2, 3], [3, 4]] and plan["pp_ranks"] == [[0, 2], [1, 3]]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(losses) == 2 and len(vals) == 3 and all(0 < v < 6 for v in losses + vals), rows
    assert vals[-1] < vals[0]  # 4 steps at lr warm-up still lower the loss of the tiny model
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
    assert (run / "checkpoints").is_dir() and any((run / "checkpoints").glob("*4*"))
    from safetensors import safe_open

    from framework.config.schema import ModelConfig
    from framework.models import model_spec

    with safe_open(str(run / "hf" / "model.safetensors"), "pt") as f:  # every stage's weights, once
        exported = set(f.keys())
    assert exported == {
        model_spec(ModelConfig()).hf_names()[n] for n, _, _ in model_spec(ModelConfig()).params()
    }


# The planner: the split by the per-layer cost model, the bubble, the per-schedule activations.


def _plan_cfg(world: int = 8, **parallel: object) -> Config:
    """Llama 3 8B's shape (128K vocabulary) on H100s, planned only (nothing is built)."""
    from framework.config.schema import HardwareConfig

    cfg = make_cfg(world, **parallel)
    m = cfg.model
    m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.ffn_dim, m.vocab_size = 4096, 32, 32, 8, 14336, 128256
    cfg.mesh.hardware = HardwareConfig(name="h100", memory_gib=80, peak_tflops=989, hbm_gbps=3350)
    cfg.train.seq_len, cfg.train.global_batch_size = 4096, 64
    cfg.run.allow_over_memory = True
    return cfg


def test_split_by_cost_gives_the_head_stage_fewer_blocks_and_is_printed() -> None:
    from framework.planner.report import format_plan

    plan = make_plan(_plan_cfg(8, pp=8, pp_microbatches=16))
    blocks = [b - a for a, b in plan.pp_split]
    assert sum(blocks) == 32 and min(blocks) >= 1
    # The 128K x 4096 head costs more than a block, the embedding far less: the last stage holds
    # fewer blocks than an even split (4); the others stay within one block of each other.
    assert blocks[-1] < 4 and max(blocks) - min(blocks[:-1]) <= 1, blocks
    text = format_plan(plan)
    assert "stage 0 = embedding + blocks 0-" in text and "+ head" in text and "bubble" in text


def test_bubble_and_activations_per_schedule() -> None:
    from framework.planner.stages import bubble_fraction, in_flight

    one_f1b = make_plan(_plan_cfg(4, pp=4, pp_microbatches=16))
    gpipe = make_plan(_plan_cfg(4, pp=4, pp_microbatches=16, pp_schedule="gpipe"))
    inter = make_plan(
        _plan_cfg(4, pp=4, pp_microbatches=16, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2)
    )
    zbv = make_plan(_plan_cfg(4, pp=4, pp_microbatches=16, pp_schedule="zbv", pp_stages_per_rank=2))
    # (pp - 1) / m = 3/16 for GPipe and 1F1B; interleaving over 2 virtual stages halves it; ZB-V a third of that.
    assert one_f1b.pp_bubble == gpipe.pp_bubble == pytest.approx(3 / 16)
    assert inter.pp_bubble == pytest.approx(3 / 32) and zbv.pp_bubble == pytest.approx(1 / 32)
    assert 0 < zbv.prediction.bubble_s < inter.prediction.bubble_s < one_f1b.prediction.bubble_s
    # GPipe holds all 16 micro batches, 1F1B at most pp = 4 in flight on the first rank.
    assert in_flight(PPSchedule["gpipe"], 4, 1, 16) == 16 and in_flight(PPSchedule["1f1b"], 4, 1, 16) == 4
    assert gpipe.memory.activations > 3 * one_f1b.memory.activations
    assert bubble_fraction(PPSchedule["1f1b"], 1, 1, 8) == 0.0
    # Without pp the same model and batch hold 4x the blocks' parameters per rank.
    flat = make_plan(_plan_cfg(4, dp_shard=1, tp=4))
    assert one_f1b.params_per_rank < flat.params_per_rank


def test_search_plans_pipelines_and_says_when_the_bubble_loses() -> None:
    from framework.planner.search import search

    cfg = make_cfg(4)
    cfg.train.seq_len = 64
    result = search(cfg)
    piped = [c for c in result.candidates if c.degrees["pp"] > 1]
    assert {c.pp_schedule for c in piped} >= {"1f1b", "gpipe", "interleaved_1f1b", "zbv"}
    assert any(c.reason.startswith("bubble: ") for c in piped)


def test_pp_with_activation_checkpointing_and_compile_per_stage(reference: list[tuple]) -> None:
    """Full AC and per-block compile (aot_eager) inside each stage of a pp=2 1F1B pipeline."""
    from framework.config.schema import ActivationCheckpointing, CompileScope, ExecutorConfig, ExecutorMode

    cfg = make_cfg(2, pp=2)
    cfg.sharding.activation_checkpointing = ActivationCheckpointing.full
    cfg.executor = ExecutorConfig(mode=ExecutorMode.compile, scope=CompileScope.block, backend="aot_eager")
    results = run_ranks(_ac_compile_worker, 2, cfg)
    # Dynamo compiled the blocks (identical blocks share one graph: parameters are graph inputs).
    assert all(r["graphs"] >= 1 for r in results), [r["graphs"] for r in results]
    print(f"pp=2 + AC full + compile: max rel diff {_check(results, reference):.2e}")


def _ac_compile_worker(rank: int, world: int, cfg: Config) -> dict:
    out = _worker(rank, world, cfg)
    out["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return out


def test_the_pipeline_wrapper_is_told_apart_in_one_place() -> None:
    """No module outside framework/parallel/pipeline.py probes a model for a pipeline's attributes
    (``schedule``, ``stages``, ``tied_copies``, ``has_first``): they ask ``is_pipeline`` (or the
    helpers over it), so a change to the wrapper has one place to follow."""
    import re

    names = "schedule|stages|tied_copies|has_first|has_last"
    probe = re.compile(rf"""(getattr|hasattr)\([^,]+,\s*["']({names})["']""")
    root = Path(__file__).resolve().parents[2] / "framework"
    found = [
        f"{path.relative_to(root)}:{n}"
        for path in sorted(root.rglob("*.py"))
        if path.name != "pipeline.py" or path.parent.name != "parallel"
        for n, line in enumerate(path.read_text().splitlines(), start=1)
        if probe.search(line)
    ]
    assert found == [], found
