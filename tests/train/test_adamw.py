"""framework.train.adamw: AdamW with bf16 moments (``optimizer.state_dtype=bfloat16``) against torch's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from framework.config.schema import Config, DType, ModelConfig, OptimizerConfig, TrainConfig
from framework.models import build_model, materialize
from framework.train.adamw import AdamW, _compiled, _update
from framework.train.loop import attach_in_backward, train_step
from framework.train.optimizers import build_optimizer, build_scheduler
from tests.train.test_loop import _fixed_batches

CPU = torch.device("cpu")
MODEL = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256)
TRAIN = TrainConfig(steps=12, global_batch_size=8, micro_batch_size=8, seq_len=16, lr=2e-2, warmup_steps=2)
BF16 = OptimizerConfig(state_dtype=DType.bfloat16)


def _model() -> torch.nn.Module:
    m = build_model(MODEL, TRAIN.seq_len)
    materialize(m, CPU, seed=0)
    return m


def _pair(n: int = 6, **kw) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``n`` steps of torch.optim.AdamW and of this AdamW on the same tensors and gradients."""
    torch.manual_seed(0)
    shapes = [(48, 32), (32,), (7, 5, 3)]
    a = [torch.randn(s, requires_grad=True) for s in shapes]
    b = [t.detach().clone().requires_grad_() for t in a]
    ref = torch.optim.AdamW(a, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    ours = AdamW(b, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, **kw)
    for _ in range(n):
        for x, y in zip(a, b, strict=True):
            x.grad = torch.randn_like(x)
            y.grad = x.grad.clone()
        ref.step()
        ours.step()
    return a, b, ours


def test_fp32_moments_give_torchs_adamw() -> None:
    """With fp32 moments the update is torch.optim.AdamW's (the same formula, rounding apart)."""
    a, b, _ = _pair(state_dtype="float32")
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(y, x, rtol=1e-6, atol=1e-6)


def test_bf16_moments_stay_bf16_and_the_weights_fp32() -> None:
    a, b, ours = _pair(state_dtype="bfloat16")
    for x, y in zip(a, b, strict=True):
        state = ours.state[y]
        assert y.dtype is torch.float32
        assert state["exp_avg"].dtype is state["exp_avg_sq"].dtype is torch.bfloat16
        assert float(state["step"]) == 6
        # bf16 moments round at ~3 significant digits; over 6 steps of lr 1e-2 the weights stay
        # within a small fraction of one step of torch's
        torch.testing.assert_close(y, x, rtol=0, atol=2e-3)
        assert not torch.equal(y, x)  # the moments' rounding is really there


def test_the_compiled_update_equals_the_eager_one_for_every_shape() -> None:
    """The CUDA path compiles ``_update`` once with symbolic lengths; here Inductor's CPU code of the
    same graph runs three lengths and a skipped step, against the eager function."""
    fn = _compiled()
    for n in (4096, 1000, 777):
        g = torch.Generator().manual_seed(n)
        p, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
        m = torch.randn(n, generator=g).to(torch.bfloat16)
        v = torch.rand(n, generator=g).to(torch.bfloat16)
        step = torch.tensor(3.0)
        args = (torch.full((), 1e-2), torch.zeros(()), 0.9, 0.95, 1e-8, 0.1)
        eager = [t.clone() for t in (p, m, v, step)]
        fn(p, grad, m, v, step, *args)
        _update(eager[0], grad, eager[1], eager[2], eager[3], *args)
        for got, want in zip((p, m, v, step), eager, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        assert float(step) == 4
        before = [t.clone() for t in (p, m, v, step)]
        fn(p, grad, m, v, step, torch.full((), 1e-2), torch.ones(()), 0.9, 0.95, 1e-8, 0.1)
        assert all(torch.equal(x, y) for x, y in zip((p, m, v, step), before, strict=True))


def test_found_inf_skips_the_update_and_its_count() -> None:
    p = torch.randn(8, 8, requires_grad=True)
    opt = AdamW([p], lr=1e-2, fused=True)
    p.grad = torch.randn_like(p)
    opt.step()
    before = p.detach().clone()
    state = {k: v.clone() for k, v in opt.state[p].items()}
    opt.found_inf = torch.ones(())
    opt.step()
    assert torch.equal(p, before) and all(torch.equal(v, state[k]) for k, v in opt.state[p].items())


def test_state_dtype_bfloat16_trains_and_halves_the_state() -> None:
    """Through build_optimizer: the loss falls about as with torch's AdamW, on half the state."""
    runs = {}
    for name, opt_cfg in (("fp32", OptimizerConfig()), ("bf16", BF16)):
        model = _model()
        opt = build_optimizer(model, TRAIN, CPU, opt_cfg)
        sched = build_scheduler(opt, TRAIN)
        batch = _fixed_batches(1)[0]  # one batch again and again: the loss must fall fast
        losses = [train_step(model, opt, sched, batch, 1.0, CPU).loss for _ in range(12)]
        state = sum(
            t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step"
        )
        runs[name] = (losses, state, opt)
    assert type(runs["fp32"][2]) is torch.optim.AdamW and type(runs["bf16"][2]) is AdamW
    assert runs["bf16"][1] * 2 == runs["fp32"][1]
    fp32, bf16 = runs["fp32"][0], runs["bf16"][0]
    assert bf16[-1] < 0.8 * bf16[0]
    assert abs(bf16[-1] - fp32[-1]) < 0.05 * fp32[-1], (fp32, bf16)


def test_bf16_moments_in_backward_match_the_plain_step() -> None:
    """optimizer-in-backward steps each parameter with a copy of the main optimizer that shares its
    state: the same weights and bf16 moments as one step after backward."""
    cfg = dataclasses.replace(TRAIN, grad_clip=0.0)
    plain, inb = _model(), _model()
    opt, opt_ib = build_optimizer(plain, cfg, CPU, BF16), build_optimizer(inb, cfg, CPU, BF16)
    sched, sched_ib = build_scheduler(opt, cfg), build_scheduler(opt_ib, cfg)
    ib = attach_in_backward(opt_ib)
    for b in _fixed_batches(3):
        train_step(plain, opt, sched, b, 0.0, CPU)
        train_step(inb, opt_ib, sched_ib, b, 0.0, CPU, in_backward=ib)
    for a, b in zip(plain.parameters(), inb.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
        assert opt_ib.state[b]["exp_avg"].dtype is torch.bfloat16 and float(opt_ib.state[b]["step"]) == 3


def _run(model, opt, sched, batches) -> None:
    for b in batches:
        train_step(model, opt, sched, b, 1.0, CPU)


def _resume(tmp_path, saved_with: OptimizerConfig, resumed_with: OptimizerConfig, batches):
    import torch.distributed.checkpoint as dcp

    from framework.checkpoint.state import apply_tensor_state, tensor_state

    first = _model()
    opt = build_optimizer(first, TRAIN, CPU, saved_with)
    sched = build_scheduler(opt, TRAIN)
    _run(first, opt, sched, batches[:3])
    payload, groups = tensor_state(first, opt)
    dcp.save(payload, checkpoint_id=str(tmp_path / "ck"))
    resumed = _model()
    with torch.no_grad():
        for p in resumed.parameters():
            p.zero_()  # nothing carries over but the checkpoint
    opt2 = build_optimizer(resumed, TRAIN, CPU, resumed_with)
    sched2 = build_scheduler(opt2, TRAIN)
    target, _ = tensor_state(resumed, opt2)
    dcp.load(target, checkpoint_id=str(tmp_path / "ck"))
    apply_tensor_state(resumed, opt2, target, groups)
    sched2.load_state_dict(sched.state_dict())
    return resumed, opt2, sched2


def test_bf16_moments_resume_from_dcp_bitwise(tmp_path) -> None:
    batches = _fixed_batches(6)
    unbroken = _model()
    opt = build_optimizer(unbroken, TRAIN, CPU, BF16)
    _run(unbroken, opt, build_scheduler(opt, TRAIN), batches)
    resumed, opt2, sched2 = _resume(tmp_path, BF16, BF16, batches)
    assert all(s["exp_avg_sq"].dtype is torch.bfloat16 for s in opt2.state.values())
    _run(resumed, opt2, sched2, batches[3:])
    for (name, a), b in zip(unbroken.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_fp32_moment_checkpoint_resumes_with_bf16_moments(tmp_path) -> None:
    """Switching optimizer.state_dtype on resume: the saved fp32 moments load, rounded to bf16."""
    resumed, opt2, sched2 = _resume(tmp_path, OptimizerConfig(), BF16, _fixed_batches(6))
    assert type(opt2) is AdamW
    for s in opt2.state.values():
        assert (
            s["exp_avg"].dtype is torch.bfloat16 and float(s["step"]) == 3 and s["exp_avg_sq"].abs().sum() > 0
        )
    _run(resumed, opt2, sched2, _fixed_batches(6)[3:])
    assert all(torch.isfinite(p).all() for p in resumed.parameters())


def test_the_planner_counts_half_the_state_and_less_traffic() -> None:
    from framework.planner.resolve import make_plan

    cfg = Config()
    base = make_plan(cfg)
    cfg.optimizer.state_dtype = DType.bfloat16
    half = make_plan(cfg)
    assert half.memory.optimizer * 2 == base.memory.optimizer
    assert half.memory.optimizer_state == "bf16" and base.memory.optimizer_state == "fp32"
    assert half.prediction.optimizer_s == pytest.approx(base.prediction.optimizer_s * 30 / 38)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled update runs on CUDA only")
def test_on_cuda_the_compiled_update_equals_the_eager_one() -> None:
    cuda = torch.device("cuda")
    g = torch.Generator(cuda).manual_seed(0)
    for n in (1 << 20, 4096 * 3 + 5):
        p, grad = (torch.randn(n, device=cuda, generator=g) for _ in range(2))
        m = torch.randn(n, device=cuda, generator=g).to(torch.bfloat16)
        v = torch.rand(n, device=cuda, generator=g).to(torch.bfloat16)
        step, lr, skip = (
            torch.tensor(3.0, device=cuda),
            torch.full((), 1e-2, device=cuda),
            torch.zeros((), device=cuda),
        )
        eager = [t.clone() for t in (p, m, v, step)]
        _compiled()(p, grad, m, v, step, lr, skip, 0.9, 0.95, 1e-8, 0.1)
        _update(eager[0], grad, eager[1], eager[2], eager[3], lr, skip, 0.9, 0.95, 1e-8, 0.1)
        torch.testing.assert_close(p, eager[0], rtol=1e-5, atol=1e-6)
        assert float(step) == float(eager[3]) == 4
        for got, want in ((m, eager[1]), (v, eager[2])):
            # Triton contracts the fp32 arithmetic into FMAs: a value that lands on a rounding
            # boundary goes to the neighbouring bf16 (measured on an H200: 9 of 1M elements)
            assert (got != want).float().mean() < 1e-4
            torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled update runs on CUDA only")
def test_on_cuda_in_backward_matches_the_plain_step() -> None:
    """Under optimizer-in-backward the compiled update runs in autograd's device thread on the side
    stream: three steps give the weights and bf16 moments of the plain step after backward."""
    cfg = dataclasses.replace(TRAIN, grad_clip=0.0)
    cuda = torch.device("cuda")
    runs = []
    for in_backward in (False, True):
        model = build_model(MODEL, TRAIN.seq_len)
        materialize(model, cuda, seed=0)
        opt = build_optimizer(model, cfg, cuda, BF16)
        sched = build_scheduler(opt, cfg)
        ib = attach_in_backward(opt) if in_backward else None
        for b in _fixed_batches(3):
            batch = [(x.to(cuda), y.to(cuda)) for x, y in b]
            train_step(model, opt, sched, batch, 0.0, cuda, in_backward=ib)
        torch.cuda.synchronize()
        runs.append((model, opt))
    (plain, opt_a), (inb, opt_b) = runs
    assert type(opt_b) is AdamW
    for a, b in zip(plain.parameters(), inb.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        sa, sb = opt_a.state[a], opt_b.state[b]
        assert sb["exp_avg"].dtype is torch.bfloat16 and float(sb["step"]) == float(sa["step"]) == 3
        torch.testing.assert_close(sb["exp_avg"], sa["exp_avg"], rtol=1e-2, atol=1e-5)


def _fsdp_weights(rank: int, world: int, strategy: str, shape: list[int]) -> dict[str, torch.Tensor]:
    """Four bf16-moment AdamW steps on ``world`` gloo ranks under ``strategy``: the full weights."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    from tests.parallel.test_parallel import GLOBAL_BATCH, batches, make_cfg, parallel_model

    model, _mesh, _plan = parallel_model(make_cfg(strategy, shape))
    opt = build_optimizer(model, TRAIN, CPU, BF16)
    n = GLOBAL_BATCH // world
    for batch in batches():
        x = batch[rank * n : (rank + 1) * n]
        logits = model(x[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
    moments = {type(s["exp_avg"]) for s in opt.state.values()}
    assert moments == ({DTensor} if strategy == "fsdp" and world > 1 else {torch.Tensor}), moments
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    return {k.removeprefix("module."): v.detach().clone() for k, v in full.items()}


def test_bf16_moments_under_fsdp_on_two_ranks_equal_one_process() -> None:
    """FSDP2 shards the weights and, through them, the moments (DTensors): each rank updates its
    shard elementwise, and the weights equal one process's. The reduce-scatter sums gradients in
    another order, so a moment that lands on a bf16 rounding boundary rounds the other way: a few
    elements move by a fraction of one step's lr; the rest agree to fp32 rounding."""
    from tests.dist import run_ranks

    one = run_ranks(_fsdp_weights, 1, "ddp", [1])[0]
    two = run_ranks(_fsdp_weights, 2, "fsdp", [2])
    for name, w in one.items():
        for r in two:
            torch.testing.assert_close(r[name], w, rtol=0, atol=0.05 * TRAIN.lr)
            assert ((r[name] - w).abs() > 1e-5).float().mean() < 0.01, name


def test_a_bf16_moment_checkpoint_resumes_with_fp32_moments(tmp_path) -> None:
    """Back to the default: torch's AdamW takes the saved bf16 moments (cast to fp32) and the saved
    groups, which lack its own keys (amsgrad, maximize, ...): it trains on."""
    resumed, opt2, sched2 = _resume(tmp_path, BF16, OptimizerConfig(), _fixed_batches(6))
    assert type(opt2) is torch.optim.AdamW
    for s in opt2.state.values():
        assert s["exp_avg"].dtype is torch.float32 and float(s["step"]) == 3
    _run(resumed, opt2, sched2, _fixed_batches(6)[3:])
    assert all(torch.isfinite(p).all() for p in resumed.parameters())
    assert {float(s["step"]) for s in opt2.state.values()} == {6.0}
