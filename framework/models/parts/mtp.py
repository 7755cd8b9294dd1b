"""DeepSeek-V3's multi-token prediction (the paper's MTP module at depth 1; ``model.mtp_layers``).

For position i the layer takes the trunk's last hidden state h_i (before the final norm) and the
embedding of token i+1 (the shared embedding), norms each, projects their concatenation back to
``dim`` (``eh_proj``), runs one block of the trunk's MoE kind over the positions and predicts token
i+2 through its own norm and the shared output head. Its cross-entropy is added to the training loss
times ``model.mtp_loss_weight`` and kept per training forward for the step's ``mtp_loss`` figure
(``take_mtp``), as the load-balancing term is (framework.models.parts.sparse.take_aux); evaluation
and decoding read the main head alone.

The concatenation puts the embedding first: the paper writes [h; Emb] but the published weights'
``eh_proj`` columns are [enorm(Emb); hnorm(h)] (vLLM's, SGLang's and Megatron's MTP layers), and the
Hub files are what the import reads.
"""

from __future__ import annotations

import torch
from torch import nn

from framework.config.schema import ModelConfig
from framework.models.parts.norm import RMSNorm


class MTPLayer(nn.Module):
    """One prediction depth: ``enorm``, ``hnorm``, ``eh_proj``, ``block``, the head's ``norm``."""

    def __init__(self, cfg: ModelConfig, block: nn.Module) -> None:
        super().__init__()
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = block
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, h: torch.Tensor, emb: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        """The normed hidden states the shared head projects: ``h`` the trunk's (batch, s, dim) at
        positions 0..s-1, ``emb`` the embeddings of the tokens one position later."""
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))
        return self.norm(self.block(x, rope))


class MultiTokenPrediction(nn.Module):
    """The MTP layers, keyed by their index in the whole model (the Hub files' ``model.layers.N``),
    so that the balance figures (``sparse.LAYER_INDEX``) place their MoE layer after the trunk's."""

    def __init__(self, layers: dict[str, MTPLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict(layers)


def keep_mtp(model: nn.Module, _args: object, _out: object) -> None:
    """The decoder's forward hook: its training forward's MTP cross-entropy (``mtp_value``) kept in
    ``mtp_values`` for the step's figure; a forward without gradients keeps nothing. A hook, as
    ``keep_aux``: a compiled forward would guard on the list."""
    value, model.mtp_value = model.mtp_value, None
    if value is None or torch.compiler.is_exporting() or not torch.is_grad_enabled():
        return
    model.mtp_values.append(value)


@torch.no_grad()
def take_mtp(model: nn.Module) -> torch.Tensor | None:
    """The MTP cross-entropy of the training forwards since the last call (before its weight), the
    mean over them (a step's micro batches); resets it. None without an MTP layer or a training
    forward."""
    parts = []
    for m in model.modules():
        values = getattr(m, "mtp_values", None)
        if values:
            parts.append(torch.stack(values).mean())
            m.mtp_values = []
    return torch.stack(parts).sum() if parts else None
