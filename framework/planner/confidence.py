"""How sure the step-time prediction is: where each of its terms comes from, and the range that follows.

Each term of ``StepPrediction`` rests on a different kind of number: a kernel table measured on the
device (``measured``), bytes or FLOPs counted from the model and the schedule at a datasheet
bandwidth (``counted``), a constant fitted to a few runs (``fitted``). The range widens each term by
the spread of its kind, ``SPREAD``: assumed figures, not measured ones (benchmarks/published.py
reports how far the predictions really land), written down so that the plan never claims more
precision than its weakest term has.
"""

from __future__ import annotations

from framework.config.schema import Config

# How far a term of each kind may be off, as a fraction (an assumption, stated; see above).
SPREAD = {"measured": 0.10, "counted": 0.15, "fitted": 0.30}


def term_sources(cfg: Config) -> dict[str, tuple[str, str]]:
    """term -> (kind, what it rests on), for the terms of framework.planner.cost.predict_step."""
    hw = cfg.mesh.hardware
    table = hw.kernel_table
    return {
        "compute": (
            ("measured", f"kernel table {table}")
            if table
            else ("fitted", f"gemm_efficiency {hw.gemm_efficiency:g} of {hw.peak_tflops:g} TFLOP/s")
        ),
        "memory": ("fitted", f"pointwise bytes per element (one profile) at {hw.hbm_gbps:g} GB/s"),
        "optimizer": ("counted", f"AdamW's bytes per parameter at {hw.hbm_gbps:g} GB/s"),
        "comm": (
            "fitted",
            f"link speed x link_efficiency {hw.link_efficiency:g}, by mechanism (overlap NVLink "
            f"{hw.comm_overlap:g}, network {hw.inter_node_comm_overlap:g})",
        ),
        "bubble": ("counted", "the schedule's fill and drain"),
        "offload": ("counted", f"bytes at host_link_gbps {hw.host_link_gbps:g}"),
    }


def step_range(terms: dict[str, float], sources: dict[str, tuple[str, str]]) -> tuple[float, float]:
    """(low, high) seconds: each term moved by its kind's spread."""
    low = sum(t * (1 - SPREAD[sources[k][0]]) for k, t in terms.items())
    high = sum(t * (1 + SPREAD[sources[k][0]]) for k, t in terms.items())
    return low, high


def describe(sources: dict[str, tuple[str, str]], terms: dict[str, float]) -> str:
    """One line: each term that takes time, its kind and what it rests on."""
    return "; ".join(f"{k} {sources[k][0]} ({sources[k][1]})" for k, t in terms.items() if t > 0)
