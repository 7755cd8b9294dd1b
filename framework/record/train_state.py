"""``TrainState``: what several parts of the training loop read, in one small dataclass.

Why one object, passed rather than captured: the loop, the checkpointer (it saves and restores the
step and the tokens seen) and the summary all read these figures. Passed explicitly, each part says
in its signature what it reads and writes; there are no closures sharing counters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class TrainState:
    tokens_per_step: int  # global batch x sequence length
    started: float = field(default_factory=time.perf_counter)  # this launch's start (perf_counter)
    train_started: float = 0.0  # when the parts were built and the loop began
    step: int = 0  # the last optimizer step queued (a rollback moves it back)
    tokens_seen: int = 0
    # Throughput counts finite steps after each build's warm-up (compilation, allocator warm-up):
    # the run's window (summary) and the window since the last log row (that row's tokens/s).
    window_tokens: int = 0
    window_s: float = 0.0
    log_tokens: int = 0
    log_s: float = 0.0
    # The time the loop waited for its batches (the sampler's ``last_wait_s``), over the same steps.
    window_wait_s: float = 0.0
    log_wait_s: float = 0.0
    log_steps: int = 0
    step_seconds: list[float] = field(default_factory=list)  # post-warm-up step times: p50/p99, baseline
    time_to_first_step_s: float | None = None
    first_step_s: float | None = None  # the first step's own time (compile time = it less a median step)
    skipped_steps: int = 0
    final_loss: float | None = None  # the last log row's
    peak_mem_gib: float | None = None
    first_val_loss: float | None = None
    last_val_loss: float | None = None

    def first_step(self, seconds: float) -> None:
        """This launch's first step was read: the time to it, and its own time."""
        self.time_to_first_step_s = time.perf_counter() - self.started
        self.first_step_s = seconds

    def count(self, seconds: float | None, finite: bool, wait_s: float) -> None:
        """One step read; ``seconds`` is its time when it counts for throughput (warm and finite),
        ``wait_s`` the time its batch kept the loop waiting."""
        if not finite:
            self.skipped_steps += 1
        if seconds is not None:
            self.window_tokens += self.tokens_per_step
            self.window_s += seconds
            self.log_tokens += self.tokens_per_step
            self.log_s += seconds
            self.window_wait_s += wait_s
            self.log_wait_s += wait_s
            self.log_steps += 1
            self.step_seconds.append(seconds)

    def take_log_window(self) -> dict[str, float | None]:
        """The log row's figures since the last row (tokens/s; data wait per step and as a share of
        the step time, when a timed step ran), and start a new window."""
        row: dict[str, float | None] = {
            "tokens_per_s": self.log_tokens / self.log_s if self.log_s > 0 else None
        }
        if self.log_steps:
            row["data_wait_ms"] = self.log_wait_s / self.log_steps * 1e3
            row["data_wait_share"] = self.log_wait_s / self.log_s
        self.log_tokens, self.log_s, self.log_wait_s, self.log_steps = 0, 0.0, 0.0, 0
        return row

    @property
    def tokens_per_s(self) -> float | None:
        return self.window_tokens / self.window_s if self.window_s > 0 else None

    @property
    def data_wait(self) -> tuple[float | None, float | None]:
        """The run's data wait per timed step (ms) and as a share of the step time (None: no timed
        step). An upper bound of the device's idle time: on CUDA the host waits while the previous
        step still runs."""
        if self.window_s <= 0:
            return None, None
        return self.window_wait_s / len(self.step_seconds) * 1e3, self.window_wait_s / self.window_s
