"""``python -m framework COMMAND``: every command reaches its tool, real ones run, old spellings work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from framework import __main__ as cli
from tests.entry import train_forked

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def test_console_script_is_the_dispatcher() -> None:
    text = (ROOT / "pyproject.toml").read_text()  # tomllib is 3.11+; the project supports 3.10
    section = text.split("[project.scripts]\n", 1)[1].split("\n[", 1)[0]
    assert 'framework = "framework.__main__:main"' in section.splitlines()


def test_usage_lists_every_command_and_an_unknown_one_is_one_line(capsys) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("train", "evaluate", "generate", "export-hf", "data", "recipes", "verify"):
        assert f"  {command} " in out
    assert cli.main([]) == 2
    assert cli.main(["trian"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown command 'trian'; valid: train, evaluate") and "\n" not in err


@pytest.mark.parametrize("command", [c for c in cli.COMMANDS if c != "train"])
def test_each_tool_command_reaches_its_tools_own_parser(command: str, capsys) -> None:
    """``--help`` of each command is its tool's argparse help (exit 0), with the tool's options."""
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ")
    expected = {
        "evaluate": "--batches",
        "generate": "--prompt",
        "export-hf": "checkpoint",
        "data": "prepare",
        "recipes": "validate",
        "verify": "compare",
        "docs": "--check",
    }
    assert expected[command] in out


def test_real_commands_through_the_entry_point() -> None:
    """The real interpreter path: ``python -m framework recipes list`` and ``train --help`` (which
    runs train.py with Hydra), and the old ``python -m framework.recipes list`` prints the same."""
    new = subprocess.run(
        [sys.executable, "-m", "framework", "recipes", "list"],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=ROOT,
        timeout=120,
    )
    old = subprocess.run(
        [sys.executable, "-m", "framework.launch.recipe_cli", "list"],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=ROOT,
        timeout=120,
    )
    assert new.returncode == old.returncode == 0, new.stderr + old.stderr
    assert new.stdout == old.stdout and "llama_tiny " in new.stdout
    helped = subprocess.run(
        [sys.executable, "-m", "framework", "train", "--help"],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=ROOT,
        timeout=120,
    )
    assert helped.returncode == 0, helped.stderr
    assert "python train.py" in helped.stdout and "recipe" in helped.stdout


def test_evaluate_gives_the_runs_own_final_val_loss(tmp_path: Path, capsys) -> None:
    """A one-rank run with a checkpoint at its last step: evaluate recomputes its final val_loss."""
    run = tmp_path / "run"
    # 3 steps, no export or plot (neither plays a part in evaluate): the default run trained 10.
    quick = ["train.steps=3", "train.eval_every=3", "freeze=none", "logger.plot=false"]
    out = train_forked(*quick, "checkpoint=sync", f"hydra.run.dir={run}", timeout=300)
    assert out.returncode == 0, out.stderr
    summary = json.loads((run / "summary.json").read_text())
    assert cli.main(["evaluate", str(run)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["checkpoint"].endswith("step_000003")
    assert got["val_loss"] == pytest.approx(summary["final_val_loss"], rel=1e-6)
    assert cli.main(["evaluate", str(tmp_path)]) == 2  # no config.yaml: one line, exit 2
    assert capsys.readouterr().err.startswith("error: no config.yaml in ")
