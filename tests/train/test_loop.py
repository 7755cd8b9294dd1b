"""The training step on its own: schedule, accumulation, and DDP against a single process."""

import numpy as np
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from framework.config.schema import (
    BucketingConfig,
    LRSchedulerConfig,
    LRSchedulerName,
    ModelConfig,
    OptimizerConfig,
    OptimizerName,
    TrainConfig,
)
from framework.data import BatchSampler
from framework.models import build_model, materialize
from framework.parallel.data_parallel import apply_ddp
from framework.parallel.step import HostIO
from framework.train.loop import attach_in_backward, pick_step, plain_step, train_step
from framework.train.optimizers import OWN_CLASS, Combined, build_optimizer, build_scheduler, lr_lambda
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


def _run_steps(model, in_backward: bool, steps: int = 5, poison_at: int = -1, check_grads: bool = True):
    """``steps`` unclipped steps on one batch each, with or without the optimiser in backward; the
    loss of step ``poison_at`` is made NaN."""
    opt = build_optimizer(model, TRAIN, CPU)
    sched = build_scheduler(opt, TRAIN)
    ib = attach_in_backward(opt, check_grads) if in_backward else None
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


def test_optimizer_in_backward_without_grad_checks_updates_the_same() -> None:
    """train.in_backward_grad_checks=false: the same weights as with the checks (finite gradients), no
    gradient norm measured, and a NaN loss still skips its step."""
    a, b = _model(), _model()
    ra, _ = _run_steps(a, in_backward=True)
    rb, opt = _run_steps(b, in_backward=True, check_grads=False)
    torch.testing.assert_close([r.loss for r in rb], [r.loss for r in ra], rtol=0, atol=0)
    assert all(r.grad_norm == 0.0 for r in rb) and all(r.grad_norm > 0 for r in ra)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    c = _model()
    results, opt = _run_steps(c, in_backward=True, steps=3, poison_at=2, check_grads=False)
    assert [r.finite for r in results] == [True, True, False]
    assert all(torch.isfinite(p).all() for p in c.parameters())
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
    import framework.train.loop as loop_mod

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


# ---------------------------------------------------------------------------------------------
# The optimizer and lr_scheduler groups (framework.config.schema.OptimizerConfig, LRSchedulerConfig).
# ---------------------------------------------------------------------------------------------

FIXED = TrainConfig(steps=12, global_batch_size=8, seq_len=16, lr=1e-2, warmup_steps=2, grad_clip=1.0)


def _fixed_batches(n: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    ramp = torch.arange(256).repeat(4)
    out = []
    for _ in range(n):
        starts = torch.randint(0, 256, (8,), generator=g)
        seq = torch.stack([ramp[s : s + 17] for s in starts])
        out.append([(seq[:, :-1], seq[:, 1:])])
    return out


def _optimizer_cfg(name: str, **fields) -> OptimizerConfig:
    return OptimizerConfig(name=OptimizerName(name), _target_=OWN_CLASS[OptimizerName(name)], **fields)


@pytest.mark.parametrize(
    "opt",
    [
        _optimizer_cfg("adamw"),
        _optimizer_cfg("adam"),
        _optimizer_cfg("sgd", momentum=0.9, nesterov=True),
        _optimizer_cfg("muon", momentum=0.95, nesterov=True),
        OptimizerConfig(_target_="torch.optim.NAdam", kwargs={"betas": [0.9, 0.95]}),
    ],
    ids=["adamw", "adam", "sgd", "muon", "nadam"],
)
def test_each_optimizer_lowers_the_loss(opt: OptimizerConfig) -> None:
    model = _model()
    lr = 0.3 if opt.name is OptimizerName.sgd else FIXED.lr
    tcfg = TrainConfig(**{**FIXED.__dict__, "lr": lr})
    optimizer = build_optimizer(model, tcfg, CPU, opt)
    sched = build_scheduler(optimizer, tcfg)
    batch = _fixed_batches(1)[0]
    losses = [train_step(model, optimizer, sched, batch, 1.0, CPU).loss for _ in range(12)]
    assert losses[-1] < 0.8 * losses[0], losses


def test_default_optimizer_is_adamw_with_the_old_groups() -> None:
    model = _model()
    opt = build_optimizer(model, FIXED, CPU, OptimizerConfig())
    assert type(opt) is torch.optim.AdamW and opt.defaults["betas"] == (0.9, 0.95)
    decay, no_decay = opt.param_groups
    assert all(p.ndim >= 2 for p in decay["params"]) and all(p.ndim < 2 for p in no_decay["params"])
    assert decay["weight_decay"] == FIXED.weight_decay and no_decay["weight_decay"] == 0.0


def test_optimizer_kwargs_override_the_options_own_arguments() -> None:
    """The schema says kwargs override the option's own: a kwargs betas under adamw did nothing."""
    model = _model()
    kw = {"betas": [0.5, 0.6], "eps": 1e-3}
    assert build_optimizer(model, FIXED, CPU, OptimizerConfig(kwargs=kw)).defaults["betas"] == (0.5, 0.6)
    sgd = build_optimizer(model, FIXED, CPU, _optimizer_cfg("sgd", kwargs={"momentum": 0.5}))
    assert sgd.defaults["momentum"] == 0.5 and sgd.defaults["lr"] == FIXED.lr
    muon = build_optimizer(model, FIXED, CPU, _optimizer_cfg("muon", kwargs={"ns_steps": 3})).parts[0]
    assert muon.defaults["ns_steps"] == 3


def test_muon_takes_the_block_matrices_and_adamw_the_rest() -> None:
    model = _model()
    opt = build_optimizer(model, FIXED, CPU, _optimizer_cfg("muon"))
    assert isinstance(opt, Combined)
    muon, adamw = opt.parts
    assert type(muon) is torch.optim.Muon and type(adamw) is torch.optim.AdamW
    names = {id(p): n for n, p in model.named_parameters()}
    on_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    assert on_muon == {n for n, p in model.named_parameters() if n.startswith("layers.") and p.ndim == 2}
    rest = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert "tok_embeddings.weight" in rest and "norm.weight" in rest and not rest & on_muon
    assert muon.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"


@pytest.mark.parametrize("name", ["muon", "sgd"])
def test_a_non_finite_step_leaves_every_optimizer_untouched(name: str) -> None:
    model = _model()
    opt = build_optimizer(model, FIXED, CPU, _optimizer_cfg(name))
    sched = build_scheduler(opt, FIXED)
    train_step(model, opt, sched, _fixed_batches(1)[0], 1.0, CPU)
    before = [p.detach().clone() for p in model.parameters()]
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    x = torch.zeros(2, 16, dtype=torch.long)
    with torch.no_grad():
        model.tok_embeddings.weight[0, 0] = float("nan")
    assert not train_step(model, opt, sched, [(x, x)], 1.0, CPU).finite
    for b, p in zip(before[1:], list(model.parameters())[1:], strict=True):
        assert torch.equal(b, p)
    for p, s in opt.state.items():
        assert all(torch.equal(v, state[id(p)][k]) for k, v in s.items())


def _muon_run(model, batches, opt=None, sched=None):
    opt = opt or build_optimizer(model, FIXED, CPU, _optimizer_cfg("muon", momentum=0.95, nesterov=True))
    sched = sched or build_scheduler(opt, FIXED, LRSchedulerConfig(name=LRSchedulerName.wsd))
    for b in batches:
        train_step(model, opt, sched, b, 1.0, CPU)
    return opt, sched


def test_muon_resumes_from_a_dcp_checkpoint_equal_to_an_unbroken_run(tmp_path) -> None:
    import torch.distributed.checkpoint as dcp

    from framework.checkpoint.state import apply_tensor_state, tensor_state

    batches = _fixed_batches(6)
    unbroken = _model()
    _muon_run(unbroken, batches)

    first = _model()
    opt, sched = _muon_run(first, batches[:3])
    payload, groups = tensor_state(first, opt)
    dcp.save(payload, checkpoint_id=str(tmp_path / "ck"))
    sched_state = sched.state_dict()

    resumed = _model()
    with torch.no_grad():
        for p in resumed.parameters():
            p.zero_()  # nothing carries over but the checkpoint
    opt2 = build_optimizer(resumed, FIXED, CPU, _optimizer_cfg("muon", momentum=0.95, nesterov=True))
    sched2 = build_scheduler(opt2, FIXED, LRSchedulerConfig(name=LRSchedulerName.wsd))
    target, _ = tensor_state(resumed, opt2)
    dcp.load(target, checkpoint_id=str(tmp_path / "ck"))
    apply_tensor_state(resumed, opt2, target, groups)
    sched2.load_state_dict(sched_state)
    assert "momentum_buffer" in opt2.parts[0].state[opt2.parts[0].param_groups[0]["params"][0]]
    _muon_run(resumed, batches[3:], opt2, sched2)
    for (name, a), b in zip(unbroken.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_muon_in_backward_matches_the_plain_step() -> None:
    tcfg = TrainConfig(**{**FIXED.__dict__, "grad_clip": 0.0})
    muon = _optimizer_cfg("muon")
    batches = _fixed_batches(3)
    plain, inb = _model(), _model()
    opt = build_optimizer(plain, tcfg, CPU, muon)
    sched = build_scheduler(opt, tcfg)
    opt_ib = build_optimizer(inb, tcfg, CPU, muon)
    sched_ib = build_scheduler(opt_ib, tcfg)
    ib = attach_in_backward(opt_ib)
    for b in batches:
        train_step(plain, opt, sched, b, 0.0, CPU)
        train_step(inb, opt_ib, sched_ib, b, 0.0, CPU, in_backward=ib)
    for a, b in zip(plain.parameters(), inb.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _old_cosine(cfg: TrainConfig, step: int) -> float:
    """The schedule as it was before lr_scheduler existed (the default must stay bitwise this)."""
    import math

    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@pytest.mark.parametrize("warmup", [0, 10])
def test_default_cosine_schedule_is_bitwise_the_old_one(warmup: int) -> None:
    cfg = TrainConfig(steps=100, warmup_steps=warmup, min_lr_ratio=0.1)
    f = lr_lambda(cfg, LRSchedulerConfig())
    assert [f(s) for s in range(120)] == [_old_cosine(cfg, s) for s in range(120)]


def test_linear_constant_and_wsd_schedules() -> None:
    cfg = TrainConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1)

    def sched(name: str, **kw):
        return lr_lambda(cfg, LRSchedulerConfig(name=LRSchedulerName(name), **kw))

    linear, constant, wsd = sched("linear"), sched("constant"), sched("wsd", decay_fraction=0.2)
    for f in (linear, constant, wsd):
        assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)  # the same warmup
    assert linear(10) == 1.0 and linear(55) == pytest.approx(0.55) and linear(100) == pytest.approx(0.1)
    assert {constant(s) for s in range(10, 200)} == {1.0}
    assert {wsd(s) for s in range(10, 81)} == {1.0}  # stable until the last 20% of the steps
    assert wsd(90) == pytest.approx(0.55) and wsd(99) == pytest.approx(0.145)
    assert wsd(100) == pytest.approx(0.1) and wsd(150) == pytest.approx(0.1)
    # decay_fraction=1: the decay starts right after warmup, i.e. the linear schedule
    assert [sched("wsd", decay_fraction=1.0)(s) for s in range(100)] == [linear(s) for s in range(100)]


def test_a_recipe_names_its_own_optimizer_class_on_the_command_line() -> None:
    """``optimizer._target_=torch.optim.NAdam`` through real Hydra composition, built via the allowlist."""
    from hydra import compose, initialize_config_dir

    from framework.config import schema as config
    from framework.launch import recipes
    from framework.launch.ranks import register_resolvers

    config.register()
    recipes.register()
    register_resolvers()
    with initialize_config_dir(config_dir=str(recipes.CONF_DIR), version_base="1.3"):
        dcfg = compose("config", overrides=["optimizer._target_=torch.optim.NAdam", "lr_scheduler=wsd"])
        default = config.to_config(compose("config"))
    cfg = config.to_config(dcfg)
    assert default.optimizer == OptimizerConfig() and default.lr_scheduler == LRSchedulerConfig()
    opt = build_optimizer(_model(), cfg.train, CPU, cfg.optimizer, cfg.run.instantiate_allow)
    assert type(opt) is torch.optim.NAdam and opt.defaults["lr"] == cfg.train.lr
    assert cfg.lr_scheduler.name is LRSchedulerName.wsd
    with pytest.raises(ValueError, match="optimizer._target_='os.system'"):
        build_optimizer(_model(), cfg.train, CPU, OptimizerConfig(_target_="os.system"), ["torch.optim."])


# The validation set and its loss on every layout: the default recipe (real Hydra, the launcher's
# checks and batch resolution), the same seed's weights, real gloo ranks.
EVAL_LAYOUTS = {
    "one process": [],
    "ddp": ["mesh='2'", "sharding=ddp"],
    "fsdp": ["mesh='2'", "sharding=fsdp"],
    "pp=2": ["mesh='2'", "parallel.pp=2", "parallel.pp_schedule=gpipe"],
    "interleaved": [
        "mesh='2'",
        "parallel.pp=2",
        "parallel.pp_schedule=interleaved_1f1b",
        "parallel.pp_stages_per_rank=2",
        "parallel.pp_microbatches=4",
    ],
}


def _layout_cfg(overrides: list[str], tmp_path) -> object:
    from hydra import compose, initialize_config_dir

    from framework.config import schema as config
    from framework.launch import recipes
    from framework.launch.prelaunch import prelaunch
    from framework.launch.ranks import register_resolvers

    config.register()
    recipes.register()
    register_resolvers()
    with initialize_config_dir(config_dir=str(recipes.CONF_DIR), version_base="1.3"):
        composed = compose("config", overrides=[*overrides, "train.eval_batches=2", "freeze=none"])
    cfg, _, _ = prelaunch(composed, tmp_path / "run", "llama_tiny")
    return cfg


def _evaluate_worker(rank: int, world: int, cfg: object) -> dict:
    """This rank's validation tokens and the loss ``evaluate`` reports, for freshly initialised weights."""
    from framework.config.run_values import batch_shape, data_run
    from framework.data import build_data
    from framework.parallel import build_mesh, dp_mesh_info, parallelize
    from framework.planner.resolve import make_plan
    from framework.train.loop import evaluate

    plan = make_plan(cfg)
    mesh = build_mesh(plan, "cpu")
    model = build_model(cfg.model, cfg.train.seq_len)
    model = parallelize(model, mesh, plan, cfg.sharding, cfg.bucketing, cfg.executor, CPU, cfg.train.seed)
    dp_rank, dp_size = dp_mesh_info(mesh, plan)
    data = build_data(data_run(cfg), batch_shape(cfg.train), dp_rank, dp_size)
    data.sampler.close()
    tokens = torch.cat(
        [x for x, _ in data.val_batches]
    ).numpy()  # by value: a tensor is passed by shared memory
    return {
        "dp_rank": dp_rank,
        "dp": dp_size,
        "micro": cfg.train.micro_batch_size,
        "tokens": tokens,
        "loss": evaluate(model, data.val_batches, CPU),
    }


def _whole_set(results: list[dict], eval_batches: int) -> torch.Tensor:
    """The validation rows in global order: global batch by global batch, each dp rank's share."""
    by_dp = {
        r["dp_rank"]: torch.from_numpy(r["tokens"]) for r in results
    }  # the ranks of one pipeline hold the same
    share = by_dp[0].shape[0] // eval_batches
    return torch.cat(
        [by_dp[d][b * share : (b + 1) * share] for b in range(eval_batches) for d in sorted(by_dp)]
    )


def test_every_layout_evaluates_the_same_tokens_to_the_same_loss(tmp_path) -> None:
    """One process, DDP, FSDP, pp=2 and an interleaved pipeline hold out the same windows and report
    the same validation loss for the same weights. Sized by the micro batch x the dp degree (as it
    was: 16, 8 x 2, 8 x 2, 8 and 4 rows per batch here), the pipelines evaluated fewer, other windows
    and the layouts disagreed (one process 1.8913, pp=2 1.8153, interleaved 1.7776 after the same
    200 steps). rtol 1e-5: the same fp32 losses, summed in another order over other micro batches."""
    seen = {}
    for name, overrides in EVAL_LAYOUTS.items():
        cfg = _layout_cfg(overrides, tmp_path / name.replace(" ", "_"))
        results = run_ranks(_evaluate_worker, cfg.mesh.world_size, cfg)
        assert len({r["loss"] for r in results}) == 1, (name, results)  # every rank reports one value
        seen[name] = (_whole_set(results, 2), results[0]["loss"], results[0]["micro"])
    tokens, loss, _ = seen["one process"]
    assert tokens.shape == (2 * 16, 128)  # 2 global batches of the recipe's 16 sequences
    assert {micro for _, _, micro in seen.values()} == {16, 8, 4}  # the layouts cut the batch differently
    for name, (other, value, micro) in seen.items():
        assert torch.equal(other, tokens), name
        assert value == pytest.approx(loss, rel=1e-5), (name, micro, value, loss)


def test_the_step_function_is_picked_once_and_steps_as_train_step() -> None:
    """``pick_step`` (what the runner calls once per build) binds the plain step, or the
    optimizer-in-backward step when hooks are attached; stepping through it is ``train_step``,
    bitwise."""
    batches = _fixed_batches(2)
    picked_model, called_model = _model(), _model()
    opt_a = build_optimizer(picked_model, TRAIN, CPU)
    sched_a = build_scheduler(opt_a, TRAIN)
    step = pick_step(picked_model, opt_a, sched_a, 1.0, CPU)
    assert step.func is plain_step  # type: ignore[attr-defined]
    opt_b = build_optimizer(called_model, TRAIN, CPU)
    sched_b = build_scheduler(opt_b, TRAIN)
    for b in batches:
        assert step(b).loss == train_step(called_model, opt_b, sched_b, b, 1.0, CPU).loss
    for a, b in zip(picked_model.parameters(), called_model.parameters(), strict=True):
        assert torch.equal(a, b)
    m = _model()
    opt = build_optimizer(m, TRAIN, CPU)
    in_backward = pick_step(m, opt, build_scheduler(opt, TRAIN), 0.0, CPU, attach_in_backward(opt))
    assert in_backward.func.__name__ == "_step_in_backward"  # type: ignore[attr-defined]
