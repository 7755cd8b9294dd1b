"""The rule table (framework.launch.rules), tested from the table itself.

For every schema key: a rule exists (a field added without one fails here), and each of the rule's
out-of-range values, set on the composed default config, is refused by the launcher's pre-launch
checks (``framework.launch.prelaunch.prelaunch``, in-process: fast) with one line naming the key and the value,
writing nothing. A handful of them also go through the real ``python train.py`` (exit 2, one error
line, no run dir); the classes whose check is not a key's value (recipes, run dirs, memory, CPU
ranks, intent) have a test each below.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from framework.config import schema as config
from framework.config.schema import Config, RunConfig
from framework.launch import recipe_cli, recipes
from framework.launch.prelaunch import check_dir_creatable, prelaunch
from framework.launch.ranks import check_local_resources, cpu_rank_cap, register_resolvers
from framework.launch.rules import RULES, TYPED, check, check_known_keys, schema_keys, show, value_at
from framework.planner.resolve import make_plan
from tests.entry import train_forked

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "llama_tiny"  # the default recipe: the config every bad value is set on


@pytest.fixture(scope="module")
def base() -> DictConfig:
    config.register()
    recipes.register()
    register_resolvers()
    with initialize_config_dir(config_dir=str(recipes.CONF_DIR), version_base="1.3"):
        return compose("config")


@pytest.fixture(scope="module")
def family_base(base: DictConfig) -> dict[str, DictConfig]:
    """The default config under each family (``model=mistral``): a family's own key
    (``model.sliding_window``) exists only there, so its bad values are set there; a rule whose context
    names ``model.family`` is tested under that family's option (the group selects the family)."""
    out = {}
    for fam in config.MODEL_SCHEMAS:
        with initialize_config_dir(config_dir=str(recipes.CONF_DIR), version_base="1.3"):
            out[fam.value] = compose("config", overrides=[f"model={fam.value}"])
    return out


def base_for(key: str, base: DictConfig, family_base: dict[str, DictConfig]) -> DictConfig:
    """The default config where ``key`` exists: a family's own key under its (first) family."""
    group, _, rest = key.partition(".")
    own = group == "model" and rest.split(".")[0] not in {
        f.name for f in dataclasses.fields(config.ModelConfig)
    }
    return family_base[config.owners(rest.split(".")[0])[0]] if own else base


def with_values(base: DictConfig, values: dict[str, Any]) -> DictConfig:
    """The composed config with ``values`` set as command-line overrides would set them (typed merge)."""
    d = copy.deepcopy(base)
    for key, value in values.items():
        OmegaConf.update(d, key, value, merge=False)
    return d


def refusal(base: DictConfig, values: dict[str, Any], tmp: Path) -> str:
    tmp.mkdir(parents=True, exist_ok=True)
    run = tmp / "run"
    with pytest.raises(ValueError) as info:
        prelaunch(with_values(base, values), run, RECIPE)
    assert not run.exists() and not any(tmp.iterdir()), "a refused config wrote files"
    msg = str(info.value)
    assert "\n" not in msg, msg
    return msg


def test_every_schema_key_has_exactly_one_rule() -> None:
    keys = dict(schema_keys())
    missing = sorted(set(keys) - set(RULES))
    assert not missing, f"schema keys without a rule in framework/launch/rules.py RULES: {missing}"
    assert not sorted(set(RULES) - set(keys)), "rules for keys the schema does not have"
    for key, rule in RULES.items():
        tp = keys[key]
        if rule is TYPED:
            assert tp is bool or (isinstance(tp, type) and issubclass(tp, Enum)), (
                f"{key} ({tp}) is declared typed, but only bools and Enums are constrained by their type"
            )
        else:
            assert (rule.ok is None) != (rule.checked_by == ""), f"{key}: either a check or checked_by"
            assert rule.valid and rule.bad, f"{key}: says what is valid and gives out-of-range values"


def test_the_default_config_and_every_recipe_pass(base: DictConfig, tmp_path: Path) -> None:
    cfg, plan, _ = prelaunch(base, tmp_path / "run", RECIPE)
    assert plan.world_size == 1 and cfg.model.name == RECIPE
    for name in recipes.discover():
        check(recipes.compose_recipe(name))  # big recipes too: the table is about values, not memory


@pytest.mark.parametrize("key", [k for k, r in RULES.items() if r.bad])
def test_every_key_refuses_its_out_of_range_values(
    base: DictConfig, family_base: dict[str, DictConfig], tmp_path: Path, key: str
) -> None:
    rule = RULES[key]
    context = dict(rule.context)
    family = context.pop("model.family", None)
    where = family_base[family] if family else base_for(key, base, family_base)
    for i, bad in enumerate(rule.bad):
        msg = refusal(where, {**context, key: bad}, tmp_path / str(i))
        if isinstance(bad, dict):  # nccl.env and the like: the variable is named
            assert all(name in msg for name in bad), msg
        elif isinstance(bad, list) and bad and dataclasses.is_dataclass(bad[0]):  # data.mix: the entry
            weights, names = (
                [getattr(e, "weight", None) for e in bad],
                [getattr(e, "name", None) for e in bad],
            )
            shown = (
                [f"weight={w}" for w in weights]
                + [f"[{w}]" for w in weights]
                + [f"name={n!r}" for n in names]
            )
            assert key in msg and any(s in msg for s in shown), msg
        else:
            assert key in msg, msg
            shown = [show(bad)[:20], str(bad)[:20], repr(bad)[:20]]
            assert any(s in msg for s in shown), (msg, shown)


def test_non_finite_and_huge_numbers_are_refused_for_every_number_key(
    base: DictConfig, family_base: dict[str, DictConfig]
) -> None:
    """The class, not the example: every float key refuses nan, inf and 1e300, every int key 10**18
    and a 1000-digit value (model.moe.router_aux_loss_coef=1e18 and nccl.timeout_s=1e300 passed; the
    second was an OverflowError in every rank)."""
    hints = dict(schema_keys())
    typed = {id(b): config.to_config(b) for b in (base, *family_base.values())}
    for key, rule in RULES.items():
        if rule.ok is None:
            continue
        default = typed[id(base_for(key, base, family_base))]
        floats, ints = [math.nan, math.inf, 1e300], [10**18, 10**1000]
        bads = floats if hints[key] is float else ints if hints[key] is int else []
        for bad in bads:
            cfg = copy.deepcopy(default)
            for k, v in (*rule.context, (key, bad)):
                group, _, leaf = k.rpartition(".")
                setattr(value_at(cfg, group), leaf, v)
            with pytest.raises(ValueError, match=rf"^{key}="):
                check(cfg)


@pytest.mark.parametrize("kwargs", [{"foreach": "yes"}, {"amsgrad": 1}, {"maximize": "maybe"}])
def test_an_optimizer_switch_that_is_not_a_boolean_is_refused(
    base: DictConfig, tmp_path: Path, kwargs: dict[str, Any]
) -> None:
    """``+optimizer.kwargs.foreach=yes``: torch tests a switch for truth, so a string passed the probe
    and the run trained (exit 0) with whatever the string's truth meant."""
    [(name, value)] = kwargs.items()
    msg = refusal(base, {"optimizer.kwargs": kwargs}, tmp_path)
    assert f"valid: {name}=true or {name}=false ({name}={value!r} is not a boolean)" in msg, msg
    prelaunch(with_values(base, {"optimizer.kwargs": {name: True}}), tmp_path / "ok", RECIPE)


def test_unknown_key_is_refused_with_the_nearest_valid_key(base: DictConfig) -> None:
    d = copy.deepcopy(base)
    with pytest.raises(ValueError, match=r"train.lrr is not a config key .*did you mean train.lr\?"):
        OmegaConf.set_struct(d, False)
        OmegaConf.update(d, "train.lrr", 0.1, force_add=True)
        check_known_keys(d)
    # Free-form dict fields take any key; Hydra's own tree is not ours to police here.
    check_known_keys(with_values(base, {"nccl.env": {"NCCL_DEBUG": "WARN"}}))


def test_self_referencing_interpolation_is_one_line(base: DictConfig, tmp_path: Path) -> None:
    msg = refusal(base, {"train.lr": "${train.lr}"}, tmp_path)
    assert msg.startswith("train.lr: ") and "ecursive" in msg, msg


def test_resume_path_while_checkpointing_is_off(base: DictConfig, tmp_path: Path) -> None:
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    # checkpoint=none (the default option, final, saves)
    msg = refusal(base, {"checkpoint.resume": str(ckpt), "checkpoint.enabled": False}, tmp_path / "t")
    assert "checkpoint.resume=" in msg and "checkpoint.enabled=true" in msg, msg
    prelaunch(with_values(base, {"checkpoint.resume": str(ckpt), "checkpoint.enabled": True}), ckpt, RECIPE)


def test_memory_over_the_device_is_refused_unless_allowed_or_dry_run(base: DictConfig) -> None:
    cfg = config.to_config(with_values(base, {"mesh.hardware.memory_gib": 0.001}))
    with pytest.raises(ValueError, match=r"mesh.hardware.memory_gib=0.001 .*run.allow_over_memory=true"):
        make_plan(cfg)
    for key in ("allow_over_memory", "dry_run"):
        ok = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, **{key: True}))
        assert any("GiB per rank, device has 0.001" in w for w in make_plan(ok).warnings)


def test_held_units_over_memory_refused_naming_the_policy(base: DictConfig, tmp_path: Path) -> None:
    """sharding.reshard_after_forward=false (units held unsharded for the step) where only the held
    units do not fit: one line naming the setting, the GiB per rank it needs against the device's
    and the policy that fits, exit 2 before anything is written; run.allow_over_memory=true and a dry
    run let it through with the memory warning."""
    values = {
        "mesh.shape": [2], "parallel.dp_shard": 2, "sharding.param_dtype": "bfloat16", "model.n_layers": 12,
        "sharding.activation_checkpointing": "none",
    }  # fmt: skip
    plans = {
        raf: make_plan(config.to_config(with_values(base, {**values, "sharding.reshard_after_forward": raf})))
        for raf in (True, False)
    }
    held, resharded = plans[False].memory.total / 2**30, plans[True].memory.total / 2**30
    assert held > resharded
    device = round((held + resharded) / 2, 4)
    bad = {**values, "sharding.reshard_after_forward": False, "mesh.hardware.memory_gib": device}
    msg = refusal(base, bad, tmp_path / "held")
    assert msg.startswith(
        f"sharding.reshard_after_forward=false holds r1 s2 t1's FSDP units unsharded for the step: needs "
        f"{held:.1f} GiB per rank"
    ), msg
    assert f"device has {device:g}" in msg and f"sharding.reshard_after_forward=true ({resharded:.1f} GiB" in msg
    for key in ("run.allow_over_memory", "run.dry_run"):
        plan = make_plan(config.to_config(with_values(base, {**bad, key: True})))
        assert any("FSDP units held unsharded for the step" in w for w in plan.warnings), plan.warnings


def test_context_parallel_refusals(base: DictConfig, tmp_path: Path) -> None:
    """cp on a CPU launch (torch's ring attention is CUDA only), and a cp whose load-balanced
    chunks (2 x cp) do not split the sequence: one line each, nothing written."""
    msg = refusal(base, {"mesh.shape": [2], "parallel.cp": 2, "run.device": "cpu"}, tmp_path / "cpu")
    assert msg.startswith("parallel.cp=2 on the CPU:") and "valid here: parallel.cp=1" in msg, msg
    values = {"mesh.shape": [4], "parallel.cp": 4, "train.seq_len": 36, "run.dry_run": True}
    msg = refusal(base, values, tmp_path / "seq")
    assert (
        "parallel.cp=4 does not split train.seq_len=36" in msg and "valid cp degrees here are [1, 2]" in msg
    )


def test_optimizer_values_are_probed_for_the_run_device(base: DictConfig) -> None:
    """A keyword value that passes the allowlist but fails on the run's device is refused naming the
    value and what is valid there. On a CUDA run the loop adds fused=True, which foreach=True
    contradicts (a crash in every rank before); capturable=True, which needs CUDA tensors, is refused
    on a CPU run and left to the ranks on a CUDA one (the probe's tensors are on the CPU)."""
    from framework.config.schema import to_config

    def cfg(kwargs: dict[str, Any], device: str) -> Config:
        return to_config(with_values(base, {"optimizer.kwargs": kwargs, "run.device": device}))

    check(cfg({"foreach": True}, "cpu"))
    check(cfg({"fused": True}, "cpu"))  # torch's fused AdamW runs on the CPU too
    with pytest.raises(ValueError, match=r"valid: foreach=False, or no foreach \(foreach=True fails on "
                       r"this run's device, cuda: RuntimeError: `fused` and `foreach` cannot be"):  # fmt: skip
        check(cfg({"foreach": True}, "cuda"))
    with pytest.raises(ValueError, match=r"capturable=True fails on this run's device, cpu"):
        check(cfg({"capturable": True}, "cpu"))
    check(cfg({"capturable": True}, "cuda"))
    with pytest.raises(ValueError, match=r"valid: one of fused=True, foreach=True left out \(together"):
        check(cfg({"fused": True, "foreach": True}, "cpu"))


def test_verify_files_are_checked_before_launch(base: DictConfig, tmp_path: Path) -> None:
    """verify.reference at a file that is no fingerprint was a traceback after training;
    verify.baseline at a folder or under a file failed at the end of training, or silently."""
    notes = tmp_path / "in" / "notes.txt"
    notes.parent.mkdir()
    notes.write_text("not json")
    on = {"verify.enabled": True}
    cases = [
        ({"verify.reference": str(notes)}, f"verify.reference: {notes} is not a fingerprint.json written by "
         "freeze=export (JSONDecodeError"),
        ({"verify.baseline": str(notes.parent)}, f"verify.baseline={str(notes.parent)!r} is a folder; valid: a "
         "JSON file path"),
        ({"verify.baseline": str(notes / "b.json")}, f"cannot be created: {str(notes)!r} is a file"),
    ]  # fmt: skip
    for i, (values, message) in enumerate(cases):
        assert message in refusal(base, on | values, tmp_path / f"t{i}")
    assert notes.read_text() == "not json"


STORE_FIGURES = {"step_p50_s": 0.1, "step_p99_s": 0.2, "tokens_per_s": 1000.0}
BAD_STORES = [
    ("[]", "is not a baseline store; valid: a JSON object {'version': 1"),
    ('{"version": 1, "baselines": 5}', "is not a baseline store; valid: a JSON object"),
    ('{"version": 1, "baselines": {"k": {"figures": {"x": 1}}}}', "its entry 'k' has figures ['x'], not "),
    ('{"version": 1, "baselines": {"k": 3}}', "its entry 'k' has no figures"),
    (
        json.dumps({"version": 1, "baselines": {"k": {"figures": STORE_FIGURES | {"tokens_per_s": 0}}}}),
        "its entry 'k' has tokens_per_s=0, not a finite number > 0",
    ),
]


@pytest.mark.parametrize(("store", "message"), BAD_STORES, ids=[m.split(";")[0][:30] for _, m in BAD_STORES])
def test_a_baseline_store_that_does_not_read_is_refused_before_training(
    base: DictConfig, tmp_path: Path, store: str, message: str
) -> None:
    """A store that is a list, of another shape, or with an entry compare_perf cannot use was a
    traceback after training (ZeroDivisionError for tokens_per_s=0), or nothing at all."""
    path = tmp_path / "store" / "baselines.json"
    path.parent.mkdir()
    path.write_text(store)
    msg = refusal(base, {"verify.enabled": True, "verify.baseline": str(path)}, tmp_path / "t")
    assert msg.startswith(f"verify.baseline={str(path)!r}") and message in msg, msg
    good = {"version": 1, "baselines": {"k": {"figures": STORE_FIGURES, "recorded": 1.0}}}
    path.write_text(json.dumps(good))
    prelaunch(with_values(base, {"verify.enabled": True, "verify.baseline": str(path)}), tmp_path / "r", RECIPE)


def test_cpu_ranks_above_the_cap_need_oversubscribe() -> None:
    cfg = Config()
    cfg.mesh.shape = [cpu_rank_cap() + 1]
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"mesh.shape=\[\d+\] starts \d+ CPU ranks .*run.oversubscribe=true"):
        check_local_resources(cfg, cpu)
    for key in ("oversubscribe", "dry_run"):
        check_local_resources(dataclasses.replace(cfg, run=RunConfig(**{key: True})), cpu)
    cfg.mesh.shape = [8]
    check_local_resources(cfg, cpu)  # the shipped meshes run on any host


def test_run_dir_that_is_a_file_or_not_writable(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match=r"hydra.run.dir='.*f/run' cannot be created: .* is a file"):
        check_dir_creatable("hydra.run.dir", str(tmp_path / "f" / "run"))
    locked = tmp_path / "ro"
    locked.mkdir(mode=0o555)
    if os.access(locked, os.W_OK):  # root ignores permission bits; a read-only mount does not
        locked = Path("/proc/sys")
    if os.access(locked, os.W_OK):
        pytest.skip("no unwritable folder on this machine")
    with pytest.raises(ValueError, match=r"hydra.run.dir=.* cannot be written: .* not writable"):
        check_dir_creatable("hydra.run.dir", str(locked / "run"))
    check_dir_creatable("hydra.run.dir", str(tmp_path / "new" / "run"))


def test_recipe_syntax_error_and_missing_root(tmp_path: Path) -> None:
    (tmp_path / "broken.yaml").write_text("train:\n  lr: [1, 2\n  steps: 3\n")
    # Refused when chosen (one line naming the file, line and column); the root's other recipes work.
    recipes.register([tmp_path])
    assert re.fullmatch(
        r"recipe 'broken' \(.*broken.yaml\) is refused: it is not valid YAML: .* line \d+, column \d+",
        recipes.REFUSED["broken"],
    )
    with pytest.raises(ValueError, match=r"recipe root '.*nowhere' is not a directory"):
        recipes.register([tmp_path / "nowhere"])


# The real launcher, for a representative handful: one per way a refusal reaches the user (a value
# rule, a shape relation, an unknown key, the run-dir callback before Hydra's mkdir, a recipe root
# read at import time). Each runs train.py as __main__ with real Hydra in a child forked from this
# process (tests/entry.py: no fresh interpreter importing torch, 3-4 s of CPU each); the ids in
# FRESH also run in a fresh ``python train.py`` process, the path a user's shell takes.
E2E = [
    (["train.lr=nan"], {}, "train.lr=nan"),
    (["model.dim=0"], {}, "model.dim=0"),
    (["+train.lrr=0.1"], {}, "did you mean train.lr"),
    (
        ["optimizer._target_=os.system"],
        {},
        "optimizer._target_='os.system' is not on the instantiation allowlist",
    ),
    (["optimizer._target_=torch.optim.LBFGS"], {}, "LBFGS doesn't support per-parameter options"),
    (["+optimizer.kwargs.eps=-1"], {}, "Invalid epsilon value: -1"),
    (
        ["+optimizer.kwargs.capturable=true", "run.device=cpu"],
        {},
        "valid: capturable=False, or no capturable (capturable=True fails on this run's device, cpu: "
        "AssertionError: If capturable=True, params and state_steps must be on supported devices",
    ),
    (["hydra.run.dir=pyproject.toml/run"], {}, "is a file, not a directory"),
    (["mesh=2", "parallel.cp=2", "run.device=cpu"], {}, "parallel.cp=2 on the CPU: torch's context_parallel"),
    ([], {"FRAMEWORK_RECIPE_PATH": "/nonexistent/recipes"}, "is not a directory"),
]


FRESH = {"train.lr=nan", "is not a directory"}  # a value rule; the recipe root read at import time


@pytest.mark.parametrize("overrides, env, message", E2E, ids=[e[2] for e in E2E])
def test_train_py_refuses_with_exit_2_one_line_and_no_run_dir(
    tmp_path: Path, overrides: list[str], env: dict[str, str], message: str
) -> None:
    run = tmp_path / "run"
    if not any(o.startswith("hydra.run.dir=") for o in overrides):
        overrides = [f"hydra.run.dir={run}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    if message in FRESH:
        proc = subprocess.run(
            [sys.executable, "train.py", *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )
    else:
        proc = train_forked(*overrides, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not run.exists() and not (ROOT / "pyproject.toml" / "run").exists()


# Values the launcher or a rank used to loop over or hold in memory before the first step (issue 24,
# part 3): each is now one line and exit 2 within seconds, through train.py (forked, tests/entry.py)
# and `recipes validate` (its main, in this process).
BOUNDED = [
    (["train.global_batch_size=100000000000"], "train.global_batch_size=100000000000 is not valid"),
    (["mesh=99999999999", "run.dry_run=true"], "mesh.shape=[99999999999] is 99999999999 ranks"),
    (["train.eval_batches=100000000"], "train.eval_batches=100000000 is not valid"),
    (["data.prefetch=1000000000"], "data.prefetch=1000000000 is not valid"),
]


@pytest.mark.parametrize("overrides, message", BOUNDED, ids=[b[1].split("=")[0] for b in BOUNDED])
def test_unbounded_counts_are_refused_before_launch(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], overrides: list[str], message: str
) -> None:
    run = tmp_path / "run"
    proc = train_forked(f"hydra.run.dir={run}", *overrides, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=60)
    capfd.readouterr()
    code = recipe_cli.main(["validate", RECIPE, *overrides])
    validate = capfd.readouterr()
    for returncode, out, err in ((proc.returncode, proc.stdout, proc.stderr), (code, validate.out, validate.err)):
        assert returncode != 0, out[-2000:]
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and message in errors[0], err[-2000:]
    assert not run.exists()


def test_layout_divisors_match_counting_one_by_one() -> None:
    from framework.planner.layout import divisors

    for n in range(200):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0], n
    assert divisors(2**20)[-3:] == [2**18, 2**19, 2**20]


def test_activation_offload_beyond_the_hosts_memory_is_refused_with_the_bytes(
    base: DictConfig, tmp_path: Path
) -> None:
    """sharding.activation_offload keeps the saved activations in host memory: a micro batch whose
    activations are twice what this host has available (MemAvailable) is refused before launch with
    the bytes needed and available; one that fits passes the check (the bytes are the planner's)."""
    from framework.launch.ranks import check_offload_memory, host_available_bytes
    from framework.planner.memory import offloaded_activation_bytes

    on = {"sharding.activation_offload": True}
    one = offloaded_activation_bytes(config.to_config(with_values(base, {**on, "train.micro_batch_size": 1})))
    micro = 2 * host_available_bytes() // one + 1
    values = {**on, "train.micro_batch_size": micro, "train.global_batch_size": micro}
    need = offloaded_activation_bytes(config.to_config(with_values(base, values)))
    msg = refusal(base, values, tmp_path)
    assert "sharding.activation_offload=true" in msg and f"{need:,} bytes" in msg and "available" in msg, msg
    cfg = config.to_config(with_values(base, on))
    check_offload_memory(cfg, available=offloaded_activation_bytes(cfg))  # exactly enough: passes
    with pytest.raises(ValueError, match="needed"):
        check_offload_memory(cfg, available=offloaded_activation_bytes(cfg) - 1)


def test_moe_keys_belong_to_the_sparse_families(
    base: DictConfig, family_base: dict[str, DictConfig], tmp_path: Path
) -> None:
    """model.moe: a key changed on a family that does not read it, the expert count of a sparse family,
    top-k over the experts, TorchScript on a routed model (torch.export freezes it), and ep with a
    dense family: one line each."""
    sparse = {"model.moe.num_experts": 4, "freeze.mode": "none"}
    qwen, mixtral = family_base["qwen3_moe"], family_base["mixtral"]
    cases = [
        (base, {"model.moe.num_experts": 8}, "model.moe.num_experts=8 is not valid; valid: 0 (the default) "
         "with model.family=llama, which does not read it; model.moe.num_experts is for model.family=qwen3_moe|mixtral"),
        (mixtral, {**sparse, "model.moe.moe_intermediate_size": 64},
         "model.moe.moe_intermediate_size=64 is not valid; valid: 0 (the default) with model.family=mixtral"),
        (qwen, {**sparse, "model.moe.num_experts_per_tok": 6},
         "model.moe.num_experts_per_tok=6 is not valid; valid: an integer in 1..model.moe.num_experts=4"),
        (qwen, {**sparse, "freeze.mode": "script"},
         "freeze.mode='script' is not valid; valid: none or export with model.family=qwen3_moe"),
        (qwen, {"freeze.mode": "none"}, "model.moe.num_experts=0 is not valid; valid: an integer in 1..65536"),
        (base, {"mesh.shape": [2], "parallel.ep": 2, "run.device": "cpu"}, "parallel.ep=2"),
    ]  # fmt: skip
    for i, (where, values, line) in enumerate(cases):
        msg = refusal(where, values, tmp_path / str(i))
        assert msg.startswith(line), (msg, line)
    prelaunch(with_values(qwen, sparse), tmp_path / "ok", RECIPE)  # the sparse family itself launches
    # and freezes (torch.export)
    prelaunch(with_values(qwen, {**sparse, "freeze.mode": "export"}), tmp_path / "export", RECIPE)
