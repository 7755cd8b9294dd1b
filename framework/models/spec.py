"""A model family's layout as plain data: every weight, its shape, how TP shards it, its HF name,
and the stack of layer kinds (``LayerKind``) it is made of, written once per family as a pattern
(``layer_pattern``: ``dense x3, moe x58``; ``[sliding, full] x18``).

Why one description: the planner (parameter shapes and FSDP units), the tensor-parallel plan, the
activation-checkpoint and compile units, float8's Linear list and the Hugging Face name maps (both
directions, with the RoPE row permutation) used to spell the Llama layout out one by one, so a new
family meant editing each in step. Each of them now reads a ``ModelSpec``; ``tests/models/test_models.py``
checks that the spec and the built ``nn.Module`` agree, name for name and shape for shape.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from enum import Enum


class TPStyle(Enum):
    """How tensor parallelism lays out one weight's module (framework.parallel.tensor maps each to
    torch's ParallelStyle)."""

    colwise = "colwise"  # a Linear sharding out_features: its output stays local to the rank
    rowwise = "rowwise"  # a Linear sharding in_features: its output is reduce-scattered on the sequence
    embedding = "embedding"  # row-wise over the vocabulary; the output is sharded on the sequence
    output = "output"  # column-wise over the vocabulary; the logits are gathered to every rank
    sequence = "sequence"  # a norm over the model dim, run sequence-parallel (weight replicated)
    heads = "heads"  # a norm over head_dim, run on the rank's own heads (weight replicated)
    moe = "moe"  # an MoE layer's router or stacked experts (framework.models.moe): not sharded by TP
    # A weight TP leaves whole (multi-head latent attention's): its sublayer runs whole on every TP
    # rank, as an MoE sublayer does
    replicated = "replicated"


# The weight dim each style shards (None: replicated over the TP axis).
_TP_DIM = {TPStyle.colwise: 0, TPStyle.rowwise: 1, TPStyle.embedding: 0, TPStyle.output: 0}


@dataclass(frozen=True)
class Weight:
    """One parameter: ``module`` is its module's path under the root or under a block."""

    module: str
    hf: str  # its Hugging Face name, under ``model.layers.N.`` for a block's weights
    shape: tuple[int, ...]
    tp: TPStyle
    # > 0: dim 0 holds this many heads of RoPE-rotated features (q/k rows, or a per-head norm), in
    # our interleaved-pair order; HF rotates halves, so the rows are permuted per head on the way.
    rope_heads: int = 0
    # The embedding's tensor (tied output head): its module is laid out, but it is no parameter of
    # its own (``named_parameters()`` lists the embedding only) and has no HF name.
    tied: bool = False
    # The parameter's own name in its module (``weight``; an MoE layer's stacked experts name theirs).
    param: str = "weight"
    # Stacked experts (dim 0: one per expert): the Hub files keep one tensor per expert and part, named
    # by these templates (``{e}``: the expert), whose rows are stacked in this order along dim 1 (gate
    # then up for ``gate_up_proj``). Empty: the tensor is stored whole under ``hf``.
    hf_experts: tuple[str, ...] = ()
    # A persistent buffer, not a parameter (DeepSeek-V3's router selection bias): in the state dict
    # and the Hub files, never in ``params()`` (no gradient, no optimizer state, not sharded).
    buffer: bool = False
    # Routed experts stacked on dim 0 that the Hub files also store stacked, whole under ``hf``
    # (GPT-OSS's ``mlp.experts.gate_up_proj`` and its bias).
    stacked: bool = False

    @property
    def name(self) -> str:
        return f"{self.module}.{self.param}"

    @property
    def experts(self) -> int:
        """Routed experts stacked on dim 0 (``hf_experts`` set), which expert parallelism shards over
        the ep ranks and of which a token runs top-k; 0 for every other weight."""
        return self.shape[0] if self.hf_experts or self.stacked else 0

    @property
    def tp_dim(self) -> int | None:
        return _TP_DIM.get(self.tp)


class AttentionKind(Enum):
    """A layer's attention: grouped-query (framework.models.parts.attention) or DeepSeek's multi-head
    latent attention (low-rank q and kv projections, decoupled RoPE heads)."""

    gqa = "gqa"
    mla = "mla"


class MLPKind(Enum):
    """A layer's MLP: SwiGLU, or a Mixture-of-Experts layer (framework.models.moe), with shared
    experts beside the routed ones (``moe_shared``)."""

    dense = "dense"
    moe = "moe"
    moe_shared = "moe_shared"


@dataclass(frozen=True)
class LayerKind:
    """One kind of layer of a stack: its weights (module paths under the block), what it saves for
    backward per token (the planner's activation term, before its measured factor), its attention
    and window (0: full causal; > 0: each position sees itself and the window - 1 before it), its MLP.
    ``name`` is the word a pattern uses for it."""

    name: str
    weights: tuple[Weight, ...]
    saved_values: int
    attention: AttentionKind = AttentionKind.gqa
    window: int = 0
    mlp: MLPKind = MLPKind.dense
    # heads x width of attention's score and value products per token ((q.k width + v width) / 2 a
    # head); 0: n_heads x the spec's head_dim (grouped-query attention).
    score_width: int = 0

    @property
    def sparse(self) -> bool:
        return self.mlp is not MLPKind.dense


# One item of a pattern: a kind's name, or a bracketed list of names, optionally "x N" times.
_ITEM = re.compile(r"\s*(\[[^\]]*\]|[A-Za-z_][\w]*)\s*(?:x\s*(\d+))?\s*(?:,|$)")


def layer_pattern(
    text: str, kinds: dict[str, LayerKind], key: str = "the layer pattern"
) -> tuple[LayerKind, ...]:
    """The stack ``text`` describes, one kind per layer: comma-separated items, each a kind's name
    or a bracketed group of them, optionally repeated (``dense x3, moe x58``; ``[sliding, full] x18``).
    Raises ValueError naming ``key``, the text and the valid kinds when it does not parse."""
    valid = "|".join(kinds)
    out: list[LayerKind] = []
    pos = 0
    while pos < len(text):
        found = _ITEM.match(text, pos)
        if found is None or found.end() == pos:
            raise ValueError(
                f"{key}={text!r} does not parse at {text[pos:]!r}; valid: items NAME, NAME xN or "
                f"[NAME, ...] xN separated by commas, NAME one of {valid}"
            )
        group, times = found.group(1), int(found.group(2) or 1)
        names = [n.strip() for n in group.strip("[]").split(",")] if group.startswith("[") else [group]
        for n in names:
            if n not in kinds:
                raise ValueError(f"{key}={text!r} names the layer kind {n!r}; valid: {valid}")
        out += [kinds[n] for n in names] * times
        pos = found.end()
    if not out:
        raise ValueError(f"{key}={text!r} has no layer; valid: a pattern of kinds {valid}")
    return tuple(out)


@dataclass(frozen=True)
class ModelSpec:
    """A decoder: root weights before the blocks, one block per layer (its ``LayerKind``), root
    weights after.

    Parameter names are those of ``named_parameters()``: ``{module}.weight`` at the root and
    ``{blocks}.{i}.{module}.weight`` in block ``i`` (a tied output head is the embedding's tensor
    and is not listed by ``params``). ``sublayers``: the blocks' modules whose input tensor parallelism
    gathers from the sequence shards, with how many positional inputs each takes (the first is the
    activation, the others pass through as they are).
    """

    family: str
    hf_architecture: str
    hf_model_type: str
    head_dim: int
    first: tuple[Weight, ...]
    layers: tuple[LayerKind, ...]
    last: tuple[Weight, ...]
    sublayers: dict[str, int] = field(default_factory=dict)
    blocks: str = "layers"
    # Multi-token prediction layers after the trunk (DeepSeek-V3's MTP, ``model.mtp_layers``): one kind
    # per layer, its weights the whole layer's (its own projections and norms, its block's under
    # ``block.``). The Hub files number them after the trunk (``model.layers.{n_layers + i}.``), and so
    # does the module (``mtp.layers.{n_layers + i}``); their parameters are the root unit's.
    mtp: tuple[LayerKind, ...] = ()
    # Tensors each MTP layer's Hub prefix also stores, copies of shared ones: their name there -> ours
    # (DeepSeek-V3's ``embed_tokens`` and ``shared_head.head``). The import reads ours, the export
    # writes the copies.
    mtp_shared: dict[str, str] = field(default_factory=dict)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @functools.cached_property
    def numel(self) -> tuple[int, int, int]:
        """(elements of all parameters, of them in routed expert stacks, experts per stack: 0 when
        dense), counted once per spec (the planner asks for every layout it weighs)."""
        total = expert = experts = 0
        for _, w, _ in self.params():
            n = math.prod(w.shape)
            total += n
            if w.experts:
                expert, experts = expert + n, w.experts
        return total, expert, experts

    @functools.cached_property
    def _all_kinds(self) -> tuple[tuple[LayerKind, int], ...]:
        return self._count(range(self.n_layers))

    def _count(self, layers: Iterable[int]) -> tuple[tuple[LayerKind, int], ...]:
        counts: dict[int, list] = {}
        for i in layers:
            kind = self.layers[i]
            entry = counts.setdefault(id(kind), [kind, 0])
            entry[1] += 1
        return tuple((k, n) for k, n in counts.values())

    def kinds(self, layers: Iterable[int] | None = None) -> tuple[tuple[LayerKind, int], ...]:
        """(kind, how many layers of it) for every kind among ``layers`` (block indices; None: every
        layer), in order of first appearance: what the planner's per-layer terms sum over."""
        return self._all_kinds if layers is None else self._count(layers)

    def score_width(self, n_heads: int) -> int:
        """Attention's heads x width summed over the layers (``LayerKind.score_width``): the L·H·Q of
        the score and value FLOPs 12·L·H·Q·T."""
        kinds = (*self.kinds(), *((kind, 1) for kind in self.mtp))
        return sum(n * (kind.score_width or n_heads * self.head_dim) for kind, n in kinds)

    def first_of(self, kind: LayerKind) -> int:
        """The index of the first layer of ``kind``."""
        return next(i for i, k in enumerate(self.layers) if k is kind)

    @property
    def sliding_window(self) -> int:
        """The attention window every layer shares (Mistral's); 0 when full, or when the layers'
        windows differ (each layer's is its kind's ``window``)."""
        windows = {kind.window for kind, _ in self.kinds()}
        return windows.pop() if len(windows) == 1 else 0

    @property
    def uniform(self) -> bool:
        """Every layer of one kind (every family before DeepSeek-V3)."""
        return len(self._all_kinds) == 1

    def units(self) -> list[str]:
        """The repeated units (FSDP, activation checkpointing, per-block compile), in order."""
        return [f"{self.blocks}.{i}" for i in range(self.n_layers)]

    def layer_units(self) -> Iterator[tuple[str, LayerKind]]:
        """(unit, its kind) for every layer, in order."""
        return zip(self.units(), self.layers, strict=True)

    def params(self) -> Iterator[tuple[str, Weight, str]]:
        """(full name, weight, unit) in ``named_parameters()`` order; unit is a block or "root"."""
        return (t for t in self.tensors() if not t[1].buffer)

    def tensors(self) -> Iterator[tuple[str, Weight, str]]:
        """``params()`` and the persistent buffers among them (``Weight.buffer``): what the state dict
        and the Hub files hold."""
        for w in self.first:
            yield w.name, w, "root"
        for unit, kind in self.layer_units():
            for w in kind.weights:
                yield f"{unit}.{w.name}", w, unit
        for w in self.last:
            if not w.tied:
                yield w.name, w, "root"
        for unit, kind in self.mtp_units():
            for w in kind.weights:
                yield f"{unit}.{w.name}", w, "root"

    def mtp_units(self) -> Iterator[tuple[str, LayerKind]]:
        """(module path, kind) of each multi-token prediction layer, numbered after the trunk."""
        return ((f"mtp.{self.blocks}.{self.n_layers + i}", kind) for i, kind in enumerate(self.mtp))

    def hf_copies(self) -> dict[str, str]:
        """Hub name -> our parameter name of the copies the MTP layers' prefixes hold (``mtp_shared``)."""
        out = {}
        for i in range(len(self.mtp)):
            prefix = f"model.{self.blocks}.{self.n_layers + i}."
            out |= {f"{prefix}{theirs}": ours for theirs, ours in self.mtp_shared.items()}
        return out

    def _hf_units(self) -> Iterator[tuple[str, str, LayerKind]]:
        """(our module path, its Hub prefix, kind) of every block, the trunk's and MTP's."""
        for unit, kind in self.layer_units():
            yield unit, f"model.{unit}.", kind
        for i, (unit, kind) in enumerate(self.mtp_units()):
            yield unit, f"model.{self.blocks}.{self.n_layers + i}.", kind

    def hf_names(self) -> dict[str, str]:
        """Our parameter name -> its Hugging Face name, for every weight (a tied head included:
        a checkpoint's ``lm_head.weight`` is named, then refused or ignored by the importer)."""
        out = {w.name: w.hf for w in (*self.first, *self.last)}
        for unit, prefix, kind in self._hf_units():
            out |= {f"{unit}.{w.name}": f"{prefix}{w.hf}" for w in kind.weights}
        return out

    def hf_experts(self) -> dict[str, tuple[str, ...]]:
        """Parameter name -> the Hub names of its per-expert parts (``{e}`` left to fill), for the
        stacked expert weights of an MoE block (``Weight.hf_experts``)."""
        out = {}
        for unit, prefix, kind in self._hf_units():
            out |= {
                f"{unit}.{w.name}": tuple(f"{prefix}{t}" for t in w.hf_experts)
                for w in kind.weights
                if w.hf_experts
            }
        return out

    def rope_heads(self) -> dict[str, int]:
        """Parameter name -> heads whose rows are permuted between RoPE orders (q/k and their norms)."""
        return {name: w.rope_heads for name, w, _ in self.params() if w.rope_heads}
