"""Read a Hugging Face checkpoint's tensors into a materialised (possibly sharded) model, each rank
its own chunk (framework.checkpoint.import_hf reads the folder, its config and its tensor names).

HF's rotate-half rows of ``q_proj`` / ``k_proj`` are permuted back to our interleaved-pair RoPE
order inside each head.

Why our own reader rather than DCP's ``HuggingFaceStorageReader`` (torch 2.13 has one): that reader
copies each requested slice of a tensor as it is stored, and our q/k rows are a permutation of the
stored ones inside each head. A shard of ``wq`` under FSDP can start or end in the middle of a head,
so its rows are scattered over the stored head. Reading with ``safe_open(...).get_slice`` directly,
each rank asks its parameters' local chunk (``DTensor.__create_chunk_list__``, what DCP itself uses)
and reads only those rows and columns, widened for q/k to the whole heads the chunk touches (at
most two heads more than the chunk). No rank reads, let alone holds, the full model unless its
layout holds the full model (DDP, one rank).

An MoE family's stacked experts ``(E, 2I, D)`` are read from the Hub's per-expert tensors (the spec's
``hf_experts``), each rank only the experts and rows of its own chunk.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch import nn

from framework.checkpoint.import_hf import HFCheckpoint, check_against
from framework.checkpoint.quantized import open_slice
from framework.models import model_spec
from framework.models.lora import is_lora_name


def _read_experts(
    get_slice: Any,
    parts: tuple[str, ...],
    offsets: tuple[int, ...],
    sizes: tuple[int, ...],
) -> torch.Tensor:
    """The local chunk ``offsets``/``sizes`` of a stacked ``(E, rows, cols)`` expert weight from the
    per-expert Hub tensors (parts stacked along the rows): each rank reads only its experts' rows."""
    (e0, r0, *c0), (ne, nr, *nc) = offsets, sizes
    if 0 in sizes:
        return torch.empty(sizes)
    cols = tuple(slice(o, o + m) for o, m in zip(c0, nc, strict=True))
    experts = []
    for e in range(e0, e0 + ne):
        names = [t.format(e=e) for t in parts]
        per = get_slice(names[0]).get_shape()[0]
        rows = []
        for j, name in enumerate(names):
            lo, hi = max(r0, j * per), min(r0 + nr, (j + 1) * per)
            if lo < hi:
                rows.append(get_slice(name)[(slice(lo - j * per, hi - j * per), *cols)])
        experts.append(torch.cat(rows))
    return torch.stack(experts)


def _local_chunk(p: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(the local tensor to fill, its offsets in the global tensor, its sizes)."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        chunks = p.__create_chunk_list__()
        assert len(chunks) == 1, f"a DTensor with {len(chunks)} local chunks"
        return p.to_local(), tuple(chunks[0].offsets), tuple(chunks[0].sizes)
    return p, (0,) * p.ndim, tuple(p.shape)


def _read_rows(sl: Any, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    index = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
    return sl[index]


def _read_rope_rows(sl: Any, offsets: tuple[int, ...], sizes: tuple[int, ...], head_dim: int) -> torch.Tensor:
    """Rows [r0, r0 + n) of our interleaved q/k layout (a projection, or a per-head norm's entries)
    from HF's rotate-half rows: read the whole heads that the rows touch, un-permute them, cut the
    chunk out."""
    r0, n = offsets[0], sizes[0]
    if 0 in sizes:  # an empty shard (more ranks than rows)
        return torch.empty(sizes)
    h0, h1 = r0 // head_dim, math.ceil((r0 + n) / head_dim)
    cols = tuple(slice(o, o + m) for o, m in zip(offsets[1:], sizes[1:], strict=True))
    stored = sl[(slice(h0 * head_dim, h1 * head_dim), *cols)]
    heads = stored.reshape(h1 - h0, 2, head_dim // 2, *stored.shape[1:])
    ours = heads.transpose(1, 2).reshape(stored.shape)
    start = r0 - h0 * head_dim
    return ours[start : start + n]


@torch.no_grad()
def load_hf_weights(model: nn.Module, ckpt: HFCheckpoint) -> None:
    """Fill every parameter of a materialised (possibly sharded) decoder from ``ckpt``, each rank
    reading only its local chunk. No collective: every rank calls it on its own.

    ``model`` may be one pipeline stage (framework.parallel.pipeline.cut_stage): it holds only its
    blocks, so the folder is checked against the whole model's names and shapes (the spec's) and
    only the stage's own tensors are read. A tied model's last stage holds a copy of the embedding
    as its output projection: it is read from the embedding's tensor, as transformers ties it.
    """
    from safetensors import safe_open

    spec = model_spec(model.cfg)
    names, rope, experts = spec.hf_names(), spec.rope_heads(), spec.hf_experts()
    check_against(ckpt, {n: tuple(w.shape) for n, w, _ in spec.tensors()}, names, experts=experts)
    if model.cfg.tie_embeddings:
        names["output.weight"] = names["tok_embeddings.weight"]
    params = {n: p for n, p in model.named_parameters() if not is_lora_name(n)}  # adapters: not in HF
    # The spec's persistent buffers (a router's selection bias) are read as the weights are.
    params |= {n: b for n, b in model.named_buffers() if n in names}
    assert set(params) <= set(names) | set(experts), (
        f"parameters the spec does not name: {sorted(set(params) - set(names) - set(experts))[:5]}"
    )
    with contextlib.ExitStack() as stack:
        handles: dict[str, Any] = {}

        def get_slice(name: str) -> Any:
            """A tensor's slice reader (dequantizing a quantized one), its file opened once."""

            def stored(t: str) -> Any:
                file = ckpt.files[t]
                if file not in handles:
                    handles[file] = stack.enter_context(safe_open(str(ckpt.path / file), framework="pt"))
                return handles[file].get_slice(t)

            return open_slice(name, ckpt.quantized, stored)

        for n in sorted(params, key=lambda n: (ckpt.files.get(names.get(n, ""), ""), n)):
            local, offsets, sizes = _local_chunk(params[n])
            if n in experts:
                value = _read_experts(get_slice, experts[n], offsets, sizes)
            elif n in rope:
                value = _read_rope_rows(get_slice(names[n]), offsets, sizes, params[n].shape[0] // rope[n])
            else:
                value = _read_rows(get_slice(names[n]), offsets, sizes)
            local.copy_(value.to(device=local.device, dtype=local.dtype))
