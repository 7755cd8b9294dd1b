"""Resolve a config into its plan, once: the layout (a preset or the search's choice), activation
checkpointing under ``auto`` and the micro batch, then the plan of that layout.

It sits above both ``plan`` (one layout's plan) and ``search`` (which plans many), so that neither
imports the other back. The launcher calls it before launch and writes ``plan.json``; ranks read that.
"""

from __future__ import annotations

import dataclasses
import json
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
    plan_from_dict,
    with_degrees,
)
from framework.planner.search import search


def make_plan(cfg: Config) -> Plan:
    """Resolve the layout (``resolve_batch``), then plan it (``plan_for``); refuse what cannot work.

    Raises ValueError naming the bad value, the reason and a fix: degrees whose product is not the
    world size, pp/cp > 1, a TP degree that does not divide heads / FFN / world, a global batch that
    does not split across data-parallel ranks and micro batches, ``sharding=auto`` with nothing that
    fits, or a per-rank memory estimate above the device memory (only a warning under
    ``run.dry_run`` or ``run.allow_over_memory``).
    """
    cfg = resolve_batch(cfg)
    d = fixed_degrees(cfg)
    assert d is not None
    return plan_for(cfg, d)


def resolve_batch(cfg: Config) -> Config:
    """Resolve everything the planner decides, once: the layout (a preset or the search's choice,
    written as explicit ``parallel.*`` degrees), activation checkpointing under ``auto``, and
    ``train.micro_batch_size=0``, which with a fixed layout is each data-parallel rank's whole share
    of the global batch, with no accumulation (the same recipe runs on 1, 4 or 8 ranks unchanged).

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


PLAN_FILE = "plan.json"


def load_plan(cfg: Config, run_dir: Path) -> Plan:
    """The plan the launcher resolved and wrote to ``run_dir/plan.json`` (every rank reads the same
    one, nothing is planned again); planned here only where no launcher wrote one (a caller that runs
    the trainer in-process). Raises ValueError when the file was planned for another layout."""
    path = run_dir / PLAN_FILE
    if not path.exists():
        return make_plan(cfg)
    plan = plan_from_dict(json.loads(path.read_text()))
    d = fixed_degrees(cfg)
    if d is None or plan.degrees != dataclasses.asdict(d) or plan.micro_batch_size != cfg.train.micro_batch_size:
        raise ValueError(
            f"{path} was planned for another layout ({plan.strategy}, micro batch {plan.micro_batch_size})"
            f" than this config ({d and d.name()}, micro batch {cfg.train.micro_batch_size}): relaunch the run"
        )
    return plan
