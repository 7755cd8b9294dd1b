"""The training step on its own: schedule, accumulation, and DDP against a single process."""

import numpy as np
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from framework.config import BucketingConfig, ModelConfig, TrainConfig
from framework.data import BatchSampler
from framework.loop import HostIO, attach_in_backward, build_optimizer, build_scheduler, lr_lambda, train_step
from framework.model import build_model, materialize
from framework.parallel.data_parallel import apply_ddp
from tests.dist import run_ranks

# A skipped (non-finite) step and the optimiser-in-backward step still call the main optimiser's
# step(), so torch's scheduler never sees its step() first: its warning is an error here.
pytestmark = pytest.mark.filterwarnings("error:Detected call of `lr_scheduler.step\\(\\)`:UserWarning")

CPU = torch.device("cpu")
MODEL = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256)
# A learnable stream (a repeating ramp), so a few steps visibly lower the loss.
TOKENS = np.tile(np.arange(256, dtype=np.uint16), 64)
TRAIN = TrainConfig(steps=6, global_batch_size=8, micro_batch_size=2, seq_len=16, lr=1e-2, warmup_steps=2)


def _model():
    m = build_model(MODEL, TRAIN.seq_len)
    materialize(m, CPU, seed=0)
    return m


def _trace(model, dp_rank: int, dp_size: int, micro: int, steps: int = TRAIN.steps) -> list[float]:
    torch.manual_seed(0)
    opt = build_optimizer(model, TRAIN, CPU)
    sched = build_scheduler(opt, TRAIN)
    sampler = BatchSampler(
        TOKENS, 256, TRAIN.seq_len, TRAIN.global_batch_size, micro, dp_rank, dp_size, seed=3
    )
    return [train_step(model, opt, sched, sampler.next_batch(), 1.0, CPU).loss for _ in range(steps)]


def test_lr_schedule_warms_up_then_decays_to_min() -> None:
    f = lr_lambda(TrainConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1))
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(55) == pytest.approx(0.55)
    assert f(100) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)


def test_gradient_accumulation_matches_one_big_batch() -> None:
    big = _trace(_model(), 0, 1, micro=8)
    accumulated = _trace(_model(), 0, 1, micro=2)
    torch.testing.assert_close(torch.tensor(accumulated), torch.tensor(big), rtol=1e-5, atol=1e-5)


def test_loss_falls_on_a_fixed_batch() -> None:
    model = _model()
    opt = build_optimizer(model, TRAIN, CPU)
    sched = build_scheduler(opt, TrainConfig(steps=30, warmup_steps=0, lr=1e-2))
    sampler = BatchSampler(None, 256, 16, 8, 8, 0, 1, seed=0)
    batch = sampler.next_batch()
    losses = [train_step(model, opt, sched, batch, 1.0, CPU).loss for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0]


def test_non_finite_loss_skips_the_step() -> None:
    model = _model()
    opt = build_optimizer(model, TRAIN, CPU)
    sched = build_scheduler(opt, TRAIN)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        model.tok_embeddings.weight[0, 0] = float("nan")
    x = torch.zeros(2, 16, dtype=torch.long)
    result = train_step(model, opt, sched, [(x, x)], 1.0, CPU)
    assert not result.finite
    for b, p in zip(before[1:], list(model.parameters())[1:], strict=True):
        assert torch.equal(b, p)


def _run_steps(model, in_backward: bool, steps: int = 5, poison_at: int = -1):
    """``steps`` unclipped steps on one batch each, with or without the optimiser in backward; the
    loss of step ``poison_at`` is made NaN."""
    opt = build_optimizer(model, TRAIN, CPU)
    sched = build_scheduler(opt, TRAIN)
    ib = attach_in_backward(opt) if in_backward else None
    sampler = BatchSampler(TOKENS, 256, TRAIN.seq_len, 4, 4, 0, 1, seed=5)
    results = []
    for i in range(steps):
        handle = (
            model.register_forward_hook(lambda _m, _i, out: out * float("nan")) if i == poison_at else None
        )
        results.append(train_step(model, opt, sched, sampler.next_batch(), 0.0, CPU, ib))
        if handle is not None:
            handle.remove()
    return results, opt


def test_optimizer_in_backward_matches_the_step_after_backward() -> None:
    """The per-parameter steps in backward give the same weights, optimiser state, losses and grad
    norms as one AdamW step after backward (no clip), and leave no gradient behind."""
    a, b = _model(), _model()
    ra, opt_a = _run_steps(a, in_backward=False)
    rb, opt_b = _run_steps(b, in_backward=True)
    torch.testing.assert_close([r.loss for r in rb], [r.loss for r in ra], rtol=1e-6, atol=0)
    torch.testing.assert_close([r.grad_norm for r in rb], [r.grad_norm for r in ra], rtol=1e-5, atol=0)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pb, pa, rtol=1e-6, atol=1e-7)
        assert pb.grad is None
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for k in sa["state"]:
        assert float(sb["state"][k]["step"]) == float(sa["state"][k]["step"]) == 5
        torch.testing.assert_close(sb["state"][k]["exp_avg_sq"], sa["state"][k]["exp_avg_sq"])


def test_optimizer_in_backward_skips_a_non_finite_step() -> None:
    """A NaN loss reaches no weight and no optimiser state, as without the option; the step after it
    trains again."""
    model = _model()
    results, opt = _run_steps(model, in_backward=True, steps=3, poison_at=2)
    assert [r.finite for r in results] == [True, True, False]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert {float(s["step"]) for s in opt.state.values()} == {2.0}


def _ddp_trace(rank: int, world: int, bucketing: BucketingConfig) -> list[float]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_replicate",))
    model = apply_ddp(_model(), mesh, bucketing, bucketing.bucket_cap_mb)
    return _trace(model, rank, world, micro=1)


@pytest.mark.parametrize(
    "world, bucketing",
    [
        (2, BucketingConfig(bucket_cap_mb=25.0)),
        (2, BucketingConfig(bucket_cap_mb=0.01, gradient_as_bucket_view=False, static_graph=False)),
        (4, BucketingConfig(bucket_cap_mb=0.05)),
    ],
)
def test_ddp_reproduces_the_single_process_trace(world: int, bucketing: BucketingConfig) -> None:
    reference = _trace(_model(), 0, 1, micro=1)
    traces = run_ranks(_ddp_trace, world, bucketing)
    for trace in traces:
        # DDP averages gradients in a different order than one process sums them: not bitwise.
        torch.testing.assert_close(torch.tensor(trace), torch.tensor(reference), rtol=2e-5, atol=2e-5)
    assert reference[-1] < reference[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host buffers need CUDA")
def test_host_io_ring_copies_in_and_out() -> None:
    """More copies than slots: every staged batch arrives intact, every figure comes back."""
    cuda = torch.device("cuda")
    io = HostIO(cuda, slots=2)
    torch.cuda._sleep(100_000_000)  # keep the stream busy: the ring grows instead of waiting
    staged = [io.to_device(torch.full((3, 4), i, dtype=torch.long)) for i in range(6)]
    assert len(io._rings[("in", (3, 4), torch.long)]) > 2
    for i, dev in enumerate(staged):
        assert dev.device.type == "cuda" and torch.equal(dev.cpu(), torch.full((3, 4), i))
    for i in range(5):
        x = torch.full((3, 4), i, dtype=torch.long)
        dev = io.to_device(x)
        assert dev.device.type == "cuda" and torch.equal(dev.cpu(), x)
        host, ready = io.to_host(torch.tensor([float(i), 2.0 * i], device=cuda))
        assert ready is not None
        ready.synchronize()
        assert host.tolist() == [float(i), 2.0 * i]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the updates' own stream is CUDA only")
def test_optimizer_in_backward_side_stream_matches_the_plain_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the per-parameter updates run on their own stream: same weights as the plain step."""
    import framework.loop as loop_mod

    cuda = torch.device("cuda")
    results = []
    for side in (False, True):
        monkeypatch.setattr(loop_mod, "OPTIMIZER_SIDE_STREAM", side)
        model = build_model(MODEL, TRAIN.seq_len)
        materialize(model, cuda, seed=0)
        opt = build_optimizer(model, TRAIN, cuda)
        ib = attach_in_backward(opt)
        assert (ib.stream is not None) == side
        sched = build_scheduler(opt, TRAIN)
        sampler = BatchSampler(TOKENS, 256, TRAIN.seq_len, 4, 4, 0, 1, seed=5)
        losses = [train_step(model, opt, sched, sampler.next_batch(), 0.0, cuda, ib).loss for _ in range(4)]
        results.append((losses, [q.detach().clone() for q in model.parameters()]))
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1], strict=True):
        assert torch.equal(a, b)
