"""The routed experts' kernels: the stacked weights of ``E`` experts run on rows sorted by expert,
by grouped GEMMs (``torch.nn.functional.grouped_mm``) where the device's kernel takes the operands,
else a per-expert loop (the reference); torchao's float8 grouped GEMM on token groups padded to 16
rows (``pad_groups``).

Why apart from the layer (framework.models.moe): the layer routes and combines, these run; expert
parallelism (framework.parallel.expert) calls the same kernels on a rank's local experts, and a
family with experts of its own form (GPT-OSS's biases and clamped SwiGLU:
framework.models.gpt_oss.experts) subclasses ``StackedExperts`` so that the same all-to-all
dispatch shards them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from enum import Enum

import torch
import torch.nn.functional as F
from torch import nn

# ``fn(x, counts, weights, float8) -> y``: a stacked-experts module's math on rows sorted by expert,
# given its parameters in registration order (the whole stack, or one ep rank's slice of it).
ExpertCompute = Callable[[torch.Tensor, torch.Tensor, Sequence[torch.Tensor], bool], torch.Tensor]


class ExpertKernel(str, Enum):
    """Which code runs the experts: ``AUTO`` takes the grouped GEMM where the device's kernel accepts
    the operands (``grouped_mm_supported``) and the loop elsewhere."""

    AUTO = "auto"
    GROUPED = "grouped"
    LOOP = "loop"


class StackedExperts(nn.Module):
    """Experts stored as stacked ``(E, ...)`` parameters, every one of them indexed by expert on dim
    0, called as ``experts(x_sorted, counts)``. Expert parallelism shards each parameter on dim 0 and
    runs ``compute()`` on the local slices, so a subclass's math lives in that function, never in
    ``forward`` alone: ``kernel`` picks grouped or loop, ``float8`` is set by
    framework.parallel.float8 where the subclass supports it."""

    kernel: ExpertKernel
    float8: bool

    def compute(self) -> ExpertCompute:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` ``(N, D)``: rows sorted by expert, ``counts[e]`` rows for expert ``e``; returns ``(N, D)``."""
        weights = [p for _, p in self.named_parameters(recurse=False)]
        return self.compute()(x, counts, weights, self.float8)


def swiglu_compute(
    x: torch.Tensor, counts: torch.Tensor, weights: Sequence[torch.Tensor], float8: bool, kernel: ExpertKernel
) -> torch.Tensor:
    """``GroupedExperts``' ``ExpertCompute``: ``weights`` = (gate_up_proj, down_proj)."""
    gate_up, down = weights
    return run_experts(x, counts, gate_up, down, kernel, float8)


def grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``grouped_mm`` takes these operands (measured on torch 2.13): float32/bfloat16/float16
    only (float64 is refused), every row stride a multiple of 16 bytes ("strides should be multiple of
    16 bytes": so the inner and outer dims must be multiples of 4 fp32 / 8 bf16 elements), and on CUDA
    compute capability 8.0 or newer (transformers' own check). The CPU kernel exists since 2.9. The same
    held on an H200 with torch 2.11+cu130 (fp32, bf16, fp16 exact against a loop, the 16-byte rule too);
    there, at a Qwen3-30B-A3B expert shape (T=8192, D=2048, I=768, E=128, k=8), forward+backward took
    7.3 ms grouped vs 167 ms looped in bf16 (254 TFLOP/s), 59 vs 340 ms in fp32."""
    if not (hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return False
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        return False
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False  # traced, its meta function takes bf16 only (torch 2.11 to 2.13)
    if any((n * x.element_size()) % 16 for n in (x.shape[-1], w.shape[-1], w.shape[-2])):
        return False
    if w.device.type == "cuda":
        return torch.cuda.get_device_capability(w.device) >= (8, 0)
    return True


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x (N, K)`` rows grouped by ``offs`` (int32 group ends) times ``w (G, K, M)`` -> ``(N, M)``.
    The public ``F.grouped_mm`` (torch >= 2.10) and ``torch._grouped_mm`` are the same kernel."""
    fn = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return fn(x, w, offs=offs)


class GroupedExperts(StackedExperts):
    """``num_experts`` SwiGLU experts as stacked weights: ``gate_up_proj (E, 2I, D)`` (gate rows, then
    up rows) and ``down_proj (E, D, I)``, transformers 5's layout, so an HF state dict maps 1:1."""

    def __init__(self, num_experts: int, dim: int, hidden: int, kernel: ExpertKernel = ExpertKernel.AUTO):
        super().__init__()
        self.kernel = kernel
        # float8 grouped GEMMs (torchao's): set by framework.parallel.float8.apply_float8, a plain
        # attribute (the state dict is the same with float8 on or off)
        self.float8 = False
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def use_grouped(self, x: torch.Tensor) -> bool:
        return use_grouped(self.kernel, x, self.gate_up_proj, self.down_proj)

    def compute(self) -> ExpertCompute:
        return functools.partial(swiglu_compute, kernel=self.kernel)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` ``(N, D)``: rows sorted by expert, ``counts[e]`` rows for expert ``e``; returns ``(N, D)``."""
        return run_experts(x, counts, self.gate_up_proj, self.down_proj, self.kernel, self.float8)

    def loop_forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The per-expert loop: the reference for the grouped path and the fallback (one host sync)."""
        return loop_experts(x, counts, self.gate_up_proj, self.down_proj)


def use_grouped(kernel: ExpertKernel, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether ``kernel`` runs these operands by the grouped GEMM; raises ValueError for ``grouped``
    where the kernel cannot take them."""
    if kernel is ExpertKernel.LOOP:
        return False
    ok = grouped_mm_supported(x, gate_up) and grouped_mm_supported(x, down)
    if kernel is ExpertKernel.GROUPED and not ok:
        raise ValueError(
            f"expert kernel 'grouped' cannot run dtype={x.dtype} dim={x.shape[-1]} on {x.device}: "
            "use 'auto' or 'loop' (grouped_mm needs fp32/bf16/fp16, 16-byte rows, CUDA sm80+)"
        )
    return ok


def run_experts(
    x: torch.Tensor,
    counts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    kernel: ExpertKernel,
    float8: bool = False,
) -> torch.Tensor:
    """The experts ``gate_up (G, 2I, D)``, ``down (G, D, I)`` on ``x`` ``(N, D)``, rows sorted by
    expert (``counts (G,)``): ``GroupedExperts``' forward, and expert parallelism's on its local
    experts (framework.parallel.expert). Under autocast the operands are cast to its dtype first, as
    ``F.linear`` would be: ``grouped_mm`` is not on autocast's list, and traced (``torch.compile``) it
    takes bf16 only. ``float8``: torchao's float8 grouped GEMMs on bf16 operands (``float8_experts``;
    the launcher refused every config where they cannot run)."""
    device = x.device.type
    # meta (the freeze traces the meta-device model) has no autocast state: asking raises
    if device != "meta" and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, gate_up, down = x.to(dtype), gate_up.to(dtype), down.to(dtype)
    if float8:
        return float8_experts(x, counts, gate_up, down)
    if use_grouped(kernel, x, gate_up, down):
        offs = torch.cumsum(counts, 0).to(torch.int32)
        gate, up = _grouped_mm(x, gate_up.transpose(-2, -1), offs).chunk(2, dim=-1)
        y = _grouped_mm(F.silu(gate) * up, down.transpose(-2, -1), offs)
        if y.requires_grad:
            # grouped_mm's backward refuses a broadcast gradient ("Invalid strides/sizes, got [0, 0]"),
            # which y.sum().backward() hands it; a dense one passes through unchanged.
            y.register_hook(torch.Tensor.contiguous)
        return y
    return loop_experts(x, counts, gate_up, down)


def pad_groups(counts: torch.Tensor, num_rows: int, align: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each of ``num_rows`` rows sorted by group (``counts (G,)`` per group) goes when every
    group is padded with zero rows to a multiple of ``align`` rows (the float8 grouped GEMM's need):
    ``(dest (num_rows,) int64, padded group ends (G,) int32, padded rows)``.

    The padded rows are a static bound, ``num_rows + G (align - 1)`` rounded up to ``align`` (what
    torchao's own padding allocates), so that ``torch.compile`` sees no data-dependent shape and the
    host never syncs; the rows past the last padded group end belong to no group. Exact: a zero row
    changes no other row of a GEMM's output, and adds zeros to the weight gradient's sums."""
    counts = counts.to(torch.int64)
    padded = (counts + align - 1) // align * align
    padded_ends = torch.cumsum(padded, 0)
    ends = torch.cumsum(counts, 0)
    shift = (padded_ends - padded) - (ends - counts)  # per group: padded start - start
    row = torch.arange(num_rows, device=counts.device)
    # a row's group: how many group ends lie at or before it (empty groups share their end)
    group = torch.searchsorted(ends, row, right=True)
    total = -(-(num_rows + counts.numel() * (align - 1)) // align) * align
    return row + shift[group], padded_ends.to(torch.int32), total


def padded_experts(
    x: torch.Tensor,
    counts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    mm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    align: int,
) -> torch.Tensor:
    """The grouped SwiGLU experts by ``mm(a, b_t, offs)`` on token groups padded to ``align`` rows:
    pad once, both GEMMs, unpad once (a zero row stays zero through SiLU(gate) * up). ``mm`` is
    torchao's float8 GEMM (``float8_experts``), or ``_grouped_mm`` in the test that checks the
    padding against the unpadded grouped path."""
    dest, offs, total = pad_groups(counts, x.shape[0], align)
    xp = x.new_zeros(total, x.shape[-1]).index_copy(0, dest, x)
    gate, up = mm(xp, gate_up.transpose(-2, -1), offs).chunk(2, dim=-1)
    y = mm(F.silu(gate) * up, down.transpose(-2, -1), offs)
    # index_select's backward scatters the gradient into zeros: a dense gradient for torchao's
    # backward (no broadcast one, cf. run_experts' hook), zero on every padding row
    return y.index_select(0, dest)


def float8_experts(
    x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """The experts in float8 (torchao's rowwise grouped GEMM, framework.kernels.float8_grouped) on
    bf16 operands (autocast's on CUDA), bf16 out. Raises ValueError off CUDA (torchao's casts are
    Triton kernels; the launcher refuses float8 there before launch)."""
    from framework.kernels.float8_grouped import GROUP_ROWS, float8_grouped_mm

    if x.device.type != "cuda":
        raise ValueError(f"float8 MoE experts need a CUDA GPU (sm90/sm100); these operands are on {x.device}")
    bf16 = torch.bfloat16
    return padded_experts(x.to(bf16), counts, gate_up.to(bf16), down.to(bf16), float8_grouped_mm, GROUP_ROWS)


def loop_experts(
    x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """The per-expert loop (one host sync for the split sizes)."""
    outs = []
    for e, part in enumerate(x.split(counts.tolist())):
        gate, up = F.linear(part, gate_up[e]).chunk(2, dim=-1)
        outs.append(F.linear(F.silu(gate) * up, down[e]))
    return torch.cat(outs) if outs else x.new_zeros(0, x.shape[-1])
