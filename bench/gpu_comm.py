"""All-reduce bandwidth through torch.distributed, defined as nccl-tests defines it.

algbw = bytes / time; busbw = algbw * 2(n-1)/n for all-reduce over n ranks (the factor
makes busbw comparable with the hardware's link bandwidth whatever n is). The time per
all-reduce is the mean over back-to-back iterations after warm-up, of the slowest rank.
With one rank nothing crosses a link: busbw is undefined (null) and algbw measures the
local no-op / copy, not a network.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from gpu_env import Runtime, max_over_ranks

MIB = 1 << 20
FULL_SIZES = [MIB << k for k in range(0, 11)]
"""1 MiB .. 1 GiB, doubling."""
TINY_SIZES = [64 << 10, 256 << 10, MIB]
"""64 KiB .. 1 MiB: gloo on a small CPU."""


def bus_factor(world_size: int) -> float | None:
    """nccl-tests' all-reduce bus-bandwidth factor 2(n-1)/n; None for a single rank."""
    return 2 * (world_size - 1) / world_size if world_size > 1 else None


def time_allreduce(rt: Runtime, nbytes: int, warmup: int, iters: int) -> float:
    """Mean seconds per all-reduce of a float32 tensor of ``nbytes``, slowest rank."""
    t = torch.zeros(nbytes // 4, dtype=torch.float32, device=rt.device)
    for _ in range(warmup):
        dist.all_reduce(t)
    rt.sync()
    dist.barrier(group=rt.cpu_group)
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t)
    rt.sync()
    return max_over_ranks(rt, (time.perf_counter() - t0) / iters)


def measure(rt: Runtime, sizes: list[int], warmup: int, iters: int) -> dict[str, Any]:
    factor = bus_factor(rt.world_size)
    rows = []
    for nbytes in sizes:
        seconds = time_allreduce(rt, nbytes, warmup, iters)
        algbw = nbytes / seconds
        rows.append(
            {
                "bytes": nbytes,
                "seconds": seconds,
                "algbw_gbps": algbw / 1e9,
                "busbw_gbps": algbw * factor / 1e9 if factor else None,
            }
        )
    note = (
        "busbw = algbw * 2(n-1)/n (nccl-tests)"
        if factor
        else "one rank: all_reduce crosses no link, busbw is undefined; algbw is a local copy, not a network"
    )
    return {
        "op": "all_reduce(sum)",
        "dtype": "float32",
        "backend": rt.backend,
        "world_size": rt.world_size,
        "busbw_factor": factor,
        "warmup": warmup,
        "iters": iters,
        "note": note,
        "sizes": rows,
    }
