"""Mistral in ``transformers``: its class, and its own config.json field (the window; HF's null
is our 0)."""

HF_ARCHITECTURE = "MistralForCausalLM"
HF_FIELDS = {"sliding_window": "sliding_window"}
