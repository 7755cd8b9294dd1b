"""Preemption: turn SIGTERM/SIGUSR1/SIGINT into a flag that every rank sees at the same step.

Why a flag and an agreement: a scheduler (SLURM, Kubernetes, torchelastic) signals ranks at
slightly different moments. If each rank acted on its own signal, they would try to save at
different steps and the save's collectives would mismatch. The handler only records the signal;
``requested()`` all-reduces the flags (MAX) on the checkpoint's control group, so all ranks get the
same answer at the same step, save, and exit.

SIGINT (Ctrl-C) is handled like SIGTERM: the launcher forwards it to the ranks, which save and
exit 0; before, it raised KeyboardInterrupt mid-step and nothing was saved.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

import torch.distributed as dist

from framework.checkpoint.group import Channel

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class PreemptionHandler:
    """Install handlers that set a flag; ``requested()`` is the agreed flag; ``close()`` restores.

    Must be created on the main thread (Python only delivers signals there). ``group`` should be a
    gloo group no background thread uses (``Checkpointer.control_group``); None works in one process.
    """

    def __init__(
        self, group: dist.ProcessGroup | None = None, signals: tuple[signal.Signals, ...] = DEFAULT_SIGNALS
    ) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("PreemptionHandler must be created on the main thread (signals go there)")
        self._channel = Channel(group)
        self.signal: int | None = None  # the last signal received on this rank
        self._previous = {s: signal.signal(s, self._on_signal) for s in signals}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signal = signum

    def signal_name(self) -> str:
        """The signal this rank received ("SIGTERM"), or "another rank's signal"."""
        return signal.Signals(self.signal).name if self.signal is not None else "another rank's signal"

    def requested(self) -> bool:
        """True on every rank once any rank got a signal. Collective: call on all ranks each time."""
        return self._channel.any(self.signal is not None)

    def close(self) -> None:
        """Restore the handlers that were installed before."""
        for s, prev in self._previous.items():
            signal.signal(s, prev)
        self._previous = {}

    def __enter__(self) -> PreemptionHandler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
