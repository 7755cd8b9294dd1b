"""Which collectives gloo runs on CUDA tensors when ranks share one GPU (NCCL refuses that).

    python benchmarks/gloo_cuda_probe.py [WORLD]

Context parallelism on one GPU would need gloo to run, on CUDA tensors: all-gather (the forward's
K/V, ``set_rotate_method("allgather")``) and all-to-all (the backward's dK/dV ring, and the
forward's with ``"alltoall"``); FSDP2 needs all-gather and reduce-scatter; the loop's loss and
clip need all-reduce; a pipeline needs send/recv. Each collective runs in its own WORLD fresh
processes, so that one which kills them (torch 2.11 on an H200: the first version of this script,
which ran them all in one pair, lost both ranks to SIGSEGV) is named; each result is checked
against the value it must produce. Prints one line per collective as it finishes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

Probe = Callable[[int, int, torch.device], tuple[torch.Tensor, torch.Tensor]]


def _x(rank: int, dev: torch.device) -> torch.Tensor:
    return torch.arange(4, dtype=torch.float32, device=dev) + 10 * rank


def _every(world: int, dev: torch.device) -> torch.Tensor:
    return torch.cat([_x(r, dev) for r in range(world)])


def _all_reduce(rank: int, world: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    y = _x(rank, dev)
    dist.all_reduce(y)
    return y, sum(_x(r, dev) for r in range(world))


def _broadcast(rank: int, world: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    y = _x(rank, dev)
    dist.broadcast(y, 0)
    return y, _x(0, dev)


def _all_gather(rank: int, world: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.empty(4 * world, device=dev)
    dist.all_gather_into_tensor(y, _x(rank, dev))
    return y, _every(world, dev)


def _reduce_scatter(rank: int, world: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.empty(4, device=dev)
    dist.reduce_scatter_tensor(y, _every(world, dev))
    return y, _x(rank, dev) * world


def _all_to_all(rank: int, world: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.empty(4 * world, device=dev)
    dist.all_to_all_single(y, _every(world, dev) + 100 * rank)  # chunk j (+ 100 rank) goes to rank j
    return y, torch.cat([_x(rank, dev) + 100 * r for r in range(world)])


def _permute(rank: int, world: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # As torch's _AllToAllRotater: rank r sends to r + 1, so it receives from r - 1.
    y = funcol.permute_tensor(_x(rank, dev), list(range(1, world)) + [0], dist.group.WORLD)
    return funcol.wait_tensor(y), _x((rank - 1) % world, dev)


def _funcol_all_gather(rank: int, world: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    y = funcol.all_gather_tensor(_x(rank, dev), 0, dist.group.WORLD)
    return funcol.wait_tensor(y), _every(world, dev)


def _send_recv(rank: int, world: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    y = _x(rank, dev)
    if rank == 0:
        dist.send(y, 1)
        return y, y
    if rank == 1:
        dist.recv(y, 0)
        return y, _x(0, dev)
    return y, y


PROBES: dict[str, Probe] = {
    "all_reduce (loss, clip)": _all_reduce,
    "broadcast": _broadcast,
    "all_gather_into_tensor (FSDP2)": _all_gather,
    "reduce_scatter_tensor (FSDP2)": _reduce_scatter,
    "all_to_all_single": _all_to_all,
    "funcol.permute_tensor (CP ring)": _permute,
    "funcol.all_gather_tensor (CP allgather)": _funcol_all_gather,
    "send/recv (pipeline)": _send_recv,
}


def _rank(rank: int, world: int, port: int, name: str, q: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = torch.device("cpu")  # without CUDA: a check of this script on gloo's CPU path
    if torch.cuda.is_available():
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        got, want = PROBES[name](rank, world, dev)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        ok = torch.equal(got.cpu(), want.cpu())
        q.put((rank, "ok" if ok else f"WRONG {got.tolist()} != {want.tolist()}"))
    except Exception as e:  # noqa: BLE001 - the report is the point
        q.put((rank, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"))
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def probe(world: int, name: str, timeout_s: float = 30.0) -> str:
    """One collective on ``world`` fresh gloo ranks: 'ok', the error, or how the ranks ended."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, name, q)) for r in range(world)]
    for p in procs:
        p.start()
    answers: dict[int, str] = {}
    try:
        while len(answers) < world:
            rank, answer = q.get(timeout=timeout_s)
            answers[rank] = answer
    except queue.Empty:
        pass
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()
    codes = [p.exitcode for p in procs]
    distinct = sorted(set(answers.values()))
    text = distinct[0] if len(distinct) == 1 and len(answers) == world else f"answers {answers}"
    return (
        text
        if all(c == 0 for c in codes)
        else f"{text}; exit codes {codes} (negative: killed by that signal)"
    )


def main() -> None:
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    print(
        f"torch {torch.__version__}, {torch.cuda.device_count()} GPU(s), {world} gloo ranks on them",
        flush=True,
    )
    for name in PROBES:
        print(f"  {name:42s} {probe(world, name)}", flush=True)


if __name__ == "__main__":
    main()
