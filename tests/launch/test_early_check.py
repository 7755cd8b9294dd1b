"""framework.launch.early_check: a key's own rule refuses it before the launcher imports torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from framework.launch.early_check import first_refusal

ROOT = Path(__file__).resolve().parents[2]


def test_a_refused_value_is_one_line_exit_2_without_torch(tmp_path: Path) -> None:
    """A fresh interpreter, as a user's shell runs it: the launcher's line, no run dir left, and
    ``import torch`` never ran (``-X importtime`` lists every module imported)."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "train.py", "train.lr=-1", f"hydra.run.dir={run_dir}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = [ln for ln in proc.stderr.splitlines() if not ln.startswith("import time:")]
    assert proc.returncode == 2 and lines == ["error: train.lr=-1.0 is not valid; valid: a finite number > 0 and <= 10"]
    imported = {ln.rsplit("|", 1)[-1].strip() for ln in proc.stderr.splitlines() if ln.startswith("import time:")}
    assert "framework.launch.early_check" in imported and "torch" not in imported
    assert not run_dir.exists()


@pytest.mark.parametrize(
    "overrides, line",
    [
        (["train.steps=0"], None),  # valid: the launcher goes on
        (["train.lr=-1"], "train.lr=-1.0 is not valid"),
        (["model.init_from=/nowhere", "model.dim=0"], None),  # the shape comes from the checkpoint
    ],
)
def test_only_what_the_config_alone_refuses(overrides: list[str], line: str | None) -> None:
    from framework.launch.recipes import compose_nodes

    dcfg, _ = compose_nodes("llama_tiny", overrides)
    got = first_refusal(dcfg)
    assert (got is None) if line is None else (got is not None and got.startswith(line)), got
