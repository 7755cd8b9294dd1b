"""End to end through ``python train.py``: real Hydra, real launcher, real ranks, real run dirs."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from framework.record.metrics import read_metrics
from tests.dist import run_ranks, train_rank
from tests.entry import train_forked, train_main, write_run_config
from tests.train.test_train_golden import composed, reference_run

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "train.steps=12",
    "train.log_every=2",
    "train.eval_every=6",
    "train.eval_batches=2",
    "train.seq_len=64",
    # The runs below compare layouts and steps: the export (traced on every rank) and the plot play
    # no part; the default recipe's run and the golden runs keep both.
    "freeze=none",
    "logger.plot=false",
]


def train(tmp: Path, *overrides: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``python train.py hydra.run.dir=TMP *overrides``, forked from this process (tests/entry.py)."""
    return train_forked(
        f"hydra.run.dir={tmp}", *overrides, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r]


# 24 steps: past the recipe's 20 warmup steps into the cosine decay; the loss has fallen from ~5.2
# to ~2.8 by step 20. Three evaluations (0, 12, 24) and three logged windows after the first.
DEFAULT_RUN = ["train.steps=24", "train.eval_every=12", "train.log_every=6"]


def test_default_recipe_trains_and_writes_its_run_dir(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = train(run, *DEFAULT_RUN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("config.yaml", "plan.json", "metrics.jsonl", "summary.json", "train.log", "nccl.json"):
        assert (run / name).is_file(), name
    rows = read_metrics(run)
    assert all("step" in r for r in rows)
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(val) == 3 and val[-1] < val[0] - 1.0  # byte-level loss starts near ln(256) = 5.5
    assert all(r["val_ppl"] == pytest.approx(math.exp(r["val_loss"])) for r in rows if "val_loss" in r)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 24 and summary["time_to_first_step_s"] > 0
    # The loader's wait (the sampler times each next_batch): per log row and over the run.
    waits = [r["data_wait_share"] for r in rows if "loss" in r and r["step"] > 6]
    assert len(waits) == 3 and all(0 <= w < 0.5 for w in waits), waits
    assert 0 < summary["data_wait_ms"] and 0 <= summary["data_wait_share"] < 0.5
    # The training math: the plain torch loop of test_train_golden over the same config, made here on
    # this CPU (numbers recorded on another CPU round differently). sharding=auto picks the single-rank step.
    ref, _ = reference_run(composed(tmp_path / "ref", *DEFAULT_RUN))
    assert losses(run) == pytest.approx(ref[5::6], rel=2e-5, abs=0)
    plan = json.loads((run / "plan.json").read_text())
    assert plan["strategy"] == "single" and plan["search"]["chosen"]["activation_checkpointing"] == "none"
    # One rank says little before step 0: the plan's choice in one line naming plan.json (it printed a
    # 10-row search table and a 25-line plan); no step-time prediction on the CPU profile.
    log = (run / "train.log").read_text().splitlines()
    before = log[: next(i for i, ln in enumerate(log) if "step 0 | val_loss" in ln)]
    [line] = [ln for ln in before if "plan: " in ln]
    expected = "plan: single on 1 rank, micro batch 16 x 1 accumulation, activation checkpointing none, "
    expected += rf"\d+\.\d\d of 24 GiB \(in full: {re.escape(str(run / 'plan.json'))}\)"
    assert re.fullmatch(expected, line.split(" - ", 1)[1]), line
    assert len(before) <= 6 and not [ln for ln in before if "layouts evaluated" in ln or "nccl" in ln], before
    # Every training line says where the run is and how long the rest takes (no bar in a log file).
    steps = [ln.split(" - ", 1)[1] for ln in log if " - step " in ln and "| loss " in ln]
    assert [s.split(" | ")[0] for s in steps] == ["step 6/24", "step 12/24", "step 18/24", "step 24/24"]
    assert all(re.search(r" \| elapsed \S+, ETA \S+$", s) for s in steps), steps
    # The first model a user trains can be used: one final checkpoint (checkpoint=final, the default),
    # named in the summary with the commands that read it; generate samples from the run dir.
    assert [p.name for p in (run / "checkpoints").glob("step_*")] == ["step_000024"]
    latest = summary["checkpoint"]["latest"]
    assert latest == str(run / "checkpoints" / "step_000024") and summary["checkpoint"]["saved"] == 1
    announced = f"checkpoint: {latest} (use it: python -m framework generate {run} --prompt"
    assert announced in (run / "train.log").read_text()
    from framework import __main__ as cli

    assert cli.main(["generate", str(run), "--prompt", "def ", "--max-new-tokens", "8"]) == 0


def test_four_ddp_ranks_match_one_process_in_one_run_dir(tmp_path: Path) -> None:
    one = tmp_path / "one"
    four = tmp_path / "four"
    proc1 = train(one, *SMALL, "train.global_batch_size=8", "train.micro_batch_size=2")
    proc4 = train(
        four, *SMALL, "train.global_batch_size=8", "train.micro_batch_size=2", "mesh=4", "bucketing=small"
    )
    assert proc1.returncode == 0, proc1.stderr[-3000:]
    assert proc4.returncode == 0, proc4.stderr[-3000:]
    # One run dir for all ranks, and nothing written anywhere else.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["four", "one"]
    assert json.loads((four / "summary.json").read_text())["world_size"] == 4
    l1, l4 = losses(one), losses(four)
    assert len(l1) == len(l4) == 6
    for a, b in zip(l1, l4, strict=True):
        assert abs(a - b) < 1e-4 * max(1.0, abs(a)), (l1, l4)


def test_compiled_tensor_parallel_run_matches_eager(tmp_path: Path) -> None:
    """``sharding=tp executor=compile`` through train.py on 2 ranks (compiled TP blocks and loss
    head, selective AC wrapped around them) logs the eager run's losses. The eager reference is the
    same config (composed as train.py does) trained on 2 ranks forked from this process."""
    common = [*SMALL, "mesh=2", "sharding=tp", "sharding.activation_checkpointing=selective"]
    compiled = train(tmp_path / "compiled", *common, "executor=compile", "executor.backend=aot_eager")
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    write_run_config(tmp_path / "eager", *common)
    run_ranks(train_rank, 2, str(tmp_path / "eager"))
    le, lc = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert len(le) == len(lc) > 0
    for a, b in zip(le, lc, strict=True):
        assert abs(a - b) < 1e-4 * max(1.0, abs(a)), (le, lc)


def test_optimizer_in_backward_run_matches_the_plain_step(tmp_path: Path) -> None:
    """``train.optimizer_in_backward=true`` through train.py logs the plain run's losses and gradient
    norms (both unclipped), and its plan counts no full set of gradients."""
    common = [*SMALL, "train.grad_clip=0"]
    plain = train(tmp_path / "plain", *common)
    early = train(tmp_path / "early", *common, "train.optimizer_in_backward=true")
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert early.returncode == 0, early.stderr[-3000:]
    rows_p = [r for r in read_metrics(tmp_path / "plain") if "loss" in r]
    rows_e = [r for r in read_metrics(tmp_path / "early") if "loss" in r]
    assert len(rows_p) == len(rows_e) == 6
    for a, b in zip(rows_p, rows_e, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-5 * max(1.0, abs(a["loss"])), (rows_p, rows_e)
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-4 * a["grad_norm"], (rows_p, rows_e)
    plan_p = json.loads((tmp_path / "plain" / "plan.json").read_text())
    plan_e = json.loads((tmp_path / "early" / "plan.json").read_text())
    assert plan_e["memory"]["grads"] < plan_p["memory"]["grads"] / 4


@pytest.mark.parametrize("mode", ["script", "trace"])
def test_legacy_torchscript_freeze_runs(tmp_path: Path, mode: str) -> None:
    """``freeze=script|trace`` through train.py: the trainer freezes the meta-device model, which
    torch.jit.freeze cannot (it inlines real weights); the scripted graph is fingerprinted and saved."""
    run = tmp_path / mode
    proc = train(run, "train.steps=2", "train.eval_every=0", f"freeze={mode}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "frozen" / "model.ts").is_file()
    assert json.loads((run / "summary.json").read_text())["steps"] == 2


NO_GPU_CASE = (
    (["run.device=cuda"], "run.device=cuda")
    if not torch.cuda.is_available()
    else (["mesh.shape=[64]", "run.device=cuda"], "GPUs")
)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["mesh=4", "sharding=ddp", "train.global_batch_size=6", "train.micro_batch_size=2"],
            "global_batch_size=6",
        ),
        (["train.stepz=3"], "stepz"),
        (["mesh=bogus"], "mesh=bogus: no such option in group 'mesh'"),
        (["executor=cudagraphs", "run.device=cpu"], "executor=cudagraphs needs a CUDA device"),
        (["checkpoint=sync", "checkpoint.dir=pyproject.toml/ck"], "is a file, not a directory"),
        (
            ["executor=compile", "executor.cache_dir=pyproject.toml"],
            "executor.cache_dir='pyproject.toml' cannot",
        ),
        (["sharding=tp", "sharding.tp=3", "mesh.shape=[3]"], "n_heads"),
        (
            ["mesh=2x3", "parallel.dp_replicate=2", "parallel.dp_shard=2"],
            "multiply to 4, not the world size 6",
        ),
        (["mesh=4", "parallel.tp=4"], "parallel.tp=4 does not divide model.n_kv_heads=2"),
        (
            ["mesh=2", "parallel.pp=2", "train.optimizer_in_backward=true"],
            "train.optimizer_in_backward=true does not work with parallel.pp=2",
        ),
        (["recipe=llama70b", "mesh/hardware=h100_sxm"], "sharding=auto: nothing fits"),
        (["train.optimizer_in_backward=true"], "train.grad_clip=1.0: a global gradient-norm clip"),
        NO_GPU_CASE,
    ],
)
def test_bad_config_exits_non_zero_and_writes_nothing(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], overrides: list[str], message: str
) -> None:
    """train.py's entry point in this process (tests/entry.py): every case is refused before launch."""
    run = tmp_path / "run"
    assert train_main(f"hydra.run.dir={run}", *overrides) != 0
    out = capfd.readouterr()
    assert message in out.err + out.out
    assert not run.exists()


@pytest.mark.parametrize(
    ("saved", "here", "message"),
    [
        # tied -> untied failed to load in every rank: the checkpoint went to corrupt/, step 0 again
        ({}, ["model.tie_embeddings=false"], "model.tie_embeddings=true there, false here"),
        # untied -> tied loaded in silence without the trained output head
        ({"tie_embeddings": False}, [], "model.tie_embeddings=false there, true here"),
        ({"dim": 64, "ffn_dim": 192}, [], "model.dim=64 there, 128 here, model.ffn_dim=192 there, 384 here"),
        # the same through checkpoint.resume=PATH
        (
            {"tie_embeddings": False},
            ["checkpoint.resume=STEP"],
            "model.tie_embeddings=false there, true here",
        ),
    ],
)
def test_resume_of_another_model_shape_is_refused_and_the_checkpoint_kept(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], saved: dict, here: list[str], message: str
) -> None:
    """checkpoint.resume=auto into a model of another shape: one line naming each differing field,
    exit 2, before launch; the checkpoint stays where it is. The step dir holds the ``extra.json``
    the trainer writes (its ``model``: init_from.shape_of of the run's model)."""
    from framework.checkpoint.init_from import shape_of
    from tests.config.test_config import compose_config

    root, run = tmp_path / "ck", tmp_path / "run"
    step = root / "step_000004"
    step.mkdir(parents=True)
    shape = shape_of(compose_config("recipe=llama_tiny").model) | saved
    doc = {"extra": {"step": 4, "model": shape}, "scheduler": {}, "param_groups": [], "step": 4, "world_size": 1}
    (step / "extra.json").write_text(json.dumps(doc))  # the fields state.read_extra checks
    from framework.checkpoint import store
    from framework.config.schema import Integrity

    (step / "rng").mkdir()
    (step / "rng" / "rank_00000.json").write_text("{}")
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    (step / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={})))  # no tensor is read
    (step / "__0_0.distcp").write_bytes(b"")
    names = ["extra.json", "rng/rank_00000.json", ".metadata", "__0_0.distcp"]
    files = {n: store.file_digest(step / n, Integrity.sha256) for n in names}
    manifest = store.Manifest(4, 1, 0.0, Integrity.sha256, files)  # a named step dir's is checked too
    (step / store.MANIFEST).write_text(json.dumps(manifest.to_json()))
    here = [o.replace("STEP", str(step)) for o in here]
    code = train_main(f"hydra.run.dir={run}", "checkpoint=sync", f"checkpoint.dir={root}", *here)
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and message in errors[0], err
    assert f"{step} holds another model" in errors[0]
    assert not run.exists() and sorted(p.name for p in root.iterdir()) == ["step_000004"]


# Each torchrun rank runs train.py under this profile hook, which writes down (at once: a torchrun rank
# ends with os._exit) every call of the planner's entry points: what that rank planned itself.
PLANNER_PROBE = r"""
import os, runpy, sys
from framework.planner import plan, resolve, search
watch = {f.__code__: f.__name__ for f in (resolve.resolve, resolve.resolve_batch, plan.plan_for,
                                          search.search, resolve.load_plan)}
out = os.path.join(sys.argv[1], "rank%s.calls" % os.environ["RANK"])
open(out, "w").close()
def prof(frame, event, arg):
    if event == "call" and frame.f_code in watch:
        with open(out, "a") as f:
            f.write(watch[frame.f_code] + "\n")
sys.argv = ["train.py"] + sys.argv[2:]
sys.setprofile(prof)
runpy.run_path("train.py", run_name="__main__")
"""


def test_torchrun_ranks_join_one_run_dir_and_read_its_plan(tmp_path: Path) -> None:
    """Under torchrun every rank composes the config itself; the run dir comes from the shared run id.
    Rank 0 alone validates and resolves it (once); every rank reads the plan from the run dir's
    plan.json, and rank 1 plans nothing (the calls of the planner, recorded on each rank)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("RUN_STAMP", None)
    calls = tmp_path / "calls"
    calls.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--no-python",
        sys.executable,
        "-c",
        PLANNER_PROBE,
        str(calls),
        "mesh=2",
        "train.steps=2",
        "train.eval_every=0",
        "train.log_every=1",
        "train.seq_len=32",
        "freeze=none",  # traced on each rank, ~2-4 s of CPU apiece: no part of joining the run dir
        f"hydra.run.dir={tmp_path}/runs/${{run_stamp:}}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dirs = [p for p in (tmp_path / "runs").glob("*/*") if p.is_dir()]
    assert len(run_dirs) == 1, run_dirs  # one dir for both ranks, named by torchrun's run id
    summary = json.loads((run_dirs[0] / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 2
    rank0, rank1 = ((calls / f"rank{r}.calls").read_text().split() for r in (0, 1))
    assert rank0.count("resolve") == 1 and rank0.count("load_plan") == 1, rank0
    assert rank1 == ["load_plan"], rank1  # no resolve, no search, no plan_for: the file's plan


@pytest.mark.parametrize(("warmup", "warned"), [(20, True), (5, True), (4, False)])
def test_warmup_as_long_as_the_run_warns_in_one_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], warmup: int, warned: bool
) -> None:
    code = train_main(
        f"hydra.run.dir={tmp_path / 'run'}",
        "run.dry_run=true",
        "train.steps=5",
        f"train.warmup_steps={warmup}",
    )
    assert code == 0
    out, err = capfd.readouterr()
    lines = [line for line in (out + err).splitlines() if "never leaves its warmup" in line]
    assert len(lines) == (1 if warned else 0), out + err
    if warned:
        assert f"train.warmup_steps={warmup} >= train.steps=5" in lines[0]


def test_outputs_latest_links_the_newest_run_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``outputs/latest`` names the newest run dir, also in the default layout ``outputs/DATE/TIME-ID``
    (the link was made only for a run dir directly under outputs/, so never by default), and
    ``generate outputs/latest`` reads that run's checkpoint."""
    from framework.launch.generate import main as generate_main

    outputs = tmp_path / "outputs"
    quick = ["train.steps=2", "train.eval_every=0", "train.log_every=1", "freeze=none", "logger.plot=false"]
    for name in ("a", "2026-12-01/23-12-52-b"):
        proc = train(outputs / name, *quick)
        assert proc.returncode == 0, proc.stderr[-3000:]
        latest = outputs / "latest"
        assert latest.is_symlink() and os.readlink(latest) == name
        assert (latest / "summary.json").is_file()
    assert sorted(p.name for p in outputs.iterdir()) == ["2026-12-01", "a", "latest"]  # no temporary link
    capsys.readouterr()
    assert generate_main([str(outputs / "latest"), "--prompt", "def ", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("def ") and "2026-12-01/23-12-52-b/checkpoints/step_000002" in out.err, out
    # A run dir elsewhere links nothing next to it.
    assert train(tmp_path / "c", *quick).returncode == 0
    assert not (tmp_path / "latest").exists()


def test_each_checkpoint_save_is_announced_in_one_line_with_its_path(tmp_path: Path) -> None:
    run = tmp_path / "run"
    quick = ["train.steps=4", "train.eval_every=0", "freeze=none", "logger.plot=false"]
    proc = train(run, *quick, "checkpoint=sync", "checkpoint.every_steps=2", "checkpoint.keep_last=10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in (run / "train.log").read_text().splitlines() if "saved checkpoint" in line]
    steps = sorted(int(p.name.split("_")[-1]) for p in (run / "checkpoints").glob("step_*"))
    assert len(lines) == len(steps) >= 2, lines
    for line, step in zip(lines, steps, strict=True):
        assert f"saved checkpoint of step {step}: " in line and line.endswith(f"checkpoints/step_{step:06d}")
