"""The ``train``, ``optimizer`` and ``lr_scheduler`` groups' schemas: the step, its optimizer and
its learning-rate schedule (framework.train.loop).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from framework.config.data import EvalSet
from framework.config.options import only_with
from framework.config.parallel import DType


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
    """The optimizer (conf/optimizer/NAME.yaml; framework.train.optimizers.build_optimizer). Its learning rate,
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
    """The learning-rate schedule (conf/lr_scheduler/NAME.yaml; framework.train.optimizers.lr_lambda). The peak,
    the floor and the warmup stay train.lr, train.min_lr_ratio and train.warmup_steps."""

    name: LRSchedulerName = LRSchedulerName.cosine
    # wsd: the fraction of train.steps, at the end, over which lr decays to lr * min_lr_ratio.
    decay_fraction: float = only_with("lr_scheduler.name", LRSchedulerName.wsd, default=0.2)
