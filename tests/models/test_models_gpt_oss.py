"""framework.models.gpt_oss against transformers' ``GptOssForCausalLM`` (fp32, CPU): a tiny random model
whose every GPT-OSS part decides the logits (2 layers: window 4 then full attention over 16 tokens,
random sinks and biases, 8 experts top-2 with biases and the clamped SwiGLU, YaRN factor 4 without
truncation), both ways on one process: HF weights -> ``model.init_from``'s reader -> our logits, and
our export -> transformers loads it -> its logits; then the KV-cache decode against the full forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "transformers", reason="transformers is in the dev extra: the parity tests compare with its models"
)

from framework.checkpoint import import_hf, init_from  # noqa: E402
from framework.checkpoint.export_hf import export_hf  # noqa: E402
from framework.config.schema import GptOssConfig, ModelConfig, MoEConfig, replace_model  # noqa: E402
from framework.models import KVCache, build_model, forward_cached, materialize  # noqa: E402

SEQ, TOL = 16, 1e-5


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))


def save(tmp: Path) -> tuple[Path, torch.Tensor]:
    from transformers import GptOssConfig as HFConfig
    from transformers import GptOssForCausalLM

    torch.manual_seed(0)
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
    config = HFConfig(
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        vocab_size=256,
        max_position_embeddings=64,
        rope_parameters=yarn | {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    model = GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(("sinks", "bias")):
                p.normal_(0.0, 0.5)
            elif "experts" in name:
                p.normal_(0.0, 0.3)
    path = tmp / "hf"
    model.save_pretrained(path)
    with torch.no_grad():
        return path, model(tokens()).logits


def ours(path: Path) -> tuple[ModelConfig, torch.nn.Module]:
    shape = import_hf.model_shape(import_hf.read_hf_checkpoint(path))
    shape["moe"] = MoEConfig(**shape["moe"])
    cfg = replace_model(ModelConfig(), **shape, init_from=str(path))
    model = build_model(cfg, SEQ)
    materialize(model, "cpu", seed=0, load_weights=init_from.load)
    return cfg, model.eval()


def test_logits_equal_transformers_both_ways(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path, expected = save(tmp_path)
    cfg, model = ours(path)
    assert isinstance(cfg, GptOssConfig) and cfg.layer_pattern == "sliding, full" and cfg.sliding_window == 4
    assert cfg.rope_yarn_factor == 4.0 and not cfg.rope_yarn_truncate
    with torch.no_grad():
        logits = model(tokens())
    there = (logits - expected).abs().max().item()
    export_hf(model.state_dict(), cfg, tmp_path / "out", max_position_embeddings=64)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert type(hf).__name__ == "GptOssForCausalLM"
    with torch.no_grad():
        back = (hf(tokens()).logits - logits).abs().max().item()
    print(f"gpt_oss: HF -> framework {there:.2e}; framework -> HF {back:.2e}")
    assert there <= TOL and back <= TOL, (there, back)


def test_cached_decode_equals_the_full_forward(tmp_path: Path) -> None:
    path, expected = save(tmp_path)
    _, model = ours(path)
    x = tokens()
    cache = KVCache.empty(model, x.shape[0], SEQ)
    assert cache.windows == [4, 0]
    forward_cached(model, x[:, :5], cache)
    for i in range(5, SEQ):
        last = forward_cached(model, x[:, i : i + 1], cache)
    torch.testing.assert_close(last, expected[:, -1], rtol=1e-5, atol=1e-5)
