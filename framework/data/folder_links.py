"""Symlinks inside a downloaded model folder (Hugging Face weights, a tokenizer folder).

The rule: a file of the folder may be a link only into the folder itself or, for a snapshot of the
Hugging Face hub cache, into that cache repo's ``blobs/`` (the hub writes
``models--ORG--NAME/snapshots/REV/x -> ../../blobs/HASH``). A link anywhere else would read whatever
file the folder's author chose (a key, another model's weights) and is refused in one line.
"""

from __future__ import annotations

from pathlib import Path


def link_roots(folder: Path) -> list[Path]:
    """Where the files of ``folder`` may really live: the folder itself, and, for a snapshot of the
    Hugging Face hub cache (``models--ORG--NAME/snapshots/REV``, whose files are links
    ``../../blobs/HASH``), that cache repo's ``blobs/``. Nowhere else: a link elsewhere would read
    whatever file the folder's author chose (a key, another model)."""
    real = folder.resolve()
    roots = [real]
    if real.parent.name == "snapshots":
        roots.append(real.parent.parent / "blobs")
    return roots


def check_inside(folder: Path, name: str, where: str) -> None:
    """Refuse ``folder/name`` when it is a symlink (or under one) whose target lies outside
    ``link_roots(folder)``, or a symlink loop. One line naming the file, its target and what is valid."""
    p = folder / name
    if not p.is_symlink() and p.parent.resolve() == folder.resolve():
        return
    try:
        target = p.resolve(strict=True)
    except (OSError, RuntimeError) as e:  # a loop, or a dangling link
        raise ValueError(f"{where}: {name} is a symlink that does not lead to a file ({e})") from None
    roots = link_roots(folder)
    if not any(target.is_relative_to(r) for r in roots):
        raise ValueError(
            f"{where}: {name} is a symlink to {str(target)!r}, outside the folder; valid: files in the "
            f"folder, or links into {str(roots[-1])!r}"
            + (" (the same Hugging Face cache repo)" if len(roots) > 1 else " itself")
        )
