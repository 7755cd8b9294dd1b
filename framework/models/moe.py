"""The Mixture-of-Experts feed-forward layer: router, token-choice dispatch, grouped experts, balance.

Why one module: a sparse family (Qwen3-MoE, Mixtral, later DeepSeek-V3) swaps its dense MLP for
``MoE``; everything it needs to route, run and measure that layer lives here, and the parallel layer
(``framework/parallel/expert.py``) only swaps ``MoE.experts`` for an expert-parallel runner of the
same call signature ``experts(x_sorted, counts)``.

The flow of ``MoE.forward`` on ``T`` tokens:
1. ``Router``: logits ``(T, E)``, top-k experts and weights per token (softmax, as Qwen3-MoE and
   Mixtral, or sigmoid plus a per-expert selection bias, as DeepSeek-V3's aux-loss-free balancing).
2. ``sort_by_expert``: the ``T * k`` assignments sorted by expert; with a capacity factor, those past
   an expert's capacity are dropped (none is dropped by default) and counted.
3. ``experts(x_sorted, counts)``: ``GroupedExperts`` (framework.models.grouped) runs all experts in
   two grouped GEMMs (``torch.nn.functional.grouped_mm``) where the kernel takes the operands, else a
   per-expert loop; under ``model.float8`` (``GroupedExperts.float8``, set by
   ``framework.parallel.float8``) torchao's float8 rowwise grouped GEMM, on token groups padded to 16
   rows (``pad_groups``).
4. The outputs, scaled by the routing weights, are summed back per token; shared experts are added.

Each forward leaves ``MoE.stats`` (``MoEStats``): the per-expert token counts, the router's probability
sums (differentiable: the auxiliary loss's gradient flows through them), the dropped count and the
router logits. ``load_balancing_loss`` combines the stats of all layers exactly as ``transformers``'
``load_balancing_loss_func`` does for Qwen3-MoE and Mixtral (``model.moe.aux_loss_scope=global``);
``layer_balancing_loss`` sums each layer's own (``layer``, Megatron's), which a pipeline's stages
can each compute and inject into backward through ``AuxLossAutoScaler``.

The weights use transformers 5's in-memory layout (``HF_MOE_NAMES``): ``gate_up_proj (E, 2I, D)`` with
gate rows first, ``down_proj (E, D, I)``, router ``weight (E, D)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

# The experts' kernels live in framework.models.grouped; the names stay importable from here, where
# the layer's callers and tests have always found them.
from framework.models.grouped import (  # noqa: F401
    ExpertKernel,
    GroupedExperts,
    StackedExperts,
    _grouped_mm,
    float8_experts,
    grouped_mm_supported,
    loop_experts,
    pad_groups,
    padded_experts,
    run_experts,
    use_grouped,
)


class RouterScore(str, Enum):
    """How router logits become expert scores."""

    SOFTMAX = "softmax"  # Qwen3-MoE, Mixtral: top-k of softmax(logits)
    SIGMOID = "sigmoid"  # DeepSeek-V3: top-k of sigmoid(logits) + bias; weights from the unbiased scores


@dataclass(frozen=True)
class MoEConfig:
    """The MoE layer's shape and routing. Names follow transformers' configs where one exists."""

    dim: int  # hidden_size
    moe_intermediate_size: int  # per-expert FFN width (Mixtral: intermediate_size)
    num_experts: int  # Mixtral: num_local_experts
    num_experts_per_tok: int = 2  # top-k
    score: RouterScore = RouterScore.SOFTMAX
    norm_topk_prob: bool = True  # renormalise the top-k weights to sum 1 (Mixtral always does)
    routed_scaling_factor: float = 1.0  # DeepSeek-V3 scales the routed weights (2.5 there)
    capacity_factor: float | None = None  # None: no token dropped
    router_aux_loss_coef: float = 0.001  # transformers' default for Qwen3-MoE and Mixtral
    bias_update_rate: float = 0.0  # DeepSeek-V3's gamma (0.001) for aux-loss-free balancing
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0  # per shared expert; 0: moe_intermediate_size
    kernel: ExpertKernel = ExpertKernel.AUTO
    # DeepSeek-V3's group-limited routing: n_group groups of experts, the top-k picked among the
    # topk_group groups whose two best (biased) scores sum highest. 1 / 1: plain top-k.
    n_group: int = 1
    topk_group: int = 1


def check_moe(cfg: MoEConfig, ep: int = 1, prefix: str = "model.moe") -> None:
    """Refuse a config the layer cannot run, one ``ValueError`` line per fault naming the value and
    what is valid. Called by ``MoE`` (ep=1) and ``parallel.expert.apply_ep``; the launcher's rules table
    (``framework/launch/rules.py``) is to call it once the schema has the MoE keys, so that the run stops
    before launch with exit 2."""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    if e < 1:
        raise ValueError(f"{prefix}.num_experts={e} must be >= 1")
    if not 1 <= k <= e:
        raise ValueError(f"{prefix}.num_experts_per_tok={k} must be in 1..{e} (num_experts={e})")
    if cfg.capacity_factor is not None and not cfg.capacity_factor > 0:  # also refuses nan
        raise ValueError(
            f"{prefix}.capacity_factor={cfg.capacity_factor} must be > 0 (or null: no token dropped)"
        )
    if not cfg.router_aux_loss_coef >= 0:
        raise ValueError(f"{prefix}.router_aux_loss_coef={cfg.router_aux_loss_coef} must be >= 0")
    if not cfg.bias_update_rate >= 0:
        raise ValueError(f"{prefix}.bias_update_rate={cfg.bias_update_rate} must be >= 0")
    if cfg.num_shared_experts < 0:
        raise ValueError(f"{prefix}.num_shared_experts={cfg.num_shared_experts} must be >= 0")
    g, tg = cfg.n_group, cfg.topk_group
    if g < 1 or e % g:
        valid = ", ".join(str(d) for d in range(1, e + 1) if e % d == 0 and (d == 1 or e // d >= 2))
        raise ValueError(
            f"{prefix}.n_group={g} does not divide {prefix}.num_experts={e}: valid n_group are {valid}"
        )
    if g > 1 and e // g < 2:
        raise ValueError(
            f"{prefix}.n_group={g} leaves {e // g} expert per group; valid: groups of >= 2 experts (a group "
            f"is scored by its two best), n_group <= {e // 2}"
        )
    if not 1 <= tg <= g:
        raise ValueError(f"{prefix}.topk_group={tg} must be in 1..{prefix}.n_group={g}")
    if k > tg * (e // g):
        raise ValueError(
            f"{prefix}.num_experts_per_tok={k} is more than the {tg * (e // g)} experts of {prefix}.topk_group="
            f"{tg} groups of {e // g}; valid: num_experts_per_tok <= {tg * (e // g)}, or a larger topk_group"
        )
    if ep < 1 or e % ep:
        valid = ", ".join(str(d) for d in range(1, e + 1) if e % d == 0)
        raise ValueError(f"parallel.ep={ep} does not divide {prefix}.num_experts={e}: valid ep are {valid}")


@dataclass
class Routing:
    """One router call: ``indices``/``weights`` ``(T, k)``, ``logits`` ``(T, E)`` as the router produced
    them (transformers returns these as ``router_logits``)."""

    logits: torch.Tensor
    indices: torch.Tensor
    weights: torch.Tensor


class Router(nn.Module):
    """Token-choice top-k router. The sigmoid router's ``expert_bias`` (a checkpointed buffer, zero at
    init) shifts the selection only, never the weights: DeepSeek-V3's aux-loss-free balancing
    (``update_expert_bias``). The softmax router has none, so its state dict is transformers' exactly."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.dim))
        self.expert_bias: torch.Tensor | None
        if cfg.score is RouterScore.SIGMOID:
            self.register_buffer("expert_bias", torch.zeros(cfg.num_experts), persistent=True)
        else:
            self.expert_bias = None
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> Routing:
        cfg = self.cfg
        logits = F.linear(x, self.weight)
        if cfg.score is RouterScore.SOFTMAX:
            # float32 softmax, as transformers does, so bf16 runs pick the same experts as fp32 ones
            scores = F.softmax(logits, dim=-1, dtype=torch.float32)
            weights, indices = torch.topk(scores, cfg.num_experts_per_tok, dim=-1)
        else:
            scores = torch.sigmoid(logits.float())
            choice = scores + self.expert_bias
            if cfg.n_group > 1:
                choice = self._group_limited(choice)
            _, indices = torch.topk(choice, cfg.num_experts_per_tok, dim=-1)
            weights = scores.gather(-1, indices)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)  # softmax/sigmoid scores are > 0
        weights = weights * cfg.routed_scaling_factor
        return Routing(logits=logits, indices=indices, weights=weights.to(x.dtype))

    def _group_limited(self, choice: torch.Tensor) -> torch.Tensor:
        """``choice`` (T, E) with the experts outside each token's ``topk_group`` best groups at -inf:
        a group scores the sum of its two best experts (transformers' DeepseekV3TopkRouter)."""
        g, e = self.cfg.n_group, self.cfg.num_experts
        grouped = choice.view(-1, g, e // g)
        best = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # (T, G)
        keep = torch.zeros_like(best, dtype=torch.bool)
        keep.scatter_(1, torch.topk(best, self.cfg.topk_group, dim=-1)[1], True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(-1, e)


@torch.no_grad()
def update_expert_bias(router: Router, tokens_per_expert: torch.Tensor) -> None:
    """DeepSeek-V3's aux-loss-free balancing, once per optimizer step: raise the selection bias of
    experts below the mean load and lower it above, by ``bias_update_rate``. ``tokens_per_expert`` is
    the step's count summed over micro-batches (and, under data parallel, all-reduced first, so that
    every rank keeps the same bias)."""
    if router.expert_bias is None:
        raise ValueError(
            f"update_expert_bias needs the sigmoid router; this one scores by {router.cfg.score.value}"
        )
    load = tokens_per_expert.float()
    router.expert_bias.add_(router.cfg.bias_update_rate * torch.sign(load.mean() - load))


def expert_capacity(num_tokens: int, cfg: MoEConfig) -> int | None:
    """Slots per expert: ``ceil(capacity_factor * T * k / E)`` (Switch Transformer's), None: unbounded."""
    if cfg.capacity_factor is None:
        return None
    return math.ceil(cfg.capacity_factor * num_tokens * cfg.num_experts_per_tok / cfg.num_experts)


@dataclass
class Dispatch:
    """The kept assignments sorted by expert: ``token`` (row in x) and ``slot`` (its k position) of each,
    ``counts`` ``(E,)`` kept per expert, ``routed`` ``(E,)`` chosen per expert before any drop."""

    token: torch.Tensor
    slot: torch.Tensor
    counts: torch.Tensor
    routed: torch.Tensor
    dropped: torch.Tensor


def sort_by_expert(indices: torch.Tensor, num_experts: int, capacity: int | None) -> Dispatch:
    """Sort the ``(T, k)`` assignments by expert (stable: earlier tokens first within an expert), and
    with a capacity drop those past it, the later tokens first, as Switch Transformer does."""
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # scatter_add, not bincount: its (E,) shape is static, so torch.compile traces it with no graph
    # break (bincount's length depends on the data); integer adds are exact in any order
    routed = torch.zeros(num_experts, dtype=flat.dtype, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    if capacity is not None:
        starts = torch.cumsum(routed, 0) - routed
        expert = flat[order]
        position = torch.arange(flat.numel(), device=flat.device) - starts[expert]
        keep = position < capacity
        order = order[keep]
        counts = routed.clamp(max=capacity)
    else:
        counts = routed
    k = indices.shape[-1]
    return Dispatch(
        token=order // k, slot=order % k, counts=counts, routed=routed, dropped=routed.sum() - counts.sum()
    )


class SharedExperts(nn.Module):
    """Experts every token goes through (DeepSeek-V3): one SwiGLU MLP of ``n * I`` width, added unscaled.
    (Qwen2-MoE's sigmoid-gated shared expert is not this; it is left out for now.)"""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass
class MoEStats:
    """What one MoE forward measured. ``tokens_per_expert`` ``(E,)`` counts top-k assignments before any
    drop (what the router chose: the balance it shows and the aux loss's f); ``prob_sum`` ``(E,)`` is the
    softmax probability summed over tokens (differentiable); ``dropped`` the assignments over capacity."""

    tokens_per_expert: torch.Tensor
    prob_sum: torch.Tensor
    num_tokens: int
    dropped: torch.Tensor
    router_logits: torch.Tensor


def load_balancing_loss(stats: list[MoEStats], group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` (Switch Transformer eq. 4-6) over the given layers:
    ``E * sum_e f_e * P_e`` with ``f`` the layer-summed assignment counts and ``P`` the layer-summed
    probabilities, each divided by all layers' tokens. Not a sum of per-layer losses: the same ``f``
    weighs every layer. Multiply by ``router_aux_loss_coef`` before adding it to the loss.

    ``group``: the ranks whose tokens the loss spans (the data-parallel ranks: framework.parallel's
    ``token_group``). The counts, the probability sums and the token counts are summed over it first,
    so every rank computes the loss one process computes over all their tokens together (a product
    of batch means is no mean of per-rank products). The sum is autograd's ``all_reduce`` (its
    backward all-reduces the gradient): each rank's routers receive the gradient of every rank's
    copy of the loss, which the data-parallel average then divides by the ranks, as one process's
    would be. One all-reduce of ``2 E + 1`` floats each way per forward."""
    rows = sum(s.num_tokens for s in stats)
    counts = torch.stack([s.tokens_per_expert for s in stats]).sum(0).float()
    probs = torch.stack([s.prob_sum for s in stats]).sum(0)
    if group is not None:
        e = counts.numel()
        packed = torch.cat([counts, probs, probs.new_full((1,), float(rows))])
        packed = funcol.wait_tensor(funcol.all_reduce(packed, "sum", group))
        counts, probs, rows = packed[:e], packed[e : 2 * e], packed[2 * e]  # type: ignore[assignment]
    return (counts / rows * (probs / rows)).sum() * counts.numel()


def layer_balancing_loss(stats: list[MoEStats], group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The sum over the given layers of each one's own load-balancing loss, ``E * sum_e f_e * P_e``
    with that layer's ``f`` and ``P`` (``load_balancing_loss`` of the layer alone): the per-layer
    loss of Megatron's ``switch_load_balancing_loss_func`` and DeepSeek's expert-level balance loss.
    Unlike transformers' coupled one it is a sum over layers, so a pipeline stage computes its
    layers' share and the stages' shares add up (``model.moe.aux_loss_scope=layer``; the caller
    divides by the model's number of MoE layers). ``group``: as ``load_balancing_loss``, every
    layer's counts, probabilities and tokens summed over its ranks first, in one all-reduce of
    ``L x (2 E + 1)`` floats for the ``L`` layers."""
    counts = torch.stack([s.tokens_per_expert for s in stats]).float()  # (L, E)
    probs = torch.stack([s.prob_sum for s in stats])
    rows = probs.new_tensor([float(s.num_tokens) for s in stats]).unsqueeze(1)  # (L, 1)
    if group is not None:
        e = counts.shape[1]
        packed = funcol.wait_tensor(funcol.all_reduce(torch.cat([counts, probs, rows], 1), "sum", group))
        counts, probs, rows = packed[:, :e], packed[:, e : 2 * e], packed[:, 2 * e :]
    return (counts / rows * (probs / rows)).sum() * counts.shape[1]


class AuxLossAutoScaler(torch.autograd.Function):
    """Megatron's ``MoEAuxLossAutoScaler``: returns ``hidden`` unchanged and, in backward, also
    back-propagates ``aux`` (an auxiliary loss computed from the same forward) with gradient 1.

    Why: under a pipeline the schedule's loss is computed from the last stage's output alone, and
    a stage's load-balancing loss belongs to no output. Attached to the stage's output, the term's
    gradient enters backward wherever the output's gradient does, under any schedule, without a
    second loss through the pipeline. The caller multiplies ``aux`` by everything the loss would
    (the coefficient, 1 / layers); the schedule's ``scale_grads`` then divides every gradient by
    the number of micro batches, the aux term's included, as one process's accumulation does."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, hidden: torch.Tensor, aux: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(aux)
        # The same storage, not a view: a view (what returning ``hidden`` itself gives) fails
        # the zero-bubble schedules' split backward, which detaches the stage output in place
        return hidden.detach()

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        (aux,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad, torch.ones_like(aux)


def expert_load(tokens_per_expert: torch.Tensor) -> dict[str, float]:
    """The balance figures of issue 25's point 5: max and mean tokens per expert and their ratio (1.0
    is what a perfectly balanced router gives; E/k when one expert takes every token). Syncs the host."""
    load = tokens_per_expert.float()
    mean = load.mean().item()
    top = load.max().item()
    return {"max": top, "mean": mean, "max_over_mean": top / mean if mean else 0.0}


class MoE(nn.Module):
    """The MoE feed-forward layer: ``(..., D) -> (..., D)``; ``self.stats`` holds the last forward's
    ``MoEStats``. ``experts`` is a ``GroupedExperts`` or, under expert parallelism, the runner that
    ``parallel.expert.apply_ep`` put there (same call)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        check_moe(cfg)
        self.cfg = cfg
        self.gate = Router(cfg)
        self.experts: nn.Module = GroupedExperts(
            cfg.num_experts, cfg.dim, cfg.moe_intermediate_size, cfg.kernel
        )
        shared = cfg.num_shared_experts * (cfg.shared_intermediate_size or cfg.moe_intermediate_size)
        self.shared_experts = SharedExperts(cfg.dim, shared) if shared else None
        self.stats: MoEStats | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        routing = self.gate(x)
        d = sort_by_expert(routing.indices, self.cfg.num_experts, expert_capacity(x.shape[0], self.cfg))
        y = self.experts(x[d.token], d.counts)
        y = y * routing.weights[d.token, d.slot].unsqueeze(-1)
        out = torch.zeros_like(x).index_add_(0, d.token, y.to(x.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        self.stats = MoEStats(
            tokens_per_expert=d.routed,
            prob_sum=F.softmax(routing.logits, dim=-1, dtype=torch.float32).sum(0),
            num_tokens=x.shape[0],
            dropped=d.dropped,
            router_logits=routing.logits,
        )
        return out.reshape(shape)


# transformers 5 in-memory names (``model.layers.{i}.mlp.`` + name) <-> this layer's (same prefix):
# identical by design. The checkpoint files on the Hub keep per-expert tensors, which transformers'
# conversion_mapping stacks at load: Qwen3-MoE ``experts.{e}.gate_proj/up_proj/down_proj.weight``,
# Mixtral ``block_sparse_moe.experts.{e}.w1 (gate) / w3 (up) / w2 (down)`` and ``block_sparse_moe.gate``;
# ``stack_hf_experts`` does the same stacking for the families' converters.
HF_MOE_NAMES: dict[str, str] = {
    "gate.weight": "gate.weight",
    "experts.gate_up_proj": "experts.gate_up_proj",
    "experts.down_proj": "experts.down_proj",
}

# The per-expert names in the Hub files, per family: (gate, up, down) under ``experts.{e}.``.
HF_EXPERT_FILE_NAMES: dict[str, tuple[str, str, str]] = {
    "qwen3_moe": ("gate_proj.weight", "up_proj.weight", "down_proj.weight"),
    "mixtral": ("w1.weight", "w3.weight", "w2.weight"),
}


def stack_hf_experts(
    per_expert: dict[str, torch.Tensor], num_experts: int, family: str
) -> dict[str, torch.Tensor]:
    """Per-expert Hub tensors (keys ``{e}.<name>`` under one layer's ``experts.``) -> this layer's
    stacked ``gate_up_proj`` / ``down_proj``. Raises ValueError naming a missing expert tensor (an HF
    checkpoint whose expert count differs from the config)."""
    gate, up, down = HF_EXPERT_FILE_NAMES[family]

    def get(e: int, name: str) -> torch.Tensor:
        key = f"{e}.{name}"
        if key not in per_expert:
            raise ValueError(f"HF checkpoint lacks experts.{key}: the config has num_experts={num_experts}")
        return per_expert[key]

    return {
        "gate_up_proj": torch.stack([torch.cat([get(e, gate), get(e, up)]) for e in range(num_experts)]),
        "down_proj": torch.stack([get(e, down) for e in range(num_experts)]),
    }
