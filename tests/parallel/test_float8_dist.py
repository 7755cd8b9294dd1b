"""model.float8 under FSDP2 and FSDP x TP on real gloo ranks, through the framework's own
``parallelize`` and scale precompute, against one process with float8 (torch 2.13's CPU build runs
``torch._scaled_mm`` on float8 tensors; train.py itself refuses float8 on the CPU).

The data-parallel ranks read identical halves of each global batch. An activation's or a
gradient's float8 scale comes from the amax over the rank's own tokens, so with different halves
every rank would quantize its activations differently from one process, by design. With identical
halves they are one process's amaxes (the gradients' exactly twice, a power of two, which the
scaling reproduces exactly), and what is left to differ is what FSDP must reproduce itself: the
weight's scale, from the amax all-reduced over its shards, and the gradient reduction. So the
float8 runs match one process to fp32 rounding (RTOL), while float8 off is 3-11% away.

What cannot run on gloo: the backward of torchao's float8 TP styles (``tensorwise`` with TP)
all-gathers gradients in float8, and gloo has no float8 collectives ("RuntimeError: Invalid scalar
type"); FSDP2's float8 all-gather moves bytes and runs. So FSDP x TP is checked in forward here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from framework.checkpoint import Checkpointer
from framework.config.schema import CheckpointConfig, Config, Float8Recipe
from framework.parallel import dp_mesh_info
from tests.checkpoint.test_checkpoint import _digest, _lr
from tests.dist import run_ranks
from tests.parallel.test_parallel import make_cfg, parallel_model

pytest.importorskip("torchao.float8", reason="torchao is the float8 extra (CI installs it)")

from torchao.float8.float8_utils import amax_to_scale  # noqa: E402
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # noqa: E402

from framework.parallel.float8 import attach_scale_precompute, is_float8  # noqa: E402

SEQ, GLOBAL_BATCH, STEPS, LR = 32, 4, 3, 1e-3
# Measured: FSDP vs one process, gradients 2.0e-7 and weights after 3 AdamW steps 3.3e-6 (largest
# per-tensor Frobenius relative error), losses within one fp32 ulp; FSDP x TP logits 1.6e-7.
RTOL = 1e-5
CKPT_STEP = 2


def batches() -> list[torch.Tensor]:
    """Global batches whose two halves are the same sequences (see the module docstring)."""
    g = torch.Generator().manual_seed(1)
    halves = [torch.randint(0, 256, (GLOBAL_BATCH // 2, SEQ + 1), generator=g) for _ in range(STEPS)]
    return [torch.cat([h, h]) for h in halves]


def float8_cfg(strategy: str, shape: list[int], tp: int, recipe: Float8Recipe) -> Config:
    cfg = make_cfg(strategy, shape, tp)
    cfg.train.global_batch_size = GLOBAL_BATCH
    cfg.train.micro_batch_size = GLOBAL_BATCH // (cfg.mesh.world_size // tp)
    cfg.model.float8 = recipe
    cfg.model.float8_size_filter = False  # the tiny model's layers are below torchao's thresholds
    cfg.model.n_layers = 1  # a float8 cast can turn an fp32 rounding into a float8 step: fewer casts
    return cfg


ONE = {r: float8_cfg("fsdp", [1], 1, r) for r in (Float8Recipe.tensorwise, Float8Recipe.none)}
FSDP = float8_cfg("fsdp", [2], 1, Float8Recipe.tensorwise)


def _full(t: torch.Tensor) -> np.ndarray:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().numpy().copy()


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _worst(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """The largest per-tensor relative (Frobenius) error of ``a`` against ``b``."""
    return max(_rel(a[k], b[k]) for k in b)


def _gathered(model: nn.Module) -> list[tuple[nn.Module, DTensor]]:
    """The float8 layers whose weights FSDP2 all-gathers in float8, with those weights."""
    return [
        (m, m.weight)
        for m in model.modules()
        if is_float8(m)
        and isinstance(m.weight, DTensor)
        and isinstance(m.weight._local_tensor, WeightWithDynamicFloat8CastTensor)
    ]


def _scale_errors(model: nn.Module) -> list[float]:
    """|precomputed scale - the scale of the whole weight| per float8-all-gathered weight (collective)."""
    out = []
    for _, w in _gathered(model):
        pre = w._local_tensor._precomputed_scale
        assert pre is not None, "no precomputed scale after the optimizer step"
        out.append((pre - amax_to_scale(w.full_tensor().abs().max(), torch.float8_e4m3fn)).abs().item())
    return out


def _batch(step: int, mesh: Any, plan: Any) -> torch.Tensor:
    """This rank's part of global batch ``step`` (TP ranks of one data-parallel group share it)."""
    dp_rank, dp_size = dp_mesh_info(mesh, plan)
    n = GLOBAL_BATCH // dp_size
    return batches()[step][dp_rank * n : (dp_rank + 1) * n]


def _mean(loss: torch.Tensor) -> float:
    """Every rank's loss, averaged."""
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


def _build(cfg: Config) -> tuple[nn.Module, torch.optim.Optimizer, Any, Any, Any, bool]:
    """As the runner builds: ``parallelize``, the optimizer, then the scale precompute on both."""
    model, mesh, plan = parallel_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    attached = attach_scale_precompute(model, opt)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, _lr), mesh, plan, attached


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Forward and backward; the loss."""
    logits = model(x[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
    loss.backward()
    return loss


def _train_worker(rank: int, world: int, cfg: Config, root: str | None) -> dict[str, Any]:
    """``STEPS`` AdamW steps; the first step's gradients; with ``root``, a checkpoint (and the state's
    digest) after step ``CKPT_STEP``."""
    model, opt, sched, mesh, plan, attached = _build(cfg)
    out: dict[str, Any] = {"losses": [], "attached": attached, "gathered": len(_gathered(model))}
    for step in range(STEPS):
        if root is not None and step == CKPT_STEP:
            out["digest"] = _digest(model, opt)
            ck = Checkpointer(CheckpointConfig(enabled=True), Path(root))
            ck.save(step, model, opt, sched, {"step": step})
            ck.close()
        loss = _loss(model, _batch(step, mesh, plan))
        if step == 0:
            out["grads"] = {k: _full(p.grad) for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        sched.step()
        out["losses"].append(_mean(loss))
    out["weights"] = {k: _full(v) for k, v in model.state_dict().items()}
    out["scale_errors"] = _scale_errors(model)
    return out


@pytest.fixture(scope="module")
def one_process() -> dict[Float8Recipe, dict[str, Any]]:
    """One process (world 1, through the same path), with float8 tensorwise and without float8."""
    return {r: run_ranks(_train_worker, 1, cfg, None)[0] for r, cfg in ONE.items()}


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """FSDP2 on 2 ranks, tensorwise: the float8 all-gather and the scale precompute; a checkpoint."""
    root = tmp_path_factory.mktemp("float8_fsdp")
    return run_ranks(_train_worker, 2, FSDP, str(root))[0], root


def test_fsdp_float8_all_gather_matches_one_process(one_process: dict, fsdp: tuple) -> None:
    ref, plain = one_process[Float8Recipe.tensorwise], one_process[Float8Recipe.none]
    r0, _ = fsdp
    assert r0["gathered"] == 7 and r0["attached"]  # every block Linear, the head kept out
    assert not ref["attached"]  # one process: no FSDP all-gather, nothing to precompute
    # After each step the precomputed scales are the whole weights' scales, to the bit.
    assert r0["scale_errors"] == [0.0] * 7
    np.testing.assert_allclose(r0["losses"], ref["losses"], rtol=RTOL)
    assert _worst(r0["grads"], ref["grads"]) < RTOL
    assert _worst(r0["weights"], ref["weights"]) < RTOL
    assert _worst(plain["grads"], ref["grads"]) > 1e-2  # float8 off: the test can fail


def _logits_worker(rank: int, world: int, cfg: Config) -> np.ndarray:
    model, _, _, mesh, plan, _ = _build(cfg)
    x = _batch(0, mesh, plan)
    return model(x[:, :-1]).detach().numpy().copy()


def test_fsdp_tp_float8_forward_matches_one_process() -> None:
    """Tensorwise under FSDP x TP on 4 ranks: torchao's float8 TP styles, and FSDP's float8
    all-gather of TP-sharded weights. Forward only (module docstring). Without the precompute at
    build, each TP shard's weight would get the scale of its own amax (the per-forward amax is
    reduced over the FSDP axis only): 3% off one process in the logits."""
    logits = run_ranks(_logits_worker, 4, float8_cfg("fsdp_tp", [2, 2], 2, Float8Recipe.tensorwise))
    one = run_ranks(_logits_worker, 1, ONE[Float8Recipe.tensorwise])[0]
    plain = run_ranks(_logits_worker, 1, ONE[Float8Recipe.none])[0]
    assert np.array_equal(logits[0], logits[1])  # the two TP ranks of data-parallel rank 0
    got = np.concatenate([logits[0], logits[2]])  # data-parallel ranks 0 and 1
    assert _rel(got, one) < RTOL
    assert _rel(plain, one) > 1e-2


def _resume_worker(rank: int, world: int, cfg: Config, root: str, save_to: str | None) -> dict[str, Any]:
    """Load the checkpoint in ``root`` (at step ``CKPT_STEP``): the loaded state's digest; then save
    it to ``save_to``, or train on to the end."""
    model, opt, sched, mesh, plan, _ = _build(cfg)
    if cfg.model.float8 is Float8Recipe.none:
        # As in a process that never imported torchao's float8 (whose import allowlists its weight
        # subclass for ``torch.load(weights_only=True)``): this fork inherited the import.
        torch.serialization.clear_safe_globals()
    ck = Checkpointer(CheckpointConfig(enabled=True), Path(root))
    path = ck.latest()
    assert path is not None
    ck.load(path, model, opt, sched)
    ck.close()
    out: dict[str, Any] = {"digest": _digest(model, opt), "losses": []}
    if save_to is not None:
        again = Checkpointer(CheckpointConfig(enabled=True), Path(save_to))
        again.save(CKPT_STEP, model, opt, sched, {"step": CKPT_STEP})
        again.close()
        return out
    for step in range(CKPT_STEP, STEPS):
        loss = _loss(model, _batch(step, mesh, plan))
        opt.step()
        opt.zero_grad()
        sched.step()
        out["losses"].append(_mean(loss))
    return out


def test_checkpoint_of_float8_fsdp_resumes_without_float8_and_back(fsdp: tuple, tmp_path: Path) -> None:
    """The claim: checkpoints hold the high-precision weights, so a float8 run resumes without
    float8 and the other way round. Float8 FSDP on 2 ranks -> float8 off on 1 rank (saved again)
    -> float8 FSDP on 2 ranks, which trains on exactly as the uninterrupted run did: its first
    step after the load casts the loaded weights with their own scales (before the fix it used
    the scales precomputed from the initial weights: loss 5.5878 for 5.5863). The files hold plain
    tensors: before the fix they pickled torchao's weight subclass, which a run with float8 off
    could not unpickle ("Unsupported global: ...WeightWithDynamicFloat8CastTensor")."""
    r0, root = fsdp
    off = run_ranks(_resume_worker, 1, ONE[Float8Recipe.none], str(root), str(tmp_path / "off"))[0]
    back = run_ranks(_resume_worker, 2, FSDP, str(tmp_path / "off"), None)[0]
    assert off["digest"] == r0["digest"] == back["digest"]  # model and optimizer state, bitwise
    assert back["losses"] == r0["losses"][CKPT_STEP:]
