"""Peak memory per rank: the host's (peak resident set, VmHWM) and, on CUDA, torch's peak allocated memory.

Every rank reads its own figures after each step, without a collective, for its metrics (and rank 0 for its
losses.jsonl line). At the steps where rank 0's progress record goes out at once (the first, every checkpoint,
the last) and every REPORT_EVERY_STEPS, one all_gather of two numbers per rank brings every rank's figures to
rank 0's record (api.MemoryReport), whence the job's status.memory and the local run's summary.

Once a large model is built (on the meta device, before any of its storage) the trainer also fixes glibc's mmap
threshold (:func:`unmap_large_frees`), so that buffers freed during a step leave the resident set instead of staying
as heap fragments.
"""

from __future__ import annotations

import ctypes
import os
import resource
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kubetrain.core import contract
from kubetrain.core.api import MemoryReport, RankMemory
from kubetrain.core.preflight import MAX_REPORTED_RANKS
from kubetrain.trainer.observe.metrics import Metrics

REPORT_EVERY_STEPS = 100
"""Besides the first, checkpoint and last steps, the gang gathers its figures every this many steps."""
PROC_STATUS = Path("/proc/self/status")
NO_DEVICE = -1
"""A rank's device peak in the gather where it has none (CPU)."""


MMAP_THRESHOLD_BYTES = 256 << 10
"""For a large model, allocations of at least this size get a mapping of their own, returned to the OS when freed."""
LARGE_MODEL_BYTES = 256 << 20
"""A model with at least this many bytes of fp32 weights (64M parameters) gets the fixed threshold."""
M_MMAP_THRESHOLD = -3
"""mallopt's parameter number (glibc malloc.h)."""


def mmap_threshold(parameters: int) -> int | None:
    """glibc's mmap threshold for a rank training a model of `parameters` (its whole count), None for glibc's own.

    glibc raises its threshold to the size of each large block freed (up to 32 MiB), so the next blocks of that
    size come from the heap and freed ones stay resident: FSDP2's per-block all-gather and reduce-scatter buffers
    (a block's whole parameters each) then kept every rank at several times its shards, and freed activations and
    gradients of 256 KiB to 1 MiB another 0.2x the weights (docs/benchmarks.md). Fixed at MMAP_THRESHOLD_BYTES,
    each is unmapped at once; but every such allocation then costs a mapping and fresh pages, which a small model's
    step on CPU feels (15-20 % fewer tokens/s, measured) and a large one's does not, while what glibc keeps of a
    small model is small. So: fixed from LARGE_MODEL_BYTES of weights, glibc's own below."""
    return MMAP_THRESHOLD_BYTES if 4 * parameters >= LARGE_MODEL_BYTES else None


def unmap_large_frees(parameters: int, environ: Mapping[str, str] = os.environ) -> bool:
    """Fix glibc's mmap threshold where :func:`mmap_threshold` says so; whether it was set. A MALLOC_MMAP_THRESHOLD_
    in the environment (the user's own choice) is left alone; not glibc (musl, macOS): nothing to do."""
    threshold = mmap_threshold(parameters)
    if threshold is None or environ.get("MALLOC_MMAP_THRESHOLD_"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))


# ---------------------------------------------------------------- pure


def status_bytes(text: str, field: str) -> int | None:
    """A `/proc/<pid>/status` field in bytes (`VmHWM:    123 kB` -> 125952); None where it is missing."""
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == field:
            number, _, unit = value.strip().partition(" ")
            return int(number) * (1024 if unit.strip() == "kB" else 1) if number.isdigit() else None
    return None


def report_due(step: int, *, first: bool, final: bool, checkpoint: bool) -> bool:
    """Whether every rank gathers its figures after `step`: the same answer on every rank."""
    return first or final or checkpoint or step % REPORT_EVERY_STEPS == 0


def memory_report(generation: int, step: int, rows: Sequence[tuple[int, int]], procs: int) -> MemoryReport:
    """Rank 0's record of every rank's (host peak, device peak or NO_DEVICE), by rank; a gang larger than
    MAX_REPORTED_RANKS lists the ranks with the highest host peaks (the maxima are the whole gang's)."""
    ranks = [RankMemory(rank=r, worker=r // max(1, procs), host_peak_bytes=host,
                        device_peak_bytes=None if device == NO_DEVICE else device)
             for r, (host, device) in enumerate(rows)]
    devices = [r.device_peak_bytes for r in ranks if r.device_peak_bytes is not None]
    listed = sorted(ranks, key=lambda r: -r.host_peak_bytes)[:MAX_REPORTED_RANKS]
    highest = max((r.host_peak_bytes for r in ranks), default=0)
    return MemoryReport(generation=generation, step=step, host_peak_bytes=highest,
                        device_peak_bytes=max(devices) if devices else None, ranks=sorted(listed, key=lambda r: r.rank))


# ---------------------------------------------------------------- this process


def host_peak_bytes() -> int:
    """This process's peak resident set since it started: VmHWM, else getrusage's ru_maxrss (KiB on Linux)."""
    try:
        found = status_bytes(PROC_STATUS.read_text(), "VmHWM")
    except OSError:
        found = None
    return found if found is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def host_resident_bytes() -> int:
    """This process's resident set now (VmRSS), else its peak."""
    try:
        found = status_bytes(PROC_STATUS.read_text(), "VmRSS")
    except OSError:
        found = None
    return found if found is not None else host_peak_bytes()


class PeakMemory:
    """One rank's peaks after each step; at report steps, every rank's gathered to rank 0 (a collective)."""

    def __init__(self, rank: int, generation: int, procs: int, device: torch.device, metrics: Metrics) -> None:
        self.rank, self.generation, self.procs = rank, generation, procs
        self.device = device
        self.metrics = metrics

    @classmethod
    def of_rank(cls, rank: int, generation: int, device: torch.device, metrics: Metrics) -> PeakMemory:
        """With the contract's processes per worker (LOCAL_WORLD_SIZE), which name each rank's worker."""
        return cls(rank, generation, int(os.environ.get(contract.LOCAL_WORLD_SIZE) or 1), device, metrics)

    def after_step(self, step: int, record: dict[str, Any], *, first: bool, final: bool,
                   checkpoint: bool) -> MemoryReport | None:
        """This rank's figures into its metrics and `record` (losses.jsonl); at :func:`report_due` steps (every
        rank alike) every rank's, returned on rank 0 (None elsewhere and between reports)."""
        host, device = host_peak_bytes(), self.metrics.device_peak_bytes
        record["host_peak_bytes"] = host
        if device is not None:
            record["device_peak_bytes"] = device
        self.metrics.observe_peak_memory(host, device)
        if not report_due(step, first=first, final=final, checkpoint=checkpoint):
            return None
        rows = self._gather(host, NO_DEVICE if device is None else device)
        return memory_report(self.generation, step, rows, self.procs) if self.rank == 0 else None

    def _gather(self, host: int, device: int) -> list[tuple[int, int]]:
        mine = torch.tensor([host, device], dtype=torch.int64, device=self.device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        return [(int(t[0]), int(t[1])) for t in every]
