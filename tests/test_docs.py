"""Generated docs are fresh, and the Hydra surface (--help, --cfg job) shows what it should."""

from __future__ import annotations

from pathlib import Path

import pytest

from framework import docs
from framework.config import GROUPS
from tests.entry import train_forked


def test_readme_config_reference_and_help_are_not_stale() -> None:
    assert docs.stale() == [], "run `python -m framework.docs` and commit the result"


def test_reference_covers_every_field_and_group() -> None:
    text = docs.render_reference()
    for key in ("train.steps", "mesh.hardware.peak_tflops", "run.instantiate_allow", "logger.mode"):
        assert f"`{key}`" in text
    assert set(GROUPS) <= set(docs.GROUP_DESCRIPTIONS)


def test_help_lists_groups_with_options_and_cfg_job_prints_the_config() -> None:
    """``python train.py --help`` and ``--cfg job``, forked from this process (tests/entry.py)."""
    out = train_forked("--help", timeout=120)
    assert out.returncode == 0, out.stderr
    assert "sharding       parallel layout" in out.stdout
    assert "logger: console, wandb" in out.stdout and "recipe: " in out.stdout
    cfg = train_forked("--cfg", "job", "logger=wandb", timeout=120)
    assert cfg.returncode == 0 and "kind: wandb" in cfg.stdout


def readme_dry_runs() -> list[str]:
    """Every ``python train.py ... run.dry_run=true`` line of README.md's (and docs/*.md's) bash blocks."""
    import re
    import shlex

    from tests.entry import ROOT

    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    lines = []
    for path in texts:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
            for line in block.splitlines():
                cmd = line.split("  #")[0].strip()
                if cmd.startswith("python train.py ") and "run.dry_run=true" in cmd and " -m " not in cmd:
                    lines.append(" ".join(shlex.split(cmd)[2:]))
    return lines


@pytest.mark.parametrize("args", readme_dry_runs())
def test_each_readme_dry_run_exits_0_and_fits_its_devices(tmp_path: Path, args: str) -> None:
    import json

    from tests.entry import train_main

    run = tmp_path / "run"
    assert train_main(f"hydra.run.dir={run}", *args.split()) == 0, args
    memory = json.loads((run / "plan.json").read_text())["memory"]
    assert memory["total"] <= memory["device"], (args, memory)
