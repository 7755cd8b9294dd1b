"""DeepSeek-V3's multi-token prediction (``model.mtp_layers=1``, framework.models.parts.mtp) on tiny
shapes: the loss against a hand computation from the layer's weights, ``mtp_layers=0`` leaving the model
as it was, the Hub layer ``model.layers.{num_hidden_layers}.*`` read into the MTP layer and written
back, FSDP on 2 gloo ranks against one process, and the one-line refusals."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest
import torch

from framework.config.schema import Config, DeepseekV3Config
from framework.launch.recipes import compose_recipe
from framework.models import build_model, materialize, model_spec, take_aux, take_mtp
from framework.models.registry import FAMILIES
from framework.models.spec import ModelSpec
from tests.dist import run_ranks

SEQ = 16


def tiny(mtp: int = 1, **kw: object) -> DeepseekV3Config:
    cfg = FAMILIES[DeepseekV3Config().family].tiny_config()
    return dataclasses.replace(cfg, mtp_layers=mtp, vocab_size=256, **kw)


def built(cfg: DeepseekV3Config, seed: int = 0) -> torch.nn.Module:
    model = build_model(cfg, SEQ)
    materialize(model, "cpu", seed)
    return model


def rows(n: int = 2, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.randint(0, 256, (n, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return t[:, :-1], t[:, 1:]


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_mtp_loss_equals_a_hand_computation() -> None:
    """The training loss is the main cross-entropy plus 0.3 x the MTP one, which plain torch ops
    recompute from the layer's weights (beside the trunk's load-balancing term): norms of the trunk's last hidden state and of token i+1's
    embedding, ``eh_proj`` over [embedding; hidden], the layer's block (its module: the trunk's MoE
    kind, tested by the parity tests), its norm, the shared head, cross-entropy against token i+2. The
    logged figure (``take_mtp``) is the unweighted one; a forward without gradients is the main loss."""
    cfg = tiny()
    model = built(cfg)
    x, y = rows()
    loss = model(x, y)
    mtp, aux = take_mtp(model), take_aux(model)
    assert mtp is not None and aux is not None and take_mtp(model) is None  # read once
    with torch.no_grad():
        main = model(x, y)
        assert take_mtp(model) is None  # no figure from an evaluation
        h = model.tok_embeddings(x)
        for layer in model.layers.values():
            h = layer(h, model.rope)
        layer = model.mtp.layers[str(cfg.n_layers)]
        eps = cfg.norm_eps
        emb = model.tok_embeddings.weight[x[:, 1:]]
        cat = torch.cat([rms(emb, layer.enorm.weight, eps), rms(h[:, :-1], layer.hnorm.weight, eps)], -1)
        z = layer.block(cat @ layer.eh_proj.weight.T, model.rope)
        logits = rms(z, layer.norm.weight, eps) @ model.output.weight.T
        logp = logits.float().log_softmax(-1)
        ref = -logp.gather(-1, y[:, 1:, None]).mean()
    print(f"main {main.item():.6f} mtp {mtp.item():.6f} hand {ref.item():.6f} loss {loss.item():.6f}")
    torch.testing.assert_close(mtp, ref, rtol=1e-5, atol=1e-6)
    # the training loss also adds the trunk's load-balancing term (model.moe.router_aux_loss_coef)
    coef = cfg.moe.router_aux_loss_coef
    torch.testing.assert_close(loss.detach(), main + coef * aux + 0.3 * ref, rtol=1e-5, atol=1e-6)
    loss.backward()  # the MTP layer trains, and through it the trunk and the shared embedding
    assert layer.eh_proj.weight.grad is not None and layer.eh_proj.weight.grad.abs().sum() > 0


def test_without_mtp_the_model_and_loss_are_unchanged() -> None:
    """``mtp_layers=0`` (the default): no MTP module, weight or figure, the spec of before (its
    parameters the trunk's); the trunk of an ``mtp_layers=1`` model, loaded into it, gives bitwise the
    same logits, and its loss without gradients (the main head alone) is bitwise the MTP model's."""
    off, on = built(tiny(0)), built(tiny(1))
    spec_off, spec_on = model_spec(tiny(0)), model_spec(tiny(1))
    assert off.mtp is None and spec_off.mtp == () and not spec_off.hf_copies()
    assert not any("mtp" in n for n in off.state_dict())
    assert {n for n, _, _ in spec_off.params()} == {n for n, _ in off.named_parameters()}
    extra = spec_on.numel[0] - spec_off.numel[0]
    assert extra == sum(p.numel() for n, p in on.named_parameters() if n.startswith("mtp."))
    assert extra > 0 and spec_on.score_width(4) > spec_off.score_width(4)
    trunk = {k: v for k, v in on.state_dict().items() if not k.startswith("mtp.")}
    off.load_state_dict(trunk)
    x, y = rows()
    with torch.no_grad():
        assert torch.equal(off(x), on(x))
        assert torch.equal(off(x, y), on(x, y))
    loss = off(x, y)  # training forward: the cross-entropy and the aux term, no MTP figure
    assert take_mtp(off) is None and torch.isfinite(loss)


def _hub_mtp_tensors(spec: ModelSpec, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Random tensors for every Hub name of the MTP layer (per-expert parts included), and its copies
    of the embedding and head, as the published checkpoints hold them."""
    g = torch.Generator().manual_seed(7)
    names, experts = spec.hf_names(), spec.hf_experts()
    out = {}
    for ours, w, _ in spec.tensors():
        if not ours.startswith("mtp."):
            continue
        if ours in experts:
            e, rows_, *rest = w.shape
            for i in range(e):
                for t in experts[ours]:
                    out[t.format(e=i)] = torch.randn(rows_ // len(experts[ours]), *rest, generator=g)
        else:
            out[names[ours]] = torch.randn(*w.shape, generator=g) * 0.1 + (1.0 if "norm" in ours else 0.0)
    state = model.state_dict()
    for theirs, ours in spec.hf_copies().items():
        out[theirs] = state[ours].clone()
    return out


def test_hub_mtp_layer_is_read_into_the_mtp_module_and_written_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A tiny transformers DeepseekV3ForCausalLM folder plus the layer ``model.layers.3.*`` (transformers
    does not build it: the test writes its tensors, config.json says ``num_nextn_predict_layers: 1``):
    with ``model.mtp_layers=1`` the import reads each into the MTP layer (values equal, the copies of
    the embedding and head read as the trunk's, no warning); with 0 it is skipped with the warning;
    the export writes every one back, with ``num_nextn_predict_layers: 1``."""
    pytest.importorskip("transformers")
    from safetensors.torch import save_file

    from framework.checkpoint.export_hf import hf_config, to_hf_state_dict
    from framework.models.parts.weights import materialize as mat
    from tests.models.test_models_deepseek_v3 import imported_cfg, save

    path, _ = save(tmp_path)
    cfg0 = imported_cfg(path)
    cfg1 = dataclasses.replace(cfg0, mtp_layers=1)
    spec = model_spec(cfg1)
    from framework.checkpoint import init_from

    trunk = build_model(cfg0, SEQ)
    mat(trunk, "cpu", seed=0, load_weights=init_from.load)
    hub = _hub_mtp_tensors(spec, trunk)
    assert "model.layers.3.eh_proj.weight" in hub and "model.layers.3.shared_head.norm.weight" in hub
    save_file(hub, str(path / "mtp.safetensors"))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"] |= dict.fromkeys(hub, "mtp.safetensors")
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))

    model = build_model(cfg1, SEQ)
    with caplog.at_level("WARNING", logger="framework"):
        mat(model, "cpu", seed=0, load_weights=init_from.load)
    assert "multi-token prediction" not in caplog.text
    out = to_hf_state_dict(model.state_dict(), cfg1)
    for name, t in hub.items():
        assert torch.equal(out[name], t), name  # read into the module, written back unchanged
    for ours, theirs in spec.hf_names().items():
        if ours.startswith("mtp.") and ours not in spec.hf_experts():
            assert torch.equal(model.state_dict()[ours], hub[theirs]), ours
    assert hf_config(cfg1, torch.float32, 64)["num_nextn_predict_layers"] == 1
    assert hf_config(cfg0, torch.float32, 64)["num_nextn_predict_layers"] == 0
    x, y = rows()
    assert torch.isfinite(model(x, y)) and take_mtp(model) is not None

    caplog.clear()
    with caplog.at_level("WARNING", logger="framework"):
        mat(build_model(cfg0, SEQ), "cpu", seed=0, load_weights=init_from.load)
    assert "multi-token prediction tensors" in caplog.text


def _cfg(world: int, **parallel: object) -> Config:
    cfg = compose_recipe("deepseek_v3_tiny")
    cfg.model.mtp_layers = 1
    cfg.mesh.shape = [world]
    cfg.train.seq_len, cfg.train.global_batch_size, cfg.train.micro_batch_size = SEQ, 8, 0
    cfg.train.grad_clip, cfg.train.warmup_steps = 0.3, 0
    for k, v in parallel.items():
        setattr(cfg.parallel, k, v)
    return cfg


def _train(world: int, rank: int, **parallel: object) -> list[tuple[float, float, float]]:
    from framework.parallel import build_mesh, dp_mesh_info, parallelize
    from framework.planner.resolve import make_plan
    from framework.train.loop import train_step
    from framework.train.optimizers import build_optimizer, build_scheduler
    from framework.train.runner import _update_biases

    cpu = torch.device("cpu")
    cfg = _cfg(world, **parallel)
    model = build_model(cfg.model, SEQ)
    if world > 1:
        plan = make_plan(cfg)
        mesh = build_mesh(plan, "cpu")
        model = parallelize(model, mesh, plan, cfg.sharding, cfg.bucketing, cfg.executor, cpu, 0)
        dp_rank, dp_size = dp_mesh_info(mesh, plan)
        micro = plan.micro_batch_size
    else:
        materialize(model, cpu, 0)
        dp_rank, dp_size, micro = 0, 1, 8
    opt = build_optimizer(model, cfg.train, cpu)
    sched = build_scheduler(opt, cfg.train)
    opt.register_step_post_hook(functools.partial(_update_biases, model))
    g = torch.Generator().manual_seed(3)
    out = []
    n = 8 // dp_size
    for _ in range(2):
        b = torch.randint(0, 256, (8, SEQ + 1), generator=g)
        mine = b[dp_rank * n : (dp_rank + 1) * n]
        mbs = [(mine[i : i + micro, :-1], mine[i : i + micro, 1:]) for i in range(0, n, micro)]
        r = train_step(model, opt, sched, mbs, cfg.train.grad_clip, cpu)
        out.append((r.loss, r.grad_norm, r.mtp))
    return out


def _worker(rank: int, world: int) -> list[tuple[float, float, float]]:
    return _train(world, rank, dp_shard=2)


def test_two_gloo_ranks_fsdp_with_mtp_train_as_one_process() -> None:
    """``deepseek_v3_tiny`` with ``model.mtp_layers=1``, 2 steps (AdamW, clipping, the bias update): FSDP
    over 2 gloo ranks (``dp_shard=2``: the MTP layer in the root unit) gives one process's loss,
    gradient norm and MTP figure within rtol 1e-5."""
    ref = _train(1, 0)
    for got in run_ranks(_worker, 2):
        for a, b in zip(got, ref, strict=True):
            for x, y in zip(a, b, strict=True):
                assert abs(x - y) <= 1e-5 * abs(y), (got, ref)
    print("deepseek_v3_tiny + MTP, one process (loss, grad_norm, mtp_loss):", ref)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"model.mtp_layers": 2}, r"model.mtp_layers=2 is not valid; valid: an integer >= 0 and <= 1"),
        ({"model.mtp_layers": -1}, r"model.mtp_layers=-1 is not valid"),
        ({"model.mtp_loss_weight": -0.5}, r"model.mtp_loss_weight=-0.5 is not valid"),
    ],
)
def test_bad_mtp_values_are_refused_in_one_line(changes: dict, match: str) -> None:
    from framework.launch.rules import check

    cfg = _cfg(1)
    for key, v in changes.items():
        setattr(cfg.model, key.split(".")[1], v)
    with pytest.raises(ValueError, match=match) as e:
        check(cfg)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("axis", ["pp", "tp", "cp", "ep"])
def test_mtp_with_a_pipeline_or_sharded_axis_is_refused(axis: str) -> None:
    from framework.launch.rules import check_family_layout
    from framework.planner.layout import Degrees

    cfg = _cfg(2)
    degrees = Degrees(**{axis: 2})
    with pytest.raises(ValueError, match=rf"^model.mtp_layers=1 is not valid with parallel.{axis}=2") as e:
        check_family_layout(cfg, degrees)
    assert "\n" not in str(e.value)
    cfg.model.mtp_layers = 0
    check_family_layout(cfg, degrees)


def test_mtp_with_document_mask_is_refused() -> None:
    with pytest.raises(ValueError, match=r"model.mtp_layers=1 with data.document_mask"):
        build_model(tiny(), SEQ, document_eos=0)
