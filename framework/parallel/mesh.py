"""The device mesh named after the plan's axes, and the coordinates other parts read from it."""

from __future__ import annotations

import math

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from framework.planner.layout import DP_AXES, MeshAxis
from framework.planner.plan import Plan

DP_SHARD_CP = "dp_shard_cp"  # the flattened dp_shard x cp axis FSDP2 shards over
EP = "ep"  # expert parallelism: the inner ep ranks of dp_shard (framework.parallel.expert)
DP_SHARD_MOD_EP = "dp_shard_mod_ep"  # the outer dp_shard / ep ranks: replicas of each expert shard
TOKENS = "dp_tokens"  # the flattened data axes (dp_replicate x dp_shard x cp): ranks of other tokens


def build_mesh(plan: Plan, device_type: str) -> DeviceMesh:
    """One mesh over all ranks with the plan's shape and axis names (needs a process group).

    Axes are ordered outermost first, so the last axis (``tp`` when present) groups consecutive
    ranks and stays inside a node.
    """
    return init_device_mesh(device_type, plan.mesh_shape, mesh_dim_names=plan.mesh_axes)


def sub_mesh(mesh: DeviceMesh, plan: Plan, axes: tuple[MeshAxis, ...]) -> DeviceMesh | None:
    """The mesh over those of ``axes`` that the plan has (in mesh order), or None if it has none."""
    names = tuple(a for a in plan.mesh_axes if MeshAxis(a) in axes)
    if not names:
        return None
    if names == tuple(mesh.mesh_dim_names or ()):
        return mesh
    return mesh[names]


def fsdp_mesh(mesh: DeviceMesh, plan: Plan) -> DeviceMesh | None:
    """The mesh FSDP2 shards over: the data-parallel axes, with dp_shard and cp flattened into one
    ``dp_shard_cp`` axis when CP is on. CP ranks hold the same parameters and average their
    gradients, so FSDP2 shards over them too (torchtitan's ``dp_shard_cp``); dp_replicate stays
    the outer (HSDP) axis."""
    d = plan.layout
    if d.cp <= 1:
        return sub_mesh(mesh, plan, DP_AXES)
    shard_cp = (MeshAxis.dp_shard.value, MeshAxis.cp.value)
    if d.dp_replicate == 1:
        return mesh[shard_cp]._flatten(DP_SHARD_CP)
    # torch deprecates slicing a flattened axis from the root mesh: flatten the three data axes
    # and unflatten them into (dp_replicate, dp_shard_cp), a mesh of its own.
    flat = mesh[(MeshAxis.dp_replicate.value, *shard_cp)]._flatten("dp_cp")
    return flat._unflatten(0, (d.dp_replicate, d.fsdp_shard), (MeshAxis.dp_replicate.value, DP_SHARD_CP))


def expert_meshes(mesh: DeviceMesh, plan: Plan) -> tuple[DeviceMesh, DeviceMesh] | None:
    """(the ep mesh the experts are sharded over, the mesh FSDP2 shards the experts over), or None
    without expert parallelism.

    The ep ranks are borrowed from dp_shard, as torchtitan's ParallelDims does: dp_shard is split
    into (``dp_shard_mod_ep``, ``ep``), ep inner, so an ep group is consecutive dp_shard ranks (the
    all-to-all stays as close as dp_shard's own collectives). The experts' FSDP mesh is
    (dp_replicate, dp_shard_mod_ep): each expert shard is sharded over its replicas and all-reduced
    across dp_replicate (HSDP), never reduced over ep, whose ranks hold different experts. Both are
    views of the one root mesh (``_unflatten``), so a parameter's DTensor placements on them compose
    with FSDP2's and DCP reads the global tensor."""
    d = plan.layout
    if d.ep <= 1:
        return None
    shard = MeshAxis.dp_shard.value
    if d.dp_replicate == 1:
        split = mesh[shard]._unflatten(0, (d.dp_shard // d.ep, d.ep), (DP_SHARD_MOD_EP, EP))
        return split[EP], split[DP_SHARD_MOD_EP]
    flat = mesh[(MeshAxis.dp_replicate.value, shard)]._flatten("dp_ep")
    split = flat._unflatten(
        0, (d.dp_replicate, d.dp_shard // d.ep, d.ep), (MeshAxis.dp_replicate.value, DP_SHARD_MOD_EP, EP)
    )
    return split[EP], split[(MeshAxis.dp_replicate.value, DP_SHARD_MOD_EP)]


def dp_mesh_info(mesh: DeviceMesh, plan: Plan) -> tuple[int, int]:
    """(this rank's data-parallel rank, data-parallel size): the coordinate the data sampler uses.

    The rank is the row-major index over the dp axes (dp_replicate outer, dp_shard inner); TP ranks
    of one data-parallel group share it, so they read the same batch.
    """
    rank, size = 0, 1
    coord = mesh.get_coordinate()
    assert coord is not None, "this rank is not part of the mesh"
    for i, name in enumerate(plan.mesh_axes):
        if MeshAxis(name) in DP_AXES:
            rank = rank * plan.mesh_shape[i] + coord[i]
            size *= plan.mesh_shape[i]
    return rank, size


def token_group(mesh: DeviceMesh, plan: Plan) -> dist.ProcessGroup | None:
    """The ranks that hold other tokens of the same step: dp_replicate x dp_shard (ep's ranks
    included: they are dp_shard's) x cp, flattened into one group; None when that is this rank alone.
    TP ranks hold the same tokens (an MoE sublayer runs whole on each: framework.parallel.tensor)
    and pp ranks the same micro batch at other layers, so neither is in it. What an MoE model sums
    over to see the step's whole batch (framework.models.moe.load_balancing_loss, the sigmoid
    routers' bias update). Collective on first use of a mesh: every rank calls it."""
    axes = (*DP_AXES, MeshAxis.cp)
    names = tuple(a for a in plan.mesh_axes if MeshAxis(a) in axes)
    sizes = [plan.mesh_shape[plan.mesh_axes.index(n)] for n in names]
    if math.prod(sizes) == 1:
        return None
    names = tuple(n for n, s in zip(names, sizes, strict=True) if s > 1)
    if len(names) == 1:
        return mesh[names[0]].get_group()
    sub = mesh if names == tuple(mesh.mesh_dim_names or ()) else mesh[names]
    return sub._flatten(TOKENS).get_group()
