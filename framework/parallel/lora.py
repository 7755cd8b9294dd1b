"""LoRA as a parallelism concern (framework.models.lora holds the adapters): where the adapters go
in ``parallelize``'s order, and what each layout allows.

- after float8 (step 0): torchao's swap builds new Float8Linear modules from plain Linears and
  would drop adapters attached before it; attached after, the hook sits on the Float8Linear and the
  frozen base runs in float8 while the adapters stay high precision (torchao's float8 training
  needs CUDA sm89+: not run on CPU);
- before TP (step 1) and refused with ``tp > 1``: ColwiseParallel/RowwiseParallel shard every
  parameter under the module they are given, the adapters' too, on the base weight's dim, which is
  wrong for ``lora_A`` under colwise (its rank dim) and ``lora_B`` under rowwise;
- before AC / compile (steps 2-3): the hook is part of the block's forward that they wrap and trace;
- before FSDP (step 4): the adapters are sharded with their block, in the same group as the frozen
  weights (FSDP2 reduces gradients of the parameters that require them only); FSDP2 all-gathers one
  dtype per group, so ``peft.base_dtype`` other than float32 is refused with FSDP;
- the adapters' init and the base cast run after materialisation (step 5), the cast before DDP
  (step 6), which broadcasts and buckets only the parameters that require gradients.
"""

from __future__ import annotations

from torch import nn

from framework.config.schema import DType, PeftConfig, PeftMethod
from framework.models import lora


def check_layout(cfg: PeftConfig, tp: int, fsdp: bool) -> None:
    """ValueError (one line) for a layout the adapters do not support."""
    if cfg.method is PeftMethod.none:
        return
    if tp > 1:
        raise ValueError(f"peft.method=lora with tp={tp}: not supported; valid: tp=1 (DDP, FSDP, pp)")
    if fsdp and cfg.base_dtype is not DType.float32:
        raise ValueError(
            f"peft.base_dtype={cfg.base_dtype.value} with FSDP: FSDP2 all-gathers one dtype per block; "
            "valid: float32 with FSDP, or DDP / one rank"
        )


def apply_lora(model: nn.Module, cfg: PeftConfig | None, tp: int, fsdp: bool) -> None:
    """Freeze the model and attach the adapters (on meta, before TP/AC/compile/FSDP). No-op when off.
    Patterns that match nothing were refused before launch on the whole model (``lora.check``); a
    pipeline stage may hold none of the targeted layers (they are on another stage)."""
    if cfg is None or cfg.method is PeftMethod.none:
        return
    check_layout(cfg, tp, fsdp)
    lora.attach(model, cfg)


def after_materialize(model: nn.Module, cfg: PeftConfig | None, seed: int) -> None:
    """The adapters' seeded init, then the base cast (``peft.base_dtype``)."""
    if cfg is None or cfg.method is PeftMethod.none:
        return
    lora.init_adapters(model, seed)
    if cfg.adapter is not None:
        lora.load_adapter(model, cfg.adapter)
    lora.cast_base(model, lora.base_dtype(cfg))
