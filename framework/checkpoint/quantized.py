"""Quantized Hub checkpoints, read as the weights they stand for: GPT-OSS's MXFP4 experts and
DeepSeek-V3's (and Kimi K2's) FP8 weights with 128 x 128 block scales, dequantized as they are read.

Why dequantize on import: training needs the weights in the compute dtype with fp32 masters, and the
published GPT-OSS and DeepSeek-V3 folders are the quantized ones (the bf16 DeepSeek-V3 is a
conversion users make themselves). The dequantization is a table lookup (MXFP4) or a multiply
(FP8) in plain torch, so no kernel is needed; each rank reads only the rows and columns of its
own chunk, as it does for an unquantized tensor, and the block scales those rows touch.

The layouts are the Hub's (transformers' readers agree: ``integrations/mxfp4.py`` and
``integrations/finegrained_fp8.py``):

- ``quant_method: mxfp4``: a weight ``W`` (E, C, R) is stored as ``W_blocks`` (E, R, C / 32, 16)
  uint8, two 4-bit e2m1 values a byte (the low nibble first), and ``W_scales`` (E, R, C / 32)
  uint8, a power-of-two exponent with bias 127 per 32 values; ``W`` is the dequantized (E, R, C)
  transposed to (E, C, R).
- ``quant_method: fp8``: a weight ``W`` (out, in) is stored in float8 e4m3 beside
  ``W_scale_inv`` (ceil(out / b0), ceil(in / b1)) fp32 (``weight_block_size`` [b0, b1]); ``W`` is the
  stored value times its block's scale.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# The 16 values of a 4-bit e2m1 code (sign bit high): the OCP microscaling format's FP4.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32
METHODS = ("mxfp4", "fp8")


@dataclass(frozen=True)
class Quantized:
    """How one logical tensor is stored: ``method`` (mxfp4 or fp8), the stored tensors it is read
    from (blocks and scales, or the weight and its inverse scales) and the fp8 block size."""

    method: str
    data: str
    scales: str
    block: tuple[int, int] = (MXFP4_BLOCK, MXFP4_BLOCK)


def logical_tensors(
    config: dict[str, Any], shapes: dict[str, tuple[int, ...]], where: str
) -> tuple[dict[str, tuple[int, ...]], dict[str, str], dict[str, Quantized]]:
    """(the folder's tensors as the model sees them: name -> shape, logical name -> a stored tensor it
    is read from (for its file), name -> how it is stored). ValueError naming the folder and the
    value when config.json's ``quantization_config`` is a method not read here, or when a quantized
    tensor's parts do not fit together."""
    qc = config.get("quantization_config")
    if qc is None:
        parts = sorted(n for n in shapes if n.endswith(("_blocks", "_scales", "_scale_inv")))
        if parts:
            raise ValueError(
                f"{where} holds quantized tensors ({parts[0]}, ...) but config.json has no "
                "quantization_config; valid: the folder's own config.json, which names the method"
            )
        return shapes, {}, {}
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method not in METHODS:
        raise ValueError(
            f"{where}: config.json's quantization_config.quant_method={method!r} is not read here; valid: "
            "mxfp4 (GPT-OSS's experts), fp8 (DeepSeek-V3's block-scaled weights), or an unquantized folder"
        )
    if method == "mxfp4":
        return _mxfp4(shapes, where)
    return _fp8(qc, shapes, where)


def _mxfp4(
    shapes: dict[str, tuple[int, ...]], where: str
) -> tuple[dict[str, tuple[int, ...]], dict[str, str], dict[str, Quantized]]:
    out = dict(shapes)
    stored, quantized = {}, {}
    for name in sorted(n for n in shapes if n.endswith("_blocks")):
        base = name.removesuffix("_blocks")
        scales = f"{base}_scales"
        b, s = shapes[name], shapes.get(scales)
        if s is None or len(b) != 4 or b[-1] != MXFP4_BLOCK // 2 or tuple(b[:-1]) != tuple(s):
            raise ValueError(
                f"{where}: MXFP4 tensor {name} {list(b)} needs {scales} of shape {list(b[:-1])} and 16 bytes "
                f"a block; found {list(s) if s is not None else 'none'}"
            )
        experts, rows, groups, _ = b
        del out[name], out[scales]
        out[base] = (experts, groups * MXFP4_BLOCK, rows)
        stored[base] = name
        quantized[base] = Quantized("mxfp4", name, scales)
    return out, stored, quantized


def _fp8(
    qc: dict[str, Any], shapes: dict[str, tuple[int, ...]], where: str
) -> tuple[dict[str, tuple[int, ...]], dict[str, str], dict[str, Quantized]]:
    fmt = qc.get("fmt", "e4m3")
    block = qc.get("weight_block_size")
    if fmt != "e4m3" or not (
        isinstance(block, list) and len(block) == 2 and all(isinstance(v, int) and v > 0 for v in block)
    ):
        raise ValueError(
            f"{where}: config.json's quantization_config (fmt={fmt!r}, weight_block_size={block!r}) is not "
            "read here; valid: fmt 'e4m3' with weight_block_size [rows, cols] (DeepSeek-V3: [128, 128])"
        )
    out = dict(shapes)
    stored, quantized = {}, {}
    for name in sorted(n for n in shapes if n.endswith("_scale_inv")):
        base = name.removesuffix("_scale_inv")
        w, s = shapes.get(base), shapes[name]
        want = None if w is None or len(w) != 2 else (math.ceil(w[0] / block[0]), math.ceil(w[1] / block[1]))
        if want is None or tuple(s) != want:
            raise ValueError(
                f"{where}: FP8 scales {name} {list(s)} do not fit {base} "
                f"{list(w) if w is not None else 'none'} in blocks of {block}"
            )
        del out[name]
        stored[base] = base
        quantized[base] = Quantized("fp8", base, name, (block[0], block[1]))
    return out, stored, quantized


class DequantSlice:
    """``safe_open(...).get_slice`` for a quantized tensor: ``get_shape()`` and ``[index]`` with
    slices (steps of 1), reading only the stored rows, columns and scales the index touches."""

    def __init__(self, q: Quantized, get_slice: Callable[[str], Any]) -> None:
        self.q = q
        self.data, self.scales = get_slice(q.data), get_slice(q.scales)

    def get_shape(self) -> list[int]:
        shape = list(self.data.get_shape())
        if self.q.method == "mxfp4":
            experts, rows, groups, _ = shape
            return [experts, groups * MXFP4_BLOCK, rows]
        return shape

    def __getitem__(self, index: tuple[slice, ...] | slice) -> torch.Tensor:
        shape = self.get_shape()
        index = index if isinstance(index, tuple) else (index,)
        bounds = [
            s.indices(n)[:2] if isinstance(s, slice) else (s, s + 1)
            for s, n in zip((*index, *(slice(None),) * (len(shape) - len(index))), shape, strict=True)
        ]
        if any(hi <= lo for lo, hi in bounds):
            return torch.empty([max(0, hi - lo) for lo, hi in bounds], dtype=torch.float32)
        read = self._mxfp4 if self.q.method == "mxfp4" else self._fp8
        return read(bounds)

    def _mxfp4(self, bounds: list[tuple[int, int]]) -> torch.Tensor:
        (e0, e1), (c0, c1), (r0, r1) = bounds
        g0, g1 = c0 // MXFP4_BLOCK, math.ceil(c1 / MXFP4_BLOCK)
        blocks = self.data[e0:e1, r0:r1, g0:g1]
        scales = self.scales[e0:e1, r0:r1, g0:g1]
        values = dequantize_mxfp4(blocks, scales)  # (e, r, (g1 - g0) * 32)
        cut = values[..., c0 - g0 * MXFP4_BLOCK : c1 - g0 * MXFP4_BLOCK]
        return cut.transpose(1, 2).contiguous()

    def _fp8(self, bounds: list[tuple[int, int]]) -> torch.Tensor:
        (r0, r1), (c0, c1) = bounds
        b0, b1 = self.q.block
        weight = self.data[r0:r1, c0:c1]
        scales = self.scales[r0 // b0 : math.ceil(r1 / b0), c0 // b1 : math.ceil(c1 / b1)]
        rows = scales.repeat_interleave(b0, dim=0)[r0 % b0 : r0 % b0 + (r1 - r0)]
        full = rows.repeat_interleave(b1, dim=1)[:, c0 % b1 : c0 % b1 + (c1 - c0)]
        return weight.to(torch.float32) * full.to(torch.float32)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(..., G, 16) uint8 blocks and (..., G) uint8 exponents -> (..., G * 32) fp32."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = blocks.to(torch.uint8)
    pairs = torch.stack([lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]], dim=-1)
    values = pairs.reshape(*codes.shape[:-1], MXFP4_BLOCK)
    exponent = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponent.unsqueeze(-1)).reshape(*codes.shape[:-2], -1)


def open_slice(name: str, quantized: dict[str, Quantized], get_slice: Callable[[str], Any]) -> Any:
    """The slice reader for ``name``: the stored tensor's, or a dequantizing one."""
    q = quantized.get(name)
    return get_slice(name) if q is None else DequantSlice(q, get_slice)
