"""FlashAttention-4 as SDPA's flash kernel (``model.attention=fa4``), through torch's registry.

Why: torch's own flash kernel is FlashAttention-2, which uses none of Hopper's asynchronous
tensor-core (wgmma) or bulk-copy (TMA) instructions. flash-attn-4 (CuTe DSL kernels, FA3-class on
sm90) does, and torch (>= 2.11) can swap it in behind aten's flash-attention ops
(``torch.nn.attention.activate_flash_attention_impl("FA4")``). The model then calls
``F.scaled_dot_product_attention`` with the flash backend as before: torch.compile traces the same
aten op, with the same shapes, so nothing breaks the graph; only the kernel that runs changes.

torch's own FA4 entry unpacks ``_flash_attn_fwd``'s result as ``(out, lse)``, while flash-attn-4
4.0.0b36 returns five values; so this module registers torch's FA4 glue under its own name with
itself as the kernel module (``_flash_attn_fwd``/``_flash_attn_bwd`` below pass the calls on and keep
the results torch reads). The swap is for the whole process, so it is made where the model meets
its device (``framework.models.materialize``). ``check`` refuses before launch what FA4 cannot run.
"""

from __future__ import annotations

import importlib
import importlib.util
from functools import cache, partial
from pathlib import Path
from typing import Any

import torch

from framework.config.schema import ActivationCheckpointing, AttentionBackend, ModelConfig
from framework.kernels.target import MissingPackage

IMPL = "FA4_framework"  # this module's entry in torch's registry (torch's own is "FA4")
KERNELS = "flash_attn.cute.interface"  # flash-attn-4's kernel module
PIP_NAME = "flash-attn-4"
# The CuTe DSL's Python half (the ``cutlass`` package, ``cutlass.cute``): nvidia-cutlass-dsl-libs-base's dependency.
CUTE_PIP_NAME = "nvidia-cutlass-dsl-libs-core"
# torch's FA4 entry accepts Hopper (sm90) and Blackwell (sm100) GPUs only.
CAPABILITY_MAJORS = (9, 10)
KEY = "model.attention=fa4"


def registry_has_fa4() -> bool:
    """Does this torch have the flash-attention registry and its FA4 glue (torch >= 2.11)?"""
    attention = torch.nn.attention
    glue = getattr(getattr(attention, "_fa4", None), "register_flash_attention_fa4", None)
    return hasattr(attention, "activate_flash_attention_impl") and glue is not None


def installed() -> bool:
    """Is flash-attn-4 importable, with its CuTe DSL? (``missing`` says which part is not.)"""
    return missing() is None


def missing() -> str | None:
    """The first part of flash-attn-4 that is not importable, as pip names it (None: all are).

    Looked up without importing anything: flash-attn-4's import loads the CuTe DSL compiler
    (seconds, and a GPU-only library). ``flash_attn`` is a namespace package, so its kernel file is
    looked for in each of its folders (flash-attn 2's ``flash_attn`` has no ``cute/interface.py``).
    The DSL comes in three wheels: nvidia-cutlass-dsl (a ``.pth`` file that puts
    ``nvidia_cutlass_dsl/dsl_packages`` on the path), its libs-base (the compiled MLIR parts,
    ``cutlass/_mlir``) and libs-core (the Python half: ``cutlass/__init__.py`` and ``cutlass/cute``,
    which flash-attn-4 imports). Without libs-core, or when installed with ``pip --target`` (which
    skips ``.pth`` files), ``cutlass.cute`` is missing and the first forward would fail in the rank.
    """
    if not _has_file("flash_attn", "cute/interface.py"):
        return PIP_NAME
    if importlib.util.find_spec("nvidia_cutlass_dsl") is None:
        return "nvidia-cutlass-dsl"
    if not _has_file("cutlass", "cute/__init__.py"):
        return CUTE_PIP_NAME
    return None


def _has_file(package: str, relative: str) -> bool:
    """Does top-level ``package`` have the file ``relative`` in one of its folders? ``find_spec`` of a
    top-level name imports nothing (of a submodule it would import the parent)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return False
    return any((Path(d) / relative).is_file() for d in spec.submodule_search_locations)


def head_dim_supported(major: int, head_dim: int) -> bool:
    """flash-attn-4's head sizes: a multiple of 8 (16 bytes in bf16), 8-256 on sm90, 8-128 or 256 on
    sm100 (``flash_attn.cute.interface._validate_head_dims``)."""
    if head_dim % 8:
        return False
    return 8 <= head_dim <= 256 if major == 9 else 8 <= head_dim <= 128 or head_dim == 256


def check(
    model: ModelConfig, cp: int, device_type: str, capability: tuple[int, int] | None, name: str, *, head_dim: int
) -> None:
    """Refuse ``model.attention=fa4`` where it cannot run: off CUDA, on a GPU other than sm90/sm100,
    with a head size its kernels lack, with context parallelism (its ring attention calls the
    attention ops itself), on a torch without the registry, or without the package. (Document
    masks run its variable-length form: framework.data.check_document_kernel.)
    The last two are ``MissingPackage``: a dry run only warns of them (framework.kernels.target).
    ``head_dim``: the model's head size, from its spec (the caller reads it: kernels sit below models);
    ``cp``: the context-parallel degree (``parallel.cp``)."""
    if model.attention is not AttentionBackend.fa4:
        return
    if device_type != "cuda" or capability is None:
        raise ValueError(
            f"{KEY} needs a CUDA GPU of compute capability 9.x or 10.x (Hopper, Blackwell), this run "
            f"uses {device_type}: use model.attention=auto"
        )
    if capability[0] not in CAPABILITY_MAJORS:
        raise ValueError(
            f"{KEY} needs a GPU of compute capability 9.x or 10.x (Hopper, Blackwell); {name} is "
            f"{capability[0]}.{capability[1]}: use model.attention=auto"
        )
    if not head_dim_supported(capability[0], head_dim):
        valid = "8-256" if capability[0] == 9 else "8-128 or 256"
        raise ValueError(
            f"{KEY}: head size {head_dim} is not one FlashAttention-4 has on compute capability "
            f"{capability[0]}.x (valid: a multiple of 8, {valid}): use model.attention=auto"
        )
    if cp > 1:
        raise ValueError(
            f"{KEY} with parallel.cp={cp}: context parallelism's ring attention calls the "
            "attention kernels itself; use model.attention=auto with context parallelism"
        )
    if not registry_has_fa4():
        raise MissingPackage(
            f"{KEY} needs torch's flash-attention registry with FA4 (torch >= 2.11: "
            f"torch.nn.attention.activate_flash_attention_impl); torch {torch.__version__} has none: "
            "upgrade torch, or use model.attention=auto"
        )
    lacking = missing()
    if lacking == CUTE_PIP_NAME:
        raise MissingPackage(
            f"{KEY} needs the CuTe DSL's Python packages (cutlass.cute, from {CUTE_PIP_NAME}), which are "
            f"not importable: pip install -e '.[fa4]' (or pip install {CUTE_PIP_NAME}); after pip install "
            "--target DIR, add DIR/nvidia_cutlass_dsl/dsl_packages to PYTHONPATH; or use model.attention=auto"
        )
    if lacking is not None:
        raise MissingPackage(
            f"{KEY} needs the {lacking} package: pip install -e '.[fa4]' (or pip install {lacking}), "
            "or use model.attention=auto"
        )


def activate() -> None:
    """Import flash-attn-4 (a broken install fails here, not inside the first forward), then swap
    its kernels in behind aten's flash-attention ops."""
    importlib.import_module(KERNELS)
    register()


def register() -> None:
    """Register this module as the FA4 kernel module in torch's registry and activate it, once per
    process (a second activation would restore and re-register the same kernels)."""
    attention = torch.nn.attention
    if IMPL not in attention.list_flash_attention_impls():
        glue = attention._fa4.register_flash_attention_fa4
        attention.register_flash_attention_impl(IMPL, register_fn=partial(glue, module_path=__name__))
    if attention.current_flash_attention_impl() != IMPL:
        attention.activate_flash_attention_impl(IMPL)


def _flash_attn_fwd(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """flash-attn-4's forward as torch's FA4 glue calls it: (out, lse) of its five results."""
    out, lse, *_ = importlib.import_module(KERNELS)._flash_attn_fwd(*args, **kwargs)
    return out, lse


def _flash_attn_bwd(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flash-attn-4's backward: (dq, dk, dv) (a fourth, the sink's gradient, only with a sink)."""
    dq, dk, dv, *_ = importlib.import_module(KERNELS)._flash_attn_bwd(*args, **kwargs)
    return dq, dk, dv


@cache
def flop_counter_takes_gqa() -> bool:
    """Does this torch's flop counter count the flash op with fewer key/value heads than query heads?
    The compiler's activation memory budget weighs recompute by it; torch 2.11's ``sdpa_flop_count``
    asserts equal head counts, so a GQA model's compile failed there under ``budget`` with the flash
    kernels (2.13's counts it). Probed once on meta tensors: no device, no kernel."""
    from torch.utils.flop_counter import FlopCounterMode

    q = torch.empty(1, 4, 128, 64, device="meta", dtype=torch.bfloat16)
    kv = torch.empty(1, 2, 128, 64, device="meta", dtype=torch.bfloat16)
    try:
        with FlopCounterMode(display=False):
            torch.ops.aten._scaled_dot_product_flash_attention(q, kv, kv, 0.0, True)
    except (AssertionError, RuntimeError):
        return False
    return True


def budget_fails(m: ModelConfig, document_mask: bool, gqa_counted: bool) -> bool:
    """Would the compiler's activation budget fail to compile this model's attention? The flash
    kernels (``model.attention=flash|fa4``) on a GQA model, unmasked (a document mask runs the
    variable-length op, which every torch here counts), where the flop counter cannot count it
    (``gqa_counted``: ``flop_counter_takes_gqa()``; ``document_mask``: ``data.document_mask``). The
    search leaves ``budget`` out there."""
    flash = m.attention in (AttentionBackend.flash, AttentionBackend.fa4)
    return flash and m.n_heads != m.n_kv_heads and not document_mask and not gqa_counted


def check_budget(
    m: ModelConfig, checkpointing: ActivationCheckpointing, document_mask: bool, gqa_counted: bool
) -> None:
    """Refuse a user's ``activation_checkpointing=budget`` where ``budget_fails``: the compile would
    fail at the first step."""
    if checkpointing is not ActivationCheckpointing.budget:
        return
    if budget_fails(m, document_mask, gqa_counted):
        raise ValueError(
            f"model.attention={m.attention.value} with sharding.activation_checkpointing=budget: torch "
            f"{torch.__version__}'s flop counter, which the budget's partitioner uses, rejects the flash "
            f"kernel with {m.n_kv_heads} key/value heads for {m.n_heads} query heads (fixed in torch "
            "2.13); use activation_checkpointing=none, selective or full, model.attention=auto, or a "
            "newer torch"
        )
