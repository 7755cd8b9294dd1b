"""The ``run``, ``executor``, ``freeze``, ``logger`` and ``callbacks`` groups' rules (how a run executes and
reports).
"""

from __future__ import annotations

from typing import Any

from framework.config.rules.rule import (
    MAX_RESTARTS,
    MAX_STEPS,
    TYPED,
    Rule,
    integer,
    is_int,
    name,
    names_list,
    optional_path,
)
from framework.config.schema import Config, ExecutorMode


def _profile_ok(v: Any, c: Config) -> bool:
    r = c.run
    if not is_int(v) or not 1 <= v <= MAX_STEPS:
        return False
    return not r.profile or r.profile_wait + r.profile_warmup + v <= c.train.steps


def _fault_step_ok(v: Any, c: Config) -> bool:
    return is_int(v) and (v == -1 or 1 <= v <= c.train.steps)


def _fault_rank_ok(v: Any, c: Config) -> bool:
    return is_int(v) and -1 <= v < c.mesh.world_size


# Always registered: no need to import torch._dynamo (seconds) in the launcher to accept them.
BUILTIN_BACKENDS = ("inductor", "aot_eager", "eager", "cudagraphs")


def _backend_ok(v: Any, c: Config) -> bool:
    if c.executor.mode is ExecutorMode.eager or v in BUILTIN_BACKENDS:
        return isinstance(v, str) and v.strip() != ""
    return v in _compile_backends()


def _compile_backends() -> list[str]:
    """Every name ``torch.compile(backend=...)`` accepts here, entry-point plugins included."""
    import torch._dynamo

    return torch._dynamo.list_backends(exclude_tags=())


def _backend_valid(c: Config) -> str:
    if c.executor.mode is ExecutorMode.eager:
        return "a torch.compile backend name"
    return f"a registered torch.compile backend: {', '.join(_compile_backends())}"


RUN_RULES: dict[str, Rule] = {
    # run
    "run.device": TYPED,
    "run.expandable_segments": TYPED,
    "run.dry_run": TYPED,
    "run.deterministic": TYPED,
    "run.max_restarts": integer(0, MAX_RESTARTS),
    "run.profile": TYPED,
    "run.profile_ranks": TYPED,
    "run.profile_wait": integer(0, MAX_STEPS),
    "run.profile_warmup": integer(0, MAX_STEPS),
    "run.profile_active": Rule(
        lambda c: (
            f"an integer in 1..{MAX_STEPS}; with run.profile=true, profile_wait + profile_warmup + profile_active "
            f"<= train.steps={c.train.steps}, or no trace is recorded"
        ),
        _profile_ok,
        (0, 1000),
        context=(("run.profile", True), ("train.steps", 10)),
    ),
    "run.instantiate_allow": Rule(
        "module prefixes such as 'framework.' (an empty prefix would allow every importable name)",
        lambda v, _c: all(isinstance(p, str) and p.strip(".").strip() for p in v),
        ([""], ["."]),
    ),
    "run.fault_kill_at_step": Rule(
        lambda c: f"-1 (off) or a step in 1..train.steps={c.train.steps}",
        _fault_step_ok,
        (-2, 0, 10**6),
    ),
    "run.fault_raise_at_step": Rule(
        lambda c: f"-1 (off) or a step in 1..train.steps={c.train.steps}",
        _fault_step_ok,
        (-2, 0, 10**6),
    ),
    "run.fault_rank": Rule(
        lambda c: (
            f"-1 (every rank) or a rank of this mesh: 0..{c.mesh.world_size - 1} (world size {c.mesh.world_size})"
        ),
        _fault_rank_ok,
        (-2, 1, 64),
    ),
    "run.oversubscribe": TYPED,  # the CPU rank cap: framework.launch.ranks.check_local_resources
    "run.allow_over_memory": TYPED,  # the memory refusal: framework.planner.resolve.make_plan
}


# The keys after freeze.mode (whose rule reads the family's record: framework.launch.rules).
FREEZE_RULES: dict[str, Rule] = {
    "freeze.strict": TYPED,
    "freeze.check_graph_breaks": TYPED,
    "freeze.ignore": names_list("submodule or method paths (non-empty strings)"),
    "freeze.export_methods": names_list("method names (non-empty strings)"),
}


EXECUTOR_RULES: dict[str, Rule] = {
    # executor
    "executor.mode": TYPED,  # cudagraphs needs CUDA (in a dry run the declared): framework.launch.prelaunch.check_cudagraphs
    "executor.scope": TYPED,
    "executor.backend": Rule(
        _backend_valid, _backend_ok, ("no_such_backend",), context=(("executor.mode", "compile"),)
    ),
    "executor.compile_loss": Rule(
        "true (default) or false, only with a compiled executor; false with executor.scope=model is refused",
        checked_by="framework.config.rules.keys.check_option_fields (only_with executor.mode) and "
        "framework.planner.plan (executor.scope=model)",
        bad=(False,),
    ),
    "executor.warmup_steps": integer(0, MAX_STEPS),
    "executor.autotune": TYPED,
    "executor.cache_dir": Rule(
        "a directory that can be created",
        checked_by="framework.launch.prelaunch.check_dir_creatable",
        bad=("pyproject.toml",),
        context=(("executor.mode", "compile"),),
    ),  # fmt: skip
}


LOGGER_RULES: dict[str, Rule] = {
    # logger
    "logger.kind": TYPED,
    "logger.project": name(),
    "logger.progress_bar": TYPED,
    "logger.entity": optional_path("a wandb entity name"),
    "logger.mode": TYPED,
    "logger.tags": names_list("non-empty tag strings"),
    "logger.plot": TYPED,
    # callbacks: each entry is built once through the allowlist before launch (check_callbacks)
    "callbacks": Rule(
        "name -> {_target_: a framework.train.callbacks.Callback class under run.instantiate_allow, its "
        "values}, or null (off); the keys that ask for a shipped callback need it",
        checked_by="framework.train.callbacks.check_callbacks",
        bad=(
            {"typo": {"every": 3}},
            {"mine": {"_target_": "framework.train.profiling.Profiling", "every": 3}},
            {"notone": {"_target_": "framework.train.runner.Step"}},
            {"evil": {"_target_": "os.system", "command": "id"}},
        ),
    ),
}
