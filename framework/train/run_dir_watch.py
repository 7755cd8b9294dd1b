"""``RunDirWatch``: every rank stops together when the run dir is deleted during the run.

Rank 0 stats the run dir (framework.record.run_dir.DirStamp) at each metrics write and before each
save, and broadcasts what it found on a gloo group of its own, so all ranks raise ``DirGone`` at the
same step: a rank that stopped alone would leave the others in a collective, failing with gloo's
"connection closed" traceback instead of the one line.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from framework.checkpoint.group import Channel, new_gloo_group
from framework.record.run_dir import DirGone, DirStamp, stopped


class RunDirWatch:
    """Built on every rank (creating its group is collective); ``check`` is collective too."""

    def __init__(self, run_dir: Path, is_main: bool) -> None:
        self.channel = Channel(new_gloo_group())
        # config.yaml: the launcher wrote it before any rank started (absent when a test calls the trainer)
        self.stamp = DirStamp.of("run dir", run_dir, marker="config.yaml") if is_main else None

    def check(self, step: int) -> None:
        """Raise DirGone on every rank when rank 0 finds the run dir gone. Call on all ranks at the
        same points (a log step, a save, the end)."""
        reason = self.stamp.gone() if self.stamp is not None else None
        reason = self.channel.broadcast(reason)
        if reason is not None:
            raise DirGone(stopped(reason, f"at step {step}"))

    @contextmanager
    def blame(self, step: int) -> Iterator[None]:
        """Around a save: the checkpoint dir found gone is the run dir's deletion when that went too
        (a deletion between ``check`` and the save's own stat names the run dir, not its child).
        Collective like ``check``: a save's DirGone is raised on every rank at once."""
        try:
            yield
        except DirGone:
            self.check(step)
            raise
