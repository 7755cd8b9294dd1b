"""Tensor parallelism (Megatron-style with sequence parallelism), as torchtitan applies it to Llama;
the plan is derived from the model's spec (framework.models: each weight's ``TPStyle``).

Column-parallel wq/wk/wv/w1/w3 and row-parallel wo/w2 keep each block's matmuls local between one
all-gather and one reduce-scatter; the norms run sequence-parallel (activations sharded on the
sequence dim) so no rank holds a full activation outside attention and the FFN.

The output projection's logits (``parallel.loss_parallel``, on by default, as torchtitan's) stay
sharded over the vocabulary (a DTensor ``Shard(-1)``, torchtitan's ``output_layouts=Shard(-1),
use_local_output=False``) and the cross-entropy runs on the shards under torch's ``loss_parallel()``
(framework.models.parts.loss): three all-reduces of one float per token in forward (the max, the
sum of exponentials, the target's logit), none in backward, so no rank holds more than 1/tp of the
logits or their gradient. The decoder's ``head_loss`` and a pipeline's ``PipelineLoss`` compute it; every
caller that runs them (the training steps, evaluation) enters the scope around forward *and*
backward, whose custom handlers the backward's ops dispatch to. ``forward(tokens)`` without targets
still returns the whole vocabulary's logits (gathered: the verifier's check, tests), except on a
pipeline's last stage, whose shards go to the schedule's loss. Off, the output projection gathers
the logits to a full (Replicate) local tensor on every rank, and the plain cross-entropy runs on it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from framework.config.schema import Float8Recipe
from framework.models import Decoder, LayerKind, ModelSpec, TPStyle, Weight, model_spec, tie
from framework.parallel.float8 import tp_styles


def _fresh_output(_module: nn.Module, _args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output.clone()


def _root_style(w: Weight, loss_parallel: bool) -> ParallelStyle:
    if w.tp is TPStyle.embedding:
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if w.tp is TPStyle.output:
        if loss_parallel:  # loss parallelism: the logits stay a DTensor sharded over the vocabulary
            return ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
        return ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=True)
    assert w.tp is TPStyle.sequence, w
    return SequenceParallel()


def _block_style(block: nn.Module, w: Weight, recipe: Float8Recipe) -> ParallelStyle:
    """Float8 layers under tensorwise take torchao's float8 styles; the layouts are the same as the
    bf16 plan's. Their float8 collective is the backward all-gather of the row-parallel outputs'
    gradients: the activations reach them already gathered, in high precision, by the sublayer's
    ``PrepareModuleInput`` (torchtitan's ``PrepareFloat8ModuleInput`` would gather them in float8,
    but hands float8 to every Linear of the sublayer, and the size filter may keep some in bf16)."""
    if w.tp is TPStyle.sequence:
        return SequenceParallel()
    if w.tp is TPStyle.heads:
        # (batch, seq, local heads, head_dim): treated as sharded on the heads dim, so that the
        # replicated weight's gradient is summed over every rank's heads.
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    styles = tp_styles(block.get_submodule(w.module), recipe)
    if w.tp is TPStyle.colwise:
        return styles[0]() if styles else ColwiseParallel()
    assert w.tp is TPStyle.rowwise, w
    return styles[1](output_layouts=Shard(1)) if styles else RowwiseParallel(output_layouts=Shard(1))


# The styles of a sublayer that TP runs whole on every rank (block_plan).
_WHOLE = (TPStyle.moe, TPStyle.replicated)


def block_plan(
    spec: ModelSpec, kind: LayerKind, block: nn.Module, recipe: Float8Recipe
) -> dict[str, ParallelStyle]:
    """One block's plan from its layer kind's weights: each sublayer's input gathered from the sequence shards
    (the other inputs, such as the RoPE table, pass through), then each weight's module.

    An MoE sublayer (all its weights ``TPStyle.moe``: router and experts) is not split by TP: it
    takes the gathered sequence as a plain tensor, every TP rank runs it whole on the same tokens
    (expert parallelism, ``parallel.ep``, splits its experts instead, over dp_shard), and its output
    is cut back to this rank's sequence shard (a local slice; in backward an all-gather of the
    output's gradient, which every rank then holds whole, as it ran the layer whole). Its weights'
    gradients are the same on every TP rank, so they are plain tensors, never summed over tp."""
    plan: dict[str, ParallelStyle] = {}
    replicated = {
        module
        for module in spec.sublayers
        if (mine := [w for w in kind.weights if w.module.startswith(f"{module}.")])
        and all(w.tp in _WHOLE for w in mine)
    }
    for module, n_inputs in spec.sublayers.items():
        rest = (None,) * (n_inputs - 1)
        if module in replicated:
            plan[module] = PrepareModuleInputOutput(
                input_layouts=(Shard(1), *rest),
                desired_input_layouts=(Replicate(), *rest),
                use_local_input=True,
                output_layouts=Replicate(),
                desired_output_layouts=Shard(1),
                use_local_output=True,
            )
            continue
        plan[module] = PrepareModuleInput(
            input_layouts=(Shard(1), *rest), desired_input_layouts=(Replicate(), *rest)
        )
    for w in kind.weights:
        if w.tp not in _WHOLE:
            plan[w.module] = _block_style(block, w, recipe)
    return plan


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """``parallel.async_tp``: turn on Inductor's micro-pipeline TP pass, which rewrites each compiled
    sequence-parallel all-gather + matmul and matmul + reduce-scatter into torch's fused ops over
    symmetric memory (torchtitan's enable_async_tensor_parallel does the same two things). The
    pass is a global Inductor setting, read when the blocks compile (after this, ``apply_compile``).
    Symmetric memory is set up for the TP group where this torch still needs it (it warns that the
    call is no longer needed from 2.12 on). The planner refuses it off CUDA and under eager."""
    import warnings

    import torch._inductor.config as inductor_config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    inductor_config._micro_pipeline_tp = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)


def apply_tp(
    model: Decoder, tp_mesh: DeviceMesh | None, loss_parallel: bool = True, async_tp: bool = False
) -> None:
    """Shard ``model`` in place over ``tp_mesh`` by its spec's TP styles; no-op when there is no TP
    axis (or it has size 1). ``async_tp`` (``parallel.async_tp``, on CUDA): ``enable_async_tp`` first,
    so the blocks compile with their collectives fused. ``loss_parallel`` (``parallel.loss_parallel``): the output projection's
    logits stay sharded over the vocabulary and the model's loss runs under ``loss_parallel_scope``
    (framework.models.parts.loss; ``Decoder.vocab_shards``); False gathers them to every TP rank.

    Tied embeddings: the embedding (row-wise over the vocabulary) and the output projection
    (column-wise) both shard the weight as Shard(0), so the output is tied again to the embedding's
    DTensor parameter. Raises RuntimeError if nothing was sharded.
    """
    if tp_mesh is None or tp_mesh.size() == 1:
        return
    if async_tp and tp_mesh.device_type == "cuda":  # a dry run on meta plans it, runs nothing
        enable_async_tp(tp_mesh)
    spec = model_spec(model.cfg)
    # A pipeline stage may lack the embedding or the head (framework.parallel.pipeline): its input
    # and output are then the residual stream's local sequence shard, as between two blocks.
    root = {
        w.module: _root_style(w, loss_parallel)
        for w in (*spec.first, *spec.last)
        if getattr(model, w.module) is not None
    }
    parallelize_module(model, tp_mesh, root)
    for key, block in model.get_submodule(spec.blocks).items():  # a pipeline stage: its own layers
        kind = spec.layers[int(key)]
        parallelize_module(block, tp_mesh, block_plan(spec, kind, block, model.cfg.float8))
    # The embedding's output is ``to_local()``'s *view* of its DTensor's local tensor. When the block
    # that takes it is compiled, AOTAutograd replays that view from its base, and the gradient
    # reaches the embedding's redistribute as a plain tensor, skipping ``to_local``'s backward
    # (torch 2.13: "'Tensor' object has no attribute '_local_tensor'"). A copy makes the residual
    # stream a fresh tensor: batch x seq/tp x dim elements once per step.
    if model.tok_embeddings is not None:
        model.tok_embeddings.register_forward_hook(_fresh_output)
    tie(model)
    # The residual stream between the blocks is now this rank's sequence shard: a mask the trunk
    # builds from its length (the sliding window's band) is for the whole sequence, which attention sees.
    model.sequence_shards = tp_mesh.size()
    if loss_parallel and model.output is not None:
        model.vocab_shards = tp_mesh.size()
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        raise RuntimeError(f"apply_tp sharded no parameter over the tp mesh {tp_mesh}")
