"""The MoE experts' float8 grouped GEMM (``model.float8`` on an MoE family): torchao's differentiable
rowwise float8 grouped GEMM, called by ``framework.models.moe.run_experts`` when the experts convert
(``framework.kernels.float8.converts_experts``; ``framework.parallel.float8.apply_float8`` marks them).

Why torchao's function and not its wrapper tensor: ``torchao.prototype.moe_training``'s conversion
(``quantize_`` with ``Float8TrainingOpConfig``) wraps the expert weights in a tensor subclass that
intercepts ``torch._grouped_mm``; the stacked weights would then be a subclass under FSDP2, DCP and the
fallback ladder's state carry-over. Calling the autograd function directly from the one place the
experts' GEMMs run keeps the parameters plain fp32 tensors (the same state dict with float8 on or off,
as the Linear layers' swap does) and the bf16 path untouched.

What torchao 0.18's ``_to_fp8_rowwise_then_scaled_grouped_mm(A, B_t, offs, out_dtype, float8_dtype,
pad_token_groups_for_grouped_mm)`` requires (read from its source, fp8_grouped_mm.py): ``A (M, K)``
row-major, ``B_t (G, K, N)`` column-major per group (``w.transpose(-2, -1)`` of a contiguous
``(G, N, K)`` stack), bf16 or fp32, K and N multiples of 16, ``offs`` int32 group ends with every
group a multiple of 16 rows; its own padding (``pad_token_groups_for_grouped_mm=True``, the default)
asserts "not yet supported", so the caller pads (``moe.pad_groups``). The casts are e4m3 rowwise with
power-of-2 scales (Triton kernels), the GEMMs ``torch._scaled_grouped_mm`` with fast accumulation
(CUDA sm90 / sm100). It saves its bf16 inputs for backward (no float8 activation memory saving).
"""

from __future__ import annotations

import torch

# Rows per token group that torch._scaled_grouped_mm's float8 kernel needs (torchao's alignment_size
# for float8; mxfp8 would need 32).
GROUP_ROWS = 16


def float8_grouped_mm(a: torch.Tensor, b_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``a (M, K)`` rows grouped by ``offs`` (int32 group ends, each group a multiple of
    ``GROUP_ROWS`` rows) times ``b_t (G, K, N)`` -> ``(M, N)`` bf16, in float8 rowwise (forward
    and both backward GEMMs). Rows past ``offs[-1]`` are in no group: their output is unspecified."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    return _to_fp8_rowwise_then_scaled_grouped_mm(
        a, b_t, offs, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False
    )


def is_float8_kernel(name: str) -> bool:
    """Is a profiler event ``name`` the float8 grouped GEMM (what the GPU test and the benchmark
    look for to tell that torchao's kernel ran)?"""
    return name == "aten::_scaled_grouped_mm"
