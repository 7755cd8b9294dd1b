"""A model as a stack of layer kinds (framework.models.spec.LayerKind, ``layer_pattern``): the pattern
language, the spec's per-layer readers, the pipeline cut by cost when layers differ, and the decoder
trunk running layers of several attention windows, against transformers' Qwen3 with its
``layer_types`` (one sliding-window layer, one full)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from framework.config.schema import ModelConfig
from framework.models import (
    KVCache,
    LayerKind,
    MLPKind,
    build_model,
    forward_cached,
    layer_pattern,
    model_spec,
)
from framework.planner.stages import _split

DENSE = LayerKind("dense", (), 10)
MOE = LayerKind("moe", (), 30, mlp=MLPKind.moe)
KINDS = {"dense": DENSE, "moe": MOE}


def test_pattern_items_groups_and_repeats() -> None:
    assert layer_pattern("dense x3, moe x2", KINDS) == (DENSE,) * 3 + (MOE,) * 2
    assert layer_pattern("[dense, moe] x2, dense", KINDS) == (DENSE, MOE, DENSE, MOE, DENSE)
    assert layer_pattern("moe", KINDS) == (MOE,)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "dense x3, mlp x2",
            r"^model.layer_pattern='dense x3, mlp x2' names the layer kind 'mlp'; valid: dense\|moe$",
        ),
        (
            "dense x3 moe",
            r"^model.layer_pattern='dense x3 moe' does not parse at 'dense x3 moe'; valid: items NAME",
        ),
        ("", r"^model.layer_pattern='' has no layer; valid: a pattern of kinds dense\|moe$"),
    ],
)
def test_a_bad_pattern_is_one_line_naming_it(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        layer_pattern(text, KINDS, "model.layer_pattern")


def test_the_spec_of_an_existing_family_is_one_kind_repeated() -> None:
    spec = model_spec(ModelConfig())
    ((kind, n),) = spec.kinds()
    assert (kind.name, n, spec.n_layers, spec.uniform) == (
        "dense",
        ModelConfig().n_layers,
        ModelConfig().n_layers,
        True,
    )
    assert spec.kinds(range(1, 3)) == ((kind, 2),)
    # params() walks each layer's own kind, in named_parameters() order
    model = build_model(ModelConfig(), 16)
    assert [n for n, _, _ in spec.params()] == [n for n, _ in model.named_parameters()]


def test_a_pipeline_cuts_layers_of_several_kinds_by_cost() -> None:
    """Four cheap layers then four three-times dearer ones over two stages: by count the cut is 4 | 4,
    by cost the first stage takes more layers (the stack's first MoE layer too)."""
    assert _split(8, 2, 0.0, 0.0) == ((0, 4), (4, 8))
    weights = (0.5,) * 4 + (1.5,) * 4
    assert _split(8, 2, 0.0, 0.0, weights) == ((0, 5), (5, 8))


SEQ, WINDOW = 16, 4


def _tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))


def test_layers_of_several_windows_equal_transformers_layer_types(tmp_path: Path) -> None:
    """Qwen3 with ``layer_types = [sliding_attention, full_attention]`` (window 4 < seq 16): our trunk
    with the same weights and per-layer windows gives its logits, in the full forward and token by
    token through the KV cache (each layer keeps its own window)."""
    pytest.importorskip("transformers")
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from framework.checkpoint import import_hf, init_from
    from framework.config.schema import replace_model
    from framework.models import materialize

    torch.manual_seed(3)
    hf = Qwen3Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        use_sliding_window=True,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    reference = Qwen3ForCausalLM(hf).eval()
    with torch.no_grad():
        expected = reference(_tokens()).logits
    hf.use_sliding_window = False  # our importer reads the shape; the windows are set below
    reference.config.use_sliding_window = False
    reference.config.layer_types = ["full_attention"] * 2
    reference.save_pretrained(tmp_path / "hf")
    shape = import_hf.model_shape(import_hf.read_hf_checkpoint(tmp_path / "hf"))
    cfg = replace_model(ModelConfig(), **shape, init_from=str(tmp_path / "hf"))
    model = build_model(cfg, SEQ)
    materialize(model, "cpu", seed=0, load_weights=init_from.load)
    model.eval()
    with torch.no_grad():
        full = model(_tokens())
        assert (full - expected).abs().max().item() > 1e-3  # the window matters here
        model.layer_windows = {"0": WINDOW, "1": 0}
        ours = model(_tokens())
    assert (ours - expected).abs().max().item() <= 1e-5
    x = _tokens()
    cache = KVCache.empty(model, x.shape[0], SEQ)
    assert cache.windows == [WINDOW, 0]
    forward_cached(model, x[:, :5], cache)
    for i in range(5, SEQ):
        last = forward_cached(model, x[:, i : i + 1], cache)
    torch.testing.assert_close(last, expected[:, -1], rtol=1e-5, atol=1e-5)
