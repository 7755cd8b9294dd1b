"""GPT-OSS (transformers' ``GptOssForCausalLM``), in progress: its attention with sinks and biases
(``attention.py``, with its cached decode step) and its MoE layer with biases and the clamped SwiGLU (``experts.py``), each equal to
transformers' module (tests/models/test_gpt_oss_parts.py). Not yet a family: no spec, block, HF
fields or registry entry."""
