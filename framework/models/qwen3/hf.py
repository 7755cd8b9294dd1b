"""Qwen3 in ``transformers``: its class; its head size is the shared ``head_dim`` field."""

HF_ARCHITECTURE = "Qwen3ForCausalLM"
HF_FIELDS: dict[str, str] = {}
