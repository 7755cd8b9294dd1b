"""GPT-OSS's parts (framework.models.gpt_oss: attention with sinks and biases, the MoE layer with
biases and the clamped SwiGLU) against transformers' ``GptOssForCausalLM`` in fp32 on the CPU: a tiny
random model (2 layers, sliding window 4 then full attention over 16 tokens, 8 experts top-2, random
sinks and biases, activations large enough that the SwiGLU clamp bites) run through our parts,
assembled here as the family's block will assemble them, gives transformers' logits.
(The family's own parity, through the import and export: tests/models/test_models_gpt_oss.py.)"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "transformers", reason="transformers is in the dev extra: the parity tests compare with its models"
)

from framework.models.gpt_oss.attention import SinkAttention  # noqa: E402
from framework.models.gpt_oss.experts import GptOssMoE  # noqa: E402
from framework.models.parts.norm import RMSNorm  # noqa: E402
from framework.models.parts.rope import rope_tables  # noqa: E402

SEQ, DIM, HEADS, KV, HD, WINDOW, EXPERTS, WIDTH = 16, 64, 4, 2, 16, 4, 8, 32


def hf_model():  # noqa: ANN201 - a GptOssForCausalLM
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    config = GptOssConfig(
        hidden_size=DIM,
        intermediate_size=WIDTH,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        head_dim=HD,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        vocab_size=256,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    model = GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(("sinks", "bias")):
                p.normal_(0.0, 0.5)
            elif "experts" in name:
                p.normal_(0.0, 0.3)  # gate/up values past the clamp limit (7) for some rows
    return model


def from_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q/k projection (or bias) from transformers' rotate-half order to our interleaved pairs."""
    return w.reshape(heads, 2, -1, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class Reference(torch.nn.Module):
    """Our parts, in transformers' block order (pre-norm attention, pre-norm MoE)."""

    def __init__(self, hf: torch.nn.Module) -> None:
        super().__init__()
        c = hf.config
        self.embed = torch.nn.Embedding(c.vocab_size, DIM)
        self.attn = torch.nn.ModuleList(
            SinkAttention(DIM, HEADS, KV, HD, WINDOW if t == "sliding_attention" else 0)
            for t in c.layer_types
        )
        self.moe = torch.nn.ModuleList(
            GptOssMoE(DIM, WIDTH, EXPERTS, 2, c.swiglu_alpha, c.swiglu_limit) for _ in c.layer_types
        )
        self.norms = torch.nn.ModuleList(
            RMSNorm(DIM, c.rms_norm_eps) for _ in range(2 * len(c.layer_types) + 1)
        )
        self.head = torch.nn.Linear(DIM, c.vocab_size, bias=False)
        self.register_buffer("rope", rope_tables(HD, SEQ, 10000.0, None), persistent=False)
        with torch.no_grad():
            self.embed.weight.copy_(hf.model.embed_tokens.weight)
            self.head.weight.copy_(hf.lm_head.weight)
            self.norms[-1].weight.copy_(hf.model.norm.weight)
            for i, layer in enumerate(hf.model.layers):
                a, ours = layer.self_attn, self.attn[i]
                for mine, theirs, heads in ((ours.wq, a.q_proj, HEADS), (ours.wk, a.k_proj, KV)):
                    mine.weight.copy_(from_halves(theirs.weight, heads))
                    mine.bias.copy_(from_halves(theirs.bias, heads))
                for mine, theirs in ((ours.wv, a.v_proj), (ours.wo, a.o_proj)):
                    mine.weight.copy_(theirs.weight)
                    mine.bias.copy_(theirs.bias)
                ours.sinks.copy_(a.sinks)
                m, e = self.moe[i], layer.mlp.experts
                m.router.weight.copy_(layer.mlp.router.weight)
                m.router.bias.copy_(layer.mlp.router.bias)
                for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
                    getattr(m.experts, name).copy_(getattr(e, name))
                self.norms[2 * i].weight.copy_(layer.input_layernorm.weight)
                self.norms[2 * i + 1].weight.copy_(layer.post_attention_layernorm.weight)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for i, (attn, moe) in enumerate(zip(self.attn, self.moe, strict=True)):
            h = h + attn(self.norms[2 * i](h), self.rope)
            h = h + moe(self.norms[2 * i + 1](h))
        return self.head(self.norms[-1](h))


def test_parts_give_transformers_logits() -> None:
    hf = hf_model()
    x = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(1))
    ours = Reference(hf).eval()
    with torch.no_grad():
        want, got = hf(x).logits, ours(x)
        diff = (got - want).abs().max().item()
        print(f"gpt_oss parts vs GptOssForCausalLM: max |logits diff| {diff:.2e}")
        assert diff <= 1e-5, diff
        # Each part decides the logits (the test can fail): the sinks, the window, the clamp.
        for change in ("sinks", "window", "clamp"):
            saved = [(a.sinks.clone(), a.window) for a in ours.attn], [m.experts.limit for m in ours.moe]
            if change == "sinks":
                for a in ours.attn:
                    a.sinks.zero_()
            elif change == "window":
                ours.attn[0].window = 0
            else:
                for m in ours.moe:
                    m.experts.limit = 1e9
            assert (ours(x) - want).abs().max().item() > 1e-4, change
            for a, (s, w) in zip(ours.attn, saved[0], strict=True):
                a.sinks.copy_(s)
                a.window = w
            for m, limit in zip(ours.moe, saved[1], strict=True):
                m.experts.limit = limit


def test_yarn_without_truncation_gives_transformers_tables() -> None:
    """GPT-OSS's published RoPE (YaRN factor 32 over 4096, beta_fast 32, beta_slow 1, ``truncate:
    false``, theta 150000, head_dim 64): our tables equal transformers' cos and sin, which the
    truncated ramp (DeepSeek-V3's) does not."""
    from types import SimpleNamespace

    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    yarn = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
    yarn |= {"original_max_position_embeddings": 4096, "rope_theta": 150000.0}
    config = GptOssConfig(head_dim=64, hidden_size=128, num_attention_heads=2, rope_parameters=yarn)
    positions = torch.arange(0, 8192, 7)[None]
    cos, sin = GptOssRotaryEmbedding(config)(torch.zeros(1), positions)
    ours = SimpleNamespace(
        rope_scaling_factor=1.0,
        rope_yarn_factor=32.0,
        rope_yarn_original_max_position=4096,
        rope_yarn_beta_fast=32.0,
        rope_yarn_beta_slow=1.0,
        rope_yarn_mscale=1.0,
        rope_yarn_mscale_all_dim=0.0,
        rope_yarn_truncate=False,
    )
    tables = rope_tables(64, 8192, 150000.0, None, ours)[positions[0]]
    torch.testing.assert_close(tables[..., 0], cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(tables[..., 1], sin[0], rtol=1e-6, atol=1e-6)
    ours.rope_yarn_truncate = True
    assert (rope_tables(64, 8192, 150000.0, None, ours)[positions[0]][..., 0] - cos[0]).abs().max() > 1e-4


@pytest.mark.parametrize("window", [0, WINDOW])
def test_cached_decode_equals_the_full_forward(window: int) -> None:
    """Token by token through a KV cache (5 prompt tokens, then one at a time), each position's
    output equals the full forward's, full causal and with the window of 4."""
    from framework.models.parts.cache import KVCache

    torch.manual_seed(0)
    attn = SinkAttention(DIM, HEADS, KV, HD, window)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0.0, 0.1)
        x = torch.randn(2, SEQ, DIM)
        rope = rope_tables(HD, SEQ, 10000.0, None)
        want = attn(x, rope)
        shape = (2, KV, SEQ, HD)
        cache = KVCache([torch.zeros(shape)], [torch.zeros(shape)], rope, windows=[window])
        got = [attn.forward_cached(x[:, :5], cache, 0)]
        cache.length = 5
        for i in range(5, SEQ):
            got.append(attn.forward_cached(x[:, i : i + 1], cache, 0))
            cache.length += 1
    torch.testing.assert_close(torch.cat(got, dim=1), want, rtol=1e-5, atol=1e-5)
