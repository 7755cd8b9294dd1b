"""Every check that can fail on user input, before any rank starts (``prelaunch``): the recipe's
safety (framework.launch.recipes), every ``_target_`` against the allowlist (framework.config.instantiate),
the schema, every key's rule (framework.launch.rules), the mesh, the local resources and the plan.
Each raises ValueError with one line; ``prepare`` turns it into ``JobFailed`` (exit status 2). Nothing
here writes: a refused launch leaves what was there as it was.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from framework.config.schema import (
    AttentionBackend,
    AuxLossScope,
    Config,
    ExecutorMode,
    Float8Recipe,
    LoggerKind,
    ModelConfig,
    RunConfig,
    VerifyConfig,
    to_config,
    to_yaml,
)
from framework.data import check_document_kernel
from framework.kernels import fa4, float8, fused_ce, target
from framework.launch.ranks import (
    check_local_resources,
    check_offload_memory,
    check_torch,
)
from framework.launch.rules import check as check_rules
from framework.launch.rules import check_family_layout, check_known_keys, check_layout, check_model_shape
from framework.models import FAMILIES, linears, model_spec
from framework.parallel.lora import check_layout as lora_layout
from framework.parallel.process import resolve_device
from framework.planner import stages as pipeline_stages
from framework.planner.layout import fixed_degrees
from framework.planner.plan import Plan
from framework.planner.resolve import resolve
from framework.planner.search import SearchResult
from framework.planner.topology import (
    nccl_environment,
    validate_mesh,
)
from framework.record.run_dir import check_dir_creatable
from framework.train.callbacks import check_callbacks

log = logging.getLogger("framework")


class JobFailed(Exception):
    """A job's ranks failed or its config was refused; carries the exit status of a single run."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


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
    cfg = to_config(dcfg)

    def check_shape(model: ModelConfig) -> None:
        check_model_shape(dataclasses.replace(cfg, model=model))

    cfg = dataclasses.replace(cfg, model=init_from.resolve(cfg.model, overrides or [], check_shape=check_shape))
    validate_mesh(cfg.mesh)
    check_rules(cfg)
    check_callbacks(cfg)  # each built once through the allowlist (framework.train.callbacks)
    from framework.config.run_values import batch_shape, data_run
    from framework.data import check_data, follow_tokenizer_vocab

    on_cli = "vocab_size" in init_from.command_line_keys(overrides or [])
    cfg = dataclasses.replace(cfg, model=follow_tokenizer_vocab(cfg.model, cfg.tokenizer, on_cli))
    check_data(data_run(cfg), batch_shape(cfg.train))  # tokenizer, files, token files, mixture, document mask: before any rank starts
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
    fa4.check_budget(
        cfg.model, cfg.sharding.activation_checkpointing, cfg.data.document_mask, fa4.flop_counter_takes_gqa()
    )
    where = target.of_run(cfg.mesh.hardware, cfg.run.dry_run, device).type
    check_document_kernel(cfg.data, cfg.model.attention, cfg.executor, where)
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
    reads = "aux_loss_scope" in FAMILIES[cfg.model.family].moe_keys  # GPT-OSS has no load-balancing loss
    if not (reads and pp > 1 and m.num_experts and m.router_aux_loss_coef > 0 and m.aux_loss_scope.name == "global"):
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
        warning = target.cpu_profile_notice(
            cfg.mesh.hardware, cfg.nccl.preset, num_params(cfg.model), group_options("mesh/hardware")
        )
    if warning:
        log.warning("%s", warning)


def check_cudagraphs(cfg: Config, device: torch.device) -> None:
    """``executor=cudagraphs``: CUDA (the declared hardware's in a dry run, framework.kernels.target)."""
    where = target.of_run(cfg.mesh.hardware, cfg.run.dry_run, device)
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
    where = target.of_run(cfg.mesh.hardware, cfg.run.dry_run, device)
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
    where = target.of_run(cfg.mesh.hardware, cfg.run.dry_run, device)
    with target.tolerate_missing_packages(where):
        fa4.check(
            cfg.model, cfg.parallel.cp, where.type, where.capability, where.name,
            head_dim=model_spec(cfg.model).head_dim,
        )  # fmt: skip


def check_fused_ce(cfg: Config, device: torch.device, tp: int) -> None:
    """``model.fused_cross_entropy``: CUDA (the declared hardware's in a dry run), no whole-model
    graph, no TP, the package (a dry run only warns)."""
    where = target.of_run(cfg.mesh.hardware, cfg.run.dry_run, device)
    with target.tolerate_missing_packages(where):
        fused_ce.check(cfg.model, cfg.executor, where.type, tp)


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
        check_family_layout(cfg, plan.layout, searched=found is not None)  # what the search chose too
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
