"""sharding=auto: the planner's choice fits, is the fastest that fits, and says why the others lose."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from framework.config.schema import ActivationCheckpointing
from framework.launch.recipes import compose_recipe
from framework.planner.params import GIB
from framework.planner.report import format_plan
from framework.planner.resolve import make_plan, resolve_batch
from framework.planner.search import format_search, search
from tests.entry import train_main

ROOT = Path(__file__).resolve().parents[2]


def test_default_recipe_picks_the_single_rank_step_of_today() -> None:
    """``python train.py``: one CPU rank, no checkpointing, the whole batch in one micro batch."""
    cfg = compose_recipe("llama_tiny")
    chosen = resolve_batch(cfg)
    assert (chosen.parallel.dp_replicate, chosen.parallel.dp_shard, chosen.parallel.tp) == (1, 1, 1)
    assert chosen.sharding.activation_checkpointing == ActivationCheckpointing.none
    assert chosen.train.micro_batch_size == cfg.train.global_batch_size
    plan = make_plan(cfg)
    assert plan.strategy == "single" and plan.grad_accum_steps == 1


def test_search_ranks_and_explains() -> None:
    cfg = compose_recipe("llama70b", ["mesh=16x8", "mesh/hardware=h100_sxm"])
    result = search(cfg)
    best = result.chosen
    assert best.fits and best.reason == "chosen" and best.memory_gib <= 79.6
    fitting = [c for c in result.candidates if c.fits]
    assert fitting[0] is best
    assert {c.degrees["cp"] for c in result.candidates} == {1}  # 8192 tokens: no CP searched
    assert all(c.predicted_step_time_s >= best.predicted_step_time_s for c in fitting)
    losers = [c for c in result.candidates if not c.fits]
    assert losers and all(c.reason.startswith("memory:") for c in losers)
    assert all(
        c.reason.split(":")[0] in ("communication", "compute", "memory-bound", "bubble", "ties")
        for c in fitting[1:]
    )
    table = format_search(result)
    assert table.count("\n") == 11 and "chosen" in table  # header, column names, 10 rows
    # A forced layout is planned with its own prediction, never better than the choice.
    forced = compose_recipe(
        "llama70b",
        ["mesh=16x8", "mesh/hardware=h100_sxm", "parallel.tp=8", "parallel.dp_replicate=2"],
    )
    forced.sharding.activation_checkpointing = ActivationCheckpointing.full
    plan = make_plan(forced)
    assert plan.degrees["dp_shard"] == 8 and plan.strategy == "hsdp_tp"  # dp_shard took the rest
    assert plan.prediction.step_time_s >= best.predicted_step_time_s


def test_nothing_fits_names_the_smallest_and_the_fix() -> None:
    cfg = compose_recipe("llama70b", ["mesh=8", "mesh/hardware=h100_sxm"])
    with pytest.raises(
        ValueError,
        match=r"sharding=auto: nothing fits mesh.hardware.memory_gib=79.6 \(mesh.hardware.name=h100_sxm\)",
    ) as e:
        search(cfg)
    assert "the smallest layout" in str(e.value) and "x the ranks" in str(e.value)


def test_sharding_tp_pins_the_search() -> None:
    cfg = compose_recipe("llama7b", ["mesh=2x4", "mesh/hardware=h100_sxm", "sharding.tp=4"])
    assert {c.degrees["tp"] for c in search(cfg).candidates} == {4}


def test_muon_keeps_the_search_to_whole_matrices() -> None:
    """Muon orthogonalizes whole matrices: under auto only replicated layouts; a sharded preset is refused."""
    from framework.launch.rules import check, check_layout
    from framework.planner.layout import fixed_degrees

    cfg = compose_recipe("llama_tiny", ["mesh=4", "optimizer=muon"])
    check(cfg)
    check_layout(cfg, fixed_degrees(cfg))
    assert {(c.degrees["dp_shard"], c.degrees["tp"]) for c in search(cfg).candidates} == {(1, 1)}
    sharded = compose_recipe("llama_tiny", ["mesh=4", "sharding=fsdp", "optimizer=muon"])
    with pytest.raises(ValueError, match="optimizer.name='muon' is not valid"):
        check_layout(sharded, fixed_degrees(sharded))


def test_cp_is_searched_for_long_sequences() -> None:
    """cp joins the candidates from CP_MIN_SEQ tokens on, where it can run: planned for H100s in a
    dry run, never for a launch on this CPU machine (torch's ring attention is CUDA only)."""
    long = ["mesh=2x8", "mesh/hardware=h100_sxm", "train.seq_len=32768", "train.global_batch_size=16"]
    result = search(compose_recipe("llama7b", [*long, "run.dry_run=true"]))
    assert {c.degrees["cp"] for c in result.candidates} == {1, 2, 4, 8, 16}
    cp = [c for c in result.candidates if c.degrees["cp"] > 1 and c.fits]
    assert cp and all(c.reason and c.memory_gib <= 79.6 for c in cp)
    tiny = ["mesh=4", "train.seq_len=16384", "train.global_batch_size=4", "run.device=cpu"]
    assert {c.degrees["cp"] for c in search(compose_recipe("llama_tiny", tiny)).candidates} == {1}
    planned = search(compose_recipe("llama_tiny", [*tiny, "run.dry_run=true"]))
    assert {c.degrees["cp"] for c in planned.candidates} == {1, 2, 4}


def test_cp_with_pp_is_searched_in_dry_runs_only() -> None:
    """A dry run plans cp together with pp (Llama 3's long-context layout); a launch's search leaves
    them apart, since a launch of both is refused (framework.planner.layout.check_cp)."""
    from framework.planner.search_space import degree_options

    long = ["mesh=2x8", "mesh/hardware=h100_sxm", "train.seq_len=32768", "run.device=cuda"]
    launch = degree_options(compose_recipe("llama7b", long))
    planned = degree_options(compose_recipe("llama7b", [*long, "run.dry_run=true"]))
    assert any(d.cp > 1 for d in launch) and not any(d.cp > 1 and d.pp > 1 for d in launch)
    both = {(d.cp, d.pp) for d in planned if d.cp > 1 and d.pp > 1}
    assert (2, 2) in both and (8, 2) in both


def _dry_run(tmp: Path, *overrides: str) -> dict:
    """``python train.py ... run.dry_run=true``, its entry point in this process (tests/entry.py):
    a dry run starts no rank, and an interpreter importing torch costs more than the plan."""
    assert train_main(*overrides, "run.dry_run=true", f"hydra.run.dir={tmp}") == 0
    return json.loads((tmp / "plan.json").read_text())


@pytest.mark.parametrize(
    "command",
    [
        ["mesh=2x4", "nccl=gdr3", "recipe=llama7b", "mesh/hardware=h100_sxm"],
        ["mesh=2x4", "nccl=gdr3", "recipe=llama7b", "mesh/hardware=h200"],
        ["recipe=llama70b", "mesh=16x8", "mesh/hardware=h100_sxm"],
        ["recipe=llama70b", "mesh=16x8", "mesh/hardware=h200"],
    ],
    ids=["mission-h100", "mission-h200", "70b-h100", "70b-h200"],
)
def test_the_mission_command_plans_a_layout_that_fits(tmp_path: Path, command: list[str]) -> None:
    """The mission's own command, as written, plus the hardware: the planner's choice, not DDP."""
    plan = _dry_run(tmp_path / "run", *command)
    chosen = plan["search"]["chosen"]
    assert chosen["fits"] and plan["memory"]["total"] <= plan["memory"]["device"]
    assert plan["degrees"] == chosen["degrees"] and plan["strategy"] != "ddp"
    assert plan["predicted_step_time_s"] == pytest.approx(chosen["predicted_step_time_s"])
    assert plan["predicted_mfu"] == pytest.approx(chosen["predicted_mfu"]) and 0 < plan["predicted_mfu"] < 1
    assert plan["memory_gib"] == pytest.approx(chosen["memory_gib"]) == plan["memory"]["total"] / GIB
    written = OmegaConf.load(tmp_path / "run" / "config.yaml")  # ranks plan it without searching
    assert {k: written.parallel[k] for k in chosen["degrees"]} == chosen["degrees"]


# A dry run of the 8B searched on 2 nodes of 8 H100s, compiled.
TWO_H100_NODES = ["mesh=2x8", "mesh/hardware=h100_sxm", "run.device=cuda", "run.dry_run=true", "executor=compile",
                  "sharding=auto"]  # fmt: skip


def test_search_weighs_the_reshard_policy_and_virtual_stages() -> None:
    """The search plans FSDP layouts both resharding after forward and holding their units for the
    step, and interleaved pipelines at 2 and 4 virtual stages; the choice is written into the config."""
    from framework.launch.recipes import compose_recipe

    cfg = compose_recipe(
        "llama3_8b",
        [*TWO_H100_NODES, "sharding.activation_checkpointing=full", "train.global_batch_size=64"],
    )
    result = search(cfg)
    fsdp = [c for c in result.candidates if c.degrees["dp_shard"] * c.degrees["cp"] > 1]
    assert {c.reshard_after_forward for c in fsdp} == {True, False}
    inter = {c.pp_stages_per_rank for c in result.candidates if c.pp_schedule == "interleaved_1f1b"}
    assert inter == {2, 4}
    assert result.chosen_cfg.sharding.reshard_after_forward == result.chosen.reshard_after_forward
    # Held units cost memory and save gathers: for the same layout, never more exposed communication.
    key = lambda c: (c.layout, c.short().replace(" held", ""), c.activation_checkpointing, c.micro_batch_size)  # noqa: E731
    by = {}
    for c in fsdp:
        by.setdefault(key(c), {})[c.reshard_after_forward] = c
    pairs = [p for p in by.values() if len(p) == 2]
    assert pairs and all(p[False].exposed_comm_s <= p[True].exposed_comm_s + 1e-12 for p in pairs)
    assert all(p[False].memory_gib >= p[True].memory_gib for p in pairs)


def test_search_weighs_several_micro_batch_counts_under_pp() -> None:
    """Under a pipeline the micro-batch count (so the micro batch size) is searched: up to three
    counts per layout, the smallest that divide the rank's batch at or above pp, 2 pp and 4 pp, so a
    batch that no multiple of pp divides (24 sequences on 16 stages) is still weighed (it was left
    out); AC and the reshard policy per layout too."""
    cfg = compose_recipe(
        "llama3_8b",
        [*TWO_H100_NODES, "train.micro_batch_size=0", "train.global_batch_size=24"],
    )
    result = search(cfg)
    counts: dict[str, set[int]] = {}
    for c in result.candidates:
        if c.degrees["pp"] > 1:
            counts.setdefault(c.short().split(" ", 1)[0] + str(c.degrees), set()).add(c.pp_microbatches)
    assert max(len(v) for v in counts.values()) == 3  # e.g. pp 2 on a batch of 24: 2, 4 and 8
    sixteen = {c.pp_microbatches for c in result.candidates if c.degrees["pp"] == 16}
    assert sixteen == {24}
    pp2 = [c for c in result.candidates if c.degrees["pp"] == 2 and c.degrees["tp"] == 8]
    assert {c.micro_batch_size for c in pp2} == {12, 6, 3}
    assert {c.activation_checkpointing for c in pp2} == {"none", "selective", "selective_op", "full"}
    sharded = [c for c in result.candidates if c.degrees["pp"] > 1 and c.degrees["dp_shard"] > 1]
    assert {c.reshard_after_forward for c in sharded if c.pp_schedule != "zbv"} == {True, False}


_H200_8B_8K = [
    "run.device=cuda", "mesh/hardware=h200", "train.seq_len=8192", "model.vocab_size=128256",
    "train.global_batch_size=1", "train.micro_batch_size=1", "train.optimizer_in_backward=true",
    "train.grad_clip=0", "sharding=auto",
]  # fmt: skip


def test_auto_weighs_the_compiler_budget_only_under_a_compiled_executor() -> None:
    """Issue 28: under executor=compile auto weighs sharding.activation_checkpointing=budget (where
    AC none does not fit: a device of 125 GiB, none planned at 131.3); eager has no partitioner to
    enforce a budget, so never there."""
    small = [*_H200_8B_8K, "mesh.hardware.memory_gib=125"]
    compiled = search(compose_recipe("llama3_8b", [*small, "executor=compile"]))
    budgets = [c for c in compiled.candidates if c.activation_checkpointing == "budget"]
    assert budgets and all(c.activation_memory_budget is not None for c in budgets)
    eager = search(compose_recipe("llama3_8b", [*small, "executor=eager"]))
    assert {c.activation_checkpointing for c in eager.candidates} <= {"none", "selective", "selective_op", "full"}
    assert all(c.activation_memory_budget is None for c in eager.candidates)


def test_auto_picks_the_largest_budget_that_fits_where_none_does_not() -> None:
    """With the memory of a small device AC none does not fit; the largest budget that does recomputes
    least, so it wins (and is written into the chosen config and printed), the budget below 1.0."""
    from framework.planner.search import BUDGET_MAX, BUDGET_MIN, BUDGET_STEP

    for gib, want in ((125, BUDGET_MAX), (114, None)):  # 0.98 planned at 115.5 GiB
        cfg = compose_recipe("llama3_8b", [*_H200_8B_8K, "executor=compile", f"mesh.hardware.memory_gib={gib}"])
        result = search(cfg)
        none = next(c for c in result.candidates if c.activation_checkpointing == "none")
        best = result.chosen
        assert not none.fits and best.fits and best.activation_checkpointing == "budget"
        budget = best.activation_memory_budget
        assert budget is not None and BUDGET_MIN <= budget < 1.0
        assert budget == want if want else budget < BUDGET_MAX
        chosen = result.chosen_cfg.sharding
        assert (chosen.activation_checkpointing, chosen.activation_memory_budget) == (
            ActivationCheckpointing.budget,
            budget,
        )
        if want is None:  # derived, not the cap: the next step up would not fit
            up = compose_recipe("llama3_8b", [
                *_H200_8B_8K, "executor=compile", f"mesh.hardware.memory_gib={gib}",
                "sharding.activation_checkpointing=budget",
                f"sharding.activation_memory_budget={round(budget + BUDGET_STEP, 2)}",
            ])  # fmt: skip
            with pytest.raises(ValueError, match=f"nothing fits mesh.hardware.memory_gib={gib}"):
                search(up)
        assert f"budget {budget:g}" in format_search(result)
        plan = make_plan(cfg)
        assert plan.activation_memory_budget == budget
        assert f"<- chosen (sharding.activation_memory_budget={budget:g})" in format_plan(plan)


def test_auto_keeps_none_over_a_budget_where_none_fits() -> None:
    """AC none recomputes nothing: where it fits no budget is faster, and none is chosen (the
    compiled 8B cut to 24 layers at 8K on one H200: none planned at 112.6 GiB of 140.4, measured
    109.6); with all 32 layers none does not fit (it ran out of memory on the H200) and the largest
    budget, 0.98, is chosen (measured: 114.4 GiB, the fastest bf16 run; benchmarks/PERF.md)."""
    result = search(compose_recipe("llama3_8b", [*_H200_8B_8K, "executor=compile", "model.n_layers=24"]))
    assert result.chosen.activation_checkpointing == "none" and result.chosen.fits
    full = search(compose_recipe("llama3_8b", [*_H200_8B_8K, "executor=compile"]))
    none = next(c for c in full.candidates if c.activation_checkpointing == "none")
    assert not none.fits
    assert (full.chosen.activation_checkpointing, full.chosen.activation_memory_budget) == ("budget", 0.98)


def test_nothing_fits_names_bf16_moments_and_they_make_it_fit() -> None:
    """Llama-3-8B at 8K on one 80 GB H100, AdamW with fp32 moments: nothing fits (108 GiB with full
    recompute); the refusal names optimizer.state_dtype=bfloat16 with what it takes off, and with it
    the search finds a layout that fits. A run that already has bf16 moments is not told again."""
    overrides = [
        "mesh/hardware=h100_sxm", "train.seq_len=8192", "train.global_batch_size=1", "train.micro_batch_size=1",
        "sharding=auto", "train.optimizer_in_backward=true", "train.grad_clip=0",
    ]  # fmt: skip
    hint = r"optimizer.state_dtype=bfloat16 \(AdamW's moments in bf16: 29.9 GiB"
    with pytest.raises(ValueError, match=hint):
        search(compose_recipe("llama3_8b", overrides))
    fits = search(compose_recipe("llama3_8b", [*overrides, "optimizer.state_dtype=bfloat16"])).chosen
    assert fits.fits and fits.memory_gib < 79.6
    too_long = [*overrides, "optimizer.state_dtype=bfloat16", "train.seq_len=65536"]
    with pytest.raises(ValueError, match="nothing fits") as refused:
        search(compose_recipe("llama3_8b", too_long))
    assert "state_dtype" not in str(refused.value)
