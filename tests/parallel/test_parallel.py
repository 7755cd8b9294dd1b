"""parallelize() on real gloo ranks reproduces the single-process loss trace, for every strategy.

Each case trains the tiny Llama (ModelConfig defaults, seq 32) for 4 AdamW steps on the same global
batch of 8 sequences, split across the data-parallel ranks, and compares the mean loss per step with
one process training on the whole batch. Tolerance: rtol 1e-5 in fp32 (measured differences are
below 2e-7; DDP/FSDP reduce in a different order than one process, so not bitwise).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import CheckpointPolicy

from framework.config.schema import (
    ActivationCheckpointing,
    CompileScope,
    Config,
    ExecutorConfig,
    ExecutorMode,
    ModelFamily,
    ParallelConfig,
    Strategy,
    replace_model,
)
from framework.models import build_model, materialize
from framework.models.parts.layout import op_saved_values
from framework.models.parts.loss import loss_parallel_scope
from framework.parallel import activation, build_mesh, dp_mesh_info, parallelize
from framework.parallel.activation import apply_ac, apply_offload, is_checkpointed, is_offloaded
from framework.parallel.compile import apply_compile, inductor_mode
from framework.planner.plan import Plan
from framework.planner.resolve import make_plan
from tests.dist import run_ranks

SEQ, GLOBAL_BATCH, STEPS, RTOL = 32, 8, 4, 1e-5


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def make_cfg(strategy: str, shape: list[int], tp: int = 1, ac: str = "none") -> Config:
    cfg = Config()
    cfg.mesh.shape = shape
    cfg.sharding.strategy = Strategy(strategy)
    cfg.sharding.tp = tp
    cfg.sharding.activation_checkpointing = ActivationCheckpointing(ac)
    cfg.train.seq_len = SEQ
    cfg.train.global_batch_size = GLOBAL_BATCH
    cfg.train.micro_batch_size = GLOBAL_BATCH // (cfg.mesh.world_size // tp)
    return cfg


def train(model: nn.Module, dp_rank: int, dp_size: int, *, loss_head: bool = False) -> list[float]:
    """The minimal step: forward, CE loss, backward, AdamW step.

    ``loss_head=True`` computes the loss inside the model (``model(tokens, targets)``, the
    ``head_loss`` region the trainer uses and the executor compiles); otherwise from the logits.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    n = GLOBAL_BATCH // dp_size
    for batch in batches():
        x = batch[dp_rank * n : (dp_rank + 1) * n]
        if loss_head:
            loss = model(x[:, :-1], x[:, 1:])
        else:
            logits = model(x[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        if dist.is_initialized():  # every rank's loss, averaged (TP ranks hold the same one)
            dist.all_reduce(mean)
            mean /= dist.get_world_size()
        losses.append(mean.item())
    return losses


def reference_losses(cfg: Config) -> list[float]:
    model = build_model(cfg.model, SEQ)
    materialize(model, "cpu", 0)
    return train(model, 0, 1)


def parallel_model(cfg: Config, seq: int = SEQ) -> tuple[nn.Module, DeviceMesh, Plan]:
    """The model as the trainer builds it on this rank: plan, mesh, parallelize (CPU, seed 0)."""
    plan = make_plan(cfg)
    mesh = build_mesh(plan, "cpu")
    model = parallelize(
        build_model(cfg.model, seq),
        mesh,
        plan,
        cfg.sharding,
        cfg.bucketing,
        cfg.executor,
        torch.device("cpu"),
        0,
    )
    return model, mesh, plan


def _worker(rank: int, world: int, cfg: Config, loss_head: bool = False) -> dict:
    model, mesh, plan = parallel_model(cfg)
    dp_rank, dp_size = dp_mesh_info(mesh, plan)
    with loss_parallel_scope([model]):  # TP's vocabulary-sharded loss: its forward and backward
        return {"losses": train(model, dp_rank, dp_size, loss_head=loss_head), "dp": (dp_rank, dp_size)}


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return reference_losses(Config())


CASES = [
    ("ddp", [1], 1),
    ("ddp", [2], 1),
    ("ddp", [4], 1),
    ("fsdp", [1], 1),
    ("fsdp", [2], 1),
    ("fsdp", [4], 1),
    ("hsdp", [2, 1], 1),
    ("hsdp", [2, 2], 1),
    ("tp", [1], 1),
    ("tp", [2], 2),
    ("fsdp_tp", [2], 2),
    ("fsdp_tp", [2, 2], 2),
    ("hsdp", [2, 4], 1),  # 8 ranks: 2 "nodes" x 4, replicate x shard (the one world-8 case: budget)
]


def test_hsdp_tp_3d_matches_single_process(reference: list[float]) -> None:
    """dp_replicate x dp_shard x tp = 2 x 2 x 2 on 8 gloo ranks (mesh 2x4: TP inside a "node",
    replicas across the two), set by explicit degrees: the layout no preset could express."""
    cfg = make_cfg("fsdp", [2, 4])
    cfg.parallel = ParallelConfig(dp_replicate=2, dp_shard=2, tp=2)
    cfg.train.micro_batch_size = GLOBAL_BATCH // 4
    plan = make_plan(cfg)
    assert (plan.mesh_axes, plan.mesh_shape) == (("dp_replicate", "dp_shard", "tp"), (2, 2, 2))
    assert [p.intra_node for p in plan.placement] == [False, True, True]
    out = run_ranks(_worker, 8, cfg, timeout_s=300)
    for r in out:
        torch.testing.assert_close(r["losses"], reference, rtol=RTOL, atol=0)
    assert sorted({r["dp"] for r in out}) == [(i, 4) for i in range(4)]


@pytest.mark.parametrize(
    ("strategy", "shape", "tp"), CASES, ids=[f"{s}-{'x'.join(map(str, m))}" for s, m, _ in CASES]
)
def test_matches_single_process(strategy: str, shape: list[int], tp: int, reference: list[float]) -> None:
    cfg = make_cfg(strategy, shape, tp)
    out = run_ranks(_worker, cfg.mesh.world_size, cfg)
    for r in out:
        torch.testing.assert_close(r["losses"], reference, rtol=RTOL, atol=0)
    dp = cfg.mesh.world_size // tp
    assert sorted({r["dp"] for r in out}) == [(i, dp) for i in range(dp)]  # TP ranks of a dp group share it


@pytest.mark.parametrize(("strategy", "shape", "tp"), [("fsdp", [2], 1), ("fsdp_tp", [2, 2], 2)])
def test_qwen3_matches_single_process(strategy: str, shape: list[int], tp: int) -> None:
    """Qwen3 (q/k norms replicated over TP, sharded by FSDP; heads of 64 on a width of 128)."""
    qwen3 = {"family": ModelFamily.qwen3, "head_dim": 64}
    single = make_cfg("ddp", [1])
    single.model = dataclasses.replace(single.model, **qwen3)
    cfg = make_cfg(strategy, shape, tp)
    cfg.model = single.model
    out, expected = run_ranks(_worker, cfg.mesh.world_size, cfg), reference_losses(single)
    for r in out:
        torch.testing.assert_close(r["losses"], expected, rtol=RTOL, atol=0)


def test_mistral_window_with_tp_matches_single_process() -> None:
    """Mistral's sliding window (8 < seq 32) under tp=2: the trunk builds the band for the whole
    sequence, which attention sees, not for its sequence shard (a 16 x 16 band failed at the first
    attention, issue 25's Mixtral ep x tp)."""
    single = make_cfg("ddp", [1])
    single.model = replace_model(single.model, family=ModelFamily.mistral, sliding_window=8)
    cfg = make_cfg("tp", [2], 2)
    cfg.model = single.model
    out, expected = run_ranks(_worker, cfg.mesh.world_size, cfg), reference_losses(single)
    for r in out:
        torch.testing.assert_close(r["losses"], expected, rtol=RTOL, atol=0)


def test_ac_and_compile_match_eager(reference: list[float]) -> None:
    """Selective AC + per-block compile (aot_eager) under FSDP2 on 2 ranks reproduces eager."""
    cfg = make_cfg("fsdp", [2], ac="selective")
    cfg.executor = ExecutorConfig(mode=ExecutorMode.compile, scope=CompileScope.block, backend="aot_eager")
    for r in run_ranks(_worker, 2, cfg):
        torch.testing.assert_close(r["losses"], reference, rtol=RTOL, atol=0)


@pytest.mark.parametrize(
    ("strategy", "shape", "ac"),
    [("tp", [2], "none"), ("fsdp_tp", [2, 2], "selective")],
    ids=["tp", "fsdp_tp"],
)
def test_compile_with_tp_matches_eager(
    strategy: str, shape: list[int], ac: str, reference: list[float]
) -> None:
    """Per-block compile (aot_eager) of TP blocks and of the TP loss head reproduces eager.

    Before the embedding output was copied (``framework.parallel.tensor``), the backward failed
    on torch 2.13 with "'Tensor' object has no attribute '_local_tensor'".
    """
    cfg = make_cfg(strategy, shape, tp=2, ac=ac)
    cfg.executor = ExecutorConfig(mode=ExecutorMode.compile, scope=CompileScope.block, backend="aot_eager")
    for r in run_ranks(_worker, cfg.mesh.world_size, cfg, True, timeout_s=300):
        torch.testing.assert_close(r["losses"], reference, rtol=RTOL, atol=0)


def _saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd saves for backward in one forward (the compiled regions' saved tensors)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x[:, :-1], x[:, 1:])
    return total


def test_memory_budget_saves_less_and_trains_the_same(reference: list[float]) -> None:
    """activation_checkpointing=budget: the partitioner (min-cut, as Inductor uses it; here without
    Inductor's code generation) saves less at a lower budget, and training matches eager."""
    executor = ExecutorConfig(mode=ExecutorMode.compile, backend="aot_eager_decomp_partition")
    saved = {}
    for budget in (1.0, 0.0):
        torch._dynamo.reset()
        model = build_model(Config().model, SEQ)
        assert apply_compile(model, executor, torch.device("cpu"), budget) == Config().model.n_layers + 1
        materialize(model, "cpu", 0)
        x = batches()[0]
        model(x[:, :-1], x[:, 1:])  # compiles (and partitions) every region
        saved[budget] = _saved_bytes(model, x)
        if budget == 0.0:
            losses = train(model, 0, 1, loss_head=True)
            torch.testing.assert_close(losses, reference, rtol=RTOL, atol=0)
    assert saved[0.0] < 0.5 * saved[1.0], saved


def test_full_ac_whole_model_compile_single_process(reference: list[float]) -> None:
    """Full AC + whole-model compile (no process group needed for these two steps)."""
    cfg = make_cfg("ddp", [1], ac="full")
    model = build_model(cfg.model, SEQ)
    assert apply_ac(model, cfg.sharding.activation_checkpointing) == cfg.model.n_layers
    executor = ExecutorConfig(mode=ExecutorMode.compile, scope=CompileScope.model, backend="aot_eager")
    assert apply_compile(model, executor, torch.device("cpu")) == 1
    materialize(model, "cpu", 0)
    torch.testing.assert_close(train(model, 0, 1), reference, rtol=RTOL, atol=0)


def _init_worker(rank: int, world: int, cfg: Config) -> list[str]:
    """Names of parameters whose full value differs from the single-process init (none expected)."""
    model, _, _ = parallel_model(cfg)
    assert (model.output.weight is model.tok_embeddings.weight) == cfg.model.tie_embeddings
    ref = build_model(cfg.model, SEQ)
    materialize(ref, "cpu", 0)
    expected = dict(ref.named_parameters())
    got = dict(model.named_parameters())
    assert got.keys() == expected.keys(), sorted(got.keys() ^ expected.keys())
    return [
        name
        for name, p in got.items()
        if not torch.equal(p.full_tensor() if isinstance(p, DTensor) else p, expected[name])
    ]


@pytest.mark.parametrize(("strategy", "shape", "tp"), [("fsdp", [2], 1), ("fsdp_tp", [2, 2], 2)])
def test_initial_weights_equal_single_process(strategy: str, shape: list[int], tp: int) -> None:
    """Tied embeddings stay tied and every layout starts from the single-process weights, bitwise."""
    cfg = make_cfg(strategy, shape, tp)
    assert run_ranks(_init_worker, cfg.mesh.world_size, cfg) == [[]] * cfg.mesh.world_size


def test_ac_modes_count_blocks() -> None:
    cfg = Config()
    model = build_model(cfg.model, SEQ)
    assert apply_ac(model, ActivationCheckpointing.none) == 0
    assert apply_ac(model, ActivationCheckpointing.selective) == 2
    assert [is_checkpointed(b) for b in model.layers.values()] == [True, False, True, False]
    names = [n for n, _ in model.named_parameters()]
    assert "layers.0.attention.wq.weight" in names  # names unchanged by checkpointing


def test_selective_op_keeps_every_other_matmul_and_trains_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """sharding.activation_checkpointing=selective_op (torchtitan's per-op SAC): every block is
    checkpointed and keeps the outputs of wq, wv, w1, w2 and attention besides its input, exactly
    the planner's count (framework.models.parts.layout.op_saved_values, plus attention's per-head
    log-sum-exp); the loss and gradients are those without checkpointing, eager and compiled
    (aot_eager: Dynamo traces the policy)."""
    kept = []
    make_policy = activation._op_policy

    def counting() -> Any:
        policy = make_policy()

        def count(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
            out = policy(ctx, func, *args, **kwargs)
            if out == CheckpointPolicy.MUST_SAVE and not ctx.is_recompute:
                kept.extend(t for t in pytree.tree_leaves(ctx.op_output) if isinstance(t, torch.Tensor))
            return out

        return count

    monkeypatch.setattr(activation, "_op_policy", counting)
    cfg = Config()
    m = cfg.model
    tokens = torch.randint(0, m.vocab_size, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    grads, inputs = {}, {}
    for mode in (ActivationCheckpointing.none, ActivationCheckpointing.selective_op):
        model = build_model(m, SEQ)
        materialize(model, torch.device("cpu"), seed=0)
        assert apply_ac(model, mode) == (0 if mode == ActivationCheckpointing.none else m.n_layers)
        inputs[mode] = _saved_bytes(model, tokens)  # what autograd saves: the blocks' inputs under AC
        kept.clear()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        grads[mode] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    op = ActivationCheckpointing.selective_op
    n_tokens, hd = 2 * SEQ, m.dim // m.n_heads
    lse = m.n_layers * n_tokens * m.n_heads * 4
    expected = m.n_layers * n_tokens * op_saved_values(m, hd) * 4 + lse  # fp32 on the CPU
    block_inputs = m.n_layers * n_tokens * m.dim * 4
    assert sum(t.numel() * t.element_size() for t in kept) + block_inputs == expected
    assert inputs[op] < inputs[ActivationCheckpointing.none]
    torch.testing.assert_close(grads[op], grads[ActivationCheckpointing.none], rtol=RTOL, atol=1e-7)
    torch._dynamo.reset()
    model = build_model(m, SEQ)
    apply_ac(model, op)
    apply_compile(model, ExecutorConfig(mode=ExecutorMode.compile, backend="aot_eager"), torch.device("cpu"))
    materialize(model, torch.device("cpu"), seed=0)
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    compiled = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(compiled, grads[ActivationCheckpointing.none], rtol=RTOL, atol=1e-6)


@pytest.mark.parametrize("mode", [ActivationCheckpointing.none, ActivationCheckpointing.full])
def test_activation_offload_keeps_loss_and_gradients(mode: ActivationCheckpointing) -> None:
    """sharding.activation_offload: the blocks' saved tensors go to host memory and back; the loss
    and every gradient are those of the same model without it, bitwise (alone and around AC)."""
    cfg = Config()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    grads = []
    for offload in (False, True):
        model = build_model(cfg.model, SEQ)
        materialize(model, torch.device("cpu"), seed=0)
        apply_ac(model, mode)
        assert apply_offload(model, offload) == (cfg.model.n_layers if offload else 0)
        assert [is_offloaded(b) for b in model.layers.values()] == [offload] * cfg.model.n_layers
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_off, g_off), (loss_on, g_on) = grads
    assert torch.equal(loss_off, loss_on)
    assert all(torch.equal(g_off[n], g_on[n]) for n in g_off), [
        n for n in g_off if not torch.equal(g_off[n], g_on[n])
    ]


def test_activation_offload_under_compiled_blocks_keeps_the_saved_strides() -> None:
    """Offloaded around compiled blocks (Inductor), the saved tensors come back with the strides the
    compiled backward asserts (torch's save_on_cpu returned them contiguous, and the 8B's first
    step failed on the H200: benchmarks/PERF.md, session 14); loss and gradients are the compiled
    model's without offload. Transposed saved tensors included (the attention's q, k, v views)."""
    cfg = Config()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    results = []
    for offload in (False, True):
        torch._dynamo.reset()
        model = build_model(cfg.model, SEQ)
        apply_compile(model, ExecutorConfig(mode=ExecutorMode.compile, compile_loss=False), torch.device("cpu"))
        apply_offload(model, offload)
        materialize(model, "cpu", 0)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)
    t = torch.randn(2, 3, 4).transpose(1, 2)
    host = activation._to_host(False, t)[1]
    assert host.stride() == t.stride() and torch.equal(activation._from_host((t.device, host)), t)
    view = torch.randn(3, 1).expand(3, 4)  # not dense: saved contiguous
    assert activation._to_host(False, view)[1].is_contiguous()


def test_compile_loss_false_compiles_the_blocks_only(reference: list[float]) -> None:
    """executor.compile_loss=false: each block compiled, the loss head left eager (the model's own
    ``head_loss``, not a compiled wrapper); training through the head matches eager."""
    torch._dynamo.reset()
    model = build_model(Config().model, SEQ)
    eager_head = model.head_loss
    executor = ExecutorConfig(mode=ExecutorMode.compile, backend="aot_eager", compile_loss=False)
    assert apply_compile(model, executor, torch.device("cpu")) == Config().model.n_layers
    assert model.head_loss == eager_head and "head_loss" not in vars(model)
    materialize(model, "cpu", 0)
    torch.testing.assert_close(train(model, 0, 1, loss_head=True), reference, rtol=RTOL, atol=0)


def test_eager_compiles_nothing() -> None:
    """(cudagraphs off CUDA is refused before launch, in framework.launch.entry: tests/train/test_train.py.)"""
    model = build_model(Config().model, SEQ)
    assert apply_compile(model, ExecutorConfig(mode=ExecutorMode.eager), torch.device("cpu")) == 0


def test_inductor_modes() -> None:
    """executor.autotune maps to Inductor's max-autotune modes, with and without CUDA graphs."""
    modes = {
        (m, a): inductor_mode(ExecutorConfig(mode=m, autotune=a))
        for m in (ExecutorMode.compile, ExecutorMode.cudagraphs)
        for a in (False, True)
    }
    assert modes == {
        (ExecutorMode.compile, False): None,
        (ExecutorMode.compile, True): "max-autotune-no-cudagraphs",
        (ExecutorMode.cudagraphs, False): "reduce-overhead",
        (ExecutorMode.cudagraphs, True): "max-autotune",
    }
    assert set(modes.values()) - {None} <= set(torch._inductor.list_mode_options())


def _ddp_bucket_worker(rank: int, world: int, cfg: Config) -> list[int]:
    model, mesh, plan = parallel_model(cfg)
    train(model, *dp_mesh_info(mesh, plan))  # DDP rebuilds its buckets after the first step
    return [
        b.buffer().numel() * b.buffer().element_size() for b in model.reducer._get_zeros_like_grad_buckets()
    ]


def test_ddp_buckets_match_plan() -> None:
    cfg = make_cfg("ddp", [2])
    cfg.bucketing.bucket_cap_mb = 0.5
    plan = make_plan(cfg)
    assert len(plan.bucket_sizes) > 2
    real = run_ranks(_ddp_bucket_worker, 2, cfg)[0]
    assert sorted(real) == sorted(plan.bucket_sizes)


def _accumulating_worker(rank: int, world: int, cfg: Config) -> dict:
    """train_step over 2 micro batches a step; FSDP2's parameter all-gathers counted per step."""
    from framework.train.loop import train_step
    from framework.train.optimizers import build_optimizer, build_scheduler

    cpu = torch.device("cpu")
    model, mesh, plan = parallel_model(cfg)
    dp_rank, dp_size = dp_mesh_info(mesh, plan)
    opt, real = build_optimizer(model, cfg.train, cpu), dist.all_gather_single
    sched = build_scheduler(opt, cfg.train)
    counts, out = [0], []

    def gather(*args: object, **kwargs: object) -> object:
        counts[-1] += 1
        return real(*args, **kwargs)

    n, micro = GLOBAL_BATCH // dp_size, plan.micro_batch_size
    dist.all_gather_single = gather  # type: ignore[assignment]
    try:
        for b in batches():
            mine = b[dp_rank * n : (dp_rank + 1) * n]
            mbs = [(mine[i : i + micro, :-1], mine[i : i + micro, 1:]) for i in range(0, n, micro)]
            r = train_step(model, opt, sched, mbs, cfg.train.grad_clip, cpu)
            out.append((float(r.loss), float(r.grad_norm)))
            counts.append(0)
    finally:
        dist.all_gather_single = real  # type: ignore[assignment]
    gathers = [c for c in plan.comm if c.collective == "all_gather" and c.axis == "dp_shard"]
    return {
        "trace": out,
        "gathers": counts[:-1],
        "planned": gathers[0].calls,
        "units": len(plan.bucket_sizes),
    }


def test_fsdp_holds_units_for_the_step_without_reshard_after_forward() -> None:
    """sharding.reshard_after_forward=false under gradient accumulation (2 micro batches on each of 2
    gloo ranks): the units stay unsharded from the step's first forward to its last backward, one
    all-gather per unit and step as planned (against 2 per unit and micro batch resharding), and the
    losses and gradient norms are those of the resharding run."""
    runs = {}
    for raf in (True, False):
        cfg = make_cfg("fsdp", [2])
        cfg.train.micro_batch_size = GLOBAL_BATCH // 4
        cfg.sharding.reshard_after_forward = raf
        runs[raf] = run_ranks(_accumulating_worker, 2, cfg)
    for held, resharded in zip(runs[False], runs[True], strict=True):
        assert resharded["planned"] == resharded["units"] * 2 * 2
        assert held["planned"] == held["units"]
        assert all(c == held["planned"] for c in held["gathers"]), held["gathers"]
        assert all(c == resharded["planned"] for c in resharded["gathers"]), resharded["gathers"]
        torch.testing.assert_close(held["trace"], resharded["trace"], rtol=RTOL, atol=0)
