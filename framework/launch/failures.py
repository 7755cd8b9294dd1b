"""What the launcher says when a rank of a self-launched run dies: one line, which rank, how, and what
happens next.

Why: when one rank of a multi-rank CPU run was killed, each survivor printed its gloo "Connection
closed by peer" traceback (about 110 lines for a few ranks) and torch's elastic agent its own
``W...``/``E...`` lines, before a restart that was right but never said. Now the survivors' tracebacks
go to the run's log file only (``is_lost_peer``: framework.launch.worker), torch's elastic lines are
kept off the console, and the agent that restarts the ranks says, once:

    rank 0 was killed by SIGKILL; restarting the ranks (restart 1 of 1): they resume from .../step_000004

When no restart is left the launcher's own line says it (framework.launch.entry: "ranks failed").
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("framework")

# What a surviving rank's collective raises when a peer process is gone (gloo on CPU, NCCL on GPU).
LOST_PEER = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "remote process exited or there was a network error",
)


def is_lost_peer(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is a collective that lost a peer rank: a consequence of
    another rank's death, whose traceback says nothing the launcher's line does not."""
    seen: BaseException | None = error
    while seen is not None:
        if any(text in str(seen) for text in LOST_PEER):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def describe_failures(failures: dict[int, Any]) -> str:
    """Which rank failed first, and how: a rank killed by a signal is the cause, and the ranks that then
    lost their peer (gloo's "Connection closed by peer", exit 1) are consequences. torchelastic's
    first failure is the lowest rank, so a killed pipeline rank 1 was reported as rank 0's exit 1."""

    def how(f: Any) -> str:
        if f.exitcode < 0:
            return f"was killed by {f.signal_name()}"
        return f"exited with {f.exitcode}" + (
            f" ({f.message})" if f.message and "traceback" not in f.message else ""
        )

    killed = sorted((r for r, f in failures.items() if f.exitcode < 0), key=lambda r: failures[r].timestamp)
    order = killed + sorted((r for r in failures if r not in killed), key=lambda r: failures[r].timestamp)
    first, rest = order[0], order[1:]
    text = f"rank {first} {how(failures[first])}"
    if rest:
        text += "; then " + ", ".join(f"rank {r} {how(failures[r])}" for r in rest)
    return text


def oom_kills() -> int | None:
    """How many processes the kernel's out-of-memory killer has killed in this process's memory
    cgroup (its ranks' too); None where that is not readable. A SIGKILL while it grew was the OOM
    killer's: the kill itself does not say."""
    for path, key in (
        (Path("/sys/fs/cgroup/memory.events"), "oom_kill"),  # cgroup v2 (a container's own root)
        (Path("/sys/fs/cgroup/memory/memory.oom_control"), "oom_kill"),  # cgroup v1
    ):
        try:
            for line in path.read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
        except (OSError, ValueError):
            continue
    return None


def resume_point(checkpoints: Path | None) -> str:
    """Where restarted ranks start: the newest committed checkpoint under ``checkpoints`` (None:
    checkpointing is off), else step 0."""
    if checkpoints is None:
        return "checkpointing is off, so they start again from step 0"
    from framework.checkpoint import store

    committed = store.committed(checkpoints)
    if not committed:
        return "no checkpoint is saved yet, so they start again from step 0"
    return f"they resume from {committed[-1][1]}"


def restart_line(failures: dict[int, Any], oom: bool, attempt: int, restarts: int, resume: str) -> str:
    """The one line the launcher logs when the agent restarts the ranks."""
    what = describe_failures(failures) if failures else "the ranks stopped responding"
    if oom:  # on the first SIGKILL: the rank the OOM killer chose
        oom_note = "SIGKILL (the kernel's out-of-memory killer: the host or the job's memory limit ran out)"
        what = what.replace("SIGKILL", oom_note, 1)
    return f"{what}; restarting the ranks (restart {attempt} of {restarts}): {resume}"


@contextlib.contextmanager
def reporting_restarts(checkpoints: Path | None) -> Iterator[None]:
    """Within: torch's elastic launcher runs an agent that logs ``restart_line`` when it restarts
    the ranks, and torch's own elastic log lines stay off the console.

    How: ``launch_agent`` builds its agent from ``torch.distributed.launcher.api.LocalElasticAgent``;
    a subclass whose ``_monitor_workers`` (the hook SimpleElasticAgent's subclasses implement) also
    reports takes its place for the length of the launch, and the name is restored after."""
    import torch.distributed.launcher.api as api
    from torch.distributed.elastic.agent.server.api import WorkerState

    base = api.LocalElasticAgent
    before = oom_kills()

    class ReportingAgent(base):  # type: ignore[misc, valid-type]
        def _monitor_workers(self, worker_group: Any) -> Any:
            result = super()._monitor_workers(worker_group)
            if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and self._remaining_restarts > 0:
                spec = worker_group.spec
                now = oom_kills()
                oom = before is not None and now is not None and now > before
                attempt = spec.max_restarts - self._remaining_restarts + 1
                line = restart_line(
                    result.failures, oom, attempt, spec.max_restarts, resume_point(checkpoints)
                )
                log.warning("%s", line)
            return result

    elastic = logging.getLogger("torch.distributed.elastic")
    level = elastic.level
    api.LocalElasticAgent = ReportingAgent
    elastic.setLevel(logging.CRITICAL)  # "Sending process closing signal", "failed (exitcode: -9)"
    try:
        yield
    finally:
        api.LocalElasticAgent = base
        elastic.setLevel(level)
