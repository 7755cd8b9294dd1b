"""metrics.jsonl, the sinks, and wandb for real (offline: no network, no key)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from framework.config.schema import LoggerConfig, LoggerKind, WandbMode
from framework.record.metrics import Metrics, perplexity, read_metrics, validation_row
from framework.record.wandb_sink import REDACTED, has_api_key, resolve_mode, strip_secrets


def test_jsonl_always_written_and_console_has_no_sink(tmp_path: Path) -> None:
    m = Metrics(tmp_path, enabled=True, total_steps=2, start_step=0, progress_bar=False)
    m.start_sinks(LoggerConfig(), tmp_path, {})
    assert m.sinks == [] and m.wandb_run_id is None
    m.log({"step": 1, "loss": 2.5})
    m.log({"step": 1, "event": "skipped_step", "detail": "x"})
    m.close()
    rows = read_metrics(tmp_path)
    assert (
        [r["step"] for r in rows] == [1, 1] and rows[0]["loss"] == 2.5 and rows[1]["event"] == "skipped_step"
    )


def test_secrets_are_redacted_at_any_depth() -> None:
    cfg = {"logger": {"api_key": "abc", "project": "p"}, "x": [{"Token": 1}], "db_password": "pw", "lr": 0.1}
    out = strip_secrets(cfg)
    assert out == {
        "logger": {"api_key": REDACTED, "project": "p"},
        "x": [{"Token": REDACTED}],
        "db_password": REDACTED,
        "lr": 0.1,
    }
    assert cfg["logger"]["api_key"] == "abc"  # a copy


def test_mode_is_offline_without_a_key_and_online_with_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert not has_api_key() and resolve_mode(WandbMode.auto) == "offline"
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password 0123456789abcdef\n")
    (tmp_path / "netrc").chmod(0o600)
    assert has_api_key() and resolve_mode(WandbMode.auto) == "online"
    assert resolve_mode(WandbMode.offline) == "offline"  # an explicit choice wins


def test_wandb_offline_run_writes_files_and_resumes_the_same_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = LoggerConfig(kind=LoggerKind.wandb, project="test")
    config = {"train": {"lr": 0.01}, "logger": {"api_key": "hunter2"}}

    m = Metrics(tmp_path, enabled=True, total_steps=4, start_step=0, progress_bar=False)
    m.start_sinks(logger, tmp_path, config)
    run_id = m.wandb_run_id
    assert run_id
    run = m.sinks[0].run
    assert run.config["logger"]["api_key"] == REDACTED and run.config["train"]["lr"] == 0.01
    m.log({"step": 2, "loss": 3.0, "tokens_per_s": 100.0})
    m.close()
    runs = sorted((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1 and (runs[0] / f"run-{run_id}.wandb").stat().st_size > 0
    assert (tmp_path / "wandb_run_id").read_text().strip() == run_id
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["loss"] == 3.0

    # A restart passes the id saved in its checkpoint: the same wandb run continues.
    other = tmp_path / "restart"
    other.mkdir()
    m2 = Metrics(other, enabled=True, total_steps=4, start_step=2, progress_bar=False)
    m2.start_sinks(logger, other, config, run_id=run_id)
    assert m2.wandb_run_id == run_id
    m2.log({"step": 4, "loss": 2.0})
    m2.close()
    assert list((other / "wandb").glob(f"offline-run-*-{run_id}"))


def test_validation_rows_carry_perplexity() -> None:
    row = validation_row(50, 2.0)
    assert row == {"step": 50, "val_loss": 2.0, "val_ppl": pytest.approx(7.389056)}
    assert perplexity(1e4) == float("inf")


def test_every_training_line_says_step_of_total_elapsed_and_eta(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """train.log, a SLURM log or nohup.out has no progress bar: each training line carries the step
    out of the total, the time since the launch's steps began and the rest at that pace. A resumed
    launch counts from its own first step; validation and event lines are left as they were."""
    import logging
    import re

    from framework.record.metrics import duration

    m = Metrics(tmp_path, enabled=True, total_steps=200, start_step=0, progress_bar=False)
    m.begin(50)  # resumed at step 50
    t0 = m._started
    assert m.with_progress("step 100 | loss 2.0000", 100, now=t0 + 25.0) == (
        "step 100/200 | loss 2.0000 | elapsed 25s, ETA 50s"  # 50 steps in 25 s: 100 more at 0.5 s each
    )
    assert m.with_progress("step 50 | loss 2.0000", 50, now=t0) == "step 50/200 | loss 2.0000 | elapsed 0s, ETA -"
    with caplog.at_level(logging.INFO, logger="framework"):
        m.log({"step": 0, "val_loss": 5.0})
        m.log({"step": 60, "loss": 2.5, "lr": 1e-3})
        m.log({"step": 60, "event": "checkpoint", "detail": "saved"})
    m.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("step 0 | val_loss 5.0000") and "ETA" not in lines[0]
    assert re.fullmatch(r"step 60/200 \| loss 2\.5000 \| lr 1\.00e-03 \| elapsed \d+s, ETA \S+", lines[1]), lines
    assert lines[2] == "step 60: checkpoint: saved"
    assert "elapsed" not in json.dumps(read_metrics(tmp_path))  # the file keeps its rows as they were
    assert [duration(s) for s in (4.4, 65, 3600 * 2 + 7 * 60 + 5)] == ["4s", "1m05s", "2h07m"]
