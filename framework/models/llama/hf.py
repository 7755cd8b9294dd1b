"""Llama in ``transformers``: its class; no config.json field of its own beyond the shared ones
(``framework.checkpoint.import_hf.SHAPE_FIELDS``: shape, RoPE and its Llama 3.1 scaling)."""

HF_ARCHITECTURE = "LlamaForCausalLM"
HF_FIELDS: dict[str, str] = {}
