"""Preflight: after joining the gang and before step 0 of every generation, each rank measures

- its own compute: a matmul benchmark (fp32 on CPU for COMPUTE_SECONDS of wall time, bf16 on a GPU), GFLOP/s;
- the gang's all-reduce bus bandwidth (gloo or NCCL): algbw x 2(n-1)/n over a few MB, a few iterations;
- a neighbour exchange: a buffer sent to rank+1 and one received from rank-1 at once, timed. A slow rank or
  link slows the two ranks beside it, not the whole gang: that tells a bad link or rank from a slow network.

Rank 0 gathers every rank's figures (all_gather_object) into its progress record (api.Preflight); the verdict
(kubetrain.core.preflight) is the lifecycle's, rank 0 only logs it. docs/trainer.md#preflight.
"""

from __future__ import annotations

import logging
import os
import socket
import time

import torch
import torch.distributed as dist

from kubetrain.core import contract
from kubetrain.core.api import Preflight, PreflightRank, TrainingJobSpec
from kubetrain.core.preflight import degraded_ranks, summarize, verdict_message
from kubetrain.trainer.config import Env
from kubetrain.trainer.observe.metrics import Metrics

log = logging.getLogger("kubetrain.trainer")

COMPUTE_SECONDS = 0.25
"""Wall time of one matmul trial on CPU: several CPU quota periods (100 ms), so a throttled pod shows it."""
COMPUTE_TRIALS = 2
"""Trials; the best counts, so a moment's contention from another process does not make a rank look slow."""
CPU_MATMUL, GPU_MATMUL = 256, 4096
"""Matrix sizes of the benchmark (n x n by n x n)."""
GPU_BATCH = 10
"""GPU matmuls queued between synchronizations."""
COLLECTIVE_BYTES = 4 * 1024 * 1024
"""All-reduce and neighbour exchange buffer size."""
COLLECTIVE_ITERATIONS = 5
"""Timed all-reduces and exchanges (after one untimed warm-up each)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_gflops(device: torch.device, seconds: float = COMPUTE_SECONDS) -> float:
    """This rank's matmul rate: repeated products for `seconds` of wall time (at least one batch)."""
    cuda = device.type == "cuda"
    n, dtype, batch = (GPU_MATMUL, torch.bfloat16, GPU_BATCH) if cuda else (CPU_MATMUL, torch.float32, 1)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.matmul(a, b)  # warm-up: kernels chosen, threads started
    _sync(device)
    done, t0 = 0, time.perf_counter()
    while True:
        for _ in range(batch):
            torch.matmul(a, b)
        _sync(device)
        done += batch
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return 2 * n**3 * done / elapsed / 1e9


def allreduce_busbw_gbps(device: torch.device, world_size: int) -> float | None:
    """The gang's all-reduce bus bandwidth in GB/s as this rank timed it (None in a gang of one)."""
    if world_size < 2:
        return None
    t = torch.ones(COLLECTIVE_BYTES // 4, dtype=torch.float32, device=device)
    dist.all_reduce(t)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(COLLECTIVE_ITERATIONS):
        dist.all_reduce(t)
    _sync(device)
    algbw = COLLECTIVE_BYTES * COLLECTIVE_ITERATIONS / (time.perf_counter() - t0)
    return algbw * 2 * (world_size - 1) / world_size / 1e9


def exchange_seconds(device: torch.device, rank: int, world_size: int) -> float | None:
    """Mean seconds of one send to rank+1 with one receive from rank-1 (None in a gang of one)."""
    if world_size < 2:
        return None
    send = torch.ones(COLLECTIVE_BYTES // 4, dtype=torch.float32, device=device)
    recv = torch.empty_like(send)

    def once() -> None:
        ops = [dist.P2POp(dist.isend, send, (rank + 1) % world_size),
               dist.P2POp(dist.irecv, recv, (rank - 1) % world_size)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        _sync(device)

    once()
    t0 = time.perf_counter()
    for _ in range(COLLECTIVE_ITERATIONS):
        once()
    return (time.perf_counter() - t0) / COLLECTIVE_ITERATIONS


def node_name() -> str:
    """The pod's node (Downward API), else this machine's hostname (a local run)."""
    return os.environ.get(contract.NODE_NAME) or socket.gethostname()


def measure(env: Env, device: torch.device) -> tuple[PreflightRank, float | None]:
    """This rank's figures and its timing of the all-reduce bus bandwidth (collective: every rank calls it)."""
    dist.barrier()  # ranks benchmark together: the same neighbours on a shared machine, no rank still starting
    gflops = max(matmul_gflops(device) for _ in range(COMPUTE_TRIALS))
    busbw = allreduce_busbw_gbps(device, env.world_size)
    seconds = exchange_seconds(device, env.rank, env.world_size)
    worker = int(os.environ.get(contract.NODE_RANK) or 0)
    row = PreflightRank(rank=env.rank, worker=worker, node=node_name(), gflops=round(gflops, 3),
                        exchange_seconds=None if seconds is None else round(seconds, 6))
    return row, busbw


def run(env: Env, spec: TrainingJobSpec, device: torch.device, metrics: Metrics) -> Preflight | None:
    """The preflight (collective), unless spec.preflight turns it off: rank 0's report, None on other ranks."""
    if not spec.preflight.enabled:
        return None
    t0 = time.perf_counter()
    row, busbw = measure(env, device)
    metrics.observe_preflight(row.gflops, busbw, row.exchange_seconds)
    rows: list[dict[str, object] | None] = [None] * env.world_size
    dist.all_gather_object(rows, row.dump())
    if env.rank != 0:
        return None
    report = summarize([PreflightRank.model_validate(r) for r in rows], generation=env.generation,
                       seconds=time.perf_counter() - t0, busbw_gbps=busbw, world_size=env.world_size)
    _log(report, spec.preflight.degraded_fraction)
    return report


def _log(report: Preflight, fraction: float) -> None:
    exchange = f", exchange median {report.median_exchange_seconds * 1e3:.2f} ms" \
        if report.median_exchange_seconds is not None else ""
    busbw = f", all-reduce busbw {report.bus_bandwidth_gbps:.3f} GB/s" if report.bus_bandwidth_gbps is not None else ""
    log.info("preflight: %d rank(s), compute median %.1f GFLOP/s (slowest rank %s)%s%s; took %.2f s",
             report.world_size, report.median_gflops, report.slowest_rank, busbw, exchange, report.seconds)
    if found := degraded_ranks(report, fraction):
        log.warning("%s", verdict_message(found, fraction, report.generation))
