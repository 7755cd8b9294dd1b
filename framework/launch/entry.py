"""What ``train.py`` does with a composed config: validate, plan, write the run files, launch.

Every check that can fail on user input runs here (``prelaunch``), before any rank starts: the
recipe's safety (framework.launch.recipes), every ``_target_`` against the allowlist (framework.config.instantiate),
the schema, every key's rule (framework.launch.rules), the mesh, the local resources and the plan. A
failed check prints one clear error, removes what Hydra just created (the run dir only when this
invocation created it and it holds nothing but Hydra's own files; never a folder that existed)
and exits with status 2. A run dir that is a file or not writable is refused
earlier still, before Hydra creates it (``RunDirCheck``).

In a multirun sweep a job never ends the process: a failure is recorded in the job's ``job.json``
and the job returns NaN, so the other jobs run and the sweep summary (framework.launch.sweep) reports it;
a job that already completed in a previous run of the same sweep is skipped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework.checkpoint.lock import LockHeld, Owner
from framework.config.schema import (
    AttentionBackend,
    AuxLossScope,
    Config,
    ExecutorMode,
    Float8Recipe,
    LoggerKind,
    RunConfig,
    VerifyConfig,
    to_config,
    to_yaml,
)
from framework.data import check_document_kernel
from framework.data.tokens import DATA_CHANGED, DataChanged
from framework.kernels import fa4, float8, fused_ce, target
from framework.launch import sweep
from framework.launch.failures import describe_failures
from framework.launch.ranks import (
    adopt_submitit_environment,
    apply_allocator_environment,
    check_local_resources,
    check_offload_memory,
    check_torch,
    isolated_environ,
    joined_torchrun,
    spawn_local,
)
from framework.launch.rules import check as check_rules
from framework.launch.rules import check_known_keys, check_layout, check_model_shape
from framework.launch.worker import LOCK_HELD
from framework.models import linears, model_spec
from framework.parallel.lora import check_layout as lora_layout
from framework.parallel.process import resolve_device
from framework.planner import stages as pipeline_stages
from framework.planner.layout import fixed_degrees
from framework.planner.plan import Plan
from framework.planner.report import format_plan, plan_to_dict
from framework.planner.resolve import PLAN_FILE, resolve, write_plan
from framework.planner.search import SearchResult, format_search, search_to_dict
from framework.planner.topology import (
    apply_nccl_environment,
    describe_nccl,
    nccl_environment,
    validate_mesh,
    write_nccl_record,
)
from framework.record.run_dir import GONE_PREFIXES, DirGone, check_creatable
from framework.train.callbacks import check_callbacks

log = logging.getLogger("framework")
HYDRA_FILES = {".hydra", "train.log"}


class JobFailed(Exception):
    """A job's ranks failed or its config was refused; carries the exit status of a single run."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


# Run dir (resolved) -> what existed before Hydra's mkdir: None when the run dir itself did not,
# else the names already inside it. Recorded by ``RunDirCheck`` so that a refusal removes only what
# this invocation created (a user's folder given as hydra.run.dir, and its train.log, stay).
_BEFORE_HYDRA: dict[str, tuple[frozenset[str] | None, list[Path]]] = {}


def note_run_dir(run_dir: Path) -> None:
    """Before Hydra creates ``run_dir``: record whether it (and which parents) exist already."""
    path = Path(run_dir).resolve()
    created = [p for p in (path, *path.parents) if not p.exists()]
    inside = frozenset(p.name for p in path.iterdir()) if path.is_dir() else None
    _BEFORE_HYDRA[str(path)] = (inside, created)


def discard_run_dir(run_dir: Path) -> None:
    """Remove what Hydra wrote for this invocation, never anything else: the run dir and its new
    parents only when this invocation created them and they hold nothing but Hydra's files; in a
    folder that existed before, only the Hydra files that were not there. Nothing without a record."""
    path = Path(run_dir).resolve()
    record = _BEFORE_HYDRA.pop(str(path), None)
    if record is None or not path.is_dir():
        return
    inside, created = record
    if inside is not None:
        for name in HYDRA_FILES - inside:
            target = path / name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target, ignore_errors=True)
            elif target.is_file():
                target.unlink(missing_ok=True)
        return
    if {p.name for p in path.iterdir()} <= HYDRA_FILES:
        shutil.rmtree(path, ignore_errors=True)
        for parent in created[1:]:
            if parent.is_dir() and not any(parent.iterdir()):
                parent.rmdir()


def check_safe(dcfg: DictConfig, recipe: str | None, hydra_cfg: DictConfig | None = None) -> None:
    """Refuse a refused recipe, recipe content composed outside the top level, an interpolation that
    would expand without bound and any ``_target_`` off the allowlist (``hydra.*`` included), before
    anything resolves, builds or runs (framework.launch.recipe_check.check_composed)."""
    from framework.launch.recipe_check import check_composed
    from framework.launch.recipes import REFUSED

    if recipe in REFUSED:
        raise ValueError(REFUSED[recipe])
    allow = OmegaConf.select(dcfg, "run.instantiate_allow", default=None)
    allow = list(allow) if isinstance(allow, ListConfig) else RunConfig().instantiate_allow
    check_composed(dcfg, hydra_cfg, allow)


def validate(dcfg: DictConfig, overrides: list[str] | None = None) -> Config:
    """The typed config, once every key passed its rule (framework.launch.rules) and the local checks.
    ``overrides``: the command line's, which ``model.init_from`` may not contradict
    (framework.checkpoint.init_from: the shape comes from the checkpoint)."""
    from framework.checkpoint import init_from

    check_torch()
    check_known_keys(dcfg)
    cfg = init_from.resolve(to_config(dcfg), overrides or [], check_shape=check_model_shape)
    validate_mesh(cfg.mesh)
    check_rules(cfg)
    check_callbacks(cfg)  # each built once through the allowlist (framework.train.callbacks)
    from framework.data import check_data, follow_tokenizer_vocab

    cfg = follow_tokenizer_vocab(cfg, "vocab_size" in init_from.command_line_keys(overrides or []))
    check_data(cfg)  # tokenizer, files, token files, mixture, document mask: before any rank starts
    # A dry run builds on the meta device and checks the declared mesh/hardware (framework.kernels.target):
    # this host's device (a login node's CPU, run.device=cuda with no GPU, too few GPUs) is not used.
    device = torch.device("meta") if cfg.run.dry_run else resolve_device(cfg.run.device)
    check_local_resources(cfg, device)
    check_offload_memory(cfg)
    check_checkpoint_dir(cfg)
    check_verify_files(cfg)
    if cfg.executor.cache_dir:
        check_dir_creatable("executor.cache_dir", cfg.executor.cache_dir)
    check_hardware(cfg, device)
    check_extras(cfg)
    check_warmup(cfg)
    check_cudagraphs(cfg, device)
    # The layout the user fixed, before any search (None under sharding=auto, where sharding.tp pins
    # TP): read once here for the checks below; the resolved one is the plan's (prelaunch).
    declared = fixed_degrees(cfg)
    check_layout(cfg, declared)
    tp = declared.tp if declared is not None else cfg.sharding.tp
    check_float8(cfg, device, tp)
    check_fa4(cfg, device)
    fa4.check_budget(cfg, fa4.flop_counter_takes_gqa())
    check_document_kernel(cfg, target.of_run(cfg, device).type)
    check_fused_ce(cfg, device, tp)
    pipeline_stages.check_without_pipeline(cfg, declared.pp if declared is not None else None)
    return cfg


def check_verify_files(cfg: Config) -> None:
    """Before launch: ``verify.reference`` must be a fingerprint file (another file was a traceback
    at the end of training), ``verify.baseline`` a JSON file path (a folder, or a path under a file,
    failed at the end of training or not at all)."""
    v = cfg.verify
    if not v.enabled:
        return
    if v.reference:
        from framework.freeze.fingerprint import load_fingerprint
        from framework.verify.consistency import resolve_reference

        try:
            load_fingerprint(resolve_reference(v.reference))
        except ValueError as e:
            text = str(e)
            raise ValueError(
                text if text.startswith("verify.reference=") else f"verify.reference: {text}"
            ) from None
    if v.baseline:
        path = Path(v.baseline)
        if path.is_dir():
            raise ValueError(
                f"verify.baseline={v.baseline!r} is a folder; valid: a JSON file path "
                f"(e.g. {str(path / 'baselines.json')!r})"
            )
        if not path.exists():
            check_dir_creatable("verify.baseline", v.baseline)
    check_baseline_store(v)


def check_baseline_store(v: VerifyConfig) -> None:
    """Before launch: the store the run compares with (``verify.baseline``, else the default) reads
    as a store, and one ``verify.save_baseline=true`` rewrites can be rewritten (its folder takes
    the temporary file): both were found only after training, as a traceback."""
    from framework.verify.baseline import load_store, store_path

    path = store_path(v)
    load_store(path)
    if v.save_baseline:
        check_dir_creatable("verify.baseline", str(path.parent))
        if path.exists() and not os.access(path, os.W_OK):
            raise ValueError(
                f"verify.baseline={str(path)!r} is read-only and verify.save_baseline=true rewrites it; "
                "valid: a store you can write, or verify.save_baseline=false"
            )


# Options whose package is an extra of pyproject.toml, not the base install: (the option, whether
# the config uses it, the package to import, the extra that installs it).
EXTRAS: list[tuple[str, Callable[[Config], bool], str, str]] = [
    ("logger=wandb", lambda c: c.logger.kind is LoggerKind.wandb, "wandb", "wandb"),
]


def check_extras(cfg: Config, extras: list[tuple[str, Callable[[Config], bool], str, str]] = EXTRAS) -> None:
    """An option whose package the base install leaves out (``pip install -e .``): one line naming
    the extra, before launch (wandb failed in every rank's import, after the freeze)."""
    import importlib.util

    for option, used, package, extra in extras:
        if used(cfg) and importlib.util.find_spec(package) is None:
            raise ValueError(
                f"{option} needs the {package} package, which the base install leaves out: "
                f"pip install -e '.[{extra}]' (the dev extra has it too)"
            )


def check_warmup(cfg: Config) -> None:
    """``train.warmup_steps >= train.steps``: one warning line. Why not a refusal: a short smoke run
    of a long recipe is legitimate, but the schedule then never leaves its warmup (no decay)."""
    t = cfg.train
    if t.warmup_steps > 0 and t.warmup_steps >= t.steps:
        log.warning(
            "train.warmup_steps=%d >= train.steps=%d: the learning rate never leaves its warmup "
            "(it peaks at step %d of %d); set train.warmup_steps below train.steps",
            t.warmup_steps,
            t.steps,
            t.steps,
            t.warmup_steps,
        )


def aux_scope_under_pipeline(cfg: Config, pp: int) -> Config:
    """``model.moe.aux_loss_scope=global`` with the load-balancing loss on under ``parallel.pp > 1``:
    ``cfg`` with ``layer`` (written to config.yaml), and one warning line. Why not a refusal: the
    planner picks pp for the large MoE recipes (``sharding=auto``), and a user of Megatron-LM or
    torchtitan, whose aux loss is per layer under any layout, expects the term to be there, not a
    stop; transformers' global loss couples every layer's routers, which the stages hold apart."""
    m = cfg.model.moe
    if not (pp > 1 and m.num_experts and m.router_aux_loss_coef > 0 and m.aux_loss_scope.name == "global"):
        return cfg
    log.warning(
        "model.moe.aux_loss_scope=global under parallel.pp=%d: the load-balancing loss is each layer's, "
        "averaged (model.moe.aux_loss_scope=layer, as Megatron's): transformers' global loss spans every "
        "layer's routers, which the pipeline's stages hold apart",
        pp,
    )
    moe = dataclasses.replace(m, aux_loss_scope=AuxLossScope["layer"])
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe=moe))


def check_hardware(cfg: Config, device: torch.device) -> None:
    """A launch on another kind of device than ``mesh/hardware`` declares: one warning line
    (framework.kernels.target.mismatch says why not a refusal). A dry run plans for the declared one.
    Else a GPU-sized job or an NCCL preset on the CPU profile (the default): one line naming the
    hardware the plan assumes and the options (framework.kernels.target.cpu_profile_notice)."""
    from framework.launch.docs import group_options
    from framework.models import num_params

    warning = None if cfg.run.dry_run else target.mismatch(cfg.mesh.hardware, target.local(device))
    if warning is None:
        warning = target.cpu_profile_notice(cfg, num_params(cfg.model), group_options("mesh/hardware"))
    if warning:
        log.warning("%s", warning)


def check_cudagraphs(cfg: Config, device: torch.device) -> None:
    """``executor=cudagraphs``: CUDA (the declared hardware's in a dry run, framework.kernels.target)."""
    where = target.of_run(cfg, device)
    if cfg.executor.mode is ExecutorMode.cudagraphs and where.type != "cuda":
        raise ValueError(
            f"executor=cudagraphs needs a CUDA device, this run uses {where.type}: "
            "use executor=compile or executor=eager"
        )


def check_float8(cfg: Config, device: torch.device, tp: int) -> None:
    """``model.float8``: layers float8 can multiply (also per TP shard of degree ``tp``), float8
    tensor cores (the declared hardware's in a dry run, framework.kernels.target), torchao (a dry
    run only warns); float8 MoE experts: the grouped GEMM's GPUs, and one line under tensorwise
    (the experts run rowwise)."""
    recipe = cfg.model.float8
    if recipe is Float8Recipe.none:
        return
    linears.check_shapes(cfg.model, tp)
    where = target.of_run(cfg, device)
    float8.check_device(recipe, where.type, where.capability, where.name)
    fast = float8.fast_accum_notice(cfg.model.float8_fast_accum)
    if fast:
        log.warning("%s", fast)
    experts = bool(linears.converted_experts(cfg.model))
    if experts:
        float8.check_experts_device(recipe, where.capability, where.name)
        notice = float8.experts_notice(recipe)
        if notice:
            log.warning("%s", notice)
    with target.tolerate_missing_packages(where):
        float8.check_torchao(recipe, experts)


def check_fa4(cfg: Config, device: torch.device) -> None:
    """``model.attention=fa4``: a Hopper or Blackwell GPU (the declared hardware's in a dry run),
    a head size its kernels have, the package (a dry run only warns)."""
    if cfg.model.attention is not AttentionBackend.fa4:
        return
    where = target.of_run(cfg, device)
    with target.tolerate_missing_packages(where):
        fa4.check(cfg, where.type, where.capability, where.name, head_dim=model_spec(cfg.model).head_dim)


def check_fused_ce(cfg: Config, device: torch.device, tp: int) -> None:
    """``model.fused_cross_entropy``: CUDA (the declared hardware's in a dry run), no whole-model
    graph, no TP, the package (a dry run only warns)."""
    where = target.of_run(cfg, device)
    with target.tolerate_missing_packages(where):
        fused_ce.check(cfg, where.type, tp)


def check_checkpoint_dir(cfg: Config) -> None:
    """A ``checkpoint.dir`` that cannot become a directory fails here, not in every rank later."""
    if not cfg.checkpoint.enabled or not cfg.checkpoint.dir:
        return
    check_dir_creatable("checkpoint.dir", cfg.checkpoint.dir)
    check_not_nested("checkpoint.dir", cfg.checkpoint.dir)


def check_not_nested(key: str, value: str | Path) -> None:
    """Refuse a checkpoint root inside another checkpoint root or step dir (or a step dir itself):
    the two runs' retention, cleanup and set-aside would delete each other's checkpoints."""
    from framework.checkpoint import store

    found = store.enclosing_checkpoint(Path(value))
    if found is not None:
        where, why = found
        raise ValueError(
            f"{key}={str(value)!r} is inside {str(where)!r} ({why}): two runs sharing one checkpoint tree "
            f"delete each other's checkpoints; valid: a directory outside any checkpoint root, e.g. "
            f"{str(where.parent / 'checkpoints_new')!r}"
        )


def check_dir_creatable(key: str, value: str) -> None:
    """ValueError naming ``key`` when ``value`` or a parent of it is an existing file, or when the
    nearest existing folder is not writable (this user cannot create or fill the directory)."""
    check_creatable(f"{key}={value!r}", Path(value))


class RunDirCheck(Callback):
    """Refuse an unusable ``hydra.run.dir`` / ``hydra.sweep.dir`` before Hydra creates it.

    Hydra makes the run dir before our task function runs, and a file or a read-only folder there
    was a Python traceback from Hydra's ``mkdir`` (or, for read-only, a failure in every rank later).
    Registered in conf/config.yaml's ``hydra.callbacks``; exits 2 with one line, having written nothing.
    """

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _refuse_run_dir("hydra.run.dir", str(config.hydra.run.dir))
        _refuse_locked_run_dir(config, Path(str(config.hydra.run.dir)))
        note_run_dir(Path(str(config.hydra.run.dir)))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _refuse_run_dir("hydra.sweep.dir", str(config.hydra.sweep.dir))


def _refuse_run_dir(key: str, value: str) -> None:
    try:
        check_dir_creatable(key, value)
    except ValueError as e:
        _refuse(str(e))


def _refuse_locked_run_dir(config: DictConfig, run_dir: Path) -> None:
    """Refuse (exit 2) a run dir that a live run holds, before Hydra rewrites its ``.hydra/`` files
    and appends to its ``train.log``: the later check (``check_checkpoint_lock``) came only after
    Hydra had written into the live run's records. Held means: the run dir's ``checkpoints/LOCK``,
    or the ``checkpoint.dir`` this launch would lock, belongs to a live process. Rank 0 (or the
    launcher) only, as the later check: a torchrun rank on another host cannot tell a live lock
    from its own job's. A ``checkpoint.dir`` that does not read plainly is the validation's to report."""
    if os.environ.get("RANK", "0") != "0" or not run_dir.is_dir():
        return
    from framework.checkpoint import lock

    own = run_dir / "checkpoints"
    owner = lock.blocking_owner(own, str(run_dir))
    if owner is not None:
        _refuse(
            f"hydra.run.dir={str(run_dir)!r} belongs to a live run: {owner.describe()} holds "
            f"{own / lock.LOCK}, and a second launch there would overwrite its files; valid: another "
            f"hydra.run.dir, or wait for that run to end (if it is gone, remove {own / lock.LOCK})"
        )
    try:
        enabled = OmegaConf.select(config, "checkpoint.enabled", default=False)
        root = OmegaConf.select(config, "checkpoint.dir", default=None)
    except OmegaConfBaseException:
        return
    if enabled is True and isinstance(root, str) and root:
        owner = lock.blocking_owner(Path(root), str(run_dir))
        if owner is not None:
            _refuse(lock.refusal(Path(root), owner))


def _refuse(message: str) -> None:
    """One line on stderr, exit 2: a refusal before Hydra has written anything."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def run_job(dcfg: DictConfig) -> float | None:
    """The Hydra task function: one job (a single run, or one job of a sweep)."""
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    overrides = list(hydra_cfg.overrides.task)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    with isolated_environ():
        adopt_submitit_environment()
        torchrun = joined_torchrun()
        rank = int(os.environ.get("RANK", "0")) if torchrun else 0
        marked = False  # this job's "running" marker is written
        try:
            if torchrun:  # the process group first; rank 0 alone validates and resolves
                join_torchrun(dcfg, run_dir)
            job, sha = from_rank_zero(
                rank, torchrun, lambda: prepare(dcfg, run_dir, hydra_cfg), lambda j: j.config_sha256
            )
            if multirun:
                # Keyed on the resolved config: an edited recipe reruns, reordered overrides do not.
                done = sweep.completed(run_dir, sha)
                if done is not None:
                    summary, source = done
                    if rank == 0:
                        sweep.record_skip(run_dir, overrides, sha, source)
                    log.info(
                        "job %s: skipped, the same resolved config completed in a previous run of this "
                        "sweep (%s)",
                        run_dir.name,
                        source,
                    )
                    return sweep.objective(summary)
                if rank == 0:
                    sweep.set_aside_previous_attempt(run_dir)
                    sweep.write_job(run_dir, overrides, "running", config_sha256=sha)
                marked = True
            recipe = hydra_cfg.runtime.choices.get("recipe")
            owner, _ = from_rank_zero(rank, torchrun, lambda: write_run_files(job, run_dir, recipe))
            try:
                result = _run(run_dir, rank, job.nccl_env if job is not None else None)
            finally:
                release_launch_lock(job, run_dir, owner)
        except JobFailed as e:
            # A refusal before launch (exit 2, no run dir kept) is one line on stderr; a failure whose
            # run dir stays, or a sweep's job, also goes to the job's log.
            if multirun or e.code != 2:
                log.error("error: %s", e)
            print(f"error: {e}", file=sys.stderr)
            if not multirun:
                if e.code == 2:
                    discard_run_dir(run_dir)
                sys.exit(e.code)
            if rank == 0:
                if not marked:
                    sweep.set_aside_previous_attempt(run_dir)
                sweep.write_job(run_dir, overrides, "failed", error=str(e))
            return math.nan
        except Exception as e:  # noqa: BLE001 - a sweep records the failure and goes on to the next job
            if not multirun:
                raise
            log.error("job %s failed:\n%s", run_dir.name, traceback.format_exc())
            if rank == 0:
                if not marked:
                    sweep.set_aside_previous_attempt(run_dir)
                sweep.write_job(run_dir, overrides, "failed", error=f"{type(e).__name__}: {e}")
            return math.nan
        if multirun and rank == 0:
            sweep.write_job(run_dir, overrides, "ok", config_sha256=sha)
        return result


def prelaunch(
    dcfg: DictConfig, run_dir: Path, recipe: str | None, hydra_cfg: DictConfig | None = None
) -> tuple[Config, Plan, dict[str, str]]:
    """Every check that can fail on user input, in order, writing nothing: the typed config with
    its batch resolved, the plan and the NCCL environment. Raises ValueError (one line) on the first
    failure, an unresolvable interpolation (``train.lr=${train.lr}``) included. ``hydra_cfg`` (the
    composed ``hydra`` node) is checked too (framework.launch.recipe_check.check_composed); its command-line
    overrides are what ``model.init_from`` may not contradict (framework.checkpoint.init_from)."""
    cfg, plan, nccl_env, _ = prelaunch_with_search(dcfg, run_dir, recipe, hydra_cfg)
    return cfg, plan, nccl_env


def prelaunch_with_search(
    dcfg: DictConfig, run_dir: Path, recipe: str | None, hydra_cfg: DictConfig | None = None
) -> tuple[Config, Plan, dict[str, str], SearchResult | None]:
    """``prelaunch``, and the layout search when the planner chose (``sharding=auto``), for plan.json."""
    overrides = list(hydra_cfg.overrides.task) if hydra_cfg is not None else []
    try:
        check_safe(dcfg, recipe, hydra_cfg)
        cfg = validate(dcfg, overrides)
        # The layout (sharding=auto: the planner's search), activation checkpointing under auto and
        # train.micro_batch_size=0 are resolved once here, written to config.yaml as explicit values
        # and the plan to plan.json; the ranks read both back and plan nothing.
        resolved = resolve(cfg)
        cfg, plan, found = resolved.cfg, resolved.plan, resolved.search
        lora_layout(cfg.peft, plan.layout.tp, plan.layout.fsdp)  # LoRA: no TP, one dtype under FSDP
        cfg = aux_scope_under_pipeline(cfg, plan.layout.pp)
        nccl_env = nccl_environment(cfg.nccl, run_dir, cfg.mesh.procs_per_node)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        msg = str(getattr(e, "msg", None) or e).splitlines()[0]
        raise ValueError(f"{key}: {msg}" if key else f"config cannot be resolved: {msg}") from e
    return cfg, plan, nccl_env, found


@dataclass(frozen=True)
class PreparedJob:
    """A job's validated inputs (``prelaunch``): everything checked before the run dir gets its files."""

    cfg: Config
    plan: Plan
    nccl_env: dict[str, str]
    config_yaml: str  # what config.yaml holds (the resolved config)
    search: SearchResult | None = None  # the planner's layout search (sharding=auto), for plan.json

    @property
    def config_sha256(self) -> str:
        return hashlib.sha256(self.config_yaml.encode()).hexdigest()


def prepare(dcfg: DictConfig, run_dir: Path, hydra_cfg: DictConfig) -> PreparedJob:
    """``prelaunch`` for a job; a failure is a JobFailed with exit status 2."""
    try:
        cfg, plan, nccl_env, found = prelaunch_with_search(
            dcfg, run_dir, hydra_cfg.runtime.choices.get("recipe"), hydra_cfg
        )
    except ValueError as e:
        raise JobFailed(str(e), 2) from e
    return PreparedJob(cfg, plan, nccl_env, to_yaml(cfg), found)


def write_run_files(job: PreparedJob, run_dir: Path, recipe: str | None) -> Owner | None:
    """The launcher's (rank 0's) last checks and the run files every rank reads: ``config.yaml``,
    ``plan.json`` (with the search), provenance and the NCCL record. JobFailed (exit 2) on a refusal,
    before anything is written. Returns the checkpoint lock this launch took (``take_launch_lock``)."""
    cfg, plan, nccl_env = job.cfg, job.plan, job.nccl_env
    try:
        check_checkpoint_lock(cfg, run_dir)  # before anything is written: exit 2, run dir removed
        check_resume_model(cfg, run_dir)
        check_export_dir(cfg, run_dir)
        owner = take_launch_lock(cfg, run_dir)
    except ValueError as e:
        raise JobFailed(str(e), 2) from e
    config_yaml = job.config_yaml
    (run_dir / "config.yaml").write_text(config_yaml)
    record = plan_to_dict(plan)
    brief = plan.world_size == 1 and not cfg.run.dry_run
    if job.search is not None:
        record["search"] = search_to_dict(job.search)
        if not brief:
            log.info("%s", format_search(job.search))
    write_plan(run_dir, record)
    write_provenance(run_dir, recipe, config_yaml)
    write_nccl_record(run_dir, nccl_env)
    if brief:  # one rank: the choice in one line; the table, the search and NCCL's are in the files
        log.info("%s", plan_line(cfg, plan, run_dir))
        for warning in plan.warnings:
            log.warning("%s", warning)
        return
    log.info("plan:\n%s", format_plan(plan))
    if cfg.mesh.hardware.device_type == "cpu":
        log.info("%s", CPU_PREDICTION)
    if nccl_env:
        log.info("nccl: %s", describe_nccl(nccl_env))
    return owner


# The step-time model's constants are fitted to GPUs (framework.planner.cost); on the CPU profile its
# prediction for the default run was far slower than measured (benchmarks/PERF.md, "A user's first
# hour": the figure).
CPU_PREDICTION = (
    "mesh/hardware=cpu: the predicted step time and tokens/s above are the GPU-fitted step-time model's, "
    "not this CPU's (measure with a short run); the memory figures hold"
)


def plan_line(cfg: Config, plan: Plan, run_dir: Path) -> str:
    """A one-rank run's plan in one line: the layout, its batch and checkpointing, the memory, and
    where the full plan is (plan.json: the estimates and, under sharding=auto, the search). The
    predicted step time only for a GPU profile (CPU_PREDICTION says why)."""
    gib = 2**30
    time = (
        ""
        if cfg.mesh.hardware.device_type == "cpu"
        else f", predicted step {plan.prediction.step_time_s * 1e3:.1f} ms"
    )
    return (
        f"plan: {plan.strategy} on 1 rank, micro batch {plan.micro_batch_size} x {plan.grad_accum_steps} "
        f"accumulation, activation checkpointing {plan.activation_checkpointing}, "
        f"{plan.memory.total / gib:.2f} of {plan.memory.device / gib:.0f} GiB{time} (in full: {run_dir / PLAN_FILE})"
    )


def join_torchrun(dcfg: DictConfig, run_dir: Path) -> None:
    """A torchrun (or submitit) rank: create the process group the trainer then runs in, taking
    its settings (device, NCCL environment and timeout, allocator) from this rank's own composition,
    and stop unless every rank composed the same config into the same run dir. Validation and the
    plan are rank 0's alone (``from_rank_zero``); every rank reads the plan from the run dir.

    Raises JobFailed (exit 2) for settings that do not convert, or ranks that disagree."""
    from framework.parallel.process import init_distributed
    from framework.train.trainer import check_same_composition

    try:
        own = to_config(dcfg)
        nccl_env = nccl_environment(own.nccl, run_dir, own.mesh.procs_per_node)
        device = resolve_device(own.run.device)
    except (ValueError, OmegaConfBaseException) as e:
        raise JobFailed(str(e).splitlines()[0], 2) from e
    apply_nccl_environment(nccl_env)  # before the process group: NCCL reads it there
    apply_allocator_environment(own.run)
    env = init_distributed(device, own.nccl.timeout_s)
    composed = OmegaConf.to_container(dcfg, resolve=False)
    try:
        check_same_composition(env, run_dir, composed)
    except ValueError as e:
        raise JobFailed(str(e), 2) from e


def from_rank_zero(
    rank: int, torchrun: bool, act: Callable[[], Any], share: Callable[[Any], str | None] = lambda _: None
) -> tuple[Any, str | None]:
    """``act()`` on rank 0 while the other ranks of a torchrun job wait for it: (its result, on rank 0
    only; ``share(result)``, a short string such as the config hash, on every rank). A refusal there
    (JobFailed) is every rank's, with rank 0's line and exit status. Without torchrun this process is
    the launcher: ``act()``, plainly. Never the plan: the ranks read that from the run dir."""
    if not torchrun:
        value = act()
        return value, share(value)
    import torch.distributed as dist

    value, failed = None, None
    box: list[Any] = [None]
    if rank == 0:
        try:
            value = act()
            box = [("ok", share(value))]
        except JobFailed as e:
            failed, box = e, [("failed", str(e), e.code)]
    dist.broadcast_object_list(box, src=0)
    if failed is not None:
        raise failed
    if box[0][0] == "failed":
        raise JobFailed(box[0][1], box[0][2])
    return value, box[0][1]


def _run(run_dir: Path, rank: int, nccl_env: dict[str, str] | None) -> float | None:
    """Train on the run dir's ``config.yaml`` and ``plan.json`` (``load_run``), whatever launched this
    process: the plan was resolved once, before launch, and no rank plans again. ``nccl_env``: the
    launcher's (None on a torchrun rank, which set its own before joining the process group)."""
    from framework.launch.worker import load_run

    try:
        cfg, plan = load_run(run_dir)
    except ValueError as e:
        raise JobFailed(str(e), 2) from e
    if nccl_env is not None and not joined_torchrun():
        # Before any process group exists, and before spawning: the ranks inherit it.
        apply_nccl_environment(nccl_env)
        apply_allocator_environment(cfg.run)
    if cfg.run.dry_run:
        from framework.launch.dry_run import dry_run, format_dry_run

        report = dry_run(cfg, plan)
        log.info("dry run:\n%s", format_dry_run(report))
        return None

    started = time.time()
    if joined_torchrun():
        return _run_torchrun_rank(cfg, plan, run_dir, rank)
    if cfg.mesh.world_size == 1:
        return _run_in_process(cfg, plan, run_dir, started)
    return _run_spawned(cfg, run_dir, started)


def _run_torchrun_rank(cfg: Config, plan: Plan, run_dir: Path, rank: int) -> float | None:
    """This process is one rank that torchrun (or submitit) started: train, then end the process
    with ``finish`` (``os._exit``), except under submitit, whose task must return its result.

    Each such rank composed its config itself (``join_torchrun`` compared the compositions); rank 0
    alone resolved it, and every rank trains on the run dir's ``config.yaml`` and ``plan.json``."""
    from framework.launch.ranks import die_with_launcher
    from framework.parallel.process import KEPT_PARTS, finish
    from framework.train import trainer

    die_with_launcher()
    try:
        trainer.run(cfg, plan, run_dir, keep=KEPT_PARTS)  # never freed: the rank ends with os._exit
    except (DataChanged, DirGone) as e:  # one line on each rank (every rank saw it), not a traceback
        log.error("error: %s", data_changed_report(run_dir, cfg, e))
        finish(1)
    except LockHeld as e:  # another launch took the checkpoint root first: its one line
        log.error("error: %s", e)
        finish(2)
    failed = None
    if rank == 0:
        finish_run(run_dir, cfg)
        failed = failed_saves(run_dir)
    if os.environ.get("SUBMITIT_EXECUTOR"):
        # A submitit task must return (submitit pickles the result); it ends the group itself.
        _end_in_process_group()
        if failed:
            raise JobFailed(failed, 1)
        return _result(run_dir)
    if failed:
        log.error("error: %s", failed)
    finish(1 if failed else 0, barrier=True)


def _run_in_process(cfg: Config, plan: Plan, run_dir: Path, started: float) -> float | None:
    """One rank, in this process: train (on the plan resolved here), then report a stop by a signal."""
    from framework.train import trainer

    try:
        trainer.run(cfg, plan, run_dir)
    except (DataChanged, DirGone) as e:  # the ranks closed every part (the lock too) on the way out
        raise JobFailed(data_changed_report(run_dir, cfg, e), 1) from None
    except LockHeld as e:  # another launch took the checkpoint root first: its one line, no traceback
        raise JobFailed(str(e), 2) from None
    finally:
        _end_in_process_group()
    finish_run(run_dir, cfg)
    stop = preemption(run_dir, started)
    if stop is not None:  # a signal to this process (Ctrl-C): the rank saved, or says it could not
        if not stop.get("saved"):
            raise JobFailed(stop_report(run_dir, cfg, stop), 1)
        log.warning("%s", stop_report(run_dir, cfg, stop))
    return _check_saves(run_dir)


def _run_spawned(cfg: Config, run_dir: Path, started: float) -> float | None:
    """Several ranks on this host: spawn them (elastic, with restarts), wait, report a preemption.
    Each rank reads the run dir's config.yaml and plan.json (framework.launch.worker.load_run)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from framework.train.trainer import checkpoint_root

    checkpoints = checkpoint_root(cfg, run_dir) if cfg.checkpoint.enabled else None
    try:
        signum = spawn_local(run_dir, cfg.mesh.world_size, cfg.run.max_restarts, checkpoints)
    except ChildFailedError as e:
        message = e.get_first_failure()[1].message
        # framework.launch.worker.tell_launcher: a data file changed, the run dir was deleted
        if isinstance(message, str) and message.startswith((DATA_CHANGED, *GONE_PREFIXES)):
            raise JobFailed(data_changed_report(run_dir, cfg, message), 1) from None
        if isinstance(message, str) and message.startswith(str(run_dir / PLAN_FILE)):  # a rank refused it
            raise JobFailed(message, 2) from None
        if isinstance(message, str) and message.startswith(LOCK_HELD):  # framework.launch.worker
            raise JobFailed(message.removeprefix(LOCK_HELD), 2) from None
        raise JobFailed(
            f"ranks failed (see {run_dir / 'train.log'}): {describe_failures(e.failures)}; "
            f"{after_failure(cfg, run_dir, checkpoints)}",
            1,
        ) from e
    finish_run(run_dir, cfg)
    if signum is not None:
        # Preemption: exit 0 (the scheduler requeues; the same run dir resumes) only when the ranks
        # really saved at the step they stopped; otherwise say so and exit 128 + signal.
        stop = preemption(run_dir, started)
        message = stop_report(run_dir, cfg, stop, signum)
        if stop is None or not stop.get("saved"):
            raise JobFailed(message, 128 + signum)
        log.warning("%s", message)
    return _check_saves(run_dir)


def after_failure(cfg: Config, run_dir: Path, checkpoints: Path | None) -> str:
    """What happens after the ranks failed for good: no restart is left, and how to go on from the
    newest checkpoint (framework.launch.failures.resume_point says which)."""
    left = f"no restart left (run.max_restarts={cfg.run.max_restarts})"
    from framework.checkpoint import store

    committed = store.committed(checkpoints) if checkpoints is not None else []
    if not committed:
        return f"{left}, and no checkpoint was saved"
    return f"{left}; run again with hydra.run.dir={run_dir} to resume from {committed[-1][1]}"


def data_changed_report(run_dir: Path, cfg: Config, e: Exception | str) -> str:
    """One line: which data file changed (or which folder was deleted), and which checkpoints the
    run keeps."""
    from framework.checkpoint import store
    from framework.train.trainer import checkpoint_root

    committed = store.committed(checkpoint_root(cfg, run_dir)) if cfg.checkpoint.enabled else []
    if not committed:
        return f"{e}; no checkpoint is left" if cfg.checkpoint.enabled else f"{e}; checkpointing was off"
    return f"{e}; the checkpoints up to step {committed[-1][0]} are kept ({committed[-1][1].parent})"


def preemption(run_dir: Path, since: float) -> dict | None:
    """The ``preempted`` event this launch's ranks logged (None: they stopped without one)."""
    from framework.record.metrics import read_metrics

    rows = [r for r in read_metrics(run_dir) if r.get("event") == "preempted" and r.get("time", 0) >= since]
    return rows[-1] if rows else None


def stop_report(run_dir: Path, cfg: Config, stop: dict | None, signum: int | None = None) -> str:
    """The one true line about a stop by a signal: which checkpoint exists now, and how to resume."""
    from framework.checkpoint import store
    from framework.train.trainer import checkpoint_root

    name = f"signal {signum}" if signum is not None else "a signal"
    if signum == 2:
        name += " (SIGINT: Ctrl-C)"
    root = checkpoint_root(cfg, run_dir)
    if stop is not None and stop.get("saved"):
        path = store.step_dir(root, int(stop["step"]))
        return (
            f"stopped by {name}: the ranks saved a checkpoint at step {stop['step']} ({path}); "
            f"run again with hydra.run.dir={run_dir} to resume"
        )
    committed = store.committed(root) if cfg.checkpoint.enabled else []
    latest = f"the latest checkpoint is {committed[-1][1]}" if committed else "there is no checkpoint"
    if not cfg.checkpoint.enabled:
        why = "checkpointing is off (checkpoint=final|sync|async saves on a signal)"
    elif stop is None:
        why = "the ranks stopped before they agreed on a step to save"
    else:
        why = f"the save at step {stop['step']} failed: {stop.get('detail', '')}"
    return f"stopped by {name}: no checkpoint was saved at the stop ({why}); {latest}"


def failed_saves(run_dir: Path) -> str | None:
    """Why this run must not exit 0: it checkpointed, and every one of its saves failed."""
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        return None
    ck = json.loads(summary_path.read_text()).get("checkpoint") or {}
    if ck.get("failed") and not ck.get("saved"):
        return (
            f"every checkpoint save of this run failed ({ck['failed']} of {ck['failed']}; see "
            f"summary.json): {ck.get('last_error')}"
        )
    return None


def _check_saves(run_dir: Path) -> float | None:
    failed = failed_saves(run_dir)
    if failed:
        raise JobFailed(failed, 1)
    return _result(run_dir)


def check_checkpoint_lock(cfg: Config, run_dir: Path) -> None:
    """Before launch: refuse (exit 2, nothing written) when another live run holds the checkpoint dir."""
    if not cfg.checkpoint.enabled:
        return
    from framework.checkpoint import lock

    root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    check_not_nested("checkpoint.dir" if cfg.checkpoint.dir else "hydra.run.dir", root)
    lock.check_free(root, str(run_dir))


def take_launch_lock(cfg: Config, run_dir: Path) -> Owner | None:
    """The checkpoint root's lock, taken by the launcher before it writes the run files, and handed
    to the ranks (framework.checkpoint.lock: the lock of a rank's own launcher is the rank's). Why:
    two launches of one run dir started seconds apart both passed the lock check, since the first
    run's rank takes the lock only once its model is built; the second then rewrote the first's
    config.yaml and plan.json and failed inside its ranks with a LockHeld traceback. Of two launches
    racing here, one gets the lock and the other a LockHeld line (exit 2). None for a dry run or
    without checkpointing (nothing to lock)."""
    if not cfg.checkpoint.enabled or cfg.run.dry_run:
        return None
    from framework.checkpoint import lock
    from framework.train.trainer import checkpoint_root

    return lock.acquire(checkpoint_root(cfg, run_dir), str(run_dir))


def release_launch_lock(job: PreparedJob | None, run_dir: Path, owner: Owner | None) -> None:
    """The launcher's lock, released if it still holds it (the ranks never took it over: they failed
    first); never a lock the ranks or another run hold."""
    if owner is None or job is None:
        return
    from framework.checkpoint import lock
    from framework.train.trainer import checkpoint_root

    lock.release(checkpoint_root(job.cfg, run_dir), owner)


def check_export_dir(cfg: Config, run_dir: Path) -> None:
    """Before launch: ``checkpoint.export_hf`` writes ``RUN_DIR/hf`` after training; a file there (a
    reused run dir) was a FileExistsError traceback once the run had trained, and a folder that
    export-hf did not write would lose its files."""
    if not cfg.checkpoint.export_hf:
        return
    from framework.checkpoint.export_hf import EXPORT_MARKER

    out = run_dir / "hf"
    fix = (
        "valid: move it away, or checkpoint.export_hf=false "
        "(export later with python -m framework export-hf)"
    )
    if out.exists() and not out.is_dir():
        raise ValueError(f"checkpoint.export_hf=true writes {out}, which is a file; {fix}")
    if out.is_dir() and any(out.iterdir()) and not (out / EXPORT_MARKER).is_file():
        raise ValueError(f"checkpoint.export_hf=true writes {out}, a folder export-hf did not write; {fix}")


def check_resume_model(cfg: Config, run_dir: Path) -> None:
    """Before launch: refuse (exit 2, nothing written) resuming a checkpoint of another model shape
    (framework.checkpoint.init_from.check_resume_model): the newest committed one under the checkpoint root
    for ``checkpoint.resume=auto``, else the one it names."""
    resume = cfg.checkpoint.resume
    if not cfg.checkpoint.enabled or resume == "none":
        return
    from framework.checkpoint import init_from, store

    if resume == "auto":
        root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
        found = store.committed(root)
        if not found:
            return
        step_dir = found[-1][1]
    else:
        from framework.checkpoint.manager import check_step_dir

        step_dir = check_step_dir(Path(resume), "checkpoint.resume")
    init_from.check_resume_model(
        step_dir, cfg.model, "checkpoint.resume" + ("=auto" if resume == "auto" else "")
    )


def write_provenance(run_dir: Path, recipe: str | None, config_yaml: str) -> None:
    """``provenance.json``: the recipe (name, source file, its hash), the config hash, the code's commit."""
    from framework.launch.recipes import provenance

    (run_dir / "provenance.json").write_text(json.dumps(provenance(recipe, config_yaml), indent=2) + "\n")


def link_latest(run_dir: Path) -> Path | None:
    """``outputs/latest`` -> the newest run dir, for a run dir under a folder named ``outputs`` (the
    default ``hydra.run.dir`` is ``outputs/DATE/TIME-ID``, two levels down; elsewhere nothing is
    written outside the run dir). The link is relative (``DATE/TIME-ID``): the tree can move.

    Rank 0 only; atomic: a new link under a temporary name replaces the old one (``os.replace``), so
    a reader never sees it missing. A ``latest`` that is not a symlink (a user's folder) is kept."""
    path = run_dir.resolve()
    root = next((p for p in path.parents[:2] if p.name == "outputs"), None)
    if root is None or os.environ.get("RANK", "0") != "0":
        return None
    latest = root / "latest"
    if latest.exists() and not latest.is_symlink():
        log.warning("not linking %s: it exists and is not a symlink", latest)
        return None
    tmp = root / f".latest.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(path.relative_to(root))
    os.replace(tmp, latest)
    return latest


def finish_run(run_dir: Path, cfg: Config) -> None:
    """Rank 0, after training: ``outputs/latest``, the run's PNG, and its path in ``summary.json``."""
    link_latest(run_dir)
    summary_path = run_dir / "summary.json"
    if not cfg.logger.plot or not summary_path.is_file():
        return
    from framework.train.plots import plot_run

    try:
        plot = plot_run(run_dir)
    except ValueError as e:  # no loss rows (e.g. zero steps): nothing to draw
        log.warning("no plot: %s", e)
        return
    info = json.loads(summary_path.read_text())
    info["plot"] = str(plot)
    summary_path.write_text(json.dumps(info, indent=2) + "\n")
    log.info("plot: %s", plot)


def _result(run_dir: Path) -> float | None:
    """The job's objective (final val loss, else train loss): what Hydra's sweepers (Optuna) minimise."""
    summary_path = run_dir / "summary.json"
    return sweep.objective(json.loads(summary_path.read_text())) if summary_path.is_file() else None


def _end_in_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
