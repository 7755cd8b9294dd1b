"""The device that the GPU-only options are checked against: this host's for a launch, the declared
``mesh.hardware`` for a dry run.

Why: a dry run plans a GPU job on a login node without a GPU. Checked against this host's device,
every GPU-only option (``model.float8``, ``model.attention=fa4``, ``model.fused_cross_entropy``,
``executor=cudagraphs``) was refused there; checked against the declared hardware, a dry run
refuses what the job's GPUs cannot run (float8 on an A100) and plans the rest. The packages are
this host's, not the job's: one the launch needs but this host lacks is a warning in a dry run
(``MissingPackage``, ``tolerate_missing_packages``) and stays a refusal at launch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from framework.config.schema import HardwareConfig

log = logging.getLogger("framework")


class MissingPackage(ValueError):
    """A package (or torch feature) an option needs is not importable on this host."""


@dataclass(frozen=True)
class Target:
    """Where the options must run: device type, CUDA compute capability (None off CUDA), a name
    for the refusals, and whether it is the declared hardware (a dry run) or this host's device."""

    type: str
    capability: tuple[int, int] | None
    name: str
    declared: bool


def local(device: torch.device) -> Target:
    """This host's device, as a launch will use it."""
    if device.type != "cuda":
        return Target(device.type, None, device.type, declared=False)
    capability = torch.cuda.get_device_capability(device)
    return Target("cuda", capability, torch.cuda.get_device_name(device), declared=False)


def declared(hw: HardwareConfig) -> Target:
    """The hardware profile's device (``mesh/hardware``), which a dry run plans for."""
    return Target(hw.device_type, hw.capability, f"mesh.hardware.name={hw.name}", declared=True)


def of_run(hw: HardwareConfig, dry_run: bool, device: torch.device) -> Target:
    """The declared hardware ``hw`` (``mesh.hardware``) for ``run.dry_run=true``, else this host's
    ``device``."""
    return declared(hw) if dry_run else local(device)


def mismatch(hw: HardwareConfig, here: Target) -> str | None:
    """A warning when a launch runs on another kind of device than ``mesh/hardware`` declares (the
    plan's memory and time figures are then the profile's, not this device's); None when they agree.

    Not a refusal: the options are checked against the device that runs them, and a CPU run of a
    GPU profile (tests, a small rehearsal) is legitimate.
    """
    if hw.device_type == here.type and (here.type != "cuda" or hw.capability == here.capability):
        return None
    have = (
        here.name if here.capability is None else f"{here.name} ({here.capability[0]}.{here.capability[1]})"
    )
    want = (
        "no CUDA GPU"
        if hw.capability is None
        else f"compute capability {hw.capability[0]}.{hw.capability[1]}"
    )
    return (
        f"mesh.hardware.name={hw.name} declares {want}, this run uses {have}: the plan's memory and "
        f"time figures are the profile's; choose the mesh/hardware option that matches the device"
    )


# A model this large is a GPU job: on the CPU profile one step of it is predicted at minutes to hours
# (llama1b, 1.24B: 0.1 TFLOP/s x 0.11 efficiency), so a plan for it on the default profile is
# almost always a forgotten mesh/hardware.
GPU_SIZED_PARAMS = 1_000_000_000


def cpu_profile_notice(
    hw: HardwareConfig, nccl_preset: str, num_params: int, hardware_options: list[str]
) -> str | None:
    """One warning line when a GPU-sized job (``GPU_SIZED_PARAMS`` or more parameters) or an NCCL
    preset (GPU ranks only: gloo reads none of it) meets the CPU profile, the default
    ``mesh/hardware``: which hardware the plan assumes and how to pick another. None otherwise."""
    gpu_sized = num_params >= GPU_SIZED_PARAMS
    preset = nccl_preset != "default"
    if hw.device_type != "cpu" or not (gpu_sized or preset):
        return None
    why = [f"a {num_params / 1e9:.3g}B-parameter model"] if gpu_sized else []
    why += [f"nccl={nccl_preset} (NCCL runs on GPU ranks only)"] if preset else []
    gpus = ", ".join(o for o in hardware_options if o != hw.name)
    return (
        f"mesh/hardware={hw.name}: the plan assumes a CPU host ({hw.memory_gib:g} GiB, "
        f"{hw.peak_tflops:g} TFLOP/s) for {' and '.join(why)}; for GPUs add mesh/hardware=NAME ({gpus})"
    )


@contextmanager
def tolerate_missing_packages(target: Target) -> Iterator[None]:
    """Around a check: for the declared hardware (a dry run) a ``MissingPackage`` becomes one
    warning line (the launch needs the package, planning does not); at launch it is raised."""
    try:
        yield
    except MissingPackage as e:
        if not target.declared:
            raise
        log.warning("dry run: %s (the launch will refuse without it; planning goes on)", e)
