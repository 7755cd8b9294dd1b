"""The ``optimizer`` keys whose rule builds the training loop's own optimizer: the class, its keyword
arguments, the state dtype and Muon (its availability here; its layout: ``framework.launch.rules.check_layout``).

Why here and not beside the schema (framework.config.rules.train holds the optimizer's other keys): each
is decided by probing ``framework.train.optimizers.build_optimizer`` over a tiny stand-in model, a layer the
config sits below.
"""

from __future__ import annotations

from typing import Any

from framework.config.rules.rule import Rule
from framework.config.schema import Config, OptimizerName


def _muon_ok(v: Any, c: Config) -> bool:
    """Muon needs torch.optim.Muon; its layout (whole matrices on each rank) is ``check_layout``'s."""
    if v is not OptimizerName.muon:
        return True
    import torch

    return hasattr(torch.optim, "Muon")


def muon_valid(c: Config) -> str:
    import torch

    if not hasattr(torch.optim, "Muon"):
        return f"adamw, adam or sgd: the installed torch {torch.__version__} has no torch.optim.Muon"
    return (
        f"adamw, adam or sgd with sharding.strategy={c.sharding.strategy.value}; muon orthogonalizes "
        "whole weight matrices and needs a layout without dp_shard or tp (sharding=ddp, or sharding=auto)"
    )


def _state_dtype_ok(v: Any, c: Config) -> bool:
    from framework.config.schema import DType
    from framework.train.optimizers import OWN_CLASS

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
    """Why the training loop's own optimizer (framework.train.optimizers.build_optimizer) cannot be built over a
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

    from framework.train.optimizers import build_optimizer

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


# The table's order: these three before the config's own optimizer keys, then state_dtype
# (framework.launch.rules assembles it).
OPTIMIZER_PROBED_RULES: dict[str, Rule] = {
    # optimizer (framework.train.optimizers.build_optimizer)
    # Muon on a sharded layout: check_layout, once the launcher read the layout (the same line).
    "optimizer.name": Rule(
        muon_valid, _muon_ok, ("muon",), context=(("sharding.strategy", "fsdp"), ("mesh.shape", [2]))
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
    "optimizer.state_dtype": Rule(_state_dtype_valid, _state_dtype_ok, ("float16",)),
}
