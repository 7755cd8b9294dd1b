"""Recipe roots (folders and installed packages), the recipes CLI, and refusal of unsafe recipes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from framework.launch import recipe_cli, recipes

ROOT = Path(__file__).resolve().parents[2]
TEAM_RECIPE = """# Team recipe: the tiny model with a shorter schedule.
model:
  name: team_tiny
train:
  steps: 4
  seq_len: 32
  global_batch_size: 4
  micro_batch_size: 2
  eval_every: 0
"""
# Hydra instantiates callbacks before any of our code runs, and its own blocklist lets this one
# through (checked by hand: without the refusal the marker file appears).
HYDRA_CALLBACK = """# Looks harmless; writes a file through Hydra's callbacks.
hydra:
  callbacks:
    pwn:
      _target_: shutil.copyfile
      _args_: ["{src}", "{marker}"]
"""
TARGET_IN_DATA = """# Smuggles a _target_ into a free-form dict.
nccl:
  env:
    _target_: os.system
"""
WIDEN = """# Widens the allowlist for itself.
run:
  instantiate_allow: ["os."]
"""
# No `hydra:` key: a defaults entry packages another recipe (the payload) into hydra.callbacks.
REPACKAGE = """# Looks harmless; its defaults move the payload into hydra.callbacks.
defaults:
  - /recipe@hydra.callbacks.pwn: payload
  - _self_
model:
  name: repackaged
"""
PAYLOAD = """_target_: shutil.copyfile
src: {src}
dst: {marker}
"""
PRELOAD = """# Loads a library into every rank.
nccl:
  env:
    LD_PRELOAD: /tmp/evil.so
"""
READS_ENV = """# Writes a secret into config.yaml.
model:
  name: ${oc.env:FRAMEWORK_TEST_SECRET}
"""
# Round 4: a framework function called with the recipe's arguments, through a list of lists (which
# the place check read as one value) under `_args_` (a key starting with `_`); the composed check
# accepted any target under `framework.`. Without the refusal the marker file appeared.
ARGS_IN_LISTS = """# Looks like a callback's values.
callbacks:
  profiler:
    _args_: [[{{_target_: framework.launch.data_cli.main, _args_: [[prepare, "{marker}", "{src}"]]}}]]
"""
MAIN_TARGET = """# The command line's own entry, with command-line trust.
optimizer:
  _target_: framework.__main__.main
"""
BAD_CALLBACK_VALUE = """# A value the profiler callback does not take: safe, but train.py refuses it.
callbacks:
  profiler:
    every: 3
"""
# 9 levels of 9 aliases: 9^9 = 387 million strings from 431 bytes.
ALIAS_BOMB = (
    '# An alias bomb.\na: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n'
    + "".join(
        f"{k}: &{k} [{', '.join(['*' + p] * 9)}]\n" for p, k in zip("abcdefgh", "bcdefghi", strict=True)
    )
)
# Schema-valid: every tag doubles the one before it (2^60 characters).
DOUBLING = "logger:\n  tags:\n    - xx\n" + "".join(
    f"    - ${{logger.tags[{i}]}}${{logger.tags[{i}]}}\n" for i in range(60)
)


@pytest.fixture
def team_package(tmp_path: Path) -> tuple[Path, Path]:
    """An installed-package root (teamrecipes/llama/*.yaml on sys.path) with good and bad recipes."""
    site = tmp_path / "site"
    folder = site / "teamrecipes" / "llama"
    folder.mkdir(parents=True)
    (site / "teamrecipes" / "__init__.py").write_text("")
    (folder / "team_tiny.yaml").write_text(TEAM_RECIPE)
    marker = tmp_path / "PWNED"
    (folder / "evil_callback.yaml").write_text(HYDRA_CALLBACK.format(src=ROOT / "README.md", marker=marker))
    (folder / "evil_target.yaml").write_text(TARGET_IN_DATA)
    (folder / "evil_widen.yaml").write_text(WIDEN)
    (folder / "evil_repackage.yaml").write_text(REPACKAGE)
    (folder / "payload.yaml").write_text(PAYLOAD.format(src=ROOT / "README.md", marker=marker))
    (folder / "evil_preload.yaml").write_text(PRELOAD)
    (folder / "evil_env.yaml").write_text(READS_ENV)
    (folder / "evil_alias_bomb.yaml").write_text(ALIAS_BOMB)
    (folder / "evil_doubling.yaml").write_text(DOUBLING)
    (folder / "evil_args_in_lists.yaml").write_text(ARGS_IN_LISTS.format(src=ROOT / "README.md", marker=marker))
    (folder / "evil_main_target.yaml").write_text(MAIN_TARGET)
    (folder / "bad_callback_value.yaml").write_text(BAD_CALLBACK_VALUE)
    return site, marker


def _env(site: Path, root: str) -> dict[str, str]:
    env = {**os.environ, "FRAMEWORK_RECIPE_PATH": root, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT), env.get("PYTHONPATH", "")])
    env.pop("RUN_STAMP", None)
    return env


def test_package_root_resolves_without_importing(team_package: tuple[Path, Path], monkeypatch) -> None:
    site, _ = team_package
    monkeypatch.syspath_prepend(str(site))
    assert recipes.package_root("pkg://teamrecipes.llama") == site / "teamrecipes" / "llama"
    with pytest.raises(ValueError, match="no installed package 'nope_pkg'"):
        recipes.package_root("pkg://nope_pkg.recipes")


def test_refusal_reasons() -> None:
    assert recipes.refusal({"model": {"dim": 8}}) is None
    assert "hydra" in recipes.refusal({"hydra": {"run": {"dir": "x"}}})
    assert "Hydra option" in recipes.refusal({"defaults": [{"override /hydra/launcher": "x"}]})
    assert "instantiate_allow" in recipes.refusal({"run": {"instantiate_allow": ["os."]}})


def test_list_shows_extra_roots_with_source_and_description(team_package: tuple[Path, Path]) -> None:
    site, _ = team_package
    out = subprocess.run(
        [sys.executable, "-m", "framework.launch.recipe_cli", "list"],
        cwd=ROOT,
        env=_env(site, "pkg://teamrecipes.llama"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines()}
    assert "Team recipe: the tiny model" in lines["team_tiny"]
    assert str(site / "teamrecipes" / "llama" / "team_tiny.yaml") in lines["team_tiny"]
    assert "recipes/llama_tiny.yaml" in lines["llama_tiny"]
    assert "REFUSED" in lines["evil_callback"] and "REFUSED" not in lines["team_tiny"]
    assert "anchors/aliases" in lines["evil_alias_bomb"]  # listed (bounded), the others unaffected


def test_validate_prints_the_plan_or_the_error(
    team_package: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    site, _ = team_package  # in-process: the CLI's main(), with the extra root on the environment
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("FRAMEWORK_RECIPE_PATH", "pkg://teamrecipes.llama")
    # sharding=ddp: under auto the search's choice for this tiny model moves with the cost model
    # (since pipelines carry tied embeddings it plans zbv on 2 ranks); what is tested is the printing.
    assert recipe_cli.main(["validate", "team_tiny", "mesh=2", "sharding=ddp"]) == 0
    out = capsys.readouterr().out
    assert "team_tiny" in out and "valid" in out and "plan: ddp on 2 ranks" in out
    assert recipe_cli.main(["validate", "team_tiny", "mesh=4", "sharding=ddp", "train.global_batch_size=6"]) == 2
    assert "global_batch_size=6" in capsys.readouterr().err
    assert recipe_cli.main(["validate", "evil_widen"]) == 2
    assert "is refused: it sets run.instantiate_allow" in capsys.readouterr().err
    assert recipe_cli.main(["validate", "evil_repackage"]) == 2  # was reported "valid"
    assert "evil_repackage" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name, message",
    [
        ("evil_callback", "may not configure Hydra"),
        ("evil_target", "nccl.env._target_ is refused: only NCCL_*"),
        ("evil_widen", "run.instantiate_allow"),
        ("evil_repackage", "its defaults select a Hydra option ({'/recipe@hydra.callbacks.pwn': 'payload'})"),
        ("evil_preload", "nccl.env.LD_PRELOAD is refused: only NCCL_* / TORCH_NCCL_* variables"),
        ("evil_env", "calls the resolver 'oc.env'"),
        ("evil_alias_bomb", "uses YAML anchors/aliases"),
        ("evil_doubling", "logger.tags.20 would expand to more than 1048576 characters"),
        ("evil_args_in_lists", "it sets callbacks.profiler._args_: a key starting with `_` is an instruction"),
        ("evil_main_target", "optimizer._target_='framework.__main__.main' is not on the instantiation allowlist"),
    ],
)
def test_unsafe_recipe_is_refused_before_anything_runs(
    team_package: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, message: str
) -> None:
    """Through train.py and real Hydra: exit 2, one line naming the recipe and why, nothing written,
    no payload run, within the timeout (the bombs used to hang with no output). train.py runs in a
    child forked from this process (tests/entry.py: no fresh interpreter importing torch, 3-4 s of
    CPU each), the package root on its sys.path; the Hydra callback's case in a fresh
    ``python train.py``, as a user's shell runs it."""
    from tests.entry import train_forked

    site, marker = team_package
    run_dir = tmp_path / "run"
    env = {**_env(site, "pkg://teamrecipes.llama"), "FRAMEWORK_TEST_SECRET": "hunter2"}
    argv = [f"recipe={name}", f"hydra.run.dir={run_dir}"]
    if name == "evil_callback":
        proc = subprocess.run(
            [sys.executable, "train.py", *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )
    else:
        monkeypatch.syspath_prepend(str(site))  # what PYTHONPATH gives a fresh interpreter
        proc = train_forked(*argv, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    # A target is judged on the composed config, where it may have come from the command line too.
    prefix = "error: " if name == "evil_main_target" else f"error: recipe '{name}'"
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(prefix), proc.stderr
    assert message in proc.stderr and "hunter2" not in proc.stdout + proc.stderr
    assert not run_dir.exists() and not marker.exists()


@pytest.mark.parametrize(
    "name, message",
    [
        ("evil_args_in_lists", "is refused: it sets callbacks.profiler._args_"),
        ("evil_main_target", "is refused: optimizer._target_='framework.__main__.main' is not on the"),
        ("bad_callback_value", "callbacks.profiler: got an unexpected keyword argument 'every'"),
    ],
)
def test_validate_runs_every_check_train_py_runs(
    team_package: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    name: str, message: str,
) -> None:
    """`recipes validate` called the round-4 recipes valid: it now runs the launcher's own checks (the
    composed targets, the callbacks built once), and nothing of the payload runs."""
    site, marker = team_package
    monkeypatch.setenv("FRAMEWORK_RECIPE_PATH", "pkg://teamrecipes.llama")
    monkeypatch.syspath_prepend(str(site))
    assert recipe_cli.main(["validate", name]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: recipe '{name}'") and message in err[0], err
    assert not marker.exists()


def test_a_root_may_not_replace_a_shipped_recipe_nor_link_files_from_outside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.entry import train_main

    root = tmp_path / "team"
    root.mkdir()
    (root / "llama_tiny.yaml").write_text("# Team's own.\ntrain:\n  steps: 1\n")
    secret = tmp_path / "credentials"
    secret.write_text("# aws_secret_access_key = hunter2\n")
    (root / "leak.yaml").symlink_to(secret)
    (root / "team_tiny.yaml").write_text(TEAM_RECIPE)
    (root / "alias.yaml").symlink_to(root / "team_tiny.yaml")  # inside the root: fine
    monkeypatch.setenv("FRAMEWORK_RECIPE_PATH", str(root))
    assert recipe_cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert "hunter2" not in out
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert "REFUSED: it is a symlink that leaves its root" in lines["leak"], lines["leak"]
    assert "REFUSED: it has the name of the shipped recipe" in lines["llama_tiny"], lines["llama_tiny"]
    assert "REFUSED" not in lines["alias"] and "REFUSED" not in lines["team_tiny"]
    assert recipe_cli.main(["validate", "llama_tiny"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rename the root's file" in err, err
    run = tmp_path / "run"
    assert train_main(f"hydra.run.dir={run}") == 2  # the default recipe is llama_tiny: not replaced
    err = capsys.readouterr().err
    assert "the name of the shipped recipe" in err and not run.exists(), err
    assert recipe_cli.main(["validate", "alias"]) == 0
    monkeypatch.delenv("FRAMEWORK_RECIPE_PATH")
    recipes.register()  # the shipped llama_tiny again, for the tests that follow in this process
    assert "llama_tiny" not in recipes.REFUSED


def _unbounded_template_folder(tmp: Path) -> Path:
    import json
    import shutil

    tok = tmp / "tok"
    shutil.copytree(recipes.SHIPPED_ROOT / "data" / "sft_tiny", tok)
    conf = json.loads((tok / "tokenizer_config.json").read_text())
    loops = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"
    (tok / "tokenizer_config.json").write_text(json.dumps({**conf, "chat_template": loops}))
    return tok


def _50m_layer_hf_folder(tmp: Path) -> Path:
    import json

    from tests.checkpoint.test_checkpoint_import_hf import MODELS, make_hf_model

    hf = tmp / "hf"
    make_hf_model(hf, *MODELS["mha_tied"])
    conf = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**conf, "num_hidden_layers": 50_000_000}))
    return hf


VALIDATE_BAD = [
    ("llama_tiny", lambda _t: ["train.eval_batches=100000000"], "train.eval_batches=100000000 is not valid"),
    ("llama_tiny", lambda _t: ["mesh=99999999999"], "is 99999999999 ranks"),
    ("llama_tiny", lambda t: [f"model.init_from={_50m_layer_hf_folder(t)}"], "model.n_layers=50000000"),
    (
        "sft_tiny",
        lambda t: [f"tokenizer.path={_unbounded_template_folder(t)}"],
        "the chat template is refused: rendering one conversation ran over",
    ),
]


@pytest.mark.parametrize("name, overrides, message", VALIDATE_BAD, ids=[v[2][:30] for v in VALIDATE_BAD])
def test_validate_uses_the_launchers_checks(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    name,
    overrides,
    message,
) -> None:
    """`recipes validate` called these valid while train.py hung or refused them: it now runs the
    same checks (the rules, init_from's config.json, the data and its chat template)."""
    monkeypatch.chdir(recipes.SHIPPED_ROOT.parent)  # the recipes' data paths are relative to the repo
    assert recipe_cli.main(["validate", name, *overrides(tmp_path)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], errors


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["sharding=nope"], "sharding=nope: no such option in group 'sharding'; available: auto"),
        (["train.lr=abc"], "train.lr=abc: not a number (train.lr is a float)"),
        (["train.lr=["], "train.lr=[: cannot be parsed"),
        (["+train.lrr=1"], "did you mean train.lr?"),
        (["model.dim=0"], "model.dim=0 is not valid; valid: a positive multiple of model.n_heads=4"),
    ],
    ids=lambda v: v[0] if isinstance(v, list) else None,
)
def test_validate_exits_2_with_train_py_s_one_line_for_a_bad_input(
    capsys: pytest.CaptureFixture[str], overrides: list[str], message: str
) -> None:
    """Every bad input is exit 2 and one line, as train.py says it: a bad value was exit 1 and a
    bad override Hydra's several lines (its search path, full_key, object_type)."""
    assert recipe_cli.main(["validate", "llama_tiny", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: recipe 'llama_tiny' (") and message in err[0], err
    assert recipe_cli.main(["validate", "no_such_recipe"]) == 2
    assert "error: no recipe 'no_such_recipe'; known: [" in capsys.readouterr().err


def test_validate_help_states_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        recipe_cli.main(["validate", "--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "exit status: 0 valid (the plan is printed); 2 a bad input" in out
    assert "1 the validator itself failed (a bug)" in out


def test_a_recipe_naming_its_family_as_a_value_selects_the_model_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A team's recipe written before the model group (``model: {family: mistral, sliding_window: 32}``)
    composes as it did: its family value selects the group's option, so the family's own key exists."""
    from framework.config.schema import MistralConfig, Qwen3Config

    root = tmp_path / "team"
    root.mkdir()
    (root / "old_mistral.yaml").write_text("model:\n  family: mistral\n  sliding_window: 32\ntrain:\n  steps: 2\n")
    (root / "new_qwen3.yaml").write_text("defaults:\n  - override /model: qwen3\ntrain:\n  steps: 2\n")
    monkeypatch.setenv("FRAMEWORK_RECIPE_PATH", str(root))
    try:
        old = recipes.compose_recipe("old_mistral")
        assert (type(old.model), old.model.sliding_window, old.train.steps) == (MistralConfig, 32, 2)
        assert type(recipes.compose_recipe("new_qwen3").model) is Qwen3Config
    finally:
        monkeypatch.delenv("FRAMEWORK_RECIPE_PATH")
        recipes.register()


def _recipe_target(name: str) -> list[str]:
    """The mesh and hardware a shipped recipe is for: the default (one CPU rank) for a model under
    1B parameters (framework.kernels.target.GPU_SIZED_PARAMS), else the fewest H200s of
    8, 4x8, 16x8, 32x8 that hold it (found by dry runs; a recipe that outgrows its mesh fails below)."""
    on_16x8 = {"gpt_314b", "gpt_462b", "llama3_405b", "nemotron4_340b", "qwen3_235b_a22b"}
    on_4x8 = {"gpt3_175b", "gpt_119b", "gpt_177b", "gpt_oss_120b"}
    on_32x8 = {"deepseek_v3_671b", "kimi_k2"}
    if name in on_32x8:
        return ["mesh=32x8", "mesh/hardware=h200"]
    if name in on_16x8 | on_4x8:
        return ["mesh=16x8" if name in on_16x8 else "mesh=4x8", "mesh/hardware=h200"]
    from framework.kernels.target import GPU_SIZED_PARAMS
    from framework.models import num_params
    from tests.config.test_config import compose_config

    small = num_params(compose_config(f"recipe={name}").model) < GPU_SIZED_PARAMS
    return [] if small and name != "qwen3_0_6b" else ["mesh=8", "mesh/hardware=h200"]


# What a recipe needs from its user before it runs (its refusal names it); every other one runs.
NEEDS_USER_FILES = {"llama3_8b_sft": "tokenizer.path"}


@pytest.mark.parametrize("name", sorted(recipes.discover([recipes.SHIPPED_ROOT])))
def test_every_shipped_recipe_dry_runs_without_a_warning(tmp_path: Path, name: str) -> None:
    """A shipped recipe contradicted itself: the byte tokenizer 'left 128,000 embedding rows unused'
    of a synthetic-data benchmark (whose ids span every row), warmup 8,000 over 100 steps, an MoE
    loss span the pipeline overrides. Its dry run on its target (``_recipe_target``) exits 0, fits,
    and neither logs a warning nor raises a Python warning."""
    import json
    import warnings

    from tests.entry import train_main

    run = tmp_path / "run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = train_main(f"recipe={name}", *_recipe_target(name), "run.dry_run=true", f"hydra.run.dir={run}")
    if name in NEEDS_USER_FILES:
        assert code == 2 and not run.exists(), name
        return
    assert code == 0, name
    log = (run / "train.log").read_text()
    assert "WARNING" not in log, [ln for ln in log.splitlines() if "WARNING" in ln]
    assert [str(w.message) for w in caught] == []
    memory = json.loads((run / "plan.json").read_text())["memory"]
    assert memory["total"] <= memory["device"], memory
