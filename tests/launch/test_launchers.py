"""Launchers: a real job through submitit's local executor (the SLURM path), and the mesh resolvers."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from framework.config.schema import RunConfig
from framework.launch.ranks import (
    ALLOC_CONF,
    apply_allocator_environment,
    arm_stack_dump,
    register_resolvers,
    task_threads,
)
from tests.entry import train_forked

ROOT = Path(__file__).resolve().parents[2]


def test_slurm_allocation_is_derived_from_the_mesh() -> None:
    register_resolvers()
    launcher = OmegaConf.load(ROOT / "conf" / "hydra" / "launcher" / "slurm.yaml")
    for shape, nodes, per_node in (([4], 1, 4), ([2, 4], 2, 4), ([2, 2, 2], 2, 4)):
        cfg = OmegaConf.create({"mesh": {"shape": shape}, "l": OmegaConf.to_container(launcher)})
        assert (cfg.l.nodes, cfg.l.tasks_per_node, cfg.l.gpus_per_node) == (nodes, per_node, per_node)


@pytest.mark.skipif(
    importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None,
    reason="hydra-submitit-launcher (part of the dev extra) is not installed",
)
def test_submitit_local_runs_one_rank_per_task(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    env = dict(os.environ)
    env.pop("RUN_STAMP", None)
    env.pop("OMP_NUM_THREADS", None)  # each task must set its own share of the cores
    cmd = [
        "-m",
        "hydra/launcher=slurm_local",
        f"hydra.sweep.dir={sweep_dir}",
        "mesh=2",
        "freeze=none",
        "train.steps=4",
        "train.seq_len=32",
        "train.eval_every=0",
        "train.log_every=2",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
    ]
    # python train.py -m, forked from this process (tests/entry.py); submitit starts its tasks afresh.
    proc = train_forked(*cmd, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((sweep_dir / "0" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    # Two submitit tasks ran, each a rank of the one job (not two self-launched ranks under one task).
    (job_folder,) = [p for p in (sweep_dir / ".submitit").iterdir() if any(p.iterdir())]
    assert sorted(p.name.split("_", 1)[1] for p in job_folder.glob("*_result.pkl")) == [
        "0_result.pkl",
        "1_result.pkl",
    ]
    with (sweep_dir / "sweep_summary.csv").open() as f:
        assert [r["status"] for r in csv.DictReader(f)] == ["ok"]
    share = task_threads(2)
    logs = (
        "".join(p.read_text() for p in job_folder.glob("*_log.*"))
        + (sweep_dir / "0" / "train.log").read_text()
    )
    for rank in (0, 1):
        assert f"submitit task {rank}: {share} intra-op threads (OMP_NUM_THREADS)" in logs


def test_task_threads_share_the_available_cores_less_one_or_take_slurms_figure() -> None:
    cores = len(os.sched_getaffinity(0))
    assert task_threads(1) == max(1, cores - 1) and task_threads(cores * 4) == 1
    assert task_threads(2, "3") == 3 and task_threads(2, "") == max(1, cores // 2 - 1)


def test_a_cpu_run_sets_its_threads_unless_omp_num_threads_was_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer's choice reaches torch in the run, and a user's OMP_NUM_THREADS wins over it."""
    from tests.entry import train_forked

    script = "train.steps=1 train.eval_every=0 freeze=none logger.plot=false".split()
    for threads, want in ((None, max(1, len(os.sched_getaffinity(0)) - 1)), ("2", 2)):
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        if threads is not None:
            env["OMP_NUM_THREADS"] = threads
        run = tmp_path / str(threads)
        proc = train_forked(f"hydra.run.dir={run}", *script, timeout=120, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"intra-op threads: {want}" in (run / "train.log").read_text()


def test_allocator_environment_is_set_once_and_never_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOC_CONF, raising=False)
    apply_allocator_environment(RunConfig(expandable_segments=False))
    assert ALLOC_CONF not in os.environ
    apply_allocator_environment(RunConfig())
    assert os.environ[ALLOC_CONF] == "expandable_segments:True"
    monkeypatch.setenv(ALLOC_CONF, "max_split_size_mb:128")
    apply_allocator_environment(RunConfig())
    assert os.environ[ALLOC_CONF] == "max_split_size_mb:128"


@pytest.mark.parametrize("value", ["abc", "0", "-5", "nan"])
def test_a_bad_stack_dump_delay_is_one_line_exit_2(
    value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``FRAMEWORK_STACK_DUMP_S`` (framework.launch.ranks.arm_stack_dump) names the value and what is valid."""
    monkeypatch.setenv("FRAMEWORK_STACK_DUMP_S", value)
    with pytest.raises(SystemExit) as e:
        arm_stack_dump()
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: FRAMEWORK_STACK_DUMP_S={value}: use a number of seconds > 0, or unset it"
    ]
