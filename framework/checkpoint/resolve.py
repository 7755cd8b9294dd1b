"""Which checkpoint to load, verified: the latest committed one whose manifest checks out, agreed
by all ranks, or the one the user named (``checkpoint.resume``, a step dir given on the command line).

A manifest must list every file a checkpoint needs (``.metadata``, ``extra.json``, each rank's RNG
file) and nothing else may lie beside them; the ranks check a share of the files each and agree on
the finding. A rejected checkpoint is reported and, found rather than named, moved to
``root/corrupt/`` so that a later save or retention never deletes it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from framework.checkpoint import state, store
from framework.checkpoint.group import Channel
from framework.config.schema import Integrity

log = logging.getLogger("framework")


@dataclass
class Resumed:
    """What ``Checkpointer.load_latest`` found: the checkpoint loaded (None: none usable), its
    ``extra``, and every newer one that was rejected (path, reason) and moved aside."""

    path: Path | None
    extra: dict[str, Any]
    rejected: list[tuple[str, str]]
    # A load raised part-way: model and optimizer may hold part of a checkpoint (rebuild them).
    load_failed: bool = False


def candidates(root: Path, channel: Channel) -> list[str]:
    """Committed checkpoints under ``root``, newest first, as rank 0 lists them (collective)."""
    return channel.broadcast(
        [str(p) for _, p in reversed(store.committed(root))] if channel.rank == 0 else None
    )


def reject(name: str, reason: str, channel: Channel, set_aside: bool) -> None:
    """Report a rejected checkpoint on rank 0; with ``set_aside`` move it to ``root/corrupt/``, so
    a later save of the same step or retention can never delete it."""
    if channel.rank != 0:
        return
    where = ""
    if set_aside:
        try:
            where = f"; moved to {store.set_aside(Path(name), reason)}"
        except OSError as e:
            where = f"; could not move it aside ({e!r}), left in place"
    # A log line (console and train.log), not a Python warning: that printed the caller's source line
    # ``resumed = ckpt.resume(...)`` as the last line on stderr, under the run's RESUME FAILED.
    log.warning("skipping checkpoint %s: %s%s", name, reason, where)


def find_latest(root: Path, channel: Channel, integrity: Integrity, set_aside: bool = False) -> Path | None:
    """The newest committed checkpoint under ``root`` whose manifest verifies, agreed by all ranks.

    Rank 0 lists the candidates; for each, newest first, all ranks check a share of its files and
    share their findings. Each rejected candidate is reported (a warning on rank 0, with the path and
    the reason; with ``set_aside`` it is moved to ``root/corrupt/``) and the previous one is tried.
    """
    for name in candidates(root, channel):
        reason = verify(Path(name), channel, integrity)
        if reason is None:
            return Path(name)
        reject(name, reason, channel, set_aside)
    return None


def _required_files(world_size: int) -> list[str]:
    """What every checkpoint holds besides the tensor shards: DCP's index, the plain state, RNGs."""
    return [".metadata", state.EXTRA_FILE, *(state.rng_file(r) for r in range(world_size))]


def verify(path: Path, channel: Channel, integrity: Integrity) -> str | None:
    """Why ``path`` is not a complete, intact checkpoint (None when it is); the same on all ranks."""
    raw: bytes | str | None = None
    if channel.rank == 0:
        try:
            raw = store.read_manifest(path)
            raw = _coverage(path, store.parse_manifest(raw)) or raw
        except (ValueError, OSError) as e:
            raw = str(e)
    raw = channel.broadcast(raw)
    if isinstance(raw, str):
        return raw
    manifest = store.parse_manifest(raw)
    if store.parse_step(path) not in (None, manifest.step):
        return f"manifest says step {manifest.step}, the directory name says otherwise"
    sizes = {n: int(f["size"]) for n, f in manifest.files.items()}
    try:
        mine = store.check_files(
            path, manifest, store.share_of(sizes, channel.rank, channel.world), integrity
        )
    except OSError as e:
        mine = [f"rank {channel.rank} could not read it: {e!r}"]
    problems = [p for share in channel.gather_all(mine) for p in share]
    if not problems:
        return None
    more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
    return "; ".join(problems[:3]) + more


def check_step_dir(path: Path, key: str) -> Path:
    """``path``, a step dir the user named (resume PATH, init_from, generate, export-hf), or one
    ValueError naming ``key`` and why it cannot be read: it fails its manifest (a damaged file
    loaded in silence when the step dir was named rather than found), its metadata is refused
    (state.read_metadata) or its extra.json is malformed (state.read_extra)."""
    reason = verify(path, Channel(None), Integrity.sha256)
    if reason is None:
        try:
            state.read_metadata(path)
            state.read_extra(path)
        except (ValueError, OSError) as e:
            reason = str(e)
    if reason is not None:
        raise ValueError(f"{key}={str(path)!r} is not a usable checkpoint: {reason}")
    return path


def _coverage(path: Path, manifest: store.Manifest) -> str | None:
    """Does the manifest cover the whole checkpoint? A missing required file, a manifest without
    shards, or a file on disk that the manifest does not list (another writer's) is a reason."""
    missing = [n for n in _required_files(manifest.world_size) if n not in manifest.files]
    if missing:
        return f"the manifest does not list {', '.join(missing[:3])} (incomplete checkpoint)"
    if not any(n.endswith(".distcp") for n in manifest.files):
        return "the manifest lists no tensor shards (*.distcp)"
    unlisted = sorted(set(store.list_files(path)) - set(manifest.files))
    if unlisted:
        return f"files not in the manifest: {', '.join(unlisted[:3])} (written after the commit, or by another run)"
    return None


def resolve_resume(
    resume: str, root: Path, channel: Channel | None = None, integrity: Integrity = Integrity.sha256
) -> Path | None:
    """What to resume from: ``"none"`` -> None, ``"auto"`` -> the latest verified checkpoint under
    ``root`` (None when there is none), anything else -> that checkpoint directory, verified.

    Collective when ``channel`` spans several ranks. Raises ValueError naming an explicit path
    that is not a complete, intact checkpoint, and why.
    """
    channel = channel or Channel(None)
    if resume == "none":
        return None
    if resume == "auto":
        return find_latest(root, channel, integrity)
    path = Path(resume)
    reason = verify(path, channel, integrity)
    if reason is not None:
        raise ValueError(
            f"checkpoint.resume={resume!r} is not a usable checkpoint: {reason}. "
            "Valid values: 'auto', 'none', or the path of a step_N directory holding manifest.json"
        )
    return path


def read_extra(path: Path, channel: Channel) -> dict[str, Any]:
    """``path``'s extra.json as rank 0 reads it, on every rank (collective); ValueError on every
    rank when it cannot be read."""
    doc: dict[str, Any] | str | None = None
    if channel.rank == 0:
        try:
            doc = state.read_extra(path)
        except ValueError as e:
            doc = str(e)
    doc = channel.broadcast(doc)
    if not isinstance(doc, dict):
        raise ValueError(f"cannot load checkpoint {path}: {doc}")
    return doc
