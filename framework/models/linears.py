"""The model's Linear layers as float8 sees them (``model.float8``): which of them convert, the
refusals of a float8 config that converts none or whose TP shards float8 cannot multiply, and the
saved activations that float8 saves (the planner's term); and an MoE family's stacked experts, whose
grouped GEMMs float8 also converts (``converted_experts``).

Why here and not in ``framework.kernels.float8``: these walk the model's spec, and kernels sit below
the models; the per-layer rules (``converts``, the size filter, the device and torchao checks) stay
there.
"""

from __future__ import annotations

from dataclasses import dataclass

from framework.config.schema import Float8Recipe, ModelConfig
from framework.kernels.float8 import SAVED_BYTES_PER_INPUT, check_experts, converts, converts_experts
from framework.models.registry import model_spec
from framework.models.spec import ModelSpec, TPStyle


@dataclass(frozen=True)
class LinearShape:
    """One ``nn.Linear`` of framework.models.Decoder: ``weight`` is (out_features, in_features)."""

    fqn: str
    out_features: int
    in_features: int
    # "colwise" (shards out_features under TP), "rowwise" (shards in_features) or "replicated"
    # (whole on every TP rank: multi-head latent attention's)
    tp_style: str


def linear_shapes(m: ModelConfig) -> list[LinearShape]:
    """Every Linear of the model, in module order, from its spec (framework.models)."""
    return list(_spec_linears(model_spec(m)))


_LINEARS: dict[int, tuple[ModelSpec, tuple[LinearShape, ...]]] = {}


def _spec_linears(spec: ModelSpec) -> tuple[LinearShape, ...]:
    """Cached by the spec object (model_spec caches those): the layout search asks for the same
    model's Linears tens of thousands of times."""
    hit = _LINEARS.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    if len(_LINEARS) >= 256:
        _LINEARS.clear()
    out: list[LinearShape] = []
    for unit, kind in spec.layer_units():
        for w in kind.weights:
            if w.tp in (TPStyle.colwise, TPStyle.rowwise) or (
                w.tp is TPStyle.replicated and len(w.shape) == 2
            ):
                out.append(LinearShape(f"{unit}.{w.module}", *w.shape, w.tp.value))
    head = next(w for w in spec.last if w.tp is TPStyle.output)
    out.append(LinearShape(head.module, *head.shape, "colwise"))
    _LINEARS[id(spec)] = (spec, tuple(out))
    return _LINEARS[id(spec)][1]


def converted(m: ModelConfig) -> list[LinearShape]:
    """The Linear layers that ``model.float8`` swaps for float8 ones."""
    return [s for s in linear_shapes(m) if converts(m, s.fqn, s.out_features, s.in_features)]


@dataclass(frozen=True)
class ExpertGemm:
    """One grouped GEMM of an MoE layer's stacked experts (framework.models.moe.GroupedExperts):
    ``num_experts`` weights of (out_features, in_features), each token running ``top_k`` of them."""

    fqn: str  # the experts module, e.g. layers.0.feed_forward.experts
    param: str  # gate_up_proj or down_proj
    num_experts: int
    out_features: int
    in_features: int
    top_k: int


def expert_gemms(m: ModelConfig) -> list[ExpertGemm]:
    """Every stacked-experts GEMM of the model, in module order, from its spec ([] for a dense one)."""
    spec = model_spec(m)
    return [
        ExpertGemm(f"{unit}.{w.module}", w.param, *w.shape, m.moe.num_experts_per_tok)
        for unit, kind in spec.layer_units()
        for w in kind.weights
        if w.experts and len(w.shape) == 3  # not the stacked biases (GPT-OSS's)
    ]


def converted_experts(m: ModelConfig) -> list[ExpertGemm]:
    """The expert GEMMs ``model.float8`` runs in float8 (torchao's grouped GEMM): a module's GEMMs
    convert together (``framework.kernels.float8.converts_experts``), as ``apply_float8`` marks them."""
    gemms = expert_gemms(m)
    dims: dict[str, list[int]] = {}
    for g in gemms:
        dims.setdefault(g.fqn, []).extend((g.out_features, g.in_features))
    return [g for g in gemms if converts_experts(m, g.fqn, dims[g.fqn])]


def check_shapes(m: ModelConfig, tp: int = 1) -> None:
    """Refuse a float8 config that converts nothing, whose TP shards float8 cannot multiply, or whose
    float8 experts the per-expert loop would run (``model.moe.expert_kernel=loop``).

    Raises ValueError naming the value and what would work. No-op for ``model.float8=none``.
    """
    if m.float8 is Float8Recipe.none:
        return
    chosen = converted(m)
    if converted_experts(m):
        check_experts(m)
    elif not chosen:
        dims = sorted({(s.out_features, s.in_features) for s in linear_shapes(m)})
        raise ValueError(
            f"model.float8={m.float8.value} converts no Linear layer"
            + (" and no MoE experts" if expert_gemms(m) else "")
            + f" of {m.name}: each is in "
            f"model.float8_skip={m.float8_skip}, has a dim that is not a multiple of 16, or "
            + (
                "is below the float8 size threshold (model.float8_size_filter=true)"
                if m.float8_size_filter
                else "cannot be converted"
            )
            + f"; weight shapes (out, in) {dims[:6]}: use model.float8=none"
            + (", or model.float8_size_filter=false" if m.float8_size_filter else "")
        )
    if m.tie_embeddings and any(s.fqn == "output" for s in chosen):
        raise ValueError(
            f"model.float8={m.float8.value} would convert the output head, which {m.name} ties to the "
            f"embedding (model.tie_embeddings=true), and float8 weights cannot be shared: keep 'output' "
            f"in model.float8_skip (now {m.float8_skip})"
        )
    if tp > 1:
        for s in chosen:
            out = s.out_features // tp if s.tp_style == "colwise" else s.out_features
            inp = s.in_features // tp if s.tp_style == "rowwise" else s.in_features
            if out % 16 or inp % 16:
                raise ValueError(
                    f"model.float8={m.float8.value} with sharding.tp={tp}: {s.fqn}'s local weight shard "
                    f"is ({out}, {inp}), and float8 GEMMs need dims that are multiples of 16: use a "
                    f"sharding.tp that keeps them so (e.g. {_good_tp(chosen)}), or add "
                    f"'{s.fqn.rsplit('.', 1)[-1]}' to model.float8_skip"
                )


def _good_tp(chosen: list[LinearShape]) -> list[int]:
    ok = []
    for tp in (1, 2, 4, 8):
        if all(
            (s.out_features // tp if s.tp_style == "colwise" else s.out_features) % 16 == 0
            and (s.in_features // tp if s.tp_style == "rowwise" else s.in_features) % 16 == 0
            for s in chosen
        ):
            ok.append(tp)
    return ok


def saved_activation_bytes_per_layer(m: ModelConfig, tokens: int, tp: int, layer: int = 0) -> int:
    """Saved-activation bytes that float8 saves per micro-batch in block ``layer`` (the planner
    subtracts it, once per layer of that block's kind)."""
    if m.float8 is Float8Recipe.none:
        return 0
    per_block = [s for s in converted(m) if s.fqn.startswith(f"layers.{layer}.")]
    return int(SAVED_BYTES_PER_INPUT * tokens * sum(s.in_features for s in per_block)) // tp


def bf16_weight_copy_bytes_per_layer(m: ModelConfig, tp: int = 1, ep: int = 1, layer: int = 0) -> int:
    """The bf16 copies of block ``layer``'s weights that bf16 autocast makes for its GEMMs: every Linear
    that ``model.float8`` leaves in bf16 and every stacked expert GEMM it leaves in bf16 (2 bytes a
    weight; TP shards the Linear layers, expert parallelism the experts). The planner counts them
    where a compiled backward keeps them (framework.planner.memory)."""
    linears = {s.fqn for s in converted(m)}
    experts = {(g.fqn, g.param) for g in converted_experts(m)}
    dense = sum(
        s.out_features * s.in_features
        for s in linear_shapes(m)
        if s.fqn.startswith(f"layers.{layer}.") and s.fqn not in linears
    )
    stacked = sum(
        g.num_experts * g.out_features * g.in_features
        for g in expert_gemms(m)
        if g.fqn.startswith(f"layers.{layer}.") and (g.fqn, g.param) not in experts
    )
    return 2 * (dense // tp + stacked // ep)
