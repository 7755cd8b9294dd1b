"""``model.fused_cross_entropy``: the refusals and the plumbing on the CPU; the kernels' loss and
gradients against the unfused head on a CUDA GPU with the package installed (skipped elsewhere)."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from pathlib import Path

import pytest
import torch

from framework.config.schema import CompileScope, FusedCrossEntropy
from framework.kernels import fused_ce
from framework.launch.prelaunch import check_fused_ce
from framework.models import Decoder, build_model, materialize
from framework.parallel.compile import apply_compile
from framework.planner import search, search_space
from framework.planner.resolve import make_plan
from tests.config.test_config import compose_config
from tests.kernels.test_target import on
from tests.train.test_train import train


def cfg_with(kind: FusedCrossEntropy, *overrides: str):
    cfg = compose_config("recipe=llama_tiny", *overrides)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, fused_cross_entropy=kind))


def test_refusals_name_the_value_and_what_runs() -> None:
    liger = cfg_with(FusedCrossEntropy.liger)
    with pytest.raises(ValueError, match=r"^model.fused_cross_entropy=liger needs a CUDA device .* uses cpu"):
        fused_ce.check(liger.model, liger.executor, "cpu", 1)
    whole = cfg_with(FusedCrossEntropy.cce, "executor=compile", "executor.scope=model")
    with pytest.raises(ValueError, match=r"executor.scope=model.*use executor.scope=block"):
        fused_ce.check(whole.model, whole.executor, "cuda", 1)
    with pytest.raises(ValueError, match=r"sharding.tp=2 shards it"):
        fused_ce.check(liger.model, liger.executor, "cuda", 2)
    for kind, (module, pip_name) in fused_ce.PACKAGES.items():
        if importlib.util.find_spec(module) is None:
            with pytest.raises(ValueError, match=f"needs the {pip_name} package: pip install {pip_name}"):
                fused_ce.check(cfg_with(kind).model, cfg_with(kind).executor, "cuda", 1)
        else:
            fused_ce.check(cfg_with(kind).model, cfg_with(kind).executor, "cuda", 1)
    fused_ce.check(cfg_with(FusedCrossEntropy.none).model, cfg_with(FusedCrossEntropy.none).executor, "cpu", 4)  # the default is never refused


def test_dry_run_checks_the_declared_hardware_and_keeps_tp_off(caplog: pytest.LogCaptureFixture) -> None:
    """A dry run on this CPU host plans liger for an H100 profile (a missing package: one warning),
    refuses it for the CPU profile; the planner's search never shards the head by TP."""
    cpu = torch.device("cpu")
    liger = cfg_with(FusedCrossEntropy.liger, "recipe=llama1b", "mesh=8")
    h100 = on(liger, "h100_sxm")
    with caplog.at_level(logging.WARNING, logger="framework"):
        check_fused_ce(h100, cpu, 1)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == (importlib.util.find_spec("liger_kernel") is None), warnings
    assert all("needs the liger-kernel package" in w for w in warnings)
    with pytest.raises(ValueError, match="needs a CUDA device .* uses cpu"):
        check_fused_ce(on(liger, "cpu"), cpu, 1)
    assert {d.tp for d in search_space.degree_options(h100)} == {1}
    with pytest.raises(
        ValueError, match=r"degrees \[8\] of 8 ranks \(model.fused_cross_entropy keeps tensor"
    ):
        search.maybe_search(h100)  # llama1b's batch of 8 in micro batches of 8 needs TP on 8 ranks
    unfused = dataclasses.replace(
        h100, model=dataclasses.replace(h100.model, fused_cross_entropy=FusedCrossEntropy.none)
    )
    assert max(d.tp for d in search_space.degree_options(unfused)) == 8


def test_train_py_refuses_it_on_cpu(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = train(run, "run.device=cpu", "model.fused_cross_entropy=liger", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "model.fused_cross_entropy=liger needs a CUDA device" in errors[0], errors
    assert not run.exists()


def test_executor_compiles_the_norm_not_the_fused_head() -> None:
    """The fused kernels cannot be traced: the executor leaves ``head_loss`` eager and compiles the
    final norm in its place (the unfused head stays one compiled region)."""
    for kind in (FusedCrossEntropy.none, FusedCrossEntropy.liger):
        cfg = cfg_with(kind, "executor=compile")
        model = build_model(cfg.model, cfg.train.seq_len)
        assert apply_compile(model, cfg.executor, torch.device("cpu")) == cfg.model.n_layers + 1
        assert cfg.executor.scope is CompileScope.block
        head_compiled = getattr(model.head_loss, "__func__", None) is not Decoder.head_loss
        norm_compiled = "forward" in vars(model.norm)
        assert (head_compiled, norm_compiled) == (
            kind is FusedCrossEntropy.none,
            kind is not FusedCrossEntropy.none,
        )


def test_planner_drops_the_logits_term() -> None:
    base = compose_config("recipe=llama1b", "executor=compile", "mesh/hardware=h200", "run.device=cuda")
    fused = dataclasses.replace(
        base, model=dataclasses.replace(base.model, fused_cross_entropy=FusedCrossEntropy.cce)
    )
    saved = make_plan(base).memory.activations - make_plan(fused).memory.activations
    tokens = base.train.micro_batch_size * base.train.seq_len
    # The compiled head's 2 bytes per logit, less the fused head's chunk, input gradient and weight gradient.
    assert 0.9 * tokens * base.model.vocab_size * 2 > saved > 0.5 * tokens * base.model.vocab_size * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused kernels are Triton: CUDA only")
@pytest.mark.parametrize("kind", [FusedCrossEntropy.liger, FusedCrossEntropy.cce])
def test_fused_loss_and_gradients_match_the_unfused_head(kind: FusedCrossEntropy) -> None:
    module, _ = fused_ce.PACKAGES[kind]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")
    cfg = compose_config("recipe=llama_tiny", "model.vocab_size=1024", "model.tie_embeddings=false")
    device = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, 1024, (4, 129), generator=g).to(device)
    targets = tokens[:, 1:].clone()
    targets[0, :7] = fused_ce.IGNORE_INDEX  # ignored targets count in neither the mean nor the gradient
    results = []
    for k in (FusedCrossEntropy.none, kind):
        model = build_model(dataclasses.replace(cfg.model, fused_cross_entropy=k), 128)
        materialize(model, device, seed=1)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], targets)
        loss.backward()
        results.append(
            (loss.detach().float(), model.output.weight.grad.clone(), model.norm.weight.grad.clone())
        )
    (ref_loss, ref_w, ref_n), (loss, w, n) = results
    assert torch.isfinite(loss) and abs(loss - ref_loss) / ref_loss < 1e-2
    for got, ref in ((w, ref_w), (n, ref_n)):
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        assert (got - ref).norm() / ref.norm() < 3e-2
