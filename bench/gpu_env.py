"""The process group, device and peak FLOP/s that bench/gpu.py measures on.

One process (a local process group of one, on a free loopback port) or one rank of
``torchrun`` (which sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT).
NCCL on CUDA, gloo on CPU. Nothing here needs a GPU to import or to run.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from support.ports import free_port  # bench/support: a link to tests/support

from kubetrain.core import contract
from kubetrain.trainer.observe.metrics import peak_flops

PG_TIMEOUT = timedelta(minutes=10)
"""Long enough for a 1B-parameter DeepSpeed init or a checkpoint of ~12 GB on one rank."""


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    rank: int
    world_size: int
    local_rank: int
    backend: str
    cpu_group: Any
    """A gloo group for the timings, barriers and object broadcasts (CPU values)."""
    ckpt_group: Any
    """A gloo group for DCP's async save only: DCP's async path needs a CPU backend, and its
    background thread's collectives must not interleave with any other group's."""

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        """Wait for the device's queued work, so that a wall clock brackets it."""
        if self.cuda:
            torch.cuda.synchronize(self.device)


def start(device: str) -> Runtime:
    """Join (or, outside torchrun, make) the process group; ``device`` is auto, cuda or cpu."""
    if contract.RANK not in os.environ:
        os.environ.update(
            {
                contract.MASTER_ADDR: "127.0.0.1",
                contract.MASTER_PORT: str(free_port()),
                contract.RANK: "0",
                contract.WORLD_SIZE: "1",
                contract.LOCAL_RANK: "0",
            }
        )
    rank, world = int(os.environ[contract.RANK]), int(os.environ[contract.WORLD_SIZE])
    local = int(os.environ.get(contract.LOCAL_RANK, "0"))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    backend = "nccl" if use_cuda else "gloo"
    dist.init_process_group(
        backend, init_method="env://", timeout=PG_TIMEOUT, device_id=dev if use_cuda else None
    )
    cpu_group = dist.new_group(backend="gloo") if use_cuda else dist.group.WORLD
    return Runtime(dev, rank, world, local, backend, cpu_group, dist.new_group(backend="gloo"))


def stop() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def max_over_ranks(rt: Runtime, value: float) -> float:
    """The slowest rank's time: a collective is as fast as its slowest participant."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=rt.cpu_group)
    return float(t)


def peak(rt: Runtime, precision: str, override_tflops: float | None) -> tuple[float | None, str | None]:
    """Peak dense FLOP/s of one device and where it came from; (None, None) when unknown (CPU)."""
    if override_tflops:
        return override_tflops * 1e12, "--peak-tflops"
    value = peak_flops(rt.device, precision)  # kubetrain's table (H100/H200 989e12 bf16) or KUBETRAIN_PEAK_FLOPS
    return value, ("kubetrain.trainer.observe.metrics" if value else None)


def _version(dist_name: str) -> str | None:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe(rt: Runtime) -> dict[str, Any]:
    """What ran: device name, software versions, process count."""
    name = torch.cuda.get_device_name(rt.device) if rt.cuda else cpu_name()
    info: dict[str, Any] = {
        "type": rt.device.type,
        "name": name,
        "count": rt.world_size,
        "backend": rt.backend,
        "torch": torch.__version__,
        "cuda": torch.version.cuda if rt.cuda else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if rt.cuda else None,
        "deepspeed": _version("deepspeed"),
        "python": platform.python_version(),
        "cpu_threads": torch.get_num_threads(),
        "cpu": cpu_name(),
    }
    if rt.cuda:
        info["memory_bytes"] = torch.cuda.get_device_properties(rt.device).total_memory
    return info
