"""framework.record.outputs: an output file replaces only what its command wrote, unless --force."""

from __future__ import annotations

from pathlib import Path

import pytest

from framework.record.outputs import check_replaceable, text_of


def _ours(path: Path) -> bool:
    return (text_of(path) or "").startswith("# ours")


def test_a_file_the_command_did_not_write_is_refused_unless_force(tmp_path: Path) -> None:
    mine, earlier = tmp_path / "mine.txt", tmp_path / "earlier.md"
    mine.write_text("my notes")
    earlier.write_text("# ours\n")
    with pytest.raises(ValueError, match=r"^--out '.*mine.txt' exists and is not a report: refusing"):
        check_replaceable("--out", mine, _ours, "a report", False, "r.md")
    check_replaceable("--out", mine, _ours, "a report", True, "r.md")
    check_replaceable("--out", earlier, _ours, "a report", False, "r.md")
    check_replaceable("--out", tmp_path / "new.md", _ours, "a report", False, "r.md")
    with pytest.raises(ValueError, match=r"is a folder; valid: a file path \(e.g. '.*/r.md'\)"):
        check_replaceable("--out", tmp_path, _ours, "a report", True, "r.md")
    with pytest.raises(ValueError, match=r"cannot be created: '.*mine.txt' is a file"):
        check_replaceable("--out", mine / "x.md", _ours, "a report", True, "r.md")
    assert mine.read_text() == "my notes"


def test_text_of_a_binary_file_is_none(tmp_path: Path) -> None:
    blob = tmp_path / "blob"
    blob.write_bytes(b"\xff\xfe\x00")
    assert text_of(blob) is None and text_of(tmp_path / "missing") is None


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_a_file_in_proc_is_refused_before_any_work() -> None:
    """``evaluate --report /proc/x.json``: a FileNotFoundError traceback after the model was scored."""
    with pytest.raises(
        ValueError, match=r"^--report '/proc/x.json' cannot be written: nothing can be created"
    ):
        check_replaceable("--report", Path("/proc/x.json"), _ours, "a report", False, "r.json")
