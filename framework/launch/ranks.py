"""Launching local ranks, one run dir for all of them, and the process group.

Three ways a run starts, one code path after ``init_distributed``:
- ``python train.py mesh=4`` on one host: the Hydra process composes the config, creates the run
  dir, writes ``config.yaml`` into it and starts the ranks itself through torch's elastic launcher
  (the machinery behind torchrun, with ``max_restarts``); each rank runs ``python -m framework.worker
  RUN_DIR`` and reads the same resolved config, so all ranks share one run dir by construction.
- ``python train.py`` (one rank): the same worker code runs in-process on a world-1 process group.
- ``torchrun ... train.py ...`` (several hosts): each rank composes the config itself and joins the
  process group (framework.launch.torchrun.join_torchrun, which refuses ranks that composed different
  configs or run dirs); rank 0 alone validates and resolves it and writes ``config.yaml`` and
  ``plan.json``, which every rank then reads back, as the self-launched ranks do. The run dir is
  ``outputs/<RUN_STAMP>`` when the launcher sets ``RUN_STAMP``, else ``outputs/<date>/<run id>`` from
  torchrun's ``TORCHELASTIC_RUN_ID`` (identical on every rank: pass ``--rdzv-id`` or ``--standalone``).
  Hydra's per-process ``${now:}`` is not used there: ranks can resolve it in different seconds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from lightning_utilities.core.imports import RequirementCache

from framework.config.schema import Config, RunConfig
from framework.launch.startup import (  # noqa: F401 (re-exported: the launcher's names, importable here too)
    arm_stack_dump,
    joined_torchrun,
    register_resolvers,
    run_stamp,
)
from framework.parallel.process import available_cores, free_port, set_task_threads, task_threads  # noqa: F401 (task_threads: re-exported)

log = logging.getLogger("framework")


TORCH_REQUIREMENT = RequirementCache("torch>=2.11")


def check_torch() -> None:
    """torch.export, FSDP2 (``fully_shard``) and DTensor as used here need torch >= 2.11."""
    if not TORCH_REQUIREMENT:
        raise ValueError(f"torch {torch.__version__} is too old: {TORCH_REQUIREMENT.message}")


def cpu_rank_cap() -> int:
    """Most local CPU ranks a self-launch starts without ``run.oversubscribe=true``.

    Each gloo rank needs core time to answer its collectives: 64 ranks on 2 cores hung in
    rendezvous. 4 ranks per usable core, never fewer than 8 (the shipped meshes run on 2 cores).
    """
    return max(8, 4 * available_cores())


def check_local_resources(cfg: Config, device: torch.device) -> None:
    """Refuse a self-launch that this host cannot hold: more ranks than GPUs, or than the CPU cap.

    A dry run starts no ranks, and torchrun's ranks were placed by torchrun: neither is capped.
    """
    world = cfg.mesh.world_size
    cap = cpu_rank_cap()
    if (
        device.type == "cpu"
        and world > cap
        and not (joined_torchrun() or cfg.run.dry_run or cfg.run.oversubscribe)
    ):
        raise ValueError(
            f"mesh.shape={list(cfg.mesh.shape)} starts {world} CPU ranks on this host, above the cap of "
            f"{cap} (4 per usable core, at least 8): ranks this oversubscribed can hang; use a smaller "
            f"mesh, torchrun across hosts, run.dry_run=true to only plan, or run.oversubscribe=true"
        )
    if (
        device.type == "cuda"
        and not (joined_torchrun() or cfg.run.dry_run)
        and world > torch.cuda.device_count()
    ):
        raise ValueError(
            f"mesh={'x'.join(map(str, cfg.mesh.shape))} needs {world} GPUs on this host, "
            f"{torch.cuda.device_count()} are visible; launch with torchrun on several hosts, or use a smaller mesh"
        )


def host_available_bytes() -> int:
    """Memory this host can still give: /proc/meminfo's MemAvailable (Linux), else the free pages."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_offload_memory(cfg: Config, available: int | None = None) -> None:
    """``sharding.activation_offload``: the ranks on this host keep their saved activations in host
    memory; refuse a launch whose ranks need more than the host has available (``available``
    bytes, default MemAvailable). A dry run plans for other hosts: not checked."""
    if not cfg.sharding.activation_offload or cfg.run.dry_run:
        return
    from framework.planner.memory import offloaded_activation_bytes

    ranks = cfg.mesh.procs_per_node
    need = ranks * offloaded_activation_bytes(cfg)
    have = host_available_bytes() if available is None else available
    if need > have:
        raise ValueError(
            f"sharding.activation_offload=true keeps the saved activations of {ranks} rank(s) on this "
            f"host in host memory: {need:,} bytes ({need / 2**30:.1f} GiB) needed, {have:,} bytes "
            f"({have / 2**30:.1f} GiB) available; use a smaller train.micro_batch_size or "
            "train.seq_len, fewer ranks per host, sharding.activation_checkpointing=full, or "
            "sharding.activation_offload=false"
        )


def spawn_local(
    run_dir: Path, world_size: int, max_restarts: int, checkpoints: Path | None = None
) -> int | None:
    """Start ``world_size`` ranks on this host through torch's elastic launcher; raise if any failed.

    Each rank runs ``python -m framework.worker RUN_DIR``. With ``max_restarts`` > 0, a rank that
    dies makes the agent restart all ranks, which resume from the latest checkpoint.

    Returns the signal number when this process was told to stop (SIGTERM/SIGINT/SIGHUP/SIGQUIT:
    a preemption), else None. The agent forwards the signal to the ranks and waits for them (30 s,
    then SIGKILL); their ``PreemptionHandler`` saves at one agreed step and they exit 0. The agent
    then raises ``SignalException``, the expected end of a preempted job; whether the ranks really
    saved is read from their ``preempted`` event (framework.launch.outcome.stop_report). The ranks die with
    this process if it is killed (``die_with_launcher``). A restart is one line naming the rank that
    died, how, and where the ranks resume (``checkpoints``: the checkpoint root, None when off;
    framework.launch.failures).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from framework.launch.failures import reporting_restarts

    try:
        with reporting_restarts(checkpoints):
            launch_local(
                world_size, max_restarts, run_dir.name, ("-m", "framework.launch.worker", str(run_dir))
            )
    except SignalException as e:
        return int(e.sigval)
    return None


def launch_local(world_size: int, max_restarts: int, run_id: str, args: tuple[str, ...]) -> None:
    """``python *args`` on ``world_size`` local ranks through torch's elastic launcher (``spawn_local``
    says how; ``python -m framework evaluate mesh=N`` starts its ranks here too). Raises torch's
    ``ChildFailedError`` when a rank failed, ``SignalException`` when this process was told to stop."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ["FRAMEWORK_WORKER"] = "1"  # inherited by the ranks: they are ours, not torchrun's
    os.environ[LAUNCHER_PID] = str(os.getpid())  # the ranks die with this process (die_with_launcher)
    # Like torchrun (the elastic launcher API does not do it): one share of the cores per rank.
    # Without it each rank runs as many intra-op threads as there are cores; measured on 2 cores,
    # 2 DDP ranks then stalled for seconds (p99 step 3.4 s, p50 0.42 s vs 0.16 s with this).
    os.environ.setdefault("OMP_NUM_THREADS", str(task_threads(world_size)))
    # torch 2.13's c10d rendezvous keeps ONE agent-hosted TCPStore across restarts (cached in
    # DynamicRendezvousHandler) while the workers' env:// store adds no per-attempt prefix: restarted
    # ranks read the dead ranks' gloo addresses and hang in init_process_group (pytorch#135712,
    # reproduced here with run.fault_kill_at_step). Opting out of the shared store makes worker rank 0
    # host a fresh store on a fresh port for every attempt.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=max_restarts,
        # How often the agent looks at its ranks (torch's default): a run ends, and a dead rank is
        # restarted, this much after the fact; 0.5 s added ~0.35 s to every launch (measured: a
        # 2-rank run of 2 steps, median of 3, 6.9 s -> 6.2 s), for no measurable CPU.
        monitor_interval=0.1,
        start_method="spawn",
    )
    for name in ELASTIC_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, CtrlCNotices) for f in logger.filters):
            logger.addFilter(CtrlCNotices())
    elastic_launch(config, sys.executable)(*args)


# The elastic agent's loggers that announce a signal it forwards to the ranks.
ELASTIC_LOGGERS = ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api")


class CtrlCNotices(logging.Filter):
    """Drops the elastic agent's own lines about a Ctrl-C (SIGINT) it forwards to the ranks ("Received
    2 death signal", "Sending process N closing signal SIGINT", three lines for two ranks): the
    launcher prints the one line about the stop (framework.launch.outcome.stop_report). A SIGTERM's
    lines stay: a scheduler's preemption is worth them in a job log."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not (text.startswith("Received 2 death signal") or text.endswith("closing signal SIGINT"))


LAUNCHER_PID = "FRAMEWORK_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_launcher() -> None:
    """Make this rank die when the process that launched it dies (SIGKILL of the launcher, OOM kill).

    Without this a SIGKILLed launcher leaves its ranks training on their own, holding the GPUs and
    the checkpoint lock. On Linux the kernel sends SIGKILL to us when our parent exits
    (``prctl(PR_SET_PDEATHSIG)``); the launcher pid in the environment (or the parent at start)
    catches a parent that died before the call. Elsewhere a daemon thread polls the parent pid.
    """
    expected = int(os.environ.get(LAUNCHER_PID) or os.getppid())
    armed = False
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    if os.getppid() != expected:  # the launcher is already gone: we were reparented
        os._exit(1)
    if not armed:
        import threading
        import time

        def watch() -> None:
            while os.getppid() == expected:
                time.sleep(1.0)
            os._exit(1)

        threading.Thread(target=watch, name="launcher-watchdog", daemon=True).start()


@contextlib.contextmanager
def isolated_environ() -> Iterator[None]:
    """Restore ``os.environ`` after one job: consecutive multirun jobs in one process share nothing.

    A job sets RANK/MASTER_PORT (world 1 in-process), FRAMEWORK_WORKER (self-launch), NCCL_* (its nccl
    group) and WANDB_DIR; the next job of a sweep must not inherit any of them.
    """
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def in_submitit_task() -> bool:
    """True inside a task of a submitit job (SLURM, or submitit's local executor) with several tasks."""
    if os.environ.get("SUBMITIT_EXECUTOR") not in ("slurm", "local"):
        return False
    import submitit

    return submitit.JobEnvironment().num_tasks > 1


def adopt_submitit_environment() -> bool:
    """Make a multi-task submitit job's tasks the ranks of one job (RANK, WORLD_SIZE, MASTER_ADDR/PORT).

    ``hydra/launcher=submitit_slurm`` asks for nodes x tasks-per-node = the mesh (conf/hydra/launcher);
    each task then joins the job as torchrun's ranks do. The master is the job's first host, the port
    a function of the job id (submitit's TorchDistributedEnvironment). Returns True when it applied.
    """
    if not in_submitit_task():
        return False
    from submitit.helpers import TorchDistributedEnvironment

    # CUDA_VISIBLE_DEVICES is left alone: init_distributed picks cuda:LOCAL_RANK itself.
    dist_env = TorchDistributedEnvironment()
    dist_env.export(set_cuda_visible_devices=False, overwrite=True)
    threads = set_task_threads(dist_env.local_world_size)
    log.info("submitit task %d: %d intra-op threads (OMP_NUM_THREADS)", dist_env.rank, threads)
    return True


ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


def apply_allocator_environment(run: RunConfig) -> None:
    """``run.expandable_segments``: set the CUDA allocator's configuration for this job and its ranks.

    Before CUDA's first allocation (the allocator reads it once); a value the user already exported
    wins, whatever the config says.
    """
    if run.expandable_segments and ALLOC_CONF not in os.environ:
        os.environ[ALLOC_CONF] = "expandable_segments:True"
