"""Run a function on N real gloo ranks (forked processes, FileStore) and collect the results.

Forking is ~50x faster than spawning N fresh interpreters that each import torch; the FileStore
needs no free port. Workers end with ``os._exit`` after a barrier: gloo's teardown races at
interpreter exit otherwise (see shared notes).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

# The parts of the runs trained by ``train_rank``, kept until the rank's os._exit (see there).
_PARTS: list[object] = []


def _entry(
    rank: int, world: int, store_path: str, fn: Callable[..., Any], args: tuple, q: Any, port: int | None
) -> None:
    torch.set_num_threads(1)
    code = 0
    try:
        if port is None:
            store = dist.FileStore(store_path, world)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        else:  # the code under test makes the group itself, as a launched rank does (env://)
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        out = fn(rank, world, *args)
        q.put((rank, _to_wire(out), None))
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        q.put((rank, None, traceback.format_exc()))
        code = 1
    finally:
        # Flush the queue's feeder thread before os._exit, or the result/traceback is lost.
        q.close()
        q.join_thread()
        os._exit(code)


class _Tensor:
    """A tensor sent by value: through a multiprocessing queue torch shares a tensor's storage by a
    file descriptor that the parent fetches from the rank, and a rank that already ended with
    ``os._exit`` then loses its result ("Connection reset by peer")."""

    def __init__(self, t: torch.Tensor) -> None:
        t = t.detach().cpu().contiguous()
        self.dtype, self.shape = t.dtype, tuple(t.shape)
        self.data = t.reshape(-1).view(torch.uint8).numpy().tobytes()

    def tensor(self) -> torch.Tensor:
        raw = (
            torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
            if self.data
            else torch.empty(0, dtype=torch.uint8)
        )
        return raw.view(self.dtype).reshape(self.shape)


def _to_wire(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return _Tensor(obj)
    if isinstance(obj, dict):
        return {k: _to_wire(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_to_wire(v) for v in obj)
    return obj


def _from_wire(obj: Any) -> Any:
    if isinstance(obj, _Tensor):
        return obj.tensor()
    if isinstance(obj, dict):
        return {k: _from_wire(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_from_wire(v) for v in obj)
    return obj


def run_ranks(
    fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 120.0, init: bool = True
) -> list[Any]:
    """Call ``fn(rank, world, *args)`` on ``world`` gloo ranks; return the per-rank results in order.

    ``init=False``: no process group is made for ``fn``; the launcher's variables (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT) are set instead, so that ``fn`` makes (and ends) its own.
    Raises RuntimeError with the first failing rank's traceback, or on timeout (workers killed).
    """
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    port = None if init else _free_port()
    with tempfile.TemporaryDirectory() as d:
        store_path = os.path.join(d, "store")
        procs = [
            ctx.Process(target=_entry, args=(r, world, store_path, fn, args, q, port)) for r in range(world)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        try:
            for _ in range(world):
                rank, out, err = q.get(timeout=timeout_s)
                if err is not None:
                    errors[rank] = err
                    break
                results[rank] = _from_wire(out)
        except Exception as e:  # queue.Empty on timeout
            errors[-1] = f"timed out after {timeout_s}s waiting for ranks: {e!r}"
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.5)
                if p.is_alive():
                    p.kill()
                    p.join()
        if errors:
            rank, err = next(iter(errors.items()))
            raise RuntimeError(f"rank {rank} failed:\n{err}")
        return [results[r] for r in range(world)]


def train_rank(rank: int, world: int, run_dir: str) -> None:
    """A rank as ``framework.launch.worker`` runs it (the run dir's ``config.yaml`` and ``plan.json``,
    then ``trainer.run``), minus the interpreter start: ``run_ranks`` made the process group.

    The run's parts are kept, as the worker keeps them: freeing them (DDP reducer, gloo groups)
    after another rank had exited was seen to block a rank in a C++ destructor."""
    from framework.launch.worker import load_run
    from framework.train import trainer

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    cfg, plan = load_run(Path(run_dir))
    trainer.run(cfg, plan, Path(run_dir), keep=_PARTS)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_on_forked_ranks(run_dir: Path, world: int, *overrides: str, timeout_s: float = 300.0) -> None:
    """What ``python train.py hydra.run.dir=RUN_DIR mesh=WORLD *overrides`` trains, on ``world`` ranks
    forked from this process: the run dir's config.yaml and plan.json as train.py writes them
    (``tests.entry.write_run_config``), then each rank as a launched one runs (``train_rank``). For
    tests whose claim is the training, not the launch: no launcher, no ``world`` interpreters
    importing torch (3-4 s of CPU each)."""
    from tests.entry import write_run_config

    write_run_config(run_dir, *overrides)
    run_ranks(train_rank, world, str(run_dir), timeout_s=timeout_s)
