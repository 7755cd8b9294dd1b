"""The model group's schema: the shared ``ModelConfig`` keys, ``model.moe``, and one subclass per family
(its own keys only), with the lookups between a family and its schema. framework.config.schema
re-exports every name (the root ``Config`` holds a ``ModelConfig``).

Why the family classes are here and not in their folders: the config layer sits below the models,
so a family's record (framework.models.NAME) points at its class here.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from framework.config.kernels import Float8GradDtype, Float8Recipe, FusedCrossEntropy
from framework.config.options import only_with


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
    # e4m3 +2.5%, its gap growing with the steps (benchmarks/PERF.md); same speed.
    float8_grad_dtype: Float8GradDtype = only_with(
        "model.float8", Float8Recipe.tensorwise, default=Float8GradDtype.e5m2
    )
    # torch._scaled_mm's fast accumulation in the two backward GEMMs too (torchao's default: the
    # forward GEMM only). Faster on Hopper, coarser gradients: an experiment's switch, measured in
    # benchmarks/PERF.md, off by default as in torchao and torchtitan.
    float8_fast_accum: bool = only_with(
        "model.float8", Float8Recipe.tensorwise, Float8Recipe.rowwise, default=False
    )
    # A fused linear cross-entropy for the loss head (CUDA only, its package installed; block-scope
    # executors; no TP): saves the logits' memory. benchmarks/PERF.md measures its speed.
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
    # Multi-token prediction (the DeepSeek-V3 paper's MTP module, the Hub files' layer
    # num_hidden_layers): 0 = off; 1 = one more MoE block after the trunk that predicts token i+2 from
    # the trunk's last hidden state and the embedding of token i+1, through the shared head. Training
    # only (evaluate and generate read the main head). Not with parallel.pp, tp, cp or ep > 1.
    mtp_layers: int = 0
    # The MTP cross-entropy's weight in the training loss (the paper's lambda: 0.3, then 0.1).
    mtp_loss_weight: float = 0.3


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
