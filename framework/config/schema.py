"""Typed configuration: one dataclass per config group, registered in Hydra's ConfigStore.

Why dataclasses and Enums: Hydra merges every group's YAML into these schemas, so a misspelled key,
a wrong type or an unknown choice fails at compose time, before any rank starts. OmegaConf 2.3
rejects ``typing.Literal``, so closed choices are Enums. The untyped ``DictConfig`` never leaves the
entry point: ``to_config`` converts it once, and library code takes the narrowest typed sub-config.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf


class Device(Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


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


class ResidualDtype(Enum):
    """dtype of the residual stream (the embedding output that every block adds into).

    ``autocast``: the autocast dtype when autocast is on (bf16 on CUDA), as under FSDP2 with
    ``param_dtype=bfloat16`` and in Meta's bf16 reference; the norms still compute in fp32.
    ``float32``: an fp32 stream (what plain autocast over fp32 embeddings gives), more memory traffic.
    """

    autocast = "autocast"
    float32 = "float32"


class ModelFamily(Enum):
    """The architecture (framework.models): ``llama`` (Llama 2/3), ``qwen3`` (Qwen3 dense: Llama's
    layout plus an RMSNorm over each query and key head before RoPE), ``mistral`` (a sliding window),
    and the sparse ones (``model.moe``): ``qwen3_moe`` (Qwen3-MoE), ``mixtral`` (Mixtral),
    ``deepseek_v3`` (DeepSeek-V3: multi-head latent attention, dense then MoE layers), ``gpt_oss``
    (GPT-OSS: attention sinks, sliding and full layers, biased experts)."""

    llama = "llama"
    qwen3 = "qwen3"
    mistral = "mistral"
    qwen3_moe = "qwen3_moe"
    mixtral = "mixtral"
    deepseek_v3 = "deepseek_v3"
    gpt_oss = "gpt_oss"


class AttentionBackend(Enum):
    """``F.scaled_dot_product_attention`` backend (torch.nn.attention.SDPBackend); auto lets torch pick.
    ``fa4``: the flash backend with flash-attn-4's kernels swapped in through torch's flash-attention
    registry (framework.kernels.fa4; `pip install -e ".[fa4]"`, Hopper or Blackwell GPUs)."""

    auto = "auto"
    flash = "flash"
    cudnn = "cudnn"
    efficient = "efficient"
    math = "math"
    fa4 = "fa4"


class FusedCrossEntropy(Enum):
    """The loss head's kernel: ``none`` (the output projection, then cross-entropy in fp32; compiled
    by the executor), or a fused linear cross-entropy that never writes the (tokens x vocab) logits:
    ``liger`` (liger-kernel's chunked Triton kernel) or ``cce`` (Apple's cut-cross-entropy)."""

    none = "none"
    liger = "liger"
    cce = "cce"


class Float8Recipe(Enum):
    """Float8 training of the Linear layers (torchao.float8): ``tensorwise`` scales each tensor once
    (the faster recipe), ``rowwise`` scales each row (finer, closer to bf16); ``none``: bf16 autocast."""

    none = "none"
    tensorwise = "tensorwise"
    rowwise = "rowwise"


class Float8GradDtype(Enum):
    """The float8 format of the output gradients in tensorwise float8's two backward GEMMs: ``e4m3``
    (3 mantissa bits: finer steps, 2^18 of range under one scale) or ``e5m2`` (2 mantissa bits, 2^32
    of range: torchao's tensorwise default, made for gradients' wide range)."""

    e4m3 = "e4m3"
    e5m2 = "e5m2"


class DType(Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class PeftMethod(Enum):
    """Parameter-efficient fine-tuning (the ``peft`` group): none trains every weight."""

    none = "none"
    lora = "lora"


class FreezeMode(Enum):
    none = "none"
    export = "export"
    script = "script"
    trace = "trace"


class ExecutorMode(Enum):
    eager = "eager"
    compile = "compile"
    cudagraphs = "cudagraphs"


class CompileScope(Enum):
    block = "block"
    model = "model"


class TokenizerKind(Enum):
    """``bytes``: one token per byte (vocab 256, nothing to download); ``hf``: a Hugging Face
    ``tokenizer.json`` (the ``tokenizers`` library); ``sentencepiece``: a ``tokenizer.model``."""

    bytes = "bytes"
    hf = "hf"
    sentencepiece = "sentencepiece"


class DataSource(Enum):
    """``stdlib``: the standard library's source, byte-level (default); ``text`` / ``jsonl`` /
    ``parquet``: documents from files, tokenized on the fly and packed with EOS; ``hf``: a
    ``datasets.load_dataset`` dataset; ``tokens``: a token file from ``python -m framework data
    prepare``; ``synthetic``: random tokens (benchmarks); ``sft``: chat / instruction records (jsonl)
    for fine-tuning, one example per row, the loss masked on prompt tokens (framework.data.sft)."""

    stdlib = "stdlib"
    text = "text"
    jsonl = "jsonl"
    parquet = "parquet"
    hf = "hf"
    tokens = "tokens"
    synthetic = "synthetic"
    sft = "sft"


class AsyncMode(Enum):
    none = "none"
    thread = "thread"
    process = "process"


class Integrity(Enum):
    """How a checkpoint's manifest is checked before it is trusted (framework.checkpoint)."""

    sha256 = "sha256"
    size = "size"


class Policy(Enum):
    warn = "warn"
    fail = "fail"
    fallback = "fallback"


class LoggerKind(Enum):
    console = "console"
    wandb = "wandb"


class WandbMode(Enum):
    """``auto``: online when an API key is configured (WANDB_API_KEY or a netrc entry), else offline."""

    auto = "auto"
    online = "online"
    offline = "offline"


class OptimizerName(Enum):
    """``adamw`` (fused on CUDA, the default), ``adam``, ``sgd`` (momentum), ``muon``: torch.optim.Muon
    for the blocks' 2-D weight matrices and AdamW for the rest (embeddings, output head, norms)."""

    adamw = "adamw"
    adam = "adam"
    sgd = "sgd"
    muon = "muon"


class MuonAdjustLR(Enum):
    """torch.optim.Muon's ``adjust_lr_fn``: ``match_rms_adamw`` (Moonshot) scales each matrix's update to
    AdamW's RMS, so Muon reuses AdamW's train.lr and weight decay; ``original`` is Keller Jordan's."""

    match_rms_adamw = "match_rms_adamw"
    original = "original"


class LRSchedulerName(Enum):
    """Each warms up linearly over train.warmup_steps, then: ``cosine`` decays to lr * min_lr_ratio at
    train.steps, ``linear`` decays linearly to it, ``constant`` holds lr, ``wsd`` (warmup-stable-decay)
    holds lr and decays linearly to lr * min_lr_ratio over the last ``decay_fraction`` of the steps."""

    cosine = "cosine"
    linear = "linear"
    constant = "constant"
    wsd = "wsd"


class ProfileRanks(Enum):
    """Which ranks record a torch.profiler trace: rank 0 only, or every rank (one file each)."""

    rank0 = "rank0"
    all = "all"


def only_with(
    selector: str, *options: Enum | bool, default: Any = dataclasses.MISSING, factory: Any = None
) -> Any:
    """A field of one option (or a few): it means something only while ``selector`` (a config key)
    is one of ``options``. Set to anything but its default under another option, it would do
    nothing, so the launcher refuses it (``framework.launch.rules.check_option_fields``, one line naming
    the option) and the config reference says which option it belongs to."""
    meta = {"only_with": (selector, options)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def option_fields(cls: type = None, prefix: str = "") -> dict[str, tuple[str, tuple[Any, ...], Any]]:  # type: ignore[assignment]
    """Every ``only_with`` field of the schema: key -> (selector key, its options, the default)."""
    out: dict[str, tuple[str, tuple[Any, ...], Any]] = {}
    for f in dataclasses.fields(cls or Config):
        key = f"{prefix}{f.name}"
        if "only_with" in f.metadata:
            default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
            out[key] = (*f.metadata["only_with"], default)
        tp = f.type if not isinstance(f.type, str) else None
        nested = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if tp is None and nested is not None and dataclasses.is_dataclass(nested):
            tp = nested
        if tp is not None and dataclasses.is_dataclass(tp):
            out.update(option_fields(tp, f"{key}."))
        if tp is ModelConfig:  # the model group: every family's own fields too
            for fam in MODEL_SCHEMAS.values():
                out.update({k: v for k, v in option_fields(fam, f"{key}.").items() if k not in out})
    return out


# ----------------------------------------------------------------------------------------------
# Recipe-owned groups: model, data, train. A recipe (recipes/NAME.yaml) pins these.
# ----------------------------------------------------------------------------------------------


class RouterScore(Enum):
    """How the MoE router scores experts (framework.models.moe): ``softmax`` (Qwen3-MoE, Mixtral), or
    ``sigmoid`` plus a per-expert selection bias for aux-loss-free balancing (DeepSeek-V3's)."""

    softmax = "softmax"
    sigmoid = "sigmoid"


class ExpertKernel(Enum):
    """What runs the experts: ``auto`` (the grouped GEMM where the device's kernel takes the operands,
    else the loop), ``grouped`` (torch's grouped_mm, refused where it cannot run), ``loop`` (per expert)."""

    auto = "auto"
    grouped = "grouped"
    loop = "loop"


# The load-balancing loss's span (``model.moe.aux_loss_scope``; framework.models.moe). The
# functional form because ``global`` is a keyword and OmegaConf matches an Enum by member name.
AuxLossScope = Enum("AuxLossScope", [(n, n) for n in ("global", "layer")], module=__name__)
AuxLossScope.__doc__ = (
    "global: transformers' load_balancing_loss_func, one f and one P over every MoE layer's routers "
    "together (HF parity; needs every layer in one process, so not under a pipeline); layer: each "
    "layer's own E * sum(f P), averaged over the layers (Megatron's and DeepSeek's), which a "
    "pipeline's stages add up"
)


@dataclass
class MoEConfig:
    """The Mixture-of-Experts keys (``model.moe``), for the sparse families (qwen3_moe, mixtral).
    Names are transformers' (Qwen3MoeConfig / MixtralConfig) where one exists. ``num_experts=0`` is a
    dense model (every other family); the launcher refuses any other key changed there."""

    # Routed experts per MoE layer (HF Qwen3-MoE num_experts, Mixtral num_local_experts); 0 = dense.
    num_experts: int = 0
    # Top-k: experts each token goes to.
    num_experts_per_tok: int = 2
    # One expert's SwiGLU width; 0 = model.ffn_dim (Mixtral's experts are intermediate_size wide, and
    # Qwen3-MoE's dense layers, mlp_only_layers, are model.ffn_dim wide).
    moe_intermediate_size: int = 0
    # Renormalise the top-k weights to sum 1 (Mixtral always does; Qwen3-MoE's published configs do).
    norm_topk_prob: bool = True
    router_score: RouterScore = RouterScore.softmax
    # DeepSeek-V3's multiplier of the routed weights (1 = off).
    routed_scaling_factor: float = 1.0
    # DeepSeek-V3's gamma: the sigmoid router's selection bias moves this much per optimizer step,
    # up for experts under the mean load, down above it (0 = a fixed zero bias).
    bias_update_rate: float = only_with("model.moe.router_score", RouterScore.sigmoid, default=0.0)
    # Slots per expert = ceil(capacity_factor * tokens * top_k / num_experts); 0 = no token dropped.
    capacity_factor: float = 0.0
    # The load-balancing loss is added times this; 0 = off.
    router_aux_loss_coef: float = 0.001
    # Its span (AuxLossScope): global (transformers' load_balancing_loss_func, all layers' routers
    # together) or layer (each layer's own, averaged over the layers: Megatron's, DeepSeek's). Under
    # parallel.pp > 1 the launcher takes layer (one warning line), which the stages add up.
    aux_loss_scope: AuxLossScope = AuxLossScope["global"]
    # Experts every token goes through (DeepSeek-style; neither HF family here has them).
    num_shared_experts: int = 0
    # One shared expert's width; 0 = the routed experts' width.
    shared_intermediate_size: int = 0
    # DeepSeek-V3's group-limited routing (transformers' n_group / topk_group): the experts form
    # n_group groups, each scored by its two best experts, and a token picks its top-k among the
    # topk_group best groups only. 1 / 1: one group, plain top-k.
    n_group: int = 1
    topk_group: int = 1
    expert_kernel: ExpertKernel = ExpertKernel.auto


@dataclass
class ModelConfig:
    """Decoder shape. Field names follow Meta's params.json / HF LlamaConfig."""

    name: str = "llama_tiny"
    # The architecture (framework.models), chosen with the model group: model=llama|qwen3|mistral
    # (model.family=NAME on the command line selects the same option).
    family: ModelFamily = ModelFamily.llama
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    # Size of each attention head; 0 = dim / n_heads (Llama's). Qwen3 sets it apart from the width.
    head_dim: int = 0
    ffn_dim: int = 384
    vocab_size: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama 3.1-style RoPE scaling (transformers' rope_type "llama3"; 1 = off): low frequencies are
    # divided by the factor, high ones kept, the band between interpolated. model.init_from reads them.
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position: int = 8192
    # The context length the model is made for (transformers' max_position_embeddings, which the HF
    # export writes); 0 = train.seq_len. model.init_from takes it from the source's config.json.
    max_position_embeddings: int = 0
    tie_embeddings: bool = True
    init_std: float = 0.02
    # cudnn measured 1.6x faster than flash for GQA at the Llama-3.2-1B shape on an H200. fa4:
    # flash-attn-4's kernels behind the flash backend (framework.kernels.fa4; sm90/sm100, `pip install -e ".[fa4]"`).
    attention: AttentionBackend = AttentionBackend.auto
    residual_dtype: ResidualDtype = ResidualDtype.autocast
    # Float8 GEMMs for the Linear layers (torchao, `pip install -e ".[float8]"`; CUDA sm89+ only),
    # and for an MoE family's experts (torchao's float8 grouped GEMM, rowwise under either recipe;
    # sm90/sm100 only; model.moe.expert_kernel auto or grouped; framework.kernels.float8).
    # The weights stay fp32 (checkpoints hold them): a float8 run resumes as bf16 and back.
    float8: Float8Recipe = Float8Recipe.none
    # Linear layers kept in bf16 under float8: any whose name contains one of these (the output head,
    # whose 128K-vocabulary logits float8 would coarsen, and which is tied to the embedding). The
    # same for the MoE experts: add "experts" to keep them bf16.
    float8_skip: list[str] = field(default_factory=lambda: ["output"])
    # Also keep in bf16 the layers too small for float8 to pay (torchao's per-recipe thresholds,
    # measured on H100); false converts every Linear whose dims are multiples of 16. Not applied to
    # the MoE experts (they convert wherever their dims are multiples of 16).
    float8_size_filter: bool = True
    # The output gradients' float8 format under tensorwise (rowwise is e4m3 throughout). e5m2,
    # torchao's default: over 3 seeds of the 125M at lr 6e-4 it ended +0.4% from bf16's loss and
    # e4m3 +2.5%, its gap growing with the steps (benchmarks/PERF.md round 15); same speed.
    float8_grad_dtype: Float8GradDtype = only_with(
        "model.float8", Float8Recipe.tensorwise, default=Float8GradDtype.e5m2
    )
    # torch._scaled_mm's fast accumulation in the two backward GEMMs too (torchao's default: the
    # forward GEMM only). Faster on Hopper, coarser gradients: an experiment's switch, measured in
    # benchmarks/PERF.md (session 13), off by default as in torchao and torchtitan.
    float8_fast_accum: bool = only_with(
        "model.float8", Float8Recipe.tensorwise, Float8Recipe.rowwise, default=False
    )
    # A fused linear cross-entropy for the loss head (CUDA only, its package installed; block-scope
    # executors; no TP): saves the logits' memory. benchmarks/PERF.md round 13 measures its speed.
    fused_cross_entropy: FusedCrossEntropy = FusedCrossEntropy.none
    # Initial weights instead of a random init: a Hugging Face Llama/Qwen3 safetensors folder, or a framework
    # checkpoint (step dir, checkpoint root or run dir; model only, new optimizer and schedule). The
    # shape fields above are taken from it (framework.checkpoint.init_from); a contradicting override is an error.
    init_from: Optional[str] = None
    moe: MoEConfig = field(default_factory=MoEConfig)

    def __post_init__(self) -> None:
        check_family_schema(self)


# ----------------------------------------------------------------------------------------------
# The model group (conf/model/NAME.yaml): one schema per family, the shared keys above plus the
# family's own, so a family's key exists only under it (model.sliding_window on a Llama fails at
# compose time). A new family: its subclass here (its own keys only, a nested block in one line:
# ``moe: MoEConfig = field(default_factory=MoEConfig)``), its line in MODEL_SCHEMAS, its
# conf/model/NAME.yaml, and its record's ``config`` (framework.models) pointing at the class.
# ----------------------------------------------------------------------------------------------


@dataclass
class LlamaConfig(ModelConfig):
    """Llama 2/3 (framework.models.llama), the default family."""

    family: ModelFamily = ModelFamily.llama


@dataclass
class Qwen3Config(ModelConfig):
    """Qwen3 dense (framework.models.qwen3): Llama's layout plus an RMSNorm over each query and key
    head before RoPE (``head_dim`` sets the head apart from the width)."""

    family: ModelFamily = ModelFamily.qwen3


@dataclass
class MistralConfig(ModelConfig):
    """Mistral (framework.models.mistral): Llama's layout with sliding-window attention."""

    family: ModelFamily = ModelFamily.mistral
    # Each position sees itself and the window - 1 before it (transformers' ``sliding_window``);
    # 0 = off (full causal attention).
    sliding_window: int = 0


@dataclass
class Qwen3MoeConfig(ModelConfig):
    """Qwen3-MoE (framework.models.qwen3_moe): Qwen3's attention, every MLP a ``model.moe`` block."""

    family: ModelFamily = ModelFamily.qwen3_moe


@dataclass
class MixtralConfig(ModelConfig):
    """Mixtral (framework.models.mixtral): Mistral's layout, every MLP a ``model.moe`` block."""

    family: ModelFamily = ModelFamily.mixtral
    sliding_window: int = 0  # as Mistral's (transformers' ``sliding_window``; 0 = off)


@dataclass
class DeepseekV3Config(ModelConfig):
    """DeepSeek-V3 (framework.models.deepseek_v3): multi-head latent attention (low-rank q and kv
    projections, decoupled RoPE heads, YaRN), a stack of dense then ``model.moe`` layers with shared
    experts and group-limited sigmoid routing. Names are transformers' DeepseekV3Config's."""

    family: ModelFamily = ModelFamily.deepseek_v3
    # The stack, one layer kind per layer: dense (SwiGLU, model.ffn_dim wide) or moe (model.moe),
    # e.g. "dense x3, moe x58" (transformers' first_k_dense_replace: 3); n_layers layers in all.
    layer_pattern: str = "dense x1, moe x3"
    # The query's low-rank projection (transformers' q_lora_rank); 0: one full projection (V2-Lite).
    q_lora_rank: int = 0
    # The compressed key/value latent, what the decode cache holds per position (kv_lora_rank).
    kv_lora_rank: int = 64
    # Per head: the query/key features without RoPE, the decoupled RoPE ones (shared by every head
    # on the key side), the value's.
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    # YaRN RoPE scaling (transformers' rope_type "yarn"; factor 1 = off).
    rope_yarn_factor: float = 1.0
    rope_yarn_original_max_position: int = 4096
    rope_yarn_beta_fast: float = 32.0
    rope_yarn_beta_slow: float = 1.0
    rope_yarn_mscale: float = 1.0
    rope_yarn_mscale_all_dim: float = 0.0


@dataclass
class GptOssConfig(ModelConfig):
    """GPT-OSS (framework.models.gpt_oss): grouped-query attention with biases and a learned sink per
    head, layers alternating a sliding window and full attention, every MLP a ``model.moe`` layer of
    experts with biases and the clamped SwiGLU; YaRN. Names are transformers' GptOssConfig's."""

    family: ModelFamily = ModelFamily.gpt_oss
    # The stack, one layer kind per layer: sliding (a window of model.sliding_window) or full, e.g.
    # "[sliding, full] x12" (transformers' layer_types); n_layers layers in all.
    layer_pattern: str = "[sliding, full] x2"
    sliding_window: int = 128  # the sliding layers' window (transformers' sliding_window)
    # The experts' SwiGLU clamp (transformers' swiglu_limit): gate <= limit, |up| <= limit.
    swiglu_limit: float = 7.0
    # YaRN as DeepSeek-V3's (factor 1 = off); GPT-OSS does not round its ramp (truncate: false).
    rope_yarn_factor: float = 1.0
    rope_yarn_original_max_position: int = 4096
    rope_yarn_beta_fast: float = 32.0
    rope_yarn_beta_slow: float = 1.0
    rope_yarn_mscale: float = 1.0
    rope_yarn_mscale_all_dim: float = 0.0
    rope_yarn_truncate: bool = False


# family -> its schema (the option ``model=NAME``, conf/model/NAME.yaml).
MODEL_SCHEMAS: dict[ModelFamily, type[ModelConfig]] = {
    ModelFamily.llama: LlamaConfig,
    ModelFamily.qwen3: Qwen3Config,
    ModelFamily.qwen3_moe: Qwen3MoeConfig,
    ModelFamily.mixtral: MixtralConfig,
    ModelFamily.mistral: MistralConfig,
    ModelFamily.deepseek_v3: DeepseekV3Config,
    ModelFamily.gpt_oss: GptOssConfig,
}


@functools.cache
def own_keys(cls: type[ModelConfig]) -> tuple[str, ...]:
    """The keys a family's schema adds to the shared ``ModelConfig`` (``sliding_window`` for Mistral)."""
    shared = {f.name for f in dataclasses.fields(ModelConfig)}
    return tuple(f.name for f in dataclasses.fields(cls) if f.name not in shared)


def owners(key: str) -> list[str]:
    """The families whose schema has ``key`` (a ``model`` key; every family for a shared one)."""
    return [
        fam.value for fam, cls in MODEL_SCHEMAS.items() if key in {f.name for f in dataclasses.fields(cls)}
    ]


def model_schema(m: ModelConfig | ModelFamily) -> type[ModelConfig]:
    """The schema of a family (or of a config's ``family``)."""
    return MODEL_SCHEMAS[m if isinstance(m, ModelFamily) else m.family]


def check_family_schema(m: ModelConfig) -> None:
    """A config's ``family`` and its schema agree: one line (value, how to select it) otherwise.

    A bare ``ModelConfig`` stands for a family that has no keys of its own (Llama, Qwen3 in code
    and tests); a family with its own keys needs its schema (``MistralConfig(sliding_window=...)``).
    """
    family = m.family if isinstance(m.family, ModelFamily) else None
    if family is None or family not in MODEL_SCHEMAS:
        return  # a bad family value: OmegaConf (compose) or the Enum refuses it
    schema = MODEL_SCHEMAS[family]
    if isinstance(m, schema) or (type(m) is ModelConfig and not own_keys(schema)):
        return
    chosen = next((f.value for f, c in MODEL_SCHEMAS.items() if type(m) is c), None)
    if chosen is None:  # code built the wrong class
        raise ValueError(
            f"model.family={family.value} needs its schema {schema.__name__} (its keys: "
            f"{', '.join(own_keys(schema))}), not {type(m).__name__}; on the command line: model={family.value}"
        )
    raise ValueError(
        f"model.family={family.value} but the model group's option is {chosen}; select the family "
        f"with model={family.value} alone (a recipe: defaults: [override /model: {family.value}])"
    )


def replace_model(m: ModelConfig, **changes: Any) -> ModelConfig:
    """``dataclasses.replace`` across families: with a new ``family`` the result is that family's
    schema, the shared keys kept, the old family's own keys dropped (a checkpoint's or an HF
    config.json's shape may be of another family than the recipe's)."""
    family = changes.get("family", m.family)
    schema = MODEL_SCHEMAS.get(family, type(m)) if isinstance(family, ModelFamily) else type(m)
    if isinstance(m, schema) or (type(m) is ModelConfig and not own_keys(schema)):
        return dataclasses.replace(m, **changes)
    names = {f.name for f in dataclasses.fields(schema) if f.init}
    kept = {f.name: getattr(m, f.name) for f in dataclasses.fields(m) if f.name in names}
    return schema(**{**kept, **{k: v for k, v in changes.items() if k in names or k not in kept}})


def family_of(node: Any) -> ModelFamily:
    """The family a composed or loaded ``model`` node is: its schema's when typed, else its
    ``family`` value (a run's config.yaml); Llama when it names none or an unknown one (the
    schema then refuses the value with OmegaConf's line)."""
    if isinstance(node, DictConfig):
        typed = OmegaConf.get_type(node)
        for fam, cls in MODEL_SCHEMAS.items():
            if typed is cls:
                return fam
    value = node.get("family") if isinstance(node, (dict, DictConfig)) else None
    value = getattr(value, "value", value)
    try:
        return ModelFamily(value) if value is not None else ModelFamily.llama
    except ValueError:
        return ModelFamily.llama


@dataclass
class TokenizerConfig:
    """Text -> token ids (framework.data.tokenizer). Its vocabulary is checked against ``model.vocab_size``."""

    kind: TokenizerKind = TokenizerKind.bytes
    # hf: a tokenizer.json or a folder holding one; sentencepiece: a tokenizer.model file.
    path: Optional[str] = None
    # The BOS / EOS tokens by name (e.g. "<|end_of_text|>"); None = the tokenizer's own (its
    # tokenizer_config.json, the SentencePiece model's ids, or a well-known name). bytes has neither.
    bos_token: Optional[str] = None
    eos_token: Optional[str] = None
    # Put BOS before every document (EOS always follows every document when the tokenizer has one).
    add_bos: bool = False


@dataclass
class MixEntry:
    """One source of a ``data.mix``: the same keys as ``data`` for that source, plus its weight."""

    source: DataSource = DataSource.jsonl
    path: Optional[str] = None
    field: str = "text"
    column: str = "text"
    name: Optional[str] = None
    split: str = "train"
    streaming: bool = False
    # Relative share of the samples (normalised over the mix; > 0).
    weight: float = 1.0


@dataclass
class EvalSet:
    """One named validation set of ``train.eval_sets``: its own data (read with the run's tokenizer
    and seq_len, from its start, in order), scored at every evaluation and logged as ``val_loss/NAME``."""

    name: str = ""
    source: DataSource = DataSource.jsonl
    # A file, a folder or a glob, as data.path (text, jsonl, parquet, tokens, sft).
    path: Optional[str] = None
    field: str = "text"  # jsonl: the key of each line's text
    column: str = "text"  # parquet: the column of the text


@dataclass
class DataConfig:
    """Where training tokens come from (framework.data). Pick a source with ``data=NAME``."""

    # The source kind; data=NAME sets it (data.source=NAME, the spelling before the group, still works).
    source: DataSource = DataSource.stdlib
    # text/jsonl/parquet/tokens: a file, a folder (its files with the source's suffixes) or a glob;
    # hf: a dataset folder, a data file, or a hub name. tokens: a .bin from `framework.data prepare`.
    path: Optional[str] = None
    # A separate validation set (same kind as path); None = hold out val_fraction of the data.
    val_path: Optional[str] = None
    # Fraction held out for validation: the last files (stdlib), the last tokens (tokens), every
    # 1/val_fraction-th record (text, jsonl, parquet, hf).
    val_fraction: float = 0.05
    # jsonl: the key of each line's document text.
    field: str = only_with("data.source", DataSource.jsonl, default="text")
    # parquet and hf: the column of the document text.
    column: str = only_with("data.source", DataSource.parquet, DataSource.hf, default="text")
    # hf: the dataset's configuration name (load_dataset's `name`) and split.
    name: Optional[str] = only_with("data.source", DataSource.hf, default=None)
    split: str = only_with("data.source", DataSource.hf, default="train")
    # hf: stream records (datasets' IterableDataset) instead of building the Arrow cache: for
    # corpora larger than disk or RAM. Resume skips records without tokenizing them.
    streaming: bool = only_with("data.source", DataSource.hf, default=False)
    # Attention stops at document boundaries (EOS) and RoPE positions restart at each document:
    # FlexAttention with a block mask on CUDA (model.attention=auto), the flash kernel's
    # variable-length form over the documents (model.attention=flash|fa4, CUDA; fa4 is the fastest),
    # else SDPA with a dense mask (CPU: FlexAttention has no backward there).
    document_mask: bool = False
    # Several sources with weights; when set, it replaces source/path. The source of each sample is a
    # deterministic function of (train.seed, sample index).
    mix: list[MixEntry] = dataclasses.field(default_factory=list)
    # Global batches tokenized ahead in a background thread (text/jsonl/parquet/hf and mixes).
    prefetch: int = 4
    # Documents encoded per tokenizer call (hf/sentencepiece encode a batch on their own threads).
    encode_batch: int = 256
    # sft: the key of each jsonl line's conversation, a list of {"role", "content"} messages (roles:
    # system, user, assistant); a line without it is read as a prompt/response pair (the next keys).
    messages_field: str = only_with("data.source", DataSource.sft, default="messages")
    # sft: the keys of a prompt/response line (read as one user and one assistant message).
    prompt_field: str = only_with("data.source", DataSource.sft, default="prompt")
    response_field: str = only_with("data.source", DataSource.sft, default="response")
    # sft: pack several whole examples per row (up to train.seq_len), each one attending only to
    # itself with its own RoPE positions (document masking) and the loss still on responses only;
    # false: one example per row, padded.
    sft_pack: bool = only_with("data.source", DataSource.sft, default=True)


@dataclass
class TrainConfig:
    steps: int = 200
    global_batch_size: int = 32
    # Sequences per forward/backward on one rank; 0 = the rank's whole share of the global batch
    # (global_batch_size / data-parallel degree, no gradient accumulation).
    micro_batch_size: int = 0
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    # Step each parameter inside backward, as soon as its gradient is complete, and free that gradient
    # (torchtitan's optimizer.early_step_in_backward): frees the fp32 gradients' memory (4 bytes per
    # parameter) for activations. One device only, no gradient accumulation, and train.grad_clip=0
    # (a global norm needs every gradient first); the planner refuses the rest.
    optimizer_in_backward: bool = False
    # With optimizer_in_backward: each gradient's norm (the logged grad_norm) and the skip of a
    # non-finite gradient's update. false: neither, and only a non-finite loss skips the step; the
    # norm is one more read of every gradient (5.7% of the step at Qwen3-30B-A3B's MoE shape on one
    # H200, benchmarks/PERF.md "MoE on one H200").
    in_backward_grad_checks: bool = only_with("train.optimizer_in_backward", True, default=True)
    # The initial weights, the data order and each rank's global RNG (dropout) derive from it.
    seed: int = 0
    log_every: int = 10
    eval_every: int = 50
    # Validation: this many global batches of held-out windows, the same windows on every layout
    # (each rank evaluates its share); the loss is the mean over all their targets.
    eval_batches: int = 4
    # Named validation sets scored beside the run's own (each eval_batches micro-batches per rank
    # from its start): train.eval_sets='[{name: code, path: code.jsonl}]' logs val_loss/code.
    eval_sets: list[EvalSet] = field(default_factory=list)


@dataclass
class OptimizerConfig:
    """The optimizer (conf/optimizer/NAME.yaml; framework.train.loop.build_optimizer). Its learning rate,
    weight decay and betas stay train.lr, train.weight_decay, train.beta1/beta2."""

    name: OptimizerName = OptimizerName.adamw
    # The class built, through the allowlist (run.instantiate_allow). Each option names torch's own
    # class; any other class (optimizer._target_=torch.optim.NAdam) is called as
    # CLASS(param_groups, lr=train.lr, **optimizer.kwargs) (under muon: for the 2-D block weights).
    _target_: str = "torch.optim.AdamW"
    # Keyword arguments added to the class's call (they override the option's own).
    kwargs: dict[str, Any] = field(default_factory=dict)
    # sgd and muon: momentum factor, and Nesterov momentum.
    momentum: float = only_with("optimizer.name", OptimizerName.sgd, OptimizerName.muon, default=0.9)
    nesterov: bool = only_with("optimizer.name", OptimizerName.sgd, OptimizerName.muon, default=False)
    # muon: how Muon scales each matrix's learning rate (MuonAdjustLR), and its Newton-Schulz steps.
    muon_adjust_lr: MuonAdjustLR = only_with(
        "optimizer.name", OptimizerName.muon, default=MuonAdjustLR.match_rms_adamw
    )
    muon_ns_steps: int = only_with("optimizer.name", OptimizerName.muon, default=5)
    # adamw: the dtype its two moments are stored in. bfloat16 (framework.train.adamw: computed in fp32,
    # stored in bf16, as DeepSeek-V3 and Megatron-Core's exp_avg_dtype do) halves the optimizer state
    # (an 8B model: 29.9 GiB freed) and 8 of its 38 bytes of traffic a parameter; the weights stay fp32.
    state_dtype: DType = only_with("optimizer.name", OptimizerName.adamw, default=DType.float32)


@dataclass
class LRSchedulerConfig:
    """The learning-rate schedule (conf/lr_scheduler/NAME.yaml; framework.train.loop.lr_lambda). The peak,
    the floor and the warmup stay train.lr, train.min_lr_ratio and train.warmup_steps."""

    name: LRSchedulerName = LRSchedulerName.cosine
    # wsd: the fraction of train.steps, at the end, over which lr decays to lr * min_lr_ratio.
    decay_fraction: float = only_with("lr_scheduler.name", LRSchedulerName.wsd, default=0.2)


@dataclass
class RunConfig:
    device: Device = Device.auto
    # CUDA caching allocator: grow segments in place instead of carving fixed blocks
    # (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, as torchtitan's launcher sets it): less
    # fragmentation when memory is tight. Never overrides a PYTORCH_CUDA_ALLOC_CONF already set.
    expandable_segments: bool = True
    # Plan (and on a fake process group, build and shard) without training.
    dry_run: bool = False
    # Fail on any nondeterministic kernel; used by the bitwise resume tests.
    deterministic: bool = False
    # Self-launch restarts when a rank dies (torch elastic max_restarts).
    max_restarts: int = 0
    # Record a torch.profiler trace (Chrome JSON) of a window of steps into <run dir>/profile.
    profile: bool = False
    profile_ranks: ProfileRanks = only_with("run.profile", True, default=ProfileRanks.rank0)
    # torch.profiler.schedule: skip `wait` steps, warm up `warmup` steps, record `active` steps, once.
    profile_wait: int = only_with("run.profile", True, default=1)
    profile_warmup: int = only_with("run.profile", True, default=1)
    profile_active: int = only_with("run.profile", True, default=3)
    # What a config's `_target_` may name besides the shipped callbacks and torch.optim's optimizer
    # classes (framework.config.instantiate, default-deny): exact names (`mypkg.MyCallback`), or a
    # package with its trailing dot (`mypkg.`). Set it in conf/ or on the command line; a recipe that
    # sets it is refused.
    instantiate_allow: list[str] = field(default_factory=list)
    # Fault injection, to test recovery on your own setup: rank `fault_rank` (-1 = every rank) SIGKILLs
    # itself after step `fault_kill_at_step` (-1 = off), on the launcher's first attempt only; or
    # raises from inside the forward of step `fault_raise_at_step` (-1 = off), to test the cleanup.
    fault_kill_at_step: int = -1
    fault_raise_at_step: int = -1
    fault_rank: int = 0
    # Start more local CPU ranks than framework.launch.rules.cpu_rank_cap() (4 per core, at least 8);
    # above it gloo ranks starve each other and the launch can hang.
    oversubscribe: bool = False
    # Launch a plan whose per-rank memory estimate exceeds mesh.hardware.memory_gib (refused by
    # default; run.dry_run=true only reports it).
    allow_over_memory: bool = False


# ----------------------------------------------------------------------------------------------
# Infrastructure groups.
# ----------------------------------------------------------------------------------------------


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
    comm_overlap: float = 0.0  # fraction of FSDP/DDP communication hidden under compute
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


@dataclass
class FreezeConfig:
    """Static graph (framework.freeze): torch.export artifact, or legacy TorchScript (script/trace)."""

    # export: what `python train.py` composes (conf/config.yaml `freeze: export`); the schema agrees.
    mode: FreezeMode = FreezeMode.export
    # torch.export.export(strict=...): trace with Dynamo instead of running Python.
    strict: bool = only_with("freeze.mode", FreezeMode.export, default=False)
    # Also trace the model as torch.compile(fullgraph=True) does (and where that breaks, run it once
    # under torch._dynamo.explain to list every break), so they are reported at freeze time.
    check_graph_breaks: bool = only_with("freeze.mode", FreezeMode.export, default=True)
    # script only: submodule paths ("layers.0.feed_forward") or methods ("helper", "layers.0.attention.fn")
    # left as Python, as @torch.jit.ignore does. Such a module runs but cannot be saved.
    ignore: list[str] = only_with("freeze.mode", FreezeMode.script, factory=list)
    # script only: extra methods compiled (and kept by torch.jit.freeze), as @torch.jit.export does.
    export_methods: list[str] = only_with("freeze.mode", FreezeMode.script, factory=list)


@dataclass
class PeftConfig:
    """LoRA (Hu et al. 2021): each targeted Linear keeps its weight W frozen and learns
    W + (alpha / rank) * B @ A, with A (rank x in) and B (out x rank, zero at the start)."""

    # none: full fine-tuning; lora: frozen base, adapters (framework.models.lora).
    method: PeftMethod = PeftMethod.none
    # The adapters' rank r: 1 .. the smallest in/out size of a targeted layer.
    rank: int = only_with("peft.method", PeftMethod.lora, default=8)
    # The update is scaled by alpha / rank (peft's lora_alpha).
    alpha: float = only_with("peft.method", PeftMethod.lora, default=16.0)
    # nn.Dropout on the adapter's input (peft's lora_dropout); the frozen path sees the plain input.
    dropout: float = only_with("peft.method", PeftMethod.lora, default=0.0)
    # Module-name patterns (fnmatch) matched against the full name ("layers.*.attention.wq") or its
    # last part ("wq"); every pattern must match at least one Linear. peft's Llama default: q and v.
    targets: list[str] = only_with("peft.method", PeftMethod.lora, factory=lambda: ["wq", "wv"])
    # The frozen weights' dtype: bfloat16 halves their memory (the adapters stay float32).
    base_dtype: DType = only_with("peft.method", PeftMethod.lora, default=DType.float32)
    # A PEFT adapter folder (adapter_config.json + adapter_model.safetensors, e.g. export-hf --adapter)
    # to start the adapters from, instead of B = 0; its base, rank, alpha and layers must be this run's.
    adapter: Optional[str] = only_with("peft.method", PeftMethod.lora, default=None)


_COMPILED = (ExecutorMode.compile, ExecutorMode.cudagraphs)


@dataclass
class ExecutorConfig:
    mode: ExecutorMode = ExecutorMode.eager
    # compile and cudagraphs: compile each block, or the whole model; torch.compile's backend.
    scope: CompileScope = only_with("executor.mode", *_COMPILED, default=CompileScope.block)
    backend: str = only_with("executor.mode", *_COMPILED, default="inductor")
    # executor.scope=block: also compile the loss head (final norm, output projection, fp32
    # cross-entropy) as its own region (framework.parallel.compile); false leaves it eager, as
    # torchtitan ran it at the end of 2024 (its loss_fn compile commented out), at 4x the head's
    # memory-bound time and 10 bytes kept per logit instead of 2 (framework.planner).
    compile_loss: bool = only_with("executor.mode", *_COMPILED, default=True)
    warmup_steps: int = 3
    # Inductor's max-autotune: benchmark GEMM/conv kernel choices at compile time (minutes longer
    # to compile; mode="max-autotune-no-cudagraphs", or "max-autotune" with cudagraphs).
    autotune: bool = only_with("executor.mode", *_COMPILED, default=False)
    # A portable compile cache (torch.compiler cache artifacts) in a directory, e.g. on shared
    # storage next to the checkpoints: loaded by every rank before compiling, extended by rank 0
    # after training, so a fresh node starts warm (framework.train.compile_cache). None = off.
    cache_dir: Optional[str] = only_with("executor.mode", *_COMPILED, default=None)


def _saving(default: Any) -> Any:
    """A checkpoint field: it means something with checkpoint.enabled=true (checkpoint=sync|async|large)."""
    return only_with("checkpoint.enabled", True, default=default)


@dataclass
class CheckpointConfig:
    """Fault-tolerant DCP checkpoints (framework.checkpoint): atomic commit, manifest, retention."""

    # python train.py composes checkpoint=final (enabled, one save at the end); a Config() built in
    # code saves only when asked. checkpoint=none turns it off.
    enabled: bool = False
    dir: Optional[str] = _saving(None)  # default: <run dir>/checkpoints
    every_steps: int = _saving(0)  # 0 = off
    every_minutes: float = _saving(0.0)  # 0 = off; rank 0's clock decides, all ranks follow
    at_end: bool = _saving(True)
    async_mode: AsyncMode = _saving(AsyncMode.none)
    keep_last: int = _saving(2)  # 0 = keep all; the newest complete checkpoint is never deleted
    keep_every: int = _saving(0)  # also keep steps that are multiples of this forever (0 = none)
    resume: str = "auto"  # auto | none | <path>
    # sha256: hash every file at commit and verify before resume; size: sizes only (huge checkpoints).
    integrity: Integrity = _saving(Integrity.sha256)
    # Write the final model (or the preempted one) as a Hugging Face folder into <run dir>/hf: safetensors,
    # config.json, generation_config.json, tokenizer files. Any checkpoint later: python -m
    # framework.checkpoint export-hf CHECKPOINT OUT.
    export_hf: bool = False


def _verifying(default: Any) -> Any:
    """A verification field: it means something with verify.enabled=true (verify=on)."""
    return only_with("verify.enabled", True, default=default)


@dataclass
class VerifyConfig:
    """Verification hooks of the migration checklist (framework.verify).

    The cheap hooks run by default: ``graph`` and ``ladder`` (benchmarks/PERF.md measures them).
    ``enabled`` (``verify=on``) adds the costly ones: the numerics check, the reference graph, the
    performance baseline and the report files. ``policy`` says what a failed check of those does:
    ``warn`` reports it and trains on, ``fail`` stops the run, ``fallback`` steps down the executor
    ladder (cudagraphs -> compile -> eager). A cross-rank mismatch always stops the job (ranks that
    disagree would hang in their first collective).
    """

    enabled: bool = False
    policy: Policy = _verifying(Policy.warn)
    # Cross-rank graph fingerprint + config hash before the first training collective (the
    # fingerprints freeze made: one all_gather_object of two short strings; with freeze=none only
    # under verify=on, which exports the model to get one).
    graph: bool = True
    # The fallback ladder: a compile error at the first forward (run before step 1 where a lower
    # rung exists) or a tripped latency circuit breaker steps down cudagraphs -> compile -> eager.
    ladder: bool = True
    # A fingerprint.json file or an earlier run dir (its frozen/fingerprint.json) to compare the graph with.
    reference: Optional[str] = _verifying(None)
    # Executed (compiled / parallelized) model vs eager on the first batch: relative loss difference.
    numerics: bool = _verifying(True)
    loss_rtol: float = _verifying(1e-4)
    # ... and the logits: max |difference| / max |logit| (0 = off). fp32 agrees to ~1e-6; under bf16
    # autocast (CUDA) compiled vs eager differ by rounding alone: 2.4e-2 measured for llama1b on an
    # H200, so the bf16 bound is looser. A miscompile shows up far above either.
    logits_rtol: float = _verifying(1e-2)
    logits_rtol_bf16: float = _verifying(6e-2)
    # ... and under model.float8 (the reference model is float8 too; compiled and eager casts can
    # round an element to neighbouring float8 values, 3 mantissa bits, so the bound is looser still).
    logits_rtol_float8: float = _verifying(0.15)
    # Also compare with an unsharded eager model built from the same config and seed, up to this size.
    reference_model_max_params: int = _verifying(50_000_000)
    # Baseline store (JSON); default outputs/baselines.json. ``save_baseline`` records this run in it.
    baseline: Optional[str] = _verifying(None)
    save_baseline: bool = _verifying(False)
    # Regression thresholds against the baseline (fractions): tokens/s drop, p99 step time, peak memory.
    max_tokens_per_s_drop: float = _verifying(0.10)
    max_p99_increase: float = _verifying(0.20)
    max_memory_increase: float = _verifying(0.10)
    # Latency circuit breaker: p99 of each window of ``breaker_window`` steps above ``breaker_factor`` x
    # the baseline p99 (or this run's first window) for ``breaker_patience`` windows in a row.
    breaker_factor: float = _verifying(3.0)
    breaker_window: int = _verifying(10)
    breaker_patience: int = _verifying(2)
    # Non-finite steps are skipped; this many in a row roll back to the last checkpoint.
    max_bad_steps: int = 3
    # Debugging knob: make the forward output NaN at these (0-based) steps, to test the bad-step policy.
    inject_nan_steps: list[int] = field(default_factory=list)


@dataclass
class LoggerConfig:
    """Metrics sinks. ``metrics.jsonl`` is always written; ``kind=wandb`` adds Weights & Biases (rank 0)."""

    kind: LoggerKind = LoggerKind.console
    project: str = "framework"
    progress_bar: bool = True
    entity: Optional[str] = None  # wandb entity (team or user); None = the key's default entity
    mode: WandbMode = WandbMode.auto  # wandb online/offline; auto = online only when a key is configured
    tags: list[str] = field(default_factory=list)  # wandb run tags
    plot: bool = True  # write metrics.png (loss, tokens/s, lr, grad norm, MFU over steps) at the end of the run


# The shipped callbacks (conf/callbacks/default.yaml lists the same, in the same order): each acts only
# when its own keys ask (run.profile, logger=wandb, run.fault_*/verify.inject_nan_steps, executor.cache_dir), so all four are
# always there. framework.train.callbacks builds them through the allowlist; a test holds the two equal.
SHIPPED_CALLBACKS: dict[str, str] = {
    "profiler": "framework.train.profiling.Profiling",
    "wandb": "framework.train.wandb_logger.WandbLogger",
    "fault_injection": "framework.train.faults.FaultInjection",
    "compile_cache": "framework.train.compile_cache.CompileCache",
}


def default_callbacks() -> dict[str, Any]:
    return {name: {"_target_": target} for name, target in SHIPPED_CALLBACKS.items()}


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    run: RunConfig = field(default_factory=RunConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    bucketing: BucketingConfig = field(default_factory=BucketingConfig)
    nccl: NcclConfig = field(default_factory=NcclConfig)
    freeze: FreezeConfig = field(default_factory=FreezeConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    verify: VerifyConfig = field(default_factory=VerifyConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    # The callbacks group (conf/callbacks/NAME.yaml): name -> {_target_: CLASS, its own values};
    # NAME=null switches one off. Built through run.instantiate_allow (framework.train.callbacks).
    callbacks: dict[str, Any] = field(default_factory=default_callbacks)


def register() -> None:
    """Store the root schema; every group's YAML is merged into (and validated by) its field type.

    The ``model`` group's options bring their family's schema: conf/model/NAME.yaml lists
    ``/NAME_model_schema@_here_`` (stored here, at the root so that ``--help`` lists only the
    options), which turns the shared ``ModelConfig`` node into the family's subclass.
    """
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for fam, cls in MODEL_SCHEMAS.items():
        cs.store(name=f"{fam.value}_model_schema", node=cls)


@functools.cache
def _schema(family: ModelFamily = ModelFamily.llama) -> DictConfig:
    """The structured root schema with ``family``'s model schema, built once per family (30 ms per
    build; the launcher converts several configs)."""
    return OmegaConf.structured(Config(model=MODEL_SCHEMAS[family]()))


def to_config(cfg: DictConfig | dict[str, Any]) -> Config:
    """Convert a composed (possibly untyped) config into the typed ``Config``, validating it.

    The ``model`` node is checked against its family's schema (``family_of``): a run's untyped
    config.yaml with ``family: mistral`` gets ``MistralConfig``, a Llama's ``sliding_window`` is refused.
    """
    model = cfg.get("model") if isinstance(cfg, (dict, DictConfig)) else None
    schema = _schema(family_of(model) if model is not None else ModelFamily.llama)
    family = family_of(model) if model is not None else ModelFamily.llama
    if isinstance(cfg, DictConfig) and OmegaConf.get_type(cfg, "model") not in (
        None,
        dict,
        MODEL_SCHEMAS[family],
    ):
        # a node typed as another schema (Config()'s base one, or a family changed in place): it
        # cannot merge into the family's class, its values can
        cfg = OmegaConf.to_container(cfg, resolve=False)
    merged = OmegaConf.merge(schema, cfg)  # merge copies its first argument: the cache stays clean
    obj = OmegaConf.to_object(merged)
    assert isinstance(obj, Config)
    return obj


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level of dotted keys (``{"train": {"lr": 1}}`` -> ``{"train.lr": 1}``),
    for naming the keys that differ between two configs."""
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


GROUPS = (
    "recipe",
    "model",
    "tokenizer",
    "data",
    "optimizer",
    "lr_scheduler",
    "mesh",
    "mesh/hardware",
    "sharding",
    "bucketing",
    "nccl",
    "freeze",
    "peft",
    "executor",
    "checkpoint",
    "verify",
    "logger",
    "callbacks",
)


MESH_DIR = Path(__file__).resolve().parents[2] / "conf" / "mesh"
_SHAPE = re.compile(r"[1-9]\d*(x[1-9]\d*)*")


def mesh_shape_overrides(args: list[str], shipped: set[str] | None = None) -> list[str]:
    """Any mesh shape works as written: ``mesh=4x8`` -> ``mesh.shape=[4,8]``, ``mesh=6`` -> ``mesh.shape=[6]``.

    The ``mesh`` group ships a file per common shape (conf/mesh/); any other ``NxM...`` has no file,
    and Hydra would stop with "Could not find 'mesh/4x8'". A shape without a file becomes the
    ``mesh.shape`` list it names; a sweep (``mesh=2x4,4x8``) with any such shape becomes a sweep
    over ``mesh.shape`` lists. Shapes with a file, and anything that is not a shape, pass unchanged.
    """
    if shipped is None:
        shipped = {p.stem for p in MESH_DIR.glob("*.yaml")}
    out = []
    for arg in args:
        key, sep, value = arg.partition("=")
        parts = value.split(",") if sep and key == "mesh" else []
        if parts and all(_SHAPE.fullmatch(p) for p in parts) and not set(parts) <= shipped:
            lists = ",".join("[" + ",".join(p.split("x")) + "]" for p in parts)
            arg = f"mesh.shape={lists}"
        out.append(arg)
    return out


def family_choice_overrides(args: list[str]) -> list[str]:
    """``model.family=qwen3`` (the surface before the model group) selects the group's option:
    ``model=qwen3``; a sweep ``model.family=llama,qwen3`` is ``model=llama,qwen3``. Left as written
    beside an explicit ``model=NAME`` (the two then disagree or repeat: ``check_family_schema``
    refuses a disagreement in one line)."""
    if any(a.partition("=")[0] == "model" for a in args):
        return list(args)
    return [f"model={a.partition('=')[2]}" if a.partition("=")[0] == "model.family" else a for a in args]


def quote_numeric_choices(args: list[str]) -> list[str]:
    """Quote numeric group choices on the command line: ``mesh=4`` -> ``mesh='4'``, after
    ``mesh_shape_overrides`` has turned shapes without a file into ``mesh.shape`` lists.

    Hydra's override parser reads ``4`` as an int and then refuses it as a group choice ("Config group
    override must be a string or a list. Got int"); our mesh options are named by their shape
    (``1``, ``4``, ``2x4``). Sweeps (``mesh=2,4``) are quoted choice by choice. ``model.family=NAME``
    becomes the group choice ``model=NAME`` first (``family_choice_overrides``).
    """
    out = []
    for arg in mesh_shape_overrides(family_choice_overrides(args)):
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+~") in GROUPS and value:
            parts = value.split(",")
            if all(p.isdigit() for p in parts):
                arg = f"{key}=" + ",".join(f"'{p}'" for p in parts)
        out.append(arg)
    return out
