"""Parallel degrees: what a layout is (dp_replicate x dp_shard x cp x tp x pp) and where its axes land.

A layout is five integers whose product is the world size, never a strategy name: the planner, the
mesh and ``parallelize`` read the degrees. The named presets of the ``sharding`` group
(``ddp|fsdp|hsdp|tp|fsdp_tp``) are shorthands for degrees (``PRESETS``), kept so old command lines
work; explicit ``parallel.*`` degrees win over a preset; ``sharding=auto`` leaves the degrees to the
search (framework.planner.search).

Mesh axes are ordered pp, dp_replicate, dp_shard, cp, tp, outermost first (as torchtitan's
ParallelDims). Global ranks are row-major over the mesh, so the last axis groups consecutive ranks:
with processes per node a multiple of tp, every TP group lies inside a node (NVLink) and
dp_replicate, the outermost data axis, spans nodes, where its one all-reduce per step is cheapest.
``axis_placement`` says, for each axis, whether its groups stay in a node or how many nodes they
span; the planner prints it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from framework.config.schema import CompileScope, Config, ExecutorMode, MeshConfig, ModelConfig, Strategy


class MeshAxis(Enum):
    """Named mesh axes ("axis" names a mesh axis, "dim" a tensor dimension), outermost first."""

    pp = "pp"
    dp_replicate = "dp_replicate"
    dp_shard = "dp_shard"
    cp = "cp"
    tp = "tp"


DP_AXES = (MeshAxis.dp_replicate, MeshAxis.dp_shard)
DEGREE_NAMES = tuple(a.value for a in MeshAxis)


@dataclass(frozen=True)
class Degrees:
    """One layout. Each degree >= 1; the product is the world size."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    # Expert parallelism: not a factor of the world size but a split of dp_shard (its inner ``ep``
    # ranks hold different experts; ``dp_shard_mod_ep`` = dp_shard / ep replicas of each), as
    # torchtitan's ParallelDims borrows ep from dp_shard. framework.parallel.mesh.expert_meshes.
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many ways the global batch is split."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> bool:
        """FSDP2 wraps the model: it shards (dp_shard > 1), or it replicates TP-sharded DTensor
        parameters across dp_replicate (HSDP with a dp_shard axis of size 1: DDP cannot wrap
        DTensors), replicates pipeline stages (the schedule syncs FSDP's gradients per stage), or CP
        is on (the CP ranks hold the same parameters and must average their gradients: FSDP2 shards
        over dp_shard x cp, as torchtitan does)."""
        return self.dp_shard > 1 or self.cp > 1 or (self.dp_replicate > 1 and (self.tp > 1 or self.pp > 1))

    @property
    def fsdp_shard(self) -> int:
        """Ranks one FSDP2 group shards parameters over: dp_shard x cp (the flattened mesh axes)."""
        return self.dp_shard * self.cp

    @property
    def expert_shard(self) -> int:
        """Ranks FSDP2 shards each expert's weights over: dp_shard x cp / ep (dp_shard_mod_ep)."""
        return max(1, self.fsdp_shard // self.ep)

    @property
    def ddp(self) -> bool:
        """DDP wraps the model: replicas without sharding or TP."""
        return self.dp_replicate > 1 and not self.fsdp

    def axes(self) -> tuple[tuple[MeshAxis, int], ...]:
        """The mesh's (axis, size) outermost first: axes of size 1 are left out, except dp_shard
        under FSDP (its mesh must name it) and, on one rank, dp_replicate (a mesh needs an axis)."""
        out = []
        for axis in MeshAxis:
            size = getattr(self, axis.value)
            if size > 1 or (axis == MeshAxis.dp_shard and self.fsdp):
                out.append((axis, size))
        return tuple(out) or ((MeshAxis.dp_replicate, 1),)

    def name(self) -> str:
        """Human name from the degrees: ``ddp``, ``fsdp``, ``hsdp``, ``tp``, ``fsdp_tp``, ``hsdp_tp``, ``single``."""
        shard = self.fsdp_shard  # with CP, FSDP2 shards over dp_shard x cp
        data = (
            "hsdp"
            if self.dp_replicate > 1 and shard > 1
            else "fsdp"
            if shard > 1
            else "ddp"
            if self.dp_replicate > 1
            else ""
        )
        parts = [p for p in (data, "tp" if self.tp > 1 else "", "cp" if self.cp > 1 else "") if p]
        parts += ["pp"] if self.pp > 1 else []
        parts += ["ep"] if self.ep > 1 else []
        return "_".join(parts) or "single"

    def short(self) -> str:
        """``r2 s2 t2`` style, for tables."""
        return " ".join(
            f"{k}{getattr(self, n)}" for k, n in (("r", "dp_replicate"), ("s", "dp_shard"), ("t", "tp"))
        ) + "".join(
            f" {k}{getattr(self, n)}"
            for k, n in (("c", "cp"), ("p", "pp"), ("e", "ep"))
            if getattr(self, n) > 1
        )


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in ascending order, found up to sqrt(n) (a world size or batch of 2**20
    counted one by one took seconds in each of several searches)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0] if n > 0 else []
    return small + [n // d for d in reversed(small) if d * d != n]


def explicit(cfg: Config) -> bool:
    """True when the user set any ``parallel.*`` degree (they then are the layout)."""
    p = cfg.parallel
    return any(getattr(p, n) != 0 for n in (*DEGREE_NAMES, "ep"))


def from_parallel(cfg: Config) -> Degrees:
    """The ``parallel.*`` degrees: -1 (or an unset dp_shard) takes the rest, other unset ones are 1.

    Raises ValueError for a degree below -1, two ``-1``, a rest that is not whole, or degrees whose
    product is not the world size, naming the values and what would be valid.
    """
    p, world = cfg.parallel, cfg.mesh.world_size
    given = {n: getattr(p, n) for n in DEGREE_NAMES}
    for n, v in given.items():
        if v < -1:
            raise ValueError(f"parallel.{n}={v} is not valid: use a degree >= 1, -1 (the rest) or 0 (unset)")
    if given["dp_shard"] == 0 and -1 not in given.values():
        given["dp_shard"] = -1
    rest = [n for n, v in given.items() if v == -1]
    if len(rest) > 1:
        raise ValueError(
            f"parallel.{rest[0]}=-1 and parallel.{rest[1]}=-1: only one degree may take the rest of "
            f"the world size {world}"
        )
    fixed = {n: (v if v > 0 else 1) for n, v in given.items() if v != -1}
    prod = math.prod(fixed.values())
    shown = " x ".join(f"parallel.{n}={v}" for n, v in given.items() if v not in (0, 1))
    if rest:
        if world % prod:
            raise ValueError(
                f"{shown} multiply to {prod}, which does not divide the world size "
                f"{world} (mesh.shape={list(cfg.mesh.shape)}): parallel.{rest[0]}=-1 cannot take the "
                f"rest; use degrees whose product divides {world} (divisors: {divisors(world)})"
            )
        fixed[rest[0]] = world // prod
    if p.ep < 0:
        raise ValueError(
            f"parallel.ep={p.ep} is not valid: use 0 or 1 (off) or a degree >= 2 that divides parallel.dp_shard"
        )
    d = Degrees(**fixed, ep=max(p.ep, 1))
    if d.world_size != world:
        raise ValueError(
            f"{shown or 'parallel degrees all 1'} multiply to {d.world_size}, not the world size {world} "
            f"(mesh.shape={list(cfg.mesh.shape)}): make their product {world}, or set one of them to -1 "
            f"(the rest)"
        )
    return d


def from_preset(cfg: Config) -> Degrees:
    """The degrees a named ``sharding`` preset stands for (``sharding.tp`` is the TP preset's degree).

    Raises ValueError as the presets always have: ``sharding.tp`` with a preset that has no TP,
    ``sharding=tp`` whose degree is not the world size, a TP degree that does not divide the world.
    """
    world, nodes, ppn = cfg.mesh.world_size, cfg.mesh.nodes, cfg.mesh.procs_per_node
    strategy, tp = cfg.sharding.strategy, cfg.sharding.tp
    assert strategy != Strategy.auto, "auto has no fixed degrees (framework.planner.search)"
    if strategy in (Strategy.ddp, Strategy.fsdp, Strategy.hsdp) and tp != 1:
        raise ValueError(
            f"sharding.tp={tp} has no effect with sharding.strategy={strategy.value}: "
            f"use sharding=fsdp_tp (or sharding=tp), or set sharding.tp=1"
        )
    if strategy == Strategy.ddp:
        return Degrees(dp_replicate=world)
    if strategy == Strategy.fsdp:
        return Degrees(dp_shard=world)
    if strategy == Strategy.hsdp:
        return Degrees(dp_replicate=nodes, dp_shard=ppn)
    if strategy == Strategy.tp:
        if tp != world:
            raise ValueError(
                f"sharding.strategy=tp needs sharding.tp == world size, got sharding.tp={tp} on "
                f"mesh.shape={list(cfg.mesh.shape)} (world {world}): set sharding.tp={world}, or use "
                f"sharding=fsdp_tp sharding.tp={tp} to add data parallelism"
            )
        return Degrees(tp=tp)
    assert strategy == Strategy.fsdp_tp
    if tp < 1 or world % tp:
        raise ValueError(
            f"sharding.tp={tp} does not divide the world size {world} (mesh.shape={list(cfg.mesh.shape)}): "
            f"valid values are {divisors(world)}"
        )
    return Degrees(dp_shard=world // tp, tp=tp)


# What each preset means, for the docs and --help (from_preset is the code).
PRESETS = {
    "ddp": "dp_replicate = world",
    "fsdp": "dp_shard = world",
    "hsdp": "dp_replicate = nodes, dp_shard = processes per node",
    "tp": "tp = sharding.tp = world",
    "fsdp_tp": "dp_shard = world / sharding.tp, tp = sharding.tp",
}


def fixed_degrees(cfg: Config) -> Degrees | None:
    """The layout the user fixed (explicit degrees win over a preset), or None under ``sharding=auto``.

    Raises ValueError (``check_degrees``) naming the key the user set, ``parallel.tp`` or ``sharding.tp``.
    """
    if explicit(cfg):
        d = from_parallel(cfg)
        check_degrees(d, cfg.model, cfg.mesh.world_size, "parallel.tp")
        return d
    if cfg.sharding.strategy == Strategy.auto:
        return None
    d = from_preset(cfg)
    check_degrees(d, cfg.model, cfg.mesh.world_size, "sharding.tp")
    return d


def check_degrees(d: Degrees, model: ModelConfig, world: int, tp_key: str = "parallel.tp") -> None:
    """Refuse what the model or this version cannot run: pp above the number of blocks, a TP degree
    that does not split the heads, the KV heads and the FFN evenly (the rest of the pipeline's
    rules: framework.planner.stages.check_pipeline; CP's: check_cp)."""
    if d.pp > model.n_layers:
        raise ValueError(
            f"parallel.pp={d.pp} is greater than model.n_layers={model.n_layers}: each pipeline stage "
            f"needs at least one block; valid: parallel.pp <= {model.n_layers}"
        )
    check_ep(d, model)
    tp = d.tp
    for field_name, value in (
        ("n_heads", model.n_heads),
        ("n_kv_heads", model.n_kv_heads),
        ("ffn_dim", model.ffn_dim),
    ):
        if value % tp:
            valid = [
                t
                for t in divisors(world)
                if model.n_heads % t == 0 and model.n_kv_heads % t == 0 and model.ffn_dim % t == 0
            ]
            raise ValueError(
                f"{tp_key}={tp} does not divide model.{field_name}={value}: each TP rank needs whole "
                f"heads and an equal FFN slice; valid TP degrees here are {valid}"
            )


def check_ep(d: Degrees, model: ModelConfig) -> None:
    """Refuse an expert-parallel degree this layout cannot run. The ep ranks are borrowed from
    dp_shard (torchtitan's choice: every ep rank is also a data-parallel rank, reading its own batch,
    so ep costs no extra ranks and the dense part stays sharded over all of dp_shard), hence ep
    divides dp_shard. CP is not combined with ep here (torchtitan folds cp into ep; this version
    does not). ep must also divide the model's number of experts (a dense model, which has none, is
    refused before launch: ``check_dense_ep``; a test may run ep on a decoder it built with MoE
    blocks from a dense config)."""
    if d.ep <= 1:
        return
    if d.dp_shard % d.ep:
        valid = [
            e for e in divisors(d.dp_shard) if e > 1
        ] or "none (parallel.dp_shard=1: set it to a multiple of ep)"
        raise ValueError(
            f"parallel.ep={d.ep} does not divide parallel.dp_shard={d.dp_shard}: the ep ranks are "
            f"borrowed from dp_shard (dp_shard = dp_shard_mod_ep x ep); valid ep here: {valid}"
        )
    if d.cp > 1:
        raise ValueError(
            f"parallel.ep={d.ep} with parallel.cp={d.cp}: expert parallelism does not compose with "
            f"context parallelism in this version; valid: parallel.ep=1 or parallel.cp=1"
        )
    experts = num_experts(model)
    if experts and experts % d.ep:
        valid = [e for e in divisors(experts) if d.dp_shard % e == 0]
        raise ValueError(
            f"parallel.ep={d.ep} does not divide model.moe.num_experts={experts}: valid ep here are {valid}"
        )


def async_tp_on(cfg: Config, tp: int) -> bool:
    """Whether TP's sequence-parallel collectives run fused with their matmuls (``parallel.async_tp``
    under tp > 1: framework.parallel.tensor.enable_async_tp)."""
    return tp > 1 and cfg.parallel.async_tp


def loss_parallel_on(cfg: Config, tp: int) -> bool:
    """Whether each TP rank keeps only its vocabulary shard of the logits (``parallel.loss_parallel``
    under tp > 1, framework.models.parts.loss); without TP every rank holds them whole anyway."""
    return tp > 1 and cfg.parallel.loss_parallel


def loss_head_compiled(cfg: Config) -> bool:
    """Whether the loss head (final norm, output projection, cross-entropy) runs compiled: inside the
    model's region (``executor.scope=model``) or as its own (``scope=block`` with
    ``executor.compile_loss``, framework.parallel.compile); eager otherwise."""
    if cfg.executor.mode is ExecutorMode.eager:
        return False
    return cfg.executor.scope is CompileScope.model or cfg.executor.compile_loss


def num_experts(model: ModelConfig) -> int:
    """The routed experts per MoE layer (``model.moe.num_experts``); 0: a dense model, as every
    model config without the MoE keys is."""
    return int(getattr(getattr(model, "moe", None), "num_experts", 0) or 0)


def ep_shards_experts(model: ModelConfig) -> bool:
    """Whether ``parallel.ep`` can shard the model's experts: a sparse family whose record allows it."""
    from framework.models import family

    return bool(num_experts(model)) and family(model).expert_parallel


def check_dense_ep(d: Degrees, model: ModelConfig) -> None:
    """Refuse ``parallel.ep`` on a dense model before launch: it has no experts to shard; and on a
    family whose experts expert parallelism does not run (GPT-OSS's)."""
    if d.ep > 1 and num_experts(model) and not ep_shards_experts(model):
        raise ValueError(
            f"parallel.ep={d.ep} with model.family={model.family.value}: expert parallelism does not run "
            f"this family's experts yet (its own MoE layer: biases, the clamped SwiGLU); valid: parallel.ep=1 "
            f"(FSDP shards the stacked experts)"
        )
    if d.ep > 1 and num_experts(model) == 0:
        raise ValueError(
            f"parallel.ep={d.ep} with model.family={model.family.value}, a dense model "
            f"(model.moe.num_experts=0): it has no experts to shard; valid: parallel.ep=1 (or 0), or a "
            f"sparse family (model.moe.num_experts > 0)"
        )


# torch's context_parallel dispatches SDPA's flash / efficient / cuDNN kernels to ring attention;
# these are CUDA kernels. On the CPU, SDPA runs aten._scaled_dot_product_flash_attention_for_cpu,
# for which DTensor has no sharding strategy (torch 2.13: "Operator aten._scaled_dot_product_flash_
# attention_for_cpu.default does not have a sharding strategy registered").
CP_CPU_ERROR = (
    "torch's context_parallel (ring attention) runs only SDPA's CUDA kernels (flash, memory-efficient, "
    "cuDNN); on the CPU, SDPA's kernel aten._scaled_dot_product_flash_attention_for_cpu has no "
    "DTensor sharding strategy in torch {version}"
)


def check_cp(d: Degrees, cfg: Config, on_cpu: bool) -> None:
    """Refuse a CP degree that cannot run: one whose load-balanced shards (2 x cp chunks of the
    sequence, rank i holding chunks i and 2cp-1-i, so causal work is equal) do not split
    ``train.seq_len``, a launch with a pipeline (its schedule runs the micro batches; a dry run
    plans cp x pp), document masks (ring
    attention takes no attention mask), masked targets
    (data=sft: the CP ranks' losses would not average to the batch mean), and CP on a CPU
    launch (``CP_CPU_ERROR``; a dry run plans it for any device)."""
    if d.cp <= 1:
        return
    seq = cfg.train.seq_len
    if seq % (2 * d.cp):
        valid = [c for c in divisors(cfg.mesh.world_size) if seq % (2 * c) == 0]
        raise ValueError(
            f"parallel.cp={d.cp} does not split train.seq_len={seq}: load-balanced causal context "
            f"parallelism cuts the sequence into 2 x cp = {2 * d.cp} equal chunks; valid cp degrees "
            f"here are {valid} (or a train.seq_len that is a multiple of {2 * d.cp})"
        )
    if cfg.data.document_mask:
        raise ValueError(
            f"parallel.cp={d.cp} with data.document_mask=true: ring attention takes no attention mask; "
            f"set data.document_mask=false or parallel.cp=1"
        )
    if d.pp > 1 and not cfg.run.dry_run:
        raise ValueError(
            f"parallel.cp={d.cp} with parallel.pp={d.pp} is planned (run.dry_run=true) but cannot be "
            f"launched: the pipeline schedule runs its micro batches itself, outside the per-micro-batch "
            f"sequence sharding; use parallel.cp=1 or parallel.pp=1, or run.dry_run=true to plan it"
        )
    if cfg.data.source.value == "sft":
        raise ValueError(
            f"parallel.cp={d.cp} with data=sft: each CP rank's loss is the mean over its own shard's "
            f"trained (unmasked) targets, which differ in number, so their average is not the batch's "
            f"mean; use parallel.cp=1 for fine-tuning"
        )
    if on_cpu and not cfg.run.dry_run:
        import torch

        raise ValueError(
            f"parallel.cp={d.cp} on the CPU: "
            + CP_CPU_ERROR.format(version=torch.__version__)
            + "; valid here: parallel.cp=1, or run.dry_run=true to plan it, or run on CUDA devices"
        )


@dataclass(frozen=True)
class Placement:
    """Where one mesh axis lands on the declared topology."""

    axis: str
    size: int
    stride: int  # rank distance between neighbours on this axis
    nodes_spanned: int  # nodes one group of this axis touches
    intra_node: bool

    def describe(self) -> str:
        if self.size == 1:
            return "size 1 (no communication)"
        if self.intra_node:
            return "inside a node (intra-node link)"
        return f"across {self.nodes_spanned} nodes (inter-node link)"


def axis_placement(sizes: tuple[int, ...], names: tuple[str, ...], mesh: MeshConfig) -> tuple[Placement, ...]:
    """Each axis's stride and how many nodes one of its groups spans (row-major ranks; a node holds
    ``procs_per_node`` consecutive ranks)."""
    ppn = mesh.procs_per_node
    out = []
    for i, (name, size) in enumerate(zip(names, sizes, strict=True)):
        stride = math.prod(sizes[i + 1 :])
        span = size * stride
        intra = size == 1 or (span <= ppn and ppn % span == 0)
        # A group covers ranks r, r+stride, ...: the nodes it touches.
        nodes = 1 if intra else min(size, max(1, span // ppn) if stride < ppn else size)
        out.append(Placement(name, size, stride, nodes, intra))
    return tuple(out)
