"""What a failed check does, per ``verify.policy``: warn, fail (raise), or fall back.

Every rank must take the same decision (a rank that stops while the others train on would leave
them hanging in a collective), so the checks feed this function figures that all ranks agreed on.
"""

from __future__ import annotations

import logging
import warnings

from framework.config.schema import Policy
from framework.verify.report import CheckResult

log = logging.getLogger("framework")


class VerificationError(RuntimeError):
    """A verification check failed under ``verify.policy=fail`` (or a cross-rank mismatch)."""


def apply_policy(check: CheckResult, policy: Policy, can_fall_back: bool) -> Policy | None:
    """None when ``check`` passed or was skipped; else the action taken, recorded in ``check.action``.

    ``fail`` raises VerificationError with the check's detail. ``fallback`` without a lower executor
    rung (already eager) acts as ``warn``, with a note in the detail.
    """
    if check.passed is not False:
        return None
    action = policy
    if policy is Policy.fallback and not can_fall_back:
        action = Policy.warn
        check.detail += "\n(policy fallback: already on the last rung, eager; reported only)"
    check.action = action.value
    message = f"verification check '{check.name}' failed: {check.detail}"
    if action is Policy.fail:
        raise VerificationError(message)
    warnings.warn(message, UserWarning, stacklevel=2)
    return action
