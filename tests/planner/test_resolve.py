"""``framework.planner.resolve``: a config is resolved into its plan once, by the launcher; the ranks
read ``plan.json`` back and plan nothing (counted in a real 2-rank gloo run), and refuse a plan.json
that is missing or another config's with one line."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from framework.config.schema import Config, Strategy
from framework.launch.worker import load_run
from framework.planner import layout, plan, resolve, search
from framework.planner.report import plan_to_dict
from framework.planner.resolve import PLAN_FILE, load_plan, make_plan, write_plan
from tests.dist import run_ranks, train_rank
from tests.entry import ROOT, write_run_config

# Every function that works a layout or a plan out from a config.
PLANNER = (
    layout.fixed_degrees,
    plan.plan_for,
    search.search,
    search.maybe_search,
    resolve.resolve,
    resolve.resolve_batch,
    resolve.make_plan,
)
TINY = [
    "train.steps=2",
    "train.warmup_steps=0",
    "train.log_every=1",
    "train.eval_every=0",
    "train.seq_len=32",
    "freeze=none",
]


def cfg_for(strategy: str, shape: list[int], gbs: int = 32, mbs: int = 0) -> Config:
    cfg = Config()
    cfg.mesh.shape = shape
    cfg.sharding.strategy = Strategy(strategy)
    cfg.train.global_batch_size, cfg.train.micro_batch_size = gbs, mbs
    return cfg


@contextmanager
def counting(functions: tuple[Callable[..., Any], ...]) -> Iterator[Counter[str]]:
    """Count the calls of ``functions`` in this thread, however they were imported (by their code
    objects, through ``sys.setprofile``): the real functions run, nothing is replaced."""
    codes = {f.__code__: f.__qualname__ for f in functions}
    calls: Counter[str] = Counter()

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event == "call" and frame.f_code in codes:
            calls[codes[frame.f_code]] += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(previous)


def test_resolve_writes_every_choice_into_the_config_and_plans_it() -> None:
    resolved = resolve.resolve(cfg_for("fsdp", [4], gbs=32))
    assert resolved.search is None and resolved.plan == make_plan(cfg_for("fsdp", [4], gbs=32))
    assert dataclasses.asdict(resolved.cfg.parallel)["dp_shard"] == 4
    assert resolved.cfg.train.micro_batch_size == resolved.plan.micro_batch_size == 8
    assert resolve.plan_differs(resolved.cfg, resolved.plan) is None
    auto = resolve.resolve(cfg_for("auto", [2], gbs=8))
    assert auto.search is not None and auto.cfg == auto.search.chosen_cfg
    assert resolve.plan_differs(auto.cfg, auto.plan) is None
    # The config as composed (not resolved) is not the plan's: a caller must pass the resolved one.
    assert "micro batch 8 vs 0" in (resolve.plan_differs(cfg_for("fsdp", [4], gbs=32), resolved.plan) or "")


def test_a_rank_reads_the_launchers_plan_and_refuses_another_or_none(tmp_path: Path) -> None:
    fsdp = resolve.resolve(cfg_for("fsdp", [4], gbs=32, mbs=2))
    with pytest.raises(ValueError, match=r"plan.json is missing: a rank reads the plan its launcher wrote"):
        load_plan(fsdp.cfg, tmp_path)
    write_plan(tmp_path, plan_to_dict(fsdp.plan) | {"search": {"tried": 0}})
    with counting(PLANNER) as calls:
        assert load_plan(fsdp.cfg, tmp_path) == fsdp.plan
    assert not calls, calls  # read, not planned
    ddp = resolve.resolve(cfg_for("ddp", [4], gbs=32, mbs=2))
    with pytest.raises(
        ValueError, match=r"plan.json was planned for another config .*layout dp_shard=4 vs dp_rep"
    ):
        load_plan(ddp.cfg, tmp_path)
    (tmp_path / PLAN_FILE).write_text('{"world_size": 4}')
    with pytest.raises(ValueError, match=r"plan.json is not a plan written by train.py \(KeyError"):
        load_plan(fsdp.cfg, tmp_path)


def _counted_rank(rank: int, world: int, run_dir: str) -> dict[str, int]:
    """``tests.dist.train_rank`` (what framework.launch.worker runs) with every planner call counted."""
    with counting(PLANNER) as calls:
        train_rank(rank, world, run_dir)
    return dict(calls)


def test_ranks_of_a_real_gloo_run_plan_nothing(tmp_path: Path) -> None:
    """Two gloo ranks train from the run dir the launcher's resolution wrote (config.yaml, plan.json),
    counting every planner call: none. The counter counts (the launcher's own resolution, here)."""
    run = tmp_path / "run"
    with counting(PLANNER) as launcher:
        write_run_config(run, *TINY, "mesh=2", "sharding=fsdp")
    assert launcher["resolve"] == 1 and launcher["plan_for"] == 1, launcher
    per_rank = run_ranks(_counted_rank, 2, str(run), timeout_s=240)
    assert per_rank == [{}, {}], per_rank
    assert json.loads((run / "summary.json").read_text())["steps"] == 2


def run_dir_with_a_ddp_plan(tmp_path: Path) -> tuple[Path, Config]:
    """A run dir as the launcher writes it for ``mesh=2 sharding=fsdp``, whose plan.json is then
    replaced by the plan of ``sharding=ddp``; and its (fsdp) config."""
    run = tmp_path / "run"
    write_run_config(run, *TINY, "mesh=2", "sharding=fsdp")
    cfg, _ = load_run(run)
    ddp = dataclasses.replace(cfg.sharding, strategy=Strategy.ddp)
    other = resolve.resolve(dataclasses.replace(cfg, sharding=ddp, parallel=type(cfg.parallel)()))
    write_plan(run, plan_to_dict(other.plan))
    return run, cfg


def test_the_worker_refuses_a_plan_of_another_config_in_one_line(tmp_path: Path) -> None:
    """``python -m framework.worker RUN_DIR`` with a plan.json of another layout: exit 2, one line,
    before any process group; ``load_run`` says the same in-process."""
    run, _ = run_dir_with_a_ddp_plan(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("TORCHELASTIC_ERROR_FILE", None)
    out = subprocess.run(
        [sys.executable, "-m", "framework.worker", str(run)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, (out.returncode, out.stderr[-2000:])
    assert lines[0].startswith(f"error: {run / PLAN_FILE} was planned for another config"), lines
    assert "layout dp_replicate=2 vs dp_shard=2" in lines[0], lines
    with pytest.raises(ValueError, match="was planned for another config"):
        load_run(run)


def test_the_launcher_reports_its_ranks_plan_refusal_in_one_line(tmp_path: Path) -> None:
    """Two ranks started by the launcher's elastic agent (as ``train.py mesh=2`` starts them) find a
    plan.json of another layout: the job fails with the ranks' one line and exit status 2, not
    'ranks failed'."""
    from framework.launch.entry import _run_spawned
    from framework.launch.prelaunch import JobFailed
    from framework.launch.ranks import isolated_environ

    run, cfg = run_dir_with_a_ddp_plan(tmp_path)
    with isolated_environ(), pytest.raises(JobFailed) as failed:
        _run_spawned(cfg, run, time.time())
    message = str(failed.value)
    assert failed.value.code == 2 and "\n" not in message, message
    assert message.startswith(f"{run / PLAN_FILE} was planned for another config"), message
