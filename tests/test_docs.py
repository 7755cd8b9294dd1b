"""Generated docs are fresh, and the Hydra surface (--help, --cfg job) shows what it should."""

from __future__ import annotations

from framework.config.schema import GROUPS
from framework.launch import docs
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
