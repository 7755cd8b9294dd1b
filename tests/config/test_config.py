"""Every shipped option of every group, and every recipe, composes against the typed schema."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from framework.config import schema as config
from framework.config.schema import Config, Strategy, quote_numeric_choices, to_config
from framework.launch import recipes
from framework.launch.ranks import register_resolvers
from framework.models import build_model, num_params

CONF = Path(__file__).resolve().parents[2] / "conf"
config.register()
recipes.register()
register_resolvers()


def compose_config(*overrides: str) -> Config:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return to_config(compose("config", overrides=quote_numeric_choices(list(overrides))))


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("group", [g for g in config.GROUPS if g != "recipe"])
def test_every_group_option_composes(group: str) -> None:
    options = group_options(group)
    assert options, f"group {group} ships no option"
    for option in options:
        cfg = compose_config(f"{group}={option}")
        assert isinstance(cfg, Config)


def test_schema_defaults_are_the_composed_defaults() -> None:
    """The config reference (docs/config.md, --help) shows the schema's defaults: they must be what
    ``python train.py`` composes. The recipe-owned groups (model, data, train) are the recipe's."""
    composed = config.flatten(
        OmegaConf.to_container(OmegaConf.structured(compose_config()), enum_to_str=True)
    )
    schema = config.flatten(OmegaConf.to_container(OmegaConf.structured(Config()), enum_to_str=True))
    differ = {
        k: (schema.get(k), composed.get(k))
        for k in composed.keys() | schema.keys()
        if not k.startswith(("model.", "data.", "train.")) and composed.get(k) != schema.get(k)
    }
    # The default sharding option (auto) lets the planner pick the checkpointing; the presets keep
    # the schema's none (the field's comment in the reference says so). The default checkpoint
    # option (final) saves once at the end; a Config() built in code saves only when asked (the
    # field's comment in the reference says so).
    assert differ == {
        "sharding.activation_checkpointing": ("none", "auto"),
        "checkpoint.enabled": (False, True),
    }


def test_mesh_shape_and_numeric_choice() -> None:
    cfg = compose_config("mesh=2x4")
    assert cfg.mesh.shape == [2, 4] and cfg.mesh.world_size == 8
    assert (cfg.mesh.nodes, cfg.mesh.procs_per_node) == (2, 4)
    assert compose_config("mesh=4").mesh.world_size == 4


@pytest.mark.parametrize("name", sorted(recipes.discover()))
def test_every_recipe_composes_and_builds_on_meta(name: str) -> None:
    cfg = compose_config(f"recipe={name}")
    assert cfg.model.name == name
    model = build_model(cfg.model, cfg.train.seq_len)  # meta device: a 70B shape costs nothing
    assert next(model.parameters()).device.type == "meta"
    assert sum(p.numel() for p in model.parameters()) == num_params(cfg.model)


def test_published_shapes() -> None:
    # Parameter counts of the real models these recipes copy (Meta's and Qwen's model cards).
    expected = {"llama1b": 1.24e9, "llama7b": 6.74e9, "llama3_8b": 8.03e9, "llama70b": 70.6e9}
    expected |= {"qwen3_0_6b": 0.6e9, "qwen3_8b": 8.2e9}
    for name, n in expected.items():
        got = num_params(compose_config(f"recipe={name}").model)
        assert abs(got - n) / n < 0.01, (name, got)


def test_default_recipe_and_typed_values() -> None:
    cfg = compose_config()
    assert cfg.model.name == "llama_tiny"
    assert cfg.sharding.strategy is Strategy.auto  # the planner's choice (framework.planner.search)


def test_command_line_beats_recipe() -> None:
    cfg = compose_config("recipe=llama_tiny", "train.steps=7", "model.dim=64")
    assert cfg.train.steps == 7 and cfg.model.dim == 64


@pytest.mark.parametrize(
    "override, error",
    [
        ("train.stepz=3", ConfigCompositionException),
        ("run.device=gpu", ConfigCompositionException),
        ("train.steps=many", ConfigCompositionException),
        ("sharding=bogus", ConfigCompositionException),
        ("recipe=nope", ConfigCompositionException),
    ],
)
def test_bad_overrides_fail_at_compose_time(override: str, error: type) -> None:
    with pytest.raises((error, ConfigKeyError, ValidationError)):
        compose_config(override)


def test_quote_numeric_choices() -> None:
    assert quote_numeric_choices(["mesh=4", "mesh=2,4", "mesh=2x4", "train.steps=4"]) == [
        "mesh='4'",
        "mesh='2','4'",
        "mesh=2x4",
        "train.steps=4",
    ]


def test_the_model_group_gives_each_family_its_schema() -> None:
    """Each option of the model group is its family's schema: the shared keys plus its own, chosen by
    ``model=NAME``, by ``model.family=NAME`` (the command line before the group) or by a recipe."""
    from framework.config.schema import LlamaConfig, MistralConfig, ModelFamily, Qwen3Config

    assert type(compose_config().model) is LlamaConfig
    assert not hasattr(compose_config().model, "sliding_window")
    assert type(compose_config("model=qwen3").model) is Qwen3Config
    qwen3 = compose_config("model.family=qwen3").model
    assert (type(qwen3), qwen3.family, qwen3.name) == (Qwen3Config, ModelFamily.qwen3, "llama_tiny")
    mistral = compose_config("recipe=mistral_tiny").model
    assert (type(mistral), mistral.family, mistral.sliding_window) == (MistralConfig, ModelFamily.mistral, 64)
    assert compose_config("model=mistral", "model.sliding_window=8").model.sliding_window == 8
    assert type(compose_config("recipe=qwen3_0_6b").model) is Qwen3Config


def test_a_family_key_under_another_family_fails_at_compose_time() -> None:
    with pytest.raises(ConfigCompositionException, match="Could not override 'model.sliding_window'") as e:
        compose_config("model.sliding_window=4096")
    assert "Key 'sliding_window' not in 'LlamaConfig'" in str(e.value.__cause__)
    with pytest.raises(ValueError, match=r"^model.family=qwen3 but the model group's option is mistral; "
                       r"select the family with model=qwen3 alone"):  # fmt: skip
        compose_config("model=mistral", "model.family=qwen3")


def test_a_run_config_yaml_converts_into_its_familys_schema() -> None:
    """A run's untyped config.yaml (evaluate, generate, resume read it back) gets the schema its
    ``family`` names; another family's key in it is refused."""
    from framework.config.schema import MistralConfig

    saved = OmegaConf.create(config.to_yaml(compose_config("recipe=mistral_tiny")))
    back = to_config(saved)
    assert (type(back.model), back.model.sliding_window) == (MistralConfig, 64)
    saved.model.family = "llama"
    with pytest.raises(ConfigKeyError, match="Key 'sliding_window' not in 'LlamaConfig'"):
        to_config(saved)
