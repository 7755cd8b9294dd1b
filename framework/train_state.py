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

    def count(self, seconds: float | None, finite: bool) -> None:
        """One step read; ``seconds`` is its time when it counts for throughput (warm and finite)."""
        if not finite:
            self.skipped_steps += 1
        if seconds is not None:
            self.window_tokens += self.tokens_per_step
            self.window_s += seconds
            self.log_tokens += self.tokens_per_step
            self.log_s += seconds
            self.step_seconds.append(seconds)

    def take_log_rate(self) -> float | None:
        """Tokens/s since the last log row (None: no timed step since), and start a new window."""
        rate = self.log_tokens / self.log_s if self.log_s > 0 else None
        self.log_tokens, self.log_s = 0, 0.0
        return rate

    @property
    def tokens_per_s(self) -> float | None:
        return self.window_tokens / self.window_s if self.window_s > 0 else None
