"""verify end to end through ``python train.py verify=on``: a compile failure falls back to eager and
training completes; injected NaNs are skipped, then rolled back; the report files and the compare
command on the two real run dirs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from framework.launch.verify_cli import main as verify_cli
from framework.record.metrics import read_metrics
from tests.train.test_train import train

TINY = ["verify=on", "train.steps=12", "train.log_every=4", "train.eval_every=0", "train.seq_len=64"]
TINY += ["logger.plot=false"]  # the report files are the point here, not the run's PNG


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("verify_runs")
    out = {"compile": base / "compile", "nan": base / "nan", "nan_lagged": base / "nan_lagged"}
    # Steps 5-7 get NaN; the third bad step (7) is a plain step, so without verify it is read one
    # step late, while step 8 is already queued.
    nan = ["checkpoint=sync", "checkpoint.every_steps=4", "verify.inject_nan_steps=[4,5,6]"]
    procs = {
        # A registered backend whose package is not installed (TVM): the first compiled call fails.
        # (An unregistered name is refused before launch by framework.launch.rules.) With the
        # compiler's own recompute (budget), which the eager rung replaces by whole-block checkpoints.
        "compile": train(
            out["compile"], *TINY, "executor=compile", "executor.backend=tvm",
            "sharding.activation_checkpointing=budget", "sharding.activation_memory_budget=0.5",
        ),  # fmt: skip
        "nan": train(out["nan"], *TINY, *nan),
        # verify off: plain steps are read one step late (the trainer's lag), rollback included.
        "nan_lagged": train(out["nan_lagged"], *TINY[1:], *nan),
    }
    for name, proc in procs.items():
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
    return out


def test_compile_failure_falls_back_to_eager_and_trains(runs: dict[str, Path]) -> None:
    run = runs["compile"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["executor"] == "eager"
    assert any("compile_error" in e for e in summary["events"])
    events = [r for r in read_metrics(run) if r.get("event") == "fallback/compile_error"]
    assert len(events) == 1 and "compile -> eager" in events[0]["detail"] and "tvm" in events[0]["detail"]
    log = (run / "train.log").read_text()
    assert "activation_checkpointing=budget, which needs the compiler: checkpointing every block (full)" in log
    report = json.loads((run / "verification.json").read_text())
    assert report["fallbacks"][0]["trigger"] == "compile_error"
    verdicts = {c["name"]: c["verdict"] for c in report["checks"]}
    assert verdicts["graph (cross-rank)"] == "pass" and verdicts["numerics"] == "pass"
    assert "performance" in verdicts


def test_nan_steps_are_skipped_then_rolled_back(runs: dict[str, Path]) -> None:
    run = runs["nan"]
    rows = read_metrics(run)
    skipped = [r["step"] for r in rows if r.get("event") == "skipped_step"]
    assert skipped == [5, 6, 7]
    rollback = [r for r in rows if r.get("event") == "fallback/bad_steps"]
    assert len(rollback) == 1 and "rollback to step 4" in rollback[0]["detail"]
    # Training went on from step 4 with the data past the bad batches, and finished with a finite loss.
    final = [r["loss"] for r in rows if r.get("loss") is not None]
    assert final[-1] == final[-1] and final[-1] < 5.0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["skipped_steps"] == 3
    md = (run / "verification.md").read_text()
    assert "| graph (cross-rank) | pass |" in md and "| numerics | pass |" in md
    assert "**bad_steps**: rollback to step 4" in md


def test_lagged_reading_gives_the_same_run(runs: dict[str, Path]) -> None:
    """Without verify the trainer queues each plain step before it reads the previous one; a NaN
    found one step late still skips the same steps and rolls back to the same checkpoint, undoing
    the step queued after it, so the run is the same as the one read step by step."""
    a, b = read_metrics(runs["nan"]), read_metrics(runs["nan_lagged"])

    def trace(rows: list[dict]) -> tuple:
        losses = [(r["step"], r["loss"], r["grad_norm"]) for r in rows if "loss" in r]
        events = sorted((r["step"], r["event"], r.get("detail", "")) for r in rows if "event" in r)
        return losses, events

    assert trace(b) == trace(a)
    assert trace(a)[0] and any(e[1] == "fallback/bad_steps" for e in trace(a)[1])
    sa, sb = (json.loads((runs[k] / "summary.json").read_text()) for k in ("nan", "nan_lagged"))
    assert (sb["steps"], sb["skipped_steps"]) == (sa["steps"], sa["skipped_steps"]) == (12, 3)


def test_compare_two_real_runs(runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """The compare command's main in this process (test_verify.py runs ``python -m framework.verify``)."""
    code = verify_cli(["compare", str(runs["compile"]), str(runs["nan"])])
    out = capsys.readouterr()
    assert code == 0, out.err
    text = out.out
    assert "## Graph" in text and "equal" in text  # same model: same fingerprint
    assert "| executor.mode | compile | eager |" in text and "verify.inject_nan_steps" in text
    assert "max_abs_diff" in text and "| tokens_per_s |" in text


def test_the_ladder_runs_by_default_and_verify_ladder_false_turns_it_off(tmp_path: Path) -> None:
    """Without verify=on (the default: only the cheap hooks), a compile error still steps down to
    eager before step 1 and the run trains; no report files (those are verify=on's). With
    ``verify.ladder=false`` the same error stops the run. The default path validates at step 0,
    before any training step: the eval graph's compile error is the one the ladder meets (it was
    raised from there, exit 1); with ``train.eval_every=0`` it is the first step's."""
    quick = ["train.steps=4", "train.log_every=2", "train.eval_every=2", "train.eval_batches=1"]
    quick += ["train.seq_len=32", "logger.plot=false"]
    broken = ["executor=compile", "executor.backend=tvm", "freeze=none"]
    for name, evals in (("on", []), ("on_no_eval", ["train.eval_every=0"])):
        on = train(tmp_path / name, *quick, *broken, *evals)
        assert on.returncode == 0, on.stderr[-3000:]
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["steps"] == 4 and summary["executor"] == "eager"
        rows = read_metrics(tmp_path / name)
        events = [r for r in rows if r.get("event") == "fallback/compile_error"]
        assert len(events) == 1 and events[0]["step"] == 0, events
        assert "compile -> eager" in events[0]["detail"] and "tvm" in events[0]["detail"], events
        validated = [r["step"] for r in rows if "val_loss" in r]
        assert validated == ([] if evals else [0, 2, 4]), validated
    assert not (tmp_path / "on" / "verification.json").exists()
    off = train(tmp_path / "off", *quick, *broken, "verify.ladder=false")
    assert off.returncode != 0 and "tvm" in off.stderr.lower(), off.stderr[-3000:]
    assert not (tmp_path / "off" / "summary.json").exists()
