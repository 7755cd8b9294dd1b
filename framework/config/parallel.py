"""The ``mesh``, ``parallel``, ``sharding``, ``bucketing`` and ``nccl`` groups' schemas: the declared
topology and the layout over it (framework.planner, framework.parallel).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from framework.config.options import only_with


class Strategy(Enum):
    """A named layout preset: each sets the parallel degrees (``framework.planner.layout.PRESETS``).

    ``auto`` (the default): the planner searches the degrees, activation checkpointing and micro
    batch that fit the declared topology and picks the fastest (``framework.planner.search``). Explicit
    ``parallel.*`` degrees win over any preset.
    """

    auto = "auto"
    ddp = "ddp"
    fsdp = "fsdp"
    hsdp = "hsdp"
    tp = "tp"
    fsdp_tp = "fsdp_tp"


class ActivationCheckpointing(Enum):
    """``selective``: every other block; ``full``: every block (torch.utils.checkpoint);
    ``selective_op``: every block, per op (torchtitan's ``selective`` with ``selective_ac_option=op``):
    each block keeps every other matmul's output and attention's, and recomputes the rest;
    ``budget``: no checkpoint wrapper, the compiler's partitioner picks what to recompute so the
    saved activations stay under ``sharding.activation_memory_budget`` (compiled executors only);
    ``auto``: the planner picks none, selective, selective_op or full, and under a compiled executor
    budget at the largest activation_memory_budget that fits (the fastest that fits)."""

    none = "none"
    selective = "selective"
    selective_op = "selective_op"
    full = "full"
    budget = "budget"
    auto = "auto"


# Pipeline schedules (``parallel.pp_schedule``), each a torch.distributed.pipelining schedule
# (framework.parallel.pipeline.SCHEDULES). The functional form because ``1f1b`` is not an identifier
# and OmegaConf matches an Enum by member name: ``PPSchedule["1f1b"]``.
PPSchedule = Enum(
    "PPSchedule",
    [(n, n) for n in ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv")],
    module=__name__,
)


PPSchedule.__doc__ = (
    "gpipe: all forwards, then all backwards (holds every micro batch's activations); 1f1b: one "
    "forward, one backward (at most pp micro batches in flight); interleaved_1f1b: 1f1b over "
    "parallel.pp_stages_per_rank >= 2 virtual stages per rank (smaller bubble); interleaved_zb: "
    "interleaved with the weight gradients deferred into the bubble (zero bubble); zbv: zero bubble "
    "over exactly 2 stages per rank placed in a V"
)


class DType(Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


@dataclass
class HardwareConfig:
    """One device and the links between devices; used by the planner's memory and alpha-beta models."""

    name: str = "cpu"
    memory_gib: float = 24.0
    peak_tflops: float = 0.1  # dense bf16 (or fp32 on CPU), TFLOP/s
    intra_node_gbps: float = 5.0  # GB/s per device, one direction
    inter_node_gbps: float = 1.0
    intra_node_latency_us: float = 30.0
    inter_node_latency_us: float = 50.0
    numa_per_host: int = 1
    # Step-time model (framework.planner.cost); where each figure comes from is in the profile's YAML file.
    gemm_efficiency: float = 0.11  # fraction of peak_tflops the model's GEMMs and attention reach
    # A measured kernel table (conf/mesh/hardware/tables/NAME.json, benchmarks/kernel_tables.py): the
    # planner prices each GEMM, grouped GEMM and attention call at its own shape's rate from it and
    # gemm_efficiency goes unused; null: gemm_efficiency for every FLOP.
    kernel_table: Optional[str] = None
    hbm_gbps: float = 20.0  # memory bandwidth of the pointwise work and the optimizer step, GB/s
    # pinned host <-> device copies, GB/s one direction (sharding.activation_offload's transfers)
    host_link_gbps: float = 10.0
    link_efficiency: float = 0.08  # fraction of the link bandwidths a collective achieves
    comm_overlap: float = 0.0  # share of an FSDP/DDP collective over NVLink that its compute window hides
    inter_node_comm_overlap: float = 0.0  # the same over the network between nodes (framework.planner.overlap)
    # CUDA compute capability [major, minor] of the device, e.g. [9, 0] for Hopper; [] (no CUDA GPU)
    # for the CPU. A dry run checks the GPU-only options (float8, fa4, fused cross-entropy, CUDA
    # graphs) against it, not against the device of the host that plans.
    compute_capability: list[int] = field(default_factory=list)

    @property
    def device_type(self) -> str:
        """``cuda`` when the profile declares a compute capability, else ``cpu``."""
        return "cuda" if self.compute_capability else "cpu"

    @property
    def capability(self) -> tuple[int, int] | None:
        """``compute_capability`` as torch.cuda.get_device_capability gives it (None: not CUDA)."""
        cc = self.compute_capability
        return (cc[0], cc[1]) if cc else None


@dataclass
class MeshConfig:
    """Declared topology: ``shape`` is nodes x processes per node.

    ``[4]`` is one node of 4 processes; ``[2, 4]`` is 2 nodes of 4; with three or more entries the
    first is still the number of nodes and the rest multiply to the processes per node
    (``[2, 2, 2]`` = 2 nodes of 4). ``framework.planner.topology.validate_mesh`` checks the shape.
    """

    shape: list[int] = field(default_factory=lambda: [1])
    hardware: HardwareConfig = field(default_factory=HardwareConfig)

    @property
    def world_size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nodes(self) -> int:
        return self.shape[0] if len(self.shape) > 1 else 1

    @property
    def procs_per_node(self) -> int:
        return self.world_size // self.nodes


@dataclass
class ParallelConfig:
    """Parallel degrees over the mesh (framework.planner.layout). Their product is the world size.

    0 = not set: the layout then comes from ``sharding`` (a preset, or ``auto``: the planner's
    choice). Once any degree is set, these are the layout: an unset ``dp_shard`` takes the rest
    (as ``-1`` does for any one degree) and the other unset degrees are 1. Mesh axes are ordered
    pp, dp_replicate, dp_shard, cp, tp (outermost first), so tp groups consecutive ranks (inside a
    node) and dp_replicate spans nodes.
    """

    dp_replicate: int = 0  # replicas: gradients all-reduced (DDP, or HSDP's outer axis)
    dp_shard: int = 0  # FSDP2 shards parameters, gradients and optimizer state over this axis
    cp: int = 0  # context parallel: ring attention over sequence shards (CUDA; 2 x cp divides seq_len)
    tp: int = 0  # tensor parallel (Megatron-style with sequence parallelism), inside a node
    pp: int = 0  # pipeline stages (torch.distributed.pipelining), the outermost axis
    # Expert parallelism: each MoE layer's experts split over this many ranks, tokens moved by
    # all-to-all (framework.parallel.expert). Not a factor of the world size: the ep ranks are
    # borrowed from dp_shard (dp_shard = dp_shard_mod_ep x ep, as torchtitan's ParallelDims), so ep
    # divides dp_shard and model.moe.num_experts. 0 or 1 = off.
    ep: int = 0
    # The pipeline schedule (PPSchedule); interleaved_1f1b, interleaved_zb and zbv need
    # pp_stages_per_rank >= 2 (zbv: exactly 2).
    pp_schedule: PPSchedule = PPSchedule["1f1b"]
    # Micro batches per step that the schedule pipelines: 0 = the data-parallel rank's batch /
    # train.micro_batch_size when that is set (and gives >= pp), else pp (the fewest that fill the
    # pipeline). Each is train.micro_batch_size rows: micro_batch_size x pp_microbatches is the
    # data-parallel rank's share of the global batch (no other gradient accumulation under pp).
    pp_microbatches: int = 0
    # Virtual stages per rank (interleaving): the model is cut into pp x pp_stages_per_rank stages,
    # rank r holds stages r, r + pp, ... (zbv: r and 2 pp - 1 - r).
    pp_stages_per_rank: int = 1
    # Loss parallelism under tp > 1 (torchtitan's default; its training.disable_loss_parallel turns
    # it off): the output projection's logits stay sharded over the vocabulary on each TP rank and
    # the cross-entropy runs under torch's loss_parallel(), so no rank holds the full logits.
    # false: the logits are gathered to every TP rank (tp x the memory). No effect without TP.
    loss_parallel: bool = True
    # Async tensor parallelism under tp > 1 (torchtitan's enable_async_tensor_parallel): Inductor's
    # micro-pipeline TP pass (torch._inductor.config._micro_pipeline_tp) rewrites each sequence-parallel
    # all-gather + matmul and matmul + reduce-scatter into fused ops over symmetric memory that overlap
    # the collective with the matmul. Compiled executors on CUDA (NCCL) only; no effect without TP.
    async_tp: bool = False


@dataclass
class ShardingConfig:
    strategy: Strategy = Strategy.auto
    # TP degree of the fsdp_tp / tp presets; under auto, a value other than 1 pins the search's TP.
    tp: int = 1
    reshard_after_forward: bool = True
    param_dtype: DType = DType.float32
    reduce_dtype: DType = DType.float32
    # none for the named presets; the default sharding option, auto, sets auto (the planner picks).
    activation_checkpointing: ActivationCheckpointing = ActivationCheckpointing.none
    # With activation_checkpointing=budget: the fraction of the compiled default's saved
    # activations to keep (torch._functorch.config.activation_memory_budget; 0 ~ full AC, 1 = off).
    activation_memory_budget: float = only_with(
        "sharding.activation_checkpointing", ActivationCheckpointing.budget, default=0.5
    )
    # Keep each block's saved activations in pinned host memory until backward (saved-tensor hooks
    # that keep strides), instead of on the device; refused before launch when the host cannot hold
    # them.
    activation_offload: bool = False


@dataclass
class BucketingConfig:
    """Real DDP knobs (torch.nn.parallel.DistributedDataParallel arguments, same names and units)."""

    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = True
    static_graph: bool = True
    # Choose bucket_cap_mb from the planner's alpha-beta model of the data-parallel axis.
    auto: bool = False


@dataclass
class NcclConfig:
    """NCCL environment, applied in every rank's environment before the process group starts.

    ``framework.planner.topology.nccl_environment`` turns this into validated variables. A preset
    (conf/nccl/NAME.yaml) lists its variables in ``preset_env``; ``env`` adds or overrides
    variables for one run. The variables that a typed field owns (NCCL_SOCKET_IFNAME,
    NCCL_TOPO_FILE, NCCL_TOPO_DUMP_FILE, TORCH_NCCL_ASYNC_ERROR_HANDLING) are set only through
    their field, so one value cannot hide behind another.
    """

    preset: str = "default"
    # The preset's variables (conf/nccl/NAME.yaml). Only NCCL_* / TORCH_NCCL_* names that
    # framework.planner.topology knows, in both this and ``env``: they are exported into every rank.
    preset_env: dict[str, str] = field(default_factory=dict)
    # Variables added or overridden for one run, e.g. nccl.env.NCCL_IB_HCA=mlx5 (same names as above).
    env: dict[str, str] = field(default_factory=dict)
    topo_file: Optional[str] = None  # NCCL_TOPO_FILE; its GPU count must match processes per node
    topo_dump_file: Optional[str] = None  # NCCL_TOPO_DUMP_FILE; a relative path lands in the run dir
    socket_ifname: Optional[str] = None  # NCCL_SOCKET_IFNAME (prefixes, ^exclude, =exact)
    require_socket_ifname: bool = False  # the socket preset refuses to start without an interface
    timeout_s: float = 600.0
    async_error_handling: int = 3  # TORCH_NCCL_ASYNC_ERROR_HANDLING: 0 none, 1..3 (3 = PyTorch default)
