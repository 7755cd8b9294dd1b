"""A model family's layout as plain data: every weight, its shape, how TP shards it, its HF name.

Why one description: the planner (parameter shapes and FSDP units), the tensor-parallel plan, the
activation-checkpoint and compile units, float8's Linear list and the Hugging Face name maps (both
directions, with the RoPE row permutation) used to spell the Llama layout out one by one, so a new
family meant editing each in step. Each of them now reads a ``ModelSpec``; ``tests/models/test_models.py``
checks that the spec and the built ``nn.Module`` agree, name for name and shape for shape.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
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

    @property
    def name(self) -> str:
        return f"{self.module}.{self.param}"

    @property
    def experts(self) -> int:
        """Routed experts stacked on dim 0 (``hf_experts`` set), which expert parallelism shards over
        the ep ranks and of which a token runs top-k; 0 for every other weight."""
        return self.shape[0] if self.hf_experts else 0

    @property
    def tp_dim(self) -> int | None:
        return _TP_DIM.get(self.tp)


@dataclass(frozen=True)
class ModelSpec:
    """A decoder: root weights before the blocks, ``n_layers`` identical blocks, root weights after.

    Parameter names are those of ``named_parameters()``: ``{module}.weight`` at the root and
    ``{blocks}.{i}.{module}.weight`` in block ``i`` (a tied output head is the embedding's tensor
    and is not listed by ``params``). ``sublayers``: the block's modules whose input tensor parallelism gathers
    from the sequence shards, with how many positional inputs each takes (the first is the
    activation, the others pass through as they are).
    """

    family: str
    hf_architecture: str
    hf_model_type: str
    n_layers: int
    head_dim: int
    first: tuple[Weight, ...]
    block: tuple[Weight, ...]
    last: tuple[Weight, ...]
    sublayers: dict[str, int] = field(default_factory=dict)
    sliding_window: int = 0  # > 0: each position attends to itself and the window - 1 before it (Mistral)
    blocks: str = "layers"

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

    def units(self) -> list[str]:
        """The repeated units (FSDP, activation checkpointing, per-block compile), in order."""
        return [f"{self.blocks}.{i}" for i in range(self.n_layers)]

    def params(self) -> Iterator[tuple[str, Weight, str]]:
        """(full name, weight, unit) in ``named_parameters()`` order; unit is a block or "root"."""
        for w in self.first:
            yield w.name, w, "root"
        for unit in self.units():
            for w in self.block:
                yield f"{unit}.{w.name}", w, unit
        for w in self.last:
            if not w.tied:
                yield w.name, w, "root"

    def hf_names(self) -> dict[str, str]:
        """Our parameter name -> its Hugging Face name, for every weight (a tied head included:
        a checkpoint's ``lm_head.weight`` is named, then refused or ignored by the importer)."""
        out = {w.name: w.hf for w in (*self.first, *self.last)}
        for unit in self.units():
            out |= {f"{unit}.{w.name}": f"model.{unit}.{w.hf}" for w in self.block}
        return out

    def hf_experts(self) -> dict[str, tuple[str, ...]]:
        """Parameter name -> the Hub names of its per-expert parts (``{e}`` left to fill), for the
        stacked expert weights of an MoE block (``Weight.hf_experts``)."""
        out = {}
        for unit in self.units():
            out |= {
                f"{unit}.{w.name}": tuple(f"model.{unit}.{t}" for t in w.hf_experts)
                for w in self.block
                if w.hf_experts
            }
        return out

    def rope_heads(self) -> dict[str, int]:
        """Parameter name -> heads whose rows are permuted between RoPE orders (q/k and their norms)."""
        return {name: w.rope_heads for name, w, _ in self.params() if w.rope_heads}
