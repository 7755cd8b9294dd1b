"""What a recipe may contain: one row per way in that an attacker's recipe tried (framework.launch.recipe_check).

The end-to-end runs through train.py are in tests/launch/test_recipes.py; these are the rules themselves,
on raw recipe content and on real files, and the check on Hydra's composed result.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from framework.config import schema as config
from framework.launch import recipe_check, recipe_cli, recipe_places

CALLBACK = {"pwn": {"_target_": "builtins.open", "file": "/tmp/x", "mode": "w"}}


@pytest.mark.parametrize(
    "content, message",
    [
        # Hydra's own keys, written directly.
        ({"hydra": {"callbacks": CALLBACK}}, "may not configure Hydra"),
        ({"hydra": {"run": {"dir": "/etc"}}}, "may not configure Hydra"),
        ({"hydra": {"job": {"env_set": {"PYTHONPATH": "/evil"}}}}, "may not configure Hydra"),
        ({"hydra": {"searchpath": ["file:///evil/conf"]}}, "may not configure Hydra"),
        ({"hydra": {"launcher": {"_target_": "os.system"}}}, "may not configure Hydra"),
        ({"hydra.callbacks.pwn": CALLBACK["pwn"]}, "top-level key(s) ['hydra.callbacks.pwn']"),
        # Defaults that package content elsewhere, or select a Hydra group.
        ({"defaults": [{"/recipe@hydra.callbacks.pwn": "payload"}]}, "select a Hydra option"),
        ({"defaults": [{"/recipe@_global_": "payload"}]}, "is not allowed (a package `@...`"),
        ({"defaults": [{"override /mesh@model": "2x4"}]}, "is not allowed"),
        ({"defaults": [{"override /recipe": "other"}]}, "is not allowed"),
        ({"defaults": [{"override /mesh": "${choice}"}]}, "is not allowed"),
        ({"defaults": [{"override /hydra/launcher": "slurm"}]}, "select a Hydra option"),
        ({"defaults": [{"override /hydra/callbacks": "pwn"}]}, "select a Hydra option"),
        ({"defaults": [{"hydra/job_logging": "disabled"}]}, "select a Hydra option"),
        ({"defaults": "override /mesh: 2"}, "defaults must be a list"),
        # Keys that reach code or the process.
        ({"run": {"instantiate_allow": ["os."]}}, "run.instantiate_allow"),
        (
            {"executor": {"cache_dir": "/shared/evil"}},
            "executor.cache_dir='/shared/evil', which is a compile cache",
        ),
        ({"nccl": {"env": {"LD_PRELOAD": "/tmp/evil.so"}}}, "nccl.env.LD_PRELOAD is refused"),
        ({"nccl": {"env": {"PATH": "/evil"}}}, "nccl.env.PATH is refused"),
        ({"nccl": {"preset_env": {"PYTHONPATH": "/evil"}}}, "nccl.preset_env.PYTHONPATH is refused"),
        (
            {"nccl": {"env": {"NCCL_SOCKET_IFNAM": "eth0"}}},
            "did you mean NCCL_SOCKET_IFNAME? (set it through nccl.socket_ifname)",
        ),
        ({"nccl": {"env": {"NCCL_NET_PLUGIN": "/tmp/evil"}}}, "loads a shared library into every rank"),
        ({"nccl": {"env": {"NCCL_CONF_FILE": "/tmp/vars"}}}, "reads more variables"),
        # Resolvers read outside the config.
        ({"model": {"name": "${oc.env:HOME}"}}, "calls the resolver 'oc.env'"),
        ({"model": {"name": "x-${oc.env:AWS_SECRET_ACCESS_KEY,none}"}}, "calls the resolver 'oc.env'"),
        ({"model": {"name": "${oc.decode:'${oc.env:HOME}'}"}}, "calls the resolver 'oc.decode'"),
        ({"logger": {"tags": ["${now:%H}"]}}, "logger.tags[0]='${now:%H}' calls the resolver 'now'"),
        ({"model": {"name": "${${which}:HOME}"}}, "a computed resolver name"),
        # Unbounded interpolation.
        (
            {"train": {"seq_len": "${train.seq_len}"}},
            "train.seq_len: recursive interpolation (a cycle: train.seq_len -> train.seq_len)",
        ),
        (
            {"model": {"name": "${data.path}"}, "data": {"path": "${model.name}"}},
            "recursive interpolation (a cycle",
        ),
        ({"model": {"name": "${"}}, "invalid interpolation"),
        # Callbacks run code: a recipe picks them by name, never names their class (any depth).
        (
            {"callbacks": {"pwn": {"_target_": "framework.train.profiling.Profiling"}}},
            "it sets callbacks.pwn._target_='framework.train.profiling.Profiling', which names the code",
        ),
        ({"callbacks": {"profiler": {"inner": {"_target_": "os.system"}}}}, "callbacks.profiler.inner._target_"),
        ({"callbacks": {"profiler": "${model.name}"}}, "an interpolation that would set callbacks.*._target_"),
        ({"callbacks": "${model.name}"}, "would set callbacks.*._target_"),
        ({"defaults": [{"override /callbacks": ["default", "${x}"]}]}, "is not allowed"),
        ({"defaults": [{"override /mesh": ["2", "4"]}]}, "is not allowed"),
    ],
)
def test_refused_recipe_content_names_the_reason(content: dict, message: str) -> None:
    reason = recipe_check.refusal(content)
    assert reason is not None and message in reason, reason


@pytest.mark.parametrize(
    "content",
    [
        {"model": {"dim": 64}, "train": {"steps": 4, "seq_len": 32}},
        {"defaults": [{"override /mesh": "2x4"}, {"override /mesh/hardware": "h100_sxm"}, "_self_"]},
        {"defaults": [{"override /mesh": 2}]},  # YAML reads 2 as an int
        {"train": {"seq_len": 64, "global_batch_size": "${train.seq_len}"}},
        {"model": {"name": "${.dim}-wide", "dim": 64}},
        {"nccl": {"env": {"NCCL_IB_HCA": "mlx5", "NCCL_DEBUG": "WARN"}}},
        {"model": {"name": "costs \\${oc.env:HOME} nothing"}},  # escaped: a literal string
        # Shipped callbacks picked and set by name, one switched off.
        {"defaults": [{"override /callbacks": ["default", "mine"]}], "callbacks": {"mine": {"every": 2}}},
        {"callbacks": {"profiler": None}},
    ],
)
def test_ordinary_recipes_pass(content: dict) -> None:
    assert recipe_check.refusal(content) is None


def _bomb(levels: int = 9) -> str:
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    names = "abcdefghijklmnop"
    for prev, name in zip(names[: levels - 1], names[1:levels], strict=True):
        lines.append(f"{name}: &{name} [{', '.join(['*' + prev] * 9)}]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "text, message",
    [
        (_bomb(), "uses YAML anchors/aliases"),
        ("model: &m {dim: 8}\n", "uses YAML anchors/aliases"),
        ("model: {dim: 8}\ntrain: {<<: {steps: 1}}\n", None),  # a merge key without an alias is plain data
        ("model: " + "[" * 40 + "]" * 40 + "\n", "nests deeper than 32 levels"),
        ("model: {dim: 8\n", "it is not valid YAML"),
    ],
)
def test_yaml_is_parsed_with_bounds(tmp_path: Path, text: str, message: str | None) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    start = time.perf_counter()
    content, reason = recipe_check.load(path)
    assert time.perf_counter() - start < 5.0
    if message is None:
        assert reason is None and isinstance(content, dict)
    else:
        assert content is None and reason is not None and message in reason, reason


def test_oversized_and_binary_files_are_refused_without_reading_them_whole(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("model:\n  name: " + "x" * recipe_check.MAX_RECIPE_BYTES + "\n")
    assert "larger than 1048576 bytes" in recipe_check.load(big)[1]
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"model: \xff\xfe\n")
    assert "not UTF-8" in recipe_check.load(binary)[1]


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A recipe root holding a good recipe, an alias bomb and the attacker's repackaging pair."""
    (tmp_path / "good.yaml").write_text("# Good.\nmodel:\n  name: good\ntrain:\n  steps: 2\n")
    (tmp_path / "bomb.yaml").write_text(_bomb(12))  # 9^12: it would never finish expanding
    (tmp_path / "evil.yaml").write_text("defaults:\n  - /recipe@hydra.callbacks.pwn: good\n  - _self_\n")
    monkeypatch.setenv("FRAMEWORK_RECIPE_PATH", str(tmp_path))
    return tmp_path


def test_validate_refuses_the_attack_and_a_bomb_does_not_touch_other_recipes(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    start = time.perf_counter()
    assert recipe_cli.main(["validate", "good"]) == 0  # the bomb next to it is never expanded
    assert "recipe good" in capsys.readouterr().out
    assert recipe_cli.main(["validate", "bomb"]) == 2
    assert "uses YAML anchors/aliases" in capsys.readouterr().err
    assert recipe_cli.main(["validate", "evil"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: recipe 'evil'") and "is refused" in err and err.count("\n") == 1
    assert time.perf_counter() - start < 30.0


@pytest.mark.parametrize(
    "overrides, message",
    [
        # The same packaging from the command line: the composed result's choices are checked.
        (["+recipe@hydra.callbacks.pwn=good"], "the recipe 'good' is composed into 'hydra.callbacks.pwn'"),
        (["+hydra.callbacks.pwn._target_=builtins.open"], "hydra.callbacks.pwn._target_='builtins.open'"),
        # A doubling chain typed on the command line is bounded too (the composed config is checked).
        (
            [
                "logger.tags=[ab,'${logger.tags.0}${logger.tags.0}'"
                + "".join(f",'${{logger.tags.{i}}}${{logger.tags.{i}}}'" for i in range(1, 40))
                + "]"
            ],
            "would expand to more than 1048576 characters",
        ),
    ],
)
def test_composed_result_is_checked(
    root: Path, capsys: pytest.CaptureFixture[str], overrides: list[str], message: str
) -> None:
    assert recipe_cli.main(["validate", "good", *overrides]) == 2
    err = capsys.readouterr().err
    assert "is refused" in err and message in err, err


# ------------------------------------------------------------------------------------------------
# Recipes may set values, not places or trust: the table COMMAND_LINE_ONLY, checked against the
# schema and tested from itself.
# ------------------------------------------------------------------------------------------------
# A field name that names a place (``val_path``, ``cache_dir``, ``topo_dump_file``, ``init_from``...).
PLACE_LIKE = re.compile(
    r"(^|_)(path|paths|dir|file|files|baseline|reference|resume|entity|url|hub|root|store|from)(_|$)"
)


def _schema_leaves(cls: type = config.Config, prefix: str = "") -> list[tuple[str, Any]]:
    """Every leaf field of the schema (list entries of a dataclass as ``key[].field``) and its type."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], f"{prefix}{f.name}"
        args = typing.get_args(tp)
        if key in recipe_places.NAMED:  # name -> {_target_, values}: the table says * for each name
            out += [(f"{key}.*._target_", str), (f"{key}.*", Any)]
        elif dataclasses.is_dataclass(tp):
            out += _schema_leaves(tp, f"{key}.")
        elif typing.get_origin(tp) is list and args and dataclasses.is_dataclass(args[0]):
            out += _schema_leaves(args[0], f"{key}[].")
        else:
            out.append((key, tp))
    return out


def _holds_str(tp: Any) -> bool:
    return tp is str or tp is Path or any(_holds_str(a) for a in typing.get_args(tp))


def test_every_place_like_or_string_field_is_classified() -> None:
    """A new field named like a place must be in COMMAND_LINE_ONLY; a new string field in it or in
    NOT_PLACES (a decision, written down, that it names no place)."""
    leaves = dict(_schema_leaves())
    table, values = recipe_places.COMMAND_LINE_ONLY, recipe_places.NOT_PLACES
    unknown = sorted((set(table) | set(values)) - set(leaves))
    assert not unknown, f"not schema keys: {unknown}"
    assert not set(table) & set(values)
    named = [k for k in leaves if PLACE_LIKE.search(k.rsplit(".", 1)[-1])]
    place_like = sorted(k for k in named if k not in table and k not in values)
    assert not place_like, f"path-like fields a recipe may set: add them to COMMAND_LINE_ONLY: {place_like}"
    strings = sorted(k for k, tp in leaves.items() if _holds_str(tp) and k not in table and k not in values)
    assert not strings, f"string fields in neither COMMAND_LINE_ONLY nor NOT_PLACES: {strings}"


def _nested(key: str, value: Any) -> dict[str, Any]:
    node: Any = value
    for part in reversed(key.split(".")):
        node = [node] if part.endswith("[]") else node
        node = {part.removesuffix("[]"): node}
    return node


@pytest.fixture
def cmd_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "root"
    folder.mkdir()
    (folder / "good.yaml").write_text("# Good.\nmodel:\n  name: good\n")
    for key, guard in recipe_places.COMMAND_LINE_ONLY.items():
        content = {**_nested(key, guard.example)}
        for ck, cv in guard.context:
            group, leaf = ck.split(".")
            content.setdefault(group, {})[leaf] = cv
        name = "sets_" + key.replace(".", "_").replace("[]", "")
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(content))
    monkeypatch.setenv("FRAMEWORK_RECIPE_PATH", str(folder))
    return folder


@pytest.mark.parametrize("key", sorted(recipe_places.COMMAND_LINE_ONLY))
def test_command_line_only_keys_are_refused_in_a_recipe_and_accepted_on_the_command_line(
    cmd_root: Path, capsys: pytest.CaptureFixture[str], key: str
) -> None:
    guard = recipe_places.COMMAND_LINE_ONLY[key]
    name = "sets_" + key.replace(".", "_").replace("[]", "")
    assert recipe_cli.main(["validate", name]) == 2
    err = capsys.readouterr().err
    written = key.replace("[]", "[0]")
    assert err.count("\n") == 1 and f"it sets {written}=" in err, err
    assert f"set {written} on the command line" in err, err
    if key == "data.mix[].path":
        value = f"data.mix=[{{path: {guard.example}}}]"
    elif "*" in key:  # a name of the mapping: the shipped profiler's own class, on the command line
        value = f"{key.replace('*', 'profiler')}={json.dumps(guard.example)}"
    else:
        value = f"{key}={json.dumps(guard.example)}"
    context = [f"{k}={json.dumps(v)}" for k, v in guard.context]
    # On the command line the key is not refused as a place: `validate` then runs the launcher's own
    # checks, which may refuse the example value itself (a path that does not exist, /etc/passwd as data).
    code = recipe_cli.main(["validate", "good", *context, value])
    out = capsys.readouterr()
    assert "a recipe may set values" not in out.err and "it sets" not in out.err, out.err
    assert (code == 0 and "valid" in out.out) or (code != 0 and out.err.count("error:") == 1), out


def test_a_recipe_may_name_data_inside_its_own_folder_only(tmp_path: Path) -> None:
    folder = tmp_path / "team"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "train.jsonl").write_text('{"text": "hi"}\n')
    secret = tmp_path / "secret.txt"
    secret.write_text("key")
    (folder / "data" / "leak.jsonl").symlink_to(secret)
    (folder / "link.jsonl").symlink_to(secret)
    ok = {"data": {"path": "data/train.jsonl"}}
    assert recipe_check.refusal(ok, folder) is None
    assert recipe_places.localized(ok, folder)["data"]["path"] == str(
        (folder / "data" / "train.jsonl").resolve()
    )
    for value, why in [
        ("../secret.txt", "leaves the recipe's folder"),
        ("link.jsonl", "leaves the recipe's folder"),
        ("data", "holds a symlink that leaves the recipe's folder"),
        (str(secret), "is not a relative path"),
        ("~/x", "is not a relative path"),
        ("data/*.jsonl", "is a glob"),
        ("org/hub_dataset", "does not exist in the recipe's folder"),
    ]:
        reason = recipe_check.refusal({"data": {"path": value}}, folder)
        assert reason is not None and why in reason and "set data.path on the command line" in reason, reason
    assert recipe_check.refusal({"checkpoint": {"resume": "none"}}, folder) is None  # a value, not a place
    assert "NCCL_DEBUG_FILE" in recipe_check.refusal({"nccl": {"env": {"NCCL_DEBUG_FILE": "/x"}}}, folder)
