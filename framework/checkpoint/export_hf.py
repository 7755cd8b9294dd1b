"""Export to Hugging Face ``LlamaForCausalLM``: ``model.safetensors`` + ``config.json``.

Names map one to one (torchtitan -> HF), except for one numerical subtlety: our RoPE rotates
interleaved pairs ``(x[2i], x[2i+1])`` as Meta's original code does, while HF rotates halves
``(x[i], x[i + d/2])``. Permuting the rows of ``wq`` and ``wk`` inside each head (pairs -> halves)
makes HF's attention compute the same scores; this is the permutation of HF's own
``convert_llama_weights_to_hf.py``. ``wv``/``wo`` are not rotated and are copied as they are.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from framework.config import ModelConfig

_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full, unsharded model state on CPU, on rank 0 (``{}`` on the others). Collective for
    FSDP/TP models: call it on every rank."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def permute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection from interleaved-pair to rotate-half order, per head (HF's permute)."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def to_hf_state_dict(model_state: dict[str, torch.Tensor], model_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Rename (and for wq/wk permute) a full state dict to HF Llama names; contiguous copies.

    Raises ValueError naming keys that are missing or that the export does not know.
    """
    expected = {"tok_embeddings.weight", "norm.weight", "output.weight"}
    expected |= {f"layers.{i}.{k}" for i in range(model_cfg.n_layers) for k in _LAYER_NAMES}
    tied_output = model_cfg.tie_embeddings and "output.weight" not in model_state
    missing = sorted(expected - set(model_state) - ({"output.weight"} if tied_output else set()))
    unknown = sorted(set(model_state) - expected)
    if missing or unknown:
        raise ValueError(f"model state does not match {model_cfg.name}: missing {missing}, unknown {unknown}")
    out = {
        "model.embed_tokens.weight": model_state["tok_embeddings.weight"],
        "model.norm.weight": model_state["norm.weight"],
    }
    if not model_cfg.tie_embeddings:
        out["lm_head.weight"] = model_state["output.weight"]
    for i in range(model_cfg.n_layers):
        for ours, theirs in _LAYER_NAMES.items():
            w = model_state[f"layers.{i}.{ours}"]
            if ours == "attention.wq.weight":
                w = permute_rope_rows(w, model_cfg.n_heads)
            elif ours == "attention.wk.weight":
                w = permute_rope_rows(w, model_cfg.n_kv_heads)
            out[f"model.layers.{i}.{theirs}"] = w
    # safetensors refuses tensors that share storage (tied weights, views): save independent copies.
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in out.items()}


def hf_config(model_cfg: ModelConfig, dtype: torch.dtype, max_position_embeddings: int) -> dict[str, object]:
    """``config.json`` for ``LlamaForCausalLM`` (transformers' LlamaConfig field names)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": model_cfg.dim,
        "intermediate_size": model_cfg.ffn_dim,
        "num_hidden_layers": model_cfg.n_layers,
        "num_attention_heads": model_cfg.n_heads,
        "num_key_value_heads": model_cfg.n_kv_heads,
        "head_dim": model_cfg.dim // model_cfg.n_heads,
        "vocab_size": model_cfg.vocab_size,
        "rms_norm_eps": model_cfg.norm_eps,
        "rope_theta": model_cfg.rope_theta,
        "tie_word_embeddings": model_cfg.tie_embeddings,
        "max_position_embeddings": max_position_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": model_cfg.init_std,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def export_hf(
    model_state: dict[str, torch.Tensor],
    model_cfg: ModelConfig,
    out_dir: Path,
    max_position_embeddings: int = 2048,
) -> Path:
    """Write ``out_dir/model.safetensors`` and ``out_dir/config.json``; return ``out_dir``.

    ``model_state`` is the full, unsharded state (``full_model_state`` on rank 0); call this on
    rank 0 only. Pass the training ``seq_len`` (or the longest context the model is meant for) as
    ``max_position_embeddings``.
    """
    from safetensors.torch import save_file

    tensors = to_hf_state_dict(model_state, model_cfg)
    dtype = tensors["model.embed_tokens.weight"].dtype
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = hf_config(model_cfg, dtype, max_position_embeddings)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out_dir
