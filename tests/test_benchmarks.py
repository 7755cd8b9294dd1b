"""The benchmarks' index (benchmarks/__init__.py) and the folder agree, and ``python -m benchmarks`` runs.

Why: the index is only worth reading if it is whole. A script added without an entry, an entry whose
script was renamed, a PERF.md section renamed under its entry, or a doc that still names a script
that is gone, fails here with the name to fix.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import BENCHMARKS, BY_NAME, DEVICES, HERE, PERF
from benchmarks.__main__ import listing, main

ROOT = HERE.parent
SCRIPTS = {p.name for p in HERE.glob("*.py") if p.name not in ("__init__.py", "__main__.py")} | {
    p.name for p in HERE.glob("*.sh")
}


def test_every_script_is_listed_once_and_every_entry_exists() -> None:
    listed = [b.script for b in BENCHMARKS]
    assert sorted(set(SCRIPTS) - set(listed)) == [], "add these to benchmarks/__init__.py's BENCHMARKS"
    assert sorted(set(listed) - set(SCRIPTS)) == [], "these entries name no script of benchmarks/"
    assert len(listed) == len(set(listed)) and len(BY_NAME) == len(BENCHMARKS)
    assert {"kernel_tables.py", "published_sources.py"} <= set(listed)


def test_names_say_what_is_measured_not_when() -> None:
    """No script or entry is named after the round or session that made it."""
    dated = re.compile(r"round|session|(^|_)r\d+(_|$)")
    assert [b.script for b in BENCHMARKS if dated.search(b.script) or dated.search(b.name)] == []


def test_each_entry_names_its_devices_and_a_perf_section_that_exists() -> None:
    headings = {m.group(1).strip() for m in re.finditer(r"^#{2,3} (.+)$", PERF.read_text(), re.M)}
    for b in BENCHMARKS:
        assert b.devices and set(b.devices) <= set(DEVICES), (b.name, b.devices)
        assert b.measures and "\n" not in b.measures, b.name
        if b.perf is None:
            assert b.elsewhere, f"{b.name}: no PERF.md section, and nothing says where its output goes"
        else:
            assert b.perf in headings, f"{b.name}: no section '## {b.perf}' in benchmarks/PERF.md"
        assert b.command.split()[:2] == ["bash" if b.script.endswith(".sh") else "python", f"benchmarks/{b.script}"]


def test_docs_name_only_scripts_that_exist() -> None:
    """Every ``benchmarks/NAME.py|.sh`` named in the README, docs/, benchmarks/ (PERF.md included),
    framework/ or conf/ is a file (a script renamed leaves no stale command behind)."""
    named: dict[str, set[str]] = {}
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *HERE.glob("*.*"), *(ROOT / "framework").rglob("*.py")]
    files += [*(ROOT / "conf").rglob("*.yaml")]
    for f in files:
        for m in re.finditer(r"benchmarks/(\w+\.(?:py|sh))\b", f.read_text()):
            named.setdefault(m.group(1), set()).add(str(f.relative_to(ROOT)))
    gone = {name: sorted(where) for name, where in named.items() if not (HERE / name).is_file()}
    assert gone == {}


def test_the_listing_shows_every_entry_and_filters_by_device(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{len(BENCHMARKS)} benchmarks")
    for b in BENCHMARKS:
        assert f"{b.name}: {b.measures}\n" in out and f"run:     {b.command}\n" in out
    cpu = listing("cpu")
    assert "cost_check:" in cpu and "multi_gpu:" not in cpu and "structure:" in cpu
    assert main(["--device", "tpu"]) == 2 and main(["nosuch"]) == 2
    assert "no benchmark 'nosuch'" in capsys.readouterr().err


def test_python_m_benchmarks_runs_one_from_the_repository_root(tmp_path: Path) -> None:
    """``python -m benchmarks cfg_flow`` (static, a few seconds) runs the script with its arguments,
    from the root, and passes its output and status through."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "cfg_flow", str(ROOT)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"cfg from launch\.entry\.run_job enters \d+ files", proc.stdout), proc.stdout
