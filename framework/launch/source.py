"""A model to evaluate or sample from, named by one path: a run dir, a framework checkpoint, or a
Hugging Face folder (``config.json`` + safetensors, its tokenizer beside it).

Why in the launch layer: the config is composed and checked as a launch does it. ``KEY=VALUE`` and
``GROUP=OPTION`` overrides (``data=sft data.path=...``) are composed by Hydra from conf/, and the
result passes ``framework.launch.prelaunch.validate`` (every rule, ``model.init_from``'s checks, the data
and tokenizer checks), so a bad value is the one line a training launch gives. The weights are then
read the way ``model.init_from`` reads them (framework.checkpoint.init_from): the source is the
``model.init_from`` of the config, whatever layout saved it.

- A run dir or checkpoint: the run's ``config.yaml`` (its tokenizer, seq_len, data), with each group
  or key the command line names taken from the composed overrides instead.
- A Hugging Face folder: the shipped defaults, the shape from its config.json, its own tokenizer
  (``tokenizer.json``: ``tokenizer=hf``; ``tokenizer.model``: ``tokenizer=sentencepiece``) unless the
  command line names one. A folder whose tokenizer has more tokens than its model's embedding is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from framework.checkpoint import import_hf, init_from
from framework.config.schema import (
    GROUPS,
    Config,
    ModelFamily,
    PeftMethod,
    TokenizerConfig,
    TokenizerKind,
    family_of,
)
from framework.data.tokenizer import Tokenizer, load_tokenizer
from framework.models import Decoder, build_model, materialize


@dataclass
class Source:
    cfg: Config
    model: Decoder
    tokenizer: Tokenizer
    weights: Path  # the step dir or HF folder the weights were read from
    run_config: Path | None  # the run's config.yaml, for a run dir or checkpoint


def compose(overrides: list[str]) -> DictConfig:
    """conf/'s config with ``overrides``, composed by Hydra as ``python train.py`` composes it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from framework.config import schema as config
    from framework.launch import recipes
    from framework.launch.ranks import register_resolvers

    config.register()
    recipes.register()
    register_resolvers()
    try:
        with initialize_config_dir(config_dir=str(recipes.CONF_DIR), version_base="1.3"):
            dcfg = hydra_compose("config", overrides=config.quote_numeric_choices(list(overrides)))
    except (HydraException, OmegaConfBaseException) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"overrides {' '.join(overrides)!r} do not compose: {first}") from None
    return dcfg


def override_keys(overrides: list[str]) -> list[str]:
    """The keys the overrides set (``data=sft`` -> ``data``, ``+train.x=1`` -> ``train.x``)."""
    keys = []
    for o in overrides:
        key, sep, _ = o.partition("=")
        if not sep:
            raise ValueError(f"{o!r} is not an override; valid: KEY=VALUE or GROUP=OPTION (e.g. data=sft)")
        keys.append(key.lstrip("+~"))
    return keys


def merged(base: DictConfig, overrides: list[str]) -> DictConfig:
    """``base`` (a run's config.yaml) with what ``overrides`` name taken from their composition: a
    group option (``data=sft``) replaces the whole group, then each ``a.b=v`` its key."""
    keys = override_keys(overrides)
    composed = compose([*family_choice(family_of(base.get("model")).value, keys), *overrides])
    out = base.copy()
    for key in keys:
        if key in GROUPS and "." not in key:
            target = key.replace("/", ".")
            OmegaConf.update(out, target, OmegaConf.select(composed, target), merge=False)
    for key in keys:
        if "." in key or key not in GROUPS:
            OmegaConf.update(out, key, OmegaConf.select(composed, key), merge=False)
    return out


def family_choice(family: str | None, keys: list[str]) -> list[str]:
    """``model=FAMILY`` for composing the overrides under the source's family (``model.sliding_window=8``
    exists only under Mistral's schema); none when the command line picks the family itself."""
    picks = any(k in ("model", "model.family") for k in keys)
    return [] if picks or family not in {f.value for f in ModelFamily} else [f"model={family}"]


def own_tokenizer(folder: Path, overrides: list[str]) -> TokenizerConfig | None:
    """An HF folder's own tokenizer; None when the command line names one."""
    if any(k == "tokenizer" or k.startswith("tokenizer.") for k in override_keys(overrides)):
        return None
    for name, kind in (
        ("tokenizer.json", TokenizerKind.hf),
        ("tokenizer.model", TokenizerKind.sentencepiece),
    ):
        if (folder / name).is_file():
            return TokenizerConfig(kind=kind, path=str(folder))
    raise ValueError(
        f"{folder} is a Hugging Face folder without a tokenizer (no tokenizer.json or tokenizer.model); "
        "name one: tokenizer=hf tokenizer.path=<folder or tokenizer.json>"
    )


def check_own_vocab(folder: Path, tokenizer: TokenizerConfig) -> None:
    """An HF folder whose own tokenizer has ids past its model's embedding: one line naming both
    sizes (a smaller tokenizer is fine: Qwen pads its embedding)."""
    ckpt = import_hf.read_hf_checkpoint(folder, "PATH")
    vocab = ckpt.config.get("vocab_size")
    tok = load_tokenizer(tokenizer)
    if isinstance(vocab, int) and tok.vocab_size > vocab:
        raise ValueError(
            f"{folder}: its tokenizer has {tok.vocab_size} tokens but its config.json has vocab_size={vocab}: "
            f"the tokenizer and the model disagree (ids {vocab}..{tok.vocab_size - 1} have no embedding row); "
            "valid: a folder whose tokenizer fits its model, or tokenizer.path=<that model's tokenizer>"
        )


def source_config(
    path: Path, overrides: list[str], evaluate_data: bool
) -> tuple[Config, Path | None, Path | None]:
    """The checked, typed config whose ``model.init_from`` is the source's weights, the run's
    config.yaml (None for an HF folder) and, for a LoRA run (``peft=lora``), the checkpoint that
    holds its adapters (else None). ``evaluate_data``: the command evaluates a data set (no
    validation split is needed: ``train.eval_every=0``).

    A LoRA run's checkpoint holds the adapters only: its config keeps the run's ``model.init_from``
    (the base, or none: the seeded init) and ``peft`` (the adapters come from the checkpoint, not
    from the ``peft.adapter`` folder the run may have started from)."""
    from framework.generate.decode import find_run_config, load_run_config, resolve_checkpoint
    from framework.launch.prelaunch import validate
    from framework.planner.resolve import resolve_batch
    from framework.planner.search import maybe_search

    path = path.expanduser().resolve()
    if not path.exists():
        raise ValueError(
            f"{path} does not exist; valid: a run dir, a checkpoint (step dir) or a Hugging Face folder"
        )
    run_config = adapters = None
    if import_hf.is_hf_checkpoint(path):
        tokenizer = own_tokenizer(path, overrides)
        own = []
        if tokenizer is not None:
            check_own_vocab(path, tokenizer)
            own = [f"tokenizer={tokenizer.kind.value}", f"tokenizer.path={tokenizer.path}"]
        family = import_hf.read_hf_checkpoint(path, "PATH").config.get("model_type")
        dcfg = compose([*own, *family_choice(family, override_keys(overrides)), *overrides])
        OmegaConf.update(dcfg, "model.init_from", str(path))
    else:
        run_config = find_run_config(path)
        run = load_run_config(run_config)
        checkpoint = resolve_checkpoint(path, run)
        dcfg = merged(OmegaConf.load(run_config), overrides) if overrides else OmegaConf.load(run_config)
        if run.peft.method is PeftMethod.lora:
            adapters = checkpoint
            OmegaConf.update(dcfg, "peft.adapter", None)
        else:
            OmegaConf.update(dcfg, "model.init_from", str(checkpoint))
    if evaluate_data:
        OmegaConf.update(dcfg, "train.eval_every", 0)
    elif OmegaConf.select(dcfg, "train.eval_every") == 0:
        OmegaConf.update(dcfg, "train.eval_every", 1)  # the run's validation batches are built
    OmegaConf.update(dcfg, "checkpoint.resume", "none")  # nothing here resumes or writes a checkpoint
    OmegaConf.update(dcfg, "train.warmup_steps", 0)  # nor trains: no warning about the schedule
    dcfg = OmegaConf.masked_copy(dcfg, [k for k in dcfg if k != "hydra"])
    cfg = validate(dcfg, overrides)
    found = maybe_search(cfg)  # the batch and layout as a launch resolves them (train.micro_batch_size=0)
    return (found.chosen_cfg if found is not None else resolve_batch(cfg)), run_config, adapters


def load_source(
    path: Path, overrides: list[str], device: torch.device, evaluate_data: bool = False
) -> Source:
    """The model of ``path`` on ``device``, unsharded, in eval mode, with its tokenizer."""
    from framework.data.pipeline import document_eos

    cfg, run_config, adapters = source_config(path, overrides, evaluate_data)
    if adapters is not None:
        from framework.generate.decode import lora_model

        model = lora_model(cfg, device, adapters, document_eos(cfg.data, cfg.tokenizer))
        return Source(cfg, model.eval(), load_tokenizer(cfg.tokenizer), adapters, run_config)
    model = build_model(cfg.model, cfg.train.seq_len, document_eos(cfg.data, cfg.tokenizer))
    materialize(model, device, cfg.train.seed, init_from.load)
    assert cfg.model.init_from is not None
    return Source(cfg, model.eval(), load_tokenizer(cfg.tokenizer), Path(cfg.model.init_from), run_config)
