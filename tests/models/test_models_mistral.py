"""framework.models.mistral against transformers' ``MistralForCausalLM``: a tiny random model whose
sliding window (4) is shorter than the sequence (16), so the window decides the logits. Both ways:
HF weights -> ``model.init_from``'s converter -> our logits, and our export -> transformers loads
it -> its logits; plus the KV-cache decode against the full forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is in the dev extra: the parity tests compare with its models")

from framework.checkpoint import export_hf, import_hf, init_from  # noqa: E402
from framework.checkpoint.export_hf import hf_config  # noqa: E402
from framework.config.schema import MistralConfig, ModelConfig, ModelFamily, replace_model  # noqa: E402
from framework.models import FAMILIES, KVCache, build_model, forward_cached, materialize, model_spec  # noqa: E402

SEQ, WINDOW, TOL = 16, 4, 1e-5


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))


def make_hf(out: Path, window: int | None) -> torch.Tensor:
    """A random MistralForCausalLM saved to ``out``; returns its logits on ``tokens()``."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(3)
    config = MistralConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        sliding_window=window,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    model = MistralForCausalLM(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        logits = model(tokens()).logits
    model.save_pretrained(out)
    return logits


def hf_logits(path: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    assert type(model).__name__ == "MistralForCausalLM"
    with torch.no_grad():
        return model(tokens()).logits


def imported(path: Path) -> tuple[ModelConfig, torch.nn.Module]:
    shape = import_hf.model_shape(import_hf.read_hf_checkpoint(path))
    cfg = replace_model(ModelConfig(), **shape, init_from=str(path))  # a Llama default -> Mistral's schema
    model = build_model(cfg, SEQ)
    materialize(model, "cpu", seed=0, load_weights=init_from.load)  # model.init_from: the HF weights
    return cfg, model.eval()


def test_record_and_spec() -> None:
    rec = FAMILIES[ModelFamily.mistral]
    spec = model_spec(MistralConfig(sliding_window=WINDOW))
    assert rec.config is MistralConfig
    assert (rec.hf_architecture, spec.hf_model_type, spec.sliding_window) == (
        "MistralForCausalLM",
        "mistral",
        4,
    )
    assert model_spec(ModelConfig()).sliding_window == 0  # the default Llama: full causal attention


def test_logits_equal_transformers_both_ways(tmp_path: Path) -> None:
    expected = make_hf(tmp_path / "hf", WINDOW)
    cfg, model = imported(tmp_path / "hf")
    assert (type(cfg), cfg.family, cfg.sliding_window) == (MistralConfig, ModelFamily.mistral, WINDOW)
    with torch.no_grad():
        ours = model(tokens())
    there = (ours - expected).abs().max().item()
    export_hf(model.state_dict(), cfg, tmp_path / "out", max_position_embeddings=64)
    back = (hf_logits(tmp_path / "out") - ours).abs().max().item()
    print(f"mistral HF -> framework max |logits diff| {there:.2e}; framework -> HF {back:.2e}")
    assert there <= TOL and back <= TOL, (there, back)
    # The window matters: the same weights without it give other logits (the test can fail).
    model.sliding_window = None
    with torch.no_grad():
        assert (model(tokens()) - expected).abs().max().item() > 1e-3


def test_init_from_a_mistral_folder_gives_mistrals_schema(tmp_path: Path) -> None:
    """``model.init_from`` on a Llama recipe (the default) with a Mistral folder: the family, its
    schema and its window come from config.json, as the shape does."""
    from framework.config.schema import Config
    from tests.checkpoint.test_init_from import resolve

    make_hf(tmp_path / "hf", WINDOW)
    cfg = resolve(Config(model=ModelConfig(init_from=str(tmp_path / "hf"))), [])
    assert (type(cfg.model), cfg.model.sliding_window, cfg.model.dim) == (MistralConfig, WINDOW, 64)


def test_no_window_is_llama_attention(tmp_path: Path) -> None:
    """``sliding_window: null`` in config.json is our 0 (off), both ways."""
    expected = make_hf(tmp_path / "hf", None)
    cfg, model = imported(tmp_path / "hf")
    assert cfg.sliding_window == 0
    with torch.no_grad():
        assert (model(tokens()) - expected).abs().max().item() <= TOL
    assert hf_config(cfg, torch.float32, 64)["sliding_window"] is None


def test_cached_decode_keeps_the_window() -> None:
    """Token by token through the KV cache, the last position's logits equal the full forward's."""
    cfg = MistralConfig(sliding_window=WINDOW, vocab_size=256)
    model = build_model(cfg, SEQ)
    materialize(model, "cpu", seed=0)
    x = tokens()
    cache = KVCache.empty(model, x.shape[0], SEQ)
    forward_cached(model, x[:, :5], cache)
    for i in range(5, SEQ):
        last = forward_cached(model, x[:, i : i + 1], cache)
    with torch.no_grad():
        torch.testing.assert_close(last, model(x)[:, -1], rtol=1e-5, atol=1e-5)


def test_the_window_is_a_key_of_the_mistral_schema_only() -> None:
    """The window exists only in Mistral's schema: a Llama config has no such key, and a Mistral
    one built as the shared ``ModelConfig`` is refused in one line naming the schema."""
    from framework.config.schema import Config
    from framework.launch import rules

    assert not hasattr(ModelConfig(), "sliding_window")
    with pytest.raises(ValueError, match=r"^model.family=mistral needs its schema MistralConfig \(its keys: sliding_window\)"):
        ModelConfig(family=ModelFamily.mistral)
    with pytest.raises(ValueError, match=r"^model.sliding_window=-1 is not valid; valid: an integer >= 0"):
        rules.check(Config(model=MistralConfig(sliding_window=-1)))
    rules.check(Config(model=MistralConfig(sliding_window=4)))  # accepted where it applies
    rules.check(Config())  # a Llama: the window's rule does not apply (no such key)
