"""Measured kernel tables: the rate of each GEMM, grouped GEMM and attention call a step runs, by shape.

Why: one efficiency for every FLOP (``mesh.hardware.gemm_efficiency``) was a fit to one profile; a
GEMM's rate depends on its shape (a thin TP shard, a small K, a 150K-row head), an MoE's expert GEMMs
on the rows each expert gets, attention on the sequence length and head dim. A profile that names a
table (``mesh.hardware.kernel_table: NAME``, ``conf/mesh/hardware/tables/NAME.json``, written on the
device by ``benchmarks/kernel_tables.py``, which records the device, torch and command beside the
numbers) has its compute priced from it: rates are interpolated linearly in the logarithms of the
shape and clamped at the table's edges (past its largest shapes a kernel's rate is flat).

Every entry is checked when the table is loaded, before launch: a missing, negative, zero or
non-finite rate is refused naming the file and the entry.
"""

from __future__ import annotations

import bisect
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TABLES = Path(__file__).resolve().parents[2] / "conf" / "mesh" / "hardware" / "tables"
GEMM_KINDS = ("bf16", "float8_tensorwise", "float8_rowwise")
ATTENTION_KINDS = ("flash", "cudnn")


@dataclass(frozen=True)
class Rates:
    """Forward and forward + backward TFLOP/s of one kernel at one shape."""

    fwd: float
    fwd_bwd: float


@dataclass(frozen=True)
class Grid:
    """Rates on a grid of shape coordinates (one axis a dimension), looked up in log space."""

    axes: tuple[tuple[int, ...], ...]
    rates: dict[tuple[int, ...], Rates]

    def at(self, point: tuple[float, ...]) -> Rates:
        """Multilinear interpolation of log-rates over log-coordinates, clamped to the grid."""
        corners: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
        for axis, x in zip(self.axes, point, strict=True):
            lo, hi, frac = _bracket(axis, x)
            corners = [(c + (lo,), w * (1 - frac)) for c, w in corners] + [
                (c + (hi,), w * frac) for c, w in corners if frac > 0
            ]
        fwd = bwd = 0.0
        for corner, weight in corners:
            r = self.rates[corner]
            fwd += weight * math.log(r.fwd)
            bwd += weight * math.log(r.fwd_bwd)
        return Rates(math.exp(fwd), math.exp(bwd))


def _bracket(axis: tuple[int, ...], x: float) -> tuple[int, int, float]:
    """The grid values around ``x`` and where ``x`` lies between them in log space (clamped)."""
    if x <= axis[0]:
        return axis[0], axis[0], 0.0
    if x >= axis[-1]:
        return axis[-1], axis[-1], 0.0
    i = bisect.bisect_right(axis, x)
    lo, hi = axis[i - 1], axis[i]
    return lo, hi, (math.log(x) - math.log(lo)) / (math.log(hi) - math.log(lo))


@dataclass(frozen=True)
class KernelTable:
    """A device's measured rates (benchmarks/kernel_tables.py), and where they were measured."""

    name: str
    device: str
    command: str
    gemm: dict[str, Grid]  # GEMM_KINDS -> (tokens, out, in)
    attention: dict[tuple[str, bool], Grid]  # (kernel, causal) -> (seq, head_dim)
    grouped: dict[tuple[int, int], Grid]  # (dim, expert width) -> (rows per expert,)
    # The MoE sublayer's work around its experts (router, sort, gather, weighting, scatter-add), per
    # routed row and element of dim, forward + backward: the median over the measured shapes.
    moe_overhead_s: float = 0.0

    def gemm_parts(self, kind: str, tokens: float, out: int, inp: int) -> tuple[float, float]:
        """(forward, forward + backward) seconds of a Linear layer's GEMMs for ``tokens`` rows of
        ``kind`` (GEMM_KINDS; bf16's rates where the table lacks the kind)."""
        grid = self.gemm.get(kind) or self.gemm["bf16"]
        return _seconds(grid.at((tokens, out, inp)), 2.0 * tokens * out * inp)

    def gemm_s(self, kind: str, tokens: float, out: int, inp: int, recompute: float) -> float:
        """Seconds of a Linear layer's GEMMs: forward and backward, and the forward again
        ``recompute`` times (activation checkpointing)."""
        fwd, fwd_bwd = self.gemm_parts(kind, tokens, out, inp)
        return fwd_bwd + recompute * fwd

    def attention_s(
        self, kernel: str, seq: int, head_dim: int, causal: bool, flop: float, recompute: float
    ) -> float:
        """Seconds of attention whose forward is ``flop`` (the FLOPs its mask leaves) at ``seq``."""
        grid = self.attention.get((kernel, causal)) or self.attention[("flash", causal)]
        fwd, fwd_bwd = _seconds(grid.at((seq, head_dim)), flop)
        return fwd_bwd + recompute * fwd

    def grouped_s(self, rows_per_expert: float, dim: int, width: int, flop: float, recompute: float) -> float:
        """Seconds of the experts' grouped GEMMs whose forward is ``flop``, at the measured expert shape
        nearest (dim, width) in log space."""
        if rows_per_expert <= 0 or flop <= 0:
            return 0.0
        key = min(self.grouped, key=lambda k: math.hypot(math.log(k[0] / dim), math.log(k[1] / width)))
        fwd, fwd_bwd = _seconds(self.grouped[key].at((rows_per_expert,)), flop)
        return fwd_bwd + recompute * fwd


def _seconds(r: Rates, flop: float) -> tuple[float, float]:
    """(forward, forward + backward) seconds of a kernel whose forward is ``flop`` (its backward
    twice that: the table's rates count 3 x the forward's FLOPs over the forward + backward time)."""
    return flop / r.fwd / 1e12, 3 * flop / r.fwd_bwd / 1e12


def _rates(where: str, row: dict[str, Any]) -> Rates:
    values = []
    for key in ("fwd_tflops", "fwd_bwd_tflops"):
        v = row.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{where}.{key}={v!r}: a rate must be a finite number of TFLOP/s above 0")
        values.append(float(v))
    return Rates(*values)


def _grid(where: str, rows: Any, keys: tuple[str, ...], fill_axis: int | None = None) -> Grid:
    """The rows as a grid over ``keys``; a point missing from the full grid takes the rate of the
    nearest smaller value along ``fill_axis`` (the benchmark skips the largest shapes: flat there)."""
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{where}: expected a non-empty list of measured entries")
    rates: dict[tuple[int, ...], Rates] = {}
    for i, row in enumerate(rows):
        at = f"{where}[{i}]"
        if not isinstance(row, dict):
            raise ValueError(f"{at}={row!r}: expected an entry with {', '.join(keys)} and its rates")
        if "error" in row:
            continue  # the kernel could not run that shape; its neighbours stand in
        coords = []
        for k in keys:
            v = row.get(k)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{at}.{k}={v!r}: expected a positive integer")
            coords.append(v)
        rates[tuple(coords)] = _rates(at, row)
    if not rates:
        raise ValueError(f"{where}: every entry failed to run")
    axes = tuple(tuple(sorted({c[j] for c in rates})) for j in range(len(keys)))
    for point in _full(axes):
        if point not in rates:
            rates[point] = _fill(where, rates, axes, point, fill_axis)
    return Grid(axes, rates)


def _full(axes: tuple[tuple[int, ...], ...]) -> list[tuple[int, ...]]:
    points: list[tuple[int, ...]] = [()]
    for axis in axes:
        points = [p + (v,) for p in points for v in axis]
    return points


def _fill(
    where: str,
    rates: dict[tuple[int, ...], Rates],
    axes: tuple[tuple[int, ...], ...],
    point: tuple[int, ...],
    axis: int | None,
) -> Rates:
    if axis is not None:
        for v in reversed([v for v in axes[axis] if v < point[axis]]):
            near = point[:axis] + (v,) + point[axis + 1 :]
            if near in rates:
                return rates[near]
    names = ", ".join(str(v) for v in point)
    raise ValueError(f"{where}: no entry at ({names}) nor a smaller one to stand for it: the grid has holes")


def parse_table(name: str, raw: Any) -> KernelTable:
    """A table from its JSON content; ValueError naming the entry for anything missing or not a rate."""
    where = f"kernel table {name!r}"
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a JSON object (benchmarks/kernel_tables.py writes one)")
    gemm_raw = raw.get("gemm")
    if not isinstance(gemm_raw, dict) or "bf16" not in gemm_raw:
        raise ValueError(f"{where}: no gemm.bf16 entries (benchmarks/kernel_tables.py measures them)")
    gemm = {
        kind: _grid(f"{where} gemm.{kind}", rows, ("tokens", "out", "in"), fill_axis=0)
        for kind, rows in gemm_raw.items()
        if kind == "bf16" or (kind in GEMM_KINDS and rows)
    }
    attention: dict[tuple[str, bool], Grid] = {}
    for kernel, rows in (raw.get("attention") or {}).items():
        if kernel not in ATTENTION_KINDS or not isinstance(rows, list):
            continue
        for causal in (True, False):
            mine = [r for r in rows if isinstance(r, dict) and r.get("causal") is causal]
            if mine:
                attention[(kernel, causal)] = _grid(
                    f"{where} attention.{kernel}{'' if causal else ' (full)'}", mine, ("seq", "head_dim"), 0
                )
    for causal in (True, False):
        if ("flash", causal) not in attention:
            raise ValueError(f"{where}: no attention.flash entries ({'causal' if causal else 'full'})")
    grouped_rows = (raw.get("grouped_gemm") or {}).get("bf16") or []
    shapes = sorted({(r.get("dim"), r.get("width")) for r in grouped_rows if isinstance(r, dict)})
    grouped = {}
    for dim, width in shapes:
        mine = [
            r for r in grouped_rows if isinstance(r, dict) and (r.get("dim"), r.get("width")) == (dim, width)
        ]
        grid = _grid(f"{where} grouped_gemm.bf16 (dim {dim}, width {width})", mine, ("rows_per_expert",), 0)
        if not (isinstance(dim, int) and isinstance(width, int) and dim > 0 and width > 0):
            raise ValueError(
                f"{where} grouped_gemm.bf16: dim={dim!r}, width={width!r}: expected positive integers"
            )
        grouped[(dim, width)] = grid
    if not grouped:
        raise ValueError(f"{where}: no grouped_gemm.bf16 entries (the MoE experts' rates)")
    overhead = _moe_overhead(where, raw.get("moe_overhead") or [])
    return KernelTable(
        name, str(raw.get("device", "")), str(raw.get("command", "")), gemm, attention, grouped, overhead
    )


def _moe_overhead(where: str, rows: Any) -> float:
    """Seconds per routed row and element of dim: each entry's layer time less its experts' time, over
    tokens x top-k x dim; the median of the entries (0 without any)."""
    per: list[float] = []
    for i, row in enumerate(rows if isinstance(rows, list) else []):
        at = f"{where} moe_overhead[{i}]"
        if not isinstance(row, dict) or "error" in row:
            continue
        values = [row.get(k) for k in ("tokens", "top_k", "dim", "overhead_ms")]
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) for v in values):
            raise ValueError(f"{at}: tokens, top_k, dim and overhead_ms must be finite numbers, got {values}")
        tokens, k, dim, ms = values
        if tokens <= 0 or k <= 0 or dim <= 0:
            raise ValueError(f"{at}: tokens={tokens}, top_k={k}, dim={dim}: expected positive counts")
        per.append(max(ms, 0.0) / 1e3 / (tokens * k * dim))
    return sorted(per)[len(per) // 2] if per else 0.0


@functools.cache
def load_table(name: str) -> KernelTable:
    """``conf/mesh/hardware/tables/NAME.json``, parsed and checked once (ValueError naming what is wrong)."""
    if not name or "/" in name or "\\" in name or name.startswith("."):
        raise ValueError(
            f"mesh.hardware.kernel_table={name!r}: a table's name, one of {available()} "
            "(conf/mesh/hardware/tables/NAME.json)"
        )
    path = TABLES / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"mesh.hardware.kernel_table={name!r}: no such table; valid: {available()} or null")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"kernel table {str(path)!r} cannot be read: {' '.join(str(e).split())}") from None
    return parse_table(name, raw)


def available() -> list[str]:
    return sorted(p.stem for p in TABLES.glob("*.json")) if TABLES.is_dir() else []
