"""verify group, single process: policy, baseline store and regression, ladder, breaker, bad steps,
reference graph check, numerics (incl. a deliberately wrong compiler backend), state carry-over,
NaN injection, report files and the compare command."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

from framework.config.schema import (
    Config,
    ExecutorConfig,
    ExecutorMode,
    Float8Recipe,
    FreezeConfig,
    FreezeMode,
    ModelConfig,
    Policy,
    TrainConfig,
    VerifyConfig,
)
from framework.freeze import freeze
from framework.models import build_model, materialize
from framework.parallel.compile import apply_compile
from framework.planner.layout import Degrees
from framework.train.faults import poison_logits
from framework.train.loop import train_step
from framework.train.optimizers import build_optimizer, build_scheduler
from framework.verify import (
    BadStepTracker,
    CheckResult,
    CircuitBreaker,
    FallbackEvent,
    PerfFigures,
    StepAction,
    VerificationError,
    VerificationReport,
    apply_policy,
    baseline_key,
    carry_state,
    check_numerics,
    check_reference,
    compare_perf,
    next_mode,
    perf_figures,
    save_baseline,
    write_report,
)
from framework.verify.baseline import load_baseline, percentile
from framework.verify.compare import compare_runs
from framework.verify.consistency import meta_example, resolve_reference
from framework.verify.fallback import Ladder
from framework.verify.numerics import reference_model

ROOT = Path(__file__).resolve().parents[2]
SMALL = ModelConfig(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=64)
SEQ = 16
CPU = torch.device("cpu")


def _batch(cfg: ModelConfig = SMALL, n: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.randint(0, cfg.vocab_size, (n, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return t[:, :-1], t[:, 1:]


def _model(cfg: ModelConfig = SMALL) -> torch.nn.Module:
    m = build_model(cfg, SEQ)
    materialize(m, CPU, 0)
    return m


# -- policy ---------------------------------------------------------------------------------------


def test_policy_warn_fail_and_fallback_downgrade() -> None:
    ok = CheckResult("x", True)
    assert apply_policy(ok, Policy.fail, True) is None
    with pytest.warns(UserWarning, match="check 'x' failed: boom"):
        assert apply_policy(CheckResult("x", False, "boom"), Policy.warn, True) is Policy.warn
    with pytest.raises(VerificationError, match="boom"):
        apply_policy(CheckResult("x", False, "boom"), Policy.fail, True)
    bad = CheckResult("x", False, "boom")
    with pytest.warns(UserWarning):
        assert apply_policy(bad, Policy.fallback, True) is Policy.fallback
    on_eager = CheckResult("x", False, "boom")
    with pytest.warns(UserWarning, match="last rung"):
        assert apply_policy(on_eager, Policy.fallback, can_fall_back=False) is Policy.warn
    assert on_eager.action == "warn"


# -- baseline -------------------------------------------------------------------------------------


def test_percentile_nearest_rank() -> None:
    xs = [float(i) for i in range(1, 101)]
    assert percentile(xs, 50) == 50.0 and percentile(xs, 99) == 99.0 and percentile([3.0, 1.0], 99) == 3.0
    fig = perf_figures([0.1] * 9 + [0.5], tokens_per_step=1000, mfu=None, peak_mem_gib=None)
    assert fig is not None and fig.step_p50_s == 0.1 and fig.step_p99_s == 0.5
    assert fig.tokens_per_s == pytest.approx(10_000 / 1.4)
    assert perf_figures([], 1000, None, None) is None


def test_impossible_baseline_regresses_honest_one_passes(tmp_path: Path) -> None:
    cfg = Config()
    vcfg = VerifyConfig(enabled=True, baseline=str(tmp_path / "b.json"))
    key = baseline_key(cfg.model.name, cfg.mesh.shape, Degrees(), 1, "cpu-x", cfg.executor.mode)
    assert key == "llama_tiny|mesh=1|single|eager|cpu-x|world=1"
    run = PerfFigures(step_p50_s=0.10, step_p99_s=0.12, tokens_per_s=5000.0, peak_mem_gib=2.0)
    save_baseline(Path(vcfg.baseline), key, run, {"run_dir": "r"})
    save_baseline(Path(vcfg.baseline), "other", run, {})  # other keys are kept
    assert load_baseline(Path(vcfg.baseline), key) == run
    assert set(json.loads(Path(vcfg.baseline).read_text())["baselines"]) == {key, "other"}

    assert compare_perf(run, load_baseline(Path(vcfg.baseline), key), vcfg).passed is True
    # Within thresholds: 5% slower, p99 +10%, memory +5%.
    near = PerfFigures(0.105, 0.132, 4750.0, peak_mem_gib=2.1)
    assert compare_perf(near, run, vcfg).passed is True
    impossible = PerfFigures(step_p50_s=1e-6, step_p99_s=1e-6, tokens_per_s=1e12, peak_mem_gib=0.01)
    res = compare_perf(run, impossible, vcfg)
    assert res.passed is False
    assert "tokens/s" in res.detail and "p99" in res.detail and "peak memory" in res.detail
    with pytest.raises(VerificationError, match="performance"):
        apply_policy(res, Policy.fail, True)
    assert compare_perf(run, None, vcfg).passed is None


def test_bad_store_is_a_value_error(tmp_path: Path) -> None:
    p = tmp_path / "b.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match="verify.baseline"):
        load_baseline(p, "k")


# -- ladder, breaker, bad steps -------------------------------------------------------------------


def test_ladder() -> None:
    assert next_mode(ExecutorMode.cudagraphs) is ExecutorMode.compile
    assert next_mode(ExecutorMode.compile) is ExecutorMode.eager
    assert next_mode(ExecutorMode.eager) is None


def test_circuit_breaker_needs_patience_consecutive_slow_windows() -> None:
    b = CircuitBreaker(factor=2.0, window=3, patience=2, reference_p99_s=0.1)
    fast, slow = [0.1] * 3, [0.1, 0.1, 0.5]
    assert not any(b.observe(s) for s in slow)  # one slow window: a strike, no trip
    assert not any(b.observe(s) for s in fast)  # a good window resets the strikes
    assert not any(b.observe(s) for s in slow)
    trips = [b.observe(s) for s in slow]
    assert trips == [False, False, True]
    # Without a baseline the first window is the reference.
    b = CircuitBreaker(factor=2.0, window=2, patience=1)
    assert [b.observe(s) for s in (0.1, 0.1, 0.3, 0.3)] == [False, False, False, True]
    with pytest.raises(ValueError, match="factor"):
        CircuitBreaker(factor=0.5, window=1, patience=1)


def test_bad_step_tracker() -> None:
    t = BadStepTracker(3)
    seq = [t.observe(f) for f in (False, False, True, False, False, False, False)]
    assert seq == [
        StepAction.skip,
        StepAction.skip,
        StepAction.ok,
        StepAction.skip,
        StepAction.skip,
        StepAction.rollback,
        StepAction.skip,
    ]
    assert t.total == 6
    with pytest.raises(ValueError, match="max_bad_steps"):
        BadStepTracker(0)


# -- reference graph check ------------------------------------------------------------------------


def _frozen(cfg: ModelConfig, out: Path | None):
    return freeze(
        build_model(cfg, SEQ),
        meta_example(2, SEQ),
        FreezeConfig(mode=FreezeMode.export, check_graph_breaks=False),
        out,
    )


def test_reference_graph_diff_and_policy(tmp_path: Path) -> None:
    ref_run = tmp_path / "ref_run"
    ref_run.mkdir()
    pinned = _frozen(SMALL, ref_run)
    assert resolve_reference(str(ref_run)) == ref_run / "frozen" / "fingerprint.json"
    same = check_reference(pinned.fingerprint, pinned.summary, str(ref_run))
    assert same.passed is True
    changed = _frozen(ModelConfig(**{**SMALL.__dict__, "n_layers": 3}), None)
    diff = check_reference(changed.fingerprint, changed.summary, str(ref_run / "frozen" / "fingerprint.json"))
    assert diff.passed is False
    assert "first differing node" in diff.detail and "aten::linear" in diff.detail
    with pytest.raises(VerificationError, match="graph differs"):
        apply_policy(diff, Policy.fail, True)
    with pytest.raises(ValueError, match="verify.reference"):
        resolve_reference(str(tmp_path / "nope"))


# -- numerics -------------------------------------------------------------------------------------


def _wrong_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    """A 'compiler' that miscompiles: every block's output is off by 5%."""

    def run(*args: object) -> object:
        out = gm(*args)
        return type(out)(
            o * 1.05 if isinstance(o, torch.Tensor) and o.is_floating_point() else o for o in out
        )

    return run


def test_numerics_compiled_matches_eager_and_unsharded_reference() -> None:
    model = _model()
    apply_compile(model, ExecutorConfig(mode=ExecutorMode.compile, backend="aot_eager"), CPU)
    ref = lambda: reference_model(build_model(SMALL, SEQ), 0, CPU)  # noqa: E731
    res = check_numerics(model, _batch(), CPU, 1e-5, compiled=True, make_reference=ref)
    assert res.passed is True, res
    assert (
        res.figures["loss_rel_diff_vs_eager"] <= 1e-5 and res.figures["logits_rel_diff_vs_unsharded"] <= 1e-5
    )


def test_numerics_catches_a_miscompiling_backend() -> None:
    model = _model()
    for block in model.layers.values():
        block.forward = torch.compile(block.forward, backend=_wrong_backend, fullgraph=True)
    res = check_numerics(model, _batch(), CPU, 1e-4, compiled=True, make_reference=None, logits_rtol=1e-3)
    assert res.passed is False and "logits differs from eager" in res.detail, res
    # The loss alone is blind to it at initialisation (it sits near ln(vocab)): the reason for the logits probe.
    assert res.figures["loss_rel_diff_vs_eager"] < 1e-4 < res.figures["logits_rel_diff_vs_eager"]
    with pytest.warns(UserWarning):
        assert apply_policy(res, Policy.fallback, True) is Policy.fallback


def test_numerics_catches_a_model_that_differs_from_the_reference() -> None:
    model = _model()
    with torch.no_grad():
        model.layers["0"].feed_forward.w2.weight.mul_(3.0)  # a "sharding bug": wrong weights
    ref = lambda: reference_model(build_model(SMALL, SEQ), 0, CPU)  # noqa: E731
    res = check_numerics(model, _batch(), CPU, 1e-4, compiled=False, make_reference=ref)
    assert res.passed is False and "logits differs from the unsharded eager model" in res.detail, res
    assert res.figures["loss_eager"] is None


# -- state carry-over and NaN injection -----------------------------------------------------------


def test_carry_state_moves_weights_and_optimizer_to_a_rebuilt_model() -> None:
    tcfg = TrainConfig(steps=4, warmup_steps=0, lr=1e-2)
    src = _model()
    apply_compile(src, ExecutorConfig(mode=ExecutorMode.compile, backend="aot_eager"), CPU)
    opt = build_optimizer(src, tcfg, CPU)
    sched = build_scheduler(opt, tcfg)
    for _ in range(2):
        train_step(src, opt, sched, [_batch()], 1.0, CPU)
    dst = _model()  # eager, fresh init
    dst_opt = build_optimizer(dst, tcfg, CPU)
    carry_state(src, opt, dst, dst_opt)
    for (n, a), b in zip(src.named_parameters(), dst.parameters(), strict=True):
        assert torch.equal(a, b), n
    sa, sb = opt.state_dict()["state"], dst_opt.state_dict()["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"]) for k in sa)
    # Both continue identically (compiled vs eager within fp tolerance).
    ra = train_step(src, opt, sched, [_batch()], 1.0, CPU)
    rb = train_step(dst, dst_opt, build_scheduler(dst_opt, tcfg), [_batch()], 1.0, CPU)
    assert ra.loss == pytest.approx(rb.loss, rel=1e-5)


def test_carry_state_from_an_optimizer_that_never_stepped_carries_no_state() -> None:
    """A fallback in the first step carries an optimizer that has not stepped: DCP's state-dict
    read would allocate its moments with a zero-lr step (AdamW's step counter at 1, the step hooks
    run), and the rebuilt model's first update would then differ from a fresh one's."""
    tcfg = TrainConfig(steps=4, warmup_steps=2, lr=1e-2)
    src, dst, fresh = _model(), _model(), _model()
    opts = [build_optimizer(m, tcfg, CPU) for m in (src, dst, fresh)]
    scheds = [build_scheduler(o, tcfg) for o in opts]
    hooked: list[object] = []
    opts[0].register_step_post_hook(lambda *_: hooked.append(1))  # as the MoE bias update is
    carry_state(src, opts[0], dst, opts[1])
    assert not opts[0].state and not opts[1].state and not hooked
    assert [g["lr"] for g in opts[1].param_groups] == [g["lr"] for g in opts[0].param_groups]
    for m, o, s in ((dst, opts[1], scheds[1]), (fresh, opts[2], scheds[2])):
        for _ in range(2):
            train_step(m, o, s, [_batch()], 1.0, CPU)
    for (n, a), b in zip(dst.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b), n


class _Rungs:
    """``Rungs`` over one small model (no rebuild: the guard's own logic is under test)."""

    def __init__(self) -> None:
        self.model = _model()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.float8, self.device = Float8Recipe.none, CPU
        self._mode, self.undone = ExecutorMode.compile, 0
        self.builds: list[tuple[ExecutorMode | None, bool]] = []

    @property
    def mode(self) -> ExecutorMode:
        return self._mode

    def build(self, mode: ExecutorMode | None = None, float8: object = None, carry: bool = False) -> None:
        self.builds.append((mode, carry))
        self._mode = mode or self._mode

    def snapshot(self) -> Callable[[], None]:
        rng = torch.get_rng_state()

        def undo() -> None:
            torch.set_rng_state(rng)
            self.undone += 1

        return undo


def test_guard_reruns_the_first_step_from_the_state_before_it() -> None:
    """A first step that fails after its forward drew from the RNG (dropout) falls back with the RNG
    as it was; the second try (eager here) draws what an unbroken eager run draws."""
    rungs, records = _Rungs(), []
    ladder = Ladder(rungs, lambda *r: records.append(r), on=True)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)

    def attempt() -> torch.Tensor:
        drawn = torch.rand(3)
        if rungs.mode is ExecutorMode.compile:
            raise RuntimeError("backend failed")
        return drawn

    assert torch.equal(ladder.guard(attempt), expected)
    assert rungs.builds == [(ExecutorMode.eager, True)] and rungs.undone == 1
    assert records == [
        (0, "compile_error", "executor compile -> eager", "rank 0: RuntimeError: backend failed")
    ]


def test_guard_refuses_to_fall_back_once_an_optimizer_stepped() -> None:
    """An error after an optimizer step (under optimizer_in_backward, in backward) cannot be undone:
    no fallback, and the error names why."""
    rungs = _Rungs()
    ladder = Ladder(rungs, lambda *r: None, on=True)

    def attempt() -> None:
        rungs.optimizer.step()
        raise RuntimeError("late failure")

    with pytest.raises(RuntimeError, match="after its optimizer had stepped .*late failure"):
        ladder.guard(attempt)
    assert rungs.builds == [] and rungs.undone == 0


def test_guard_makes_a_backward_compile_error_come_before_any_gradient() -> None:
    """torch compiles a region's backward lazily, at the first backward: there a compile error would
    come after the later regions' gradients (and, under optimizer_in_backward, their updates). Under
    the guard the backward is lowered with the forward, so the step fails before any gradient."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    def fw(gm: torch.fx.GraphModule, _inputs: object) -> Callable[..., object]:
        return make_boxed_func(gm.forward)

    def bw(gm: torch.fx.GraphModule, _inputs: object) -> Callable[..., object]:
        raise RuntimeError("backward fails to compile")

    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    backend = aot_autograd(fw_compiler=fw, bw_compiler=bw)
    rungs, left = _Rungs(), []

    def attempt() -> None:
        if rungs.mode is ExecutorMode.eager:  # the retry: what the failed try left behind
            left.extend(p.grad for p in (*first.parameters(), *second.parameters()))
            forward = first.forward
        else:
            forward = torch.compile(first.forward, backend=backend)
        second(forward(torch.ones(2, 4))).sum().backward()

    torch._dynamo.reset()
    try:
        rungs._mode = ExecutorMode.compile
        with pytest.raises(Exception, match="backward fails to compile"):  # unguarded: in backward
            attempt()
        assert second.weight.grad is not None
        first.zero_grad(set_to_none=True)
        second.zero_grad(set_to_none=True)
        torch._dynamo.reset()  # compile again, under the guard
        Ladder(rungs, lambda *r: None, on=True).guard(attempt)
    finally:
        torch._dynamo.reset()
    assert rungs.builds == [(ExecutorMode.eager, True)] and left == [None] * 4


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_poisoned_logits_make_a_real_non_finite_step() -> None:
    """Fault injection's NaN hook (verify.inject_nan_steps, framework.train.faults): while active, the
    step is non-finite through the real code path and skipped; inactive, it trains."""
    tcfg = TrainConfig(steps=4, warmup_steps=0)
    model = _model()
    opt = build_optimizer(model, tcfg, CPU)
    sched = build_scheduler(opt, tcfg)
    before = [p.detach().clone() for p in model.parameters()]
    active = [True]
    handles = poison_logits(model, lambda: active[0])
    res = train_step(model, opt, sched, [_batch()], 1.0, CPU)
    assert not res.finite
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # step skipped
    active[0] = False
    assert train_step(model, opt, sched, [_batch()], 1.0, CPU).finite
    for h in handles:
        h.remove()
    assert not model._forward_hooks


# -- report and compare ---------------------------------------------------------------------------


def test_report_files(tmp_path: Path) -> None:
    rep = VerificationReport("warn")
    rep.add(CheckResult("graph (cross-rank)", True, figures={"fingerprint": "ab" * 32, "world_size": 2}))
    rep.add(CheckResult("numerics", False, "executed loss differs", {"rel_diff_vs_eager": 0.01}, "warn"))
    rep.add(CheckResult("performance", None, "no baseline"))
    rep.fallbacks.append(FallbackEvent(0, "compile_error", "executor compile -> eager", "InvalidBackend"))
    js, md = write_report(tmp_path, rep)
    doc = json.loads(js.read_text())
    assert doc["passed"] is False and [c["verdict"] for c in doc["checks"]] == [
        "pass",
        "FAIL (warn)",
        "skipped",
    ]
    assert doc["fallbacks"][0]["trigger"] == "compile_error"
    text = md.read_text()
    assert "| numerics | FAIL (warn) | rel_diff_vs_eager=0.01 |" in text
    assert "step 0: **compile_error**: executor compile -> eager" in text
    assert FallbackEvent(3, "bad_steps", "rollback to step 2").row()["event"] == "fallback/bad_steps"


def _fake_run(d: Path, lr: float, losses: list[float], tps: float) -> Path:
    d.mkdir()
    (d / "config.yaml").write_text(yaml.safe_dump({"train": {"lr": lr, "steps": 4}, "model": {"name": "m"}}))
    rows = [{"step": i + 1, "loss": v} for i, v in enumerate(losses)] + [{"step": 4, "event": "x"}]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "summary.json").write_text(json.dumps({"tokens_per_s": tps, "steps": 4}))
    return d


def test_compare_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _fake_run(tmp_path / "a", 1e-3, [5.0, 4.0, 3.0, 2.5], 1000.0)
    b = _fake_run(tmp_path / "b", 2e-3, [5.0, 3.5, 3.2, 2.0], 1500.0)
    text = compare_runs(a, b)
    assert "| train.lr | 0.001 | 0.002 |" in text
    assert "- max_abs_diff: 0.5" in text and "- final_b: 2" in text and "- min_a: 2.5" in text
    assert "| tokens_per_s | 1000 | 1500 | 1.500 |" in text
    assert "not recorded" in text
    from framework.launch.verify_cli import main  # python -m framework verify, in this process

    assert main(["compare", str(a), str(tmp_path)]) == 2 and "not a run dir" in capsys.readouterr().err


def test_compare_out_never_replaces_a_file_compare_did_not_write_unless_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``compare A B --out A/config.yaml`` replaced that run's config with the report."""
    from framework.launch.verify_cli import main

    a = _fake_run(tmp_path / "a", 1e-3, [5.0, 4.0], 1000.0)
    b = _fake_run(tmp_path / "b", 2e-3, [5.0, 3.5], 1500.0)
    config = (a / "config.yaml").read_text()
    assert main(["compare", str(a), str(b), "--out", str(a / "config.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exists and is not a report compare wrote" in err[0], err
    assert (a / "config.yaml").read_text() == config
    report = tmp_path / "compare.md"
    assert main(["compare", str(a), str(b), "--out", str(report)]) == 0
    assert main(["compare", str(b), str(a), "--out", str(report)]) == 0  # its own report: replaced
    assert report.read_text() == compare_runs(b, a)
    expected = compare_runs(a, b)
    assert main(["compare", str(a), str(b), "--out", str(a / "config.yaml"), "--force"]) == 0
    assert (a / "config.yaml").read_text() == expected


def test_shipped_verify_configs_compose() -> None:
    from omegaconf import OmegaConf

    for path in sorted((ROOT / "conf" / "verify").glob("*.yaml")):
        merged = OmegaConf.merge(OmegaConf.structured(VerifyConfig), OmegaConf.load(path))
        assert isinstance(OmegaConf.to_object(merged), VerifyConfig), path


def test_a_compile_error_record_names_its_cause() -> None:
    """Dynamo's first line only says that the backend raised; the record carries the cause's line."""
    from framework.verify.fallback import _first_line

    wrapped = RuntimeError("backend='inductor' raised:\n\nAssertionError: a shape disagrees\n\nSet TORCH_LOGS=...")
    assert _first_line(wrapped) == "RuntimeError: backend='inductor' raised: AssertionError: a shape disagrees"
    assert _first_line(ValueError("plain line\nmore")) == "ValueError: plain line"
    assert _first_line(KeyError()) == "KeyError: "
