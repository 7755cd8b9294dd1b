"""The decoder trunk every family here shares: embedding, ``n_layers`` blocks, final norm, loss head.

A family brings its spec (``framework.models.spec.ModelSpec``: the weights, the head size, the
attention window) and its block (``Family.block``); the trunk runs them. Module names follow
torchtitan (``tok_embeddings``, ``layers.N.attention.wq`` ...) so tensor-parallel plans and
checkpoint converters can name them. The model is built on the meta device and initialised after
placement (``init_weights``), so a 70B shape never materialises on one host.

What the rest of the framework may rely on (the decoder interface): ``cfg``, ``tok_embeddings``,
``layers`` (a ModuleDict "0".."L-1"), ``norm``, ``output``, ``rope``, ``head_dim``,
``sliding_window``, ``document_eos``, ``forward(tokens, targets, documents)``, ``head_loss``,
``init_weights``; a pipeline stage sets the embedding or the head to None. Each block has a
``forward_cached`` for decoding (``forward_cached`` below, framework.models.parts.cache).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from framework.config.schema import (
    AttentionBackend,
    Float8Recipe,
    FusedCrossEntropy,
    ModelConfig,
)
from framework.kernels.fused_ce import linear_cross_entropy
from framework.kernels.saved_copy import saved_copy
from framework.models import moe
from framework.models.parts.attention import Attention
from framework.models.parts.cache import KVCache
from framework.models.parts.loss import require_scope, vocab_parallel_cross_entropy
from framework.models.parts.masks import (
    DOC_START,
    causal_band,
    dense_document_mask,
    document_block_mask,
    document_ids,
    document_positions,
    document_spans,
    flex_trains_on,
)
from framework.models.parts.mlp import FeedForward
from framework.models.parts.mtp import MTPLayer, MultiTokenPrediction, keep_mtp
from framework.models.parts.norm import RMSNorm
from framework.models.parts.rope import rope_tables
from framework.models.parts.weights import draw_weights, tie
from framework.models.spec import LayerKind, ModelSpec


class TransformerBlock(nn.Module):
    """Pre-norm attention then pre-norm MLP, each added to the residual stream."""

    def __init__(self, cfg: ModelConfig, attention: nn.Module, feed_forward: nn.Module) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = attention
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = feed_forward
        # Under float8 each norm's output is saved for backward, not recomputed there
        # (framework.kernels.saved_copy: the compiled transposed float8 cast of the recompute).
        self.save_norms = cfg.float8 is not Float8Recipe.none

    def forward(self, x: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        # ``mask`` may also be a BlockMask (see Attention.forward). The mask goes as a keyword: tensor parallelism's PrepareModuleInput lays out positional inputs only.
        if mask is None:
            h = x + self.attention(self._saved(self.attention_norm(x)), rope)
        else:
            h = x + self.attention(self._saved(self.attention_norm(x)), rope, mask=mask)
        return h + self.feed_forward(self._saved(self.ffn_norm(h)))

    def _saved(self, y: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting() or not self.save_norms:
            return y
        return self._copy(y)

    @torch.jit.unused
    def _copy(self, y: torch.Tensor) -> torch.Tensor:
        return saved_copy(y)

    def forward_cached(self, x: torch.Tensor, cache: KVCache, layer: int) -> torch.Tensor:
        """``forward`` for new positions after the cached ones (framework.models.parts.cache)."""
        h = x + self.attention.forward_cached(self.attention_norm(x), cache, layer)
        return h + self.feed_forward(self.ffn_norm(h))


def dense_block(cfg: ModelConfig, spec: ModelSpec, qk_norm: bool = False) -> TransformerBlock:
    """Llama's block (grouped-query attention, SwiGLU); ``qk_norm``: Qwen3's per-head q/k norm."""
    return TransformerBlock(cfg, Attention(cfg, spec.head_dim, qk_norm), FeedForward(cfg.dim, cfg.ffn_dim))


# A family's block: (config, spec, the layer's kind) -> that layer's module.
BlockFactory = Callable[[ModelConfig, ModelSpec, LayerKind], nn.Module]


class Decoder(nn.Module):
    """Decoder-only transformer. ``forward(tokens) -> logits`` (batch, seq, vocab)."""

    def __init__(
        self,
        cfg: ModelConfig,
        spec: ModelSpec,
        block: BlockFactory,
        max_seq_len: int,
        document_eos: int | None = None,
    ) -> None:
        super().__init__()
        if not cfg.head_dim and cfg.dim % cfg.n_heads:
            raise ValueError(f"model.dim={cfg.dim} is not divisible by model.n_heads={cfg.n_heads}")
        if cfg.n_heads % cfg.n_kv_heads:
            raise ValueError(
                f"model.n_heads={cfg.n_heads} is not divisible by model.n_kv_heads={cfg.n_kv_heads}"
            )
        self.cfg = cfg
        self.head_dim = spec.head_dim
        self.max_seq_len = max_seq_len
        # data.document_mask: the EOS id whose positions end documents (None = plain causal attention).
        self.document_eos = document_eos
        # The document mask's kernel: None = the flash kernel's variable-length form under
        # model.attention=flash|fa4 on CUDA, FlexAttention where it trains (``flex_trains_on``) under
        # model.attention=auto, else SDPA with the dense mask; True / False force flex / dense (tests).
        self.document_flex: bool | None = None
        # The attention window every layer shares (its kind's: Mistral); None = full causal attention,
        # an attribute TorchScript drops the branch on. Layers of several windows (a stack of
        # sliding and full layers): ``layer_windows``, each layer's by its key (0: full), and no
        # shared one.
        windows = {str(i): kind.window for i, kind in enumerate(spec.layers)}
        self.layer_windows: dict[str, int] | None = None
        if len(set(windows.values())) > 1:
            self.layer_windows = windows
        self.sliding_window: int | None = (
            (spec.layers[0].window or None) if self.layer_windows is None else None
        )
        # Pieces the residual stream's sequence is cut into between the blocks: tp under tensor
        # (sequence) parallelism (framework.parallel.tensor sets it), whose attention sees it whole.
        self.sequence_shards = 1
        # Loss parallelism: the TP degree the output projection's logits are sharded over (a DTensor
        # of this rank's vocabulary shard; framework.parallel.tensor sets it under TP with
        # parallel.loss_parallel), whose cross-entropy runs under torch's loss_parallel(), which the
        # caller enters around forward and backward (framework.models.parts.loss). None: whole
        # logits, an attribute TorchScript drops the branches on. ``gather_logits``: ``forward(tokens)``
        # then returns the whole vocabulary's logits; a pipeline stage (framework.parallel.pipeline)
        # leaves them sharded for the schedule's loss.
        self.vocab_shards: int | None = None
        self.gather_logits = True
        if (self.sliding_window is not None or self.layer_windows is not None) and document_eos is not None:
            window = self.sliding_window or max((self.layer_windows or {}).values())
            raise ValueError(f"model.sliding_window={window} with data.document_mask: valid: one of them")
        # model.fused_cross_entropy, None for the default head: an attribute rather than a config
        # read, so TorchScript (freeze=script) drops the fused branch it cannot compile.
        self.fused_cross_entropy = (
            None if cfg.fused_cross_entropy is FusedCrossEntropy.none else cfg.fused_cross_entropy
        )
        # The residual stream's dtype: ``materialize`` sets the loop's compute dtype (bf16 on CUDA)
        # when cfg.residual_dtype=autocast; None leaves the embedding's dtype. A plain attribute,
        # not an autocast query, so that Dynamo, export and TorchScript all see a constant.
        self.stream_dtype: torch.dtype | None = None
        # An MoE family's load-balancing loss is added to the loss times this (model.moe); None: dense
        # or coefficient 0 (an attribute TorchScript drops the branch on).
        moe_cfg = cfg.moe
        self.router_aux_loss_coef: float | None = (
            moe_cfg.router_aux_loss_coef if moe_cfg.num_experts and moe_cfg.router_aux_loss_coef > 0 else None
        )
        # model.moe.aux_loss_scope: transformers' loss over all layers together, or each layer's own
        # averaged over the model's MoE layers (``num_moe_layers``, counted before a pipeline cuts it).
        self.aux_per_layer = moe_cfg.aux_loss_scope.name == "layer"
        # A pipeline stage (framework.parallel.pipeline sets it): the term goes into backward through
        # the stage's output (``moe.AuxLossAutoScaler``), not into a loss, which only the last stage has.
        self.inject_aux = False
        # The ranks that hold other tokens of the same step (the data-parallel ranks), set by
        # framework.parallel on a model with MoE layers (``token_group``; None: this process alone):
        # the load-balancing loss spans their tokens together, and the sigmoid routers' bias update
        # their loads. ``router_aux``: the last forward's term (detached, before the coefficient; a
        # stage's share under a pipeline), kept per training forward in ``aux_values`` by
        # ``keep_aux`` for the step's figure (framework.models.parts.sparse.take_aux).
        self.token_group: object | None = None
        self.router_aux: torch.Tensor | None = None
        self.aux_values: list[torch.Tensor] = []
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        # A ModuleDict keyed "0".."L-1" keeps fully-qualified names stable when blocks are wrapped.
        self.layers = nn.ModuleDict({str(i): block(cfg, spec, kind) for i, kind in enumerate(spec.layers)})
        self.num_moe_layers = sum(isinstance(m, moe.MoE) for m in self.layers.modules())
        if self.num_moe_layers == 0:  # experts of a family's own (GPT-OSS's): no load-balancing terms
            self.router_aux_loss_coef = None
        if self.router_aux_loss_coef is not None:
            self.register_forward_hook(keep_aux)
        # Multi-token prediction (the spec's ``mtp`` layers, DeepSeek-V3's ``model.mtp_layers``): None
        # without, an attribute TorchScript drops the branch on. ``mtp_value``: the last training
        # forward's cross-entropy (detached, before its weight), kept in ``mtp_values`` by ``keep_mtp``
        # for the step's figure (framework.models.parts.mtp.take_mtp).
        self.mtp: MultiTokenPrediction | None = None
        self.mtp_loss_weight = float(getattr(cfg, "mtp_loss_weight", 0.0))
        self.mtp_value: torch.Tensor | None = None
        self.mtp_values: list[torch.Tensor] = []
        if spec.mtp:
            if document_eos is not None:
                raise ValueError(
                    f"model.mtp_layers={len(spec.mtp)} with data.document_mask: valid: one of them "
                    "(the multi-token prediction layer attends causally over the whole row)"
                )
            n = len(spec.layers)
            self.mtp = MultiTokenPrediction(
                {str(n + i): MTPLayer(cfg, block(cfg, spec, kind)) for i, kind in enumerate(spec.mtp)}
            )
            self.register_forward_hook(keep_mtp)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        tie(self)
        # Non-persistent: recomputed from the shape, never checkpointed.
        self.register_buffer("rope", self._rope_tables(None), persistent=False)

    def _rope_tables(self, device: torch.device | None) -> torch.Tensor:
        return self.rope_for(self.max_seq_len, device)

    def rope_for(self, length: int, device: torch.device | None) -> torch.Tensor:
        """The RoPE tables of positions 0..length-1 (the cache's capacity, or training's length)."""
        return rope_tables(self.head_dim, length, self.cfg.rope_theta, device, self.cfg)

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
        if self.layer_windows is not None:
            return self._forward_layer_windows(tokens, targets, self.layer_windows)
        h = self._embed(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope)
        if self.mtp is not None and targets is not None and self.output is not None:
            if torch.is_grad_enabled():
                return self._head(h, targets) + self._mtp_loss(h, tokens, targets)
        return self._head(h, targets)

    @torch.jit.unused
    def _mtp_loss(self, h: torch.Tensor, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The multi-token prediction term times its weight (framework.models.parts.mtp): position i
        of the trunk's ``h`` and the embedding of token i+1 predict token i+2, for i up to s-2 (the
        tokens, not the targets, give the embedded ones: a masked target is still a token). Training
        forwards only; the unweighted cross-entropy is kept as ``mtp_value``."""
        assert self.mtp is not None
        emb = self._embed(tokens[:, 1:])
        h = h[:, :-1]
        later = targets[:, 1:]
        for layer in self.mtp.layers.values():
            h = layer(h, emb, self.rope)
            if self.fused_cross_entropy is not None:
                loss = linear_cross_entropy(self.fused_cross_entropy, h, self.output.weight, later)
            else:
                loss = F.cross_entropy(self.output(h).flatten(0, 1).float(), later.flatten())
        self.mtp_value = loss.detach()
        return self.mtp_loss_weight * loss

    def _forward_window(
        self, tokens: torch.Tensor, targets: torch.Tensor | None, window: int
    ) -> torch.Tensor:
        """``forward`` with a sliding window: one banded causal mask for the shape, every layer."""
        h = self._embed(tokens)
        s = h.shape[1] * self.sequence_shards  # the whole sequence, as attention sees it
        mask = causal_band(s, s, 0, window, h.device)
        for layer in self.layers.values():
            h = layer(h, self.rope, mask=mask)
        return self._head(h, targets)

    @torch.jit.unused
    def _forward_layer_windows(
        self, tokens: torch.Tensor, targets: torch.Tensor | None, windows: dict[str, int]
    ) -> torch.Tensor:
        """``forward`` over layers of several windows: one banded mask per window (full causal
        attention, window 0, takes none), each layer its own."""
        h = self._embed(tokens)
        s = h.shape[1] * self.sequence_shards
        masks = {w: causal_band(s, s, 0, w, h.device) for w in set(windows.values()) if w > 0}
        for key, layer in self.layers.items():
            w = windows[key]
            h = layer(h, self.rope, mask=masks[w]) if w > 0 else layer(h, self.rope)
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
        if self.router_aux_loss_coef is not None:
            if self.inject_aux and torch.is_grad_enabled():
                h = self._inject_aux(h, self.router_aux_loss_coef)
        if self.output is None:
            return h
        if targets is None:
            logits = self.output(self.norm(h))
            if self.vocab_shards is not None:
                if self.gather_logits:
                    return self._whole_vocabulary(logits)
            return logits
        if self.vocab_shards is not None:
            self._require_loss_scope()
        loss = self.head_loss(h, targets)
        # The load-balancing term trains the routers; a forward without gradients (validation,
        # evaluate) reports the cross-entropy alone, as transformers' models and torchtitan's do.
        if self.router_aux_loss_coef is not None and torch.is_grad_enabled():
            if not self.inject_aux:
                aux = self.router_aux_loss()
                self.router_aux = aux.detach()
                loss = loss + self.router_aux_loss_coef * aux
        return loss

    @torch.jit.unused
    def _inject_aux(self, h: torch.Tensor, coef: float) -> torch.Tensor:
        """A pipeline stage's share of the load-balancing term, added to backward through its output
        (``moe.AuxLossAutoScaler``: the hidden states pass unchanged). Nothing for a stage without
        MoE layers."""
        if not any(isinstance(m, moe.MoE) and m.stats is not None for m in self.layers.modules()):
            return h
        aux = self.router_aux_loss()
        self.router_aux = aux.detach()
        return moe.AuxLossAutoScaler.apply(h, coef * aux)  # type: ignore[no-any-return]

    def router_aux_loss(self) -> torch.Tensor:
        """The load-balancing loss over this model's MoE layers, from their last forward, over the
        tokens of every rank of ``token_group``: transformers' over all layers together
        (``model.moe.aux_loss_scope=global``: framework.models.moe.load_balancing_loss), or the sum
        of each layer's own divided by the whole model's MoE layers (``layer``: a pipeline stage's
        share of the mean; ``layer_balancing_loss``). Each forward is one such batch: with gradient
        accumulation, the loss of micro batch i spans the data-parallel ranks' micro batches i, and
        the step's is their mean, as the cross-entropy's."""
        stats = [m.stats for m in self.layers.modules() if isinstance(m, moe.MoE) and m.stats is not None]
        if self.aux_per_layer:
            return moe.layer_balancing_loss(stats, self.token_group) / self.num_moe_layers  # type: ignore[arg-type]
        return moe.load_balancing_loss(stats, self.token_group)  # type: ignore[arg-type]

    def document_attention_mask(self, tokens: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
        """The documents' spans for the flash kernels, FlexAttention's ``BlockMask``, or SDPA's dense
        mask (see ``document_flex``). TorchScript cannot name the first two (the annotation leaves
        them out): a scripted model takes the dense mask."""
        if torch.jit.is_scripting():
            return dense_document_mask(doc)
        else:
            flex = self.document_flex
            if flex is None:
                if tokens.is_cuda and self.cfg.attention in (AttentionBackend.flash, AttentionBackend.fa4):
                    return document_spans(doc)  # type: ignore[return-value]
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
        if self.vocab_shards is not None:
            return self._vocab_parallel_loss(logits, targets)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    @torch.jit.unused
    def _vocab_parallel_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of vocabulary-sharded logits (a DTensor ``Shard(-1)`` over the TP
        ranks) under torch's ``loss_parallel()``, which the caller has entered
        (framework.models.parts.loss)."""
        return vocab_parallel_cross_entropy(logits, targets)

    @torch.jit.unused
    def _require_loss_scope(self) -> None:
        """Here, outside the loss head's compiled region, whose trace cannot check it."""
        require_scope()

    @torch.jit.unused
    def _whole_vocabulary(self, logits: torch.Tensor) -> torch.Tensor:
        """Vocabulary-sharded logits gathered to the full vocabulary on every TP rank (a plain tensor)."""
        return logits.full_tensor()  # type: ignore[attr-defined]

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Initialise in place after ``to_empty`` (meta -> real device): each parameter drawn
        from a generator seeded by (seed, its name), so that every layout starts from the
        single-process weights (framework.models.parts.weights.draw_weights says how)."""
        draw_weights(self, seed)


def keep_aux(model: Decoder, _args: object, _out: object) -> None:
    """The decoder's forward hook (an MoE model with the load-balancing loss on): its forward's term
    (``router_aux``) kept among the step's training forwards; evaluation (no gradient) and a trace
    (the freeze) keep nothing. A hook, not ``forward``: compiled as one region
    (``executor.scope=model``) the forward would guard on the list and recompile."""
    aux, model.router_aux = model.router_aux, None
    if aux is None or torch.compiler.is_exporting() or not torch.is_grad_enabled():
        return
    model.aux_values.append(aux)


@torch.no_grad()
def forward_cached(model: Decoder, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits of the last position for ``tokens`` (batch, new) appended after the cached ones: the
    trunk walked block by block, each block's ``forward_cached`` (its family's own)."""
    h = model.tok_embeddings(tokens)
    for i, block in enumerate(model.layers.values()):
        h = block.forward_cached(h, cache, i)
    cache.length += tokens.shape[1]
    return model.output(model.norm(h[:, -1]))
