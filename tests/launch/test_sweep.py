"""Multirun sweeps of multi-rank jobs through ``python train.py -m``: summary, resume, failures."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import time
from pathlib import Path

from framework.launch.ranks import isolated_environ
from framework.launch.sweep import sweep_id
from tests.entry import train_forked

TINY = [
    "freeze=none",
    "data.source=synthetic",
    "train.steps=4",
    "train.seq_len=32",
    "train.eval_every=0",
    "train.log_every=2",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
]


def multirun(cwd: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RUN_STAMP", "FRAMEWORK_SWEEP_ID"):
        env.pop(key, None)
    t0 = time.perf_counter()
    proc = train_forked("-m", *overrides, timeout=400, env=env, cwd=cwd)  # python train.py -m, forked
    return proc, time.perf_counter() - t0


def summary_rows(sweep_dir: Path) -> list[dict[str, str]]:
    with (sweep_dir / "sweep_summary.csv").open() as f:
        return list(csv.DictReader(f))


def test_sweep_of_two_rank_jobs_summarises_and_resumes(tmp_path: Path) -> None:
    args = ["mesh=2", "sharding=ddp,fsdp", "train.seed=0,1", *TINY]
    proc, first_s = multirun(tmp_path, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sweep_dir,) = (tmp_path / "multirun").iterdir()  # the stable dir: multirun/sweep-<hash>
    assert sweep_dir.name.startswith("sweep-")
    rows = summary_rows(sweep_dir)
    assert [r["job"] for r in rows] == ["0", "1", "2", "3"] and {r["status"] for r in rows} == {"ok"}
    assert [r["overrides"].split()[1:3] for r in rows] == [
        ["sharding=ddp", "train.seed=0"],
        ["sharding=ddp", "train.seed=1"],
        ["sharding=fsdp", "train.seed=0"],
        ["sharding=fsdp", "train.seed=1"],
    ]
    for row in rows:
        job = Path(row["run_dir"])
        summary = json.loads((job / "summary.json").read_text())
        assert summary["world_size"] == 2 and summary["steps"] == 4
        assert float(row["final_loss"]) == summary["final_loss"] and float(row["tokens_per_s"]) > 0
        assert Path(row["plot"]).is_file() and (job / "provenance.json").is_file()
    # Same seed, same data: DDP and FSDP agree; different seeds differ.
    losses = [float(r["final_loss"]) for r in rows]
    assert abs(losses[0] - losses[2]) < 1e-3 and losses[0] != losses[1]
    # One job's ranks end before the next job starts.
    for a, b in zip(rows[:-1], rows[1:], strict=True):
        assert (Path(a["run_dir"]) / "summary.json").stat().st_mtime <= (
            Path(b["run_dir"]) / "config.yaml"
        ).stat().st_mtime
    md = (sweep_dir / "sweep_summary.md").read_text()
    assert md.count("| ok |") == 4 and (sweep_dir / "sweep_summary.png").stat().st_size > 0

    # The same command again: same sweep dir, every job skipped.
    again, second_s = multirun(tmp_path, *args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [p.name for p in (tmp_path / "multirun").iterdir()] == [sweep_dir.name]
    assert {r["status"] for r in summary_rows(sweep_dir)} == {"skipped"}
    assert second_s < first_s / 2, (first_s, second_s)


def test_failed_job_is_reported_and_rerun(tmp_path: Path) -> None:
    # Job 1 fails validation (4 is not a multiple of 3) at once; job 0 trains 2 steps in-process.
    args = [
        "mesh=1",
        "train.micro_batch_size=2,3",
        "train.global_batch_size=4",
        "train.steps=2",
        *TINY[:2],
        *TINY[3:5],
    ]
    proc, _ = multirun(tmp_path, *args)
    assert proc.returncode == 1 and "1 sweep job(s) failed" in proc.stderr
    (sweep_dir,) = (tmp_path / "multirun").iterdir()
    rows = summary_rows(sweep_dir)
    assert [r["status"] for r in rows] == ["ok", "failed"]
    assert "global_batch_size" in (sweep_dir / "sweep_summary.md").read_text()
    proc, _ = multirun(tmp_path, *args)
    assert proc.returncode == 1
    assert [r["status"] for r in summary_rows(sweep_dir)] == ["skipped", "failed"]
    # The failed job ran again; its first attempt was set aside, not mixed into the new one.
    assert json.loads((sweep_dir / "1" / "attempts" / "0" / "job.json").read_text())["status"] == "failed"


def test_sweep_id_is_a_function_of_the_command_line() -> None:
    a = sweep_id(["-m", "sharding=ddp,fsdp", "mesh=2"])
    assert a == sweep_id(["sharding=ddp,fsdp", "mesh=2", "--multirun"]) and a.startswith("sweep-")
    assert a != sweep_id(["-m", "sharding=ddp,fsdp", "mesh=4"])
    # Reordered overrides: the same sweep (jobs are matched by their resolved config).
    assert a == sweep_id(["-m", "mesh=2", "sharding=ddp,fsdp"])


RECIPE = (
    "model:\n  name: NAME\n  dim: 32\n  n_layers: 1\n  n_heads: 2\n  n_kv_heads: 1\n  ffn_dim: 64\n"
    "train:\n  micro_batch_size: 2\n"
)


def test_isolated_environ_undoes_a_jobs_environment(monkeypatch) -> None:
    monkeypatch.setenv("KEEP_ME", "1")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with isolated_environ():
        os.environ.update(MASTER_PORT="1234", RANK="0", FRAMEWORK_WORKER="1")
        del os.environ["KEEP_ME"]
    assert "MASTER_PORT" not in os.environ and "FRAMEWORK_WORKER" not in os.environ
    assert os.environ["KEEP_ME"] == "1"


def test_resume_is_keyed_on_the_resolved_config(tmp_path: Path, monkeypatch) -> None:
    """Rerun with the overrides reordered (which renumbers the jobs) after editing one recipe: the
    jobs of the unchanged recipe are skipped, each with its own result, those of the edited one run
    again (the edit makes them fail validation at once, so the test trains nothing twice)."""
    root = tmp_path / "recipes"
    root.mkdir()
    (root / "sweep_a.yaml").write_text(RECIPE.replace("NAME", "sweep_a"))
    (root / "sweep_b.yaml").write_text(RECIPE.replace("NAME", "sweep_b").replace("dim: 32", "dim: 48"))
    monkeypatch.setenv("FRAMEWORK_RECIPE_PATH", str(root))
    tiny = [a for a in TINY if not a.startswith("train.micro_batch_size")]  # the recipes set it
    tiny += ["train.steps=1", "train.log_every=1", "logger.plot=false", "logger.progress_bar=false"]
    proc, _ = multirun(tmp_path, "recipe=sweep_a,sweep_b", "train.seed=0,1", *tiny)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sweep_dir,) = (tmp_path / "multirun").iterdir()
    rows = summary_rows(sweep_dir)
    first = {frozenset(r["overrides"].split()): r["final_loss"] for r in rows}
    assert {r["status"] for r in rows} == {"ok"} and len(set(first.values())) == 4

    edited = RECIPE.replace("NAME", "sweep_b").replace("dim: 32", "dim: 48")
    (root / "sweep_b.yaml").write_text(edited.replace("micro_batch_size: 2", "micro_batch_size: 3"))
    proc, _ = multirun(tmp_path, "train.seed=0,1", "recipe=sweep_a,sweep_b", *tiny)
    assert proc.returncode == 1 and "2 sweep job(s) failed" in proc.stderr, proc.stderr[-3000:]
    assert [p.name for p in (tmp_path / "multirun").iterdir()] == [sweep_dir.name]  # order ignored
    rows = summary_rows(sweep_dir)
    # Seed-major now: job 1 was (sweep_a, seed 1) and is (seed 0, sweep_b); job 2 is (seed 1, sweep_a).
    assert [(r["overrides"].split()[:2], r["status"]) for r in rows] == [
        (["train.seed=0", "recipe=sweep_a"], "skipped"),
        (["train.seed=0", "recipe=sweep_b"], "failed"),
        (["train.seed=1", "recipe=sweep_a"], "skipped"),
        (["train.seed=1", "recipe=sweep_b"], "failed"),
    ]
    for r in rows[::2]:  # a skipped job reports its own earlier result
        assert first[frozenset(r["overrides"].split())] == r["final_loss"], r
    # Computed as job 1 in the first order, set aside when job 1 reran with another config.
    job2 = json.loads((sweep_dir / "2" / "job.json").read_text())
    assert job2["result_of"] == str(sweep_dir / "1" / "attempts" / "0")
