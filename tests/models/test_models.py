"""The model spec (framework.models) against the modules framework.models builds: every consumer
(planner, TP plan, float8, HF names) reads the spec, so the spec must be the model."""

from __future__ import annotations

import pytest

from framework.config.schema import ModelConfig
from framework.models import FAMILIES, TPStyle, blocks, build_model, model_spec

# Every family of the registry at its record's tiny shape, and two shared layouts.
SHAPES = {
    "tiny_tied": ModelConfig(),
    "gqa_untied": ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, tie_embeddings=False),
    **{fam.name: fam.tiny_config() for fam in FAMILIES.values()},
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
        module = model.get_submodule(name.removesuffix(f".{w.param}"))
        kind = type(module).__name__
        expected = {TPStyle.embedding: "Embedding", TPStyle.sequence: "RMSNorm", TPStyle.heads: "RMSNorm"}
        # An MoE layer's router and stacked experts, and a sublayer TP leaves whole (multi-head latent
        # attention, GPT-OSS's attention with sinks): any module, run whole on every TP rank.
        if w.tp not in (TPStyle.moe, TPStyle.replicated):
            assert kind == expected.get(w.tp, "Linear"), (name, kind)
        assert unit == "root" or name.startswith(unit + ".")
    assert [model.get_submodule(u) for u in spec.units()] == blocks(model)
    names = spec.hf_names()
    assert len(set(names.values())) == len(names)
    assert ("output.weight" in dict((n, 0) for n, _, _ in spec.params())) is not cfg.tie_embeddings
    # RoPE rotates the q and k projections' rows, and a per-head norm over them (Qwen3's q/k norms)
    # sees the rotated features: the rows each of them holds per head are permuted on the way to HF.
    # (DeepSeek-V3's latent attention has no wq / wk: its decoupled RoPE heads need no permutation.)
    heads = {n.rsplit(".", 2)[-2] for n, w, _ in spec.params() if w.tp is TPStyle.heads}
    params = {n for n, _, _ in spec.params()}
    assert set(spec.rope_heads()) == {
        f"layers.{i}.attention.{w}.{p}"
        for i in range(cfg.n_layers)
        for w in ("wq", "wk", *heads)
        for p in ("weight", "bias")
    } & params
