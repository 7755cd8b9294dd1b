"""On-disk layout of a checkpoint root: naming, manifest, atomic commit, discovery and retention.

Layout::

    root/
      step_000120/          complete: committed by a rename, holds manifest.json
      step_000240.tmp/      being written (or left by a crash): never loaded, removed at start
      step_000060.del/      being deleted by retention: never loaded, removed at start
      corrupt/              checkpoints that failed verification or loading, moved aside (kept)
      LOCK                  the run that writes here (framework.checkpoint.lock)

Why a rename: it is atomic on POSIX file systems, so a reader sees either no ``step_000240`` or a
complete one; a crash at any point leaves the previous checkpoint as the newest complete one. The
manifest (size and sha256 of every file) catches what a rename cannot: bit rot, truncation by a
full disk after the fact, a copy that was cut short. This module is pure file-system code with no
process groups: the collective decisions live in ``framework.checkpoint.manager``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from framework.config.schema import Integrity

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
TMP_SUFFIX = ".tmp"
DEL_SUFFIX = ".del"
CORRUPT_DIR = "corrupt"
_STEP_RE = re.compile(r"^step_(\d+)$")
_HASH_CHUNK = 8 << 20  # 8 MiB reads: large enough that sha256, not syscalls, sets the speed


def step_dir(root: Path, step: int) -> Path:
    """The committed directory of ``step`` (zero-padded so names sort like steps up to 10^6)."""
    return root / f"step_{step:06d}"


def tmp_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}{TMP_SUFFIX}"


def parse_step(path: Path) -> int | None:
    """The step of a committed checkpoint directory name, or None for anything else."""
    m = _STEP_RE.match(path.name)
    return int(m.group(1)) if m else None


def committed(root: Path) -> list[tuple[int, Path]]:
    """Committed checkpoint directories (name ``step_N``, not yet verified), oldest first."""
    if not root.is_dir():
        return []
    found = [(parse_step(p), p) for p in root.iterdir() if p.is_dir()]
    return sorted((s, p) for s, p in found if s is not None)


def clean_stale(root: Path) -> list[Path]:
    """Remove ``.tmp`` (interrupted saves) and ``.del`` (interrupted deletions); return what went.

    Call on one rank only, before any save starts.
    """
    removed = []
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and p.name.startswith("step_") and p.name.endswith((TMP_SUFFIX, DEL_SUFFIX)):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def file_digest(path: Path, integrity: Integrity) -> dict[str, int | str | None]:
    """Size and (in sha256 mode) the sha256 of one file, read in large chunks."""
    size = path.stat().st_size
    if integrity is Integrity.size:
        return {"size": size, "sha256": None}
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def list_files(directory: Path) -> list[str]:
    """Every regular file under ``directory`` as a relative POSIX path, the manifest excluded."""
    out = []
    for dirpath, _, names in os.walk(directory):
        for n in names:
            rel = Path(dirpath, n).relative_to(directory).as_posix()
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def share_of(files: dict[str, int], rank: int, world: int) -> list[str]:
    """This rank's share of the files to hash: largest first, dealt round-robin, so shares balance."""
    ordered = sorted(files, key=lambda f: (-files[f], f))
    return ordered[rank::world]


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (POSIX needs the directory fsynced too)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj: object) -> None:
    """Write JSON and fsync it: a manifest or extra.json must reach the disk before the commit rename."""
    data = json.dumps(obj, indent=1, sort_keys=True, allow_nan=True).encode()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    time_s: float
    integrity: Integrity
    files: dict[str, dict[str, int | str | None]]

    def to_json(self) -> dict[str, object]:
        return {
            "format": MANIFEST_FORMAT,
            "step": self.step,
            "world_size": self.world_size,
            "time_s": self.time_s,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.time_s)),
            "integrity": self.integrity.value,
            "files": self.files,
        }


def read_manifest(directory: Path) -> bytes:
    """The raw bytes of ``directory/manifest.json``; ValueError when there is none."""
    path = directory / MANIFEST
    if not directory.is_dir():
        raise ValueError("not a directory")
    if not path.is_file():
        raise ValueError(f"no {MANIFEST} (incomplete, or not a checkpoint)")
    return path.read_bytes()


def parse_manifest(data: bytes) -> Manifest:
    """Parse a manifest; ValueError saying what is wrong with it."""
    try:
        raw = json.loads(data)
        if raw["format"] != MANIFEST_FORMAT:
            raise ValueError(f"manifest format {raw['format']!r}, expected {MANIFEST_FORMAT}")
        files = {str(k): {"size": int(v["size"]), "sha256": v["sha256"]} for k, v in raw["files"].items()}
        return Manifest(
            step=int(raw["step"]),
            world_size=int(raw["world_size"]),
            time_s=float(raw["time_s"]),
            integrity=Integrity(raw["integrity"]),
            files=files,
        )
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"unreadable {MANIFEST}: {e!r}") from e


def check_files(directory: Path, manifest: Manifest, names: list[str], integrity: Integrity) -> list[str]:
    """Problems with ``names`` (a share of the manifest's files): missing, wrong size, wrong sha256.

    ``integrity`` is what the reader asks for; a manifest written in size mode can only be checked
    for sizes. Sizes are compared first, so a truncated file is caught without reading it.
    """
    problems = []
    for name in names:
        want = manifest.files[name]
        path = directory / name
        if not path.is_file():
            problems.append(f"{name}: missing")
            continue
        size = path.stat().st_size
        if size != want["size"]:
            problems.append(f"{name}: size {size} != {want['size']} in manifest")
            continue
        if integrity is Integrity.sha256 and want["sha256"] is not None:
            got = file_digest(path, Integrity.sha256)["sha256"]
            if got != want["sha256"]:
                problems.append(f"{name}: sha256 {str(got)[:12]}... != {str(want['sha256'])[:12]}...")
    return problems


def commit(tmp: Path, manifest: Manifest) -> Path:
    """Write the manifest into ``tmp`` and rename it to its committed name; return that name.

    A committed directory of the same step (a re-save after resuming from an older checkpoint) is
    moved aside first and deleted after the rename, so there is no moment without a complete one.
    """
    final = step_dir(tmp.parent, manifest.step)
    write_json(tmp / MANIFEST, manifest.to_json())
    fsync_dir(tmp)
    old = None
    if final.exists():
        old = final.with_name(final.name + DEL_SUFFIX)
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    fsync_dir(tmp.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def retention_victims(steps: list[int], keep_last: int, keep_every: int, protect: int) -> list[int]:
    """Steps to delete: all but the newest ``keep_last`` (0 keeps all), multiples of ``keep_every``
    (milestones, kept forever) and ``protect`` (the checkpoint just committed, known complete).

    Pure, so the policy is tested without files.
    """
    if keep_last <= 0 or not steps:
        return []
    ordered = sorted(steps)
    keep = set(ordered[-keep_last:]) | {protect}
    if keep_every > 0:
        keep |= {s for s in ordered if s % keep_every == 0}
    return [s for s in ordered if s not in keep]


def delete(directory: Path) -> None:
    """Delete a committed checkpoint: rename to ``.del`` first (atomic), so a crash mid-delete
    never leaves a half-deleted ``step_N`` that discovery would have to hash to reject."""
    doomed = directory.with_name(directory.name + DEL_SUFFIX)
    directory.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def set_aside(directory: Path, reason: str) -> Path:
    """Move a checkpoint that failed verification or loading to ``root/corrupt/`` and return its
    new path. Never deleted, never overwritten: the name gets a UTC time stamp (and a counter when
    that exists too), and ``<name>.why`` next to it says why. Call on one rank only."""
    aside = directory.parent / CORRUPT_DIR
    aside.mkdir(exist_ok=True)
    base = f"{directory.name}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    target, n = aside / base, 1
    while target.exists() or target.with_name(target.name + ".why").exists():
        target, n = aside / f"{base}-{n}", n + 1
    directory.rename(target)
    target.with_name(target.name + ".why").write_text(reason + "\n")
    fsync_dir(directory.parent)
    return target


def _marker(directory: Path) -> str | None:
    """What makes ``directory`` a checkpoint root or a step dir (None: neither): its files say so."""
    if directory.name.startswith("step_") and (
        parse_step(directory) is not None or directory.name.endswith((TMP_SUFFIX, DEL_SUFFIX))
    ):
        return f"it is a checkpoint step dir ({directory.name})"
    if (directory / MANIFEST).is_file():
        return f"it is a checkpoint step dir (it holds {MANIFEST})"
    if (directory / "LOCK").is_file():
        return "it is a checkpoint root (it holds LOCK)"
    try:
        held = [p.name for _, p in committed(directory) if (p / MANIFEST).is_file()]
    except OSError:
        return None
    return f"it is a checkpoint root (it holds {held[0]})" if held else None


def enclosing_checkpoint(root: Path) -> tuple[Path, str] | None:
    """The checkpoint root or step dir that ``root`` lies inside (strictly), with why it is one.

    Why: a root inside another run's tree is destroyed with it (that run's retention deletes its
    step dirs, ``set_aside`` moves them), and its own files land in that run's checkpoints.
    """
    path = Path(root).expanduser().resolve()
    if (path / MANIFEST).is_file() or parse_step(path) is not None:
        return path, f"it is a checkpoint step dir ({path.name})"
    for parent in path.parents:
        if parent.is_dir():
            why = _marker(parent)
            if why is not None:
                return parent, why
    return None
