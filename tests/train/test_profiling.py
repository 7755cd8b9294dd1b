"""run.profile: a real torch.profiler window, its Chrome trace, and the top operators."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from framework.config.schema import ProfileRanks, RunConfig
from framework.train.profiling import NullProfiler, format_top_operators, make_profiler


def _train(prof, steps: int) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with prof:
        for _ in range(steps):
            model(torch.randn(16, 32)).sum().backward()
            opt.step()
            opt.zero_grad()
            prof.step()


def test_trace_and_top_operators_on_rank0(tmp_path: Path) -> None:
    cfg = RunConfig(profile=True, profile_wait=1, profile_warmup=1, profile_active=2)
    prof = make_profiler(cfg, tmp_path, rank=0)
    _train(prof, steps=6)
    trace = json.loads((tmp_path / "profile" / "trace_rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::addmm" in names
    top = prof.top_operators(5)
    assert 0 < len(top) <= 5 and top[0]["self_ms"] >= top[-1]["self_ms"]
    assert json.loads((tmp_path / "profile" / "top_ops_rank0.json").read_text())[0]["name"] == top[0]["name"]
    assert top[0]["name"] in format_top_operators(top)


def test_rank_selection(tmp_path: Path) -> None:
    assert isinstance(make_profiler(RunConfig(profile=False), tmp_path, 0), NullProfiler)
    assert isinstance(make_profiler(RunConfig(profile=True), tmp_path, 1), NullProfiler)
    every = make_profiler(RunConfig(profile=True, profile_ranks=ProfileRanks.all), tmp_path, 1)
    assert not isinstance(every, NullProfiler) and every.trace_path.name == "trace_rank1.json"
    with pytest.raises(ValueError, match="profile_active=0"):
        make_profiler(RunConfig(profile=True, profile_active=0), tmp_path, 0)


def test_a_run_dir_deleted_before_the_trace_is_not_made_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The window closes after the run dir went: the trace is skipped with a warning (the run stops
    at its next metrics write), and no folder comes back at the run dir's path."""
    run = tmp_path / "run"
    run.mkdir()
    prof = make_profiler(RunConfig(profile=True, profile_wait=1, profile_warmup=1, profile_active=1), run, 0)
    run.rmdir()
    with caplog.at_level("WARNING", logger="framework"):
        _train(prof, steps=4)
    assert not run.exists()
    assert "trace of rank 0 not written" in caplog.text
