"""Context parallelism (framework.parallel.context): torch's ring attention, where it can run.

On the CPU it cannot: the first test pins down why (it fails, on purpose, the day torch runs CP on
the CPU, so the refusal in framework.layout.check_cp can be lifted). The equivalence test (cp=2 vs
one process, rtol 1e-5) needs 2 CUDA devices and skips cleanly without them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from framework.config import Config, Device, ModelConfig, ParallelConfig, ResidualDtype
from framework.model import build_model, materialize
from framework.parallel import build_mesh, parallelize
from framework.parallel.context import sequence_shard
from framework.plan import make_plan
from tests.dist import run_ranks

SEQ, BATCH, STEPS, RTOL = 32, 2, 3, 1e-5


def _torch_cp_on_cpu(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except NotImplementedError as e:
        return str(e)
    return "ran"


def test_torch_ring_attention_does_not_run_on_cpu() -> None:
    """What the CPU refusal rests on: DTensor has no sharding strategy for the CPU SDPA kernel."""
    errors = run_ranks(_torch_cp_on_cpu, 1)  # one rank hits the same dispatch
    assert errors[0] != "ran", (
        "torch now runs context_parallel on the CPU: lift framework.layout.check_cp's refusal"
    )
    assert (
        "aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy"
        in errors[0]
    )


def _cfg(cp: int) -> Config:
    """The tiny Llama with MHA in fp32 (the memory-efficient kernel: fp32, no GQA), TF32 off."""
    cfg = Config(model=ModelConfig(n_kv_heads=4, residual_dtype=ResidualDtype.float32))
    cfg.mesh.shape = [cp]
    cfg.parallel = ParallelConfig(cp=cp) if cp > 1 else ParallelConfig()
    cfg.run.device = Device.cuda
    cfg.train.seq_len = SEQ
    cfg.train.global_batch_size = BATCH
    cfg.train.micro_batch_size = BATCH
    return cfg


def _train(model: torch.nn.Module, device: torch.device, shard) -> list[float]:  # noqa: ANN001
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        batch = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g).to(device)
        x, y = batch[:, :-1].clone(), batch[:, 1:].clone()
        if shard is None:
            loss = model(x, y)
            loss.backward()
        else:
            with shard(x, y):
                loss = model(x, y)
                loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(mean)
            mean /= dist.get_world_size()
        losses.append(mean.item())
    return losses


def _cuda_rank(rank: int, world: int, store_path: str, q: mp.Queue) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", store=dist.FileStore(store_path, world), rank=rank, world_size=world, device_id=device
    )
    try:
        cfg = _cfg(world)
        plan = make_plan(cfg)
        mesh = build_mesh(plan, "cuda")
        model = parallelize(
            build_model(cfg.model, SEQ), mesh, plan, cfg.sharding, cfg.bucketing, cfg.executor, device, 0
        )
        q.put((rank, _train(model, device, sequence_shard(model, mesh, plan))))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="context parallelism runs on CUDA: needs 2 GPUs")
def test_cp2_matches_one_process_on_cuda() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = _cfg(1)
    model = build_model(cfg.model, SEQ)
    materialize(model, torch.device("cuda", 0), 0)
    reference = _train(model, torch.device("cuda", 0), None)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        procs = [ctx.Process(target=_cuda_rank, args=(r, 2, os.path.join(d, "store"), q)) for r in range(2)]
        for p in procs:
            p.start()
        results = dict(q.get(timeout=300) for _ in procs)
        for p in procs:
            p.join(timeout=60)
    assert results[0] == results[1]
    assert results[0] == pytest.approx(reference, rel=RTOL)
