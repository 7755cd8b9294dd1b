"""Which collectives gloo runs on CUDA tensors, with ranks sharing one GPU (run.cuda_backend=gloo).

    python benchmarks/gloo_cuda_probe.py [WORLD]

Context parallelism needs all-gather (the forward's K/V, ``set_rotate_method("allgather")``) and
all-to-all (the backward's dK/dV ring, and the forward's with ``"alltoall"``); FSDP2 needs
all-gather and reduce-scatter; the loop's loss and clip need all-reduce; a pipeline needs send/recv.
Each is checked against the value it must produce. Send/recv runs in its own processes: if gloo
reads a device pointer as host memory it may crash rather than raise. Prints one line per collective.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def _collectives(rank: int, world: int) -> dict[str, object]:
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    x = torch.arange(4, dtype=torch.float32, device=dev) + 10 * rank
    every = torch.cat([torch.arange(4, dtype=torch.float32) + 10 * r for r in range(world)]).to(dev)
    out: dict[str, object] = {}

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        out[name] = "ok" if torch.equal(got.cpu(), want.cpu()) else f"WRONG {got.tolist()} != {want.tolist()}"

    probes = {
        "all_reduce": lambda: _all_reduce(x, world, check),
        "broadcast": lambda: _broadcast(x, check),
        "all_gather_into_tensor": lambda: _all_gather(x, every, world, check),
        "reduce_scatter_tensor": lambda: _reduce_scatter(every, rank, world, check),
        "all_to_all_single": lambda: _all_to_all(every, rank, world, check),
        "funcol.permute_tensor (CP ring)": lambda: _permute(x, rank, world, check),
        "funcol.all_gather_tensor (CP allgather)": lambda: check(
            "funcol.all_gather_tensor (CP allgather)",
            funcol.all_gather_tensor(x, 0, dist.group.WORLD).wait(),
            every,
        ),
    }
    for name, fn in probes.items():
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the report is the point
            out[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return out


def _all_reduce(x: torch.Tensor, world: int, check) -> None:  # noqa: ANN001
    y = x.clone()
    dist.all_reduce(y)
    check("all_reduce", y, sum(torch.arange(4.0) + 10 * r for r in range(world)))


def _broadcast(x: torch.Tensor, check) -> None:  # noqa: ANN001
    y = x.clone()
    dist.broadcast(y, 0)
    check("broadcast", y, torch.arange(4.0))


def _all_gather(x: torch.Tensor, every: torch.Tensor, world: int, check) -> None:  # noqa: ANN001
    y = torch.empty(4 * world, device=x.device)
    dist.all_gather_into_tensor(y, x)
    check("all_gather_into_tensor", y, every)


def _reduce_scatter(every: torch.Tensor, rank: int, world: int, check) -> None:  # noqa: ANN001
    y = torch.empty(4, device=every.device)
    dist.reduce_scatter_tensor(y, every)
    check("reduce_scatter_tensor", y, every.cpu()[4 * rank : 4 * rank + 4] * world)


def _all_to_all(every: torch.Tensor, rank: int, world: int, check) -> None:  # noqa: ANN001
    src = every + 100 * rank  # rank r sends chunk j (its values + 100 r) to rank j
    y = torch.empty_like(src)
    dist.all_to_all_single(y, src)
    want = torch.cat([every.cpu()[4 * rank : 4 * rank + 4] + 100 * r for r in range(world)])
    check("all_to_all_single", y, want)


def _permute(x: torch.Tensor, rank: int, world: int, check) -> None:  # noqa: ANN001
    # As torch's _AllToAllRotater: rank r sends to r + 1, so it receives from r - 1.
    y = funcol.permute_tensor(x, list(range(1, world)) + [0], dist.group.WORLD).wait()
    check("funcol.permute_tensor (CP ring)", y, torch.arange(4.0) + 10 * ((rank - 1) % world))


def _send_recv(rank: int, world: int) -> dict[str, object]:
    x = torch.full((4,), float(rank + 1), device=torch.device("cuda", rank % torch.cuda.device_count()))
    try:
        if rank == 0:
            dist.send(x, 1)
            return {"send/recv (pipeline)": "sent"}
        if rank == 1:
            y = torch.zeros_like(x)
            dist.recv(y, 0)
            ok = torch.equal(y.cpu(), torch.ones(4))
            return {"send/recv (pipeline)": "ok" if ok else f"WRONG {y.tolist()}"}
        return {}
    except Exception as e:  # noqa: BLE001
        return {"send/recv (pipeline)": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}


def _rank(rank: int, world: int, port: int, probe: str, q: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = (_collectives if probe == "collectives" else _send_recv)(rank, world)
    q.put((rank, result))
    dist.barrier()
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def probe(world: int, name: str) -> dict[str, object]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, name, q)) for r in range(world)]
    for p in procs:
        p.start()
    merged: dict[str, object] = {}
    try:
        for _ in procs:
            rank, result = q.get(timeout=30)
            for k, v in result.items():
                prev = merged.get(k)
                merged[k] = v if prev in (None, "sent", v) else f"rank {rank}: {v} (other: {prev})"
    except Exception as e:  # noqa: BLE001 - a crashed rank never answers
        merged.setdefault(f"{name}", f"no answer: {type(e).__name__}")
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    codes = [p.exitcode for p in procs]
    if any(c not in (0, None) for c in codes):
        merged[f"{name}: exit codes"] = codes
    return merged


def main() -> None:
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    print(f"torch {torch.__version__}, {torch.cuda.device_count()} GPU(s), {world} gloo ranks on them")
    for name in ("collectives", "send_recv"):
        for k, v in probe(world, name).items():
            print(f"  {k:42s} {v}")


if __name__ == "__main__":
    main()
