"""Tensor parallelism (Megatron-style with sequence parallelism), as torchtitan applies it to Llama.

Column-parallel wq/wk/wv/w1/w3 and row-parallel wo/w2 keep each block's matmuls local between one
all-gather and one reduce-scatter; the norms run sequence-parallel (activations sharded on the
sequence dim) so no rank holds a full activation outside attention and the FFN. The output
projection gathers the logits to a full (Replicate) local tensor, so the trainer's
``F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())`` runs unchanged.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from framework.model import Llama
from framework.parallel.float8 import tp_styles


def _fresh_output(_module: nn.Module, _args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output.clone()


def apply_tp(model: Llama, tp_mesh: DeviceMesh | None) -> None:
    """Shard ``model`` in place over ``tp_mesh``; no-op when there is no TP axis (or it has size 1).

    Tied embeddings: the embedding (row-wise over the vocabulary) and the output projection
    (column-wise) both shard the weight as Shard(0), so the output is tied again to the embedding's
    DTensor parameter. Raises RuntimeError if nothing was sharded.
    """
    if tp_mesh is None or tp_mesh.size() == 1:
        return
    # A pipeline stage may lack the embedding or the head (framework.parallel.pipeline): its input
    # and output are then the residual stream's local sequence shard, as between two blocks.
    root = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=True),
    }
    parallelize_module(model, tp_mesh, {k: v for k, v in root.items() if getattr(model, k) is not None})
    recipe = model.cfg.float8

    def col(block: nn.Module, path: str) -> ColwiseParallel:
        styles = tp_styles(block.get_submodule(path), recipe)
        return styles[0]() if styles else ColwiseParallel()

    def row(block: nn.Module, path: str) -> RowwiseParallel:
        styles = tp_styles(block.get_submodule(path), recipe)
        return styles[1](output_layouts=Shard(1)) if styles else RowwiseParallel(output_layouts=Shard(1))

    for block in model.layers.values():
        # Float8 layers under tensorwise take torchao's float8 styles (float8 all-gather of the
        # activations); the layouts are the same as the bf16 plan's.
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                # The second input is the RoPE table: a plain tensor every rank holds whole.
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
                ),
                "attention.wq": col(block, "attention.wq"),
                "attention.wk": col(block, "attention.wk"),
                "attention.wv": col(block, "attention.wv"),
                "attention.wo": row(block, "attention.wo"),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w1": col(block, "feed_forward.w1"),
                "feed_forward.w2": row(block, "feed_forward.w2"),
                "feed_forward.w3": col(block, "feed_forward.w3"),
            },
        )
    # The embedding's output is ``to_local()``'s *view* of its DTensor's local tensor. When the block
    # that takes it is compiled, AOTAutograd replays that view from its base, and the gradient
    # reaches the embedding's redistribute as a plain tensor, skipping ``to_local``'s backward
    # (torch 2.13: "'Tensor' object has no attribute '_local_tensor'"). A copy makes the residual
    # stream a fresh tensor: batch x seq/tp x dim elements once per step.
    if model.tok_embeddings is not None:
        model.tok_embeddings.register_forward_hook(_fresh_output)
    if model.cfg.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        raise RuntimeError(f"apply_tp sharded no parameter over the tp mesh {tp_mesh}")
