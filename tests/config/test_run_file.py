"""framework.config.run_file: a run's config.yaml read back, or one line that never quotes the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from framework.config.run_file import read_run_config
from framework.config.schema import Config, to_yaml


def test_a_run_config_reads_and_anything_else_is_one_short_line(tmp_path: Path) -> None:
    good = tmp_path / "config.yaml"
    good.write_text(to_yaml(Config()))
    assert read_run_config(good, "--config x").train == Config().train
    secret = tmp_path / "passwd"
    secret.write_text("".join(f"root:x:0:0:user{i}:/home/u{i}:/bin/sh\n" for i in range(40)))
    with pytest.raises(ValueError, match=r"^--config x is not a run's config.yaml \(the schema refuses") as e:
        read_run_config(secret, "--config x")
    assert len(str(e.value)) < 300 and "user39" not in str(e.value)
    binary = tmp_path / "blob"
    binary.write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(ValueError, match=r"\(not text\)"):
        read_run_config(binary, "--config x")
