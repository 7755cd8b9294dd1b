"""framework.launch.failures: the launcher's one line about a rank that died."""

from __future__ import annotations

from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from framework.launch.failures import is_lost_peer, restart_line, resume_point


def test_a_lost_peer_is_told_from_a_rank_that_failed_on_its_own() -> None:
    gloo = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:44210")
    try:
        try:
            raise gloo
        except RuntimeError as e:
            raise ValueError("the step failed") from e
    except ValueError as wrapped:
        assert is_lost_peer(wrapped)
    assert not is_lost_peer(ValueError("model.dim=7 is not divisible by model.n_heads=2"))


def test_the_restart_line_names_the_rank_how_it_died_and_where_the_ranks_resume(tmp_path: Path) -> None:
    killed = ProcessFailure(local_rank=1, pid=10, exitcode=-9, error_file="")
    lost = ProcessFailure(local_rank=0, pid=11, exitcode=1, error_file="")
    killed.timestamp, lost.timestamp = 1, 2
    step = tmp_path / "step_000004"
    step.mkdir()
    (step / "manifest.json").write_text('{"step": 4}')
    line = restart_line({0: lost, 1: killed}, True, 1, 2, resume_point(tmp_path))
    assert line == (
        "rank 1 was killed by SIGKILL (the kernel's out-of-memory killer: the host or the job's memory limit "
        f"ran out); then rank 0 exited with 1; restarting the ranks (restart 1 of 2): they resume from {step}"
    )
    assert resume_point(tmp_path / "none").endswith("start again from step 0")
    assert resume_point(None) == "checkpointing is off, so they start again from step 0"
