"""The files a command writes (``evaluate --report``, ``verify compare --out``, ``data prepare OUT``):
never over a file the command did not write, unless ``--force``; export-hf's rule for its folder
(framework.checkpoint.export_hf.check_out_dir), for one file.

Why: ``evaluate RUN --report RUN/config.yaml`` replaced the run's config with a JSON report, and a
folder as the path was an IsADirectoryError traceback after the model had been scored.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from framework.record.run_dir import cannot_create_in


def check_output_file(flag: str, out: Path, example: str = "out.bin") -> None:
    """Refuse an output path that is a folder, sits under a file, or is in a folder this user cannot
    write, before any input is read (each was a traceback after the work, or an IsADirectoryError).
    ``example``: a file name the message suggests inside a folder given as the path."""
    if out.is_dir():
        raise ValueError(f"{flag} {str(out)!r} is a folder; valid: a file path (e.g. {str(out / example)!r})")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{flag} {str(out)!r} cannot be created: {str(parent)!r} is a file")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise ValueError(f"{flag} {str(out)!r} cannot be written: {str(parent)!r} is not writable")
            why = cannot_create_in(parent)  # /proc, /sys: writable to root by os.access, not in fact
            if why is not None:
                raise ValueError(
                    f"{flag} {str(out)!r} cannot be written: nothing can be created in {str(parent)!r} ({why})"
                )
            break
    if out.exists() and not os.access(out, os.W_OK):
        raise ValueError(f"{flag} {str(out)!r} is read-only")


def check_replaceable(
    flag: str, out: Path, ours: Callable[[Path], bool], what: str, force: bool, example: str
) -> None:
    """``check_output_file``, and a ValueError when ``out`` exists and ``ours(out)`` says this command
    did not write it (``what`` names what it writes: "a report evaluate wrote"), unless ``force``."""
    check_output_file(flag, out, example)
    if out.exists() and not force and not ours(out):
        raise ValueError(
            f"{flag} {str(out)!r} exists and is not {what}: refusing to overwrite it; valid: a new path, "
            f"{what}, or --force to replace it"
        )


def text_of(path: Path, limit: int = 1 << 20) -> str | None:
    """The start of ``path`` as text (None when it cannot be read as UTF-8): enough to recognise a
    file a command wrote without reading a large foreign one whole."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(limit)
    except (OSError, UnicodeDecodeError):
        return None
