"""The model's parameters as the planner counts them: specs from the model description, the shard
each rank holds (TP, FSDP, expert parallelism), FSDP units, and a pipeline rank's share.

Pure arithmetic over ``framework.models``' spec (no model is built); the dry run checks the counts
against the real sharded model. Memoized per parameter list (``MEMO``): the search plans thousands
of layouts over the same lists.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from framework.config.schema import (
    DType,
    ModelConfig,
    PeftConfig,
    PeftMethod,
)
from framework.models import model_spec
from framework.models.lora import matches
from framework.models.spec import TPStyle, Weight

GIB = 1024**3
MIB = 1024**2
DTYPE_BYTES = {DType.float32: 4, DType.bfloat16: 2, DType.float16: 2}
# Master weights and gradients are kept in fp32 (FSDP2 keeps the sharded parameter in its original
# dtype; ``param_dtype`` only changes the all-gathered compute copy); AdamW's two moments too, unless
# optimizer.state_dtype=bfloat16 (framework.planner.work.adamw_state_bytes).
MASTER_BYTES = 4


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of the model: its name, full shape and the tensor dim TP shards (if any)."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    unit: str  # FSDP unit that owns it: "layers.N", "root" (or HEAD_ROOT: a second root, zbv's V)
    # False for a pipeline's copy of a tied weight: stepped through the embedding it copies.
    optimizer: bool = True
    # A routed expert stack under expert parallelism: ``shape`` is this rank's slice (E / ep experts
    # on dim 0) and FSDP2 shards it over dp_shard x cp / ep ranks (Degrees.expert_shard). 0: dense.
    ep: int = 0


class _Memo:
    """Results keyed by the identity of an object the planner reuses (a cached spec, a cached list of
    parameters) and some hashable arguments. The object is held with its result, so its id cannot be
    reused by another while the entry lives. Why: the search plans a layout thousands of times over
    the same parameter lists (an MoE model has ~1,200 of them); summing them each time took minutes."""

    def __init__(self, size: int = 8192) -> None:
        self._size = size
        self._entries: dict[tuple[int, Any], tuple[object, Any]] = {}

    def get(self, obj: object, args: Any, compute: Any) -> Any:
        key = (id(obj), args)
        hit = self._entries.get(key)
        if hit is not None and hit[0] is obj:
            return hit[1]
        if len(self._entries) >= self._size:
            self._entries.clear()
        value = compute()
        self._entries[key] = (obj, value)
        return value


MEMO = _Memo()


def param_specs(m: ModelConfig, ep: int = 1) -> list[ParamSpec]:
    """Parameters of the model ``m`` describes, in ``named_parameters()`` order (tied output omitted),
    from its spec (framework.models): the planner needs no model; the dry run checks they agree.
    A routed expert stack is this rank's ``E / ep`` experts (framework.parallel.expert). The list is
    shared between calls (memoized): callers do not change it."""
    spec = model_spec(m)
    return MEMO.get(spec, ("specs", ep), lambda: _param_specs(spec, ep))


def _param_specs(spec: Any, ep: int) -> list[ParamSpec]:
    out = []
    for name, w, unit in spec.params():
        if w.experts:
            shape = (w.experts // ep, *w.shape[1:])
            out.append(ParamSpec(name, shape, w.tp_dim, unit, ep=ep))
        else:
            out.append(ParamSpec(name, w.shape, w.tp_dim, unit))
    return out


def local_numel(spec: ParamSpec, tp: int, dp_shard: int) -> int:
    """Elements of rank 0's shard: TP chunks ``tp_dim``, then FSDP2 chunks dim 0 of what is left
    (an expert stack's ``E / ep`` experts over the dp_shard x cp / ep ranks outside its ep group).

    torch.chunk gives the first ranks ceil(size / n) rows, so rank 0 holds the largest shard.
    """
    return _local(spec.shape, spec.tp_dim, spec.ep, tp, dp_shard)


def _local(shape_: tuple[int, ...], tp_dim: int | None, ep: int, tp: int, dp_shard: int) -> int:
    shape = list(shape_)
    if tp > 1 and tp_dim is not None:
        shape[tp_dim] = math.ceil(shape[tp_dim] / tp)
    shard = max(1, dp_shard // ep) if ep else dp_shard
    if shard > 1:
        shape[0] = math.ceil(shape[0] / shard)
    return math.prod(shape)


def param_kinds(specs: list[ParamSpec]) -> dict[tuple[Any, ...], int]:
    """The parameters grouped by what their shard size depends on, with their counts (memoized)."""

    def count() -> dict[tuple[Any, ...], int]:
        out: dict[tuple[Any, ...], int] = {}
        for s in specs:
            k = (s.shape, s.tp_dim, s.ep, s.optimizer)
            out[k] = out.get(k, 0) + 1
        return out

    return MEMO.get(specs, "kinds", count)


def ep_of(specs: list[ParamSpec]) -> int:
    """The expert-parallel degree the specs were built for (1 for a dense model or ep = 1)."""
    return max((k[2] for k in param_kinds(specs)), default=1) or 1


def sum_local(specs: list[ParamSpec], tp: int, dp_shard: int, which: str = "all") -> int:
    """``sum(local_numel(s, tp, dp_shard) for s in specs)`` over all of them, those with optimizer
    state (``which="optimizer"``) or the expert stacks under ep (``"experts"``); ``"max"``: the
    largest one. Memoized per list (see ``_Memo``)."""

    def compute() -> int:
        kinds = param_kinds(specs)
        if which == "max":
            return max(_local(sh, td, ep, tp, dp_shard) for sh, td, ep, _ in kinds)
        keep = {
            "all": lambda ep, opt: True,
            "optimizer": lambda ep, opt: opt,
            "experts": lambda ep, opt: ep > 1,
        }[which]
        return sum(
            n * _local(sh, td, ep, tp, dp_shard) for (sh, td, ep, opt), n in kinds.items() if keep(ep, opt)
        )

    return MEMO.get(specs, ("sum", tp, dp_shard, which), compute)


# The FSDP unit of the last stage's final norm and output projection, where the rank also holds the
# first stage (whose root unit is the embedding): two roots, two all-gathers.
HEAD_ROOT = "root.head"


def tied_copy(m: ModelConfig) -> ParamSpec | None:
    """Under pp, the last stage's copy of a tied embedding (framework.parallel.pipeline): a
    parameter and a gradient like the embedding's, no optimizer state. None when untied."""
    if not m.tie_embeddings:
        return None
    embedding = next(s for s in param_specs(m) if s.name.startswith("tok_embeddings"))
    return dataclasses.replace(embedding, name="output.weight", unit="root", optimizer=False)


def fsdp_units(specs: list[ParamSpec], tp: int) -> list[int]:
    """Unsharded fp32 bytes of each FSDP unit: one per block, then the root (embeddings, norm, output;
    a pipeline rank holding both the first and the last stage has two roots, ``rank_specs``)."""
    return list(MEMO.get(specs, ("units", tp), lambda: tuple(_unit_bytes(specs, tp))))


def _unit_bytes(specs: list[ParamSpec], tp: int) -> list[int]:
    units: dict[str, int] = {}
    for s in specs:
        units[s.unit] = units.get(s.unit, 0) + local_numel(s, tp, 1) * MASTER_BYTES
    roots = [units.pop(name) for name in ("root", HEAD_ROOT) if name in units]
    return [*units.values(), *roots]


def rank_specs(
    specs: list[ParamSpec], split: tuple[tuple[int, int], ...], ids: list[int], tied: ParamSpec | None
) -> list[ParamSpec]:
    """The parameters of the stages ``ids``: their blocks, the embedding with stage 0, the final norm
    and output projection with the last stage (``tied``: its copy of a tied embedding). Memoized per
    parameter list (the search plans the same split many times): callers do not change the result."""
    return MEMO.get(specs, ("rank", split, tuple(ids), tied), lambda: _stage_specs(specs, split, ids, tied))


def _stage_specs(
    specs: list[ParamSpec], split: tuple[tuple[int, int], ...], ids: list[int], tied: ParamSpec | None
) -> list[ParamSpec]:
    blocks = {i for s in ids for i in range(*split[s])}
    last = len(split) - 1
    out = []
    for spec in specs:
        if spec.unit.startswith("layers."):
            keep = int(spec.unit.split(".")[1]) in blocks
        elif spec.name.startswith("tok_embeddings"):
            keep = 0 in ids
        else:
            keep = last in ids
        if keep:
            out.append(spec)
    if tied is not None and last in ids:
        out.append(tied)
    if 0 in ids and last in ids and last > 0:  # zbv's V: each stage is fully_shard's root of its own
        out = [
            dataclasses.replace(s, unit=HEAD_ROOT)
            if s.unit == "root" and not s.name.startswith("tok_embeddings")
            else s
            for s in out
        ]
    return out


# The weights that are nn.Linear layers, which LoRA can target (framework.models.lora.linear_names):
# TP's Linear styles, and the MoE layer's shared-expert Linears (2-D; its router, ``gate``, is a bare
# parameter and its routed experts are stacks).
_LINEAR_STYLES = (TPStyle.colwise, TPStyle.rowwise, TPStyle.output)


def lora_specs(specs: list[ParamSpec], m: ModelConfig, peft: PeftConfig) -> list[ParamSpec]:
    """What trains under ``peft.method=lora``: the adapters of the targeted Linear layers among
    ``specs`` (a pipeline rank's share, or the whole model), ``lora_A`` (rank x in) and ``lora_B``
    (out x rank) in their layer's FSDP unit, never TP-sharded (LoRA refuses tp > 1); a tied output
    head's adapters go with the final norm's stage. Empty under ``peft.method=none`` (every
    parameter trains). Memoized per list: callers do not change the result."""
    if peft.method is PeftMethod.none:
        return []
    # The list identifies the model (its specs, or a pipeline rank's share of them).
    return MEMO.get(specs, ("lora", peft.rank, tuple(peft.targets)), lambda: _lora_specs(specs, m, peft))


def _lora_specs(specs: list[ParamSpec], m: ModelConfig, peft: PeftConfig) -> list[ParamSpec]:
    spec = model_spec(m)
    names = {s.name for s in specs}
    linears = [(n, w, u) for n, w, u in spec.params() if _is_linear(w)]
    head = next((w for w in spec.last if w.tied and w.tp is TPStyle.output), None)
    if head is not None and ("output.weight" in names or "norm.weight" in names):
        linears.append((head.name, head, "root"))  # the tied head: a Linear over the embedding's tensor
        names.add(head.name)
    out = []
    for name, w, unit in linears:
        module = name.removesuffix(".weight")
        if name in names and any(matches(module, p) for p in peft.targets):
            rows, cols = w.shape
            out.append(ParamSpec(f"{module}.lora_A.weight", (peft.rank, cols), None, unit))
            out.append(ParamSpec(f"{module}.lora_B.weight", (rows, peft.rank), None, unit))
    return out


def _is_linear(w: Weight) -> bool:
    if w.tp in _LINEAR_STYLES or (w.tp is TPStyle.replicated and len(w.shape) == 2):  # MLA's Linears
        return True
    shared_expert = w.tp is TPStyle.moe and w.param == "weight" and not w.experts and len(w.shape) == 2
    return shared_expert and not w.module.endswith("gate")
