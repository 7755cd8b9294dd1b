"""Data parallelism: DDP with the bucketing group's knobs, and FSDP2 / HSDP (``fully_shard``)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

from framework.config.schema import BucketingConfig, DType, ShardingConfig
from framework.models import Decoder, blocks
from framework.parallel.expert import expert_modules

try:  # FSDP2's per-parameter mesh (torch >= 2.12), from its private modules (not exported yet)
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
except ImportError:  # torch 2.11: the experts are a unit of their own (see ExpertShards)
    ShardPlacementResult = None

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
    expert weights are sharded over ``experts_mesh`` (the replicas of each ep shard), not over
    dp_shard, whose ep ranks hold different experts, in the block's own unit (``ExpertShards``). An
    expert's gradient already sums the tokens of all its ep ranks (the all-to-all's backward), so it
    is divided by the whole data-parallel degree ``dp_degree``, as every other gradient is, not by
    the replicas alone.

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
        if experts_mesh is not None and ShardPlacementResult is None:
            _shard_experts_apart(block, experts_mesh, sharding, mp, dp_degree)
        experts = [p for m in expert_modules(block) for p in m.parameters()]
        has_experts = experts and experts_mesh is not None and ShardPlacementResult is not None
        unit = ExpertShards(experts, experts_mesh) if has_experts else None
        fully_shard(
            block,
            mesh=dp_mesh,
            reshard_after_forward=sharding.reshard_after_forward,
            mp_policy=mp,
            shard_placement_fn=unit.placement if unit is not None else None,
        )
        if unit is not None:
            unit.divide_grads(block, dp_degree)
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


class ExpertShards:
    """A block's expert weights sharded over the experts' own FSDP mesh inside the block's unit,
    through FSDP2's per-parameter mesh (``shard_placement_fn`` returning a ``ShardPlacementResult``,
    torch >= 2.13: one unit, a parameter group per mesh, each gathered and reduced over its own).

    Why not a unit of their own (``fully_shard(experts)``, as before): FSDP2's forward hooks are
    ``torch._dynamo.disable``d, so a unit nested in a block breaks the block's compiled graph at
    the expert call ("Attempted to call function marked as skipped": ``executor=compile`` fell back
    to eager under ``parallel.ep``). In the block's unit the hooks run around the block, outside
    its graph, which holds the all-to-alls and the experts."""

    def __init__(self, experts: list[nn.Parameter], experts_mesh: DeviceMesh) -> None:
        self.mesh = experts_mesh
        self.ids = {id(p) for p in experts}
        # FSDP's mesh record of the experts' mesh (HSDP when 2D: dp_replicate x dp_shard_mod_ep), one
        # object for all of them, as FSDP2 groups parameters by it
        self.info = _get_mesh_info(experts_mesh)

    def placement(self, p: nn.Parameter) -> ShardPlacementResult | None:
        """``shard_placement_fn``: dim 0 over the experts' mesh for an expert weight; None (dim 0
        over the block's mesh) for every other parameter."""
        return ShardPlacementResult(Shard(0), self.info) if id(p) in self.ids else None  # type: ignore[arg-type]

    def divide_grads(self, block: nn.Module, dp_degree: int) -> None:
        """The expert group's gradients divided by ``dp_degree`` (its own mesh is smaller); the
        block's other group keeps FSDP's default (its mesh's size, the same degree). FSDP2 sets a
        divide factor per unit only (``set_gradient_divide_factor``), so per group here."""
        groups = [g for g in block._get_fsdp_state()._fsdp_param_groups if g.mesh_info is self.info]  # type: ignore[operator]
        assert len(groups) == 1, "FSDP2 made no parameter group of the block's experts"
        groups[0].gradient_divide_factor = float(dp_degree)
        # Sum, then divide: a divide factor other than the group's size is otherwise NCCL's
        # PREMUL_SUM, which gloo refuses ("Cannot use ReduceOp.PREMUL_SUM with Gloo"). Not over a
        # one-rank shard group: there FSDP2 divides when it copies the gradient and again after,
        # when forced to sum (torch 2.13 foreach_reduce: half the gradient).
        groups[0].force_sum_reduction_for_comms = self.mesh.shape[-1] > 1


def _shard_experts_apart(
    block: nn.Module, experts_mesh: DeviceMesh, sharding: ShardingConfig, mp: MixedPrecisionPolicy, dp_degree: int
) -> None:
    """torch 2.11, without FSDP2's per-parameter mesh: each block's experts a unit of their own over
    ``experts_mesh``, inside the block's. Correct, but the nested unit's hooks break a compiled block
    at the expert call (``executor=compile`` falls back to eager under ``parallel.ep``)."""
    for experts in expert_modules(block):
        fully_shard(experts, mesh=experts_mesh, reshard_after_forward=sharding.reshard_after_forward, mp_policy=mp)
        experts.set_gradient_divide_factor(float(dp_degree))
        # Sum, then divide: a divide factor other than the group's size is otherwise NCCL's
        # PREMUL_SUM, which gloo refuses. Not over a one-rank shard group: there FSDP2 divides when it
        # copies the gradient and again after, when forced to sum (half the gradient).
        experts.set_force_sum_reduction_for_comms(experts_mesh.shape[-1] > 1)
