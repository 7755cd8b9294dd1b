"""The verification report: each check's figures and verdict, and every fallback taken.

Rank 0 writes ``verification.json`` (for tools, and for ``python -m framework verify compare``) and
``verification.md`` (for people) into the run dir. The report is built up during the run and
written again at the end, so a run that stops on a failed check still leaves the reason on disk.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

JSON_FILE = "verification.json"
MD_FILE = "verification.md"


@dataclass
class CheckResult:
    """One check. ``passed`` is None when the check was skipped (``detail`` says why).

    ``action`` is what the policy did about a failure: "warn", "fail" or "fallback" ("" when passed).
    """

    name: str
    passed: bool | None
    detail: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    action: str = ""

    @property
    def verdict(self) -> str:
        if self.passed is None:
            return "skipped"
        return "pass" if self.passed else f"FAIL ({self.action})" if self.action else "FAIL"


@dataclass
class FallbackEvent:
    """A change of course during the run: an executor fallback, a rollback, a circuit-breaker trip."""

    step: int
    trigger: str  # compile_error | graph | numerics | circuit_breaker | bad_steps | regression
    action: str  # e.g. "executor compile -> eager", "rollback to step 4"
    detail: str = ""

    def row(self) -> dict[str, Any]:
        """The metrics.jsonl event row (``metrics.format_row`` prints ``event: detail``)."""
        return {
            "step": self.step,
            "event": f"fallback/{self.trigger}",
            "detail": f"{self.action}: {self.detail}",
        }


@dataclass
class VerificationReport:
    policy: str
    checks: list[CheckResult] = field(default_factory=list)
    fallbacks: list[FallbackEvent] = field(default_factory=list)

    def add(self, check: CheckResult) -> CheckResult:
        self.checks.append(check)
        return check

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "passed": all(c.passed is not False for c in self.checks),
            "checks": [{**asdict(c), "verdict": c.verdict} for c in self.checks],
            "fallbacks": [asdict(f) for f in self.fallbacks],
        }


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, str) and len(v) > 20 and all(c in "0123456789abcdef" for c in v):
        return v[:16]  # a sha256: the prefix identifies it
    return str(v).replace("|", "\\|")  # a table cell


def format_markdown(report: VerificationReport) -> str:
    d = report.to_dict()
    lines = [
        "# Verification",
        "",
        f"policy: `{report.policy}`; overall: {'pass' if d['passed'] else 'FAIL'}",
        "",
        "| check | result | figures |",
        "|---|---|---|",
    ]
    for c in report.checks:
        figures = ", ".join(f"{k}={_fmt(v)}" for k, v in c.figures.items() if v is not None)
        lines.append(f"| {c.name} | {c.verdict} | {figures} |")
    details = [c for c in report.checks if c.detail]
    if details:
        lines += ["", "## Details", ""]
        for c in details:
            lines += [f"### {c.name}", "", "```", c.detail, "```", ""]
    lines += ["", "## Fallbacks", ""]
    if not report.fallbacks:
        lines.append("none")
    for f in report.fallbacks:
        lines.append(f"- step {f.step}: **{f.trigger}**: {f.action}" + (f" ({f.detail})" if f.detail else ""))
    return "\n".join(lines) + "\n"


def write_report(run_dir: Path, report: VerificationReport) -> tuple[Path, Path]:
    """Write both files (rank 0 only); returns their paths."""
    js, md = Path(run_dir) / JSON_FILE, Path(run_dir) / MD_FILE
    js.write_text(json.dumps(report.to_dict(), indent=2, default=str) + "\n")
    md.write_text(format_markdown(report))
    return js, md


def read_report(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / JSON_FILE
    return json.loads(path.read_text()) if path.is_file() else None
