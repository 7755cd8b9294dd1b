"""framework.launch.source: a run's config.yaml with command-line overrides, composed under the
run's own model family (a family's own key exists only under its schema)."""

from __future__ import annotations

from omegaconf import OmegaConf

from framework.config.schema import MistralConfig, to_config, to_yaml
from framework.launch import recipes, source


def test_overrides_of_a_run_are_composed_under_its_family() -> None:
    run = OmegaConf.create(to_yaml(recipes.compose_recipe("mistral_tiny")))
    cfg = to_config(source.merged(run, ["model.sliding_window=8", "train.seq_len=64"]))
    assert (type(cfg.model), cfg.model.sliding_window, cfg.train.seq_len) == (MistralConfig, 8, 64)
    assert cfg.model.dim == 128 and cfg.model.name == "mistral_tiny"  # the run's own shape is kept
    assert source.family_choice("mistral", ["model"]) == []  # the command line picks the family itself
    assert source.family_choice("gpt2", []) == []  # not a family here: the shipped default composes
