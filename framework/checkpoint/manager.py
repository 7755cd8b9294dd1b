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
run on the same root is refused. Which checkpoint to load, and whether it is intact:
framework.checkpoint.resolve.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from framework.checkpoint import lock, state, store
from framework.checkpoint.group import Channel, dist_ready, new_gloo_group
from framework.checkpoint.resolve import (
    Resumed,
    candidates,
    find_latest,
    read_extra,
    reject,
    resolve_resume,
    verify,
)
from framework.checkpoint.save_io import (
    ANOTHER_RANK,
    ASYNC_TYPE,
    PendingSave,
    Writer,
    describe_failure,
    hash_own_shards,
    no_space,
    one_line,
    payload_bytes,
    require_tensors,
)
from framework.config.schema import AsyncMode, CheckpointConfig
from framework.record.run_dir import DirGone, DirStamp, stopped

log = logging.getLogger("framework")


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
        self._pending: PendingSave | None = None
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
        require_tensors(payload)
        needed = payload_bytes(payload)
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
                    err = no_space(self.channel.rank, needed, tmp, free)
                else:
                    store.write_json(tmp / state.rng_file(self.channel.rank), state.capture_rng())
                if self.channel.rank == 0 and err is None:
                    doc = {"extra": extra, "scheduler": sched_state, "param_groups": param_groups}
                    doc |= {"step": step, "world_size": self.channel.world}
                    store.write_json(tmp / state.EXTRA_FILE, doc)
            except OSError as e:
                err = describe_failure(e, self.channel.rank, tmp, needed)
            # Agree before DCP starts: a rank that skipped it would leave the others' DCP collectives hanging.
            if self.channel.any(err is not None) and err is None:
                err = ANOTHER_RANK
        pending = PendingSave(step, tmp, None, err, needed)
        if err is None:
            try:
                pending.future = self._dcp_save(payload, pending)
            # CheckpointException (a BaseException) carries every failing rank's traceback, on every rank.
            except (Exception, CheckpointException) as e:  # noqa: BLE001
                pending.error = describe_failure(e, self.channel.rank, tmp, needed)
        if pending.future is None:
            self._report(pending, self._finish(pending, self.channel))
        else:
            self._pending = pending
        self.last_blocked_s = time.perf_counter() - t0

    def _dcp_save(self, payload: dict[str, Any], p: PendingSave) -> Future | None:
        tmp = p.tmp
        writer = Writer(tmp, sync_files=True)
        no_dist = not dist_ready()
        if self.cfg.async_mode is AsyncMode.none:
            dcp.save(payload, storage_writer=writer, process_group=self._save_pg, no_dist=no_dist)
            return None
        fut = dcp.async_save(
            payload,
            storage_writer=writer,
            process_group=self._save_pg,
            async_checkpointer_type=ASYNC_TYPE[self.cfg.async_mode],
            async_stager=self._stager,
            no_dist=no_dist,
        )
        assert isinstance(fut, Future), f"a synchronous stager returns a Future, got {type(fut)}"
        assert self._hasher is not None
        return self._hasher.submit(self._complete, fut, p)

    def _complete(self, write: Future, p: PendingSave) -> list[str]:
        """On the hashing thread, once this rank's write is done: hash its own shards (hashlib
        releases the GIL), then take part in the commit on the commit group. Returns the errors."""
        try:
            p.digests = hash_own_shards(write, p.tmp, self.channel.rank, self.cfg.integrity)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - agreed on in _finish
            p.error = describe_failure(e, self.channel.rank, p.tmp, p.needed_bytes)
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

    def _finish(self, p: PendingSave, channel: Channel) -> list[str]:
        """Agree on the errors; commit when there are none, else remove the ``.tmp``. Collective on
        ``channel``; returns the agreed errors (empty: committed)."""
        # dict.fromkeys: DCP reports the same failure on every rank; name it once.
        errors = list(dict.fromkeys(e for e in channel.gather_all(p.error) if e is not None))
        if errors and any(e != ANOTHER_RANK for e in errors):
            errors = [e for e in errors if e != ANOTHER_RANK]
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

    def _report(self, p: PendingSave, errors: list[str]) -> None:
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

    def _commit(self, p: PendingSave, channel: Channel) -> list[str]:
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
        for name in candidates(self.root, self.channel):
            path = Path(name)
            reason = verify(path, self.channel, self.cfg.integrity)
            extra: dict[str, Any] = {}
            if reason is None:
                err = None
                try:
                    extra = self.load(path, model, optimizer, scheduler)
                except (Exception, CheckpointException) as e:  # noqa: BLE001 - agreed on below
                    err = f"rank {self.channel.rank}: {one_line(e)}"
                failed = [e for e in self.channel.gather_all(err) if e is not None]
                if not failed:
                    out.path, out.extra = path, extra
                    return out
                out.load_failed = True
                reason = "it verifies but does not load: " + "; ".join(dict.fromkeys(failed))
            out.rejected.append((name, reason))
            reject(name, reason, self.channel, set_aside=True)
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
        doc = read_extra(path, self.channel)
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
