"""The ``run``, ``logger`` and ``callbacks`` groups' schemas: how this run executes, reports and what
it calls back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from framework.config.options import only_with


class Device(Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class ProfileRanks(Enum):
    """Which ranks record a torch.profiler trace: rank 0 only, or every rank (one file each)."""

    rank0 = "rank0"
    all = "all"


@dataclass
class RunConfig:
    device: Device = Device.auto
    # CUDA caching allocator: grow segments in place instead of carving fixed blocks
    # (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, as torchtitan's launcher sets it): less
    # fragmentation when memory is tight. Never overrides a PYTORCH_CUDA_ALLOC_CONF already set.
    expandable_segments: bool = True
    # Plan (and on a fake process group, build and shard) without training.
    dry_run: bool = False
    # Fail on any nondeterministic kernel; used by the bitwise resume tests.
    deterministic: bool = False
    # Self-launch restarts when a rank dies (torch elastic max_restarts).
    max_restarts: int = 0
    # Record a torch.profiler trace (Chrome JSON) of a window of steps into <run dir>/profile.
    profile: bool = False
    profile_ranks: ProfileRanks = only_with("run.profile", True, default=ProfileRanks.rank0)
    # torch.profiler.schedule: skip `wait` steps, warm up `warmup` steps, record `active` steps, once.
    profile_wait: int = only_with("run.profile", True, default=1)
    profile_warmup: int = only_with("run.profile", True, default=1)
    profile_active: int = only_with("run.profile", True, default=3)
    # What a config's `_target_` may name besides the shipped callbacks and torch.optim's optimizer
    # classes (framework.config.instantiate, default-deny): exact names (`mypkg.MyCallback`), or a
    # package with its trailing dot (`mypkg.`). Set it in conf/ or on the command line; a recipe that
    # sets it is refused.
    instantiate_allow: list[str] = field(default_factory=list)
    # Fault injection, to test recovery on your own setup: rank `fault_rank` (-1 = every rank) SIGKILLs
    # itself after step `fault_kill_at_step` (-1 = off), on the launcher's first attempt only; or
    # raises from inside the forward of step `fault_raise_at_step` (-1 = off), to test the cleanup.
    fault_kill_at_step: int = -1
    fault_raise_at_step: int = -1
    fault_rank: int = 0
    # Start more local CPU ranks than framework.launch.ranks.cpu_rank_cap() (4 per core, at least 8);
    # above it gloo ranks starve each other and the launch can hang.
    oversubscribe: bool = False
    # Launch a plan whose per-rank memory estimate exceeds mesh.hardware.memory_gib (refused by
    # default; run.dry_run=true only reports it).
    allow_over_memory: bool = False


class LoggerKind(Enum):
    console = "console"
    wandb = "wandb"


class WandbMode(Enum):
    """``auto``: online when an API key is configured (WANDB_API_KEY or a netrc entry), else offline."""

    auto = "auto"
    online = "online"
    offline = "offline"


@dataclass
class LoggerConfig:
    """Metrics sinks. ``metrics.jsonl`` is always written; ``kind=wandb`` adds Weights & Biases (rank 0)."""

    kind: LoggerKind = LoggerKind.console
    project: str = "framework"
    progress_bar: bool = True
    entity: Optional[str] = None  # wandb entity (team or user); None = the key's default entity
    mode: WandbMode = WandbMode.auto  # wandb online/offline; auto = online only when a key is configured
    tags: list[str] = field(default_factory=list)  # wandb run tags
    # write metrics.png (loss, tokens/s, lr, grad norm, MFU over steps) at the end of the run
    plot: bool = True


# The shipped callbacks (conf/callbacks/default.yaml lists the same, in the same order): each acts only
# when its own keys ask (run.profile, logger=wandb, run.fault_*/verify.inject_nan_steps, executor.cache_dir), so all four are
# always there. framework.train.callbacks builds them through the allowlist; a test holds the two equal.
SHIPPED_CALLBACKS: dict[str, str] = {
    "profiler": "framework.train.profiling.Profiling",
    "wandb": "framework.train.wandb_logger.WandbLogger",
    "fault_injection": "framework.train.faults.FaultInjection",
    "compile_cache": "framework.train.compile_cache.CompileCache",
}


def default_callbacks() -> dict[str, Any]:
    return {name: {"_target_": target} for name, target in SHIPPED_CALLBACKS.items()}
