"""Attention masks: the sliding-window band and the packed-document masks (SDPA's dense mask,
FlexAttention's ``BlockMask``, or the documents' spans for a variable-length flash kernel), and the
token flags that mark documents."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

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
    return idx - torch.where(document_starts(doc), idx, 0).cummax(dim=1).values


def document_starts(doc: torch.Tensor) -> torch.Tensor:
    """Where a document starts, (batch, seq) bool: each row's first token and wherever the id changes."""
    return torch.cat([torch.ones_like(doc[:, :1], dtype=torch.bool), doc[:, 1:] != doc[:, :-1]], dim=1)


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
    # On CUDA the mask's construction is compiled (torch's ``_compile``): at 8K, 3.2 ms a step
    # instead of 9.0 eager on one H200 (benchmarks/PERF.md); elsewhere eager, as tests run it.
    return create_block_mask(same_document_causal, b, None, s, s, device=doc.device, _compile=doc.is_cuda)


def flex_trains_on(device: torch.device) -> bool:
    """Whether FlexAttention runs forward and backward here. CUDA: yes. CPU (torch 2.13, eager and
    compiled): forward only ("FlexAttention does not support backward on CPU"), so training on CPU
    takes SDPA with the dense mask; meta (freezing) traces the dense path too."""
    return device.type == "cuda"


@dataclass(frozen=True)
class DocumentSpans:
    """The packed documents as a variable-length flash kernel takes them: the rows flattened to one
    sequence of ``batch * seq`` tokens, cut at ``cu_seqlens`` (int32 offsets, first 0, last the total,
    padded at the end with zero-length spans to a power-of-two count). Each span attends causally
    within itself, so the kernel does only the documents' own work, where a block mask also pays for
    the blocks that straddle two documents."""

    cu_seqlens: torch.Tensor


# Fewest spans a ``DocumentSpans`` holds (zero-length ones pad it): rows of a few documents all get
# the same count, so a CUDA-graph executor records one graph for them.
MIN_SPANS = 16


def document_spans(doc: torch.Tensor) -> DocumentSpans:
    """``DocumentSpans`` of ``document_ids`` (batch, seq): a span starts at each row's first token
    and wherever the id changes. Counting the spans reads one number back from the device (the
    kernel's launch needs their offsets, not a bound), so this runs outside compiled graphs; the
    offsets' length is marked dynamic, so a compiled block does not recompile when it changes."""
    b, s = doc.shape
    offsets = document_starts(doc).flatten().nonzero().flatten().to(torch.int32)
    spans = max(MIN_SPANS, 1 << (offsets.numel() - 1).bit_length())
    cu = torch.full((spans + 1,), b * s, dtype=torch.int32, device=doc.device)
    cu[: offsets.numel()] = offsets
    torch._dynamo.maybe_mark_dynamic(cu, 0)
    return DocumentSpans(cu)
