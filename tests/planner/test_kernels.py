"""Kernel tables (framework.planner.kernels) and the compute priced from them (framework.planner.compute):
entries checked when loaded, rates interpolated in log space, every GEMM of the model counted once at
its own shard's shape, MoE experts whole on every TP rank."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path

import pytest

from framework.launch.recipes import compose_recipe
from framework.models import active_params, model_spec
from framework.planner import kernels
from framework.planner.compute import table_compute
from framework.planner.kernels import load_table, parse_table
from framework.planner.layout import Degrees


def flat_table(rate: float = 500.0, fwd: float | None = None) -> dict:
    """A table whose every kernel runs at ``rate`` TFLOP/s (forward at ``fwd``, default the same)."""
    f = rate if fwd is None else fwd
    widths, tokens = (128, 1024, 8192, 131072), (1024, 8192, 65536)
    return {
        "device": "synthetic",
        "command": "tests/planner/test_kernels.py",
        "gemm": {
            "bf16": [
                {"tokens": t, "out": o, "in": i, "fwd_tflops": f, "fwd_bwd_tflops": rate}
                for t in tokens for o in widths for i in widths if i <= 32768
            ]
        },
        "attention": {
            "flash": [
                {"seq": s, "head_dim": h, "causal": c, "fwd_tflops": f, "fwd_bwd_tflops": rate}
                for s in (512, 8192, 131072) for h in (64, 128) for c in (True, False)
            ]
        },
        "grouped_gemm": {
            "bf16": [
                {"rows_per_expert": r, "dim": 2048, "width": 768, "fwd_tflops": f, "fwd_bwd_tflops": rate}
                for r in (16, 1024, 16384)
            ]
        },
    }  # fmt: skip


def _set(raw: dict, path: tuple, value: object) -> dict:
    out = copy.deepcopy(raw)
    node = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return out


@pytest.mark.parametrize(
    "path, value, message",
    [
        (("gemm", "bf16", 0, "fwd_tflops"), -1.0, "gemm.bf16[0].fwd_tflops=-1.0: a rate must be a finite"),
        (("gemm", "bf16", 3, "fwd_bwd_tflops"), float("nan"), "gemm.bf16[3].fwd_bwd_tflops=nan"),
        (("gemm", "bf16", 1, "fwd_tflops"), "fast", "gemm.bf16[1].fwd_tflops='fast'"),
        (("gemm", "bf16", 2, "fwd_tflops"), 0, "gemm.bf16[2].fwd_tflops=0"),
        (("gemm", "bf16", 0, "tokens"), -8, "gemm.bf16[0].tokens=-8: expected a positive integer"),
        (("gemm", "bf16"), [], "gemm.bf16: expected a non-empty list"),
        (("gemm",), {}, "no gemm.bf16 entries"),
        (("attention",), {}, "no attention.flash entries"),
        (("grouped_gemm", "bf16", 1, "fwd_tflops"), float("inf"), "grouped_gemm.bf16 (dim 2048, width 768)[1]"),
        (("grouped_gemm",), {}, "no grouped_gemm.bf16 entries"),
    ],
)
def test_a_bad_entry_is_refused_naming_it(path: tuple, value: object, message: str) -> None:
    with pytest.raises(ValueError, match="kernel table 'syn'") as err:
        parse_table("syn", _set(flat_table(), path, value))
    assert message in str(err.value), err.value


def test_a_grid_with_a_hole_is_refused_and_failed_entries_stand_aside() -> None:
    raw = flat_table()
    del raw["gemm"]["bf16"][0]  # (1024, 128, 128): nothing smaller stands for it
    with pytest.raises(ValueError, match=r"no entry at \(1024, 128, 128\)"):
        parse_table("syn", raw)
    raw = flat_table()
    raw["gemm"]["bf16"][-1] = {"tokens": 65536, "out": 131072, "in": 8192, "error": "out of memory"}
    table = parse_table("syn", raw)  # the largest shape: the next smaller token count stands for it
    assert table.gemm["bf16"].rates[(65536, 131072, 8192)] == table.gemm["bf16"].rates[(8192, 131072, 8192)]


def test_rates_interpolate_in_log_space_and_clamp_at_the_edges() -> None:
    raw = flat_table()
    for row in raw["gemm"]["bf16"]:
        row["fwd_tflops"] = row["fwd_bwd_tflops"] = 100.0 if row["tokens"] == 1024 else 400.0
    grid = parse_table("syn", raw).gemm["bf16"]
    assert grid.at((1024, 1024, 1024)).fwd == pytest.approx(100.0)
    assert grid.at((8192, 1024, 1024)).fwd == pytest.approx(400.0)
    mid = math.sqrt(1024 * 8192)  # halfway in log tokens: the geometric mean of the rates
    assert grid.at((mid, 1024, 1024)).fwd == pytest.approx(200.0)
    assert grid.at((10, 5, 5)).fwd == pytest.approx(100.0)  # below the grid: its first rates
    assert grid.at((10**7, 10**7, 10**7)).fwd_bwd == pytest.approx(400.0)


def _cfg(recipe: str, *overrides: str):  # noqa: ANN202 - a Config
    return compose_recipe(recipe, ["train.micro_batch_size=2", "train.global_batch_size=2", *overrides])


def test_every_gemm_is_counted_once_at_a_flat_rate() -> None:
    """At one rate everywhere, the Linear GEMMs take 6 x (their parameters) x tokens / rate and
    attention 3 x its causal forward FLOPs / rate: nothing counted twice or left out."""
    rate = 400.0
    table = parse_table("syn", flat_table(rate))
    cfg = _cfg("llama_125m", "train.seq_len=1024")
    m, spec = cfg.model, model_spec(cfg.model)
    d = Degrees(1, 1, 1, 1, 1, 1)
    terms = table_compute(cfg, d, table, accum=1, recompute=0.0, fast_accum_speedup=1.0, expert_float8_speedup=1.0)
    tokens = 2 * 1024
    linear = active_params(m, include_embedding=False) - (0 if m.tie_embeddings else m.vocab_size * m.dim)
    linear -= sum(math.prod(w.shape) for _, w, unit in spec.params() if len(w.shape) == 1 and unit != "root")
    linear -= sum(math.prod(w.shape) for w in spec.last if len(w.shape) == 1)
    linear += m.vocab_size * m.dim  # the head's GEMM, tied or not
    assert terms.gemm_s == pytest.approx(6 * linear * tokens / rate / 1e12, rel=1e-9)
    causal = 4 * 2 * m.n_heads * 1024 * 1024 / 2 * spec.head_dim * m.n_layers
    assert terms.attention_s == pytest.approx(3 * causal / rate / 1e12, rel=1e-9)
    assert terms.grouped_s == 0.0
    full = table_compute(cfg, d, table, 1, recompute=1.0, fast_accum_speedup=1.0, expert_float8_speedup=1.0)
    head = 2 * m.vocab_size * m.dim * tokens / rate / 1e12  # never recomputed
    assert full.gemm_s == pytest.approx(terms.gemm_s * 4 / 3 - head, rel=1e-9)  # blocks x 4/3, head once


def test_moe_experts_run_whole_on_every_tp_rank() -> None:
    """The runtime runs an MoE sublayer whole on each TP rank (framework.parallel.tensor.block_plan):
    TP halves the attention's Linear GEMMs, never the experts'."""
    table = parse_table("syn", flat_table(400.0))
    cfg = _cfg("qwen3_moe_tiny", "train.seq_len=64")
    one = table_compute(cfg, Degrees(1, 1, 1, 1, 1, 1), table, 1, 0.0, 1.0, 1.0)
    two = table_compute(cfg, Degrees(1, 1, 1, 2, 1, 1), table, 1, 0.0, 1.0, 1.0)
    assert one.grouped_s > 0 and two.grouped_s == pytest.approx(one.grouped_s)
    assert two.attention_s == pytest.approx(one.attention_s / 2)


def test_a_table_is_named_not_pathed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "TABLES", tmp_path)
    load_table.cache_clear()
    (tmp_path / "mine.json").write_text(json.dumps(flat_table()))
    (tmp_path / "broken.json").write_text("{")
    try:
        assert load_table("mine").device == "synthetic"
        with pytest.raises(ValueError, match=r"mesh.hardware.kernel_table='nosuch': no such table; valid: \['broken', 'mine'\]"):
            load_table("nosuch")
        with pytest.raises(ValueError, match="a table's name"):
            load_table("../mine")
        with pytest.raises(ValueError, match="cannot be read"):
            load_table("broken")
    finally:
        load_table.cache_clear()


def test_the_plan_names_where_its_compute_came_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from framework.planner.resolve import make_plan

    monkeypatch.setattr(kernels, "TABLES", tmp_path)
    load_table.cache_clear()
    (tmp_path / "syn.json").write_text(json.dumps(flat_table(400.0)))
    try:
        base = compose_recipe(
            "llama_125m", ["mesh/hardware=h100_sxm", "mesh.hardware.kernel_table=null", "run.dry_run=true"]
        )
        legacy = make_plan(base).prediction
        hw = dataclasses.replace(base.mesh.hardware, kernel_table="syn")
        cfg = dataclasses.replace(base, mesh=dataclasses.replace(base.mesh, hardware=hw))
        measured = make_plan(cfg).prediction
    finally:
        load_table.cache_clear()
    assert legacy.compute_source == "gemm_efficiency" and legacy.gemm_s == 0.0
    assert measured.compute_source == "kernel_table syn (attention: flash)"
    assert measured.compute_s == pytest.approx(measured.gemm_s + measured.grouped_s + measured.attention_s)


def test_the_shipped_h100_table_loads_and_prices_a_step_at_its_measured_rates() -> None:
    """conf/mesh/hardware/tables/h100_sxm.json (benchmarks/kernel_tables.py on the lent H100) loads,
    names its device and command, and prices the GEMMs of a large dense step between the slowest and
    the fastest bf16 rate it measured."""
    table = load_table("h100_sxm")
    assert "H100" in table.device and "kernel_tables.py" in table.command and table.moe_overhead_s > 0
    rates = [r.fwd_bwd for r in table.gemm["bf16"].rates.values()]
    cfg = _cfg("llama3_8b", "train.seq_len=8192", "train.micro_batch_size=1", "train.global_batch_size=1")
    terms = table_compute(cfg, Degrees(1, 1, 1, 1, 1, 1), table, 1, 0.0, 1.0, 1.0)
    spec, m = model_spec(cfg.model), cfg.model
    linear = sum(math.prod(w.shape) for _, w, unit in spec.params() if len(w.shape) == 2 and unit != "root")
    linear += m.vocab_size * m.dim
    achieved = 6 * linear * 8192 / terms.gemm_s / 1e12
    assert min(rates) < achieved < max(rates)
