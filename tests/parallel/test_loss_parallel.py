"""Loss parallelism (``parallel.loss_parallel``, framework.models.parts.loss) on real gloo ranks.

Under tp > 1 the output projection's logits stay sharded over the vocabulary and the cross-entropy
runs under torch's ``loss_parallel()``. Each case trains the tiny Llama (2 layers, vocabulary 320,
so that a whole-vocabulary tensor is told apart from every other shape; seq 16) for 3 steps of the
framework's ``train_step`` (AdamW, clipping that clips, 2 micro batches per rank where the batch
allows) and evaluates it, and compares the loss and gradient norm of every step and the validation
loss with one process: rtol 1e-5. ``masked``: sft's targets, ignored (IGNORE_INDEX) over each
row's prompt, token-weighted as the sampler's ``loss_scales`` weigh them. A probe of what autograd
saves for backward shows that no rank keeps a whole-vocabulary tensor (and that with loss
parallelism off, each rank keeps the gathered logits).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.distributed.tensor import DTensor

from framework.config.schema import CompileScope, Config, ExecutorConfig, ExecutorMode
from framework.kernels.fused_ce import IGNORE_INDEX
from framework.models import build_model, materialize
from framework.models.parts.loss import loss_parallel_scope
from framework.parallel import build_mesh, dp_mesh_info, parallelize
from framework.parallel.pipeline import is_pipeline, logit_modules
from framework.planner.resolve import make_plan
from framework.train.loop import evaluate, train_step
from framework.train.optimizers import build_optimizer, build_scheduler
from framework.verify.numerics import batch_logits
from tests.dist import run_ranks

SEQ, GLOBAL_BATCH, STEPS, RTOL, VOCAB = 16, 8, 3, 1e-5, 320
CPU = torch.device("cpu")


def make_cfg(world: int, **parallel: object) -> Config:
    cfg = Config()
    cfg.mesh.shape = [world]
    cfg.model.vocab_size = VOCAB
    cfg.model.n_layers = 2  # one block per pipeline stage; fewer regions to compile
    cfg.train.seq_len = SEQ
    cfg.train.global_batch_size = GLOBAL_BATCH
    cfg.train.grad_clip = 0.3
    cfg.train.warmup_steps = 0
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    if parallel:
        cfg.parallel.dp_shard = cfg.parallel.dp_shard or 1
    return cfg


def rows(seed: int, n: int, masked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets) of ``n`` rows; ``masked``: each row's first 2-9 targets ignored (a prompt)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, SEQ + 1), generator=g)
    tokens, targets = x[:, :-1], x[:, 1:].clone()
    if masked:
        prompt = torch.randint(2, 10, (n, 1), generator=g)
        targets[torch.arange(SEQ) < prompt] = IGNORE_INDEX
    return tokens, targets


def run(model: torch.nn.Module, cfg: Config, dp_rank: int, dp_size: int, micro: int, masked: bool) -> dict:
    """``STEPS`` train steps (loss, gradient norm) on this rank's rows of each global batch, then
    the validation loss over 2 batches of 4 rows (this rank's share of each)."""
    opt = build_optimizer(model, cfg.train, CPU)
    sched = build_scheduler(opt, cfg.train)
    n = GLOBAL_BATCH // dp_size
    steps = []
    for step in range(STEPS):
        x, y = rows(step, GLOBAL_BATCH, masked)
        x, y = x[dp_rank * n : (dp_rank + 1) * n], y[dp_rank * n : (dp_rank + 1) * n]
        mbs = [(x[i : i + micro], y[i : i + micro]) for i in range(0, n, micro)]
        total = int((rows(step, GLOBAL_BATCH, masked)[1] >= 0).sum())  # the global batch's trained targets
        scales = [int((b >= 0).sum()) * dp_size / total for _, b in mbs] if masked else None
        r = train_step(model, opt, sched, mbs, cfg.train.grad_clip, CPU, scales=scales)
        steps.append((r.loss, r.grad_norm))
    k = 4 // dp_size
    val = [rows(100 + i, 4, masked) for i in range(2)]
    val = [(vx[dp_rank * k : (dp_rank + 1) * k], vy[dp_rank * k : (dp_rank + 1) * k]) for vx, vy in val]
    return {"steps": steps, "val": evaluate(model, val, CPU)}


def saved_vocab_dims(model: torch.nn.Module) -> set[int]:
    """The last dims of the tensors autograd saves (this rank's local shards) that hold logits: a
    multiple of the vocabulary's shard, VOCAB // 2 or VOCAB, in one forward of the loss."""
    dims: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        local = t._local_tensor if isinstance(t, DTensor) else t
        if local.dim() and local.shape[-1] in (VOCAB // 2, VOCAB):
            dims.add(local.shape[-1])
        return t

    x, y = rows(7, GLOBAL_BATCH // 2, masked=False)
    with loss_parallel_scope([model]), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, y)
    return dims


def _worker(rank: int, world: int, cfg: Config, masked: bool, probe: bool = False) -> dict:
    plan = make_plan(cfg)
    mesh = build_mesh(plan, "cpu")
    model = parallelize(
        build_model(cfg.model, SEQ), mesh, plan, cfg.sharding, cfg.bucketing, cfg.executor, CPU, 0
    )
    dp_rank, dp_size = dp_mesh_info(mesh, plan)
    out: dict = {"loss_parallel": plan.loss_parallel}
    if probe:
        out["saved_vocab_dims"] = sorted(saved_vocab_dims(model))
    if is_pipeline(model):  # the last stage hands the schedule its logits as vocabulary shards
        shards: list[tuple[bool, int]] = []

        def note(_m: torch.nn.Module, _a: tuple, logits: torch.Tensor) -> None:
            local = logits.to_local() if isinstance(logits, DTensor) else logits
            shards.append((isinstance(logits, DTensor), local.shape[-1]))

        hooks = [m.register_forward_hook(note) for m in logit_modules(model)]
        # The verifier's logits through the schedule: gathered to the whole vocabulary.
        x, y = rows(7, GLOBAL_BATCH // 2, masked=False)  # one micro batch (pp=2 cuts the batch in 2)
        logits = batch_logits(model, x, CPU, y)
        out["logits"] = None if logits is None else logits.detach()
        out["stage_logits"] = sorted(set(shards))
        for h in hooks:
            h.remove()
    out.update(run(model, cfg, dp_rank, dp_size, plan.micro_batch_size, masked))
    return out


@pytest.fixture(scope="module")
def reference() -> Callable[[bool], dict]:
    """One process's steps and validation loss (the whole batch in one micro batch), per ``masked``."""
    cache: dict[bool, dict] = {}

    def get(masked: bool) -> dict:
        if masked not in cache:
            cfg = make_cfg(1)
            model = build_model(cfg.model, SEQ)
            materialize(model, "cpu", 0)
            x, _ = rows(7, GLOBAL_BATCH // 2, masked=False)
            cache[masked] = {"logits": model(x).detach(), **run(model, cfg, 0, 1, GLOBAL_BATCH, masked)}
        return cache[masked]

    return get


def _check(results: list[dict], ref: dict) -> float:
    worst = 0.0
    for r in results:
        assert r["loss_parallel"]
        for (loss, norm), (ref_loss, ref_norm) in zip(r["steps"], ref["steps"], strict=True):
            assert loss == pytest.approx(ref_loss, rel=RTOL), (loss, ref_loss)
            assert norm == pytest.approx(ref_norm, rel=RTOL), (norm, ref_norm)
            worst = max(worst, abs(loss / ref_loss - 1), abs(norm / ref_norm - 1))
        assert r["val"] == pytest.approx(ref["val"], rel=RTOL), (r["val"], ref["val"])
        worst = max(worst, abs(r["val"] / ref["val"] - 1))
    return worst


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "sft_masked"])
def test_tp2_matches_one_process_and_keeps_no_whole_vocabulary(
    reference: Callable[[bool], dict], masked: bool
) -> None:
    """tp=2, two micro batches per rank (gradient accumulation): every step and the validation loss
    as one process's; what autograd saves holds the logits' vocabulary shard (160), never the whole
    vocabulary (320)."""
    results = run_ranks(_worker, 2, make_cfg(2, tp=2), masked, True)
    assert all(r["saved_vocab_dims"] == [VOCAB // 2] for r in results), [
        r["saved_vocab_dims"] for r in results
    ]
    print(
        f"tp=2 loss parallel{' sft' if masked else ''}: max rel diff {_check(results, reference(masked)):.2e}"
    )


def test_tp2_without_loss_parallel_gathers_the_logits(reference: Callable[[bool], dict]) -> None:
    """parallel.loss_parallel=false: the same numbers, each rank holding the gathered logits."""
    cfg = make_cfg(2, tp=2, loss_parallel=False)
    results = run_ranks(_worker, 2, cfg, True, True)
    assert all(VOCAB in r["saved_vocab_dims"] for r in results), [r["saved_vocab_dims"] for r in results]
    for r in results:
        r["loss_parallel"] = not r["loss_parallel"]  # off, as asked
    _check(results, reference(True))


def test_fsdp_x_tp_matches_one_process(reference: Callable[[bool], dict]) -> None:
    """dp_shard=2 x tp=2 (4 ranks), sft's masked targets."""
    results = run_ranks(_worker, 4, make_cfg(4, dp_shard=2, tp=2), True)
    print(f"dp_shard=2 x tp=2 loss parallel sft: max rel diff {_check(results, reference(True)):.2e}")


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "sft_masked"])
def test_pp_x_tp_matches_one_process(reference: Callable[[bool], dict], masked: bool) -> None:
    """pp=2 x tp=2 (4 ranks, 1F1B, tied embeddings): the last stage's logits reach the schedule's loss
    as vocabulary shards; sft's loss is the schedule's token-weighted sum; the verifier's logits
    through the schedule are gathered whole and equal one process's."""
    results = run_ranks(_worker, 4, make_cfg(4, pp=2, tp=2), masked)
    ref = reference(masked)
    last = [r for r in results if r["logits"] is not None]
    assert len(last) == 2  # the tp ranks of the last stage
    for r in last:
        assert r["stage_logits"] == [(True, VOCAB // 2)]
        torch.testing.assert_close(r["logits"], ref["logits"], rtol=1e-5, atol=1e-6)
    print(f"pp=2 x tp=2 loss parallel{' sft' if masked else ''}: max rel diff {_check(results, ref):.2e}")


def test_compiled_loss_head_matches_eager(reference: Callable[[bool], dict]) -> None:
    """executor=compile (aot_eager, block scope: each block and the head_loss region compiled) under
    tp=2 with sft's masked targets: as one process's eager steps."""
    cfg = make_cfg(2, tp=2)
    cfg.executor = ExecutorConfig(mode=ExecutorMode.compile, scope=CompileScope.block, backend="aot_eager")
    results = run_ranks(_worker, 2, cfg, True, True, timeout_s=300)
    assert all(r["saved_vocab_dims"] == [VOCAB // 2] for r in results), [
        r["saved_vocab_dims"] for r in results
    ]
    print(f"tp=2 compiled loss parallel sft: max rel diff {_check(results, reference(True)):.2e}")


def test_loss_outside_the_scope_is_refused_in_one_line() -> None:
    """The sharded loss needs torch's handlers in forward and backward: outside the scope, one line
    that names the scope and the setting, instead of DTensor's "mixed torch.Tensor and DTensor"."""
    results = run_ranks(_outside_worker, 2, make_cfg(2, tp=2))
    assert all("loss_parallel_scope" in r and "parallel.loss_parallel=false" in r for r in results), results


def _outside_worker(rank: int, world: int, cfg: Config) -> str:
    plan = make_plan(cfg)
    model = parallelize(
        build_model(cfg.model, SEQ),
        build_mesh(plan, "cpu"),
        plan,
        cfg.sharding,
        cfg.bucketing,
        cfg.executor,
        CPU,
        0,
    )
    x, y = rows(0, 2, masked=False)
    with pytest.raises(RuntimeError) as err:
        model(x, y)
    return str(err.value)
