"""What every config key accepts: one table, checked once in the launcher before any rank starts.

Why a table: the schema (framework.config.schema) types every key, but a type says nothing about range,
sign or the relation to other keys. ``train.lr=nan`` is a float, ``model.dim=0`` an int, and each
used to fail minutes later inside a rank (or never: ``train.steps=-5`` trained nothing and exited 0).
Here every schema key has exactly one entry; ``check`` runs them all from ``framework.launch.entry`` before
the run files are written, and each failure is one ``ValueError`` line naming the key, its value and
what is valid. ``tests/launch/test_rules.py`` is generated from this table and fails when a schema key has
no entry, so a field added later without a rule is caught.

An entry is one of:
- a value rule: ``ok(value, cfg)`` decides (a relation to other keys reads ``cfg``), ``valid`` says
  what is valid (text, or a function of ``cfg`` when it depends on other keys);
- ``typed``: the schema type alone constrains the key (a bool, an Enum: OmegaConf refuses anything
  else at compose time);
- ``checked_by``: another pre-launch check owns the rule (the planner, the NCCL table, the local
  resources check, the allowlist); the table names it so that each rule lives in one place, and
  ``bad`` still gives a value the generated test proves it refuses.

Keys of the composed config that the schema does not have (``+train.lrr=0.1``) are refused by
``check_known_keys`` with the nearest valid key: OmegaConf would otherwise drop them silently.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from framework.config.schema import (
    MODEL_SCHEMAS,
    Config,
    EvalSet,
    ExecutorMode,
    MixEntry,
    ModelConfig,
    MoEConfig,
    OptimizerName,
    family_of,
    model_schema,
    option_fields,
    own_keys,
    owners,
)
from framework.models import FAMILIES, model_spec
from framework.planner.layout import Degrees, check_dense_ep

INT64_MAX = 2**63 - 1  # step counters, sizes and seeds end up in int64 tensors and JSON

Valid = str | Callable[[Config], str]


@dataclass(frozen=True)
class Rule:
    valid: Valid = ""
    ok: Callable[[Any, Config], bool] | None = None
    # Out-of-range values for the generated test (each, set alone on the default config, is refused).
    bad: tuple[Any, ...] = ()
    # Other keys the test sets together with a bad value, when the rule only applies in that context.
    context: tuple[tuple[str, Any], ...] = ()
    typed: bool = False
    checked_by: str = ""


TYPED = Rule(typed=True)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def integer(lo: int, hi: int = INT64_MAX, *, bad: tuple[Any, ...] = (), what: str = "") -> Rule:
    """An integer in [lo, hi]; ``what`` explains the special values (``0 = off``)."""
    top = "" if hi == INT64_MAX else f" and <= {hi}"
    text = f"an integer >= {lo}{top}" + (f" ({what})" if what else "")
    above = (hi + 1,) if hi < INT64_MAX else ()
    return Rule(text, lambda v, _c: _is_int(v) and lo <= v <= hi, bad or (lo - 1, *above, 10**1000))


def number(
    lo: float,
    hi: float = math.inf,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
    what: str = "",
    bad: tuple[Any, ...] = (),
) -> Rule:
    """A finite number in the interval; nan and inf are never valid (they poison every later step)."""

    def ok(v: Any, _c: Config) -> bool:
        if not _is_number(v) or not math.isfinite(v):
            return False
        above = v > lo if lo_open else v >= lo
        below = v < hi if hi_open else v <= hi
        return above and below

    low = f"{'>' if lo_open else '>='} {lo:g}"
    high = "" if hi == math.inf else f" and {'<' if hi_open else '<='} {hi:g}"
    text = f"a finite number {low}{high}" + (f" ({what})" if what else "")
    above = () if hi == math.inf else (hi if hi_open else hi * 10 if hi > 0 else hi + 1,)
    default_bad = (math.nan, math.inf, lo if lo_open else lo - 1, *above)
    return Rule(text, ok, bad or default_bad)


def name(what: str = "a non-empty name") -> Rule:
    return Rule(what, lambda v, _c: isinstance(v, str) and v.strip() != "", ("",))


def optional_path(what: str = "") -> Rule:
    """None (unset) or a non-empty path; ``what`` names the check that looks at the file itself."""
    text = "unset (null) or a non-empty path" + (f"; {what}" if what else "")
    return Rule(text, lambda v, _c: v is None or (isinstance(v, str) and v.strip() != ""), ("",))


def optional_name(what: str) -> Rule:
    return Rule(what, lambda v, _c: v is None or (isinstance(v, str) and v.strip() != ""), ("",))


def _capability_ok(v: Any) -> bool:
    """Empty, or a CUDA compute capability: major >= 1, minor 0-9 (8.9, 9.0, 10.0, 12.0 ...)."""
    if len(v) == 0:
        return True
    return len(v) == 2 and all(_is_int(x) for x in v) and 1 <= v[0] <= 99 and 0 <= v[1] <= 9


def names_list(what: str) -> Rule:
    return Rule(what, lambda v, _c: all(isinstance(s, str) and s.strip() for s in v), ([""],))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if 0 < n <= 1_000_000 else []


# Bounds on counts that the launcher or a rank loops over or holds in memory before the first step
# (each used to hang or fill the host: train.global_batch_size=1e11 counted its divisors one by one,
# train.eval_batches=1e8 built 12 GB of validation batches in 69 s).
MAX_LAYERS = 4096
MAX_GLOBAL_BATCH = 2**20  # sequences per step; the largest published runs use a few thousand
MAX_PREFETCH = 1024  # global batches held ahead in the data thread's queue
MAX_EVAL_BATCHES = 100_000
# Validation batches are built up front (int64 tokens on every rank): 2**28 tokens = 2 GiB.
MAX_EVAL_TOKENS = 2**28
# Upper bounds for every other number (issue 40: model.moe.router_aux_loss_coef=1e18 and
# nccl.timeout_s=1e300 were accepted; the second was an OverflowError traceback in every rank).
# Each is far above any published setting, so a bound only ever stops a typo or a runaway value.
MAX_WIDTH = 2**20  # model.dim, ffn_dim and expert widths: the widest published FFN is 53248
MAX_HEADS = 2**12  # attention heads: the largest published models have 128
MAX_POSITIONS = 2**24  # tokens of context (16M): the longest published contexts are 1-10M
MAX_STEPS = 10**9  # optimizer steps (and step intervals): three years at 10 steps a second
MAX_RESTARTS = 1000  # elastic restarts of the ranks: each reloads the last checkpoint
MAX_TIMEOUT_S = 7 * 24 * 3600  # a collective's timeout: a week (datetime.timedelta overflows at ~1e14 s)
MAX_RATE_GBPS = 1e6  # a link or memory bandwidth in GB/s: HBM3e is 8e3


def _eval_tokens(v: int, c: Config) -> int:
    return v * c.train.global_batch_size * (c.train.seq_len + 1)


def _eval_batches_ok(v: Any, c: Config) -> bool:
    return _is_int(v) and 1 <= v <= MAX_EVAL_BATCHES and _eval_tokens(v, c) <= MAX_EVAL_TOKENS


def _eval_batches_valid(c: Config) -> str:
    t = c.train
    most = max(1, min(MAX_EVAL_BATCHES, MAX_EVAL_TOKENS // (t.global_batch_size * (t.seq_len + 1))))
    return (
        f"an integer in 1..{most}: the validation batches are built up front, at most {MAX_EVAL_TOKENS} "
        f"tokens (train.global_batch_size={t.global_batch_size} x train.seq_len+1={t.seq_len + 1} each)"
    )


def _head_dim_ok(v: Any, c: Config) -> bool:
    if not _is_int(v) or not 1 <= v <= MAX_WIDTH:
        return False
    return c.model.head_dim > 0 or (v % c.model.n_heads == 0 and (v // c.model.n_heads) % 2 == 0)


def _dim_valid(c: Config) -> str:
    h = c.model.n_heads
    if c.model.head_dim > 0:
        return f"an integer in 1..{MAX_WIDTH}"
    return (
        f"a positive multiple of model.n_heads={h} up to {MAX_WIDTH} whose head dim (dim / n_heads) is even for rotary "
        f"embeddings, e.g. {[2 * h * k for k in (16, 32, 64)]}"
    )


def _kv_ok(v: Any, c: Config) -> bool:
    return _is_int(v) and 1 <= v <= c.model.n_heads and c.model.n_heads % v == 0


def _resume_ok(v: Any, c: Config) -> bool:
    if v in ("auto", "none"):
        return True
    return isinstance(v, str) and v.strip() != "" and c.checkpoint.enabled and Path(v).is_dir()


def _resume_valid(c: Config) -> str:
    if not c.checkpoint.enabled and c.checkpoint.resume not in ("auto", "none"):
        return (
            "'auto', 'none' or a checkpoint directory; resuming from a path needs checkpointing on "
            "(checkpoint=sync or checkpoint.enabled=true), otherwise the path is ignored"
        )
    return "'auto', 'none' or an existing checkpoint directory (a step_N folder holding manifest.json)"


def _fault_step_ok(v: Any, c: Config) -> bool:
    return _is_int(v) and (v == -1 or 1 <= v <= c.train.steps)


def _fault_rank_ok(v: Any, c: Config) -> bool:
    return _is_int(v) and -1 <= v < c.mesh.world_size


def _profile_ok(v: Any, c: Config) -> bool:
    r = c.run
    if not _is_int(v) or not 1 <= v <= MAX_STEPS:
        return False
    return not r.profile or r.profile_wait + r.profile_warmup + v <= c.train.steps


def _nan_steps_ok(v: Any, c: Config) -> bool:
    return all(_is_int(s) and 0 <= s < c.train.steps for s in v)


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


def _muon_ok(v: Any, c: Config) -> bool:
    """Muon needs torch.optim.Muon; its layout (whole matrices on each rank) is ``check_layout``'s."""
    if v is not OptimizerName.muon:
        return True
    import torch

    return hasattr(torch.optim, "Muon")


def _lora_error(c: Config) -> str | None:
    """``framework.models.lora.check`` on the meta model of ``c``: its one line, or None."""
    from framework.models import build_model, lora

    if getattr(c.peft.method, "value", c.peft.method) == "none":
        return None
    try:
        lora.check(build_model(c.model, c.train.seq_len), c.peft)
    except ValueError as e:
        return str(e)
    return None


def _adapter_error(c: Config) -> str | None:
    """``framework.models.lora.check_adapter``: the folder against this run's base and adapters."""
    from framework.models import build_model, lora

    if c.peft.adapter is None:
        return None
    try:
        model = build_model(c.model, c.train.seq_len)
        lora.attach(model, c.peft)
        lora.check_adapter(model, c.peft, c.model.init_from)
    except ValueError as e:
        return str(e)
    return None


def check_layout(cfg: Config, declared: Degrees | None) -> None:
    """The rules that read the layout the user fixed (``declared``: read once by the launcher,
    framework.launch.prelaunch.validate; None under ``sharding=auto``, whose search then keeps to layouts
    these rules allow, framework.planner.search). Raises ValueError in the table's one-line form.

    Muon orthogonalizes each weight matrix whole: no ``dp_shard`` or ``tp``. Expert parallelism needs
    experts (``check_dense_ep``)."""
    if declared is not None:
        check_dense_ep(declared, cfg.model)
    if cfg.optimizer.name is OptimizerName.muon and declared is not None:
        if declared.dp_shard != 1 or declared.tp != 1:
            raise ValueError(
                f"optimizer.name={show(cfg.optimizer.name)} is not valid; valid: {_muon_valid(cfg)}"
            )


def _muon_valid(c: Config) -> str:
    import torch

    if not hasattr(torch.optim, "Muon"):
        return f"adamw, adam or sgd: the installed torch {torch.__version__} has no torch.optim.Muon"
    return (
        f"adamw, adam or sgd with sharding.strategy={c.sharding.strategy.value}; muon orthogonalizes "
        "whole weight matrices and needs a layout without dp_shard or tp (sharding=ddp, or sharding=auto)"
    )


def _state_dtype_ok(v: Any, c: Config) -> bool:
    from framework.config.schema import DType
    from framework.train.loop import OWN_CLASS

    if v is DType.float32:
        return True
    return v is DType.bfloat16 and c.optimizer._target_ == OWN_CLASS[c.optimizer.name]


def _state_dtype_valid(c: Config) -> str:
    return (
        "float32, or bfloat16 (the framework's AdamW, framework.train.adamw) with the option's own "
        f"optimizer._target_ (not {c.optimizer._target_})"
        if c.optimizer._target_ != "torch.optim.AdamW"
        else "float32 or bfloat16"
    )


def _momentum_ok(v: Any, c: Config) -> bool:
    return _is_number(v) and 0 <= v < 1 and not (c.optimizer.nesterov and v == 0)


def _optimizer_class(c: Config) -> type | None:
    """``optimizer._target_`` resolved, when it is a torch optimizer class (else None). The allowlist
    was checked before the rules run (framework.launch.prelaunch.check_safe), so this imports nothing else."""
    import torch

    from framework.config.instantiate import check_target
    from framework.config.schema import DType

    try:
        cls = check_target(c.optimizer._target_, c.run.instantiate_allow, where="optimizer._target_")
    except ValueError:
        return None
    if c.optimizer.state_dtype is DType.bfloat16 and _state_dtype_ok(DType.bfloat16, c):
        from framework.train.adamw import AdamW

        return AdamW  # what build_optimizer builds: its keyword arguments are checked
    return cls if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) else None


def _target_ok(_v: Any, c: Config) -> bool:
    return _optimizer_class(c) is not None and _probe_error(c, with_kwargs=False) is None


def _target_valid(c: Config) -> str:
    why = _probe_error(c, with_kwargs=False) if _optimizer_class(c) is not None else None
    text = "a torch.optim.Optimizer subclass under run.instantiate_allow"
    if why is None:
        return text
    return (
        f"{text} that builds over the model's parameter groups and steps without a closure on dense "
        f"gradients, as the training loop does ({why})"
    )


# Keyword values the probe cannot judge on CPU tensors for a CUDA run: torch.optim's
# ``capturable=True`` needs its parameters on an accelerator (CUDA graphs capture the step).
ACCELERATOR_ONLY_KWARGS = ("capturable",)


def _run_device(c: Config) -> str:
    """The device type the ranks will train on (``run.device``; ``auto``: cuda when visible)."""
    import torch

    from framework.config.schema import Device

    if c.run.device is Device.auto:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return c.run.device.value


def _probe_error(c: Config, with_kwargs: bool, kwargs: dict[str, Any] | None = None) -> str | None:
    """Why the training loop's own optimizer (framework.train.loop.build_optimizer) cannot be built over a
    tiny stand-in model and stepped once on its dense gradients; None when it can. ``kwargs``: these
    instead of ``optimizer.kwargs`` (to find which one fails).

    Why a probe: a class or a keyword value can pass the allowlist and the names check and still
    crash every rank at its first line (LBFGS refuses parameter groups and needs a closure, SparseAdam
    sparse gradients, betas=5 or eps=-1 are refused by the class itself, capturable=True needs CUDA
    tensors, differentiable=True steps leaves that require grad in place): torch's own checks, run
    here. The stand-in's tensors are on the CPU, but the optimizer is built for the run's device (on
    CUDA the loop adds ``fused=True``, which ``foreach=True`` contradicts); on a CUDA run the values
    only an accelerator can judge (ACCELERATOR_ONLY_KWARGS) are left to the ranks.
    """
    import dataclasses as dc

    import torch

    from framework.train.loop import build_optimizer

    device = _run_device(c)
    chosen = dict(c.optimizer.kwargs if kwargs is None else kwargs) if with_kwargs else {}
    if device == "cuda":
        chosen = {k: v for k, v in chosen.items() if k not in ACCELERATOR_ONLY_KWARGS}
    opt = dc.replace(c.optimizer, kwargs=chosen)
    probe = torch.nn.Module()
    probe.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4, bias=False)])  # a matrix (Muon's share)
    probe.norm = torch.nn.LayerNorm(4, bias=False)  # a 1-D weight: the no-decay group
    try:
        optimizer = build_optimizer(probe, c.train, torch.device(device), opt, c.run.instantiate_allow)
        for p in probe.parameters():
            p.grad = torch.full_like(p, 0.01)
        optimizer.step()
    except Exception as e:  # noqa: BLE001 - any failure of the class (torch asserts some): one line
        text = " ".join(str(e).split()) or type(e).__name__
        return f"{type(e).__name__}: {text[:200]}"
    return None


def _failing_kwargs(c: Config) -> str:
    """Which of ``optimizer.kwargs`` fail, and what is valid instead, for the refusal's one line: each
    value probed alone; when none fails alone, the combination is named."""
    kwargs = dict(c.optimizer.kwargs)
    device = _run_device(c)
    for k, v in kwargs.items():
        why = _probe_error(c, with_kwargs=True, kwargs={k: v})
        if why is not None:
            other = f"{k}={not v}" if isinstance(v, bool) else f"another {k} that the class accepts"
            return f"{other}, or no {k} ({k}={v!r} fails on this run's device, {device}: {why})"
    together = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    why = _probe_error(c, with_kwargs=True)
    return f"one of {together} left out (together they fail on this run's device, {device}: {why})"


def _class_kwargs(cls: type) -> list[str] | None:
    """The keyword arguments ``cls(params, ...)`` takes; None when it takes any (``**kwargs``)."""
    import inspect

    params = list(inspect.signature(cls).parameters.values())[1:]  # the first is the params
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    config_only = getattr(cls, "CONFIG_ONLY", ())  # the framework's AdamW: set by config keys
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in kinds and p.name not in config_only]


def _flag_kwargs(cls: type) -> list[str]:
    """The keyword arguments of ``cls`` that are switches (a bool default or a ``bool`` /
    ``bool | None`` annotation): torch tests them for truth, so ``foreach=yes`` (a string) or
    ``amsgrad=1`` passed the probe and did something else than written, or nothing."""
    import inspect

    flags = []
    for name, p in list(inspect.signature(cls).parameters.items())[1:]:
        text = str(p.annotation).replace("typing.", "").replace("<class 'bool'>", "bool")
        if isinstance(p.default, bool) or text in ("bool", "bool | None", "Optional[bool]"):
            flags.append(name)
    return flags


def _bad_flag(v: Any, c: Config) -> str | None:
    """The first switch of ``optimizer.kwargs`` whose value is not true, false (or null where the
    class's default is): ``foreach=yes`` was accepted."""
    cls = _optimizer_class(c)
    if cls is None:
        return None
    flags = _flag_kwargs(cls)
    return next((k for k, x in v.items() if k in flags and not isinstance(x, bool) and x is not None), None)


def _kwargs_names_ok(v: Any, c: Config) -> bool:
    if not all(isinstance(k, str) and k.isidentifier() and k not in RESERVED_KWARGS for k in v):
        return False
    cls = _optimizer_class(c)
    takes = _class_kwargs(cls) if cls is not None else None
    return takes is None or all(k in takes for k in v)


def _kwargs_ok(v: Any, c: Config) -> bool:
    if not _kwargs_names_ok(v, c) or _bad_flag(v, c) is not None:
        return False
    return not v or _probe_error(c, with_kwargs=True) is None


def _kwargs_valid(c: Config) -> str:
    cls = _optimizer_class(c)
    takes = _class_kwargs(cls) if cls is not None else None
    names = "" if takes is None else f": {', '.join(k for k in takes if k not in RESERVED_KWARGS)}"
    what = f"optimizer._target_={c.optimizer._target_}"
    if cls is not None and hasattr(cls, "CONFIG_ONLY"):
        what = f"the framework's AdamW of optimizer.state_dtype={c.optimizer.state_dtype.value}"
    text = (
        f"keyword arguments that {what} takes{names} (not "
        f"{', '.join(RESERVED_KWARGS)}: set train.lr and train.weight_decay)"
    )
    flag = _bad_flag(c.optimizer.kwargs, c) if _kwargs_names_ok(c.optimizer.kwargs, c) else None
    if flag is not None:
        return f"{flag}=true or {flag}=false ({flag}={c.optimizer.kwargs[flag]!r} is not a boolean)"
    if _kwargs_names_ok(c.optimizer.kwargs, c):  # the names are fine, a value is not: say which
        return _failing_kwargs(c)
    return text


# lr: train.lr is the schedule's peak; weight_decay: each param group sets train.weight_decay (or 0
# on norms), which wins over a class default, so a kwargs one did nothing.
RESERVED_KWARGS = (
    "params",
    "lr",
    "weight_decay",
    "_target_",
    "_partial_",
    "_convert_",
    "_recursive_",
    "_args_",
)


# ----------------------------------------------------------------------------------------------
# model.moe: each key means something only on a family that reads it (its record's ``moe_keys``);
# elsewhere it must stay at its default. On such a family, its range (and its relation to the others).
# ----------------------------------------------------------------------------------------------

MAX_EXPERTS = 2**16  # routed experts per layer; the largest published models have a few hundred
_MOE_DEFAULT = MoEConfig()


def _family(c: Config) -> str:
    return getattr(c.model.family, "value", c.model.family)


def _moe_keys(c: Config) -> tuple[str, ...]:
    fam = next((f for f in FAMILIES.values() if f.name == _family(c)), None)
    return fam.moe_keys if fam is not None else ()


def moe_key(
    leaf: str, valid: Valid, ok: Callable[[Any, Config], bool], bad: tuple[Any, ...], **ctx: Any
) -> Rule:
    """``model.moe.<leaf>``: its default on a family whose record does not list it, else ``ok``."""
    default = getattr(_MOE_DEFAULT, leaf)

    def check_value(v: Any, c: Config) -> bool:
        if leaf not in _moe_keys(c):
            return v == default
        return ok(v, c)

    def text(c: Config) -> str:
        if leaf not in _moe_keys(c):
            owners = "|".join(f.name for f in FAMILIES.values() if leaf in f.moe_keys) or "none"
            return (
                f"{show(default)} (the default) with model.family={_family(c)}, which does not read it; "
                f"model.moe.{leaf} is for model.family={owners}"
            )
        return valid(c) if callable(valid) else valid

    context = tuple(
        (f"model.{k}" if "." in k or k == "family" else f"model.moe.{k}", v) for k, v in ctx.items()
    )
    return Rule(text, check_value, bad, context=context)


# The context the range of a key is tested in: a sparse family with 4 experts.
_SPARSE = {"family": "qwen3_moe", "num_experts": 4}

# DeepSeek-V3's routing keys are tested on its family with 8 experts.
_DEEPSEEK = {"family": "deepseek_v3", "num_experts": 8}


def _n_group_ok(g: int, experts: int) -> bool:
    return g == 1 or (1 < g and experts % g == 0 and experts // g >= 2)


def _topk_group_ok(tg: int, moe: Any) -> bool:
    g = moe.n_group
    return 1 <= tg <= g and moe.num_experts_per_tok <= tg * (moe.num_experts // max(g, 1))


def _pattern_layers(c: Config) -> int:
    """The layers model.layer_pattern gives (-1: it does not parse; the spec's refusal says where)."""
    try:
        return model_spec(c.model).n_layers
    except ValueError:
        return -1


MOE_RULES: dict[str, Rule] = {
    f"model.moe.{k}": r
    for k, r in {
        "num_experts": moe_key(
            "num_experts",
            f"an integer in 1..{MAX_EXPERTS} (a sparse family has experts)",
            lambda v, _c: _is_int(v) and 1 <= v <= MAX_EXPERTS,
            (0, -1, MAX_EXPERTS + 1),
            family="qwen3_moe",
        ),
        "num_experts_per_tok": moe_key(
            "num_experts_per_tok",
            lambda c: (
                f"an integer in 1..model.moe.num_experts={c.model.moe.num_experts} (top-k of the experts)"
            ),
            lambda v, c: _is_int(v) and 1 <= v <= c.model.moe.num_experts,
            (0, 5),
            **_SPARSE,
        ),
        "moe_intermediate_size": moe_key(
            "moe_intermediate_size",
            f"0 (= model.ffn_dim) or an integer in 1..{MAX_WIDTH}",
            lambda v, _c: _is_int(v) and 0 <= v <= MAX_WIDTH,
            (-1, MAX_WIDTH + 1),
            **_SPARSE,
        ),
        "norm_topk_prob": moe_key(
            "norm_topk_prob", "true or false", lambda v, _c: isinstance(v, bool), (False,)
        ),
        "router_score": moe_key("router_score", "softmax or sigmoid", lambda v, _c: True, ("sigmoid",)),
        "routed_scaling_factor": moe_key(
            "routed_scaling_factor",
            "a finite number > 0 and <= 1000 (1 = off)",
            lambda v, _c: _is_number(v) and math.isfinite(v) and 0 < v <= 1000,
            (0.0, -1.0, math.nan, 1e18),
            **_SPARSE,
        ),
        "bias_update_rate": moe_key(
            "bias_update_rate",
            "a finite number >= 0 and <= 1 (0 = a fixed zero selection bias)",
            lambda v, _c: _is_number(v) and math.isfinite(v) and 0 <= v <= 1,
            (-0.001, math.nan, 1e18),
            **_SPARSE,
            router_score="sigmoid",
        ),
        "capacity_factor": moe_key(
            "capacity_factor",
            f"0 (no token dropped) or a finite number > 0 and <= {MAX_EXPERTS} (the experts' count)",
            lambda v, _c: _is_number(v) and math.isfinite(v) and 0 <= v <= MAX_EXPERTS,
            (-1.0, math.nan, math.inf, 1e18),
            **_SPARSE,
        ),
        "router_aux_loss_coef": moe_key(
            "router_aux_loss_coef",
            "a finite number >= 0 and <= 1 (0 = no load-balancing loss; published: 0.001 to 0.02)",
            lambda v, _c: _is_number(v) and math.isfinite(v) and 0 <= v <= 1,
            (-0.1, math.nan, 1e18),
            **_SPARSE,
        ),
        "aux_loss_scope": moe_key("aux_loss_scope", "global or layer", lambda v, _c: True, ("layer",)),
        "num_shared_experts": moe_key(
            "num_shared_experts",
            f"an integer in 0..{MAX_EXPERTS}",
            lambda v, _c: _is_int(v) and 0 <= v <= MAX_EXPERTS,
            (-1, MAX_EXPERTS + 1),
            **_SPARSE,
        ),
        "shared_intermediate_size": moe_key(
            "shared_intermediate_size",
            f"0 (= the routed experts' width) or an integer in 1..{MAX_WIDTH}",
            lambda v, _c: _is_int(v) and 0 <= v <= MAX_WIDTH,
            (-1, MAX_WIDTH + 1),
            **_SPARSE,
        ),
        "expert_kernel": moe_key("expert_kernel", "auto, grouped or loop", lambda v, _c: True, ("loop",)),
        # DeepSeek-V3's group-limited routing (framework.models.moe.check_moe says why each bound).
        "n_group": moe_key(
            "n_group",
            lambda c: (
                f"a divisor of model.moe.num_experts={c.model.moe.num_experts} leaving >= 2 experts a group, "
                "or 1 (no group limit)"
            ),
            lambda v, c: _is_int(v) and _n_group_ok(v, c.model.moe.num_experts),
            (0, 3, 8),
            **_DEEPSEEK,
        ),
        "topk_group": moe_key(
            "topk_group",
            lambda c: (
                f"an integer in 1..model.moe.n_group={c.model.moe.n_group}, its groups holding at least "
                f"model.moe.num_experts_per_tok={c.model.moe.num_experts_per_tok} experts"
            ),
            lambda v, c: _is_int(v) and _topk_group_ok(v, c.model.moe),
            (0, 5),
            **_DEEPSEEK,
            n_group=4,
        ),
    }.items()
}


RULES: dict[str, Rule] = {
    # model: the shape is checked here so a bad one never reaches the model code (model.dim=0 was a
    # 253-line traceback from inside a rank).
    "model.name": name(),
    "model.family": TYPED,
    # Before model.dim, whose rule reads it. RoPE rotates pairs of features: an even size.
    "model.head_dim": Rule(
        "0 (= model.dim / model.n_heads) or an even integer >= 2",
        lambda v, _c: _is_int(v) and 0 <= v <= 2**20 and v % 2 == 0,
        (-2, 3),
    ),
    "model.n_heads": integer(1, MAX_HEADS),  # before model.dim and model.n_kv_heads, whose rules divide by it
    "model.dim": Rule(_dim_valid, _head_dim_ok, (0, 130, 132, MAX_WIDTH * 2)),
    # Bounded: the launcher lists every layer's tensors (num_hidden_layers: 50000000 in an HF
    # config.json hung it); the largest published models have ~128 layers.
    "model.n_layers": integer(1, MAX_LAYERS),
    "model.n_kv_heads": Rule(
        lambda c: f"a divisor of model.n_heads={c.model.n_heads}: {_divisors(c.model.n_heads)}",
        _kv_ok,
        (0, 3, 8),
    ),
    "model.ffn_dim": integer(1, MAX_WIDTH),
    # The families' own keys (framework.config.schema.MODEL_SCHEMAS): each exists only under its
    # family's option (model=mistral), so a rule here reads it only there.
    "model.sliding_window": integer(
        0, MAX_POSITIONS, what="0 = off, full causal attention; >= 1: the window"
    ),
    # DeepSeek-V3's own (framework.models.deepseek_v3): its stack of layers and multi-head latent
    # attention. The pattern must give model.n_layers layers (before it: its rule reads it).
    "model.layer_pattern": Rule(
        lambda c: (
            f"a stack of model.n_layers={c.model.n_layers} layers: items KIND or KIND xN separated by commas, "
            "KIND the family's (deepseek_v3: dense|moe, e.g. 'dense x1, moe x3'; gpt_oss: sliding|full, "
            "e.g. '[sliding, full] x2')"
        ),
        lambda v, c: isinstance(v, str) and _pattern_layers(c) == c.model.n_layers,
        ("dense x1, moe x2", "dense x1, mo x3", "dense x5"),
    ),
    "model.q_lora_rank": integer(0, MAX_WIDTH, what="0 = one full query projection"),
    "model.kv_lora_rank": integer(1, MAX_WIDTH),
    "model.qk_nope_head_dim": integer(1, MAX_WIDTH),
    # RoPE rotates pairs of features: an even size.
    "model.qk_rope_head_dim": Rule(
        "an even integer >= 2 (RoPE rotates pairs of features)",
        lambda v, _c: _is_int(v) and 2 <= v <= MAX_WIDTH and v % 2 == 0,
        (0, 7, MAX_WIDTH + 2),
    ),
    "model.v_head_dim": integer(1, MAX_WIDTH),
    "model.rope_yarn_factor": number(1, 1024, what="1 = no YaRN", bad=(math.nan, math.inf, 0.5, 1e18)),
    "model.rope_yarn_original_max_position": integer(1, MAX_POSITIONS),
    "model.rope_yarn_beta_fast": number(0, 1e4, lo_open=True),
    "model.rope_yarn_beta_slow": number(0, 1e4, lo_open=True),
    "model.rope_yarn_mscale": number(0, 1e4),
    "model.rope_yarn_mscale_all_dim": number(0, 1e4),
    "model.rope_yarn_truncate": TYPED,
    # GPT-OSS's own (framework.models.gpt_oss): the experts' SwiGLU clamp.
    "model.swiglu_limit": number(0, 1e4, lo_open=True),
    "model.vocab_size": integer(1, 2**32, what="token ids are stored as uint16/uint32"),
    "model.norm_eps": number(0, 1, lo_open=True),
    "model.rope_theta": number(0, 1e12, lo_open=True),  # published: 1e4 to 1e7
    "model.rope_scaling_factor": number(
        1, 1024, what="1 = no RoPE scaling", bad=(math.nan, math.inf, 0.5, 1e18)
    ),
    "model.rope_low_freq_factor": number(0, 1e4, lo_open=True),
    # The interpolation divides by (high - low): equal factors would divide by zero.
    "model.rope_high_freq_factor": Rule(
        lambda c: f"a finite number > model.rope_low_freq_factor={c.model.rope_low_freq_factor:g} and <= 1e4",
        lambda v, c: _is_number(v) and math.isfinite(v) and c.model.rope_low_freq_factor < v <= 1e4,
        (1.0, math.nan, 1e5),
    ),
    "model.rope_original_max_position": integer(1, MAX_POSITIONS),
    "model.max_position_embeddings": integer(0, MAX_POSITIONS, what="0 = train.seq_len"),
    "model.tie_embeddings": TYPED,
    "model.init_std": number(0, 1, lo_open=True),
    # fa4 off CUDA, off sm90/sm100, with an unsupported head size, with context parallelism, without
    # torch's registry or the package is refused by framework.kernels.fa4 before launch (with
    # data.document_mask, by framework.data).
    "model.attention": TYPED,
    "model.residual_dtype": TYPED,
    # CPU, GPUs below sm89 and shapes float8 cannot handle are refused by framework.kernels.float8 before launch.
    "model.float8": TYPED,
    "model.float8_skip": names_list(
        "Linear name fragments (non-empty strings); [] converts every eligible layer"
    ),
    "model.float8_size_filter": TYPED,
    "model.float8_grad_dtype": Rule(
        "e5m2 (default) or e4m3, only with model.float8=tensorwise (rowwise casts gradients to e4m3)",
        checked_by="framework.launch.rules.check_option_fields (model.float8_grad_dtype is only_with tensorwise)",
        bad=("e4m3",),
    ),
    "model.float8_fast_accum": Rule(
        "true or false (default), only with model.float8=tensorwise or rowwise",
        checked_by="framework.launch.rules.check_option_fields (model.float8_fast_accum is only_with float8)",
        bad=(True,),
    ),
    # Off CUDA (in a dry run: the declared hardware), a missing package (a dry run warns), executor.scope=model
    # and TP are refused by framework.kernels.fused_ce before launch.
    "model.fused_cross_entropy": TYPED,
    "model.init_from": optional_path(
        "framework.checkpoint.init_from reads the checkpoint and checks every tensor"
    ),
    **MOE_RULES,
    "tokenizer.kind": TYPED,
    "tokenizer.path": optional_path("framework.data.tokenizer reads the file"),
    "tokenizer.bos_token": optional_name("unset (null: the tokenizer's own) or a token of its vocabulary"),
    "tokenizer.eos_token": optional_name("unset (null: the tokenizer's own) or a token of its vocabulary"),
    "tokenizer.add_bos": TYPED,
    "data.source": TYPED,
    "data.path": optional_path("framework.data.pipeline.check_data reads the files"),
    "data.val_path": optional_path("framework.data.pipeline.check_data reads the files"),
    "data.val_fraction": number(0, 1, lo_open=True, hi_open=True, bad=(0.0, 1.0, 1.5, math.nan)),
    "data.field": name("a non-empty key of each jsonl line"),
    "data.column": name("a non-empty column name"),
    "data.name": optional_name("unset (null) or a dataset configuration name"),
    "data.split": name("a split name (train, validation, ...)"),
    "data.streaming": TYPED,
    "data.sft_pack": TYPED,  # data=sft only; packing marks examples itself (framework.data.sft)
    "data.document_mask": TYPED,  # needs an EOS and a masking kernel: framework.data.pipeline
    # There the error names the entry (data.mix[1].weight=-1.0), not the list's dataclass repr.
    "data.mix": Rule(
        "[] (no mix) or entries {source, path, weight, ...} whose weights are finite numbers >= 0 "
        "summing to > 0",
        checked_by="framework.data.pipeline.check_mix",
        bad=([MixEntry(path="a.jsonl", weight=-1.0)], [MixEntry(path="a.jsonl", weight=0.0)]),
    ),
    "data.prefetch": integer(1, MAX_PREFETCH, what="global batches held ahead in memory"),
    "data.encode_batch": integer(1, 2**20),
    "data.messages_field": name("a non-empty key of each jsonl line"),
    "data.prompt_field": name("a non-empty key of each jsonl line"),
    "data.response_field": name("a non-empty key of each jsonl line"),
    # train
    "train.steps": integer(0, MAX_STEPS, what="0 plans, builds and evaluates without training"),
    "train.global_batch_size": integer(1, MAX_GLOBAL_BATCH, what="sequences per optimizer step"),
    "train.micro_batch_size": integer(
        0, MAX_GLOBAL_BATCH, what="0 = the rank's whole share of the global batch"
    ),
    "train.seq_len": integer(1, MAX_POSITIONS),
    "train.lr": number(0, 10, lo_open=True, bad=(math.nan, math.inf, -0.01, 0.0, 1e18)),
    "train.min_lr_ratio": number(0, 1, bad=(-0.1, 1.5, math.nan)),
    "train.warmup_steps": integer(0, MAX_STEPS),
    "train.weight_decay": number(0, 10),
    "train.beta1": number(0, 1, hi_open=True, bad=(1.0, -0.1, math.nan)),
    "train.beta2": number(0, 1, hi_open=True, bad=(1.0, 1.5, math.nan)),
    "train.grad_clip": number(0, 1e6, what="0 = no clipping, the norm is still logged"),
    # One device, one micro-batch, no clip: framework.planner.plan._check_in_backward (the loop asserts it).
    "train.optimizer_in_backward": TYPED,
    "train.in_backward_grad_checks": TYPED,
    "train.seed": integer(0, 2**32 - 1),
    "train.log_every": integer(1, MAX_STEPS),
    "train.eval_every": integer(0, MAX_STEPS, what="0 = no evaluation"),
    "train.eval_sets": Rule(
        "[] (none) or entries {name, source, path, field, column} with unique names and data of at least "
        "one window (train.eval_every>0)",
        checked_by="framework.data.pipeline.check_eval_sets",
        bad=([EvalSet(name="", path="a.jsonl")],),
    ),
    "train.eval_batches": Rule(_eval_batches_valid, _eval_batches_ok, (0, 10**8, 10**1000)),
    # optimizer, lr_scheduler (framework.train.loop.build_optimizer, lr_lambda)
    # Muon on a sharded layout: check_layout, once the launcher read the layout (the same line).
    "optimizer.name": Rule(
        _muon_valid, _muon_ok, ("muon",), context=(("sharding.strategy", "fsdp"), ("mesh.shape", [2]))
    ),
    # The allowlist itself: framework.config.instantiate.check_targets (framework.launch.prelaunch.check_safe), first.
    "optimizer._target_": Rule(
        _target_valid,
        _target_ok,
        ("os.system", "builtins.exec", "torch.nn.Linear", "torch.optim.LBFGS", "torch.optim.SparseAdam"),
    ),
    "optimizer.kwargs": Rule(
        _kwargs_valid,
        _kwargs_ok,
        ({"params": 1}, {"lr": 0.1}, {"weight_decay": 0.0}, {"nope": 1}, {"betas": 5}, {"eps": -1})
        + ({"differentiable": True}, {"foreach": True, "fused": True}, {"foreach": "yes"}, {"amsgrad": 1}),
    ),
    "optimizer.momentum": Rule(
        "a number in [0, 1); > 0 with optimizer.nesterov=true", _momentum_ok, (-0.1, 1.0, math.nan)
    ),
    "optimizer.nesterov": TYPED,  # its relation to momentum: optimizer.momentum
    "optimizer.muon_adjust_lr": TYPED,
    "optimizer.muon_ns_steps": integer(1, 99, what="torch.optim.Muon refuses 100 or more"),
    "optimizer.state_dtype": Rule(_state_dtype_valid, _state_dtype_ok, ("float16",)),
    "lr_scheduler.name": TYPED,
    "lr_scheduler.decay_fraction": number(0, 1, bad=(-0.1, 1.5, math.nan)),
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
    # mesh
    "mesh.shape": Rule(
        "a list of positive integers, e.g. [8] or [2, 4]",
        checked_by="framework.planner.topology.validate_mesh (ranks vs cores: framework.launch.ranks)",
        bad=([0], [], [2, -1], [100_000], [99_999_999_999], [2**11, 2**10]),
        context=(("run.device", "cpu"),),
    ),
    "mesh.hardware.name": name("a non-empty name ('cpu' or a conf/mesh/hardware option)"),
    # A device's figures (GiB, TFLOP/s, GB/s, microseconds), each bounded at about 1000 times the
    # largest shipped one (B200: 180 GiB, 4500 TFLOP/s, 8000 GB/s): beyond, the planner's times round to 0.
    "mesh.hardware.memory_gib": number(0, 2**18, lo_open=True),
    "mesh.hardware.peak_tflops": number(0, 1e7, lo_open=True),
    "mesh.hardware.intra_node_gbps": number(0, MAX_RATE_GBPS, lo_open=True),
    "mesh.hardware.inter_node_gbps": number(0, MAX_RATE_GBPS, lo_open=True),
    "mesh.hardware.intra_node_latency_us": number(0, 1e6),
    "mesh.hardware.inter_node_latency_us": number(0, 1e6),
    "mesh.hardware.numa_per_host": integer(1, 1024),
    "mesh.hardware.gemm_efficiency": number(0, 1, lo_open=True),
    "mesh.hardware.hbm_gbps": number(0, MAX_RATE_GBPS, lo_open=True),
    "mesh.hardware.host_link_gbps": number(0, MAX_RATE_GBPS, lo_open=True),
    "mesh.hardware.link_efficiency": number(0, 1, lo_open=True),
    "mesh.hardware.comm_overlap": number(0, 1),
    "mesh.hardware.kernel_table": Rule(
        "null or the name of a measured table, conf/mesh/hardware/tables/NAME.json (benchmarks/kernel_tables.py)",
        checked_by="framework.planner.kernels.load_table (via the planner: every entry a finite rate above 0)",
        bad=("nosuch", "../h100_sxm"),
    ),
    "mesh.hardware.compute_capability": Rule(
        "[] (no CUDA GPU) or [major, minor] of a CUDA GPU, e.g. [9, 0] for Hopper, [8, 0] for A100",
        lambda v, _c: _capability_ok(v),
        ([9], [9, 0, 1], [0, 0], [9, 10]),
    ),
    # parallel: the degrees (framework.planner.layout)
    **{
        f"parallel.{n}": Rule(
            "0 (unset), -1 (the rest) or a degree >= 1; the degrees multiply to the world size "
            "(pp: at most model.n_layers; cp: 2 x cp divides train.seq_len, on CUDA or in a dry run)",
            checked_by="framework.planner.layout.from_parallel / check_degrees / check_cp (via the planner)",
            bad=(-2, 3),
        )
        for n in ("dp_replicate", "dp_shard", "cp", "tp", "pp")
    },
    "parallel.loss_parallel": TYPED,
    # The combinations (eager, a CPU launch) are the planner's: framework.planner.plan._check_async_tp.
    "parallel.async_tp": TYPED,
    "parallel.ep": Rule(
        "0 or 1 (off), or an expert-parallel degree >= 2 that divides parallel.dp_shard (the ep ranks "
        "are borrowed from it) and model.moe.num_experts, with a sparse family and parallel.cp=1",
        checked_by="framework.planner.layout.from_parallel / check_ep (via the planner), check_dense_ep (check_layout)",
        bad=(-1, 3),
        context=(("mesh.shape", [2]),),
    ),
    # the pipeline (framework.planner.stages): bad values are refused under a 2-stage pipeline; any of the
    # three set where no pipeline runs (a layout with pp=1, one process) by check_without_pipeline
    "parallel.pp_schedule": TYPED,
    "parallel.pp_microbatches": Rule(
        "0 (= the rank's batch / train.micro_batch_size, or parallel.pp) or an integer >= parallel.pp "
        "that divides the data-parallel rank's batch",
        checked_by="framework.planner.stages.check_pipeline (via the planner), check_without_pipeline (entry)",
        bad=(-1, 1, 3),
        context=(("mesh.shape", [2]), ("parallel.pp", 2), ("model.tie_embeddings", False)),
    ),
    "parallel.pp_stages_per_rank": Rule(
        "an integer >= 1: 1 for gpipe / 1f1b, >= 2 for interleaved_1f1b / interleaved_zb, 2 for zbv; "
        "parallel.pp x it <= model.n_layers",
        checked_by="framework.planner.stages.check_pipeline (via the planner)",
        bad=(0, 2),
        context=(("mesh.shape", [2]), ("parallel.pp", 2), ("model.tie_embeddings", False)),
    ),
    # sharding
    "sharding.strategy": TYPED,
    "sharding.tp": Rule(
        "an integer >= 1 that divides the world size, model.n_heads, n_kv_heads and ffn_dim",
        checked_by="framework.planner.plan (layout and TP degree)",
        bad=(0, 3),
        context=(("sharding.strategy", "fsdp_tp"),),
    ),
    "sharding.reshard_after_forward": TYPED,
    "sharding.param_dtype": TYPED,
    "sharding.reduce_dtype": TYPED,
    "sharding.activation_checkpointing": TYPED,  # budget needs a compiled executor: framework.planner.plan
    "sharding.activation_memory_budget": Rule(
        "0.0 to 1.0, a fraction of the compiled default's saved activations",
        checked_by="framework.planner.plan (with activation_checkpointing=budget; else a warning)",
        bad=(-0.1, 1.5, math.nan),
        context=(("sharding.activation_checkpointing", "budget"), ("executor.mode", "compile")),
    ),
    # the host memory the saved activations need: framework.launch.ranks.check_offload_memory
    "sharding.activation_offload": TYPED,
    # bucketing
    "bucketing.bucket_cap_mb": number(0, 2**20, lo_open=True),
    "bucketing.gradient_as_bucket_view": TYPED,
    "bucketing.static_graph": TYPED,
    "bucketing.auto": TYPED,
    # nccl: the variables themselves are checked against NCCL's table in framework.planner.topology
    "nccl.preset": name(),
    "nccl.preset_env": Rule(
        "NCCL variables NCCL accepts",
        checked_by="framework.planner.topology.nccl_environment",
        bad=({"NCCL_DEBUG": "LOUD"},),
    ),  # fmt: skip
    "nccl.env": Rule(
        "NCCL variables NCCL accepts",
        checked_by="framework.planner.topology.nccl_environment",
        bad=({"NCCL_ALGO": "Bogus"},),
    ),  # fmt: skip
    "nccl.topo_file": Rule(
        "an NCCL topology XML file",
        checked_by="framework.planner.topology.nccl_environment",
        bad=("/nonexistent/topo.xml",),
    ),  # fmt: skip
    "nccl.topo_dump_file": optional_path("relative paths land in the run dir"),
    "nccl.socket_ifname": optional_path("interface prefixes, ^exclude or =exact"),
    "nccl.require_socket_ifname": TYPED,
    "nccl.timeout_s": number(
        0, MAX_TIMEOUT_S, lo_open=True, what="a week at most", bad=(0.0, -1.0, math.nan, math.inf, 1e300)
    ),
    "nccl.async_error_handling": Rule(
        "0, 1, 2 or 3 (TORCH_NCCL_ASYNC_ERROR_HANDLING)",
        checked_by="framework.planner.topology.nccl_environment",
        bad=(-1, 4),
    ),  # fmt: skip
    # freeze
    # An MoE family's per-expert counts decide the experts' shapes: torch.export traces them as
    # unbacked sizes (framework.freeze), TorchScript cannot (script and trace are for dense families).
    "freeze.mode": Rule(
        lambda c: (
            f"none or export with model.family={_family(c)} (an MoE family: its per-expert sizes are "
            "data-dependent, which torch.export traces and TorchScript does not); script or trace "
            "with a dense family"
        ),
        lambda v, c: getattr(v, "value", v) in ("none", "export") or not _moe_keys(c),
        ("script", "trace"),
        context=(("model.family", "qwen3_moe"), ("model.moe.num_experts", 4)),
    ),
    "freeze.strict": TYPED,
    "freeze.check_graph_breaks": TYPED,
    "freeze.ignore": names_list("submodule or method paths (non-empty strings)"),
    "freeze.export_methods": names_list("method names (non-empty strings)"),
    # peft (framework.models.lora): the patterns and the rank against the model's own Linears
    "peft.method": TYPED,
    "peft.targets": Rule(
        lambda c: (_lora_error(c) or "patterns of Linear layers").split("valid: ", 1)[-1],
        lambda v, c: _lora_error(c) is None or not _lora_error(c).startswith("peft.targets"),
        (["no_such_layer"],),
        context=(("peft.method", "lora"),),
    ),
    "peft.rank": Rule(
        lambda c: (_lora_error(c) or f"an integer in 1..{MAX_WIDTH}").split("valid: ", 1)[-1],
        lambda v, c: _is_int(v) and 1 <= v <= MAX_WIDTH and _lora_error(c) is None,
        (0, -1, 100000),
        context=(("peft.method", "lora"),),
    ),
    "peft.adapter": Rule(
        lambda c: (_adapter_error(c) or "a PEFT adapter folder").split("valid: ", 1)[-1],
        lambda v, c: v is None or _adapter_error(c) is None,
        ("/nonexistent/adapter",),
        context=(("peft.method", "lora"),),
    ),
    "peft.alpha": number(0, 2**16, lo_open=True, bad=(0.0, -1.0, math.nan, math.inf, 1e18)),
    "peft.dropout": number(0, 1, hi_open=True, bad=(-0.1, 1.0, math.nan)),
    "peft.base_dtype": Rule(
        "float32 or bfloat16 (float32 with FSDP: framework.parallel.lora.check_layout, after the plan)",
        lambda v, c: getattr(v, "value", v) != "float16",
        ("float16",),
        context=(("peft.method", "lora"),),
    ),
    # executor
    "executor.mode": TYPED,  # cudagraphs needs CUDA (in a dry run the declared): framework.launch.prelaunch.check_cudagraphs
    "executor.scope": TYPED,
    "executor.backend": Rule(
        _backend_valid, _backend_ok, ("no_such_backend",), context=(("executor.mode", "compile"),)
    ),
    "executor.compile_loss": Rule(
        "true (default) or false, only with a compiled executor; false with executor.scope=model is refused",
        checked_by="framework.launch.rules.check_option_fields (only_with executor.mode) and "
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
    # checkpoint
    "checkpoint.enabled": TYPED,
    "checkpoint.dir": Rule(
        "a directory that can be created",
        checked_by="framework.launch.prelaunch.check_checkpoint_dir",
        bad=("pyproject.toml/ck",),
        context=(("checkpoint.enabled", True),),
    ),  # fmt: skip
    "checkpoint.every_steps": integer(0, MAX_STEPS, what="0 = off"),
    "checkpoint.every_minutes": number(0, 10**6, what="0 = off"),
    "checkpoint.at_end": TYPED,
    "checkpoint.async_mode": TYPED,
    "checkpoint.keep_last": integer(0, 10**6, what="0 = keep all"),
    "checkpoint.keep_every": integer(0, MAX_STEPS, what="0 = none"),
    "checkpoint.resume": Rule(
        _resume_valid, _resume_ok, ("", "/nonexistent/step_5"), context=(("checkpoint.enabled", True),)
    ),
    "checkpoint.integrity": TYPED,
    "checkpoint.export_hf": TYPED,
    # verify
    "verify.enabled": TYPED,
    "verify.policy": TYPED,
    "verify.graph": TYPED,
    "verify.ladder": TYPED,
    "verify.reference": optional_path("a fingerprint.json or an earlier run dir"),
    "verify.numerics": TYPED,
    # Relative differences: 1 is already a difference as large as the value.
    "verify.loss_rtol": number(0, 1, lo_open=True),
    "verify.logits_rtol": number(0, 1, what="0 = off"),
    "verify.logits_rtol_bf16": number(0, 1, what="0 = off"),
    "verify.logits_rtol_float8": number(0, 1, what="0 = off"),
    "verify.reference_model_max_params": integer(0, 2**40),
    "verify.baseline": optional_path("a JSON baseline store"),
    "verify.save_baseline": TYPED,
    "verify.max_tokens_per_s_drop": number(0, 1, what="a fraction", bad=(-0.1, 1.5, math.nan)),
    "verify.max_p99_increase": number(0, 1000, what="a fraction"),
    "verify.max_memory_increase": number(0, 1000, what="a fraction"),
    "verify.breaker_factor": number(1, 1e6, lo_open=True, what="a multiple of the reference p99"),
    "verify.breaker_window": integer(1, MAX_STEPS),
    "verify.breaker_patience": integer(1, MAX_STEPS),
    "verify.max_bad_steps": integer(1, MAX_STEPS),
    "verify.inject_nan_steps": Rule(
        lambda c: f"0-based steps below train.steps={c.train.steps}",
        _nan_steps_ok,
        ([-1], [10**6]),
    ),
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


def schema_keys(cls: type = Config, prefix: str = "", model: type | None = None) -> Iterator[tuple[str, Any]]:
    """Every leaf key of the schema as (dotted key, type); nested dataclasses are groups. The
    ``model`` group's keys are the shared ones, then every family's own (``model.sliding_window``),
    or only ``model``'s (one family's schema) when given."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if tp is ModelConfig:
            yield from schema_keys(model or ModelConfig, f"{prefix}{f.name}.")
            if model is None:
                for fam in MODEL_SCHEMAS.values():
                    yield from _own_schema_keys(fam, f"{prefix}{f.name}.")
        elif dataclasses.is_dataclass(tp):
            yield from schema_keys(tp, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", tp


def _own_schema_keys(fam: type, prefix: str) -> Iterator[tuple[str, Any]]:
    """The leaf keys of a family's own fields (a nested block's leaves too)."""
    own = own_keys(fam)
    for key, tp in schema_keys(fam, prefix):
        if key[len(prefix) :].split(".")[0] in own:
            yield key, tp


_ABSENT = object()


def value_at(cfg: Config, key: str) -> Any:
    """The value at a dotted key; ``_ABSENT`` for another family's key (``model.sliding_window``
    under Llama: the key does not exist there, so no rule of it applies)."""
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part, _ABSENT)
        if obj is _ABSENT:
            return _ABSENT
    return obj


def show(value: Any) -> str:
    """The value as the user wrote it, cut to one readable line (a 1000-digit int stays short)."""
    if isinstance(value, Enum):
        value = value.value
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:24]}...({len(text)} characters)"


def check_group(cfg: Config, group: str) -> None:
    """``check`` for the keys of one group only (``model``): for values read from a file before the
    whole config is checked (framework.checkpoint.init_from takes the shape from a checkpoint's config.json)."""
    for key, rule in RULES.items():
        if rule.ok is None or not key.startswith(f"{group}."):
            continue
        value = value_at(cfg, key)
        if value is not _ABSENT and not rule.ok(value, cfg):
            valid = rule.valid(cfg) if callable(rule.valid) else rule.valid
            raise ValueError(f"{key}={show(value)} is not valid; valid: {valid}")


def check(cfg: Config) -> None:
    """Raise ValueError (one line: key, value, what is valid) at the first key whose rule fails.

    Rules run in table order, so a relation (``model.n_kv_heads`` divides ``model.n_heads``) only
    runs after the keys it reads passed their own rule; then ``check_option_fields``.
    """
    for key, rule in RULES.items():
        if rule.ok is None:
            continue
        value = value_at(cfg, key)
        if value is not _ABSENT and not rule.ok(value, cfg):
            valid = rule.valid(cfg) if callable(rule.valid) else rule.valid
            raise ValueError(f"{key}={show(value)} is not valid; valid: {valid}")
    check_option_fields(cfg)


def _choice(value: Any) -> str:
    return (
        str(value).lower()
        if isinstance(value, bool)
        else value.value
        if isinstance(value, Enum)
        else str(value)
    )


def check_option_fields(cfg: Config) -> None:
    """Refuse a field of one option set under another (``framework.config.schema.only_with``): it would do
    nothing. A field left at its default passes, so a group's other options need not mention it."""
    for key, (selector, options, default) in option_fields().items():
        value, chosen = value_at(cfg, key), value_at(cfg, selector)
        if value is _ABSENT or value == default or chosen in options:
            continue
        wanted = "|".join(_choice(o) for o in options)
        raise ValueError(
            f"{key}={show(value)} does nothing with {selector}={_choice(chosen)}: it belongs to "
            f"{selector}={wanted}; set that, or leave {key} at its default ({show(default)})"
        )


def _schema_tree(model: type | None = None) -> dict[str, Any]:
    """Nested dict of the schema's group keys (``model``'s: that family's); a leaf is None (its
    value's own keys are free)."""
    tree: dict[str, Any] = {}
    for key, _tp in schema_keys(model=model):
        node = tree
        *groups, leaf = key.split(".")
        for g in groups:
            node = node.setdefault(g, {})
        node[leaf] = None
    return tree


def check_known_keys(dcfg: DictConfig) -> None:
    """Refuse a composed key the schema does not have (``+train.lrr=0.1``), naming the nearest valid key.

    OmegaConf's conversion to the typed ``Config`` drops such a key silently, so the user's setting
    would do nothing. ``hydra`` is Hydra's own; dict-valued fields (``nccl.env``) take any key.
    """
    model = dcfg.get("model") if isinstance(dcfg, DictConfig) else None
    schema = model_schema(family_of(model)) if model is not None else None
    tree = _schema_tree(schema)
    flat = list(dict(schema_keys(model=schema)))
    mine = family_of(model).value if model is not None else "llama"

    def walk(node: Any, schema: dict[str, Any], prefix: str) -> None:
        for k in node:
            key = f"{prefix}{k}"
            if k not in schema and prefix == "model." and owners(k):
                select = "|".join(owners(k))
                raise ValueError(
                    f"{key} is a key of model={select} only, not of model={mine}; select the family "
                    f"with model={select}, or drop {key}"
                )
            if k not in schema:
                near = difflib.get_close_matches(key, flat, n=1, cutoff=0.5)
                hint = f"; did you mean {near[0]}?" if near else ""
                raise ValueError(
                    f"{key} is not a config key (the schema in framework/config/schema.py has no such field, "
                    f"it would be ignored){hint}"
                )
            sub = schema[k]
            child = node[k]
            if isinstance(sub, dict) and isinstance(child, dict):
                walk(child, sub, f"{key}.")

    container = OmegaConf.to_container(dcfg, resolve=False)
    assert isinstance(container, dict)
    container.pop("hydra", None)
    walk(container, tree, "")


def check_model_shape(cfg: Config) -> None:
    """The ``model`` group's rules, for a shape read from a checkpoint (``init_from.resolve`` calls it)."""
    check_group(cfg, "model")
