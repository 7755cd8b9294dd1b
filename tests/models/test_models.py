"""The model spec (framework.models) against the modules framework.models builds: every consumer
(planner, TP plan, float8, HF names) reads the spec, so the spec must be the model."""

from __future__ import annotations

import pytest

from framework.config.schema import ModelConfig, ModelFamily
from framework.models import TPStyle, blocks, build_model, model_spec

SHAPES = {
    "tiny_tied": ModelConfig(),
    "gqa_untied": ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, tie_embeddings=False),
    # Qwen3: q/k norms, and heads wider than dim / n_heads (4 x 32 = 128 > 64).
    "qwen3_hd32": ModelConfig(
        family=ModelFamily.qwen3, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=96
    ),
}


@pytest.mark.parametrize("cfg", SHAPES.values(), ids=SHAPES.keys())
def test_spec_is_the_model(cfg: ModelConfig) -> None:
    """Names, order and shapes of ``named_parameters()``; the TP styles name real modules of the
    right kind; units are the blocks; every parameter has a distinct HF name."""
    spec, model = model_spec(cfg), build_model(cfg, 16)
    assert [(n, w.shape) for n, w, _ in spec.params()] == [
        (n, tuple(p.shape)) for n, p in model.named_parameters()
    ]
    for name, w, unit in spec.params():
        module = model.get_submodule(name.removesuffix(".weight"))
        kind = type(module).__name__
        expected = {TPStyle.embedding: "Embedding", TPStyle.sequence: "RMSNorm", TPStyle.heads: "RMSNorm"}
        assert kind == expected.get(w.tp, "Linear"), (name, kind)
        assert unit == "root" or name.startswith(unit + ".")
    assert [model.get_submodule(u) for u in spec.units()] == blocks(model)
    names = spec.hf_names()
    assert len(set(names.values())) == len(names)
    assert ("output.weight" in dict((n, 0) for n, _, _ in spec.params())) is not cfg.tie_embeddings
    rotated = ("wq", "wk", "q_norm", "k_norm") if cfg.family is ModelFamily.qwen3 else ("wq", "wk")
    assert set(spec.rope_heads()) == {
        f"layers.{i}.attention.{w}.weight" for i in range(cfg.n_layers) for w in rotated
    }
