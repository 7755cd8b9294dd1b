"""A command-line override Hydra rejects at compose time: one line naming it and what is valid, exit 2,
nothing written (framework.config.override_errors)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig
from omegaconf.errors import ValidationError

from framework.config import schema as config
from framework.config.override_errors import explain
from framework.config.schema import quote_numeric_choices
from framework.launch import recipes
from framework.launch.ranks import register_resolvers
from tests.entry import train_main

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
config.register()
recipes.register()
register_resolvers()


@pytest.fixture(scope="module")
def composed() -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", return_hydra_config=True)


def explained(error: Exception, overrides: list[str]) -> str:
    line = explain(error, overrides)
    assert line is not None and "\n" not in line, (line, error)
    return line


# A value override fails in Hydra's merge of the command line into the composed config (the last step
# of ConfigLoaderImpl.load_configuration): applied here to one composed config, not composed per case.
@pytest.mark.parametrize(
    "override, line",
    [
        ("train.steps=abc", "train.steps=abc: not an integer (train.steps is an int)"),
        ("train.lr=abc", "train.lr=abc: not a number (train.lr is a float)"),
        ("run.dry_run=maybe", "run.dry_run=maybe: not a boolean; valid values are true, false"),
        (
            "sharding.activation_checkpointing=bogus",
            "sharding.activation_checkpointing=bogus: valid values are none, selective, selective_op, full, budget, auto",
        ),
        ("model.float8=bad", "model.float8=bad: valid values are none, tensorwise, rowwise"),
        ("train.steps=null", "train.steps=null: train.steps cannot be null"),
        ("mesh.shape=[2,x]", "mesh.shape=[2,x]: 'x' is not an integer (mesh.shape is a list of ints)"),
        ("train.stepz=1", "train.stepz=1: no key 'stepz' in train; valid keys: steps, global_batch_size, "),
        ("train.stepz=1", "; did you mean steps?"),
        ("nosuchgroup=x", "nosuchgroup=x: unknown config group or key 'nosuchgroup'; valid keys: bucketing, "),
        # A typo in the first component of a dotted key: the group or key is unknown, not "trian in trian.steps".
        ("trian.steps=5", "trian.steps=5: unknown config group or key 'trian'; valid keys: bucketing, "),
        ("trian.steps=5", "; did you mean train?"),
        ("hydra.nosuch=1", "hydra.nosuch=1: no key 'nosuch' in hydra; valid keys: run, sweep, "),
        (
            "train=x",
            "train=x: train is a section, not a value: set its keys as train.KEY=VALUE; valid keys: ",
        ),
        ("~train.steps", "~train.steps: a key of the schema cannot be deleted; set a value instead"),
        (
            "data.mix=[{path: a, weight: x}]",
            "data.mix=[{path: a, weight: x}]: 'x' is not a number (weight is a float)",
        ),
        (
            "data.mix=[{nosuch: 1}]",
            "data.mix=[{nosuch: 1}]: no key 'nosuch' in data.mix; valid keys: source, path",
        ),
        ("+train.steps=3", "+train.steps=3: train.steps already has a value; set it with train.steps=3"),
        (  # a family's own key under another family (the default recipe is a Llama)
            "model.sliding_window=4096",
            "model.sliding_window=4096: a key of model=mixtral|mistral|gpt_oss only, not of model=llama (this recipe's "
            "family); select the family with model=mixtral|mistral|gpt_oss, or drop the override",
        ),
    ],
)
def test_rejected_value_is_one_line_naming_it_and_what_is_valid(
    composed: DictConfig, override: str, line: str
) -> None:
    overrides = OverridesParser.create().parse_overrides([override])
    with pytest.raises(ConfigCompositionException) as e:
        ConfigLoaderImpl._apply_overrides_to_config(overrides, copy.deepcopy(composed))
    assert line in explained(e.value, [override])


# A group option, a sweep without -m and a malformed override fail before anything is composed.
@pytest.mark.parametrize(
    "override, line",
    [
        (
            "executor=bogus",
            "executor=bogus: no such option in group 'executor'; available: compile, cudagraphs, eager",
        ),
        (
            "recipe=llama_tiyn",
            "recipe=llama_tiyn: no such option in group 'recipe'; did you mean llama_tiny?",
        ),
        ("mesh=3x0", "mesh=3x0: no such option in group 'mesh'; available: 1, 128x8, "),
        ("mesh=0", "; or any shape of positive integers such as 6 or 4x8 (it sets mesh.shape)"),
        (
            "hydra/launcher=nope",
            "hydra/launcher=nope: no such option in group 'hydra/launcher'; available: basic",
        ),
        (
            "+executor=compile",
            "+executor=compile: group 'executor' already has an option; choose it with executor=compile",
        ),
        (
            "train.steps=1,2",
            "train.steps=1,2: a comma-separated value (or range, choice, glob) is a sweep: add -m",
        ),
        ("train.steps", "train.steps: not an override (no '='); an override is KEY=VALUE"),
        ("train.steps=[1,", "train.steps=[1,: cannot be parsed (no viable alternative at input '[1,')"),
        ("=3", "=3: no key before '='"),
        ("model=gemma", "model=gemma: no such option in group 'model'; available: deepseek_v3, gpt_oss, llama, mistral, mixtral, qwen3, qwen3_moe"),
        ("model.family=gemma", "model=gemma: no such option in group 'model'; available: deepseek_v3, gpt_oss, llama, mistral, mixtral, qwen3, qwen3_moe"),
        (  # the command line's family under a recipe that sets another family's key
            "recipe=mistral_tiny model.family=llama",
            "model=llama: the recipe sets model.sliding_window, a key of model=mixtral|mistral|gpt_oss only; keep the "
            "recipe's family (drop model=llama) or pick a recipe of model=llama",
        ),
    ],
)
def test_rejected_choice_or_syntax_is_one_line_naming_it_and_what_is_valid(override: str, line: str) -> None:
    overrides = quote_numeric_choices(override.split())  # as train.py passes them (mesh=0 -> mesh='0')
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        with pytest.raises(Exception) as e:  # noqa: B017 - whatever Hydra raises is what train.py sees
            compose("config", overrides=overrides)
    assert line in explained(e.value, overrides)


def test_an_error_no_override_caused_keeps_hydras_report() -> None:
    """A bad value in a YAML file, even at a key the command line also sets, and a missing option a
    YAML file's defaults list names: no override's line (the file's is ``explain_file_error``'s, below)."""
    in_yaml = ConfigCompositionException()  # what load_configuration raises for a YAML file's value
    in_yaml.__cause__ = ValidationError("Value 'abc' of type 'str' could not be converted to Integer")
    in_yaml.__cause__.full_key = "train.steps"
    assert explain(in_yaml, ["train.steps=3"]) is None
    missing = MissingConfigException("In 'recipe/x': Could not find 'mesh/3x3'", "mesh/3x3", ["1", "2"])
    assert explain(missing, ["train.steps=3"]) is None


@pytest.mark.parametrize(
    ("recipe", "line"),
    [
        (
            "defaults:\n  - override /callbacks: [default, nosuch]\n",
            "recipe/mine: callbacks=nosuch: no such option in group 'callbacks'; available: compile_cache, "
            "default, fault_injection, profiler, wandb",
        ),
        ("train:\n  steps: abc\n", "recipe/mine: train.steps: 'abc' is not an integer (train.steps is an int)"),
        ("train:\n  stepz: 3\n", "recipe/mine: train.stepz: no key 'stepz' in train; valid keys: steps, "),
    ],
)
def test_an_error_in_a_users_recipe_is_one_line_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], recipe: str, line: str
) -> None:
    """A recipe whose defaults list names a callback that does not exist (or that sets a key or value
    the schema refuses) was Hydra's 6-line report and exit status 1, in a run and in a sweep."""
    root = tmp_path / "recipes"
    root.mkdir()
    (root / "mine.yaml").write_text(recipe + "model:\n  name: mine\n")
    monkeypatch.setenv("FRAMEWORK_RECIPE_PATH", str(root))
    run, sweep = tmp_path / "run", tmp_path / "sweep"
    assert train_main(f"hydra.run.dir={run}", "recipe=mine") == 2
    assert train_main("-m", f"hydra.sweep.dir={sweep}", "recipe=llama_tiny,mine") == 2
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 2 and all(e.startswith(f"error: {line}") for e in err), err
    assert not run.exists() and not sweep.exists()


def test_train_py_run_and_sweep_exit_2_with_one_line_and_write_nothing(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """train.py's entry point in this process (tests/entry.py): a run, and a sweep whose second job's
    value is bad (Hydra's sweeper writes multirun.yaml before it checks the jobs; it is removed)."""
    run, sweep = tmp_path / "run", tmp_path / "sweep"
    load = ConfigLoaderImpl.load_configuration
    assert train_main(f"hydra.run.dir={run}", "sharding.activation_checkpointing=bogus") == 2
    assert train_main("-m", f"hydra.sweep.dir={sweep}", "train.steps=1,abc") == 2
    err = capfd.readouterr().err
    assert err.splitlines() == [
        "error: sharding.activation_checkpointing=bogus: valid values are none, selective, selective_op, full, budget, auto",
        "error: train.steps=abc: not an integer (train.steps is an int)",
    ]
    assert not run.exists() and not sweep.exists()
    assert ConfigLoaderImpl.load_configuration is load  # Hydra is left as it was


def test_hydra_full_error_keeps_the_full_traceback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # Hydra re-raises instead of reporting
    with pytest.raises(OverrideParseException, match="Error parsing override 'train.steps'"):
        train_main(f"hydra.run.dir={tmp_path / 'run'}", "train.steps")


def test_python_train_py_bad_option_is_one_line_exit_2_and_no_outputs(tmp_path: Path) -> None:
    """The real interpreter path, from a fresh folder: no ``outputs/`` (the default run dir) appears."""
    env = {k: v for k, v in os.environ.items() if k not in ("RUN_STAMP", "HYDRA_FULL_ERROR")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "executor=bogus"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        "error: executor=bogus: no such option in group 'executor'; available: compile, cudagraphs, eager"
    ]
    assert list(tmp_path.iterdir()) == []


def test_train_py_a_family_key_under_another_family_is_one_line(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """``model.sliding_window`` on the default (Llama) recipe: refused at compose time, exit 2, one
    line naming the family that has the key."""
    run = tmp_path / "run"
    assert train_main(f"hydra.run.dir={run}", "model.sliding_window=4096") == 2
    assert capfd.readouterr().err.splitlines() == [
        "error: model.sliding_window=4096: a key of model=mixtral|mistral|gpt_oss only, not of model=llama (this recipe's "
        "family); select the family with model=mixtral|mistral|gpt_oss, or drop the override"
    ]
    assert not run.exists()


def test_the_mode_probe_is_skipped_only_where_nothing_can_set_the_mode(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """framework.config.mode_probe: Hydra's second composition (its ``hydra.mode`` probe) is skipped
    unless an override may set the mode; ``hydra.mode=MULTIRUN`` on the command line still makes a
    sweep (the probe ran), and Hydra is left as it was."""
    from hydra._internal.hydra import Hydra

    from framework.config.mode_probe import may_set_mode

    assert not may_set_mode(["hydra.run.dir=x", "train.steps=2", "hydra.sweep.dir=y", "+hydra.job.name=n"])
    for arg in ("hydra.mode=MULTIRUN", "+hydra.mode=RUN", "++hydra.mode=RUN", "~hydra.mode", "hydra/launcher=x"):
        assert may_set_mode(["train.steps=2", arg]), arg
    probe = Hydra.get_mode
    sweep = tmp_path / "sweep"
    args = ("hydra.mode=MULTIRUN", f"hydra.sweep.dir={sweep}", "run.dry_run=true", "train.steps=2")
    assert train_main(*args) == 0
    capfd.readouterr()
    assert (sweep / "0" / "plan.json").is_file()  # a sweep of one job: the mode came from the probe
    assert Hydra.get_mode is probe
