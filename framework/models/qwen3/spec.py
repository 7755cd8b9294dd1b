"""The Qwen3 dense layout: Llama's, plus an RMSNorm over each query and key head (``q_norm`` /
``k_norm``, before RoPE) and a head size set apart from the width; ``dense xN``. What a block saves
is the dense block's values (the per-head norms are counted in its q/k terms, as the fit that
measured them did)."""

from __future__ import annotations

from framework.config.schema import ModelConfig
from framework.models.parts.layout import decoder_spec, dense_kind, head_dim, repeated
from framework.models.qwen3.hf import HF_ARCHITECTURE
from framework.models.spec import ModelSpec


def qwen3_spec(m: ModelConfig) -> ModelSpec:
    hd = head_dim(m)
    return decoder_spec(m, "qwen3", repeated(dense_kind(m, hd, qk_norm=True), m), hd, HF_ARCHITECTURE)
