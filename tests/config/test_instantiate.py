"""The instantiation allowlist: allowed targets build, alias paths and plain dangerous ones are refused."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from framework.config.instantiate import (
    BUILTIN_ALLOW,
    check_target,
    check_targets,
    is_allowed_name,
    safe_instantiate,
)
from framework.config.schema import SHIPPED_CALLBACKS, RunConfig

ALLOW = ["framework.", "torch.optim.", "torch.nn."]


@pytest.mark.parametrize("path", ["torch.optim.AdamW", "torch.nn.Linear", "framework.launch.sweep.SweepSummary"])
def test_allowed_targets_pass(path: str) -> None:
    check_target(path, ALLOW)


@pytest.mark.parametrize(
    "path, allow, message",
    [
        ("builtins.eval", ALLOW, "not on the instantiation allowlist"),
        ("subprocess.Popen", ALLOW, "not on the instantiation allowlist"),
        ("os.system", ALLOW, "not on the instantiation allowlist"),
        ("posix.system", ALLOW, "not on the instantiation allowlist"),
        # GHSA-37p2-j732-x8pj: an allowed-looking module that re-exports os.
        ("logging.os.system", [*ALLOW, "logging."], "'logging.os' is really 'os'"),
        ("framework.launch.entry.os.system", ALLOW, "'framework.launch.entry.os' is really 'os'"),
        ("framework.launch.run_dir_guard.shutil.rmtree", ALLOW, "is really 'shutil'"),
        # A name imported into an allowed module keeps its real home.
        ("framework.config.instantiate.OmegaConf", ALLOW, "is really 'omegaconf"),
        ("torch.optim.NoSuchThing", ALLOW, "cannot be resolved"),
    ],
)
def test_refused_targets_name_the_reason(path: str, allow: list[str], message: str) -> None:
    with pytest.raises(ValueError, match="refused|allowlist|resolved") as err:
        check_target(path, allow)
    assert message in str(err.value) and path in str(err.value)


def test_prefix_matches_module_boundaries() -> None:
    assert is_allowed_name("torch.optim", ["torch.optim."])
    assert is_allowed_name("torch.optim.adamw", ["torch.optim."])
    assert not is_allowed_name("torch.optimizer_evil", ["torch.optim."])
    assert not is_allowed_name("anything", [])


def test_an_entry_without_a_trailing_dot_is_one_name() -> None:
    """``torch.optim.AdamW`` grants that class, not what lies below or beside it."""
    assert is_allowed_name("torch.optim.AdamW", ["torch.optim.AdamW"])
    assert not is_allowed_name("torch.optim.AdamW.step", ["torch.optim.AdamW"])
    assert not is_allowed_name("torch.optim.adamw", ["torch.optim"])
    assert check_target("torch.optim.AdamW", ["torch.optim.AdamW"]) is torch.optim.AdamW


@pytest.mark.parametrize(
    "path",
    [
        "framework.launch.data_cli.main",  # round 4: a data tool run with a recipe's arguments
        "framework.__main__.main",  # every subcommand, with command-line trust
        "framework.checkpoint.export_hf.export",
        "torch.optim.lr_scheduler",  # a module of torch.optim, not an optimizer class
        "torch.nn.Linear",
        "torch.load",
    ],
)
def test_the_default_allowlist_names_classes_not_packages(path: str) -> None:
    assert RunConfig().instantiate_allow == [] and not any(a.endswith(".") for a in BUILTIN_ALLOW)
    with pytest.raises(ValueError, match="not on the instantiation allowlist"):
        check_target(path, RunConfig().instantiate_allow)


def test_the_builtin_allowlist_is_the_shipped_callbacks_and_torch_optimizers() -> None:
    """Each builtin entry resolves to a class: a callback the docs name or a torch optimizer."""
    assert set(SHIPPED_CALLBACKS.values()) <= set(BUILTIN_ALLOW)
    for name in BUILTIN_ALLOW:
        cls = check_target(name, [])
        assert isinstance(cls, type), name
        assert name in SHIPPED_CALLBACKS.values() or issubclass(cls, torch.optim.Optimizer), name


def test_scan_finds_nested_and_interpolated_targets() -> None:
    cfg = OmegaConf.create(
        {
            "evil": "os.system",
            "nccl": {"env": {"_target_": "${evil}"}},
            "run": {"things": [{"_target_": "torch.nn.ReLU"}]},
            "hydra": {"callbacks": {"x": {"_target_": "framework.launch.sweep.SweepSummary"}}},
        }
    )
    with pytest.raises(ValueError, match=r"nccl\.env\._target_='os\.system'"):
        check_targets(cfg, ALLOW)
    del cfg["nccl"]
    assert check_targets(cfg, ALLOW) == 2  # the hydra node is scanned too


@pytest.mark.parametrize(
    "hydra, message",
    [
        (
            {"callbacks": {"pwn": {"_target_": "builtins.open"}}},
            "hydra.callbacks.pwn._target_='builtins.open'",
        ),
        # Hydra's own helpers would instantiate anything.
        (
            {"callbacks": {"pwn": {"_target_": "hydra.utils.call"}}},
            "hydra.callbacks.pwn._target_='hydra.utils.call'",
        ),
        ({"launcher": {"_target_": "${oops}"}}, "must be a literal dotted path"),
        # logging.config.dictConfig calls `()` and `class` with the node's keys; fileConfig evals.
        (
            {"job_logging": {"handlers": {"h": {"()": "os.system"}}}},
            r"hydra.job_logging.handlers.h.\(\)='os.system'",
        ),
        (
            {"job_logging": {"handlers": {"h": {"class": "logging.config.fileConfig"}}}},
            "logging.config.fileConfig",
        ),
    ],
)
def test_hydra_node_targets_are_checked(hydra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_targets(OmegaConf.create({"hydra": hydra}), ALLOW)


def test_hydra_own_plugins_and_logging_pass() -> None:
    hydra = {
        "launcher": {"_target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher"},
        "sweeper": {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"},
        "callbacks": {"s": {"_target_": "framework.launch.sweep.SweepSummary"}},
        "job_logging": {
            "handlers": {"c": {"class": "logging.StreamHandler"}, "f": {"class": "logging.FileHandler"}}
        },
    }
    assert check_targets(OmegaConf.create({"hydra": hydra}), ALLOW) == 5


def test_safe_instantiate_builds_allowed_and_refuses_others() -> None:
    layer = safe_instantiate({"_target_": "torch.nn.Linear", "in_features": 3, "out_features": 2}, ALLOW)
    assert isinstance(layer, torch.nn.Linear) and layer.weight.shape == (2, 3)
    with pytest.raises(ValueError, match="allowlist"):
        safe_instantiate({"_target_": "torch.nn.Linear", "bias": {"_target_": "builtins.exec"}}, ALLOW)
