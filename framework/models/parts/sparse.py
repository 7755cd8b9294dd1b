"""The sparse block the MoE families share (Qwen3-MoE, Mixtral): the dense block's attention, then
``framework.models.moe.MoE`` in place of the SwiGLU MLP, under the same module name (``feed_forward``),
so that the trunk, FSDP's units and activation checkpointing see one block like any other.

From ``model.moe`` (``framework.config.schema.MoEConfig``) to the layer's own config, the spec's
entries for the router and the stacked experts (with their per-expert Hub names), and the balance
figures of a step (``gather_load``: per layer, read and reset by the trainer at its log rows), and
those sums as state that a rebuild carries over (``routing_state``) or that a forward of no step's
tokens leaves as they were (``routing_unchanged``).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from framework.config.schema import ModelConfig
from framework.models import moe
from framework.models.parts.attention import Attention
from framework.models.parts.decoder import Decoder, TransformerBlock
from framework.models.spec import LayerKind, MLPKind, ModelSpec, TPStyle, Weight


def expert_width(m: ModelConfig) -> int:
    """One routed expert's SwiGLU width: ``model.moe.moe_intermediate_size``, 0 = ``model.ffn_dim``."""
    return m.moe.moe_intermediate_size or m.ffn_dim


def layer_config(m: ModelConfig) -> moe.MoEConfig:
    """The MoE layer's config from ``model.moe`` (the schema's keys, the launcher's rules ran on them)."""
    c = m.moe
    return moe.MoEConfig(
        dim=m.dim,
        moe_intermediate_size=expert_width(m),
        num_experts=c.num_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        score=moe.RouterScore(c.router_score.value),
        norm_topk_prob=c.norm_topk_prob,
        routed_scaling_factor=c.routed_scaling_factor,
        capacity_factor=c.capacity_factor or None,
        router_aux_loss_coef=c.router_aux_loss_coef,
        bias_update_rate=c.bias_update_rate,
        num_shared_experts=c.num_shared_experts,
        shared_intermediate_size=c.shared_intermediate_size,
        kernel=moe.ExpertKernel(c.expert_kernel.value),
        n_group=c.n_group,
        topk_group=c.topk_group,
    )


class SparseMLP(moe.MoE):
    """``MoE`` that also sums what each forward routed (``load``, per expert) and dropped, since the
    trainer last read them (``take_load``). Plain attributes, not buffers: the state dict stays
    transformers' key for key. The sums are taken by a forward hook on the block (``count_load``), not
    in ``forward``: the block's ``forward`` is what ``torch.compile`` traces (fullgraph), and its hooks run
    around it, in eager; there a forward that activation checkpointing reruns during backward is told
    apart and not counted twice."""

    def __init__(self, cfg: moe.MoEConfig) -> None:
        super().__init__(cfg)
        self.load: torch.Tensor | None = None
        self.dropped: torch.Tensor | None = None
        self.step_load: torch.Tensor | None = None  # since the last optimizer step (the bias update)

    @torch.no_grad()
    def count(self) -> None:
        """Add the last forward's routed and dropped counts to the sums."""
        stats = self.stats
        if stats is None:
            return
        counts = stats.tokens_per_expert.detach()
        if self.load is None or self.load.device != counts.device:
            self.load, self.step_load = torch.zeros_like(counts), torch.zeros_like(counts)
            self.dropped = torch.zeros((), dtype=counts.dtype, device=counts.device)
        assert self.step_load is not None and self.dropped is not None
        self.load += counts
        self.step_load += counts
        self.dropped += stats.dropped.detach()

    def init_buffers(self) -> None:
        """The sigmoid router's selection bias starts at zero (after ``to_empty``, which leaves it
        uninitialised, and after an HF import, which has none)."""
        if self.gate.expert_bias is not None:
            self.gate.expert_bias.zero_()


def count_load(block: nn.Module, _args: object, _out: object) -> None:
    """The sparse block's forward hook: its MoE layers' counts into their sums, for training forwards
    only. Not in a recompute inside backward (activation checkpointing), which routes the same tokens
    again, nor without gradients (validation, ``framework.generate``, the verifier's numerics check):
    their tokens are no step's, and counted they would enter the next metrics row and move the sigmoid
    routers' bias (``update_expert_biases``). Grad mode, as ``keep_aux`` reads it: compiled, Dynamo
    guards on it already, so the check adds no recompile."""
    if torch.compiler.is_exporting() or not torch.is_grad_enabled():
        return  # a trace (the freeze, on meta), or a forward of no step's tokens
    if not torch.compiler.is_compiling() and torch._C._current_graph_task_id() != -1:
        return  # eager activation checkpointing's recompute (a compiled one reruns no hook)
    for m in block.modules():
        if isinstance(m, SparseMLP):
            m.count()


def sparse_block(cfg: ModelConfig, spec: ModelSpec, qk_norm: bool = False) -> TransformerBlock:
    """Grouped-query attention (``qk_norm``: Qwen3's per-head norms), then the MoE layer."""
    return sparse(TransformerBlock(cfg, Attention(cfg, spec.head_dim, qk_norm), SparseMLP(layer_config(cfg))))


def sparse(block: nn.Module) -> nn.Module:
    """``block`` (one holding a ``SparseMLP``) with the forward hook that counts its routing."""
    block.register_forward_hook(count_load)
    return block


def moe_kind(
    m: ModelConfig, weights: tuple[Weight, ...], hd: int, window: int = 0, name: str = "moe"
) -> LayerKind:
    """A sparse block as a layer kind: its weights, what it saves (``sparse_saved_values``), its window;
    ``moe_shared`` where ``model.moe`` has shared experts."""
    mlp = MLPKind.moe_shared if m.moe.num_shared_experts else MLPKind.moe
    return LayerKind(name, weights, sparse_saved_values(m, hd), window=window, mlp=mlp)


def moe_weights(m: ModelConfig, prefix: str, parts: tuple[str, str, str]) -> tuple[Weight, ...]:
    """The MoE layer's spec entries: the router ``(E, D)`` and the stacked experts. ``prefix``: the Hub
    files' module of the layer (``mlp`` for Qwen3-MoE, ``block_sparse_moe`` for Mixtral); ``parts``:
    the per-expert (gate, up, down) names under ``experts.{e}.``."""
    e, d, i = m.moe.num_experts, m.dim, expert_width(m)
    gate, up, down = (f"{prefix}.experts.{{e}}.{p}" for p in parts)
    out = [
        Weight("feed_forward.gate", f"{prefix}.gate.weight", (e, d), TPStyle.moe),
        Weight(
            "feed_forward.experts",
            gate,
            (e, 2 * i, d),
            TPStyle.moe,
            param="gate_up_proj",
            hf_experts=(gate, up),
        ),
        Weight("feed_forward.experts", down, (e, d, i), TPStyle.moe, param="down_proj", hf_experts=(down,)),
    ]
    shared = m.moe.num_shared_experts * (m.moe.shared_intermediate_size or i)
    if shared:  # no Hub layout of its own (neither family has one): the export refuses it
        out += [
            Weight(
                "feed_forward.shared_experts.gate_proj",
                f"{prefix}.shared_experts.gate_proj.weight",
                (shared, d),
                TPStyle.moe,
            ),
            Weight(
                "feed_forward.shared_experts.up_proj",
                f"{prefix}.shared_experts.up_proj.weight",
                (shared, d),
                TPStyle.moe,
            ),
            Weight(
                "feed_forward.shared_experts.down_proj",
                f"{prefix}.shared_experts.down_proj.weight",
                (d, shared),
                TPStyle.moe,
            ),
        ]
    return tuple(out)


def sparse_saved_values(m: ModelConfig, hd: int) -> int:
    """Values one sparse block saves for backward per token: the dense block's attention part, then per
    token k expert rows (the gathered input, gate/up outputs, SiLU, product: 4 x width each, plus the
    input and output rows) and the router's logits and probabilities."""
    kv_dim = m.n_kv_heads * hd
    k, i, e = m.moe.num_experts_per_tok, expert_width(m), m.moe.num_experts
    shared = m.moe.num_shared_experts * (m.moe.shared_intermediate_size or i)
    return 10 * m.dim + 3 * kv_dim + k * (4 * i + 2 * m.dim) + 2 * e + 4 * shared


def sparse_layers(model: nn.Module) -> list[tuple[str, SparseMLP]]:
    """(block name, its MoE layer) for every sparse block of ``model`` (wrapped or not), in order."""
    return [(name.rsplit(".", 1)[0], m) for name, m in model.named_modules() if isinstance(m, SparseMLP)]


@torch.no_grad()
def take_load(model: nn.Module) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(block, tokens routed per expert, dropped) summed since the last call, per sparse block; resets
    them. Empty for a dense model or before any forward."""
    out = []
    for name, layer in sparse_layers(model):
        if layer.load is not None and layer.dropped is not None:
            out.append((name, layer.load.clone(), layer.dropped.clone()))
            layer.load.zero_()
            layer.dropped.zero_()
    return out


@dataclass(frozen=True)
class RoutingState:
    """What a model's MoE layers measured that its state dict does not hold: per sparse layer, in
    order, the sums since they were last read (``load``, ``dropped``: ``take_load``; ``step_load``:
    the bias update) and the last forward's ``stats``; per decoder, its last ``router_aux``.

    Why: the fallback ladder rebuilds the model for another rung (framework.train.runner), and an
    unbroken run's next metrics row (``balance_row``) counts the steps since the last row, the
    rebuild included; a first step that failed must leave the sums as they were before it."""

    layers: list[tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, moe.MoEStats | None]]
    router_aux: list[torch.Tensor | None]


def routing_state(model: nn.Module) -> RoutingState:
    """A copy of ``model``'s routing sums (the sums grow in place); empty for a dense model."""

    def copy(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.clone()

    layers = [(copy(m.load), copy(m.dropped), copy(m.step_load), m.stats) for _, m in sparse_layers(model)]
    return RoutingState(layers, [m.router_aux for m in model.modules() if isinstance(m, Decoder)])


def set_routing_state(model: nn.Module, state: RoutingState) -> None:
    """Put ``state`` (``routing_state`` of this model, or of the same model built for another rung)
    into ``model``'s MoE layers and decoders."""
    for (_, m), (load, dropped, step_load, stats) in zip(sparse_layers(model), state.layers, strict=True):
        m.load, m.dropped, m.step_load, m.stats = load, dropped, step_load, stats
    decoders = [m for m in model.modules() if isinstance(m, Decoder)]
    for d, aux in zip(decoders, state.router_aux, strict=True):
        d.router_aux = aux


@contextlib.contextmanager
def routing_unchanged(model: nn.Module) -> Iterator[None]:
    """Forwards inside leave ``model``'s routing figures as they were: the sums (``routing_state``:
    the balance figures of ``balance_row``, the bias update's ``step_load``, the last ``stats``) and
    each decoder's kept load-balancing terms (``aux_values``). For a forward that routes no step's
    tokens: torch's pipeline schedule's shape probe on the first step (framework.parallel.pipeline),
    which runs each stage once more, on the first micro batch or on uninitialised inputs (issue 25).
    Restores rather than stops the counting hooks, so that a compiled region that traces them sees
    no new global to guard on."""
    state = routing_state(model)
    kept = [(m, len(m.aux_values)) for m in model.modules() if isinstance(m, Decoder)]
    try:
        yield
    finally:
        set_routing_state(model, state)
        for m, n in kept:
            del m.aux_values[n:]


def token_group_of(model: nn.Module) -> object | None:
    """The ranks holding the step's other tokens (``Decoder.token_group``, which framework.parallel
    sets) of ``model``, wrapped or not, a pipeline's stages included (``PipelineModel.token_group``:
    the wrapper registers its stages' layers, not the stages); None: this process alone."""
    if not isinstance(model, Decoder) and hasattr(model, "token_group"):
        return model.token_group
    return next((m.token_group for m in model.modules() if isinstance(m, Decoder)), None)


@torch.no_grad()
def update_expert_biases(model: nn.Module, group: object = None) -> None:
    """After an optimizer step: DeepSeek-V3's aux-loss-free update of each sigmoid router's selection
    bias from the tokens it routed during the step (summed over ``group``'s ranks first, so that every
    data-parallel rank keeps the same bias), then the step's count restarts. No-op where no router
    moves its bias (``model.moe.bias_update_rate=0``, or a softmax router)."""
    import torch.distributed as dist

    for _, layer in sparse_layers(model):
        if layer.step_load is None:
            continue
        if layer.gate.expert_bias is not None and layer.cfg.bias_update_rate > 0:
            load = layer.step_load.clone()
            if group is not None and dist.is_initialized():
                dist.all_reduce(load, group=group)  # type: ignore[arg-type]
            moe.update_expert_bias(layer.gate, load)
        layer.step_load.zero_()


@torch.no_grad()
def take_aux(model: nn.Module) -> torch.Tensor | None:
    """The load-balancing term of the training forwards since the last call (before its
    coefficient), the mean over those forwards (a step's micro batches), summed over the decoders
    of ``model`` (one; or, given a pipeline stage, that stage's share); resets it. None where no
    term was added (a dense model, a coefficient of 0, no training forward)."""
    parts = []
    for m in model.modules():
        if isinstance(m, Decoder) and m.aux_values:
            parts.append(torch.stack(m.aux_values).mean())
            m.aux_values = []
    return torch.stack(parts).sum() if parts else None


# A sparse block's index in the whole model, from its module name: "layers.3", also under a wrapper
# ("_orig_mod.layers.3", "layers.3._checkpoint_wrapped_module"); a pipeline keeps the whole model's
# keys (framework.parallel.pipeline.PipelineModel).
LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


@torch.no_grad()
def gather_load(
    model: nn.Module, pp_group: dist.ProcessGroup | None = None
) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(layer index in the whole model, tokens routed per expert, dropped) of every sparse block, in
    layer order, summed since the last call (resets them) over the ranks that hold the step's other
    tokens (``token_group_of``: the data-parallel ranks) and gathered over ``pp_group`` (a pipeline's
    ranks, each holding its own stages' layers): what one process counts over the same batch.

    Collective over both groups: every rank calls it at the same steps, one with no sparse block
    too (it then adds nothing). One all-reduce of ``L x (E + 1)`` integers and one gather of as many
    over the pipeline (objects: the stages hold different layers), at log rows only."""
    mine = []
    for name, layer in sparse_layers(model):
        found = LAYER_INDEX.search(name)
        assert found is not None, f"sparse block {name!r} is not under the decoder's layers"
        if layer.load is None or layer.dropped is None:  # no training forward yet: nothing routed
            zeros = torch.zeros(layer.cfg.num_experts + 1, dtype=torch.long, device=layer.gate.weight.device)
            mine.append((int(found.group(1)), zeros))
            continue
        mine.append((int(found.group(1)), torch.cat([layer.load, layer.dropped.reshape(1)])))
        layer.load.zero_()
        layer.dropped.zero_()
    group = token_group_of(model)
    if mine and group is not None and dist.is_initialized():
        packed = torch.stack([t for _, t in mine])
        dist.all_reduce(packed, group=group)  # type: ignore[arg-type]
        mine = [(i, t) for (i, _), t in zip(mine, packed, strict=True)]
    rows = [(i, t.cpu()) for i, t in mine]
    if pp_group is not None and dist.is_initialized():
        parts: list[list[tuple[int, torch.Tensor]]] = [[] for _ in range(dist.get_world_size(pp_group))]
        dist.all_gather_object(parts, rows, group=pp_group)
        rows = [row for part in parts for row in part]
    return [(i, t[:-1], t[-1]) for i, t in sorted(rows, key=lambda row: row[0])]


def balance_row(model: nn.Module, pp_group: dist.ProcessGroup | None = None) -> dict[str, object]:
    """The experts' balance for a metrics row, from the tokens the whole model routed since the last
    row over the step's whole batch (``gather_load``: every sparse block, every data-parallel rank's
    tokens; resets it; a collective, every rank calls it): per sparse block in layer order the max /
    mean tokens per expert (``moe_load``, 1.0 is a perfectly balanced router, ``num_experts / top_k``
    one expert taking every token), the worst block's (``moe_load_max``), the assignments dropped
    over capacity and their share (with a ``model.moe.capacity_factor``). Empty for a dense model.
    (The load-balancing loss, ``moe_aux_loss``, is the step's: ``framework.parallel.step.StepResult.aux``.)"""
    loads = gather_load(model, pp_group)
    if not loads:
        return {}
    ratios = []
    routed = dropped = 0.0
    for _, load, drop in loads:
        figures = moe.expert_load(load)
        ratios.append(round(figures["max_over_mean"], 4))
        routed += float(load.sum())
        dropped += float(drop)
    row: dict[str, object] = {"moe_load_max": max(ratios), "moe_load": ratios}
    if any(layer.cfg.capacity_factor is not None for _, layer in sparse_layers(model)):
        row["moe_dropped"] = int(dropped)
        row["moe_dropped_frac"] = dropped / routed if routed else 0.0
    return row
