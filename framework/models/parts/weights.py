"""A decoder's weights on their device: allocate the meta-built model, draw its initial weights or
load ``model.init_from``'s, tie the output projection to the embedding.

Why a seeded draw per parameter name: the values are then the same whatever the wrapping (DDP,
FSDP, TP, a pipeline's stages) or the number of ranks, so every layout starts from the
single-process weights. The loader of ``model.init_from`` is the caller's
(framework.checkpoint.init_from.load), handed in, so that models/ never imports a layer above.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from framework.config.schema import AttentionBackend, ResidualDtype


@torch.no_grad()
def draw_weights(model: nn.Module, seed: int) -> None:
    """Initialise ``model`` (a decoder, or a pipeline stage of one) in place after ``to_empty``
    (meta -> real device).

    Draws each parameter from a generator seeded by (seed, parameter name) on the parameter's
    device type, so the values do not depend on the wrapping or the number of ranks (they do
    depend on the device type: CPU and CUDA generators differ). Drawing on the GPU keeps a 7B
    init to seconds rather than minutes of CPU sampling. Sharded (DTensor) parameters are filled
    from the full tensor's generator and sliced to the local shard. Residual projections (wo, w2)
    are scaled by 1/sqrt(2 * n_layers) as in GPT-2.
    """
    std = model.cfg.init_std
    device = local_device(model)
    for name, p in model.named_parameters():
        if name == "output.weight" and model.cfg.tie_embeddings:
            # A pipeline's last stage holds its own copy of the tied weight (the embedding is on
            # the first stage): drawn from the embedding's name, it starts equal to it.
            name = "tok_embeddings.weight"
        leaf = name.rsplit(".", 1)[0].rsplit(".", 1)[-1]
        # The projections into the residual stream: attention's, the MLP's, an MoE layer's experts'.
        residual = leaf in ("wo", "w2", "down_proj") or name.endswith("experts.down_proj")
        if name.endswith("norm.weight"):
            full = torch.ones(_full_shape(p), device=device)
        else:
            scale = std / math.sqrt(2 * model.cfg.n_layers) if residual else std
            g = torch.Generator(device=device).manual_seed(_name_seed(seed, name))
            full = torch.randn(_full_shape(p), generator=g, device=device) * scale
        _copy_full_into(p, full)
    # Non-persistent buffers are not restored by to_empty: fill the RoPE tables again.
    model.rope = model._rope_tables(device)
    init_buffers(model)


def init_buffers(model: nn.Module) -> None:
    """The modules' own buffers after ``to_empty`` (which leaves them uninitialised): an MoE router's
    selection bias (framework.models.parts.sparse), before the weights are drawn or loaded."""
    for m in model.modules():
        if m is not model and hasattr(m, "init_buffers"):
            m.init_buffers()


def tie(model: nn.Module) -> None:
    """Tie the output projection to the embedding (``model.tie_embeddings``), again after anything
    that re-creates parameters (``to_empty``, TP). A pipeline stage holding only one of the two
    keeps its own (framework.parallel.pipeline ties the copies across stages)."""
    if model.cfg.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        model.output.weight = model.tok_embeddings.weight


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_device(model: nn.Module) -> torch.device:
    """The device of the model's (local shard of its) first parameter."""
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


def compute_dtype(device: torch.device | str) -> torch.dtype | None:
    """The dtype the training loop autocasts to on ``device``: bf16 on CUDA; None (fp32) elsewhere."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else None


# Loads ``model.init_from``'s weights into a placed (possibly sharded) model, in place: the
# caller's, handed in (framework.checkpoint.init_from.load), so that models/ never imports a layer above.
WeightLoader = Callable[[nn.Module, str], None]


def materialize(
    model: nn.Module, device: torch.device | str, seed: int, load_weights: WeightLoader | None = None
) -> None:
    """Allocate a meta-built (possibly already sharded) model on ``device`` and initialise it:
    from ``model.init_from`` when set, by ``load_weights`` (each rank reads its own shards:
    framework.checkpoint.init_from.load, which the caller passes), else ``init_weights(seed)``.

    ``to_empty`` unties shared parameters (it re-creates each module's tensors), so tied embeddings
    are tied again before init. Raises ValueError when ``model.init_from`` is set and no loader was
    given (the weights would silently be the seeded init's).
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
    if load_weights is None:
        raise ValueError(
            f"model.init_from={model.cfg.init_from!r} and no weight loader: pass "
            "load_weights=framework.checkpoint.init_from.load to materialize / parallelize"
        )
    init_buffers(model)  # a framework checkpoint's load overwrites them; an HF one has none
    load_weights(model, model.cfg.init_from)
    # Non-persistent buffers are not restored by to_empty (init_weights fills them otherwise).
    model.rope = model._rope_tables(local_device(model))
