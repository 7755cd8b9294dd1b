"""Which Linear layers train in float8 (``model.float8``), and what cannot: the rules, without torchao.

The planner, the entry point's refusals and ``framework.parallel.float8`` (which does the swap with
torchao) all read the same rules from here (``converts``; ``framework.models.linears`` applies it to
the model's Linear layers, from its spec), so the plan counts exactly the layers that are swapped
and a config that float8 cannot run is refused before launch, on any host, torchao installed or not.

The default filter follows torchtitan's float8 converter: keep the output head in bf16
(``model.float8_skip``), keep every layer whose dims are not multiples of 16 (``torch._scaled_mm``
needs them), and (``model.float8_size_filter``) keep the layers too small for float8 to pay, by
torchao's per-recipe thresholds (measured on H100: below them the casts cost more than the faster
GEMM saves; at the 125M's dim 768 float8 everywhere made a run slower).

The MoE families' routed experts (``framework.models.moe.GroupedExperts``: two grouped GEMMs over
stacked weights, no ``nn.Linear``) train in float8 too (``converts_experts``), by torchao's float8
grouped GEMM (``torchao.prototype.moe_training``, ``framework.kernels.float8_grouped``). That kernel
scales rowwise only, so the experts run rowwise under either recipe (``EXPERTS_RECIPE``; under
``tensorwise`` the Linear layers stay tensorwise and the launcher says so in one line), as
torchtitan's float8 converter does for its MoE modules; it needs ``torch._scaled_grouped_mm``, i.e.
Hopper or Blackwell (``check_experts_device``). Keep them bf16 with ``model.float8_skip=[output,experts]``.
"""

from __future__ import annotations

from collections.abc import Iterable

from framework.config.schema import ExpertKernel, Float8Recipe, ModelConfig
from framework.kernels.target import MissingPackage

# Hopper (sm90) and Ada (sm89) have float8 tensor cores; torch._scaled_mm refuses older GPUs.
MIN_CAPABILITY = (8, 9)

# Bytes of saved activations that float8 saves per element of each converted Linear's input, per
# token: the input is kept for backward as float8 (1 byte) instead of bf16 (2 bytes), and compiled
# the bf16 copy is dropped. Fitted to one measurement (llama1b b16 seq 2048 on an H200, every block
# Linear in float8 tensorwise: peak 65.8 -> 52.0 GiB, i.e. 1.25 bytes per input element per token;
# benchmarks/PERF.md): a fit, not a derivation.
SAVED_BYTES_PER_INPUT = 1.25


def pays_off(recipe: Float8Recipe, n: int, k: int) -> bool:
    """torchao's size heuristic (``_auto_filter_for_recipe``): is a float8 GEMM of an (N, K) weight
    expected to beat bf16? Tensorwise needs K > 4096 or N > 1024; rowwise, whose casts cost more,
    needs N > 2048, K > 1024 and not both N <= 4096 and K <= 2048."""
    if recipe is Float8Recipe.tensorwise:
        return not (k <= 4096 and n <= 1024)
    return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))


def converts(
    m: ModelConfig, fqn: str, out_features: int, in_features: int, recipe: Float8Recipe | None = None
) -> bool:
    """The module filter: does this Linear train in float8 under ``m`` (``recipe`` defaults to
    ``m.float8``)? Works on a module's name and weight shape, as torchao's ``module_filter_fn``."""
    recipe = m.float8 if recipe is None else recipe
    if recipe is Float8Recipe.none:
        return False
    if any(s in fqn for s in m.float8_skip):
        return False
    if out_features % 16 or in_features % 16:
        return False
    return not m.float8_size_filter or pays_off(recipe, out_features, in_features)


# The recipe of the experts' float8 grouped GEMMs under either ``model.float8``: torchao's
# ``_to_fp8_rowwise_then_scaled_grouped_mm`` (0.18) has no tensorwise variant.
EXPERTS_RECIPE = Float8Recipe.rowwise
# torch._scaled_grouped_mm's CUDA kernels: sm90 (Hopper) and sm100 (Blackwell) only; Ada (8.9) has
# float8 tensor cores for torch._scaled_mm but no grouped kernel.
EXPERTS_CAPABILITY_MAJORS = (9, 10)


def converts_experts(m: ModelConfig, fqn: str, dims: Iterable[int]) -> bool:
    """Do the stacked MoE experts at ``fqn`` (``layers.N.feed_forward.experts``) train in float8 under
    ``m``? Under any recipe but ``none``, unless a ``model.float8_skip`` entry is in the name
    (``experts``, or ``feed_forward.experts`` to keep the routed ones only), only where every GEMM dim
    (``dims``: (out, in) of each expert GEMM) is a multiple of 16 (the float8 kernels'), and, under
    ``model.float8_size_filter``, only where every expert GEMM passes rowwise's size threshold
    (``pays_off``): at Qwen3-30B-A3B's experts (2048 x 768) float8 made the step 15% slower on an
    H200 (benchmarks/PERF.md, session 13: the casts cost more than the faster GEMMs save), so small
    experts stay bf16 unless ``model.float8_size_filter=false``."""
    if m.float8 is Float8Recipe.none:
        return False
    if any(s in fqn for s in m.float8_skip):
        return False
    dims = list(dims)
    if any(d % 16 for d in dims):
        return False
    pairs = zip(dims[::2], dims[1::2], strict=True)
    return not m.float8_size_filter or all(pays_off(EXPERTS_RECIPE, n, k) for n, k in pairs)


def check_experts(m: ModelConfig) -> None:
    """Refuse float8 experts run by the per-expert loop (``model.moe.expert_kernel=loop``): float8
    runs the grouped GEMM only. Call where the experts convert (``converts_experts``)."""
    if m.moe.expert_kernel is ExpertKernel.loop:
        raise ValueError(
            f"model.float8={m.float8.value} trains the MoE experts by torchao's float8 grouped GEMM, but "
            "model.moe.expert_kernel=loop runs them one by one: use model.moe.expert_kernel=auto or "
            f"grouped, or keep the experts in bf16 (add 'experts' to model.float8_skip={m.float8_skip})"
        )


def experts_notice(recipe: Float8Recipe) -> str | None:
    """The one warning line for ``tensorwise`` with float8 experts (they run rowwise), else None."""
    if recipe is not Float8Recipe.tensorwise:
        return None
    return (
        "model.float8=tensorwise: the MoE experts' grouped GEMMs train in float8 rowwise (torchao's "
        "float8 grouped GEMM has no tensorwise recipe; model.float8_grad_dtype does not apply to them), "
        "the Linear layers tensorwise; add 'experts' to model.float8_skip to keep the experts in bf16"
    )


def fast_accum_notice(fast_accum: bool) -> str | None:
    """The one warning line for ``model.float8_fast_accum=true``, else None: measured to diverge
    where the default did not (benchmarks/PERF.md, session 14), so it is not a free speed-up."""
    if not fast_accum:
        return None
    return (
        "model.float8_fast_accum=true: fast accumulation in the backward GEMMs diverged on Llama-3-8B "
        "at 8K with document masks (loss 12.8 and grad norm 53 at step 12, where the default reached "
        "9.8 and 7.8; benchmarks/PERF.md): watch the loss, or leave it false"
    )


def check_experts_device(recipe: Float8Recipe, capability: tuple[int, int] | None, name: str) -> None:
    """Refuse float8 experts where ``torch._scaled_grouped_mm`` has no kernel (below Hopper, e.g. Ada's
    8.9, which ``check_device`` lets through for the Linear layers). Call after ``check_device``."""
    if capability is not None and capability[0] not in EXPERTS_CAPABILITY_MAJORS:
        raise ValueError(
            f"model.float8={recipe.value} trains the MoE experts by torch._scaled_grouped_mm, which needs "
            f"compute capability 9.x or 10.x (Hopper, Blackwell); {name} is {capability[0]}.{capability[1]}: "
            "add 'experts' to model.float8_skip (the experts stay bf16), or use model.float8=none"
        )


def check_device(
    recipe: Float8Recipe, device_type: str, capability: tuple[int, int] | None, name: str
) -> None:
    """Refuse float8 where there are no float8 tensor cores (the CPU, GPUs below sm89)."""
    if recipe is Float8Recipe.none:
        return
    if device_type != "cuda" or capability is None:
        raise ValueError(
            f"model.float8={recipe.value} needs a CUDA GPU with float8 tensor cores (compute capability "
            f">= 8.9: Ada, Hopper, Blackwell); this run uses {device_type}: use model.float8=none"
        )
    if tuple(capability) < MIN_CAPABILITY:
        raise ValueError(
            f"model.float8={recipe.value} needs a GPU with float8 tensor cores (compute capability >= 8.9: "
            f"Ada, Hopper, Blackwell); {name} is {capability[0]}.{capability[1]}: use model.float8=none"
        )


def check_torchao(recipe: Float8Recipe, experts: bool = False) -> None:
    """Refuse float8 when torchao is not installed (it is an extra), or (``experts``: float8 MoE
    experts) has no ``torchao.prototype.moe_training`` (torchao >= 0.12): ``MissingPackage``."""
    if recipe is Float8Recipe.none:
        return
    try:
        import torchao.float8  # noqa: F401

        if experts:
            import torchao.prototype.moe_training  # noqa: F401
    except ImportError as e:
        raise MissingPackage(
            f'model.float8={recipe.value} needs torchao ({e}): pip install -e ".[float8]", or use '
            f"model.float8=none"
        ) from e
