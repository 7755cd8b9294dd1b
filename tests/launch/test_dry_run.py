"""Dry run on a fake process group: the real sharded model agrees with the planner's estimate."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch.distributed as dist

from framework.config.schema import Config, ModelConfig, ModelFamily, MoEConfig, Strategy
from framework.launch.dry_run import DryRunReport, dry_run, format_dry_run
from framework.planner.resolve import resolve
from tests.config.test_config import compose_config
from tests.entry import train_main
from tests.kernels.test_target import on


def resolved_dry_run(cfg: Config) -> DryRunReport:
    """The dry run of ``cfg`` as the launcher runs it: resolved and planned once, then sharded."""
    resolved = resolve(cfg)
    return dry_run(resolved.cfg, resolved.plan)


# A shape whose dims do not divide evenly by large shard counts, so FSDP2's padding shows.
ODD = ModelConfig(
    dim=192, n_layers=3, n_heads=6, n_kv_heads=2, ffn_dim=520, vocab_size=1000, tie_embeddings=False
)


def cfg_for(strategy: str, shape: list[int], tp: int = 1, model: ModelConfig | None = None) -> Config:
    cfg = Config(model=model or ModelConfig())
    cfg.mesh.shape = shape
    cfg.sharding.strategy = Strategy(strategy)
    cfg.sharding.tp = tp
    cfg.train.global_batch_size = cfg.mesh.world_size
    cfg.train.micro_batch_size = 1
    return cfg


CASES = [
    ("ddp", [2], 1),
    ("ddp", [64, 8], 1),
    ("fsdp", [4], 1),
    ("fsdp", [64, 8], 1),
    ("hsdp", [2, 2], 1),
    ("hsdp", [64, 8], 1),
    ("tp", [2], 2),
    ("fsdp_tp", [2, 2], 2),
    ("fsdp_tp", [64, 8], 2),
]


@pytest.mark.parametrize("model", [ModelConfig(), ODD], ids=["tiny_tied", "odd_untied"])
@pytest.mark.parametrize(
    ("strategy", "shape", "tp"), CASES, ids=[f"{s}-{'x'.join(map(str, m))}" for s, m, _ in CASES]
)
def test_measured_matches_estimate(strategy: str, shape: list[int], tp: int, model: ModelConfig) -> None:
    report = resolved_dry_run(cfg_for(strategy, shape, tp, model))
    assert report.rel_error < 0.01, format_dry_run(report)
    sharded = strategy != "ddp"
    assert (report.num_sharded_params == report.num_params) == sharded
    if sharded:  # sharding really divided the parameters
        assert report.measured_param_bytes < 4 * report.plan.num_params / 1.9
    assert not dist.is_initialized()  # the fake group is gone


def test_report_and_refusals() -> None:
    report = resolved_dry_run(cfg_for("fsdp_tp", [2, 4], 2))
    text = format_dry_run(report)
    assert "dry run: fsdp_tp on 8 ranks (dp_shard=4 x tp=2)" in text
    assert f"measured {report.measured_param_bytes:,} B" in text
    with pytest.raises(ValueError, match="sharding.tp=3 does not divide"):
        resolved_dry_run(cfg_for("fsdp_tp", [4], 3))
    assert not dist.is_initialized()


def test_leaves_this_process_clean() -> None:
    """A real FSDP2 run forked after a dry run of the same shape still matches one process.

    Regression: with the fake group in this process, the later gloo run trained on wrong values.
    """
    from tests.dist import run_ranks
    from tests.parallel.test_parallel import _worker, make_cfg, reference_losses

    resolved_dry_run(cfg_for("fsdp", [4]))
    cfg = make_cfg("fsdp", [4])
    losses = run_ranks(_worker, 4, cfg)[0]["losses"]
    assert losses == pytest.approx(reference_losses(cfg), rel=1e-5)


@pytest.mark.parametrize(
    ("degrees", "shape"),
    [((1, 1, 4, 1), [4]), ((2, 2, 2, 2), [2, 8])],
    ids=["cp4", "hsdp_tp_cp-2x8"],
)
def test_cp_shards_parameters_over_dp_shard_and_cp(degrees: tuple[int, ...], shape: list[int]) -> None:
    """CP ranks share parameters: FSDP2 shards them over dp_shard x cp flattened (and HSDP's
    dp_replicate stays outer); planned for CUDA hardware in a dry run on this CPU machine."""
    cfg = Config(model=ODD)
    cfg.mesh.shape = shape
    cfg.parallel.dp_replicate, cfg.parallel.dp_shard, cfg.parallel.cp, cfg.parallel.tp = degrees
    cfg.train.seq_len = 64
    cfg.train.global_batch_size = degrees[0] * degrees[1]
    cfg.train.micro_batch_size = 1
    cfg.run.dry_run = True
    report = resolved_dry_run(cfg)
    assert report.measured_param_bytes == report.estimated_param_bytes, format_dry_run(report)
    assert report.num_sharded_params == report.num_params
    fsdp_ranks = degrees[1] * degrees[2]
    assert report.measured_param_bytes < 4 * report.plan.num_params / degrees[3] / fsdp_ranks * 1.1


def test_cp_with_pp_dry_run_measures_what_the_plan_estimates() -> None:
    """pp=2 x cp=2: each stage's parameters are sharded over the CP ranks, as the plan says."""
    cfg = Config(model=ODD)
    cfg.mesh.shape = [4]
    cfg.parallel.pp, cfg.parallel.cp = 2, 2
    cfg.train.seq_len = 64
    cfg.train.global_batch_size = 2
    cfg.run.dry_run = True
    report = resolved_dry_run(cfg)
    assert report.plan.strategy == "fsdp_cp_pp"
    assert report.measured_param_bytes == report.estimated_param_bytes, format_dry_run(report)


@pytest.mark.parametrize(("strategy", "tp"), [("fsdp", 1), ("fsdp_tp", 2)])
def test_float8_layouts_of_a_gpu_profile(strategy: str, tp: int) -> None:
    """llama1b in float8 tensorwise, planned for 8 H100s on this CPU: torchao swaps the planner's
    layers, FSDP2 all-gathers each of their weights in float8, and the bytes match the estimate."""
    pytest.importorskip("torchao.float8", reason="torchao is the float8 extra (CI installs it)")
    base = compose_config("recipe=llama1b", "model.float8=tensorwise")
    cfg = on(cfg_for(strategy, [8], tp, base.model), "h100_sxm")
    report = resolved_dry_run(cfg)
    text = format_dry_run(report)
    assert report.measured_param_bytes == report.estimated_param_bytes, text
    # 16 blocks x (wq, wo, w1, w2, w3): wk/wv are below tensorwise's size threshold, the head is skipped.
    assert report.num_float8_layers == report.planned_float8_layers == 80, text
    assert report.num_float8_all_gather == report.planned_float8_all_gather == 80, text
    assert "float8 layers       planned 80, swapped 80 (model.float8=tensorwise)" in text


def test_train_py_plans_float8_for_a_gpu_profile_on_this_cpu(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The user's command on a CPU login node (train.py's entry point, in this process): exit 0,
    and the report's measured parameter bytes are the planner's."""
    pytest.importorskip("torchao.float8", reason="torchao is the float8 extra (CI installs it)")
    run = tmp_path / "run"
    args = [
        "recipe=llama1b",
        "model.float8=tensorwise",
        "mesh=8",
        "mesh/hardware=h100_sxm",
        "run.dry_run=true",
    ]
    code = train_main(f"hydra.run.dir={run}", *args)
    err = capfd.readouterr().err
    assert code == 0, err[-2000:]
    log = (run / "train.log").read_text()
    found = re.search(r"params per rank     estimated ([\d,]+) B .*measured ([\d,]+) B", log)
    assert found is not None and found[1] == found[2], log[-2000:]
    assert re.search(r"float8 layers       planned (\d+), swapped \1 ", log), log[-2000:]


# A tiny Qwen3-MoE whose experts do not split evenly over FSDP's ranks (6 experts of width 40),
# untied (a pipeline refuses tied embeddings).
MOE = ModelConfig(
    family=ModelFamily.qwen3_moe,
    dim=64,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    ffn_dim=128,
    vocab_size=200,
    tie_embeddings=False,
    moe=MoEConfig(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40),
)
MOE_CASES = [  # (shape, dp_replicate, dp_shard, tp, pp, ep)
    ([6], 1, 6, 1, 1, 2),
    ([6], 1, 6, 1, 1, 6),
    ([2, 6], 2, 6, 1, 1, 3),
    ([2, 4], 1, 4, 1, 2, 2),
    ([8, 8], 1, 64, 1, 1, 2),
]


@pytest.mark.parametrize(
    ("shape", "rep", "shard", "tp", "pp", "ep"),
    MOE_CASES,
    ids=[f"r{c[1]}s{c[2]}t{c[3]}p{c[4]}e{c[5]}" for c in MOE_CASES],
)
def test_moe_experts_sharded_over_ep_as_planned(
    shape: list[int], rep: int, shard: int, tp: int, pp: int, ep: int
) -> None:
    """Issue 25: the planner's parameter bytes per rank of an MoE model under expert parallelism
    (each rank's E / ep experts, FSDP over dp_shard / ep of them) are what the real parallelize
    leaves on rank 0; at ep=2 of 64 FSDP ranks the experts are sharded 32 ways, so a wrong model of
    it would be far off."""
    cfg = Config(model=MOE)
    cfg.mesh.shape = shape
    p = cfg.parallel
    p.dp_replicate, p.dp_shard, p.tp, p.pp, p.ep = rep, shard, tp, pp, ep
    cfg.train.seq_len = 32
    cfg.train.global_batch_size = rep * shard * pp
    cfg.train.micro_batch_size = 1
    report = resolved_dry_run(cfg)
    assert report.measured_param_bytes == report.estimated_param_bytes, format_dry_run(report)
    assert report.plan.degrees["ep"] == ep


# Issue 25 point 4: the published MoE shapes on 128 and 512 H100s (qwen3_235b_a22b: 235B, 94 layers).
LARGE_MOE = [(r, m) for r in ("qwen3_30b_a3b", "qwen3_235b_a22b", "mixtral_8x7b") for m in ("16x8", "64x8")]


@pytest.mark.parametrize(("recipe", "mesh"), LARGE_MOE, ids=[f"{r}-{m}" for r, m in LARGE_MOE])
def test_large_moe_recipes_plan_a_layout_that_fits(recipe: str, mesh: str) -> None:
    """``sharding=auto`` (the recipes' default) finds a layout within the H100's memory, with ep,
    in seconds; its parameter bytes per rank are what the fake-backend measurement finds on rank 0."""
    from framework.launch.recipes import compose_recipe

    cfg = compose_recipe(recipe, [f"mesh={mesh}", "mesh/hardware=h100_sxm", "run.dry_run=true"])
    report = resolved_dry_run(cfg)
    memory = report.plan.memory
    assert memory.total <= memory.device, format_dry_run(report)
    assert report.plan.degrees["ep"] > 1, format_dry_run(report)
    assert report.measured_param_bytes == report.estimated_param_bytes, format_dry_run(report)
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("shape", "pp", "ep"), [([4], 1, 1), ([4], 1, 2), ([4], 2, 2)], ids=["fsdp", "ep2", "pp2ep2"]
)
def test_float8_experts_marked_as_planned(shape: list[int], pp: int, ep: int) -> None:
    """model.float8 on an MoE family, planned for H100s on this CPU: rank 0's experts that
    ``parallelize`` marks float8 (expert parallelism's runners carry the mark) are the planner's."""
    pytest.importorskip("torchao.float8", reason="torchao is the float8 extra (CI installs it)")
    base = compose_config(
        "recipe=qwen3_moe_tiny",
        "model.float8=rowwise",
        "model.float8_size_filter=false",
        "model.float8_skip=[output,attention]",
    )
    cfg = on(Config(model=base.model), "h100_sxm")
    cfg.mesh.shape = shape
    cfg.parallel.dp_shard, cfg.parallel.pp, cfg.parallel.ep = shape[0] // pp, pp, ep
    cfg.train.seq_len = 32
    cfg.train.global_batch_size = shape[0]
    cfg.train.micro_batch_size = 1
    report = resolved_dry_run(cfg)
    text = format_dry_run(report)
    assert report.num_float8_experts == report.planned_float8_experts == 4 // pp, text
    assert f"float8 MoE experts  planned {4 // pp}, marked {4 // pp}" in text


def test_a_gpu_sized_job_or_nccl_preset_on_the_cpu_profile_says_which_hardware(tmp_path: Path) -> None:
    """The mission's command without mesh/hardware planned for the default CPU profile, silently:
    now one warning line names the profile and the options; a GPU profile, or a small job without
    an NCCL preset, prints none."""
    cases = {
        "gpu_sized": (["mesh=2x4", "nccl=gdr3", "recipe=llama7b"], 1),
        "preset_only": (["mesh=2", "nccl=ib"], 1),
        "declared": (["mesh=2x4", "nccl=gdr3", "recipe=llama7b", "mesh/hardware=h100_sxm"], 0),
        "small": (["mesh=2"], 0),
    }
    for name, (args, expected) in cases.items():
        run = tmp_path / name
        assert train_main(f"hydra.run.dir={run}", *args, "run.dry_run=true") == 0, name
        lines = [ln for ln in (run / "train.log").read_text().splitlines() if "the plan assumes" in ln]
        assert len(lines) == expected, (name, lines)
        if expected:
            assert "[WARNING]" in lines[0] and "mesh/hardware=cpu: the plan assumes a CPU host" in lines[0]
            assert "add mesh/hardware=NAME (a100_80gb, h100_96gb_500w, h100_sxm, h200)" in lines[0]
    text = (tmp_path / "gpu_sized" / "train.log").read_text()
    assert "for a 6.74B-parameter model and nccl=gdr3 (NCCL runs on GPU ranks only)" in text


def test_the_missions_command_prints_one_line_per_warning(tmp_path: Path) -> None:
    """``python train.py mesh=2x4 nccl=gdr3 recipe=llama7b run.dry_run=true`` as a user runs it (a
    real interpreter): the CPU-profile notice is one line, and each of the preset's two NCCL
    debugging variables one line on stderr (Python printed its source line under each)."""
    import os
    import subprocess
    import sys

    from tests.entry import ROOT

    args = [
        "mesh=2x4",
        "nccl=gdr3",
        "recipe=llama7b",
        "run.dry_run=true",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    env = {k: v for k, v in os.environ.items() if k != "RUN_STAMP"}
    proc = subprocess.run(
        [sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [ln for ln in proc.stdout.splitlines() if "WARNING" in ln and "the plan assumes" in ln], (
        proc.stdout
    )
    err = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(err) == 2 and all("NcclDebugVariableWarning: NCCL_NET_GDR_" in ln for ln in err), err
