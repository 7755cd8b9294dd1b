"""The launcher's own refusals (framework.entry): what a refused config leaves behind, and
checkpoint dirs that would share another run's tree. Through the real ``train.py`` and Hydra, in
this process (tests/entry.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.entry import train_main


def test_refusal_keeps_an_existing_run_dir_and_the_users_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "mine"
    run.mkdir()  # holding only a train.log: it used to look like Hydra's own files and was removed
    (run / "train.log").write_text("my own log\n")
    assert train_main(f"hydra.run.dir={run}", "train.lr=nan") == 2
    assert "train.lr=nan" in capsys.readouterr().err
    assert (run / "train.log").read_text().startswith("my own log\n")
    assert not (run / ".hydra").exists()  # what Hydra added for this invocation is gone


def test_refusal_removes_the_run_dir_it_created(tmp_path: Path) -> None:
    run = tmp_path / "new" / "run"
    assert train_main(f"hydra.run.dir={run}", "train.lr=nan") == 2
    assert not run.exists() and not (tmp_path / "new").exists() and tmp_path.is_dir()
