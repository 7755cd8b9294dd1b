"""The ``optimizer`` and ``lr_scheduler`` groups built: the optimizer over a model's trainable
parameters (no weight decay on norms; Muon and AdamW together under ``optimizer=muon``) and the
learning-rate factor of each step.

Apart from the step (framework.train.loop) because a build makes them once and the launcher probes
them over a stand-in model before any rank starts (framework.launch.optimizer_rules).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from framework.config.instantiate import check_target, safe_instantiate
from framework.config.schema import (
    DType,
    LRSchedulerConfig,
    LRSchedulerName,
    OptimizerConfig,
    OptimizerName,
    RunConfig,
    TrainConfig,
)
from framework.parallel.pipeline import tied_copies
from framework.train.adamw import AdamW, closure_loss


def lr_lambda(cfg: TrainConfig, sched: LRSchedulerConfig | None = None) -> Callable[[int], float]:
    """The learning-rate factor of each step (``lr_scheduler.name``): linear warmup to ``lr``, then
    cosine or linear decay to ``lr * min_lr_ratio`` at ``steps``, a constant ``lr``, or
    warmup-stable-decay (constant, then linear decay over the last ``decay_fraction`` of the steps)."""
    sched = sched or LRSchedulerConfig()
    name = sched.name
    floor = cfg.min_lr_ratio
    decay_start = cfg.warmup_steps
    if name is LRSchedulerName.wsd:
        decay_start = max(cfg.warmup_steps, cfg.steps - round(sched.decay_fraction * cfg.steps))

    def factor(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if name is LRSchedulerName.constant or step < decay_start:
            return 1.0
        span = max(1, cfg.steps - decay_start)
        progress = min(1.0, (step - decay_start) / span)
        if name is LRSchedulerName.cosine:
            cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
            return floor + (1.0 - floor) * cosine
        return floor + (1.0 - floor) * (1.0 - progress)  # linear, and wsd's decay

    return factor


# The class each option names in its conf/optimizer/NAME.yaml: called with the option's own arguments.
OWN_CLASS = {
    OptimizerName.adamw: "torch.optim.AdamW",
    OptimizerName.adam: "torch.optim.Adam",
    OptimizerName.sgd: "torch.optim.SGD",
    OptimizerName.muon: "torch.optim.Muon",
}


class Combined(torch.optim.Optimizer):
    """Optimizers over disjoint parameters, seen as one (``optimizer=muon``: Muon and AdamW).

    Why one object: the trainer, the scheduler, optimizer-in-backward and DCP's ``get_state_dict``
    all take one optimizer. Its ``param_groups`` are the parts' own group dicts (the scheduler's lr
    reaches every part) and its ``state`` is the one dict that every part reads and writes, so
    ``state_dict`` / ``load_state_dict`` are torch's own; loading rebinds the parts to the new dicts.
    """

    def __init__(self, parts: list[torch.optim.Optimizer]) -> None:
        self.parts = parts
        super().__init__([{"params": g["params"]} for o in parts for g in o.param_groups], {})
        self._bind(sum((o.param_groups for o in parts), []))

    def _bind(self, groups: list[dict]) -> None:
        self.param_groups = groups
        i = 0
        for o in self.parts:
            n = len(o.param_groups)
            o.param_groups = groups[i : i + n]
            o.state = self.state
            i += n

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        for o in self.parts:
            o.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._bind(self.param_groups)


def _decay_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict]:
    """No weight decay on norms (1-D weights)."""
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _optimizer_class(opt: OptimizerConfig, allow: list[str]) -> Callable[..., torch.optim.Optimizer]:
    """``optimizer._target_`` through the allowlist; the caller passes ``optimizer.kwargs`` over the
    option's own arguments (bound here, the option's own won: a kwargs betas did nothing)."""
    check_target(opt._target_, allow, where="optimizer._target_")  # the error names the key
    return safe_instantiate({"_target_": opt._target_, "_partial_": True}, allow)


def build_optimizer(
    model: nn.Module,
    cfg: TrainConfig,
    device: torch.device,
    opt: OptimizerConfig | None = None,
    allow: list[str] | None = None,
) -> torch.optim.Optimizer:
    """The ``optimizer`` group's optimizer (AdamW by default: fused kernel on CUDA). No weight decay
    on norms. Under ``muon``, Muon steps the blocks' 2-D weight matrices and AdamW the rest."""
    opt = opt or OptimizerConfig()
    allow = RunConfig().instantiate_allow if allow is None else allow
    # A pipeline's copy of a tied weight is stepped through the embedding it copies.
    copies = {id(p) for p in tied_copies(model)}
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in copies]
    own = opt._target_ == OWN_CLASS[opt.name]
    fused = device.type == "cuda"
    adam = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "fused": fused}
    make = _optimizer_class(opt, allow)
    kwargs = dict(opt.kwargs)  # over the option's own arguments, as the schema says
    if opt.name is OptimizerName.muon:
        matrices = [p for n, p in named if p.ndim == 2 and "layers" in n.split(".")]
        taken = {id(p) for p in matrices}
        rest = [p for _n, p in named if id(p) not in taken]
        muon_kw: dict[str, Any] = {"lr": cfg.lr}
        if own:
            muon_kw |= {
                "momentum": opt.momentum,
                "nesterov": opt.nesterov,
                "adjust_lr_fn": opt.muon_adjust_lr.value,
                "ns_steps": opt.muon_ns_steps,
            }
        muon = make([{"params": matrices, "weight_decay": cfg.weight_decay}], **(muon_kw | kwargs))
        return Combined([muon, torch.optim.AdamW(_decay_groups(rest, cfg.weight_decay), **adam)])
    groups = _decay_groups([p for _n, p in named], cfg.weight_decay)
    if not own:
        return make(groups, lr=cfg.lr, **kwargs)
    if opt.name is OptimizerName.adamw and opt.state_dtype is DType.bfloat16:
        return AdamW(groups, **(adam | {"state_dtype": opt.state_dtype.value} | kwargs))
    if opt.name is OptimizerName.sgd:
        return make(groups, **({"lr": cfg.lr, "momentum": opt.momentum, "nesterov": opt.nesterov} | kwargs))
    return make(groups, **(adam | kwargs))  # adamw, adam


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainConfig, sched: LRSchedulerConfig | None = None
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, sched))
