"""model.float8: the module filter, the refusals before launch, the module swap and its state dict,
the planner's memory term, and the non-finite fallback to bf16 (a real run on the CPU, where
torchao's float8 casts run emulated; train.py itself refuses float8 there)."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from framework.config.schema import Config, Float8GradDtype, Float8Recipe, ModelConfig
from framework.kernels import float8
from framework.kernels.target import MissingPackage
from framework.launch.prelaunch import check_float8
from framework.launch.rules import check_option_fields
from framework.models import build_model, linears, materialize
from framework.planner.resolve import make_plan
from framework.record.metrics import read_metrics
from tests.config.test_config import compose_config
from tests.entry import train_main
from tests.kernels.test_target import on

torchao = pytest.importorskip("torchao.float8", reason="torchao is the float8 extra (CI installs it)")

from framework.parallel.float8 import apply_float8, float8_config, is_float8  # noqa: E402

LLAMA1B = compose_config("recipe=llama1b").model


def block_names(m: ModelConfig) -> list[str]:
    return [s.fqn.removeprefix("layers.0.") for s in linears.converted(m) if s.fqn.startswith("layers.0.")]


def test_default_filter_skips_head_and_small_layers() -> None:
    tw = dataclasses.replace(LLAMA1B, float8=Float8Recipe.tensorwise)
    # wk/wv are (512, 2048): below tensorwise's threshold (K <= 4096 and N <= 1024); the head is skipped.
    assert block_names(tw) == [
        "attention.wq",
        "attention.wo",
        "feed_forward.w1",
        "feed_forward.w2",
        "feed_forward.w3",
    ]
    assert all(s.fqn != "output" for s in linears.converted(tw))
    every = dataclasses.replace(tw, float8_size_filter=False)
    assert len(block_names(every)) == 7
    rw = dataclasses.replace(LLAMA1B, float8=Float8Recipe.rowwise)
    assert block_names(rw) == ["feed_forward.w1", "feed_forward.w3"]
    # The override: a user list of names kept in bf16; dims that are not multiples of 16 never convert.
    assert block_names(dataclasses.replace(every, float8_skip=["output", "attention"])) == [
        "feed_forward.w1",
        "feed_forward.w2",
        "feed_forward.w3",
    ]
    assert not float8.converts(every, "layers.0.feed_forward.w1", 8200, 2048)
    assert not float8.converts(LLAMA1B, "layers.0.feed_forward.w1", 8192, 2048)  # float8=none


def test_shapes_float8_cannot_run_are_refused() -> None:
    small = ModelConfig(float8=Float8Recipe.rowwise)  # llama_tiny: every layer below the thresholds
    with pytest.raises(
        ValueError,
        match=r"model.float8=rowwise converts no Linear layer of llama_tiny.*float8_size_filter=false",
    ):
        linears.check_shapes(small)
    odd = ModelConfig(
        dim=512,
        n_heads=8,
        n_kv_heads=8,
        ffn_dim=1376,
        float8=Float8Recipe.tensorwise,
        float8_size_filter=False,
    )
    linears.check_shapes(odd, tp=2)  # 1376 / 2 = 688, a multiple of 16
    with pytest.raises(
        ValueError,
        match=r"sharding.tp=4: layers.0.feed_forward.w1's local weight shard is \(344, 512\).*e.g. \[1, 2\]",
    ):
        linears.check_shapes(odd, tp=4)
    with pytest.raises(ValueError, match="ties to the embedding"):
        linears.check_shapes(dataclasses.replace(odd, float8_skip=[]))


def test_device_refusals() -> None:
    with pytest.raises(
        ValueError,
        match=r"^model.float8=tensorwise needs a CUDA GPU .* this run uses cpu: use model.float8=none$",
    ):
        float8.check_device(Float8Recipe.tensorwise, "cpu", None, "cpu")
    with pytest.raises(ValueError, match=r"NVIDIA A100-SXM4-80GB is 8.0: use model.float8=none"):
        float8.check_device(Float8Recipe.rowwise, "cuda", (8, 0), "NVIDIA A100-SXM4-80GB")
    float8.check_device(Float8Recipe.tensorwise, "cuda", (9, 0), "NVIDIA H200")
    cfg = Config(model=ModelConfig(float8=Float8Recipe.tensorwise, float8_size_filter=False))
    with pytest.raises(ValueError, match="this run uses cpu"):
        check_float8(cfg, torch.device("cpu"), 1)


def test_dry_run_checks_the_declared_hardware(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On this CPU host: a dry run for an H100 profile is planned, for an A100 refused naming the
    profile and its capability, for the CPU profile refused as a launch here is; a dry run without
    torchao warns in one line, a launch refuses (MissingPackage)."""
    cpu = torch.device("cpu")
    cfg = compose_config("recipe=llama1b", "model.float8=tensorwise")
    check_float8(on(cfg, "h100_sxm"), cpu, 1)
    with pytest.raises(ValueError, match=r"; mesh.hardware.name=a100_80gb is 8.0: use model.float8=none$"):
        check_float8(on(cfg, "a100_80gb"), cpu, 1)
    for refused in (on(cfg, "cpu"), on(cfg, "h100_sxm", dry_run=False)):
        with pytest.raises(ValueError, match="this run uses cpu"):
            check_float8(refused, cpu, 1)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import torchao.float8 raises ImportError
    with pytest.raises(MissingPackage, match=r"needs torchao .*pip install"):
        float8.check_torchao(Float8Recipe.tensorwise)
    with caplog.at_level(logging.WARNING, logger="framework"):
        check_float8(on(cfg, "h100_sxm"), cpu, 1)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and warnings[0].startswith("dry run: model.float8=tensorwise needs torchao")


def test_train_py_refuses_float8_on_cpu(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Refused before launch: train.py's entry point runs in this process (tests/entry.py)."""
    run = tmp_path / "run"
    overrides = ["run.device=cpu", "model.float8=tensorwise", "model.float8_size_filter=false"]
    code = train_main(f"hydra.run.dir={run}", *overrides)
    err = capfd.readouterr().err
    assert code == 2, err[-2000:]
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "model.float8=tensorwise needs a CUDA GPU" in errors[0]
    assert not run.exists()


def test_swap_keeps_names_and_high_precision_weights(tmp_path: Path) -> None:
    """Float8 and bf16 models share one state dict (names, fp32 values): a float8 checkpoint loads
    into a bf16 model (and back) through DCP, and the executor rung's carry-over works unchanged."""
    m = ModelConfig(float8=Float8Recipe.tensorwise, float8_size_filter=False)
    fp8 = build_model(m, 32)
    names = apply_float8(fp8, m)
    assert names == [s.fqn for s in linears.converted(m)] and len(names) == 4 * 7
    assert not is_float8(fp8.output) and all(is_float8(fp8.get_submodule(n)) for n in names)
    assert {n for n, mod in fp8.named_modules() if isinstance(mod, nn.Linear)} == {
        s.fqn for s in linears.linear_shapes(m)
    }
    materialize(fp8, "cpu", seed=3)
    plain = build_model(dataclasses.replace(m, float8=Float8Recipe.none), 32)
    materialize(plain, "cpu", seed=3)
    a, b = fp8.state_dict(), plain.state_dict()
    assert list(a) == list(b)
    assert all(a[k].dtype == torch.float32 and torch.equal(a[k], b[k]) for k in a)
    # A float8 run's checkpoint resumes as bf16: save from the float8 model, load into a bf16 one.
    with torch.no_grad():
        fp8.layers["0"].feed_forward.w1.weight.add_(1.0)
    dcp.save(fp8.state_dict(), checkpoint_id=tmp_path / "ckpt")
    target = plain.state_dict()
    dcp.load(target, checkpoint_id=tmp_path / "ckpt")
    assert torch.equal(target["layers.0.feed_forward.w1.weight"], fp8.layers["0"].feed_forward.w1.weight)
    x = torch.randint(0, m.vocab_size, (2, 32))
    assert torch.isfinite(fp8(x)).all()  # float8 forward (emulated on the CPU)


def test_planner_counts_float8_activation_memory() -> None:
    cfg = compose_config(
        "recipe=llama1b",
        "mesh/hardware=h200",
        "train.micro_batch_size=16",
        "train.global_batch_size=16",
        "executor=compile",
    )
    tw = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, float8=Float8Recipe.tensorwise, float8_size_filter=False)
    )
    bf16_acts, fp8_acts = make_plan(cfg).memory.activations, make_plan(tw).memory.activations
    expected = 16 * (16 * 2048) * int(float8.SAVED_BYTES_PER_INPUT * (3 * 2048 + 2048 + 2 * 2048 + 8192))
    assert abs((bf16_acts - fp8_acts) - expected) < 16 * 16  # int rounding per layer
    assert (
        make_plan(
            dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, float8=Float8Recipe.none))
        ).memory
        == make_plan(cfg).memory
    )


def _run_in_process(trainer, cfg: Config, run_dir: Path):  # noqa: ANN001, ANN202 - a module, a Summary
    """``trainer.run`` in this process sets the launcher's variables (RANK, MASTER_PORT, ...) and a
    process group, as a rank does; undo both, or later tests' forked ranks and ``train.py``
    children would inherit them (a child with RANK set thinks it joined torchrun)."""
    import os

    import torch.distributed as dist

    from framework.planner.resolve import resolve

    saved = dict(os.environ)
    resolved = resolve(cfg)
    try:
        return trainer.run(resolved.cfg, resolved.plan, run_dir)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


def test_nonfinite_float8_run_falls_back_to_bf16(tmp_path: Path) -> None:
    """Three NaN steps in a row under float8 (with activation checkpointing): the ladder's float8
    rung rebuilds the run in bf16 (same executor, weights and optimiser carried over), records why,
    and training finishes."""
    from framework.config.schema import (
        ActivationCheckpointing,
        DataConfig,
        DataSource,
        Device,
        LoggerConfig,
        RunConfig,
        ShardingConfig,
        TrainConfig,
        VerifyConfig,
    )
    from framework.train import trainer

    cfg = Config(
        model=ModelConfig(float8=Float8Recipe.tensorwise, float8_size_filter=False),
        data=DataConfig(source=DataSource.synthetic),
        train=TrainConfig(
            steps=8, global_batch_size=2, micro_batch_size=2, seq_len=32, log_every=2, eval_every=0
        ),
        run=RunConfig(device=Device.cpu),
        sharding=ShardingConfig(activation_checkpointing=ActivationCheckpointing.full),
        verify=VerifyConfig(inject_nan_steps=[2, 3, 4], max_bad_steps=3),
        logger=LoggerConfig(progress_bar=False, plot=False),
    )
    summary = _run_in_process(trainer, cfg, tmp_path)
    assert summary.steps == 8 and summary.skipped_steps == 3
    falls = [r for r in read_metrics(tmp_path) if r.get("event") == "fallback/bad_steps"]
    assert "model.float8 tensorwise -> none (bf16)" in falls[0]["detail"], falls
    assert "3 non-finite steps in a row under float8 tensorwise" in falls[0]["detail"]
    assert summary.final_loss is not None and summary.final_loss == summary.final_loss
    assert any(
        "model.float8 tensorwise -> none" in e
        for e in json.loads((tmp_path / "summary.json").read_text())["events"]
    )


def test_grad_dtype_reaches_torchao_and_the_backward() -> None:
    """``model.float8_grad_dtype`` sets the dtype torchao casts the output gradients to in both
    backward GEMMs (tensorwise only; rowwise keeps its e4m3), on every swapped layer. A CPU
    backward through one float8 layer shows it is the one used: e4m3's 3 mantissa bits give
    gradients closer to the fp32 layer's than e5m2's 2 do (~0.038 vs ~0.061 relative error) in one
    step; over 500 steps e5m2's range won (PERF.md round 15)."""
    from torchao.float8.config import ScalingGranularity, e4m3_dtype, e5m2_dtype

    base = ModelConfig(float8=Float8Recipe.tensorwise, float8_size_filter=False)
    assert base.float8_grad_dtype is Float8GradDtype.e5m2  # the default (PERF.md round 15)
    for grad, dtype in ((Float8GradDtype.e4m3, e4m3_dtype), (Float8GradDtype.e5m2, e5m2_dtype)):
        m = dataclasses.replace(base, float8_grad_dtype=grad)
        c = float8_config(m, fsdp_all_gather=True)
        assert c.cast_config_grad_output.target_dtype == dtype
        assert c.cast_config_grad_output_for_grad_weight.target_dtype == dtype
        assert c.cast_config_input.target_dtype == e4m3_dtype and c.enable_fsdp_float8_all_gather
        model = build_model(m, 32)
        names = apply_float8(model, m)
        assert {model.get_submodule(n).config.cast_config_grad_output.target_dtype for n in names} == {dtype}
    rw = float8_config(dataclasses.replace(base, float8=Float8Recipe.rowwise), fsdp_all_gather=True)
    assert rw.cast_config_grad_output.target_dtype == e4m3_dtype and not rw.enable_fsdp_float8_all_gather
    assert rw.cast_config_grad_output.scaling_granularity is ScalingGranularity.AXISWISE

    g = torch.Generator().manual_seed(0)
    x, dy, w = (
        torch.randn(64, 128, generator=g),
        torch.randn(64, 96, generator=g),
        torch.randn(96, 128, generator=g),
    )

    def grads(grad: Float8GradDtype | None) -> tuple[torch.Tensor, torch.Tensor]:
        layer = nn.Sequential(nn.Linear(128, 96, bias=False))
        layer[0].weight.data.copy_(w)
        if grad is not None:
            m = dataclasses.replace(base, float8_grad_dtype=grad)
            torchao.convert_to_float8_training(layer, config=float8_config(m, fsdp_all_gather=False))
            assert is_float8(layer[0])
        xi = x.clone().requires_grad_()
        layer(xi).backward(dy)
        return layer[0].weight.grad, xi.grad

    ref = grads(None)

    def error(grad: Float8GradDtype) -> list[float]:
        return [float((a - b).norm() / b.norm()) for a, b in zip(grads(grad), ref, strict=True)]

    e4m3, e5m2 = error(Float8GradDtype.e4m3), error(Float8GradDtype.e5m2)
    assert all(0 < a < 0.75 * b for a, b in zip(e4m3, e5m2, strict=True)), (e4m3, e5m2)


def test_grad_dtype_is_refused_where_it_does_nothing() -> None:
    """Only tensorwise reads it: set to e4m3 under bf16 or rowwise, the launcher refuses it."""
    for recipe in (Float8Recipe.none, Float8Recipe.rowwise):
        cfg = Config(model=ModelConfig(float8=recipe, float8_grad_dtype=Float8GradDtype.e4m3))
        with pytest.raises(
            ValueError,
            match=rf"^model.float8_grad_dtype='e4m3' does nothing with model.float8={recipe.value}: "
            r"it belongs to model.float8=tensorwise",
        ):
            check_option_fields(cfg)
    check_option_fields(Config(model=ModelConfig(float8=Float8Recipe.rowwise)))  # the default passes


def test_fast_accum_reaches_every_swapped_layer_and_the_plan() -> None:
    """``model.float8_fast_accum``: torchao's fast accumulation in the two backward GEMMs too (its
    default: the forward only), on every swapped layer, either recipe; the planner costs the backward
    GEMMs faster; without float8 the launcher refuses it (it would do nothing)."""
    base = ModelConfig(float8=Float8Recipe.tensorwise, float8_size_filter=False)
    for recipe in (Float8Recipe.tensorwise, Float8Recipe.rowwise):
        for fast in (False, True):
            m = dataclasses.replace(base, float8=recipe, float8_fast_accum=fast)
            c = float8_config(m, fsdp_all_gather=False)
            assert c.gemm_config_output.use_fast_accum  # torchao's default for the forward
            assert (c.gemm_config_grad_input.use_fast_accum, c.gemm_config_grad_weight.use_fast_accum) == (fast, fast)
            model = build_model(m, 32)
            names = apply_float8(model, m)
            configs = {model.get_submodule(n).linear_mm_config for n in names}
            assert {(mm.grad_input.use_fast_accum, mm.grad_weight.use_fast_accum) for mm in configs} == {(fast, fast)}
    from framework.launch.recipes import compose_recipe
    from framework.planner.resolve import make_plan

    common = ["run.device=cuda", "mesh/hardware=h200", "executor=compile", "model.float8=tensorwise",
              "model.float8_size_filter=false", "train.seq_len=2048"]  # fmt: skip
    slow = make_plan(compose_recipe("llama1b", common)).prediction.compute_s
    fast = make_plan(compose_recipe("llama1b", [*common, "model.float8_fast_accum=true"])).prediction.compute_s
    assert fast < slow
    with pytest.raises(ValueError, match=r"^model.float8_fast_accum=True does nothing with model.float8=none"):
        check_option_fields(Config(model=ModelConfig(float8_fast_accum=True)))


def test_fast_accum_warns_before_launch(caplog: pytest.LogCaptureFixture) -> None:
    """It diverged where the default did not (benchmarks/PERF.md): one line before launch says so."""
    assert float8.fast_accum_notice(False) is None
    cfg = compose_config("model.float8=tensorwise", "model.float8_size_filter=false", "model.float8_fast_accum=true")
    with caplog.at_level(logging.WARNING, logger="framework"):
        check_float8(on(cfg, "h100_sxm"), torch.device("cpu"), 1)
    lines = [r.getMessage() for r in caplog.records if "float8_fast_accum" in r.getMessage()]
    assert lines == [float8.fast_accum_notice(True)] and "diverged" in lines[0]
