"""Llama-family decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention through SDPA.

Module names follow torchtitan (``tok_embeddings``, ``layers.N.attention.wq`` ...) so tensor-parallel
plans and checkpoint converters can name them. The model is built on the meta device and initialised
after placement (``init_weights``), so a 70B shape never materialises on one host.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from framework.config.schema import AttentionBackend, FusedCrossEntropy, ModelConfig, ResidualDtype
from framework.kernels.fused_ce import linear_cross_entropy
from framework.models import model_spec

_SDPA_BACKENDS = {
    AttentionBackend.flash: SDPBackend.FLASH_ATTENTION,
    AttentionBackend.cudnn: SDPBackend.CUDNN_ATTENTION,
    AttentionBackend.efficient: SDPBackend.EFFICIENT_ATTENTION,
    AttentionBackend.math: SDPBackend.MATH,
    # The flash backend, whose kernels framework.kernels.fa4.activate swaps for flash-attn-4's.
    AttentionBackend.fa4: SDPBackend.FLASH_ATTENTION,
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (as Meta's reference does): bf16 sums of squares lose precision.
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).type_as(x)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_tables(
    head_dim: int,
    seq_len: int,
    theta: float,
    device: torch.device | None = None,
    scaling: ModelConfig | None = None,
) -> torch.Tensor:
    """cos/sin tables, shape (seq_len, head_dim // 2, 2); real-valued so export and compile keep them.

    ``scaling``: a model config whose ``rope_scaling_factor`` != 1 applies Llama 3.1's frequency
    scaling (transformers' ``_compute_llama3_parameters``, the same operations in the same order).
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is not None and scaling.rope_scaling_factor != 1.0:
        inv = _llama3_scaled(inv, scaling)
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv)
    return torch.stack([freqs.cos(), freqs.sin()], dim=-1)


def _llama3_scaled(inv: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_len = cfg.rope_original_max_position
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]); x is (batch, seq, heads, head_dim). ``tables`` is (seq, ...)
    for positions 0..seq-1, or (batch, seq, ...) for each token's own position (document masking)."""
    b, s, h, d = x.shape
    xf = x.float().reshape(b, s, h, d // 2, 2)
    if tables.dim() == 4:  # per-token positions: (batch, seq, head_dim // 2, 2)
        cos, sin = tables[:, :s, None, :, 0], tables[:, :s, None, :, 1]
    else:
        cos = tables[:s, None, :, 0]
        sin = tables[:s, None, :, 1]
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.reshape(b, s, h, d).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = model_spec(cfg).head_dim
        self.gqa = cfg.n_heads != cfg.n_kv_heads
        self.backend = _SDPA_BACKENDS.get(cfg.attention)
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        # None where the family has no q/k norm: TorchScript (freeze=script) drops a branch on a None
        # attribute, where a bool flag would make it compile the missing modules' call.
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if model_spec(cfg).qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if model_spec(cfg).qk_norm else None

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as (batch, seq, heads, head_dim), before RoPE (q/k normalised per head when the
        family has qk_norm). -1 for the head count: under tensor parallelism each rank holds only
        its share of heads."""
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: None (causal), a dense boolean mask, or FlexAttention's ``BlockMask``. The
        annotation leaves BlockMask out, and so does the check below when scripting: TorchScript
        (``freeze=script``) would try to compile that class, and a scripted model never has one."""
        b, s, _ = x.shape
        q, k, v = self.heads(x)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        # From the config, not the tensors: tracing would turn a shape comparison into a tensor, and
        # tensor parallelism divides both head counts by the same degree.
        if mask is not None:  # data.document_mask
            out = self._attend_masked(q, k, v, mask)
        elif self.backend is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa)
        else:
            with sdpa_kernel(self.backend):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa)
        out = out.transpose(1, 2).reshape(b, s, -1)
        return self.wo(out)

    def _attend_masked(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Causal within each document: FlexAttention for a BlockMask, SDPA for a dense mask
        (TorchScript compiles only the dense case: it cannot name BlockMask)."""
        if torch.jit.is_scripting():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.gqa)
        else:
            if isinstance(mask, BlockMask):
                return _flex(q)(q, k, v, block_mask=mask, enable_gqa=self.gqa)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.gqa)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        # ``mask`` may also be a BlockMask (see Attention.forward). The mask goes as a keyword: tensor parallelism's PrepareModuleInput lays out positional inputs only.
        if mask is None:
            h = x + self.attention(self.attention_norm(x), rope)
        else:
            h = x + self.attention(self.attention_norm(x), rope, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))


# A token id with this bit set starts a document (data.sft_pack marks each packed example so, since
# EOS also ends turns inside a conversation); ``document_ids`` reads it and the model strips it.
DOC_START = 1 << 40
# ``document_eos`` for rows whose documents are marked by DOC_START only (no token id is negative).
NO_EOS = -1


def causal_band(queries: int, keys: int, offset: int, window: int, device: torch.device) -> torch.Tensor:
    """SDPA's boolean mask (queries, keys): query ``i`` sits at position ``offset + i`` and sees key
    ``j`` when ``j <= offset + i`` and, for a window > 0, ``j > offset + i - window`` (itself and the
    ``window - 1`` before it: transformers' ``sliding_window``). Shared by training and the KV cache."""
    q = torch.arange(offset, offset + queries, device=device)[:, None]
    k = torch.arange(keys, device=device)[None, :]
    mask = k <= q
    if window > 0:
        mask = mask & (k > q - window)
    return mask


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Which document each token belongs to, (batch, seq) int32, increasing along each row.

    Documents are packed back to back with EOS after each (framework.data.stream); an EOS belongs to
    the document it ends, so the token after it starts a new one. A token flagged with DOC_START
    starts one too. Built from the tokens themselves, so it needs no extra input and is sharded,
    traced and compiled like them.
    """
    is_eos = (tokens == eos_id).to(torch.int32)
    starts = (tokens >= DOC_START).to(torch.int32)
    return torch.cumsum(is_eos, dim=1) - is_eos + torch.cumsum(starts, dim=1)


def document_positions(doc: torch.Tensor) -> torch.Tensor:
    """Each token's position within its document, (batch, seq) int64: RoPE restarts at every
    document, so a document packed after others is rotated as it would be alone."""
    idx = torch.arange(doc.shape[1], device=doc.device).expand(doc.shape)
    starts = torch.cat([torch.ones_like(doc[:, :1], dtype=torch.bool), doc[:, 1:] != doc[:, :-1]], dim=1)
    return idx - torch.where(starts, idx, 0).cummax(dim=1).values


def document_mask(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Boolean attention mask (batch, 1, seq, seq) for SDPA: causal, and only within a document
    (``document_ids``). Dense: seq x seq per row, the fallback where FlexAttention cannot train."""
    return dense_document_mask(document_ids(tokens, eos_id))


def dense_document_mask(doc: torch.Tensor) -> torch.Tensor:
    """``document_mask`` from ``document_ids``."""
    s = doc.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=doc.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal)[:, None]


def document_block_mask(doc: torch.Tensor) -> BlockMask:
    """FlexAttention's block mask of ``document_ids``: causal within each document. Blocks wholly
    outside every document are skipped, and no seq x seq tensor is kept."""

    def same_document_causal(
        b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        return (doc[b, q] == doc[b, kv]) & (q >= kv)

    b, s = doc.shape
    return create_block_mask(same_document_causal, b, None, s, s, device=doc.device)


def flex_trains_on(device: torch.device) -> bool:
    """Whether FlexAttention runs forward and backward here. CUDA: yes. CPU (torch 2.13, eager and
    compiled): forward only ("FlexAttention does not support backward on CPU"), so training on CPU
    takes SDPA with the dense mask; meta (freezing) traces the dense path too."""
    return device.type == "cuda"


_FLEX_COMPILED: list[Callable[..., torch.Tensor]] = []


def _flex(q: torch.Tensor) -> Callable[..., torch.Tensor]:
    """FlexAttention compiled once on CUDA (eager flex materializes the scores: the unfused
    reference), as torchtitan does; under a compiled block Dynamo traces through it."""
    if not q.is_cuda:
        return flex_attention
    if not _FLEX_COMPILED:
        _FLEX_COMPILED.append(torch.compile(flex_attention, dynamic=False))
    return _FLEX_COMPILED[0]


class Llama(nn.Module):
    """Decoder-only transformer. ``forward(tokens) -> logits`` (batch, seq, vocab)."""

    def __init__(self, cfg: ModelConfig, max_seq_len: int, document_eos: int | None = None) -> None:
        super().__init__()
        if not cfg.head_dim and cfg.dim % cfg.n_heads:
            raise ValueError(f"model.dim={cfg.dim} is not divisible by model.n_heads={cfg.n_heads}")
        if cfg.n_heads % cfg.n_kv_heads:
            raise ValueError(
                f"model.n_heads={cfg.n_heads} is not divisible by model.n_kv_heads={cfg.n_kv_heads}"
            )
        self.cfg = cfg
        self.max_seq_len = max_seq_len
        # data.document_mask: the EOS id whose positions end documents (None = plain causal attention).
        self.document_eos = document_eos
        # The document mask's kernel: None = FlexAttention where it trains (``flex_trains_on``) and
        # model.attention=auto, else SDPA with the dense mask; True / False force one (tests).
        self.document_flex: bool | None = None
        # The family's attention window (framework.models: Mistral); None = full causal attention,
        # an attribute TorchScript drops the branch on.
        self.sliding_window: int | None = model_spec(cfg).sliding_window or None
        if self.sliding_window is not None and document_eos is not None:
            raise ValueError(
                f"model.sliding_window={self.sliding_window} with data.document_mask: valid: one of them"
            )
        # model.fused_cross_entropy, None for the default head: an attribute rather than a config
        # read, so TorchScript (freeze=script) drops the fused branch it cannot compile.
        self.fused_cross_entropy = (
            None if cfg.fused_cross_entropy is FusedCrossEntropy.none else cfg.fused_cross_entropy
        )
        # The residual stream's dtype: ``materialize`` sets the loop's compute dtype (bf16 on CUDA)
        # when cfg.residual_dtype=autocast; None leaves the embedding's dtype. A plain attribute,
        # not an autocast query, so that Dynamo, export and TorchScript all see a constant.
        self.stream_dtype: torch.dtype | None = None
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        # A ModuleDict keyed "0".."L-1" keeps fully-qualified names stable when blocks are wrapped.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        tie(self)
        # Non-persistent: recomputed from the shape, never checkpointed.
        self.register_buffer("rope", self._rope_tables(None), persistent=False)

    def _rope_tables(self, device: torch.device | None) -> torch.Tensor:
        head_dim = model_spec(self.cfg).head_dim
        return rope_tables(head_dim, self.max_seq_len, self.cfg.rope_theta, device, self.cfg)

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits (batch, seq, vocab); or, given ``targets``, the mean cross-entropy loss.

        Computing the loss inside ``forward`` lets the loss head (final norm, output projection,
        fp32 log-softmax) be compiled as one region and run under DDP/FSDP's forward hooks.
        ``documents``: the rows' ``document_ids`` (data.document_mask), given to every pipeline stage
        (a later stage sees hidden states, not the tokens they are built from); None: built here.
        """
        if self.document_eos is not None:
            return self._forward_documents(tokens, targets, documents)
        if self.sliding_window is not None:
            return self._forward_window(tokens, targets, self.sliding_window)
        h = self._embed(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope)
        return self._head(h, targets)

    def _forward_window(
        self, tokens: torch.Tensor, targets: torch.Tensor | None, window: int
    ) -> torch.Tensor:
        """``forward`` with a sliding window: one banded causal mask for the shape, every layer."""
        h = self._embed(tokens)
        s = h.shape[1]
        mask = causal_band(s, s, 0, window, h.device)
        for layer in self.layers.values():
            h = layer(h, self.rope, mask=mask)
        return self._head(h, targets)

    def _forward_documents(
        self, tokens: torch.Tensor, targets: torch.Tensor | None, documents: torch.Tensor | None
    ) -> torch.Tensor:
        """``forward`` with ``data.document_mask``: attention and RoPE positions restart at each
        document. Its own method, reached only when ``document_eos`` is set, so that TorchScript
        (``freeze=script``, which skips a branch on a None attribute) compiles none of it otherwise."""
        doc = documents
        if self.tok_embeddings is not None:
            if doc is None:
                doc = document_ids(tokens, self.document_eos)
            tokens = torch.bitwise_and(tokens, DOC_START - 1)  # the ids without the start flags
        assert doc is not None, "a pipeline stage without the embedding needs the rows' document ids"
        h = self._embed(tokens)
        rope = self.rope[document_positions(doc)]  # (batch, seq, head_dim // 2, 2)
        mask = self.document_attention_mask(tokens, doc)
        for layer in self.layers.values():
            h = layer(h, rope, mask=mask)
        return self._head(h, targets)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        # A pipeline stage (framework.parallel.pipeline) may lack the embedding (it then takes the
        # previous stage's hidden states) and the head (``_head`` then returns its hidden states).
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if self.stream_dtype is not None:
            # fp32 embeddings under autocast would make the whole residual stream fp32 (every add
            # promotes): twice the traffic of every norm, add and saved block input.
            h = h.to(self.stream_dtype)
        return h

    def _head(self, h: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        if self.output is None:
            return h
        if targets is None:
            return self.output(self.norm(h))
        return self.head_loss(h, targets)

    def document_attention_mask(self, tokens: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
        """FlexAttention's ``BlockMask``, or SDPA's dense mask (see ``document_flex``). TorchScript
        cannot name BlockMask (the annotation leaves it out): a scripted model takes the dense mask."""
        if torch.jit.is_scripting():
            return dense_document_mask(doc)
        else:
            flex = self.document_flex
            if flex is None:
                flex = flex_trains_on(tokens.device) and self.cfg.attention is AttentionBackend.auto
            return document_block_mask(doc) if flex else dense_document_mask(doc)

    def head_loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Final norm + output projection + cross-entropy in fp32 (a separate method so that the
        executor can compile it as its own region: with a 128K vocabulary it is a large share of
        the step). ``model.fused_cross_entropy`` replaces the projection and the loss with one fused
        kernel (framework.kernels.fused_ce) that never writes the logits."""
        if self.fused_cross_entropy is not None:
            return linear_cross_entropy(self.fused_cross_entropy, self.norm(h), self.output.weight, targets)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise in place after ``to_empty`` (meta -> real device).

        Draws each parameter from a generator seeded by (seed, parameter name) on the parameter's
        device type, so the values do not depend on the wrapping or the number of ranks (they do
        depend on the device type: CPU and CUDA generators differ). Drawing on the GPU keeps a 7B
        init to seconds rather than minutes of CPU sampling. Sharded (DTensor) parameters are filled
        from the full tensor's generator and sliced to the local shard. Residual projections (wo, w2)
        are scaled by 1/sqrt(2 * n_layers) as in GPT-2.
        """
        std = self.cfg.init_std
        device = _local_device(self)
        for name, p in self.named_parameters():
            if name == "output.weight" and self.cfg.tie_embeddings:
                # A pipeline's last stage holds its own copy of the tied weight (the embedding is on
                # the first stage): drawn from the embedding's name, it starts equal to it.
                name = "tok_embeddings.weight"
            leaf = name.rsplit(".", 1)[0].rsplit(".", 1)[-1]
            if name.endswith("norm.weight"):
                full = torch.ones(_full_shape(p), device=device)
            else:
                scale = std / math.sqrt(2 * self.cfg.n_layers) if leaf in ("wo", "w2") else std
                g = torch.Generator(device=device).manual_seed(_name_seed(seed, name))
                full = torch.randn(_full_shape(p), generator=g, device=device) * scale
            _copy_full_into(p, full)
        # Non-persistent buffers are not restored by to_empty: fill the RoPE tables again.
        self.rope = self._rope_tables(device)


def tie(model: Llama) -> None:
    """Tie the output projection to the embedding (``model.tie_embeddings``), again after anything
    that re-creates parameters (``to_empty``, TP). A pipeline stage holding only one of the two
    keeps its own (framework.parallel.pipeline ties the copies across stages)."""
    if model.cfg.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        model.output.weight = model.tok_embeddings.weight


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local_device(model: nn.Module) -> torch.device:
    p = next(model.parameters())
    return p.to_local().device if _is_dtensor(p) else p.device


def _full_shape(p: torch.Tensor) -> torch.Size:
    return p.shape  # a DTensor reports its global shape


def _name_seed(seed: int, name: str) -> int:
    # Stable across processes (unlike hash()): a simple polynomial hash of the name.
    h = seed * 1_000_003
    for ch in name:
        h = (h * 131 + ord(ch)) % (2**61 - 1)
    return h


def _copy_full_into(p: torch.Tensor, full: torch.Tensor) -> None:
    if _is_dtensor(p):
        from torch.distributed.tensor import distribute_tensor

        # src_data_rank=None: every rank drew the same full tensor, so each slices its own shard locally.
        full = full.to(device=p.to_local().device, dtype=p.dtype)
        local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
        p.to_local().copy_(local.to_local())
    else:
        p.copy_(full.to(device=p.device, dtype=p.dtype))


def build_model(cfg: ModelConfig, max_seq_len: int, document_eos: int | None = None) -> Llama:
    """Build on the meta device: no memory is taken until ``to_empty`` + ``init_weights``."""
    with torch.device("meta"):
        return Llama(cfg, max_seq_len, document_eos)


def num_params(cfg: ModelConfig, include_embedding: bool = True) -> int:
    """Parameter count from the shape alone (its spec; tied embeddings counted once)."""
    n = sum(math.prod(w.shape) for _, w, _ in model_spec(cfg).params())
    return n if include_embedding else n - cfg.vocab_size * cfg.dim


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training flops per token: 6N + 12·L·H·Q·T (PaLM appendix B; N excludes the input embedding).

    6N covers the matmuls of forward (2N) and backward (4N); 12·L·H·Q·T is attention's score and
    value products (L layers, H heads, Q head dim, T sequence length), which N does not see.
    """
    n = num_params(cfg, include_embedding=False)
    if cfg.tie_embeddings:
        # The tied output projection is a matmul of vocab x dim even though its weight is shared.
        n += cfg.vocab_size * cfg.dim
    head_dim = model_spec(cfg).head_dim
    return 6.0 * n + 12.0 * cfg.n_layers * cfg.n_heads * head_dim * seq_len


def compute_dtype(device: torch.device | str) -> torch.dtype | None:
    """The dtype the training loop autocasts to on ``device``: bf16 on CUDA; None (fp32) elsewhere."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else None


def materialize(model: Llama, device: torch.device | str, seed: int) -> None:
    """Allocate a meta-built (possibly already sharded) model on ``device`` and initialise it:
    from ``model.init_from`` when set (each rank reads its own shards, framework.checkpoint.init_from), else
    ``init_weights(seed)``.

    ``to_empty`` unties shared parameters (it re-creates each module's tensors), so tied embeddings
    are tied again before init.
    """
    model.to_empty(device=device)
    if model.cfg.attention is AttentionBackend.fa4:
        from framework.kernels import fa4

        fa4.activate()  # process-wide: where the model meets its device, before any forward
    if model.cfg.residual_dtype == ResidualDtype.autocast:
        model.stream_dtype = compute_dtype(device)
    tie(model)
    if model.cfg.init_from is None:
        model.init_weights(seed)
        return
    from framework.checkpoint.init_from import load

    load(model, model.cfg.init_from)
    # Non-persistent buffers are not restored by to_empty (init_weights fills them otherwise).
    model.rope = model._rope_tables(_local_device(model))
