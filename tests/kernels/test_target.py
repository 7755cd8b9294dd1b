"""framework.kernels.target: a dry run checks the GPU-only options against the declared ``mesh/hardware``, a
launch against its own device; a missing package warns in a dry run and refuses at launch."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from framework.config.schema import Config, HardwareConfig
from framework.kernels import target
from framework.kernels.target import MissingPackage, Target
from framework.launch.prelaunch import check_cudagraphs, check_hardware
from tests.config.test_config import compose_config

CPU = torch.device("cpu")
PROFILES = Path(__file__).resolve().parents[2] / "conf" / "mesh" / "hardware"


def on(cfg: Config, profile: str, dry_run: bool = True) -> Config:
    """``cfg`` with the shipped ``mesh/hardware`` profile and ``run.dry_run`` (cheaper than a compose)."""
    hw = HardwareConfig(**OmegaConf.to_container(OmegaConf.load(PROFILES / f"{profile}.yaml")))
    mesh = dataclasses.replace(cfg.mesh, hardware=hw)
    return dataclasses.replace(cfg, mesh=mesh, run=dataclasses.replace(cfg.run, dry_run=dry_run))


def test_profiles_declare_their_device() -> None:
    """The shipped profiles: Hopper and A100 are CUDA with their capability, the CPU is not."""
    expected = {"h100_sxm": (9, 0), "h200": (9, 0), "a100_80gb": (8, 0), "cpu": None}
    for name, capability in expected.items():
        hw = on(Config(), name).mesh.hardware
        assert hw.capability == capability, name
        assert hw.device_type == ("cpu" if capability is None else "cuda"), name
        here = target.declared(hw)
        assert (here.type, here.capability, here.declared) == (hw.device_type, capability, True)
        assert here.name == f"mesh.hardware.name={name}"


def test_a_dry_run_plans_for_the_declared_hardware_a_launch_for_its_device() -> None:
    dry = on(Config(), "h100_sxm")
    assert target.of_run(dry.mesh.hardware, dry.run.dry_run, CPU) == Target("cuda", (9, 0), "mesh.hardware.name=h100_sxm", True)
    launch = on(Config(), "h100_sxm", dry_run=False)
    assert target.of_run(launch.mesh.hardware, launch.run.dry_run, CPU) == Target("cpu", None, "cpu", False)


def test_cudagraphs_is_checked_against_the_declared_hardware_in_a_dry_run() -> None:
    graphs = compose_config("executor=cudagraphs")
    check_cudagraphs(on(graphs, "h200"), CPU)
    for refused in (on(graphs, "cpu"), on(graphs, "h200", dry_run=False)):
        with pytest.raises(ValueError, match="^executor=cudagraphs needs a CUDA device, this run uses cpu"):
            check_cudagraphs(refused, CPU)
    assert on(graphs, "h200") == compose_config(
        "executor=cudagraphs", "mesh/hardware=h200", "run.dry_run=true"
    )


def test_a_launch_on_another_device_than_declared_warns(caplog: pytest.LogCaptureFixture) -> None:
    h100 = HardwareConfig(name="h100_sxm", compute_capability=[9, 0])
    assert target.mismatch(h100, Target("cuda", (9, 0), "NVIDIA H100", False)) is None
    assert target.mismatch(HardwareConfig(), Target("cpu", None, "cpu", False)) is None
    on_a100 = target.mismatch(h100, Target("cuda", (8, 0), "NVIDIA A100", False))
    assert (
        on_a100 is not None and "declares compute capability 9.0, this run uses NVIDIA A100 (8.0)" in on_a100
    )
    on_gpu = target.mismatch(HardwareConfig(), Target("cuda", (9, 0), "NVIDIA H200", False))
    assert on_gpu is not None and on_gpu.startswith("mesh.hardware.name=cpu declares no CUDA GPU")
    default = Config()
    with caplog.at_level(logging.WARNING, logger="framework"):
        check_hardware(on(default, "h100_sxm", dry_run=False), CPU)
        check_hardware(on(default, "h100_sxm"), CPU)
        check_hardware(default, CPU)  # the default profile on this CPU: nothing to say
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [
        "mesh.hardware.name=h100_sxm declares compute capability 9.0, this run uses cpu: the plan's "
        "memory and time figures are the profile's; choose the mesh/hardware option that matches the device"
    ]


def test_missing_packages_warn_in_a_dry_run_and_refuse_at_launch(caplog: pytest.LogCaptureFixture) -> None:
    def lacking() -> None:
        raise MissingPackage("model.float8=tensorwise needs torchao (No module named 'torchao')")

    with caplog.at_level(logging.WARNING, logger="framework"):
        with target.tolerate_missing_packages(Target("cuda", (9, 0), "mesh.hardware.name=h200", True)):
            lacking()
    assert [r.getMessage() for r in caplog.records] == [
        "dry run: model.float8=tensorwise needs torchao (No module named 'torchao') (the launch will "
        "refuse without it; planning goes on)"
    ]
    with pytest.raises(MissingPackage), target.tolerate_missing_packages(Target("cpu", None, "cpu", False)):
        lacking()
    with pytest.raises(ValueError, match="other"):  # only a missing package is tolerated
        with target.tolerate_missing_packages(Target("cuda", (9, 0), "mesh.hardware.name=h200", True)):
            raise ValueError("other")


def test_a_dry_run_uses_no_device_of_this_host(tmp_path: Path) -> None:
    """The GPU job's own command plus run.dry_run=true plans on this CPU host: run.device=cuda with
    no GPU visible is not refused (a launch still is), nor are 8 ranks (framework.launch.prelaunch.validate)."""
    from hydra import compose, initialize_config_dir

    from framework.config import schema as config
    from framework.launch import recipes
    from framework.launch.prelaunch import prelaunch
    from framework.launch.ranks import register_resolvers

    config.register()
    recipes.register()
    register_resolvers()
    job = ["data=synthetic", "mesh='8'", "mesh/hardware=h100_sxm", "run.device=cuda", "executor=cudagraphs"]
    with initialize_config_dir(config_dir=str(recipes.CONF_DIR), version_base="1.3"):
        dry, launch = (compose("config", overrides=[*job, f"run.dry_run={d}"]) for d in ("true", "false"))
    cfg, plan, _ = prelaunch(dry, tmp_path / "run", None)
    assert cfg.run.dry_run and plan.world_size == 8
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="run.device=cuda but no CUDA device is visible"):
            prelaunch(launch, tmp_path / "run", None)
