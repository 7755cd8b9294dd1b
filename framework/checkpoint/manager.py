"""``Checkpointer``: when to save, save (sync or async), commit atomically, find and load the latest.

The protocol of one save at step N, on every rank:

1. rank 0 creates ``root/step_N.tmp/`` (removing a stale one); all ranks learn whether that worked.
2. each rank writes its RNG state, rank 0 writes ``extra.json``; the ranks agree that all did.
3. DCP writes the tensors (``dcp.save``, or ``dcp.async_save`` on a background thread or process,
   in which case ``save`` returns after the staging copy and 4-5 run on a background thread of
   each rank, on a gloo group of their own, as soon as that rank's write is done: the commit
   lands when the last rank has finished writing, not at the next ``save``).
4. every rank reports its error (or none) to all; if any rank failed, nobody commits, rank 0 warns
   with the step and the errors and removes the ``.tmp``; the previous checkpoint stays the latest.
   A full disk is named as such, with the bytes this rank needed and where.
5. the ranks hash the files in parallel (each a share), rank 0 writes ``manifest.json``, renames
   ``.tmp`` to ``step_N`` (the commit) and applies retention.

All decisions that must be identical on all ranks (save now or not, which checkpoint is the
latest, did the save succeed) are made once and broadcast on the checkpoint's control group.
Rank 0 holds ``root/LOCK`` (framework.checkpoint.lock) from construction to ``close``: a second
run on the same root is refused. A manifest must list every file a checkpoint needs
(``.metadata``, ``extra.json``, each rank's RNG file) and nothing else may lie beside them.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from framework.checkpoint import lock, state, store
from framework.checkpoint.group import Channel, dist_ready, new_gloo_group
from framework.config.schema import AsyncMode, CheckpointConfig, Integrity
from framework.record.run_dir import DirGone, DirStamp, stopped

log = logging.getLogger("framework")
_ANOTHER_RANK = "another rank failed"

_ASYNC_TYPE = {
    AsyncMode.thread: AsyncCheckpointerType.THREAD,
    AsyncMode.process: AsyncCheckpointerType.PROCESS,
}


class _OwnFolderOnly(FileSystem):
    """Makes the checkpoint's own folder and never its parents: torch's writer makes them all, so a
    save in flight when the run dir was deleted brought the run dir back (or filled a user's new
    folder at its path). Rank 0 made the ``.tmp`` before DCP starts; gone, the write fails instead."""

    def mkdir(self, path: str | os.PathLike) -> None:
        Path(path).mkdir(exist_ok=True)


class _Writer(FileSystemWriter):
    """DCP's file writer with ``_OwnFolderOnly`` (a module-level class: the process async mode pickles it)."""

    def __init__(self, path: Path, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = _OwnFolderOnly()


@dataclass
class _Pending:
    """A save whose DCP write may still be running; committed by ``Checkpointer._finish``."""

    step: int
    tmp: Path
    future: Future | None  # resolves to the agreed errors of the commit (see Checkpointer._complete)
    error: str | None
    needed_bytes: int = 0  # this rank's share of the state: the estimate a full disk is reported with
    digests: dict[str, Any] | None = None


@dataclass
class Resumed:
    """What ``Checkpointer.load_latest`` found: the checkpoint loaded (None: none usable), its
    ``extra``, and every newer one that was rejected (path, reason) and moved aside."""

    path: Path | None
    extra: dict[str, Any]
    rejected: list[tuple[str, str]]
    # A load raised part-way: model and optimizer may hold part of a checkpoint (rebuild them).
    load_failed: bool = False


def _candidates(root: Path, channel: Channel) -> list[str]:
    """Committed checkpoints under ``root``, newest first, as rank 0 lists them (collective)."""
    return channel.broadcast(
        [str(p) for _, p in reversed(store.committed(root))] if channel.rank == 0 else None
    )


def _reject(name: str, reason: str, channel: Channel, set_aside: bool) -> None:
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
    for name in _candidates(root, channel):
        reason = verify(Path(name), channel, integrity)
        if reason is None:
            return Path(name)
        _reject(name, reason, channel, set_aside)
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


class Checkpointer:
    """Saves and restores a training run; see the module docstring for the protocol.

    Construct it on every rank at the same point (it creates two gloo groups, a collective); with no
    process group initialised it works in one process. ``process_group``, when given, is the gloo
    group DCP saves on (it must span all ranks and carry no other traffic during async saves);
    by default one is created. Rank 0 takes ``root/LOCK`` for ``run_id`` (the run dir) and then
    removes stale ``.tmp``/``.del`` directories. Raises ``lock.LockHeld`` (a ValueError naming the
    owner) on every rank when another live run holds the root.
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        root: Path,
        process_group: dist.ProcessGroup | None = None,
        run_id: str = "",
    ) -> None:
        for name in ("every_steps", "every_minutes", "keep_last", "keep_every"):
            if getattr(cfg, name) < 0:
                raise ValueError(f"checkpoint.{name}={getattr(cfg, name)} is negative; use 0 to turn it off")
        self.cfg = cfg
        self.root = Path(root)
        if not dist_ready():
            # One process: DCP warns on every call that it "assumes a single process"; that is the intent.
            warnings.filterwarnings(
                "ignore", message="torch.distributed is (disabled, )?unavailable or uninit"
            )
        if process_group is not None and dist.get_world_size(process_group) != dist.get_world_size():
            raise ValueError(
                f"process_group has {dist.get_world_size(process_group)} ranks; the checkpoint group must "
                f"span all {dist.get_world_size()} ranks"
            )
        self._save_pg = process_group if process_group is not None else new_gloo_group()
        self.channel = Channel(new_gloo_group())
        # Async commits run on each rank's hashing thread: a group of their own, never the main thread's.
        asynchronous = cfg.async_mode is not AsyncMode.none
        self._commit_channel = Channel(new_gloo_group()) if asynchronous else self.channel
        self._pending: _Pending | None = None
        # One stager for the whole run: it keeps its CPU staging buffers between saves, so only the
        # first async save pays for allocating (and page-faulting) a copy of the state. Shared memory
        # lets the process checkpointer receive the staged tensors without another copy.
        self._stager: DefaultStager | None = None
        self._hasher: ThreadPoolExecutor | None = None
        if cfg.async_mode is not AsyncMode.none:
            shm = cfg.async_mode is AsyncMode.process
            self._stager = DefaultStager(StagingOptions(False, shm, False, False))
            self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-hash")
        self._last_save_s: float | None = None
        self.last_error: str | None = None  # why the last save failed (None after a success)
        self.last_blocked_s = 0.0  # how long the last save() held the training loop
        self.saves_ok = 0
        self.saves_failed = 0
        self._unreported: list[tuple[int, str]] = []  # (step, error) of failed saves, see take_failures
        self._lock: lock.Owner | None = None
        # Rank 0's stamp of the root: a save into a root deleted mid-run stops the run (DirGone)
        # instead of recreating it (framework.record.run_dir).
        self._root_stamp: DirStamp | None = None
        refused: str | None = None
        if self.channel.rank == 0:
            try:
                self._lock = lock.acquire(self.root, run_id)
                self._root_stamp = DirStamp.of("checkpoint dir", self.root)
                store.clean_stale(self.root)
            except lock.LockHeld as e:
                refused = str(e)
        refused = self.channel.broadcast(refused)
        if refused is not None:
            raise lock.LockHeld(refused)

    @property
    def control_group(self) -> dist.ProcessGroup | None:
        """The gloo group for main-thread agreements (e.g. ``PreemptionHandler``'s)."""
        return self.channel.group

    def should_save(self, step: int, now_s: float) -> bool:
        """Save after step ``step``? ``every_steps`` is evaluated locally (it is the same on all
        ranks); ``every_minutes`` is decided by rank 0's ``now_s`` and broadcast, so every rank
        saves at the same step. No collective runs when ``every_minutes`` is 0."""
        by_steps = self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0
        if self.cfg.every_minutes <= 0:
            return by_steps
        if self._last_save_s is None:
            self._last_save_s = now_s
        due = now_s - self._last_save_s >= self.cfg.every_minutes * 60.0
        decision = bool(self.channel.broadcast(by_steps or due))
        if decision:
            self._last_save_s = now_s
        return decision

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        extra: dict[str, Any],
    ) -> None:
        """Save at ``step``; with async_mode thread/process return after the staging copy.

        ``extra`` holds replicated plain values (step, tokens seen, data position, wandb id, config
        hash); it is stored as JSON and returned by ``load``. A failure is reported with a warning,
        recorded in ``last_error``, and training may go on. Raises ValueError (on every rank, before
        anything is written) when ``extra`` or the scheduler state is not plain JSON.
        """
        t0 = time.perf_counter()
        self.wait()
        sched_state = scheduler.state_dict()
        state.check_json("extra", extra)
        state.check_json("scheduler state", sched_state)
        payload, param_groups = state.tensor_state(model, optimizer)
        _require_tensors(payload)
        needed = _payload_bytes(payload)
        tmp = store.tmp_dir(self.root, step)

        err: str | None = None
        gone = self._root_stamp.gone() if self._root_stamp is not None else None
        if self.channel.rank == 0 and gone is None:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                # No parents: a root deleted since the check above must fail here, not come back
                # (rank 0 made the root when it took the lock).
                tmp.mkdir()
                (tmp / state.RNG_DIR).mkdir()
            except OSError as e:
                gone = self._root_stamp.gone() if self._root_stamp is not None else None
                err = None if gone is not None else f"rank 0: cannot create {tmp}: {e!r}"
        err, gone = self.channel.broadcast((err, gone))
        if gone is not None:  # every rank: nothing is written, the run stops
            raise DirGone(stopped(gone, f"at the save of step {step}"))
        if err is None:
            try:
                free = shutil.disk_usage(self.root).free
                if free < needed:  # refuse before writing: a partial write would fill the disk for everyone
                    err = _no_space(self.channel.rank, needed, tmp, free)
                else:
                    store.write_json(tmp / state.rng_file(self.channel.rank), state.capture_rng())
                if self.channel.rank == 0 and err is None:
                    doc = {"extra": extra, "scheduler": sched_state, "param_groups": param_groups}
                    doc |= {"step": step, "world_size": self.channel.world}
                    store.write_json(tmp / state.EXTRA_FILE, doc)
            except OSError as e:
                err = _describe(e, self.channel.rank, tmp, needed)
            # Agree before DCP starts: a rank that skipped it would leave the others' DCP collectives hanging.
            if self.channel.any(err is not None) and err is None:
                err = _ANOTHER_RANK
        pending = _Pending(step, tmp, None, err, needed)
        if err is None:
            try:
                pending.future = self._dcp_save(payload, pending)
            # CheckpointException (a BaseException) carries every failing rank's traceback, on every rank.
            except (Exception, CheckpointException) as e:  # noqa: BLE001
                pending.error = _describe(e, self.channel.rank, tmp, needed)
        if pending.future is None:
            self._report(pending, self._finish(pending, self.channel))
        else:
            self._pending = pending
        self.last_blocked_s = time.perf_counter() - t0

    def _dcp_save(self, payload: dict[str, Any], p: _Pending) -> Future | None:
        tmp = p.tmp
        writer = _Writer(tmp, sync_files=True)
        no_dist = not dist_ready()
        if self.cfg.async_mode is AsyncMode.none:
            dcp.save(payload, storage_writer=writer, process_group=self._save_pg, no_dist=no_dist)
            return None
        fut = dcp.async_save(
            payload,
            storage_writer=writer,
            process_group=self._save_pg,
            async_checkpointer_type=_ASYNC_TYPE[self.cfg.async_mode],
            async_stager=self._stager,
            no_dist=no_dist,
        )
        assert isinstance(fut, Future), f"a synchronous stager returns a Future, got {type(fut)}"
        assert self._hasher is not None
        return self._hasher.submit(self._complete, fut, p)

    def _complete(self, write: Future, p: _Pending) -> list[str]:
        """On the hashing thread, once this rank's write is done: hash its own shards (hashlib
        releases the GIL), then take part in the commit on the commit group. Returns the errors."""
        try:
            p.digests = _hash_own_shards(write, p.tmp, self.channel.rank, self.cfg.integrity)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - agreed on in _finish
            p.error = _describe(e, self.channel.rank, p.tmp, p.needed_bytes)
        return self._finish(p, self._commit_channel)

    def writing(self) -> bool:
        """True while this rank's async write, hashing or commit still runs; local, no collective."""
        return (
            self._pending is not None and self._pending.future is not None and not self._pending.future.done()
        )

    def wait(self) -> None:
        """Finish a pending async save and commit it (collective; a no-op when none is pending)."""
        pending, self._pending = self._pending, None
        if pending is not None and pending.future is not None:
            # The commit itself ran on the hashing thread; this only collects its agreed outcome.
            self._report(pending, pending.future.result())

    def _finish(self, p: _Pending, channel: Channel) -> list[str]:
        """Agree on the errors; commit when there are none, else remove the ``.tmp``. Collective on
        ``channel``; returns the agreed errors (empty: committed)."""
        # dict.fromkeys: DCP reports the same failure on every rank; name it once.
        errors = list(dict.fromkeys(e for e in channel.gather_all(p.error) if e is not None))
        if errors and any(e != _ANOTHER_RANK for e in errors):
            errors = [e for e in errors if e != _ANOTHER_RANK]
        if not errors:
            errors = self._commit(p, channel)
        if errors:
            if channel.rank == 0:
                shutil.rmtree(p.tmp, ignore_errors=True)
            channel.barrier()
        return errors

    def _root_gone(self) -> str | None:
        """Rank 0: why the root is no longer this run's (deleted during the run), else None."""
        return self._root_stamp.gone() if self._root_stamp is not None else None

    def _report(self, p: _Pending, errors: list[str]) -> None:
        """Main thread: record a save's outcome (``last_error``, counters) and warn on rank 0."""
        if not errors:
            self.last_error = None
            self.saves_ok += 1
            return
        self.saves_failed += 1
        self.last_error = "; ".join(errors)
        self._unreported.append((p.step, self.last_error))
        # A root deleted under a save in flight: the run's DirGone line says so, not this warning too.
        if self.channel.rank == 0 and self._root_gone() is None:
            log.warning(
                "checkpoint save at step %d failed, nothing committed (latest stays the previous one): %s",
                p.step,
                self.last_error,
            )

    def take_failures(self) -> list[tuple[int, str]]:
        """The (step, error) of each save that failed since the last call: an async save's outcome
        is known only after its commit, so the caller asks after ``save``, ``wait`` and ``close``."""
        out, self._unreported = self._unreported, []
        return out

    def _commit(self, p: _Pending, channel: Channel) -> list[str]:
        """Hash in parallel, then rank 0 writes the manifest, renames and prunes. Errors, agreed."""
        integrity = self.cfg.integrity
        # Shards an async save already hashed in the background; the rest is hashed here, shared out.
        done = {n: d for share in channel.gather_all(p.digests or {}) for n, d in share.items()}
        sizes = channel.broadcast(
            {n: (p.tmp / n).stat().st_size for n in store.list_files(p.tmp) if n not in done}
            if channel.rank == 0
            else None
        )
        digests: dict[str, Any] = dict(done) if channel.rank == 0 else {}
        err = None
        try:
            for name in store.share_of(sizes, channel.rank, channel.world):
                digests[name] = store.file_digest(p.tmp / name, integrity)
        except OSError as e:
            err = f"rank {channel.rank} hashing: {e!r}"
        gathered = channel.gather_all((digests, err))
        result: list[str] = []
        if channel.rank == 0:
            result = [e for _, e in gathered if e is not None]
            gone = self._root_gone()  # deleted while an async save wrote: commit nothing into it
            if gone is not None:
                result = [gone]
            if not result:
                files = {n: d for share, _ in gathered for n, d in share.items()}
                manifest = store.Manifest(p.step, channel.world, time.time(), integrity, files)
                try:
                    final = store.commit(p.tmp, manifest)
                    log.info("saved checkpoint of step %d: %s", p.step, final)
                    self._prune(p.step)
                except OSError as e:
                    result = [f"rank 0 committing: {e!r}"]
        return channel.broadcast(result)

    def _prune(self, protect: int) -> None:
        dirs = dict(store.committed(self.root))
        for step in store.retention_victims(list(dirs), self.cfg.keep_last, self.cfg.keep_every, protect):
            store.delete(dirs[step])

    def latest(self) -> Path | None:
        """The newest complete checkpoint whose manifest verifies (collective; see ``find_latest``).

        Waits for a pending async commit first; rejected checkpoints are moved to ``root/corrupt/``.
        """
        self.wait()
        return find_latest(self.root, self.channel, self.cfg.integrity, set_aside=True)

    def load_latest(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
    ) -> Resumed:
        """Load the newest checkpoint that verifies *and* loads; collective.

        A candidate that fails verification or whose load raises (a tensor shape from another
        model, an unreadable ``extra.json``, a DCP read error) is reported, moved to ``root/corrupt/``
        and the previous one is tried. The ranks agree on each outcome.
        """
        self.wait()
        out = Resumed(None, {}, [])
        for name in _candidates(self.root, self.channel):
            path = Path(name)
            reason = verify(path, self.channel, self.cfg.integrity)
            extra: dict[str, Any] = {}
            if reason is None:
                err = None
                try:
                    extra = self.load(path, model, optimizer, scheduler)
                except (Exception, CheckpointException) as e:  # noqa: BLE001 - agreed on below
                    err = f"rank {self.channel.rank}: {_one_line(e)}"
                failed = [e for e in self.channel.gather_all(err) if e is not None]
                if not failed:
                    out.path, out.extra = path, extra
                    return out
                out.load_failed = True
                reason = "it verifies but does not load: " + "; ".join(dict.fromkeys(failed))
            out.rejected.append((name, reason))
            _reject(name, reason, self.channel, set_aside=True)
        return out

    def resolve_resume(self, resume: str) -> Path | None:
        """``resolve_resume`` on this checkpointer's root, group and integrity mode."""
        return resolve_resume(resume, self.root, self.channel, self.cfg.integrity)

    def load(
        self,
        path: Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
    ) -> dict[str, Any]:
        """Restore model, optimizer, scheduler and this rank's RNG from ``path``; return ``extra``.

        Works across layouts and world sizes (DCP reshards). Expects a checkpoint that was verified
        (``latest`` / ``resolve_resume``); raises ValueError when ``extra.json`` cannot be read.
        """
        self.wait()
        doc: dict[str, Any] | str | None = None
        if self.channel.rank == 0:
            try:
                doc = state.read_extra(path)
            except ValueError as e:
                doc = str(e)
        doc = self.channel.broadcast(doc)
        if not isinstance(doc, dict):
            raise ValueError(f"cannot load checkpoint {path}: {doc}")
        payload, names = state.tensor_state(model, optimizer)
        state.load_dcp(
            payload,
            path,
            process_group=self._save_pg,
            no_dist=not dist_ready(),
        )
        state.apply_tensor_state(model, optimizer, payload, doc["param_groups"], names)
        scheduler.load_state_dict(doc["scheduler"])
        rng = path / state.rng_file(self.channel.rank)
        if rng.is_file():
            state.restore_rng(json.loads(rng.read_bytes()))
        if self.channel.rank == 0 and doc["world_size"] != self.channel.world:
            log.warning(
                "checkpoint %s was saved by %d ranks and is loaded by %d: tensors are resharded; ranks "
                "below %d restore their RNG state, others keep theirs",
                path,
                doc["world_size"],
                self.channel.world,
                min(doc["world_size"], self.channel.world),
            )
        return doc["extra"]

    def close(self) -> None:
        """Commit any pending save, free the staging buffers and release the lock. Collective."""
        self.wait()
        if self._lock is not None:
            lock.release(self.root, self._lock)
            self._lock = None
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        if self._hasher is not None:
            self._hasher.shutdown()
            self._hasher = None

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _hash_own_shards(save: Future, tmp: Path, rank: int, integrity: Integrity) -> dict[str, Any]:
    """After this rank's DCP write, hash its own shards off the training thread (hashlib releases
    the GIL), so the commit in ``wait`` only hashes the small files. DCP names a rank's shards
    ``__{rank}_{i}.distcp``; were that to change, the commit would simply hash them itself."""
    save.result()
    return {p.name: store.file_digest(p, integrity) for p in sorted(tmp.glob(f"__{rank}_*.distcp"))}


def _describe(e: BaseException, rank: int, tmp: Path, needed: int) -> str:
    """This rank's failure in one line. DCP's CheckpointException carries every failing rank's
    exception, on every rank; each rank names only its own (the others name theirs), so a full disk
    is reported by the rank that hit it with the bytes it needed."""
    if isinstance(e, CheckpointException):
        mine = e.failures.get(rank)  # failures: rank -> (exception, traceback summary)
        if mine is None:
            return _ANOTHER_RANK
        e = mine[0]
    free = _free_after_failure(e, tmp)
    if free is not None:
        return _no_space(rank, needed, tmp, free)
    return f"rank {rank}: {e!r}"


def _no_space(rank: int, needed: int, tmp: Path, free: int) -> str:
    return f"rank {rank}: no space left on device, {needed} bytes needed at {tmp} ({free} bytes free)"


def _free_after_failure(e: BaseException, tmp: Path) -> int | None:
    """The free bytes at ``tmp`` when ``e`` is a full disk, else None.

    An OSError says ENOSPC itself. torch.save's C++ writer (which DCP writes tensors with) drops the
    errno: it raises RuntimeError "[enforce fail at inline_container.cc...] unexpected pos" or "file
    write failed"; such a write error on a disk with less than 1 MiB left is a full disk.
    """
    chain: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and cur not in chain:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    try:
        free = shutil.disk_usage(tmp if tmp.exists() else tmp.parent).free
    except OSError:
        free = 0
    for x in chain:
        if isinstance(x, OSError) and x.errno == errno.ENOSPC:
            return free
        text = str(x)
        if "No space left on device" in text:
            return free
        if isinstance(x, RuntimeError) and "inline_container" in text and free < 1 << 20:
            return free
    return None


def _payload_bytes(payload: dict[str, Any]) -> int:
    """Bytes of this rank's tensors in a DCP payload (local shards of DTensors): an upper bound of
    what this rank writes (DCP writes a replicated tensor once, on one rank)."""
    total = 0
    for v in payload.values():
        if isinstance(v, dict):
            total += _payload_bytes(v)
        elif isinstance(v, torch.Tensor):
            local = v.to_local() if hasattr(v, "to_local") else v
            total += local.numel() * local.element_size()
    return total


def _one_line(e: BaseException) -> str:
    if isinstance(e, CheckpointException):
        return "; ".join(
            f"rank {r}: {str(f[0]).splitlines()[0][:300]}" for r, f in sorted(e.failures.items())
        )
    text = str(e).splitlines()[0][:300] if str(e) else ""
    return f"{type(e).__name__}: {text}"


def _require_tensors(payload: dict[str, Any], prefix: str = "") -> None:
    """The DCP payload must be tensors only: DCP would pickle anything else (see state.py)."""
    for k, v in payload.items():
        if isinstance(v, dict):
            _require_tensors(v, f"{prefix}{k}.")
        elif not isinstance(v, torch.Tensor):
            raise ValueError(
                f"state {prefix}{k} is a {type(v).__name__}; only tensors are checkpointed through DCP "
                "(put plain values in `extra`)"
            )
