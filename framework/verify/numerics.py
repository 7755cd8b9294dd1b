"""Numerical consistency at start-up: the executed model and eager give the same loss on one batch.

Two comparisons, both on this rank's first micro-batch, without a gradient and without touching the
data sampler or the optimiser:

* executed vs the same model with compilation switched off (``torch.compiler.set_stance
  ("force_eager")`` runs every compiled function's original Python): isolates the compiler, works
  under every sharding because the wrappers (DDP, FSDP2, TP) and the weights are the very same
  objects. Skipped for ``executor=eager`` (it would compare a path with itself).
* executed vs an unsharded eager model built from the same config and seed (every layout is
  initialised to the single-process weights, see ``Decoder.init_weights``): catches sharding bugs.
  Built only when the model is small (``verify.reference_model_max_params``), since every rank
  holds a full copy for a moment.

Each rank measures its own relative differences (loss, and max |logit difference| / max |logit|;
under pipeline parallelism only the last stage's ranks have logits, the others take part in the
schedule's passes and report none); the figures are all-gathered and the worst rank decides, so every rank takes the same policy
decision. At initialisation the loss sits near ln(vocab) for any weights, so it barely moves even
for a wrong model; the logits are the sharp probe (fp32 agrees to ~1e-6, bf16 autocast to ~1e-3).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from framework.config.schema import ModelConfig
from framework.models import WeightLoader, materialize, num_params
from framework.parallel.pipeline import is_pipeline
from framework.parallel.pipeline_run import pipeline_logits
from framework.parallel.step import autocast, loss_fn
from framework.verify.report import CheckResult


@torch.no_grad()
def batch_logits(
    model: nn.Module, x: torch.Tensor, device: torch.device, y: torch.Tensor | None = None
) -> Any:
    """The logits of one micro-batch as ``train_step`` computes them (autocast), without a gradient.
    Under pipeline parallelism (the schedule needs ``y`` too) only the last stage's rank has them:
    None elsewhere."""
    if is_pipeline(model):
        assert y is not None, "a pipeline's schedule takes the targets with the tokens"
        logits = pipeline_logits(model, x, y, device)
        return None if logits is None else logits.float()
    with autocast(device):
        logits = model(x.to(device))
    full = getattr(logits, "full_tensor", None)  # a DTensor output (a TP plan without use_local_output)
    return (full() if full is not None else logits).float()


def batch_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> float:
    return float(loss_fn(batch_logits(model, x, device), y.to(device)))


def eager_logits(
    model: nn.Module, x: torch.Tensor, device: torch.device, y: torch.Tensor | None = None
) -> Any:
    """The same model's logits with every compiled function running its original (eager) code."""
    with torch.compiler.set_stance("force_eager"):
        return batch_logits(model, x, device, y)


def reference_model(
    meta: nn.Module,
    seed: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    load_weights: WeightLoader | None = None,
) -> nn.Module:
    """The unsharded eager model with the run's initial weights, from a copy of the run's meta model
    (``dtype``: FSDP's param_dtype), with its float8 layers (``model.float8``), so that only the
    sharding differs (``load_weights``: ``model.init_from``'s loader, the runner's). The caller owns
    the meta model; copying on meta costs nothing."""
    from framework.parallel.float8 import apply_float8

    model = copy.deepcopy(meta)
    apply_float8(model, model.cfg)
    materialize(model, device, seed, load_weights)
    return model.to(dtype)


def wants_reference(cfg: ModelConfig, max_params: int) -> bool:
    return num_params(cfg) <= max_params


def _rel(a: float, b: float) -> float:
    if a == b:  # also inf == inf
        return 0.0
    return abs(a - b) / max(abs(b), 1e-12)


def _diffs(executed: torch.Tensor, other: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float]:
    """(other's loss, relative loss difference, max |logit difference| / max |logit|)."""
    loss_a, loss_b = float(loss_fn(executed, y)), float(loss_fn(other, y))
    scale = float(other.abs().max())
    return loss_b, _rel(loss_a, loss_b), float((executed - other).abs().max()) / max(scale, 1e-12)


def _worst(values: list[float | None]) -> tuple[float | None, int]:
    present = [(v, r) for r, v in enumerate(values) if v is not None]
    if not present:
        return None, -1
    # NaN is the worst difference of all.
    v, r = max(present, key=lambda t: float("inf") if t[0] != t[0] else t[0])
    return v, r


def check_numerics(
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    device: torch.device,
    rtol: float,
    compiled: bool,
    make_reference: Callable[[], nn.Module] | None,
    logits_rtol: float = 1e-2,
) -> CheckResult:
    """Compare the executed loss and logits with eager (if ``compiled``) and ``make_reference()`` (if given).

    The loss must agree within ``rtol`` (relative) and the logits within ``logits_rtol`` (max absolute
    difference over the largest logit; 0 turns it off). The logits are the sharper probe: at
    initialisation the loss sits near ln(vocab) whatever the weights (a miscompiled block that is off
    by 1% moves the loss by ~1e-5 but the logits by ~1e-3). Collective (all_gather_object on the
    default group) when a process group spans several ranks. The first executed forward is where a
    lazily compiled model compiles: a compile error is raised from here, for the fallback ladder.
    """
    x, y = batch
    y = y.to(device)
    executed = batch_logits(model, x, device, y)
    eager = eager_logits(model, x, device, y) if compiled else None  # a pipeline's is collective
    mine: dict[str, Any] = {"eager": None, "unsharded": None, "loss": None}
    if executed is not None:  # under pipeline parallelism: the last stage's ranks only
        mine["loss"] = float(loss_fn(executed, y))
        if eager is not None:
            mine["eager"] = _diffs(executed, eager, y)
        if make_reference is not None:
            ref_model = make_reference()
            mine["unsharded"] = _diffs(executed, batch_logits(ref_model, x, device), y)
            del ref_model
    world = dist.get_world_size() if dist.is_initialized() else 1
    gathered: list = [mine]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
    loss = next(g["loss"] for g in gathered if g["loss"] is not None)
    figures: dict[str, float | None] = {"loss_executed": loss, "loss_rtol": rtol, "logits_rtol": logits_rtol}
    bad: list[str] = []
    labels = {"eager": "eager (compilation off)", "unsharded": "the unsharded eager model"}
    for what, label in labels.items():
        here = next((g[what] for g in gathered if g[what] is not None), None)
        figures[f"loss_{what}"] = None if here is None else here[0]
        for i, (name, tol) in enumerate((("loss", rtol), ("logits", logits_rtol)), start=1):
            worst, rank = _worst([None if g[what] is None else g[what][i] for g in gathered])
            figures[f"{name}_rel_diff_vs_{what}"] = worst
            if worst is not None and tol > 0 and not worst <= tol:  # `not <=` so that NaN fails
                bad.append(
                    f"executed {name} differs from {label} by {worst:.3g} (relative) on rank {rank}, "
                    f"above {tol:g} (verify.{name}_rtol)"
                )
    if all(g["eager"] is None and g["unsharded"] is None for g in gathered):
        return CheckResult(
            "numerics",
            None,
            "executor=eager and the model is above verify.reference_model_max_params: nothing to compare",
            figures,
        )
    return CheckResult("numerics", not bad, "\n".join(bad), figures)
