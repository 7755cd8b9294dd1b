"""Resolve a config into its plan, once: the layout (a preset or the search's choice), activation
checkpointing under ``auto`` and the micro batch, then the plan of that layout.

It sits above both ``plan`` (one layout's plan) and ``search`` (which plans many), so that neither
imports the other back. The launcher calls ``resolve`` once before launch and writes ``config.yaml``
and ``plan.json``; everything downstream takes the resulting plan (or its ``layout``) as a value,
and every rank, whatever launched it, reads both files back (``load_plan``), never planning again.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from framework.config.schema import Config
from framework.planner import stages as pipeline_stages
from framework.planner.layout import fixed_degrees
from framework.planner.plan import (
    Plan,
    check_mesh,
    explicit_degrees_equal,
    needs_search,
    plan_for,
    with_degrees,
)
from framework.planner.report import plan_from_dict
from framework.planner.search import SearchResult, search

PLAN_FILE = "plan.json"


@dataclass(frozen=True)
class Resolved:
    """A config with every planner choice written in, the plan of its layout, and the search that
    chose it (None when the user fixed the layout): what the launcher writes to the run dir."""

    cfg: Config  # explicit parallel.* degrees, activation checkpointing, micro batch (config.yaml)
    plan: Plan  # plan.json
    search: SearchResult | None = None


def resolve(cfg: Config) -> Resolved:
    """The one resolution of a config: its choices (``resolve_batch``, or the search's), then the
    plan of that layout (``plan_for``); refuse what cannot work.

    Raises ValueError naming the bad value, the reason and a fix: degrees whose product is not the
    world size, pp/cp > 1, a TP degree that does not divide heads / FFN / world, a global batch that
    does not split across data-parallel ranks and micro batches, ``sharding=auto`` with nothing that
    fits, or a per-rank memory estimate above the device memory (only a warning under
    ``run.dry_run`` or ``run.allow_over_memory``).
    """
    check_mesh(cfg)
    found = search(cfg) if needs_search(cfg) else None
    out = found.chosen_cfg if found is not None else resolve_batch(cfg)
    d = fixed_degrees(out)
    assert d is not None  # resolved: explicit degrees
    return Resolved(out, plan_for(out, d), found)


def make_plan(cfg: Config) -> Plan:
    """``resolve(cfg).plan``: for callers that want only the plan (the recipe check, benchmarks)."""
    return resolve(cfg).plan


def resolve_batch(cfg: Config) -> Config:
    """Resolve everything the planner decides, without planning the result: the layout (a preset or
    the search's choice, written as explicit ``parallel.*`` degrees), activation checkpointing under
    ``auto``, and ``train.micro_batch_size=0``, which with a fixed layout is each data-parallel rank's
    whole share of the global batch, with no accumulation (the same recipe runs on 1, 4 or 8 ranks).

    Returns ``cfg`` itself when nothing is left to resolve (what entry.py wrote to config.yaml).
    Raises ValueError when the global batch does not split across the data-parallel ranks, or as
    the search does when nothing fits.
    """
    check_mesh(cfg)
    if needs_search(cfg):
        return search(cfg).chosen_cfg
    d = fixed_degrees(cfg)
    assert d is not None
    out = cfg if explicit_degrees_equal(cfg, d) else with_degrees(cfg, d)
    if cfg.train.micro_batch_size != 0:
        return out
    dp, gbs = d.dp, cfg.train.global_batch_size
    if gbs < dp or gbs % dp:
        raise ValueError(
            f"train.global_batch_size={gbs} does not split across {dp} data-parallel ranks: use a "
            f"multiple of {dp} (e.g. {[dp * k for k in (1, 2, 4, 8)]})"
        )
    # Under a pipeline the rank's batch is cut into the schedule's micro batches.
    pieces = pipeline_stages.microbatches(cfg, d.pp, dp) if d.pp > 1 else 1
    if (gbs // dp) % pieces:
        pipeline_stages.check_pipeline(cfg, d.pp, dp)  # names the micro batches that would divide it
    micro = gbs // dp // pieces
    return dataclasses.replace(out, train=dataclasses.replace(out.train, micro_batch_size=micro))


def plan_differs(cfg: Config, plan: Plan) -> str | None:
    """What makes ``plan`` another config's plan than resolved ``cfg``'s (None: it is this one's).

    Compared field by field with what the plan recorded, planning nothing: a resolved config carries
    its layout as explicit ``parallel.*`` degrees, so an unresolved one (``sharding=auto``,
    ``train.micro_batch_size=0``) differs too."""
    have = {
        "layout": {k: getattr(cfg.parallel, k) for k in plan.degrees},
        "world size": cfg.mesh.world_size,
        "nodes": cfg.mesh.nodes,
        "micro batch": cfg.train.micro_batch_size,
        "global batch": cfg.train.global_batch_size,
        "seq_len": cfg.train.seq_len,
        "activation checkpointing": cfg.sharding.activation_checkpointing.value,
    }
    want = {
        "layout": plan.degrees,
        "world size": plan.world_size,
        "nodes": plan.nodes,
        "micro batch": plan.micro_batch_size,
        "global batch": plan.global_batch_size,
        "seq_len": plan.seq_len,
        "activation checkpointing": plan.activation_checkpointing,
    }
    bad = [f"{k} {_show(want[k])} vs {_show(have[k])}" for k in want if want[k] != have[k]]
    return ", ".join(bad) or None


def _show(value: object) -> str:
    if isinstance(value, dict):
        return "x".join(f"{k}={v}" for k, v in value.items() if v != 1) or "all 1"
    return str(value)


def check_plan(cfg: Config, plan: Plan, where: str = "the plan") -> None:
    """Refuse a plan made for another config than resolved ``cfg`` (ValueError, one line)."""
    differs = plan_differs(cfg, plan)
    if differs is not None:
        raise ValueError(
            f"{where} was planned for another config than this one (plan vs config: {differs}): "
            "relaunch the run (train.py resolves the config and writes config.yaml and plan.json once)"
        )


def write_plan(run_dir: Path, record: dict) -> Path:
    """``run_dir/plan.json`` (the launcher's, once): ``plan_to_dict`` and the search, if any."""
    path = run_dir / PLAN_FILE
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def load_plan(cfg: Config, run_dir: Path) -> Plan:
    """The plan the launcher resolved and wrote to ``run_dir/plan.json``: every rank reads the same
    one and plans nothing. Raises ValueError (one line) when the file is missing, unreadable, or was
    planned for another config than ``cfg`` (the run dir's ``config.yaml``)."""
    path = run_dir / PLAN_FILE
    if not path.is_file():
        raise ValueError(
            f"{path} is missing: a rank reads the plan its launcher wrote and plans nothing itself; "
            "start ranks with train.py, which writes config.yaml and plan.json into the run dir"
        )
    try:
        plan = plan_from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError, KeyError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(
            f"{path} is not a plan written by train.py ({type(e).__name__}: {e}): relaunch the run"
        ) from e
    check_plan(cfg, plan, str(path))
    return plan
