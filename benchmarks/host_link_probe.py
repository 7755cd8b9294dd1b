"""Pinned host <-> device copy bandwidth, what ``sharding.activation_offload`` moves its saved
activations over (the planner's offload term): ``python benchmarks/host_link_probe.py`` on a GPU."""

from __future__ import annotations

import time

import torch


def main(size: int = 2 << 30, repeats: int = 5) -> None:
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(size, dtype=torch.uint8, device="cuda")
    for name, (dst, src) in {"host->device": (device, host), "device->host": (host, device)}.items():
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        print(f"{name}: {repeats * size / (time.perf_counter() - start) / 1e9:.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
