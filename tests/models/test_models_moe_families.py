"""framework.models.qwen3_moe and framework.models.mixtral against transformers'
``Qwen3MoeForCausalLM`` / ``MixtralForCausalLM`` (tiny random models made here, fp32, CPU, 1 rank).

Both ways: HF weights (saved sharded, per-expert tensors as the Hub keeps them) -> ``model.init_from``'s
importer -> our logits; our export -> transformers loads it -> its logits. The training loss with the
router's load-balancing term (transformers' ``output_router_logits``) and its gradients too. Mixtral's
window (4) is shorter than the sequence, so it decides the logits.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from framework.checkpoint.init_from import load
from framework.config.schema import replace_model

pytest.importorskip("transformers", reason="transformers is in the dev extra: the parity tests compare with its models")

from framework.checkpoint import export_hf, import_hf  # noqa: E402
from framework.checkpoint.export_hf import hf_config  # noqa: E402
from framework.config.schema import ModelConfig, ModelFamily, MoEConfig, RouterScore  # noqa: E402
from framework.models import FAMILIES, build_model, materialize, model_spec  # noqa: E402

SEQ, TOL, VOCAB = 16, 1e-5, 256


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def hf_model(family: str) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(5)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.02,
        attn_implementation="eager",
    )
    if family == "qwen3_moe":
        config = Qwen3MoeConfig(
            **common,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=4,
            head_dim=32,
            norm_topk_prob=True,
        )
        model = Qwen3MoeForCausalLM(config)
    else:
        model = MixtralForCausalLM(
            MixtralConfig(**common, intermediate_size=32, num_local_experts=4, sliding_window=4)
        )
    with torch.no_grad():  # non-trivial norms; a router that is not almost uniform
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            if n.endswith("gate.weight"):
                p.normal_(0, 0.5)
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("hf_moe")
    out = {}
    for family in ("qwen3_moe", "mixtral"):
        model = hf_model(family)
        model.save_pretrained(root / family, max_shard_size="60KB")  # experts spread over several files
        out[family] = (root / family, model)
    return out


def imported_cfg(path: Path) -> ModelConfig:
    shape = import_hf.model_shape(import_hf.read_hf_checkpoint(path))
    shape["moe"] = MoEConfig(**shape["moe"])
    return replace_model(ModelConfig(), **shape, init_from=str(path))


def ours(path: Path) -> tuple[ModelConfig, torch.nn.Module]:
    cfg = imported_cfg(path)
    model = build_model(cfg, SEQ)
    materialize(model, "cpu", seed=0, load_weights=load)
    return cfg, model.eval()


def test_records_and_shapes(saved: dict) -> None:
    for family, arch in (("qwen3_moe", "Qwen3MoeForCausalLM"), ("mixtral", "MixtralForCausalLM")):
        assert (
            FAMILIES[ModelFamily(family)].hf_architecture == arch and FAMILIES[ModelFamily(family)].moe_keys
        )
        path, _ = saved[family]
        assert (path / import_hf.INDEX_FILE).is_file()
        assert len(set(import_hf.read_hf_checkpoint(path).files.values())) > 1
    q, m = imported_cfg(saved["qwen3_moe"][0]), imported_cfg(saved["mixtral"][0])
    assert (q.moe.num_experts, q.moe.num_experts_per_tok, q.moe.moe_intermediate_size, q.head_dim) == (
        4,
        2,
        32,
        32,
    )
    assert (q.moe.router_aux_loss_coef, q.moe.norm_topk_prob, q.ffn_dim) == (0.02, True, 96)
    assert (m.moe.num_experts, m.ffn_dim, m.sliding_window, model_spec(m).sliding_window) == (4, 32, 4, 4)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_logits_equal_transformers_both_ways(tmp_path: Path, saved: dict, family: str) -> None:
    from transformers import AutoModelForCausalLM

    path, hf = saved[family]
    cfg, model = ours(path)
    with torch.no_grad():
        expected, got = hf(tokens()).logits, model(tokens())
    imported = (got - expected).abs().max().item()
    export_hf(model.state_dict(), cfg, tmp_path / "out", max_position_embeddings=64)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert type(back).__name__ == type(hf).__name__
    with torch.no_grad():
        exported = (back(tokens()).logits - got).abs().max().item()
    print(f"{family}: HF -> ours max |logits diff| {imported:.2e}; ours -> HF {exported:.2e}")
    assert imported <= TOL and exported <= TOL, (imported, exported)
    # The export's config.json carries the MoE fields transformers reads.
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["num_experts_per_tok"] == 2 and written["router_aux_loss_coef"] == 0.02
    assert written["num_experts" if family == "qwen3_moe" else "num_local_experts"] == 4


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_loss_with_the_aux_term_and_gradients_equal_transformers(saved: dict, family: str) -> None:
    """transformers adds router_aux_loss_coef x load_balancing_loss_func to the loss when asked for
    the router logits; ours always does (model.moe.router_aux_loss_coef > 0). Same loss, same
    gradients (the router's carry the aux term's)."""
    path, hf = saved[family]
    _, model = ours(path)
    x = tokens()
    # HF shifts the labels inside; ours takes the targets (the last position ignored, as HF's is).
    targets = torch.cat([x[:, 1:], torch.full((2, 1), -100)], dim=1)
    hf_out = hf(x, labels=x, output_router_logits=True)
    loss = model(x, targets)
    assert hf_out.aux_loss is not None and hf_out.aux_loss.item() > 0
    hf_out.loss.backward()
    loss.backward()
    assert abs(loss.item() - hf_out.loss.item()) <= TOL, (loss.item(), hf_out.loss.item())
    prefix = "mlp"  # transformers 5's in-memory module for both (Mixtral's files say block_sparse_moe)
    pairs = {
        "layers.0.feed_forward.gate.weight": f"model.layers.0.{prefix}.gate.weight",
        "layers.1.feed_forward.experts.gate_up_proj": f"model.layers.1.{prefix}.experts.gate_up_proj",
        "layers.1.feed_forward.experts.down_proj": f"model.layers.1.{prefix}.experts.down_proj",
        "layers.0.attention.wv.weight": "model.layers.0.self_attn.v_proj.weight",
    }
    theirs = dict(hf.named_parameters())
    mine = dict(model.named_parameters())
    for a, b in pairs.items():
        diff = (mine[a].grad - theirs[b].grad).abs().max().item()
        assert diff <= TOL, (a, diff)
    # Without the aux term the router's gradient differs: the comparison can fail.
    hf.zero_grad()
    hf(x, labels=x).loss.backward()
    gate = "layers.0.feed_forward.gate.weight"
    assert (mine[gate].grad - theirs[pairs[gate]].grad).abs().max().item() > 1e-6
    hf.zero_grad()


def test_hf_checkpoint_with_another_expert_count_or_layout_is_one_line(tmp_path: Path, saved: dict) -> None:
    path, _ = saved["qwen3_moe"]
    cfg = imported_cfg(path)
    ckpt = import_hf.read_hf_checkpoint(path)
    more = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, num_experts=6))
    spec = model_spec(more)
    expected = {n: w.shape for n, w, _ in spec.params()}
    with pytest.raises(
        ValueError,
        match=r"tensor model.layers.0.mlp.gate.weight has shape \[4, 64\], the model expects \[6, 64\]",
    ):
        import_hf.check_against(ckpt, expected, spec.hf_names(), experts=spec.hf_experts())
    no_router = {n: s for n, s in expected.items() if "gate.weight" not in n}
    with pytest.raises(ValueError, match=r"missing \['model.layers.0.mlp.experts.4.down_proj.weight"):
        import_hf.check_against(ckpt, no_router, spec.hf_names(), experts=spec.hf_experts())
    # Dense layers among the sparse ones: a layout this family does not compute.
    for key, value in (("mlp_only_layers", [0]), ("decoder_sparse_step", 2)):
        config = json.loads((path / "config.json").read_text()) | {key: value}
        odd = tmp_path / key
        odd.mkdir()
        (odd / "config.json").write_text(json.dumps(config))
        for f in path.glob("*.safetensors*"):
            (odd / f.name).write_bytes(f.read_bytes())
        with pytest.raises(ValueError, match=re.escape(f"config.json has {key}={value!r}; valid: ")):
            import_hf.model_shape(import_hf.read_hf_checkpoint(odd))


def test_export_refuses_what_transformers_cannot_compute() -> None:
    cfg = ModelConfig(family=ModelFamily.qwen3_moe, head_dim=32, moe=MoEConfig(num_experts=4))
    hf_config(cfg, torch.float32, 64)  # the softmax router exports
    sigmoid = dataclasses.replace(cfg, moe=MoEConfig(num_experts=4, router_score=RouterScore.sigmoid))
    with pytest.raises(
        ValueError, match=r"model.moe.router_score=sigmoid has no Qwen3MoeForCausalLM counterpart"
    ):
        hf_config(sigmoid, torch.float32, 64)


@pytest.mark.parametrize("init_from", [False, True], ids=["seeded", "hf_import"])
def test_materialize_zeroes_the_sigmoid_routers_bias(saved: dict, init_from: bool) -> None:
    """``to_empty`` leaves the selection bias as whatever memory held (it once trained from 1e38):
    materialize sets it to zero on both paths, the seeded init and an HF import (which has none)."""
    path, _ = saved["qwen3_moe"]
    cfg = imported_cfg(path)
    cfg = replace_model(cfg, moe=dataclasses.replace(cfg.moe, router_score=RouterScore.sigmoid))
    if not init_from:
        cfg = replace_model(cfg, init_from=None)
    model = build_model(cfg, SEQ)
    real_to_empty = model.to_empty

    def to_garbage(*, device: str, recurse: bool = True) -> torch.nn.Module:
        real_to_empty(device=device, recurse=recurse)
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.fill_(float("nan"))  # what an uninitialised allocation may hold
        return model

    model.to_empty = to_garbage  # type: ignore[method-assign]
    materialize(model, "cpu", seed=0, load_weights=load)
    biases = {n: b for n, b in model.named_buffers() if n.endswith("expert_bias")}
    assert len(biases) == cfg.n_layers and all(torch.equal(b, torch.zeros_like(b)) for b in biases.values())
