"""The pieces every family here is built from: norm, RoPE, attention (SDPA, FlexAttention and the
document and window masks), MLP, the decoder trunk, and the KV-cache decode that walks them.

A family folder (``framework.models.llama`` ...) composes these; none of them names a family.
"""
