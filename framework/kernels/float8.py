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
"""

from __future__ import annotations

from framework.config.schema import Float8Recipe, ModelConfig
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


def check_torchao(recipe: Float8Recipe) -> None:
    """Refuse float8 when torchao is not installed (it is an extra): ``MissingPackage``."""
    if recipe is Float8Recipe.none:
        return
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        raise MissingPackage(
            f'model.float8={recipe.value} needs torchao ({e}): pip install -e ".[float8]", or use '
            f"model.float8=none"
        ) from e
