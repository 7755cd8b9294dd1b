"""Features that go through a pipeline, on real gloo ranks against one process (rtol 1e-5, as
tests/parallel/test_pipeline.py): tied embeddings (the last stage's copy of the embedding, its gradient
summed into the embedding's and its value sent back each step), checkpoints of a tied model across
pp degrees (the single-process names: one set of optimizer moments for the tied weight), the plan's
count of the copy, the HF export's gather of every stage, document masks in every stage, sft's
token-weighted loss and the verifier's numerics check.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor

from framework.config.schema import Config
from framework.models import build_model, materialize
from framework.parallel import build_mesh, dp_mesh_info, parallelize
from framework.planner.resolve import make_plan, resolve
from tests.dist import run_ranks
from tests.parallel.test_parallel import parallel_model
from tests.parallel.test_pipeline import GLOBAL_BATCH, RTOL, SEQ, STEPS, _check, batches, make_cfg, run_steps


def tied_cfg(world: int, **parallel: object) -> Config:
    cfg = make_cfg(world, **parallel)
    cfg.model.tie_embeddings = True
    return cfg


@pytest.fixture(scope="module")
def tied_run() -> dict:
    """One process: the steps' (loss, grad norm) and the trained model's state."""
    cfg = tied_cfg(1)
    model = build_model(cfg.model, SEQ)
    materialize(model, "cpu", 0)
    steps = run_steps(model, cfg, 0, 1, GLOBAL_BATCH)
    return {"steps": steps, "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


@pytest.fixture(scope="module")
def tied_reference(tied_run: dict) -> list[tuple]:
    return tied_run["steps"]


def val_batches(micro: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """3 validation batches of ``micro`` rows: under pp=2 one group of 2 and one filled up."""
    rows = torch.cat(batches())[: 3 * micro]
    return [(rows[i : i + micro, :-1], rows[i : i + micro, 1:]) for i in range(0, 3 * micro, micro)]


def tied_val(micro: int) -> float:
    """One process's validation loss at initialisation (the trainer evaluates before step 1)."""
    from framework.train.loop import evaluate

    model = build_model(tied_cfg(1).model, SEQ)
    materialize(model, "cpu", 0)
    return evaluate(model, val_batches(micro), torch.device("cpu"))


def _full(p: torch.Tensor | None) -> np.ndarray | None:
    """A whole tensor as numpy: results cross the rank's queue by value (a tensor would go by a
    shared-memory handle, which the rank's exit right after can cut before the parent reads it)."""
    if p is None:
        return None
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().numpy().copy()


@contextlib.contextmanager
def _tied_transfers(tied: object) -> Iterator[list[tuple[str, int]]]:
    """Record (collective, bytes) of each reduce / broadcast over the tied weight's group."""
    import torch.distributed as dist

    calls: list[tuple[str, int]] = []
    group = getattr(tied, "group", None)
    real = {name: getattr(dist, name) for name in ("reduce", "broadcast")}

    def spy(name: str) -> Callable[..., object]:
        def call(t: torch.Tensor, *args: object, **kwargs: object) -> object:
            if group is not None and kwargs.get("group") is group:
                calls.append((f"tied_{name}", t.numel() * t.element_size()))
            return real[name](t, *args, **kwargs)

        return call

    for name in real:
        setattr(dist, name, spy(name))
    try:
        yield calls
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


@contextlib.contextmanager
def _gathers_per_step() -> Iterator[list[int]]:
    """FSDP2's parameter all-gathers (``dist.all_gather_single``) in each pipeline step."""
    import torch.distributed as dist

    from framework.train import loop  # pick_step binds the pipeline's step by this name

    counts: list[int] = []
    real_gather, real_step = dist.all_gather_single, loop.pipeline_step

    def gather(*args: object, **kwargs: object) -> object:
        counts[-1] += 1
        return real_gather(*args, **kwargs)

    def step(*args: object, **kwargs: object) -> object:
        counts.append(0)
        return real_step(*args, **kwargs)

    dist.all_gather_single, loop.pipeline_step = gather, step  # type: ignore[assignment]
    try:
        yield counts
    finally:
        dist.all_gather_single, loop.pipeline_step = real_gather, real_step  # type: ignore[assignment]


def _tied_worker(
    rank: int, world: int, cfg: Config, steps: slice = slice(None), ckpt: tuple | None = None
) -> dict:
    from framework.checkpoint import full_model_state
    from framework.train.loop import evaluate

    model, mesh, plan = parallel_model(cfg, SEQ)
    dp_rank, dp_size = dp_mesh_info(mesh, plan)
    val = evaluate(model, val_batches(plan.micro_batch_size), torch.device("cpu")) if ckpt is None else None
    tied = getattr(model, "tied", None)
    with _tied_transfers(tied) as transfers, _gathers_per_step() as gathers:
        out = run_steps(model, cfg, dp_rank, dp_size, plan.micro_batch_size, steps, ckpt)
    state = full_model_state(model) if ckpt is None else {}  # what checkpoint.export_hf writes
    return {
        "val": val,
        "micro": plan.micro_batch_size,
        "steps": out,
        "stages": getattr(model, "stage_ids", None),
        "master": _full(tied.master) if tied else None,
        "copy": _full(tied.copy) if tied else None,
        "copies": len(getattr(model, "tied_copies", [])),
        "transfers": transfers,
        "gathers": gathers,
        "state": {k: _full(v) for k, v in state.items()},
    }


TIED_CASES = [
    (2, {"pp": 2}),  # embedding on rank 0, its copy on rank 1
    (2, {"pp": 2, "pp_schedule": "zbv", "pp_stages_per_rank": 2}),  # the V: both on rank 0
    (4, {"pp": 2, "dp_shard": 2}),  # FSDP shards of both, summed shard by shard
    (4, {"pp": 2, "tp": 2}),  # TP: the embedding's replicated gradient cut to its vocabulary shard
    # Zero bubble with FSDP: the V holds both, its stages unsharded for the step (it lost the last
    # stage's gradients and crashed on the tied weight before: framework.parallel._pipeline).
    (4, {"pp": 2, "pp_schedule": "zbv", "pp_stages_per_rank": 2, "dp_shard": 2}),
]


@pytest.mark.parametrize(("world", "parallel"), TIED_CASES, ids=[str(p) for _, p in TIED_CASES])
def test_tied_embeddings_match_one_process(tied_run: dict, world: int, parallel: dict) -> None:
    """Training, evaluation through the schedule before it (zbv's eval runs its forward actions
    only: torch's would run the backward hand-off at the V's turn and fail), and the full state the
    HF export gathers from every stage to rank 0 afterwards."""
    tied_reference = tied_run["steps"]
    results = run_ranks(_tied_worker, world, tied_cfg(world, **parallel))
    val = tied_val(results[0]["micro"])
    assert all(r["val"] == pytest.approx(val, rel=RTOL) for r in results), (val, results[0]["val"])
    print(f"tied {parallel}: max rel diff {_check(results, tied_reference):.2e}")
    masters = [r["master"] for r in results if r["master"] is not None]
    copies = [r["copy"] for r in results if r["copy"] is not None]
    assert masters and copies and sum(r["copies"] for r in results) == len(copies)
    # The plan's tied transfers are what the ranks sent: per step one reduce and one broadcast of
    # each rank's shard, on the two ranks of each group; none where one rank holds both (zbv).
    planned = {c.collective: c for c in make_plan(tied_cfg(world, **parallel)).comm if c.axis == "pp"}
    sent = [r["transfers"] for r in results if r["transfers"]]
    if "tied_reduce" not in planned:
        assert not sent and all(r["master"] is not None for r in results if r["copy"] is not None)
    else:
        assert len(sent) == sum(r["copy"] is not None for r in results) * 2, sent
        for kind in ("tied_reduce", "tied_broadcast"):
            c = planned[kind]
            assert c.calls == 1 and c.group_size == 2
            assert all(t.count((kind, c.bytes_per_call)) == STEPS * c.calls for t in sent), (kind, sent)
            assert all(len(t) == 2 * STEPS for t in sent), sent
    if parallel.get("pp_schedule") == "zbv" and "dp_shard" in parallel:
        # Zero bubble keeps the FSDP units unsharded for the step: one all-gather per unit and step
        # (after the first, whose shape inference runs more), as planned for the busiest rank.
        (gather,) = [c for c in make_plan(tied_cfg(world, **parallel)).comm if c.collective == "all_gather"]
        assert max(r["gathers"][-1] for r in results) == gather.calls == 4, [r["gathers"] for r in results]
        assert all(len(set(r["gathers"][1:])) == 1 for r in results), [r["gathers"] for r in results]
    # After 4 steps every copy still holds exactly the embedding's value.
    assert all(np.array_equal(c, masters[0]) for c in masters + copies)
    state, want = results[0]["state"], tied_run["state"]
    assert sorted(state) == sorted(want) and not any(r["state"] for r in results[1:])
    # Per tensor, relative to its norm: after 4 AdamW steps a weight with a near-zero gradient can
    # move by ~1e-5 more or less in another summation order (one process with 2 micro batches
    # instead of 1 differs from itself by 1.3e-5 in one element); a wrong name or stage is ~1.
    for name, t in want.items():
        diff = (torch.from_numpy(state[name]) - t).norm() / t.norm()
        assert diff < 1e-4, (name, float(diff))


def _dcp_keys(path: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


PP2_1F1B = {"pp": 2}
PP2_ZBV = {"pp": 2, "pp_schedule": "zbv", "pp_stages_per_rank": 2}


@pytest.mark.parametrize(
    ("save", "load"), [(PP2_1F1B, {}), ({}, PP2_ZBV)], ids=["pp2-1f1b->pp1", "pp1->pp2-zbv"]
)
def test_tied_checkpoint_loads_across_pp_degrees(
    tied_reference: list[tuple], tmp_path: Path, save: dict, load: dict
) -> None:
    """2 steps at one pp degree, saved; steps 3-4 resumed at the other continue as the unbroken
    single-process run. The checkpoint holds the tied weight once, with its optimizer moments, under
    the embedding's name, whichever degree saved it (the pipeline's last stage reads it into its
    copy)."""

    def world(p: dict) -> int:
        return p.get("pp", 1)

    saved = run_ranks(
        _tied_worker, world(save), tied_cfg(world(save), **save), slice(0, 2), ("save", str(tmp_path))
    )
    _check(saved, tied_reference[:2])
    (step_dir,) = [p for p in tmp_path.iterdir() if p.name.startswith("step_")]
    tied = {k for k in _dcp_keys(step_dir) if "tok_embeddings" in k or "output" in k}
    assert tied == {
        "model.tok_embeddings.weight",
        "optim.state.tok_embeddings.weight.exp_avg",
        "optim.state.tok_embeddings.weight.exp_avg_sq",
        "optim.state.tok_embeddings.weight.step",
    }, tied
    resumed = run_ranks(
        _tied_worker, world(load), tied_cfg(world(load), **load), slice(2, 4), ("load", str(tmp_path))
    )
    print(f"tied {save} -> {load}: max rel diff {_check(resumed, tied_reference[2:]):.2e}")


def test_plan_counts_the_tied_copy_as_the_dry_run_measures_it() -> None:
    """zbv puts the embedding and the last stage's copy on pp rank 0: the fake-backend dry run
    measures both, and the plan counts the copy as a parameter (and gradient) without AdamW moments."""
    from framework.launch.dry_run import dry_run, format_dry_run
    from framework.planner.cost import adamw_state_bytes
    from framework.planner.params import MASTER_BYTES

    cfg = tied_cfg(2, pp=2, pp_schedule="zbv", pp_stages_per_rank=2)  # zbv runs without dp
    resolved = resolve(cfg)
    report = dry_run(resolved.cfg, resolved.plan)
    assert report.measured_param_bytes == report.estimated_param_bytes, format_dry_run(report)
    memory = resolved.plan.memory
    copy_bytes = cfg.model.vocab_size * cfg.model.dim * MASTER_BYTES
    assert memory.optimizer == (memory.params - copy_bytes) // MASTER_BYTES * adamw_state_bytes(cfg)


# Per-micro-batch inputs: document masks (every stage needs the rows' document ids) and sft's
# masked targets (the loss is the mean over every trained target of the global batch).


def doc_batches(sft: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, targets) per step. Documents: EOS (token 0) at ~1 in 5 positions. sft: documents
    start at a DOC_START flag instead (``NO_EOS``), and about half the targets are masked, more in
    some rows than others, so a mean of micro-batch means would weigh them differently."""
    from framework.models.parts.masks import DOC_START

    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        rows = torch.randint(1, 256, (GLOBAL_BATCH, SEQ + 1), generator=g)
        starts = torch.rand(rows.shape, generator=g) < 0.2
        x, y = rows[:, :-1], rows[:, 1:].clone()
        if not sft:
            out.append((torch.where(starts[:, :-1], 0, x), y))
            continue
        keep = torch.rand(y.shape, generator=g) < torch.linspace(0.1, 0.9, GLOBAL_BATCH)[:, None]
        out.append((torch.where(starts[:, :-1], x | DOC_START, x), torch.where(keep, y, -100)))
    return out


def _doc_steps(
    model: torch.nn.Module,
    cfg: Config,
    dp_rank: int,
    dp_size: int,
    micro: int,
    sft: bool,
    weighted: bool = True,
) -> list[tuple]:
    from framework.train.loop import train_step
    from framework.train.optimizers import build_optimizer, build_scheduler

    opt = build_optimizer(model, cfg.train, torch.device("cpu"))
    sched = build_scheduler(opt, cfg.train)
    n, out = GLOBAL_BATCH // dp_size, []
    for x, y in doc_batches(sft):
        mx, my = x[dp_rank * n : (dp_rank + 1) * n], y[dp_rank * n : (dp_rank + 1) * n]
        mbs = [(mx[i : i + micro], my[i : i + micro]) for i in range(0, n, micro)]
        total = int((y >= 0).sum())  # the sampler's loss_scales: share of the global batch's trained targets
        scales = [int((b >= 0).sum()) * dp_size / total for _, b in mbs] if sft and weighted else None
        r = train_step(model, opt, sched, mbs, cfg.train.grad_clip, torch.device("cpu"), scales=scales)
        out.append((r.loss, r.grad_norm))
    return out


def _eos(sft: bool) -> int:
    from framework.models.parts.masks import NO_EOS

    return NO_EOS if sft else 0


def _doc_reference(sft: bool, weighted: bool = True, masked: bool = True) -> list[tuple]:
    cfg = tied_cfg(1)
    model = build_model(cfg.model, SEQ, _eos(sft) if masked else None)
    materialize(model, "cpu", 0)
    return _doc_steps(model, cfg, 0, 1, GLOBAL_BATCH // 2, sft, weighted)


def _doc_worker(rank: int, world: int, cfg: Config, sft: bool) -> dict:
    plan = make_plan(cfg)
    mesh = build_mesh(plan, "cpu")
    model = build_model(cfg.model, SEQ, _eos(sft))
    model = parallelize(model, mesh, plan, cfg.sharding, cfg.bucketing, cfg.executor, torch.device("cpu"), 0)
    dp_rank, dp_size = dp_mesh_info(mesh, plan)
    return {"steps": _doc_steps(model, cfg, dp_rank, dp_size, plan.micro_batch_size, sft), "stages": None}


def test_document_mask_through_every_stage_matches_one_process() -> None:
    """Interleaved 1F1B over 4 stages on 2 ranks: the middle stages attend within documents too."""
    reference = _doc_reference(sft=False)
    plain = _doc_reference(sft=False, masked=False)  # the same rows, attention across documents
    assert abs(plain[-1][1] - reference[-1][1]) > 0.01 * reference[-1][1], (plain[-1], reference[-1])
    cfg = tied_cfg(2, pp=2, pp_schedule="interleaved_1f1b", pp_stages_per_rank=2)
    results = run_ranks(_doc_worker, 2, cfg, False)
    print(f"document mask, pp=2 interleaved: max rel diff {_check(results, reference):.2e}")


def test_sft_token_weighted_loss_matches_one_process() -> None:
    """pp=2 x dp_shard=2, 2 micro batches per rank, masked targets and DOC_START documents: the loss
    and gradient are the mean over every trained target of the global batch. The mean of the micro
    batches' means is far from it here, so the comparison can fail."""
    reference = _doc_reference(sft=True)
    unweighted = _doc_reference(sft=True, weighted=False)
    assert abs(unweighted[0][1] - reference[0][1]) > 0.05 * reference[0][1], (unweighted[0], reference[0])
    results = run_ranks(_doc_worker, 4, tied_cfg(4, pp=2, dp_shard=2), True)
    print(f"sft, pp=2 x dp_shard=2: max rel diff {_check(results, reference):.2e}")


def _numerics_worker(rank: int, world: int, cfg: Config, scale_head: float) -> tuple:
    from framework.verify.numerics import check_numerics, reference_model

    plan = make_plan(cfg)
    mesh = build_mesh(plan, "cpu")
    cpu = torch.device("cpu")
    model = parallelize(
        build_model(cfg.model, SEQ), mesh, plan, cfg.sharding, cfg.bucketing, cfg.executor, cpu, 0
    )
    if model.has_last:  # a wrong last stage: its final norm scaled
        model.norm.weight.data.mul_(scale_head)
    rows = batches()[0][: plan.micro_batch_size]
    check = check_numerics(
        model,
        (rows[:, :-1], rows[:, 1:]),
        cpu,
        rtol=1e-4,
        compiled=True,  # eager here: the pipeline's second pass under force_eager gives the same logits
        make_reference=lambda: reference_model(build_model(cfg.model, SEQ), 0, cpu),
    )
    return check.passed, check.figures


@pytest.mark.parametrize("scale_head", [1.0, 1.5])
def test_verifier_numerics_check_through_a_pipeline(scale_head: float) -> None:
    """verify's numerics check under pp=2 (tied): the last stage's logits against the same pipeline
    under force_eager and against an unsharded eager model; a wrong last stage fails it on every rank."""
    results = run_ranks(_numerics_worker, 2, tied_cfg(2, pp=2), scale_head)
    for passed, figures in results:
        assert figures["logits_rel_diff_vs_eager"] == 0.0
        if scale_head == 1.0:
            assert passed and figures["logits_rel_diff_vs_unsharded"] < 1e-5, figures
        else:
            assert not passed and figures["logits_rel_diff_vs_unsharded"] > 0.1, figures


# The verifier's NaN injection: the bad-step policy sees the same non-finite steps on every pp rank.


def nan_cfg(pp: int) -> Config:
    """The trainer in-process: 6 steps, a synchronous checkpoint every 2; the batches of steps 3-5
    (0-based 2-4) poisoned, so 3 bad steps in a row (verify.max_bad_steps) roll back to the last
    checkpoint (step 4's: skipped steps leave the weights of step 2)."""
    from framework.config.schema import (
        CheckpointConfig,
        Device,
        FreezeConfig,
        FreezeMode,
        LoggerConfig,
        MeshConfig,
        RunConfig,
        TrainConfig,
        VerifyConfig,
    )

    cfg = Config(
        train=TrainConfig(
            steps=6, global_batch_size=4, seq_len=SEQ, log_every=1, eval_every=0, warmup_steps=0
        ),
        checkpoint=CheckpointConfig(enabled=True, every_steps=2),
        verify=VerifyConfig(inject_nan_steps=[2, 3, 4], max_bad_steps=3),
        run=RunConfig(device=Device.cpu),
        mesh=MeshConfig(shape=[pp]),
        freeze=FreezeConfig(mode=FreezeMode.none),
        logger=LoggerConfig(progress_bar=False, plot=False),
    )
    cfg.parallel.pp, cfg.parallel.dp_shard = pp, 1
    return cfg


_KEPT: list[object] = []  # a forked rank's run parts, never freed: it ends with os._exit (framework.launch.worker)


def _nan_worker(rank: int, world: int, cfg: Config, run_dir: Path) -> dict:
    from framework.train import trainer

    resolved = resolve(cfg)
    summary = trainer.run(resolved.cfg, resolved.plan, run_dir, keep=_KEPT)
    return {"skipped": summary.skipped_steps, "steps": summary.steps}


def _nan_trace(run_dir: Path) -> tuple[list, list]:
    from framework.record.metrics import read_metrics

    rows = read_metrics(run_dir)
    losses = [(r["step"], r["loss"], r["grad_norm"]) for r in rows if "loss" in r]
    events = [(r["step"], r["event"], r.get("detail", "")) for r in rows if "event" in r]
    return losses, events


def test_injected_nan_skips_and_rolls_back_through_a_pipeline(tmp_path: Path) -> None:
    """pp=2 (tied, 1f1b): the last stage's logits are poisoned; the NaN reaches the first stage's
    rank through the loss's sum over the pp axis and the backward, so both ranks skip steps 3 and 4
    and roll back at step 5 as one process does, and train on to the same losses (rtol 1e-5).
    Without verify, so plain steps are read one step late (the trainer's lag) on both."""
    runs = {}
    for pp in (1, 2):
        run_dir = tmp_path / f"pp{pp}"
        run_dir.mkdir()
        out = run_ranks(_nan_worker, pp, nan_cfg(pp), run_dir, init=False, timeout_s=180)
        assert all(o == {"skipped": 3, "steps": 6} for o in out), out
        runs[pp] = _nan_trace(run_dir)
    (ref_losses, ref_events), (losses, events) = runs[1], runs[2]
    assert [e[:2] for e in events if e[1] == "skipped_step"] == [
        (3, "skipped_step"),
        (4, "skipped_step"),
        (5, "skipped_step"),
    ]
    rollback = [e for e in events if e[1].startswith("fallback/")]
    assert len(rollback) == 1 and "rollback to step 4" in rollback[0][2], events
    assert [e[:2] for e in events] == [e[:2] for e in ref_events], (events, ref_events)
    assert [s for s, *_ in losses] == [s for s, *_ in ref_losses]
    for (step, loss, norm), (_, ref_loss, ref_norm) in zip(losses, ref_losses, strict=True):
        if ref_loss != ref_loss:  # a poisoned step: NaN on both
            assert loss != loss and norm != norm, step
            continue
        assert loss == pytest.approx(ref_loss, rel=RTOL) and norm == pytest.approx(ref_norm, rel=RTOL), step


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_units_held_for_the_step_under_any_schedule(tied_run: dict, schedule: str) -> None:
    """sharding.reshard_after_forward=false with pp=2 x dp_shard=2 (4 gloo ranks, tied embeddings):
    torch's PipelineStage keeps reshard_after_backward off until the step's reduce, so each FSDP unit
    is gathered once a step, as planned (framework.planner.stages.held_for_step), and training matches
    one process."""
    spr = 2 if schedule.startswith("interleaved") else 1
    cfg = tied_cfg(4, pp=2, dp_shard=2, pp_schedule=schedule, pp_stages_per_rank=spr)
    cfg.sharding.reshard_after_forward = False
    results = run_ranks(_tied_worker, 4, cfg)
    print(f"held {schedule}: max rel diff {_check(results, tied_run['steps']):.2e}")
    (gather,) = [c for c in make_plan(cfg).comm if c.collective == "all_gather"]
    # After the first step (whose shape inference runs more), the busiest rank as planned.
    assert max(r["gathers"][-1] for r in results) == gather.calls, [r["gathers"] for r in results]
    assert all(len(set(r["gathers"][1:])) == 1 for r in results), [r["gathers"] for r in results]
