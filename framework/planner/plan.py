"""The plan: every derived number of a run, computed once from the config before any process starts.

``make_plan(cfg)`` is pure (no process group, no model, no device) and deterministic, so the same plan
is printed by the launcher, written to ``plan.json``, checked by the dry run against the real sharded
model, and compared across runs. It refuses what cannot work with a ``ValueError`` that names the bad
value, the reason and a fix; the trainer catches it before launching ranks.

The layout is a set of parallel degrees (framework.planner.layout): fixed by ``parallel.*`` or a named
``sharding`` preset, or searched (``sharding=auto``, framework.planner.search, which evaluates candidates
with ``plan_for``). Every branch here reads the degrees, never a strategy name. Each plan carries
its predicted step time (framework.planner.cost), so a forced layout can be compared with the search's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from framework.config.schema import (
    ActivationCheckpointing,
    CompileScope,
    Config,
    DType,
    ExecutorMode,
)
from framework.models import model_spec
from framework.planner import stages as pipeline_stages
from framework.planner.comm import axis_is_intra_node, bucket_plan, step_comm
from framework.planner.cost import CommEstimate, StepPrediction, predict_step
from framework.planner.layout import (
    Degrees,
    MeshAxis,
    Placement,
    async_tp_on,
    axis_placement,
    check_cp,
    check_degrees,
    divisors,
    fixed_degrees,
    loss_parallel_on,
    num_experts,
)
from framework.planner.memory import (
    MemoryEstimate,
    budget_of,
    check_fits,
    offloaded_activation_bytes,
    rank_memory,
    runs_on_cpu,
    whole_model_backward,
)
from framework.planner.params import (
    GIB,
    MASTER_BYTES,
    ParamSpec,
    fsdp_units,
    param_specs,
    rank_specs,
    sum_local,
    tied_copy,
)
from framework.planner.pipeline import plan_pipeline, send_recv, tied_weight_comm


@dataclass(frozen=True)
class Plan:
    world_size: int
    nodes: int
    procs_per_node: int
    strategy: str  # the layout's name, from its degrees (Degrees.name): ddp, fsdp, hsdp_tp, ...
    degrees: dict[str, int]  # dp_replicate, dp_shard, cp, tp, pp
    mesh_shape: tuple[int, ...]
    mesh_axes: tuple[str, ...]
    placement: tuple[Placement, ...]  # where each mesh axis lands on the topology
    dp_degree: int
    tp_degree: int
    micro_batch_size: int
    global_batch_size: int
    grad_accum_steps: int
    seq_len: int
    num_params: int
    params_per_rank: int
    activation_checkpointing: str
    memory: MemoryEstimate
    comm: tuple[CommEstimate, ...]
    comm_time_s: float
    bucket_cap_mb: float
    bucket_reason: str
    bucket_sizes: tuple[int, ...]  # bytes; DDP buckets in gradient order, or FSDP units (blocks, root)
    prediction: StepPrediction
    warnings: tuple[str, ...]
    # Pipeline (pp > 1; framework.planner.stages): the schedule, its micro batches, the virtual stages per
    # rank, each stage's [start, stop) blocks (split by the per-layer cost model), the stages each pp
    # rank holds, and the bubble as a fraction of the busiest rank's compute.
    pp_schedule: str = ""
    pp_microbatches: int = 0
    pp_stages_per_rank: int = 1
    pp_split: tuple[tuple[int, int], ...] = ()
    pp_ranks: tuple[tuple[int, ...], ...] = ()
    pp_bubble: float = 0.0
    # Loss parallelism (``parallel.loss_parallel`` under tp > 1, framework.parallel.tensor): the
    # logits stay sharded over the vocabulary on each TP rank. False without TP, or when turned off.
    loss_parallel: bool = False
    # Async TP (``parallel.async_tp`` under tp > 1): the TP collectives fused with their matmuls.
    async_tp: bool = False
    # sharding.activation_memory_budget under activation_checkpointing=budget (None under any other
    # mode): the value the compiler's partitioner gets, chosen by the search under auto.
    activation_memory_budget: float | None = None

    @property
    def layout(self) -> Degrees:
        return Degrees(**self.degrees)

    def axis_size(self, axis: MeshAxis) -> int:
        return self.mesh_shape[self.mesh_axes.index(axis.value)] if axis.value in self.mesh_axes else 1


def check_mesh(cfg: Config) -> None:
    shape = list(cfg.mesh.shape)
    if not shape or any(s < 1 for s in shape):
        raise ValueError(
            f"mesh.shape={shape} is not valid: use [procs] for one node or [nodes, procs_per_node, ...], "
            f"all sizes >= 1"
        )


def _check_executor(cfg: Config, d: Degrees) -> None:
    """Refuse compile combinations that fail (or hang) on torch 2.13, found by the parallel tests."""
    ac = cfg.sharding.activation_checkpointing
    budget = cfg.sharding.activation_memory_budget
    if ac == ActivationCheckpointing.budget and not 0.0 <= budget <= 1.0:
        raise ValueError(
            f"sharding.activation_memory_budget={budget}: a fraction of the compiled default's saved "
            f"activations, valid values are 0.0 (recompute all it can) to 1.0 (recompute nothing extra)"
        )
    if ac == ActivationCheckpointing.selective_op and num_experts(cfg.model):
        raise ValueError(
            f"sharding.activation_checkpointing=selective_op with model.moe.num_experts="
            f"{num_experts(cfg.model)}: the planner counts what the per-op policy keeps for a dense "
            f"block only (framework.models.parts.layout.op_saved_values); use "
            f"sharding.activation_checkpointing=selective|full|none"
        )
    if cfg.executor.mode == ExecutorMode.eager:
        if ac == ActivationCheckpointing.budget:
            raise ValueError(
                "sharding.activation_checkpointing=budget with executor.mode=eager: the budget is "
                "enforced by the compiler's partitioner; use executor=compile (or cudagraphs), or "
                "sharding.activation_checkpointing=selective|full"
            )
        return
    tp = d.tp
    if (
        cfg.executor.scope == CompileScope.model
        and tp > 1
        and ac
        not in (ActivationCheckpointing.none, ActivationCheckpointing.budget, ActivationCheckpointing.auto)
    ):
        raise ValueError(
            f"executor.scope=model with sharding.tp={tp} and sharding.activation_checkpointing="
            f"{ac.value}: a checkpoint inside a compiled TP graph saves a DeviceMesh that AOTAutograd "
            f"refuses (torch 2.13); use executor.scope=block (checkpointing then wraps each compiled "
            f"block) or sharding.activation_checkpointing=none"
        )
    if cfg.executor.scope == CompileScope.model and not cfg.executor.compile_loss:
        raise ValueError(
            "executor.compile_loss=false with executor.scope=model: the loss head is part of the "
            "model's one compiled region; use executor.scope=block to leave the head eager"
        )
    if cfg.executor.scope == CompileScope.model and d.fsdp:
        raise ValueError(
            f"executor.scope=model with an FSDP layout ({d.name()}: {d.short()}): FSDP2's per-block hooks "
            f"are Dynamo graph breaks (torch._dynamo.disable), so no full graph spans the model; "
            f"use executor.scope=block, which compiles exactly the regions between those hooks"
        )


def _check_async_tp(cfg: Config, d: Degrees) -> None:
    """``parallel.async_tp`` is an Inductor pass over symmetric memory (CUDA, NCCL): refuse it where
    nothing would compile it (eager) or where it cannot run (a CPU launch; a dry run plans it for the
    declared hardware)."""
    if not (cfg.parallel.async_tp and d.tp > 1):
        return
    if cfg.executor.mode is ExecutorMode.eager:
        raise ValueError(
            f"parallel.async_tp=true with executor.mode=eager (tp={d.tp}): the fused all-gather/matmul "
            "and matmul/reduce-scatter are Inductor's rewrite of a compiled graph; valid: executor=compile "
            "(or cudagraphs), or parallel.async_tp=false"
        )
    cpu = cfg.mesh.hardware.device_type == "cpu" if cfg.run.dry_run else runs_on_cpu(cfg)
    if cpu:
        where = f"mesh/hardware={cfg.mesh.hardware.name}" if cfg.run.dry_run else "a CPU launch (gloo)"
        raise ValueError(
            f"parallel.async_tp=true on {where}: async TP needs CUDA devices and NCCL (symmetric memory); "
            "valid: parallel.async_tp=false, or a CUDA run (a dry run: a GPU mesh/hardware profile)"
        )


def _check_in_backward(cfg: Config, accum: int) -> None:
    """``train.optimizer_in_backward`` steps each parameter from its gradient hook: refuse what that breaks."""
    if not cfg.train.optimizer_in_backward:
        return
    world = cfg.mesh.world_size
    if world > 1:
        raise ValueError(
            f"train.optimizer_in_backward=true on mesh.shape={list(cfg.mesh.shape)} (world {world}): the "
            f"per-parameter step fires before DDP/FSDP/TP reduce that gradient across ranks; use it on "
            f"one device (mesh=1), or keep it off and let sharding=fsdp shard the gradients instead"
        )
    if accum > 1:
        raise ValueError(
            f"train.optimizer_in_backward=true with {accum} micro-batches per step "
            f"(train.global_batch_size={cfg.train.global_batch_size}, train.micro_batch_size="
            f"{cfg.train.micro_batch_size}): the step happens in the first backward; set "
            f"train.micro_batch_size={cfg.train.global_batch_size} (or 0)"
        )
    if cfg.train.grad_clip > 0:
        raise ValueError(
            f"train.optimizer_in_backward=true with train.grad_clip={cfg.train.grad_clip}: a global "
            f"gradient-norm clip needs every gradient before the first step; set train.grad_clip=0 "
            f"(the norm is still logged) or train.optimizer_in_backward=false"
        )


def _check_batch(cfg: Config, dp: int) -> int:
    gbs, mbs = cfg.train.global_batch_size, cfg.train.micro_batch_size
    if mbs < 1 or gbs < 1 or gbs % (dp * mbs):
        per_dp = gbs // dp if gbs % dp == 0 else None
        micro_ok = divisors(per_dp) if per_dp else []
        step = dp * max(mbs, 1)
        raise ValueError(
            f"train.global_batch_size={gbs} is not divisible by dp_degree ({dp}) x "
            f"train.micro_batch_size ({mbs}) = {dp * mbs}: use a global batch size in "
            f"{[step * k for k in range(1, 5)]}..."
            + (f" or a micro batch size in {micro_ok}" if micro_ok else "")
        )
    return gbs // (dp * mbs)


def with_degrees(cfg: Config, d: Degrees) -> Config:
    """``cfg`` with its layout written as explicit ``parallel.*`` degrees (what config.yaml records)."""
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **dataclasses.asdict(d)))


def needs_search(cfg: Config) -> bool:
    """Whether the planner chooses part of the layout: the degrees (``sharding=auto`` without
    ``parallel.*``) or the activation checkpointing (``sharding.activation_checkpointing=auto``)."""
    return fixed_degrees(cfg) is None or cfg.sharding.activation_checkpointing == ActivationCheckpointing.auto


def explicit_degrees_equal(cfg: Config, d: Degrees) -> bool:
    return all(getattr(cfg.parallel, k) == v for k, v in dataclasses.asdict(d).items())


def plan_for(cfg: Config, d: Degrees, *, check_memory: bool = True) -> Plan:
    """The plan of one concrete layout: ``cfg`` has a micro batch and an activation checkpointing
    mode; ``d`` are its degrees. ``check_memory=False`` (the search) reports a layout that does not
    fit instead of refusing it."""
    check_mesh(cfg)
    warnings: list[str] = []
    world = cfg.mesh.world_size
    assert d.world_size == world, (d, cfg.mesh.shape)
    check_degrees(d, cfg.model, world)
    check_cp(d, cfg, runs_on_cpu(cfg))
    axes_sizes = d.axes()
    axes = tuple(a for a, _ in axes_sizes)
    sizes = tuple(n for _, n in axes_sizes)
    placement = axis_placement(sizes, tuple(a.value for a in axes), cfg.mesh)
    size = dict(zip(axes, sizes, strict=True))
    tp, dp, shard = d.tp, d.dp, d.fsdp_shard
    _check_executor(cfg, d)
    _check_async_tp(cfg, d)
    pipeline_stages.check_pipeline(cfg, d.pp, dp)
    accum = _check_batch(cfg, dp)
    _check_in_backward(cfg, accum)
    warnings += _layout_warnings(cfg, d, sizes, axes)
    # Fields of another option (activation_memory_budget without budget, executor.autotune or
    # cache_dir on eager) are refused before launch: framework.launch.rules.check_option_fields.
    specs = param_specs(cfg.model, d.ep)
    num_params = model_spec(cfg.model).numel[0]
    pipe = plan_pipeline(cfg, d, specs, tp, shard, accum) if d.pp > 1 else None
    if pipe is not None:  # the busiest pp rank's parameters, blocks and activations
        specs, memory = pipe.specs, pipe.memory
        units = fsdp_units(specs, tp)
    else:
        units = fsdp_units(specs, tp)
        held = pipeline_stages.held_for_step(cfg, d.pp)
        memory = rank_memory(cfg, specs, tp, shard, units, ddp=d.ddp, accum=accum, cp=d.cp, held=held)

    cap, reason, buckets = bucket_plan(cfg, d, specs, units, sizes, size, warnings)
    held = pipeline_stages.held_for_step(cfg, d.pp)
    comm = step_comm(cfg, specs, sizes, axes, accum, len(buckets), units, d.ddp, pipe and pipe.layers, held)
    if pipe is not None:
        comm.append(send_recv(cfg, d, sizes, axes, accum))
        comm += tied_weight_comm(cfg, d, sizes, axes, pipe.ranks)
    prediction = predict_step(
        cfg,
        d,
        comm,
        accum,
        units,
        pipeline=(pipe.fraction, pipe.bubble) if pipe is not None else None,
        local_params=sum_local(specs, tp, shard),
        offload_bytes=offloaded_activation_bytes(cfg, tp, d.cp) if cfg.sharding.activation_offload else 0,
    )
    if check_memory and memory.total > memory.device and not (cfg.run.dry_run or cfg.run.allow_over_memory):
        _check_held_fits(cfg, d, memory)
    check_fits(cfg, d, memory, check_memory, warnings)
    return Plan(
        world_size=world,
        nodes=cfg.mesh.nodes,
        procs_per_node=cfg.mesh.procs_per_node,
        strategy=d.name(),
        degrees=dataclasses.asdict(d),
        mesh_shape=sizes,
        mesh_axes=tuple(a.value for a in axes),
        placement=placement,
        dp_degree=dp,
        tp_degree=tp,
        micro_batch_size=cfg.train.micro_batch_size,
        global_batch_size=cfg.train.global_batch_size,
        grad_accum_steps=accum,
        seq_len=cfg.train.seq_len,
        num_params=num_params,
        params_per_rank=sum_local(specs, tp, shard),  # the busiest pp rank's
        activation_checkpointing=cfg.sharding.activation_checkpointing.value,
        memory=memory,
        comm=tuple(comm),
        comm_time_s=sum(c.time_s for c in comm),
        bucket_cap_mb=cap,
        bucket_reason=reason,
        bucket_sizes=tuple(buckets),
        prediction=prediction,
        warnings=tuple(warnings),
        **(pipe.fields() if pipe is not None else {}),
        loss_parallel=loss_parallel_on(cfg, tp),
        async_tp=async_tp_on(cfg, tp),
        activation_memory_budget=budget_of(cfg),
    )


def _layout_warnings(
    cfg: Config, d: Degrees, sizes: tuple[int, ...], axes: tuple[MeshAxis, ...]
) -> list[str]:
    """What runs but is probably not what the user meant: TP over nodes, settings that do nothing."""
    warnings: list[str] = []
    tp = d.tp
    if tp > 1 and not axis_is_intra_node(sizes, axes.index(MeshAxis.tp), cfg.mesh.procs_per_node):
        warnings.append(
            f"tp axis (size {tp}) spans nodes (procs per node {cfg.mesh.procs_per_node}): TP runs over "
            f"the inter-node link; use a tp degree that divides {cfg.mesh.procs_per_node}"
        )
    if cfg.train.optimizer_in_backward and whole_model_backward(cfg):
        warnings.append(
            "train.optimizer_in_backward with executor.scope=model: the one compiled backward hands "
            "out every gradient at once, so no gradient memory is saved and no update overlaps the "
            "backward; use executor.scope=block"
        )
    if cfg.parallel.async_tp and tp == 1:
        warnings.append("parallel.async_tp=true does nothing without tensor parallelism (tp=1)")
    if not cfg.parallel.loss_parallel and tp == 1:
        warnings.append(
            "parallel.loss_parallel=false does nothing without tensor parallelism (tp=1): every rank "
            "holds the whole vocabulary's logits either way"
        )
    if cfg.sharding.strategy.value == "hsdp" and cfg.mesh.nodes == 1 and fixed_degrees(cfg) == d:
        warnings.append("sharding=hsdp on one node has dp_replicate=1: it is fsdp")
    if not d.fsdp and (
        cfg.sharding.param_dtype != DType.float32 or cfg.sharding.reduce_dtype != DType.float32
    ):
        warnings.append(
            f"sharding.param_dtype / reduce_dtype are ignored without FSDP ({d.name()}; FSDP2 mixed "
            f"precision only)"
        )
    return warnings


def _check_held_fits(cfg: Config, d: Degrees, memory: MemoryEstimate) -> None:
    """Refuse ``sharding.reshard_after_forward=false`` where the units it holds unsharded for the
    step are what does not fit: the layout resharding after each forward fits. One line with the
    memory per rank each policy needs against the device's. Not for a zero-bubble schedule (it
    holds its units whatever the setting: framework.planner.stages.held_for_step) or a layout
    without FSDP sharding (the setting changes nothing there); a layout too large either way gets
    ``check_fits``'s refusal."""
    if cfg.sharding.reshard_after_forward or d.fsdp_shard == 1:
        return
    if d.pp > 1 and cfg.parallel.pp_schedule in pipeline_stages.ZERO_BUBBLE:
        return
    resharded = dataclasses.replace(
        cfg, sharding=dataclasses.replace(cfg.sharding, reshard_after_forward=True)
    )
    other = plan_for(resharded, d, check_memory=False).memory
    if other.total > other.device:
        return
    device = cfg.mesh.hardware.memory_gib
    raise ValueError(
        f"sharding.reshard_after_forward=false holds {d.short()}'s FSDP units unsharded for the step: "
        f"needs {memory.total / GIB:.1f} GiB per rank (of it FSDP units held unsharded for the step "
        f"{memory.comm_buffers / GIB:.1f}), device has {device:g} (mesh.hardware.memory_gib, "
        f"mesh.hardware.name={cfg.mesh.hardware.name}); valid here: sharding.reshard_after_forward=true "
        f"({other.total / GIB:.1f} GiB per rank: each unit gathered per micro batch), or "
        f"run.allow_over_memory=true to launch anyway"
    )


def pp_rank_specs(cfg: Config, plan: Plan, pp_rank: int) -> list[ParamSpec]:
    """The parameters pipeline rank ``pp_rank`` holds (its stages'); every one without a pipeline."""
    if plan.layout.pp == 1:
        return param_specs(cfg.model, plan.layout.ep)
    return rank_specs(
        param_specs(cfg.model, plan.layout.ep),
        plan.pp_split,
        list(plan.pp_ranks[pp_rank]),
        tied_copy(cfg.model),
    )


def pp_rank_param_bytes(cfg: Config, plan: Plan, pp_rank: int) -> int:
    """Bytes of the parameter shards one rank of pipeline rank ``pp_rank`` holds (its stages'), as
    ``MemoryEstimate.params`` counts them; the dry run measures pp rank 0 against it."""
    mine = pp_rank_specs(cfg, plan, pp_rank)
    shard = plan.degrees["dp_shard"] * plan.degrees["cp"]  # FSDP2 shards over dp_shard x cp
    return sum_local(mine, plan.tp_degree, shard) * MASTER_BYTES


def check_world_size(plan: Plan, world_size: int) -> None:
    """Refuse a launch whose real world size is not the one the plan's mesh was made for."""
    if world_size != plan.world_size:
        raise ValueError(
            f"world size {world_size} != product of mesh {list(plan.mesh_shape)} = {plan.world_size}: "
            f"launch {plan.world_size} processes or pick a mesh whose shape multiplies to {world_size}"
        )
