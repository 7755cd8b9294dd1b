"""The training step on its own: schedule, accumulation, and DDP against a single process."""

import numpy as np
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from framework.config import BucketingConfig, ModelConfig, TrainConfig
from framework.data import BatchSampler
from framework.loop import build_optimizer, build_scheduler, lr_lambda, train_step
from framework.model import build_model, materialize
from framework.parallel.data_parallel import apply_ddp
from tests.dist import run_ranks

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
