"""``Checkpointer``: when to save, save (sync or async), commit atomically, find and load the latest.

The protocol of one save at step N, on every rank:

1. rank 0 creates ``root/step_N.tmp/`` (removing a stale one); all ranks learn whether that worked.
2. each rank writes its RNG state, rank 0 writes ``extra.json``; the ranks agree that all did.
3. DCP writes the tensors (``dcp.save``, or ``dcp.async_save`` on a background thread or process,
   in which case ``save`` returns after the staging copy and 4-5 run in the next ``wait``/``save``).
4. every rank reports its error (or none) to all; if any rank failed, nobody commits, rank 0 warns
   with the step and the errors and removes the ``.tmp``; the previous checkpoint stays the latest.
5. the ranks hash the files in parallel (each a share), rank 0 writes ``manifest.json``, renames
   ``.tmp`` to ``step_N`` (the commit) and applies retention.

All decisions that must be identical on all ranks (save now or not, which checkpoint is the
latest, did the save succeed) are made once and broadcast on the checkpoint's control group.
"""

from __future__ import annotations

import json
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
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from framework.checkpoint import state, store
from framework.checkpoint.group import Channel, dist_ready, new_gloo_group
from framework.config import AsyncMode, CheckpointConfig, Integrity

_ASYNC_TYPE = {
    AsyncMode.thread: AsyncCheckpointerType.THREAD,
    AsyncMode.process: AsyncCheckpointerType.PROCESS,
}


@dataclass
class _Pending:
    """A save whose DCP write may still be running; committed by ``Checkpointer._finish``."""

    step: int
    tmp: Path
    future: Future | None  # resolves to this rank's own shard digests (see _hash_own_shards)
    error: str | None
    digests: dict[str, Any] | None = None


def find_latest(root: Path, channel: Channel, integrity: Integrity) -> Path | None:
    """The newest committed checkpoint under ``root`` whose manifest verifies, agreed by all ranks.

    Rank 0 lists the candidates; for each, newest first, all ranks check a share of its files and
    share their findings. Each rejected candidate is reported (a warning on rank 0, with the path and
    the reason) and the previous one is tried.
    """
    names = channel.broadcast(
        [str(p) for _, p in reversed(store.committed(root))] if channel.rank == 0 else None
    )
    for name in names:
        reason = verify(Path(name), channel, integrity)
        if reason is None:
            return Path(name)
        if channel.rank == 0:
            warnings.warn(f"skipping checkpoint {name}: {reason}", stacklevel=3)
    return None


def verify(path: Path, channel: Channel, integrity: Integrity) -> str | None:
    """Why ``path`` is not a complete, intact checkpoint (None when it is); the same on all ranks."""
    raw: bytes | str | None = None
    if channel.rank == 0:
        try:
            raw = store.read_manifest(path)
        except (ValueError, OSError) as e:
            raw = str(e)
    raw = channel.broadcast(raw)
    if isinstance(raw, str):
        return raw
    try:
        manifest = store.parse_manifest(raw)
    except ValueError as e:
        return str(e)
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
    by default one is created. Stale ``.tmp``/``.del`` directories are removed here, by rank 0.
    """

    def __init__(
        self, cfg: CheckpointConfig, root: Path, process_group: dist.ProcessGroup | None = None
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
        if self.channel.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            store.clean_stale(self.root)
        self.channel.barrier()

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
        tmp = store.tmp_dir(self.root, step)

        err: str | None = None
        if self.channel.rank == 0:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                (tmp / state.RNG_DIR).mkdir(parents=True)
            except OSError as e:
                err = f"rank 0: cannot create {tmp}: {e!r}"
        err = self.channel.broadcast(err)
        if err is None:
            try:
                store.write_json(tmp / state.rng_file(self.channel.rank), state.capture_rng())
                if self.channel.rank == 0:
                    doc = {"extra": extra, "scheduler": sched_state, "param_groups": param_groups}
                    doc |= {"step": step, "world_size": self.channel.world}
                    store.write_json(tmp / state.EXTRA_FILE, doc)
            except OSError as e:
                err = f"rank {self.channel.rank}: {e!r}"
            # Agree before DCP starts: a rank that skipped it would leave the others' DCP collectives hanging.
            if self.channel.any(err is not None) and err is None:
                err = "another rank failed before the tensors were written"
        future = None
        if err is None:
            try:
                future = self._dcp_save(payload, tmp)
            # CheckpointException (a BaseException) carries every failing rank's traceback, on every rank.
            except (Exception, CheckpointException) as e:  # noqa: BLE001
                err = _describe(e, self.channel.rank)
        pending = _Pending(step, tmp, future, err)
        if future is None:
            self._finish(pending)
        else:
            self._pending = pending
        self.last_blocked_s = time.perf_counter() - t0

    def _dcp_save(self, payload: dict[str, Any], tmp: Path) -> Future | None:
        writer = FileSystemWriter(tmp, sync_files=True)
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
        return self._hasher.submit(_hash_own_shards, fut, tmp, self.channel.rank, self.cfg.integrity)

    def writing(self) -> bool:
        """True while this rank's async write (and shard hashing) still runs; local, no collective."""
        return (
            self._pending is not None and self._pending.future is not None and not self._pending.future.done()
        )

    def wait(self) -> None:
        """Finish a pending async save and commit it (collective; a no-op when none is pending)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            if pending.future is not None and pending.error is None:
                try:
                    pending.digests = pending.future.result()
                except (Exception, CheckpointException) as e:  # noqa: BLE001 - agreed on in _finish
                    pending.error = _describe(e, self.channel.rank)
            self._finish(pending)

    def _finish(self, p: _Pending) -> None:
        # dict.fromkeys: DCP reports the same failure on every rank; name it once.
        errors = list(dict.fromkeys(e for e in self.channel.gather_all(p.error) if e is not None))
        if not errors:
            errors = self._commit(p)
        if errors:
            self.last_error = "; ".join(errors)
            if self.channel.rank == 0:
                shutil.rmtree(p.tmp, ignore_errors=True)
                warnings.warn(
                    f"checkpoint save at step {p.step} failed, nothing committed "
                    f"(latest stays the previous one): {self.last_error}",
                    stacklevel=3,
                )
            self.channel.barrier()
        else:
            self.last_error = None

    def _commit(self, p: _Pending) -> list[str]:
        """Hash in parallel, then rank 0 writes the manifest, renames and prunes. Errors, agreed."""
        integrity = self.cfg.integrity
        # Shards an async save already hashed in the background; the rest is hashed here, shared out.
        done = {n: d for share in self.channel.gather_all(p.digests or {}) for n, d in share.items()}
        sizes = self.channel.broadcast(
            {n: (p.tmp / n).stat().st_size for n in store.list_files(p.tmp) if n not in done}
            if self.channel.rank == 0
            else None
        )
        digests: dict[str, Any] = dict(done) if self.channel.rank == 0 else {}
        err = None
        try:
            for name in store.share_of(sizes, self.channel.rank, self.channel.world):
                digests[name] = store.file_digest(p.tmp / name, integrity)
        except OSError as e:
            err = f"rank {self.channel.rank} hashing: {e!r}"
        gathered = self.channel.gather_all((digests, err))
        result: list[str] = []
        if self.channel.rank == 0:
            result = [e for _, e in gathered if e is not None]
            if not result:
                files = {n: d for share, _ in gathered for n, d in share.items()}
                manifest = store.Manifest(p.step, self.channel.world, time.time(), integrity, files)
                try:
                    store.commit(p.tmp, manifest)
                    self._prune(p.step)
                except OSError as e:
                    result = [f"rank 0 committing: {e!r}"]
        return self.channel.broadcast(result)

    def _prune(self, protect: int) -> None:
        dirs = dict(store.committed(self.root))
        for step in store.retention_victims(list(dirs), self.cfg.keep_last, self.cfg.keep_every, protect):
            store.delete(dirs[step])

    def latest(self) -> Path | None:
        """The newest complete checkpoint whose manifest verifies (collective; see ``find_latest``)."""
        return find_latest(self.root, self.channel, self.cfg.integrity)

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
                doc = json.loads((path / state.EXTRA_FILE).read_bytes())
            except (OSError, ValueError) as e:
                doc = f"{path / state.EXTRA_FILE}: {e!r}"
        doc = self.channel.broadcast(doc)
        if not isinstance(doc, dict):
            raise ValueError(f"cannot load checkpoint {path}: {doc}")
        payload, _ = state.tensor_state(model, optimizer)
        dcp.load(
            payload,
            storage_reader=state.SafeReader(path),
            process_group=self._save_pg,
            no_dist=not dist_ready(),
        )
        state.apply_tensor_state(model, optimizer, payload, doc["param_groups"])
        scheduler.load_state_dict(doc["scheduler"])
        rng = path / state.rng_file(self.channel.rank)
        if rng.is_file():
            state.restore_rng(json.loads(rng.read_bytes()))
        if self.channel.rank == 0 and doc["world_size"] != self.channel.world:
            warnings.warn(
                f"checkpoint {path} was saved by {doc['world_size']} ranks and is loaded by "
                f"{self.channel.world}: tensors are resharded; ranks below "
                f"{min(doc['world_size'], self.channel.world)} restore their RNG state, others keep theirs",
                stacklevel=2,
            )
        return doc["extra"]

    def close(self) -> None:
        """Commit any pending save and free the staging buffers. Collective."""
        self.wait()
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


def _describe(e: BaseException, rank: int) -> str:
    """One line per failing rank: DCP's CheckpointException names them all (with tracebacks)."""
    if isinstance(e, CheckpointException):
        # failures: rank -> (exception, traceback summary)
        return "; ".join(f"rank {r}: {f[0]!r}" for r, f in sorted(e.failures.items()))
    return f"rank {rank}: {e!r}"


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
