"""Multi-head latent attention's kernel choice (framework.models.parts.mla): q/k and v of different
widths, which SDPA's flash kernels refuse; ``model.attention=flash`` pads v with zero columns to the
q/k width and slices the output back. On the CPU (whose flash kernel has the same equal-widths rule)
that path equals the default one, forward and every gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from framework.config.schema import AttentionBackend
from framework.models.parts.mla import LatentAttention, padded_v_attention
from framework.models.parts.rope import rope_tables


def layer(backend: AttentionBackend) -> LatentAttention:
    torch.manual_seed(0)
    # qk = 16 + 8 = 24 wide, v 16 wide: DeepSeek-V3's (128 + 64, 128) in small
    return LatentAttention(32, 4, 16, 12, 16, 8, 16, 1e-6, 24**-0.5, backend)


def test_flash_refuses_unequal_widths_and_the_padded_v_takes_them() -> None:
    q, k = torch.randn(1, 2, 8, 24), torch.randn(1, 2, 8, 24)
    v = torch.randn(1, 2, 8, 16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), pytest.raises(RuntimeError, match="No available kernel"):
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = padded_v_attention(q, k, v, True, 0.2)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2))


def test_latent_attention_under_flash_equals_the_default_kernel() -> None:
    x = torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(1))
    rope = rope_tables(8, 10, 10000.0, None)
    results = []
    for backend in (AttentionBackend.auto, AttentionBackend.flash):
        attn = layer(backend)
        xi = x.clone().requires_grad_()
        out = attn(xi, rope)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append([out.detach(), xi.grad] + [p.grad for p in attn.parameters()])
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)  # two kernels: fp32 rounding
