"""Data parallelism: DDP with the bucketing group's knobs, and FSDP2 / HSDP (``fully_shard``)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from framework.config.schema import BucketingConfig, DType, ShardingConfig
from framework.models import Decoder, blocks
from framework.parallel.expert import expert_modules

TORCH_DTYPES = {DType.float32: torch.float32, DType.bfloat16: torch.bfloat16, DType.float16: torch.float16}


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, bucketing: BucketingConfig, bucket_cap_mb: float) -> DDP:
    """Wrap in DDP over the data-parallel mesh axis.

    ``static_graph=True`` is the real "static graph" switch of DDP: the set of used parameters and the
    order of their gradients is recorded on the first iteration and reused, which lets DDP skip the
    unused-parameter search and overlap bucketed all-reduces deterministically.
    ``bucket_cap_mb`` comes from the plan (the group's value, or the alpha-beta model's choice under
    ``bucketing=auto``).
    """
    device_ids = None
    param = next(model.parameters())
    if param.device.type == "cuda":
        device_ids = [param.device.index]
    return DDP(
        model,
        device_ids=device_ids,
        process_group=dp_mesh.get_group(),
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=bucketing.gradient_as_bucket_view,
        static_graph=bucketing.static_graph,
    )


def apply_fsdp(
    model: Decoder,
    dp_mesh: DeviceMesh,
    sharding: ShardingConfig,
    experts_mesh: DeviceMesh | None = None,
    dp_degree: int = 1,
) -> None:
    """FSDP2: ``fully_shard`` each block, then the root (embeddings, final norm, output).

    Under expert parallelism (``experts_mesh``: framework.parallel.mesh.expert_meshes) each block's
    experts are a unit of their own first, sharded over ``experts_mesh`` (the replicas of each ep
    shard), not over dp_shard, whose ep ranks hold different experts. An expert's gradient already
    sums the tokens of all its ep ranks (the all-to-all's backward), so it is divided by the whole
    data-parallel degree ``dp_degree``, as every other gradient is, not by the replicas alone.

    A 1D ``dp_mesh`` shards over all its ranks (fsdp, fsdp_tp); a 2D (dp_replicate, dp_shard) mesh is
    HSDP: shard inside the dp_shard axis, all-reduce across dp_replicate. Parameters already sharded
    by TP become 2D DTensors. Per-block units let FSDP2 all-gather one block while the previous
    computes, and free it after (``reshard_after_forward``). Raises RuntimeError if a parameter was
    left unsharded.
    """
    mp = MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPES[sharding.param_dtype], reduce_dtype=TORCH_DTYPES[sharding.reduce_dtype]
    )
    for block in blocks(model):
        if experts_mesh is not None:
            for experts in expert_modules(block):
                fully_shard(
                    experts,
                    mesh=experts_mesh,
                    reshard_after_forward=sharding.reshard_after_forward,
                    mp_policy=mp,
                )
                experts.set_gradient_divide_factor(float(dp_degree))
                # Sum, then divide: a divide factor other than the group's size is otherwise
                # NCCL's PREMUL_SUM, which gloo refuses ("Cannot use ReduceOp.PREMUL_SUM with Gloo").
                # Not over a one-rank shard group: there FSDP2 divides when it copies the gradient
                # and again after, when forced to sum (torch 2.13 foreach_reduce: half the gradient).
                experts.set_force_sum_reduction_for_comms(experts_mesh.shape[-1] > 1)
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=sharding.reshard_after_forward, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=sharding.reshard_after_forward, mp_policy=mp)
    # Without resharding after forward, gradient accumulation keeps the units unsharded until the
    # step's last backward too (framework.train.loop._no_grad_sync): one all-gather a step, as planned.
    model.hold_for_step = not sharding.reshard_after_forward
    names = set(dp_mesh.mesh_dim_names or ())
    expert_names = set(experts_mesh.mesh_dim_names or ()) if experts_mesh is not None else names
    unsharded = [
        n
        for n, p in model.named_parameters()
        if not (
            isinstance(p, DTensor)
            and (
                names <= set(p.device_mesh.mesh_dim_names or ())
                or expert_names <= set(p.device_mesh.mesh_dim_names or ())
            )
        )
    ]
    if unsharded:
        raise RuntimeError(f"fully_shard left {len(unsharded)} parameter(s) unsharded, e.g. {unsharded[:3]}")
