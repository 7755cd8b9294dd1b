"""The plan of a LoRA run (``peft=lora``): the frozen base is held, the adapters train.

Each figure is compared with a plan of the same layout without LoRA and with the adapters of a
real model: the meta model with ``framework.models.lora.attach``'s adapters."""

from __future__ import annotations

import dataclasses
import math

import pytest

from framework.config.schema import Config, DType, ModelConfig, PeftConfig, PeftMethod, Strategy
from framework.models import build_model, lora
from framework.planner.cost import adamw_state_bytes
from framework.planner.resolve import make_plan

MODEL = ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=160, vocab_size=256)
LORA = PeftConfig(method=PeftMethod.lora, rank=4, alpha=8.0, targets=["wq", "wk", "wv", "wo", "w2"])


def _cfg(peft: PeftConfig, world: int, strategy: Strategy) -> Config:
    cfg = Config(model=MODEL, peft=peft)
    cfg.mesh.shape, cfg.sharding.strategy = [world], strategy
    # One micro batch a step: FSDP's unsharded gradient accumulation plays no part.
    cfg.train.seq_len, cfg.train.global_batch_size, cfg.train.micro_batch_size = 32, world, 1
    return cfg


def _adapter_shapes(peft: PeftConfig, model: ModelConfig = MODEL) -> list[tuple[int, ...]]:
    """The shapes of the adapters ``peft`` attaches to the real (meta) model."""
    meta = build_model(model, 32)
    lora.attach(meta, peft)
    return [tuple(p.shape) for n, p in meta.named_parameters() if lora.is_lora_name(n)]


@pytest.mark.parametrize(
    ("world", "strategy"), [(1, Strategy.ddp), (2, Strategy.ddp), (2, Strategy.fsdp)], ids=["one", "ddp", "fsdp"]
)
def test_memory_is_the_base_held_and_the_adapters_trained(world: int, strategy: Strategy) -> None:
    """params = the base (as without LoRA) + the adapters; grads = the adapters'; AdamW's two fp32
    moments = the adapters'. Under FSDP each is rank 0's shard (torch.chunk on dim 0)."""
    full, peft = make_plan(_cfg(PeftConfig(), world, strategy)), make_plan(_cfg(LORA, world, strategy))
    shard = world if strategy is Strategy.fsdp else 1
    adapters = sum(math.ceil(s[0] / shard) * s[1] for s in _adapter_shapes(LORA))
    assert adapters > 0 and full.layout == peft.layout
    assert peft.memory.params == full.memory.params + 4 * adapters
    assert peft.memory.optimizer == adamw_state_bytes(peft_cfg := _cfg(LORA, world, strategy)) * adapters
    assert adamw_state_bytes(peft_cfg) == 8
    grads = 4 * adapters
    if strategy is Strategy.ddp and world > 1:
        assert peft.memory.comm_buffers == grads  # DDP's buckets hold the adapters' gradients only
    assert peft.memory.grads == grads
    assert full.memory.grads == full.memory.params and full.memory.optimizer == 2 * full.memory.params
    # The optimizer step and the gradient accumulation: the adapters' share of the base's work.
    base = full.memory.params // 4
    assert peft.prediction.optimizer_s == pytest.approx(full.prediction.optimizer_s * adapters / base, rel=1e-9)


def test_a_bf16_base_is_held_in_two_bytes() -> None:
    peft = dataclasses.replace(LORA, base_dtype=DType.bfloat16)
    full, half = make_plan(_cfg(PeftConfig(), 1, Strategy.ddp)), make_plan(_cfg(peft, 1, Strategy.ddp))
    adapters = sum(math.prod(s) for s in _adapter_shapes(peft))
    assert half.memory.params == full.memory.params // 2 + 4 * adapters


def test_a_tied_head_and_every_linear_as_targets_count_like_the_model() -> None:
    """``targets=["*"]`` puts adapters on every Linear, the tied output head included."""
    model = dataclasses.replace(MODEL, tie_embeddings=True)
    peft = dataclasses.replace(LORA, targets=["*"])
    cfg = _cfg(peft, 1, Strategy.ddp)
    cfg.model = model
    full_cfg = _cfg(PeftConfig(), 1, Strategy.ddp)
    full_cfg.model = model
    adapters = sum(math.prod(s) for s in _adapter_shapes(peft, model))
    assert make_plan(cfg).memory.grads == 4 * adapters
    assert make_plan(cfg).memory.params == make_plan(full_cfg).memory.params + 4 * adapters


def test_the_8b_plan_drops_the_base_gradients_and_moments() -> None:
    """Llama-3-8B's shape: without LoRA the plan held fp32 gradients and two moments for all 8.0B
    parameters (89.6 GiB); with rank-8 adapters on q and v they are 13.6M parameters' worth."""
    big = ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256)
    big = dataclasses.replace(big, tie_embeddings=False)
    cfgs = [_cfg(p, 1, Strategy.ddp) for p in (PeftConfig(), PeftConfig(method=PeftMethod.lora))]
    for c in cfgs:
        c.model, c.run.dry_run = big, True
    full, peft = (make_plan(c).memory for c in cfgs)
    adapters = sum(math.prod(s) for s in _adapter_shapes(cfgs[1].peft, big))
    assert adapters == 32 * 8 * (4096 + 4096 + 4096 + 1024)
    saved = (full.grads + full.optimizer) - (peft.grads + peft.optimizer)
    assert saved == 12 * (full.params // 4 - adapters)
    assert saved / 1e9 > 95
