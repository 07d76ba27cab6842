"""Training throughput: kubetrain's trainer (FSDP2, DeepSpeed ZeRO-3) against a hand-written loop.

The trainer variants are built as ``python -m kubetrain.trainer`` builds them: the trainer's
model on the meta device (``build_model(meta=True)``, no storage), glibc's mmap threshold fixed
for its size, then ``make_engine`` (its sharding, each rank's shards alone materialised on the
device, its optimizer, scheduler and mixed precision; ZeRO-3 builds the model again under
``deepspeed.zero.Init``), its data sampler, and per step its ``train_step`` plus the per-step
loss all-reduce (``mean_loss_and_stop``). The baseline is the same model built whole on the
device with ``torch.optim.AdamW``, autocast and gradient clipping, and nothing else (DDP only
when there is more than one process). Each step is bracketed by a device synchronisation;
warm-up steps (and with them torch.compile's compilation) are not timed; tokens/s come from the
median step time. Each variant also records its build time (model build to engine or optimizer
ready) and the process's host peak resident set (VmHWM, reset at the variant's start where Linux
allows it).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import gpu_model
import torch
from gpu_env import Runtime, max_over_ranks
from torch import nn

from kubetrain.core.api import TrainingJobSpec
from kubetrain.trainer.data.text import Sampler, load_corpus
from kubetrain.trainer.loop import mean_loss_and_stop, train_step
from kubetrain.trainer.model import build_model
from kubetrain.trainer.observe.memory import status_bytes, unmap_large_frees
from kubetrain.trainer.parallel.engines import Engine, make_engine

Step = Callable[[int], "float | torch.Tensor"]
"""One optimizer step; its mean loss (a tensor is read only after the timed steps: no extra sync)."""
T = TypeVar("T")
Parts = tuple[nn.Module, nn.Module, torch.optim.Optimizer]
"""The hand-written loop's model, the module it calls (the model, or DDP around it) and its optimizer."""
PROC_SELF = Path("/proc/self")


@dataclass(frozen=True)
class Variant:
    name: str
    loop: str
    """"trainer" (kubetrain's) or "baseline" (hand-written)."""
    strategy: str
    """The trainer's strategy (fsdp, deepspeed); the baseline's "ddp" means DDP only past one process."""
    compiled: bool


VARIANTS = (
    Variant("baseline", "baseline", "ddp", False),
    Variant("fsdp2", "trainer", "fsdp", False),
    Variant("baseline-compiled", "baseline", "ddp", True),
    Variant("fsdp2-compiled", "trainer", "fsdp", True),
    # ZeRO-3 gathers parameters in module hooks that torch.compile would graph-break on; kubetrain
    # does not turn on DeepSpeed's own compiler, so DeepSpeed runs eager. Last: it leaves global state.
    Variant("deepspeed-zero3", "trainer", "deepspeed", False),
)


@dataclass(frozen=True)
class Timing:
    warmup: int
    steps: int


def sampler_for(spec: TrainingJobSpec) -> Sampler:
    return Sampler(load_corpus(spec.data, spec.model.seq_len), spec.model.seq_len, spec.seed)


def trainer_engine(rt: Runtime, spec: TrainingJobSpec) -> Engine:
    """The model and engine as the trainer's loop builds them (loop.py ``_train``): on the meta device, then
    ``make_engine`` gives each rank's shards their storage."""
    model = build_model(spec.model, spec.activation_checkpointing, spec.seed, meta=True)
    unmap_large_frees(sum(p.numel() for p in model.parameters()))  # as the trainer does, before any storage
    return make_engine(spec, model, rt.device, rt.world_size)


def trainer_step(rt: Runtime, spec: TrainingJobSpec, compiled: bool) -> tuple[Step, float]:
    """One optimizer step of kubetrain's trainer loop (without its logging and checkpoint policy), compiled as
    spec.compile compiles (make_engine, between tensor parallelism and FSDP2); and the seconds to build it."""
    spec = spec.model_copy(update={"compile": compiled})
    engine, build_s = timed(rt, lambda: trainer_engine(rt, spec))
    sampler = sampler_for(spec)
    mbs, ga = spec.micro_batch_size, spec.gradient_accumulation_steps

    def step(i: int) -> float:
        batches = sampler.micro_batches(i, mbs, ga, rt.world_size, rt.rank)
        local_loss, _lr, _info = train_step(engine, batches)
        loss, _stop, _writes = mean_loss_and_stop(local_loss, False, rt.device)
        return loss

    return step, build_s


def baseline_parts(rt: Runtime, spec: TrainingJobSpec, compiled: bool) -> Parts:
    """The hand-written loop's model built whole on the device, the model it calls (DDP past one process), and
    its AdamW."""
    model = gpu_model.build(spec, rt.device)
    if compiled:
        gpu_model.compile_blocks(model)
    wrapped: nn.Module = model
    if rt.world_size > 1:
        wrapped = nn.parallel.DistributedDataParallel(model, device_ids=[rt.device.index] if rt.cuda else None)
    o = spec.optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)
    return model, wrapped, opt


def baseline_step(rt: Runtime, spec: TrainingJobSpec, compiled: bool) -> tuple[Step, float]:
    """The minimal loop: forward under autocast, backward, clip, AdamW, zero_grad; and the seconds to build it."""
    (model, wrapped, opt), build_s = timed(rt, lambda: baseline_parts(rt, spec, compiled))
    o = spec.optimizer
    amp = gpu_model.compute_dtype(spec.precision)
    sampler = sampler_for(spec)
    mbs, ga = spec.micro_batch_size, spec.gradient_accumulation_steps

    def step(i: int) -> torch.Tensor:
        batches = sampler.micro_batches(i, mbs, ga, rt.world_size, rt.rank)
        total = torch.zeros((), device=rt.device)
        for m, (x, y) in enumerate(batches):
            skip_sync = rt.world_size > 1 and m < ga - 1
            with wrapped.no_sync() if skip_sync else contextlib.nullcontext():  # type: ignore[operator]
                with torch.autocast(rt.device.type, dtype=amp, enabled=amp != torch.float32):
                    loss = wrapped(x.to(rt.device, non_blocking=True), y.to(rt.device, non_blocking=True))
                (loss / ga).backward()
            total += loss.detach()
        if o.grad_clip > 0:
            nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total / ga

    return step, build_s


def timed(rt: Runtime, build: Callable[[], T]) -> tuple[T, float]:
    """What ``build`` returns and its seconds, between device synchronisations (the slowest rank's)."""
    rt.sync()
    t0 = time.perf_counter()
    built = build()
    rt.sync()
    return built, max_over_ranks(rt, time.perf_counter() - t0)


def reset_host_peak() -> bool:
    """Set the process's VmHWM back to its present resident set (Linux 4.0+: clear_refs 5); whether it could."""
    try:
        (PROC_SELF / "clear_refs").write_text("5")
    except OSError:
        return False
    return True


def host_peak_gib() -> float | None:
    """The process's peak resident set (VmHWM) in GiB; None without /proc."""
    try:
        peak = status_bytes((PROC_SELF / "status").read_text(), "VmHWM")
    except OSError:
        return None
    return None if peak is None else peak / 2**30


def time_steps(rt: Runtime, step: Step, timing: Timing) -> tuple[list[float], float, float]:
    """Seconds of each timed step (the slowest rank's), the last step's loss, and the first (warm-up) step's
    seconds: a compiled variant's compilation."""
    seconds: list[float] = []
    first = 0.0
    loss: float | torch.Tensor = float("nan")
    for i in range(timing.warmup + timing.steps):
        rt.sync()
        t0 = time.perf_counter()
        loss = step(i)
        rt.sync()
        if i == 0:
            first = time.perf_counter() - t0
        if i >= timing.warmup:
            seconds.append(time.perf_counter() - t0)
    seconds = [max_over_ranks(rt, s) for s in seconds]
    return seconds, float(loss), max_over_ranks(rt, first)


def release(rt: Runtime, compiled: bool) -> None:
    """Free the last variant's model, optimizer and compiled graphs before the next one."""
    if compiled:
        torch._dynamo.reset()
    gc.collect()
    if rt.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(rt.device)


def measure(rt: Runtime, shape: gpu_model.Shape, variant: Variant, timing: Timing) -> dict[str, Any]:
    """Tokens/s, step times, peak device and host memory, build time and the last loss of one variant."""
    spec = gpu_model.job_spec(shape, variant.strategy, timing.warmup + timing.steps)
    make = trainer_step if variant.loop == "trainer" else baseline_step
    release(rt, False)
    reset = reset_host_peak()
    step, build_s = make(rt, spec, variant.compiled)
    seconds, loss, first = time_steps(rt, step, timing)
    peak_mem = torch.cuda.max_memory_allocated(rt.device) if rt.cuda else None
    host_peak = host_peak_gib()
    del step
    release(rt, variant.compiled)
    median = statistics.median(seconds)
    tokens = shape.tokens_per_step(rt.world_size)
    return {
        "build_s": build_s,
        "first_step_seconds": first,
        "step_seconds_median": median,
        "step_seconds": seconds,
        "tokens_per_step": tokens,
        "tokens_per_second": tokens / median,
        "tokens_per_second_per_gpu": tokens / median / rt.world_size,
        "peak_memory_bytes": peak_mem,
        "host_peak_rss_gib": host_peak,
        "host_peak_since": "variant start" if reset else "process start",
        "last_loss": loss,
    }
