"""framework.models.deepseek_v3 against transformers' ``DeepseekV3ForCausalLM`` (fp32, CPU): tiny random
models whose every DeepSeek part decides the logits: multi-head latent attention (with and without
the low-rank query), YaRN (factor 4, mscale_all_dim 1), one dense layer then MoE ones with a shared
expert, group-limited sigmoid routing (4 groups, the best 2) with a random selection bias
(``e_score_correction_bias``), ``routed_scaling_factor`` 2.5.

Both ways on one process (HF weights -> ``model.init_from``'s reader -> our logits; our export ->
transformers loads it -> its logits), the KV-cache decode (the cache holds the compressed latent)
against the full forward, and on 2 gloo ranks: FSDP (each rank reads its experts), expert
parallelism (``parallel.ep=2``), tensor parallelism (``parallel.tp=2``: the latent attention runs whole
on each TP rank, the dense MLP is sharded) and a pipeline (``parallel.pp=2``, cut by cost). Then the
bad inputs: one line each, naming the value and what is valid."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "transformers", reason="transformers is in the dev extra: the parity tests compare with its models"
)

from framework.checkpoint import import_hf, init_from  # noqa: E402
from framework.checkpoint.export_hf import export_hf  # noqa: E402
from framework.config.schema import (
    Config,
    DeepseekV3Config,
    ModelConfig,
    MoEConfig,
    RouterScore,
    replace_model,
)  # noqa: E402
from framework.models import KVCache, build_model, forward_cached, materialize, model_spec  # noqa: E402

SEQ, TOL = 16, 1e-5


def tokens(n: int = 2) -> torch.Tensor:
    return torch.randint(0, 256, (n, SEQ), generator=torch.Generator().manual_seed(1))


def hf_model(q_lora_rank: int | None = 48):  # noqa: ANN201 - a DeepseekV3ForCausalLM
    from transformers import DeepseekV3Config as HFConfig
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(3)
    config = HFConfig(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        routed_scaling_factor=2.5,
        kv_lora_rank=32,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        vocab_size=256,
        max_position_embeddings=64,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        tie_word_embeddings=False,
        attn_implementation="eager",
        num_nextn_predict_layers=0,
    )
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.uniform_(-0.1, 0.1)
    return model


def save(tmp: Path, q_lora_rank: int | None = 48, x: torch.Tensor | None = None) -> tuple[Path, torch.Tensor]:
    hf = hf_model(q_lora_rank)
    path = tmp / f"hf_q{q_lora_rank}"
    hf.save_pretrained(path, max_shard_size="60KB")
    with torch.no_grad():
        return path, hf(tokens() if x is None else x).logits


def imported_cfg(path: Path) -> ModelConfig:
    shape = import_hf.model_shape(import_hf.read_hf_checkpoint(path))
    shape["moe"] = MoEConfig(**shape["moe"])
    return replace_model(ModelConfig(), **shape, init_from=str(path))


def ours(path: Path) -> tuple[ModelConfig, torch.nn.Module]:
    cfg = imported_cfg(path)
    model = build_model(cfg, SEQ)
    materialize(model, "cpu", seed=0, load_weights=init_from.load)
    return cfg, model.eval()


def hf_logits(path: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    with torch.no_grad():
        return model(tokens()).logits


@pytest.mark.parametrize("q_lora_rank", [48, None])
def test_logits_equal_transformers_both_ways(tmp_path: Path, q_lora_rank: int | None) -> None:
    path, expected = save(tmp_path, q_lora_rank)
    cfg, model = ours(path)
    assert isinstance(cfg, DeepseekV3Config) and cfg.layer_pattern == "dense x1, moe x2"
    assert (cfg.q_lora_rank, cfg.moe.n_group, cfg.moe.router_score) == (
        q_lora_rank or 0,
        4,
        RouterScore.sigmoid,
    )
    assert cfg.rope_yarn_factor == 4.0 and [k.name for k in model_spec(cfg).layers] == ["dense", "moe", "moe"]
    bias = model.get_buffer("layers.1.feed_forward.gate.expert_bias")
    assert bias.abs().min() > 0  # the checkpoint's selection bias, read
    with torch.no_grad():
        logits = model(tokens())
    there = (logits - expected).abs().max().item()
    export_hf(model.state_dict(), cfg, tmp_path / "out", max_position_embeddings=64)
    back = (hf_logits(tmp_path / "out") - logits).abs().max().item()
    print(f"deepseek_v3 q_lora_rank={q_lora_rank}: HF -> framework {there:.2e}; framework -> HF {back:.2e}")
    assert there <= TOL and back <= TOL, (there, back)
    # Each part decides the logits (the test can fail): without the bias, or without group limits.
    with torch.no_grad():
        bias.zero_()
        assert (model(tokens()) - expected).abs().max().item() > 1e-4


def test_cached_decode_keeps_the_latent(tmp_path: Path) -> None:
    """Token by token through the KV cache, the last position's logits equal the full forward's; each
    layer's cache is the compressed latent (kv_lora_rank) and the RoPE key, not per-head keys."""
    path, expected = save(tmp_path)
    cfg, model = ours(path)
    x = tokens()
    cache = KVCache.empty(model, x.shape[0], SEQ)
    assert [tuple(k.shape) for k in cache.keys] == [(2, SEQ, cfg.kv_lora_rank)] * 3
    assert [tuple(v.shape) for v in cache.values] == [(2, SEQ, 1, cfg.qk_rope_head_dim)] * 3
    forward_cached(model, x[:, :5], cache)
    for i in range(5, SEQ):
        last = forward_cached(model, x[:, i : i + 1], cache)
    torch.testing.assert_close(last, expected[:, -1], rtol=1e-5, atol=1e-5)


LAYOUTS = [{"dp_shard": 2}, {"dp_shard": 2, "ep": 2}, {"tp": 2}, {"pp": 2}]


def _layout_logits(rank: int, world: int, path: Path, x: torch.Tensor) -> dict:
    """The HF checkpoint through ``parallelize`` in each layout; each data-parallel rank feeds its own
    row of ``x``: the max |logits diff| against transformers' row (-1: a pipeline rank without the
    last stage)."""
    from framework.models import build_model
    from framework.parallel import build_mesh, dp_mesh_info, parallelize
    from framework.parallel.pipeline import is_pipeline
    from framework.parallel.pipeline_run import pipeline_logits
    from framework.planner.resolve import make_plan

    path, expected = path
    out = {}
    for layout in LAYOUTS:
        full = Config(model=imported_cfg(path))
        full.mesh.shape = [world]
        full.train.seq_len, full.train.global_batch_size = SEQ, 2
        for k, v in layout.items():
            setattr(full.parallel, k, v)
        plan = make_plan(full)
        mesh = build_mesh(plan, "cpu")
        model = parallelize(
            build_model(full.model, SEQ), mesh, plan, full.sharding, full.bucketing, full.executor,
            torch.device("cpu"), 0, load_weights=init_from.load,
        )  # fmt: skip
        if layout.get("dp_shard") == 2:  # each rank holds (and read) only its experts
            experts = model.get_parameter("layers.1.feed_forward.experts.gate_up_proj")
            assert experts.to_local().shape[0] == 4
        row, _ = dp_mesh_info(mesh, plan)
        mine = x[row : row + 1]
        with torch.no_grad():
            logits = (
                pipeline_logits(model, mine, mine, torch.device("cpu")) if is_pipeline(model) else model(mine)
            )
        out[plan.layout.short()] = (
            -1.0 if logits is None else (logits - expected[row : row + 1]).abs().max().item()
        )
    return out


def test_two_gloo_ranks_fsdp_ep_tp_pp_equal_transformers(tmp_path: Path) -> None:
    from tests.dist import run_ranks

    x = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(2))
    saved = save(tmp_path, x=x)
    out = run_ranks(_layout_logits, 2, saved, x, timeout_s=300)
    worst = {key: max(d[key] for d in out) for key in out[0]}
    print("HF DeepSeek-V3 -> framework, 2 gloo ranks, max |logits diff|:", worst)
    assert len(worst) == len(LAYOUTS) and 0 <= min(worst.values()) and max(worst.values()) <= TOL, worst


def test_multi_token_prediction_layers_are_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The published DeepSeek-V3 and Kimi K2 store their multi-token prediction layer as
    ``model.layers.{num_hidden_layers}.*`` (config.json's ``num_nextn_predict_layers: 1``): the import
    reads the rest, with one warning; the same tensors without that field are refused by name."""
    import json

    from safetensors.torch import save_file

    path, expected = save(tmp_path)
    save_file({"model.layers.3.eh_proj.weight": torch.zeros(64, 128)}, str(path / "mtp.safetensors"))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.3.eh_proj.weight"] = "mtp.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match=r"unknown \['model.layers.3.eh_proj.weight'\]"):
        ours(path)
    (path / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    with caplog.at_level("WARNING", logger="framework"):
        _, model = ours(path)
    assert (
        "1 multi-token prediction tensors" in caplog.text and "model.layers.3.eh_proj.weight" in caplog.text
    )
    with torch.no_grad():
        assert (model(tokens()) - expected).abs().max().item() <= TOL
