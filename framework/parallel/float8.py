"""Float8 training (``model.float8``): swap the chosen ``nn.Linear`` layers for torchao's ``Float8Linear``.

First of the parallelize concerns, on the meta model, as torchao requires: TP must shard the
float8 modules (with torchao's float8 TP styles under tensorwise, which all-gather the gradients
of the row-parallel outputs in float8), compile must trace their casts, and FSDP2 must see their
weight subclass to all-gather in float8 (``enable_fsdp_float8_all_gather``, tensorwise only). The parameters keep their names and
their fp32 master values (``Float8Linear`` subclasses ``nn.Linear`` and casts in forward), so
checkpoints, the per-name init and the fallback ladder's state carry-over see the same state dict
with float8 on or off. Which layers convert is ``framework.kernels.float8.converts`` (shared with the
planner and the refusals).

An MoE family's stacked experts (``GroupedExperts``, no ``nn.Linear``) are not swapped: they are
marked (``GroupedExperts.float8``) and run torchao's float8 grouped GEMM on their plain parameters
(framework.kernels.float8_grouped), where ``framework.kernels.float8.converts_experts`` says so.
Expert parallelism, applied later, carries the mark to its runner.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from framework.config.schema import Float8GradDtype, Float8Recipe, ModelConfig
from framework.kernels.float8 import converts, converts_experts
from framework.models.moe import GroupedExperts


def float8_config(m: ModelConfig, fsdp_all_gather: bool):  # -> torchao Float8LinearConfig
    """torchao's config for ``m.float8``: its recipe, with ``m.float8_grad_dtype`` for the output
    gradients under tensorwise (both backward GEMMs: torchao wants one dtype for the two); FSDP2
    all-gathers weights in float8 under tensorwise only (torchao's weight subclass supports no other
    granularity); ``m.float8_fast_accum`` sets fast accumulation in the backward GEMMs too."""
    from torchao.float8 import CastConfig, Float8GemmConfig, Float8LinearConfig
    from torchao.float8.config import e4m3_dtype, e5m2_dtype

    config = Float8LinearConfig.from_recipe_name(m.float8.value)
    if m.float8_fast_accum:
        fast = Float8GemmConfig(use_fast_accum=True)
        config = dataclasses.replace(config, gemm_config_grad_input=fast, gemm_config_grad_weight=fast)
    if m.float8 is Float8Recipe.tensorwise:
        dtype = e4m3_dtype if m.float8_grad_dtype is Float8GradDtype.e4m3 else e5m2_dtype
        grads = CastConfig(target_dtype=dtype)
        config = dataclasses.replace(
            config, cast_config_grad_output=grads, cast_config_grad_output_for_grad_weight=grads
        )
        if fsdp_all_gather:
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    return config


def apply_float8(model: nn.Module, m: ModelConfig, fsdp_all_gather: bool = False) -> list[str]:
    """Swap the Linear layers that ``framework.kernels.float8.converts`` picks and mark the MoE
    experts that ``converts_experts`` picks; returns the Linear layers' names.

    ``fsdp_all_gather``: FSDP2 will shard this model over more than one rank. No-op (returns [])
    for ``model.float8=none``. Raises RuntimeError when the filters picked nothing (the refusals
    before launch make that unreachable from a config).
    """
    if m.float8 is Float8Recipe.none:
        return []
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    def keep(mod: nn.Module, fqn: str) -> bool:
        return isinstance(mod, nn.Linear) and converts(m, fqn, *mod.weight.shape)

    convert_to_float8_training(model, module_filter_fn=keep, config=float8_config(m, fsdp_all_gather))
    names = [n for n, mod in model.named_modules() if isinstance(mod, Float8Linear)]
    experts = mark_float8_experts(model, m)
    if not names and not experts:
        raise RuntimeError(f"model.float8={m.float8.value} converted no Linear layer and no MoE experts")
    return names


def mark_float8_experts(model: nn.Module, m: ModelConfig) -> list[str]:
    """Set ``GroupedExperts.float8`` on the experts ``converts_experts`` picks; returns their names."""
    names = []
    for name, mod in model.named_modules():
        if isinstance(mod, GroupedExperts):
            dims = (*mod.gate_up_proj.shape[1:], *mod.down_proj.shape[1:])
            mod.float8 = converts_experts(m, name, dims)
            if mod.float8:
                names.append(name)
    return names


def is_float8(module: nn.Module) -> bool:
    """Is ``module`` a torchao ``Float8Linear`` (without importing torchao when float8 is off)?"""
    return type(module).__name__ == "Float8Linear"


def tp_styles(module: nn.Module, recipe: Float8Recipe) -> tuple[type, type] | None:
    """torchao's (colwise, rowwise) float8 TP styles for a float8 layer under tensorwise, else None
    (rowwise float8 layers and bf16 layers take torch's own styles)."""
    if recipe is not Float8Recipe.tensorwise or not is_float8(module):
        return None
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    return Float8ColwiseParallel, Float8RowwiseParallel


def _float8_gathered(model: nn.Module) -> list[torch.Tensor]:
    """The local shards (torchao's ``WeightWithDynamicFloat8CastTensor``) of the weights that
    FSDP2 all-gathers in float8; [] when there are none."""
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    return [
        p._local_tensor
        for p in model.parameters()
        if isinstance(p, DTensor) and isinstance(p._local_tensor, WeightWithDynamicFloat8CastTensor)
    ]


def attach_scale_precompute(model: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    """Compute every float8-all-gathered weight's scale in one all-reduce (torchao's
    ``precompute_float8_dynamic_scale_for_fsdp``) now, after each optimizer step and after each
    ``load_state_dict`` of the model, instead of one all-reduce per weight in the next forward.
    Only where FSDP2 all-gathers in float8; returns whether it attached. Collective: call it, and
    load into the model, on every rank.

    Why at all three points: a precomputed scale is used as it is by the next forward, so weights
    loaded after it (a resume, a rollback, the ladder's carry-over) would be cast with the scale of
    the weights they replaced (a resume is always such a case: a fresh optimizer's state dict runs a
    zero-lr step first, which precomputes from the initial weights). And the precomputed scale is
    the whole weight's amax, where the per-forward one is reduced over the FSDP axis only, so under
    FSDP x TP each TP shard would get its own scale on the steps that no precompute preceded (the
    first, and the first after a load): precomputing at these points keeps every step's float8
    weights those of one process (tests/parallel/test_float8_dist.py).
    """
    if not _float8_gathered(model):
        return False
    from torchao.float8.fsdp_utils import precompute_float8_dynamic_scale_for_fsdp

    def after_step(_opt: torch.optim.Optimizer, _args: tuple, _kwargs: dict) -> None:
        precompute_float8_dynamic_scale_for_fsdp(model)

    def after_load(_module: nn.Module, _incompatible: object) -> None:
        precompute_float8_dynamic_scale_for_fsdp(model)

    precompute_float8_dynamic_scale_for_fsdp(model)
    optimizer.register_step_post_hook(after_step)
    model.register_load_state_dict_post_hook(after_load)
    return True
