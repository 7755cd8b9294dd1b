"""The ``train``, ``optimizer``, ``lr_scheduler`` and ``peft`` groups' rules that read the config alone.

The optimizer's class, keyword arguments, state dtype and Muon's availability are probed by building the
training loop's own optimizer, and the LoRA targets and rank against the meta model: those rules need
the layers above (``framework.launch.optimizer_rules``, ``framework.launch.rules``).
"""

from __future__ import annotations

import math
from typing import Any

from framework.config.rules.rule import (
    MAX_EVAL_BATCHES,
    MAX_EVAL_TOKENS,
    MAX_GLOBAL_BATCH,
    MAX_POSITIONS,
    MAX_STEPS,
    TYPED,
    Rule,
    integer,
    is_int,
    is_number,
    number,
)
from framework.config.schema import Config, EvalSet


def _eval_tokens(v: int, c: Config) -> int:
    return v * c.train.global_batch_size * (c.train.seq_len + 1)


def _eval_batches_ok(v: Any, c: Config) -> bool:
    return is_int(v) and 1 <= v <= MAX_EVAL_BATCHES and _eval_tokens(v, c) <= MAX_EVAL_TOKENS


def _eval_batches_valid(c: Config) -> str:
    t = c.train
    most = max(1, min(MAX_EVAL_BATCHES, MAX_EVAL_TOKENS // (t.global_batch_size * (t.seq_len + 1))))
    return (
        f"an integer in 1..{most}: the validation batches are built up front, at most {MAX_EVAL_TOKENS} "
        f"tokens (train.global_batch_size={t.global_batch_size} x train.seq_len+1={t.seq_len + 1} each)"
    )


def _momentum_ok(v: Any, c: Config) -> bool:
    return is_number(v) and 0 <= v < 1 and not (c.optimizer.nesterov and v == 0)


TRAIN_RULES: dict[str, Rule] = {
    # train
    "train.steps": integer(0, MAX_STEPS, what="0 plans, builds and evaluates without training"),
    "train.global_batch_size": integer(1, MAX_GLOBAL_BATCH, what="sequences per optimizer step"),
    "train.micro_batch_size": integer(
        0, MAX_GLOBAL_BATCH, what="0 = the rank's whole share of the global batch"
    ),
    "train.seq_len": integer(1, MAX_POSITIONS),
    "train.lr": number(0, 10, lo_open=True, bad=(math.nan, math.inf, -0.01, 0.0, 1e18)),
    "train.min_lr_ratio": number(0, 1, bad=(-0.1, 1.5, math.nan)),
    "train.warmup_steps": integer(0, MAX_STEPS),
    "train.weight_decay": number(0, 10),
    "train.beta1": number(0, 1, hi_open=True, bad=(1.0, -0.1, math.nan)),
    "train.beta2": number(0, 1, hi_open=True, bad=(1.0, 1.5, math.nan)),
    "train.grad_clip": number(0, 1e6, what="0 = no clipping, the norm is still logged"),
    # One device, one micro-batch, no clip: framework.planner.plan._check_in_backward (the loop asserts it).
    "train.optimizer_in_backward": TYPED,
    "train.in_backward_grad_checks": TYPED,
    "train.seed": integer(0, 2**32 - 1),
    "train.log_every": integer(1, MAX_STEPS),
    "train.eval_every": integer(0, MAX_STEPS, what="0 = no evaluation"),
    "train.eval_sets": Rule(
        "[] (none) or entries {name, source, path, field, column} with unique names and data of at least "
        "one window (train.eval_every>0)",
        checked_by="framework.data.checks.check_eval_sets",
        bad=([EvalSet(name="", path="a.jsonl")],),
    ),
    "train.eval_batches": Rule(_eval_batches_valid, _eval_batches_ok, (0, 10**8, 10**1000)),
}


# The keys after optimizer.kwargs (framework.launch.optimizer_rules has name, _target_, kwargs and
# state_dtype: they build the loop's optimizer).
OPTIMIZER_RULES: dict[str, Rule] = {
    "optimizer.momentum": Rule(
        "a number in [0, 1); > 0 with optimizer.nesterov=true", _momentum_ok, (-0.1, 1.0, math.nan)
    ),
    "optimizer.nesterov": TYPED,  # its relation to momentum: optimizer.momentum
    "optimizer.muon_adjust_lr": TYPED,
    "optimizer.muon_ns_steps": integer(1, 99, what="torch.optim.Muon refuses 100 or more"),
}


LR_SCHEDULER_RULES: dict[str, Rule] = {
    "lr_scheduler.name": TYPED,
    "lr_scheduler.decay_fraction": number(0, 1, bad=(-0.1, 1.5, math.nan)),
}


# peft (framework.models.lora): the targets, rank and adapter are checked against the meta model's own
# Linears (framework.launch.rules); the values the config alone decides here.
PEFT_RULES: dict[str, Rule] = {
    "peft.method": TYPED,
    "peft.alpha": number(0, 2**16, lo_open=True, bad=(0.0, -1.0, math.nan, math.inf, 1e18)),
    "peft.dropout": number(0, 1, hi_open=True, bad=(-0.1, 1.0, math.nan)),
    "peft.base_dtype": Rule(
        "float32 or bfloat16 (float32 with FSDP: framework.parallel.lora.check_layout, after the plan)",
        lambda v, c: getattr(v, "value", v) != "float16",
        ("float16",),
        context=(("peft.method", "lora"),),
    ),
}
