"""The ``verify`` config group: the migration checklist's verification hooks.

* consistency.py: cross-rank graph fingerprint + config hash; a pinned reference graph.
* numerics.py: executed vs eager (and vs an unsharded eager model) loss on the first batch.
* baseline.py: the performance baseline store and the regression comparison.
* fallback.py: the ladder (``Ladder``, driven by the trainer), latency circuit breaker, bad-step
  policy, state carry-over.
* policy.py: warn | fail | fallback. report.py: verification.json + verification.md.
* session.py: ``Verifier``, the hooks the trainer calls; each judges and returns a decision.
* compare.py / __main__.py:
  ``python -m framework verify compare RUN_A RUN_B``.
"""

from framework.verify.baseline import PerfFigures, baseline_key, compare_perf, perf_figures, save_baseline
from framework.verify.consistency import RankMismatchError, check_ranks, check_reference
from framework.verify.fallback import (
    BadStepTracker,
    CircuitBreaker,
    Ladder,
    StepAction,
    Verdict,
    carry_state,
    next_float8,
    next_mode,
)
from framework.verify.numerics import check_numerics
from framework.verify.policy import VerificationError, apply_policy
from framework.verify.report import CheckResult, FallbackEvent, VerificationReport, write_report
from framework.verify.session import Verifier

__all__ = [
    "BadStepTracker",
    "CheckResult",
    "CircuitBreaker",
    "FallbackEvent",
    "Ladder",
    "PerfFigures",
    "RankMismatchError",
    "StepAction",
    "VerificationError",
    "Verdict",
    "VerificationReport",
    "Verifier",
    "apply_policy",
    "baseline_key",
    "carry_state",
    "check_numerics",
    "check_ranks",
    "check_reference",
    "compare_perf",
    "next_float8",
    "next_mode",
    "perf_figures",
    "save_baseline",
    "write_report",
]
