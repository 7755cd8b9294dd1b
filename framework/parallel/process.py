"""This process as one rank: its device, the default process group (gloo, or NCCL with gloo beside it
on CUDA) for the length of a block, and the end of a worker without gloo's exit race.

Below the trainer, which runs in a group; the launcher (framework.launch.ranks) starts the processes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from lightning_utilities.core.rank_zero import rank_zero_only

from framework.config.schema import Device


def resolve_device(device: Device) -> torch.device:
    if device is Device.auto:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device is Device.cuda and not torch.cuda.is_available():
        raise ValueError("run.device=cuda but no CUDA device is visible; use run.device=cpu or auto")
    return torch.device(device.value)


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(device: torch.device, timeout_s: float) -> DistEnv:
    """Create the default process group; world 1 when nothing launched us.

    On CUDA the group has two backends, NCCL for CUDA tensors and gloo for CPU ones, so that the
    small CPU collectives (verification's cross-rank max, object gathers) work next to NCCL; a
    NCCL-only group refuses them ("No backend type associated with device type cpu").
    """
    if not dist.is_initialized() and "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
    if dist.is_initialized():  # a group made by the caller (a test's forked ranks): its ranks rule
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rank_zero_only.rank = rank  # lightning-utilities' rank-zero helpers (``@rank_zero_only``) read it
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return DistEnv(rank, world, local_rank, device)


LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def process_group(device: torch.device, timeout_s: float) -> Iterator[DistEnv]:
    """``init_distributed`` for the length of a ``with`` block.

    A group this call created is destroyed at the end: after a barrier when the block ended normally
    (gloo's exit race, see ``finish``), without one after an exception (the other ranks may never
    reach it; destroying the group ends their pending collectives with an error instead of a hang).
    The launcher variables it set are removed again. A group that existed before (a test's forked
    ranks) is the caller's and is left alone.
    """
    created = not dist.is_initialized()
    unset = [k for k in LAUNCH_VARS if k not in os.environ]
    env = init_distributed(device, timeout_s)
    ended = False
    try:
        yield env
        ended = True
    finally:
        try:
            if created and dist.is_initialized():
                if ended:
                    dist.barrier()
                dist.destroy_process_group()
        finally:
            for key in unset:
                os.environ.pop(key, None)


# The parts of a run on a rank that ends with ``finish`` (its ``os._exit``): trainer.run's ``keep``.
# Never freed, because freeing them can deadlock (torch 2.13, about 1 in 5 four-rank CPU runs; stacks
# from py-spy --native): the process group is destroyed first, so the DDP Reducer holds the last
# reference to the gloo group; its pybind dealloc keeps the GIL while ~ProcessGroupGloo joins the
# group's worker thread, and that thread, freeing a finished barrier's work, waits for the GIL to
# decref its tensors. The class of bug is pytorch/pytorch#56297 (blocking destructors under the GIL).
KEPT_PARTS: list[object] = []


def finish(code: int, barrier: bool | None = None) -> None:
    """End a worker without gloo's exit race: barrier, destroy, flush, ``os._exit``.

    ``barrier`` defaults to ``code == 0`` (a failed rank may not reach it); rank 0 of a run that
    ended but must report failure passes True, since the other ranks wait for it there."""
    try:
        if dist.is_initialized():
            if code == 0 if barrier is None else barrier:
                dist.barrier()
            dist.destroy_process_group()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's or taskset's share), not
    the host's count that ``os.cpu_count`` gives."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def task_threads(local_tasks: int, cpus_per_task: str | None = None) -> int:
    """Intra-op threads for one of ``local_tasks`` ranks on this host: SLURM's ``--cpus-per-task``
    when it is set, else an equal share of the available cores less one core left to the rest of
    the machine (never fewer than 1).

    Why one core less: an OpenMP team waits at every barrier for its slowest thread, so one thread
    descheduled by another process stalls every op. Measured on 2 cores (benchmarks/PERF.md), 30
    steps of the default recipe took 196 s with 2 threads next to one busy process, 26 s with 1."""
    if cpus_per_task and cpus_per_task.isdigit() and int(cpus_per_task) > 0:
        return int(cpus_per_task)
    share = available_cores() // max(1, local_tasks)
    return max(1, share - 1)


def set_task_threads(local_tasks: int) -> int:
    """Set this task's thread count unless OMP_NUM_THREADS was exported; returns the count in use.

    Why: a submitit task is a fresh process that imported torch with one intra-op thread per core;
    with several tasks on one host they oversubscribe the cores (36x slower steps measured on CPU
    with ``hydra/launcher=slurm_local``). torch reads OMP_NUM_THREADS when it starts, so the running
    process is set with ``torch.set_num_threads`` and the variable is exported for what it starts.
    """
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        threads = int(os.environ["OMP_NUM_THREADS"])
    else:
        threads = task_threads(local_tasks, os.environ.get("SLURM_CPUS_PER_TASK"))
        os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    return threads
