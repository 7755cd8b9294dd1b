"""``export-hf``'s two exports from a run's checkpoint: the run's ``config.yaml`` read here, at the
command's entry, and each group handed down (framework.checkpoint.export_hf writes the folder,
framework.checkpoint.export_lora the adapter's).
"""

from __future__ import annotations

from pathlib import Path

from framework.checkpoint.export_hf import check_out_dir, checkpoint_model_state, export_hf
from framework.checkpoint.export_lora import export_adapter
from framework.checkpoint.init_from import framework_checkpoint, load, saved_shape, with_shape
from framework.config.run_file import read_run_config
from framework.config.schema import ModelConfig
from framework.models import lora


def export_checkpoint(
    checkpoint: Path, out_dir: Path, run_config: Path | None = None, force: bool = False
) -> Path:
    """``python -m framework export-hf``: a framework checkpoint -> a Hugging Face folder.

    ``checkpoint``: a ``step_N`` dir, a checkpoint root or a run dir (its newest complete
    checkpoint). The model shape comes from the checkpoint (``extra.json``) or the run's
    ``config.yaml`` (``run_config``, default two levels above the step dir), which also gives the
    tokenizer. ``max_position_embeddings`` is the model's own (``model.max_position_embeddings``,
    which ``model.init_from`` took from its source), else the training ``seq_len``. Raises ValueError when the
    path is not a checkpoint or its shape cannot be found, or OUT holds what export-hf did not
    write (unless ``force``).
    """
    from framework.data.tokenizer import load_tokenizer

    checkpoint = Path(checkpoint).expanduser().resolve()
    step_dir = framework_checkpoint(checkpoint, "CHECKPOINT") if checkpoint.is_dir() else None
    if step_dir is None:
        raise ValueError(
            f"CHECKPOINT={str(checkpoint)!r} is not a framework checkpoint; valid: a step_N dir "
            "(with manifest.json), a checkpoint root or a run dir holding one"
        )
    check_out_dir(Path(out_dir), step_dir, force)
    given = run_config is not None  # a --config that is missing is refused, the default may be
    run_config = Path(run_config) if run_config is not None else step_dir.parent.parent / "config.yaml"
    cfg = read_run_config(run_config, f"--config {run_config}") if given or run_config.is_file() else None
    shape = saved_shape(step_dir)
    if cfg is None and shape is None:
        raise ValueError(
            f"{step_dir}: no model shape (no 'model' in extra.json, no {run_config}); "
            "pass --config RUN_DIR/config.yaml of the run that saved it"
        )
    model_cfg = cfg.model if cfg is not None else ModelConfig()
    model_cfg = with_shape(model_cfg, shape, init_from=None)
    tokenizer = load_tokenizer(cfg.tokenizer) if cfg is not None else None
    seq_len = cfg.train.seq_len if cfg is not None else 2048
    state = checkpoint_model_state(step_dir)
    if cfg is not None and cfg.peft.method.value == "lora":  # adapters only: the base rebuilt, merged
        state = lora.merge(
            lora.with_base(state, cfg.peft, model_cfg, cfg.model.init_from, cfg.train, load), cfg.peft
        )
    context = model_cfg.max_position_embeddings or seq_len
    source = cfg.model.init_from if cfg is not None else None
    return export_hf(state, model_cfg, out_dir, context, tokenizer, source)


def export_adapter_checkpoint(
    checkpoint: Path, out_dir: Path, run_config: Path | None = None, force: bool = False
) -> Path:
    """``export-hf --adapter``: a LoRA run's checkpoint -> a PEFT adapter folder, with
    ``export_checkpoint``'s checks of CHECKPOINT and OUT. The run's ``config.yaml`` gives the
    ``peft`` settings and the base (``model.init_from``, recorded as ``base_model_name_or_path``).
    Raises ValueError (one line) before writing anything."""
    checkpoint = Path(checkpoint).expanduser().resolve()
    step_dir = framework_checkpoint(checkpoint, "CHECKPOINT") if checkpoint.is_dir() else None
    if step_dir is None:
        raise ValueError(f"CHECKPOINT={str(checkpoint)!r} is not a framework checkpoint; valid: a step_N dir")
    check_out_dir(Path(out_dir), step_dir, force)
    run_config = Path(run_config) if run_config is not None else step_dir.parent.parent / "config.yaml"
    if not run_config.is_file():
        raise ValueError(f"--adapter: no {run_config}; pass --config RUN_DIR/config.yaml of the LoRA run")
    cfg = read_run_config(run_config, f"--config {run_config}")
    if cfg.peft.method.value != "lora":
        raise ValueError(
            f"--adapter: {run_config} has peft.method={cfg.peft.method.value}; valid: a LoRA run's"
        )
    model_cfg = with_shape(cfg.model, saved_shape(step_dir), init_from=None)
    state = lora.with_base(
        checkpoint_model_state(step_dir), cfg.peft, model_cfg, cfg.model.init_from, cfg.train, load
    )
    return export_adapter(state, model_cfg, cfg.peft, out_dir, cfg.model.init_from)
