"""Checkpoint stall: how long the training loop is blocked by a torch.distributed.checkpoint save
of the model and optimizer state (kubetrain's FSDP2 engine), synchronous against asynchronous.

- sync: ``dcp.save`` as the trainer's ``TorchEngine.save`` calls it; the stall is the whole save.
- async: ``dcp.async_save`` on its own gloo group (DCP's async path needs a CPU backend) with a
  reused stager: on CUDA pinned host buffers, cached across saves, filled by non-blocking
  copies. The stall is from the call until the state is staged (after that the loop may change
  the parameters again); the write to storage runs in a background thread. Only one save may
  be in flight: the previous save's future is waited on before the next one, and that wait is
  reported on its own (``waited_seconds``), as it depends on the storage and on how far apart
  saves are, not on the save call.
Between saves the loop trains ``gap`` steps; their median time is reported for both modes, so
a background write that slows training down shows up.
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import gpu_model
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from gpu_env import Runtime, max_over_ranks
from gpu_train import Step, sampler_for
from support.waiting import wait_for  # bench/support: a link to tests/support
from torch.distributed.checkpoint.state_dict import get_state_dict

from kubetrain.trainer.loop import train_step
from kubetrain.trainer.parallel.engines import Engine, make_engine


def make_stager(rt: Runtime) -> Any:
    """Pinned, cached, asynchronous staging on CUDA; plain copies on CPU (pinning needs CUDA)."""
    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: PLC0415
    except ImportError:  # torch < 2.9: cached pinned buffers, blocking copies
        from torch.distributed.checkpoint.staging import BlockingAsyncStager  # noqa: PLC0415

        return BlockingAsyncStager(cache_staged_state_dict=rt.cuda)
    gpu = rt.cuda
    return DefaultStager(
        StagingOptions(use_pinned_memory=gpu, use_shared_memory=False, use_async_staging=gpu, use_non_blocking_copy=gpu)
    )


def _spent(stager: Any) -> bool:
    """torch 2.11 closes its StateDictStager after each save (its copiers and cached pinned buffers are dropped; a
    second save fails with KeyError: <class 'type'>); later versions keep them for the next save."""
    inner = getattr(stager, "_state_dict_stager", None)
    return inner is not None and not getattr(inner, "_deepcopy_dispatch", True)


def state_of(engine: Engine) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer)
    return {"model": model_sd, "optim": optim_sd}


def state_bytes(state: dict[str, Any]) -> int:
    """Bytes of this rank's tensors in the state (its shard)."""
    total = 0
    for part in state.values():
        for value in _tensors(part):
            local = value.to_local() if hasattr(value, "to_local") else value
            total += local.numel() * local.element_size()
    return total


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return []


class Saver:
    """Numbered checkpoint directories under ``root``; each one removed once written and timed."""

    def __init__(self, rt: Runtime, root: Path) -> None:
        self.rt = rt
        self.root = root
        self.count = 0

    def next_dir(self) -> str:
        self.count += 1
        return str(self.root / f"save-{self.count}")

    def remove(self, path: str) -> None:
        dist.barrier(group=self.rt.cpu_group)  # every rank's files are written
        if self.rt.rank == 0:
            shutil.rmtree(path, ignore_errors=True)


def train_gap(rt: Runtime, step: Step, first: int, gap: int) -> list[float]:
    times = []
    for i in range(first, first + gap):
        rt.sync()
        t0 = time.perf_counter()
        float(step(i))
        rt.sync()
        times.append(time.perf_counter() - t0)
    return times


def sync_saves(rt: Runtime, engine: Engine, step: Step, saves: int, gap: int, saver: Saver) -> dict[str, Any]:
    stalls, steps = [], []
    for n in range(saves):
        steps += train_gap(rt, step, n * gap + 1, gap)
        path = saver.next_dir()
        rt.sync()
        t0 = time.perf_counter()
        dcp.save(state_of(engine), checkpoint_id=path)
        stalls.append(max_over_ranks(rt, time.perf_counter() - t0))
        saver.remove(path)
    return {"stall_seconds": stalls, "write_seconds": stalls, "waited_seconds": [0.0] * saves, "gap_steps": steps}


def _wait(upload: Future | None, saver: Saver, path: str | None) -> float:
    if upload is None or path is None:
        return 0.0
    t0 = time.perf_counter()
    upload.result()
    waited = time.perf_counter() - t0
    saver.remove(path)
    return waited


def async_saves(rt: Runtime, engine: Engine, step: Step, saves: int, gap: int, saver: Saver) -> dict[str, Any]:
    stager, stagers = make_stager(rt), 1
    stalls, waited, steps = [], [], []
    writes: list[float] = []
    upload: Future | None = None
    path: str | None = None
    for n in range(saves):
        steps += train_gap(rt, step, (saves + n) * gap + 1, gap)  # overlaps the previous save's write
        waited.append(max_over_ranks(rt, _wait(upload, saver, path)))
        path = saver.next_dir()
        rt.sync()
        t0 = time.perf_counter()
        response = dcp.async_save(state_of(engine), checkpoint_id=path, process_group=rt.ckpt_group, async_stager=stager)
        staging, upload = _futures(response)
        if staging is not None:
            staging.result()  # state copied off the parameters: the loop may go on
        stalls.append(max_over_ranks(rt, time.perf_counter() - t0))
        upload.add_done_callback(_record_end(writes, t0))
        if _spent(stager):
            stager.close()
            stager, stagers = make_stager(rt), stagers + 1
    _wait(upload, saver, path)
    # result() can return before the future's callbacks ran: the last duration may still be coming.
    wait_for(lambda: len(writes) == saves, 10.0, interval=0.01, what="the async saves' done callbacks")
    stager.close()
    return {"stall_seconds": stalls, "write_seconds": writes, "waited_seconds": waited, "gap_steps": steps,
            "stagers": stagers}


def _futures(response: Any) -> tuple[Future | None, Future]:
    """(staging, upload): an AsyncSaveResponse carries both when staging is asynchronous, else one Future."""
    if hasattr(response, "upload_completion"):
        return response.staging_completion, response.upload_completion
    return None, response


def _record_end(writes: list[float], t0: float) -> Callable[[Future], None]:
    return lambda _f: writes.append(time.perf_counter() - t0)


def summarise(raw: dict[str, Any]) -> dict[str, Any]:
    """First save (it allocates the staging buffers) apart from the steady state (the median of the rest)."""
    stalls = raw["stall_seconds"]
    rest = stalls[1:] or stalls
    return {
        **raw,
        "stall_first_seconds": stalls[0],
        "stall_steady_seconds": statistics.median(rest),
        "write_seconds_median": statistics.median(raw["write_seconds"]) if raw["write_seconds"] else None,
        "gap_step_seconds_median": statistics.median(raw["gap_steps"]),
    }


def measure(rt: Runtime, shape: gpu_model.Shape, saves: int, gap: int, root: Path) -> dict[str, Any]:
    spec = gpu_model.job_spec(shape, "fsdp", 1)
    engine = make_engine(spec, gpu_model.build(spec, rt.device), rt.device, rt.world_size)
    sampler = sampler_for(spec)

    def step(i: int) -> float:
        batches = sampler.micro_batches(i, shape.micro_batch, shape.grad_accum, rt.world_size, rt.rank)
        return float(train_step(engine, batches)[0])

    step(0)  # the optimizer's state exists from the first step on
    saver = Saver(rt, root)
    nbytes = max_over_ranks(rt, float(state_bytes(state_of(engine))))
    result = {
        "strategy": "fsdp",
        "state_bytes_per_rank": int(nbytes),
        "saves": saves,
        "gap_steps": gap,
        "dir": str(root),
        "sync": summarise(sync_saves(rt, engine, step, saves, gap, saver)),
        "async": summarise(async_saves(rt, engine, step, saves, gap, saver)),
    }
    return result


def filesystem(path: Path) -> str | None:
    """The type of the filesystem holding ``path`` (tmpfs writes to memory, not to a disk)."""
    best, kind = "", None
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    target = str(path.resolve())
    for line in mounts:
        fields = line.split()
        if len(fields) < 3 or len(fields[1]) < len(best):
            continue
        if target == fields[1] or target.startswith(fields[1].rstrip("/") + "/"):
            best, kind = fields[1], fields[2]
    return kind
