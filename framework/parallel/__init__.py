"""Parallelize a meta-device decoder (``framework.models.Decoder``) per the plan, each concern in order.

One module per concern: pipeline.py (pipeline stages and schedule), float8.py (float8 Linear layers),
tensor.py (TP), expert.py (EP), activation.py (AC), compile.py, data_parallel.py (FSDP2 / HSDP, DDP), mesh.py (the
named device mesh).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from framework.config.schema import (
    BucketingConfig,
    ExecutorConfig,
    PeftConfig,
    PPSchedule,
    ShardingConfig,
)
from framework.models import Decoder, WeightLoader, materialize
from framework.parallel.activation import activation_rung, apply_ac, apply_offload
from framework.parallel.compile import apply_compile
from framework.parallel.data_parallel import apply_ddp, apply_fsdp
from framework.parallel.expert import apply_ep, moe_layers
from framework.parallel.float8 import apply_float8
from framework.parallel.lora import after_materialize, apply_lora
from framework.parallel.mesh import (
    build_mesh,
    dp_mesh_info,
    expert_meshes,
    fsdp_mesh,
    sub_mesh,
    token_group,
)
from framework.parallel.pipeline import PipelineModel, build_schedule, cut_stage, tie_stages
from framework.parallel.tensor import apply_tp
from framework.planner.layout import DP_AXES, MeshAxis
from framework.planner.plan import Plan
from framework.planner.stages import ZERO_BUBBLE, stage_ids

__all__ = ["build_mesh", "dp_mesh_info", "parallelize"]


def parallelize(
    model: Decoder,
    mesh: DeviceMesh,
    plan: Plan,
    sharding: ShardingConfig,
    bucketing: BucketingConfig,
    executor: ExecutorConfig,
    device: torch.device,
    seed: int,
    *,
    init_weights: bool = True,
    peft: PeftConfig | None = None,
    load_weights: WeightLoader | None = None,
) -> nn.Module:
    """Shard, checkpoint, compile, place and initialise a model built on the meta device.

    Order, and why:
      P. Pipeline split (``pp > 1``, framework.parallel.pipeline): first, on the whole meta model,
         because every later step applies to each stage on its own: this rank's stages are cut
         (copies without the other stages' blocks, embedding or head; the single-process parameter
         names), steps 0-5 run on each stage (TP and FSDP inside the stage, AC and compile per stage;
         under pp, dp_replicate is FSDP's replicate axis, never DDP: ``Degrees.fsdp``), and the
         schedule wraps them last, over real tensors. Returns a ``PipelineModel``: the rank's stages
         under the single-process names, with the schedule that runs them.
      0. Float8 (``apply_float8``, ``model.float8``): swaps the chosen Linear layers for torchao's
         Float8Linear, first, as torchao requires: TP shards the float8 modules (torchao's float8
         styles under tensorwise), compile traces their casts, FSDP2 all-gathers their weights in
         float8 (tensorwise). Off under ``model.float8=none``.
     0b. LoRA (``apply_lora``, ``peft``; framework.parallel.lora says why here): freezes the model
         and attaches the adapters after float8 (whose swap would drop them) and before TP (refused:
         TP's styles would shard the adapters on the base's dim), AC, compile and FSDP (which wrap,
         trace and shard them with their block). Their seeded init and ``peft.base_dtype``'s cast
         follow materialisation (5), before DDP (6). Off under ``peft=none``.
      1. TP (``apply_tp``): swaps Linear/Embedding weights for DTensors and installs the layout
         hooks; FSDP must see these DTensors to shard them a second time (2D), and AC/compile must
         wrap a forward that already contains the TP collectives. Under ``plan.loss_parallel`` the
         output projection's logits stay sharded over the vocabulary (the steps and evaluation
         enter torch's ``loss_parallel()`` around the loss: ``tensor.loss_parallel_scope``).
     1b. EP (``apply_ep``, ``parallel.ep``): each MoE layer's stacked experts become DTensors
         ``Shard(0)`` on the ep mesh (the inner ep ranks of dp_shard, ``expert_meshes``) and its
         expert call an all-to-all dispatch and combine. After TP, whose plan leaves the experts
         alone, and before AC and compile (which wrap and trace the all-to-all with the block) and
         FSDP (step 4 shards the experts over the replicas of each ep shard, the rest over
         dp_shard as without ep).
      2. Activation checkpointing (``apply_ac``): wraps each block's forward (``budget`` leaves
         it to the compiler's partitioner, step 3); before compile so Dynamo traces the
         checkpoint region as one higher-order op and Inductor plans the recompute. Exception:
         with TP, that op saves a DeviceMesh among its tensors and AOTAutograd refuses it (torch
         2.13), so with TP the order of 2 and 3 swaps: eager checkpointing wraps the compiled
         block and re-runs it in backward (same recompute, same memory; the planner refuses
         ``executor.scope=model`` there, where no order helps).
      3. Compile (``apply_compile``): per block (or whole model) before FSDP/DDP, so their hooks
         stay outside the compiled graphs (fullgraph) and Dynamo never traces DDP.
      4. FSDP2 / HSDP (``apply_fsdp``): per block, then the root; still on meta, so a 70B shape
         is sharded before any rank allocates it. On when ``dp_shard > 1``, and for
         ``dp_replicate > 1`` with TP (HSDP over a size-1 dp_shard axis: DDP cannot wrap the TP
         DTensors), so dp_replicate x dp_shard x tp is one 3D mesh. With CP it shards over
         dp_shard x cp flattened (``fsdp_mesh``): CP ranks share parameters and average gradients.
         CP itself acts per step, not on the model (framework.parallel.context).
      5. Materialize (``framework.models.materialize``): ``to_empty`` on the device, re-tie, then
         ``init_weights(seed)``, which draws every full parameter from a per-name generator and
         slices the local shard: every layout starts from the single-process weights; or, under
         ``model.init_from``, ``load_weights`` (the caller's: framework.checkpoint.init_from.load). It also
         sets the residual stream's dtype for the device (``model.residual_dtype``).
         Skipped with ``init_weights=False`` (the dry run measures shapes on meta).
      6. DDP (``apply_ddp``): last, because it verifies, broadcasts and buckets real tensors (it
         cannot wrap meta ones, so ``init_weights=False`` skips it too; DDP shards nothing, so the
         dry run's measurement does not change). On for ``dp_replicate > 1`` without dp_shard or
         TP. Like every step, it is off when its axis has size 1, so world size 1 needs no branch.

    Every step reads the plan's degrees (``plan.layout``), never a strategy name.

    Each step is a no-op when its setting is off. Raises RuntimeError when a wrapper that should have
    sharded something sharded nothing (and under ``parallel.ep`` when the model has no MoE layer).
    """
    if plan.layout.ep > 1 and not moe_layers(model):
        raise RuntimeError(
            f"parallel.ep={plan.layout.ep}, but the model has no MoE layer whose experts it could shard"
        )
    if plan.layout.pp > 1:
        return _pipeline(
            model, mesh, plan, sharding, executor, device, seed, init_weights, peft, load_weights
        )
    return _parallelize_stage(
        model, mesh, plan, sharding, bucketing, executor, device, seed, init_weights, peft, load_weights
    )


def _pipeline(
    model: Decoder,
    mesh: DeviceMesh,
    plan: Plan,
    sharding: ShardingConfig,
    executor: ExecutorConfig,
    device: torch.device,
    seed: int,
    init_weights: bool,
    peft: PeftConfig | None = None,
    load_weights: WeightLoader | None = None,
) -> PipelineModel:
    """Step P of ``parallelize``: cut this rank's stages, parallelize each, build the schedule (and
    with tied embeddings the group that keeps the last stage's copy equal to the embedding).

    Zero-bubble schedules keep each FSDP stage unsharded from its first forward to the step's
    REDUCE_GRAD (``reshard_after_forward=False``, torchtitan's default under pp). They need it:
    torch's split backward (``stage_backward_input``) collects the weights whose gradients its
    weight pass computes from ``submod.parameters()`` before the autograd pass; right after a
    forward that resharded, those are FSDP2's sharded DTensors, not the unsharded parameters the
    graph accumulates into, so no weight matches, ``stage_backward_weight`` computes nothing and
    that micro batch's weight gradients are lost (every one of the last stage's, whose input pass
    always follows its own forward: ``.grad`` None after the step). Kept unsharded, the parameters
    are the graph's own at every input pass.
    """
    pp_mesh = sub_mesh(mesh, plan, (MeshAxis.pp,))
    assert pp_mesh is not None
    schedule = PPSchedule[plan.pp_schedule]
    if schedule in ZERO_BUBBLE:
        sharding = dataclasses.replace(sharding, reshard_after_forward=False)
    n = len(plan.pp_split)
    ids = stage_ids(pp_mesh.get_local_rank(), plan.layout.pp, plan.pp_stages_per_rank, schedule)
    stages = [cut_stage(model, range(*plan.pp_split[i]), i == 0, i == n - 1) for i in ids]
    for stage in stages:
        out = _parallelize_stage(
            stage, mesh, plan, sharding, None, executor, device, seed, init_weights, peft, load_weights
        )
        assert out is stage, "under pp, data parallelism is FSDP (in place), never a DDP wrapper"
    piped = PipelineModel(stages, ids, n)
    if init_weights:
        build_schedule(piped, pp_mesh, schedule, plan.pp_microbatches, device)
        if model.cfg.tie_embeddings:
            pp = plan.layout.pp
            last = next(r for r in range(pp) if n - 1 in stage_ids(r, pp, plan.pp_stages_per_rank, schedule))
            tie_stages(piped, mesh, plan.mesh_axes.index(MeshAxis.pp.value), last)
    return piped


def _parallelize_stage(
    model: Decoder,
    mesh: DeviceMesh,
    plan: Plan,
    sharding: ShardingConfig,
    bucketing: BucketingConfig | None,
    executor: ExecutorConfig,
    device: torch.device,
    seed: int,
    init_weights: bool,
    peft: PeftConfig | None = None,
    load_weights: WeightLoader | None = None,
) -> nn.Module:
    """Steps 0-6 of ``parallelize`` on one model (the whole model, or one pipeline stage)."""
    layout = plan.layout
    if model.cfg.moe.num_experts:  # an MoE family: its balance spans the data-parallel ranks' tokens
        model.token_group = token_group(mesh, plan)
    apply_float8(model, model.cfg, fsdp_all_gather=layout.fsdp and layout.fsdp_shard > 1)
    apply_lora(model, peft, layout.tp, layout.fsdp)
    apply_tp(model, sub_mesh(mesh, plan, (MeshAxis.tp,)), plan.loss_parallel, plan.async_tp)
    experts = expert_meshes(mesh, plan)
    apply_ep(model, experts[0] if experts else None)
    ac, budget = activation_rung(sharding, executor)
    if layout.tp > 1:
        apply_compile(model, executor, device, budget)
        apply_ac(model, ac)
    else:
        apply_ac(model, ac)
        apply_compile(model, executor, device, budget)
    apply_offload(model, sharding.activation_offload)
    if layout.fsdp:
        shard_mesh = fsdp_mesh(mesh, plan)
        assert shard_mesh is not None
        apply_fsdp(model, shard_mesh, sharding, experts[1] if experts else None, layout.dp)
    if init_weights:
        materialize(model, device, seed, load_weights)
        after_materialize(model, peft, seed)
    # DDP over a one-rank data-parallel axis would only copy gradients into buckets and all-reduce
    # them with itself, and keep its gradient buckets resident through forward: the concern is off.
    if layout.ddp and init_weights:
        dp_mesh = sub_mesh(mesh, plan, DP_AXES)
        assert dp_mesh is not None and bucketing is not None
        return apply_ddp(model, dp_mesh, bucketing, plan.bucket_cap_mb)
    return model
