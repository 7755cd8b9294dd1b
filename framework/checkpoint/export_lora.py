"""LoRA exports (``peft.method=lora``): merged weights (an ordinary HF folder, framework.checkpoint.export_hf)
or a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) that
``peft.PeftModel.from_pretrained(base, folder)`` loads onto the base model.

The adapter's names are peft's: ``base_model.model.<HF module>.lora_A.weight``. Our RoPE rotates
interleaved pairs and HF rotates halves, so the export permutes the rows of ``wq``/``wk`` inside each
head (framework.checkpoint.export_hf); for ``W + s * B @ A`` the rows of ``W`` are the rows of ``B``,
so ``lora_B`` of q/k is permuted the same way and ``lora_A`` is copied as it is.

A LoRA checkpoint holds the adapters only (framework.checkpoint.state): the base is rebuilt as the run
built it, from ``model.init_from`` or the seeded init (``framework.models.lora.with_base``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from framework.checkpoint.export_hf import (
    finish_export,
    permute_rope_rows,
    save_safetensors,
)
from framework.config.schema import ModelConfig, PeftConfig
from framework.models import lora, model_spec

ADAPTER_CONFIG, ADAPTER_WEIGHTS = lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS


def to_peft_state(state: dict[str, torch.Tensor], model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The adapters of a full state dict under peft's names (q/k ``lora_B`` rows permuted)."""
    spec = model_spec(model_cfg)
    names, rope = spec.hf_names(), spec.rope_heads()
    out = {}
    for k, v in state.items():
        if not lora.is_lora_name(k):
            continue
        module, kind = k.removesuffix(".weight").rsplit(".", 1)
        base = f"{module}.weight"
        hf_module = names[base].removesuffix(".weight")
        if kind == "lora_B" and base in rope:
            v = permute_rope_rows(v, rope[base])
        out[f"base_model.model.{hf_module}.{kind}.weight"] = v.detach().to("cpu").contiguous().clone()
    return out


def adapter_config(cfg: PeftConfig, hf_modules: list[str], base: str | None) -> dict[str, object]:
    """``adapter_config.json`` (peft's LoraConfig fields). ``target_modules`` lists the full HF module
    names: peft matches a name equal to one or ending in ``.`` + one, so exactly these layers."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": sorted(hf_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def export_adapter(
    state: dict[str, torch.Tensor], model_cfg: ModelConfig, cfg: PeftConfig, out_dir: Path, base: str | None
) -> Path:
    """Write the PEFT adapter folder of a full state dict (rank 0 only); return ``out_dir``."""
    tensors = to_peft_state(state, model_cfg)
    if not tensors:
        raise ValueError(
            "--adapter: the checkpoint has no LoRA adapters (peft.method=none); valid: a LoRA run"
        )
    modules = sorted({k.removeprefix("base_model.model.").rsplit(".", 2)[0] for k in tensors})
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, out_dir / ADAPTER_WEIGHTS)
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(cfg, modules, base), indent=2) + "\n")
    marker = {"written_by": "framework.checkpoint export-hf --adapter", "architecture": ["PEFT LoRA"]}
    finish_export(out_dir, marker, [ADAPTER_WEIGHTS, ADAPTER_CONFIG])
    return out_dir
