"""Prometheus metrics of one worker (``kubetrain_trainer_*``), labelled with job and rank."""

from __future__ import annotations

import logging
import os

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger("kubetrain.trainer")

PEAK_FLOPS_ENV = "KUBETRAIN_PEAK_FLOPS"
"""Peak FLOP/s of one device for the MFU estimate; overrides the built-in table."""

# Dense peak FLOP/s per device: (substring of torch.cuda.get_device_name(), bf16/fp16, fp32 via TF32).
_PEAKS: list[tuple[str, float, float]] = [
    ("H200", 989e12, 494e12),
    ("H100", 989e12, 494e12),
    ("B200", 2250e12, 1100e12),
    ("A100", 312e12, 156e12),
    ("L40S", 362e12, 183e12),
    ("L4", 121e12, 60e12),
    ("A10", 125e12, 62.5e12),
]


def uses_tf32(device_type: str, precision: str) -> bool:
    """Whether fp32 matmuls run on TF32 tensor cores (the trainer sets torch.set_float32_matmul_precision("high")
    then): precision fp32 on CUDA. bf16/fp16 compute in half precision anyway; a CPU has no TF32."""
    return device_type == "cuda" and precision == "fp32"


def table_peak(device_name: str, precision: str, tf32: bool) -> float | None:
    """The table's dense peak FLOP/s for a GPU named `device_name` (torch.cuda.get_device_name): bf16/fp16's, or
    for fp32 TF32's. fp32 without TF32 runs on the plain FP32 units, whose peak the table does not hold: None."""
    if precision == "fp32" and not tf32:
        return None
    for key, low, fp32 in _PEAKS:
        if key in device_name:
            return fp32 if precision == "fp32" else low
    return None


def peak_flops(device: torch.device, precision: str) -> float | None:
    """Peak FLOP/s of this device for the precision, or None when unknown (CPU, unlisted GPU)."""
    raw = os.environ.get(PEAK_FLOPS_ENV)
    if raw:
        try:
            return float(raw)
        except ValueError:
            log.warning("ignoring %s=%r: not a number", PEAK_FLOPS_ENV, raw)
    if device.type != "cuda":
        return None
    return table_peak(torch.cuda.get_device_name(device), precision, uses_tf32(device.type, precision))


_LABELS = ["job", "rank"]


class Metrics:
    """Gauges, histogram and counters of one worker; served on ``port`` when it is free."""

    def __init__(self, job: str, rank: int, port: int | None, registry: CollectorRegistry | None = None,
                 addr: str = "0.0.0.0") -> None:
        self.registry = registry or CollectorRegistry()
        self.labels = {"job": job, "rank": str(rank)}
        gauge, counter = self._gauge, self._counter
        self.step = gauge("kubetrain_trainer_step", "Last completed optimizer step")
        self.loss = gauge("kubetrain_trainer_loss", "Training loss of the last step (mean over ranks)")
        self.tokens_per_second = gauge(
            "kubetrain_trainer_tokens_per_second", "Tokens per second of the whole gang, last step"
        )
        self.step_seconds = Histogram(
            "kubetrain_trainer_step_seconds",
            "Wall time of one optimizer step",
            _LABELS,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=self.registry,
        )
        self.mfu = gauge("kubetrain_trainer_mfu", "Model FLOPs utilisation estimate (0-1)")
        self.eval_loss = gauge("kubetrain_trainer_eval_loss", "Loss on the held-out text at the last evaluation "
                               "(mean over ranks; spec.evalEverySteps)")
        self.checkpoint_save_seconds = gauge(
            "kubetrain_trainer_checkpoint_save_seconds",
            "Seconds training stopped for the last committed checkpoint save (a background write not included)",
        )
        self.checkpoint_load_seconds = gauge(
            "kubetrain_trainer_checkpoint_load_seconds", "Duration of the checkpoint load at start"
        )
        self.checkpoints = counter("kubetrain_trainer_checkpoints", "Checkpoints committed by this process's gang")
        self.skipped_steps = counter("kubetrain_trainer_skipped_steps", "Optimizer steps skipped (fp16 overflow)")
        self.allreduce_bytes = counter(
            "kubetrain_trainer_allreduce_bytes",
            "Gradient bytes this process passed to all-reduce (strategy ddp; after ddp.gradientCompression)",
        )
        self.restart_generation = gauge(
            "kubetrain_trainer_restart_generation", "Gang restart generation of this process"
        )
        self.cuda_memory_bytes = gauge(
            "kubetrain_trainer_cuda_memory_bytes", "CUDA memory allocated by this process (max since last step)"
        )
        self.device_memory_bytes = Gauge(
            "kubetrain_trainer_device_memory_bytes", "This rank's GPU memory as torch sees it after a step: "
            "allocated (by tensors), reserved (by the caching allocator), peak (max allocated during the step)",
            [*_LABELS, "kind"], registry=self.registry)
        self.peak_memory_bytes = Gauge(
            "kubetrain_trainer_peak_memory_bytes", "This rank's peak memory since its process started: host (its "
            "resident set, VmHWM), device (GPU memory allocated by tensors, on CUDA)", [*_LABELS, "kind"],
            registry=self.registry)
        self.device_peak_bytes: int | None = None
        """The most GPU memory allocated since the process started (torch's own peak is reset every step)."""
        self.preflight_gflops = gauge("kubetrain_trainer_preflight_gflops",
                                      "This rank's matmul rate at the generation's preflight, GFLOP/s")
        self.preflight_busbw = gauge("kubetrain_trainer_preflight_bus_bandwidth_gbps",
                                     "The gang's all-reduce bus bandwidth at the preflight as this rank timed it, GB/s")
        self.preflight_exchange = gauge("kubetrain_trainer_preflight_exchange_seconds",
                                        "This rank's neighbour exchange time at the preflight")
        self.port: int | None = None
        if port:
            try:
                start_http_server(port, addr=addr, registry=self.registry)
                self.port = port
            except OSError as exc:
                log.warning("metrics port %d unavailable (%s); continuing without a metrics endpoint", port, exc)

    def _gauge(self, name: str, documentation: str) -> Gauge:
        return Gauge(name, documentation, _LABELS, registry=self.registry)

    def _counter(self, name: str, documentation: str) -> Counter:
        return Counter(name, documentation, _LABELS, registry=self.registry)

    def set_generation(self, generation: int) -> None:
        self.restart_generation.labels(**self.labels).set(generation)

    def observe_checkpoint_load(self, seconds: float) -> None:
        self.checkpoint_load_seconds.labels(**self.labels).set(seconds)

    def observe_checkpoint_save(self, seconds: float) -> None:
        """A committed save: how long training stopped for it (the whole save when synchronous; waiting for
        the previous write plus staging when written in the background), and one more in the count."""
        self.checkpoint_save_seconds.labels(**self.labels).set(seconds)
        self.checkpoints.labels(**self.labels).inc()

    def set_eval_loss(self, loss: float) -> None:
        self.eval_loss.labels(**self.labels).set(loss)

    def observe_allreduce(self, nbytes: int) -> None:
        self.allreduce_bytes.labels(**self.labels).inc(nbytes)

    def observe_step(
        self, step: int, loss: float, tokens_per_second: float, seconds: float, mfu: float | None, skipped: bool
    ) -> None:
        lb = self.labels
        self.step.labels(**lb).set(step)
        self.loss.labels(**lb).set(loss)
        self.tokens_per_second.labels(**lb).set(tokens_per_second)
        self.step_seconds.labels(**lb).observe(seconds)
        if mfu is not None:
            self.mfu.labels(**lb).set(mfu)
        if skipped:
            self.skipped_steps.labels(**lb).inc()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.observe_device_memory(torch.cuda.memory_allocated(), torch.cuda.memory_reserved(),
                                       torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()

    def observe_preflight(self, gflops: float, busbw_gbps: float | None, exchange_seconds: float | None) -> None:
        """The generation's preflight figures (a gang of one has no bus bandwidth or exchange)."""
        self.preflight_gflops.labels(**self.labels).set(gflops)
        if busbw_gbps is not None:
            self.preflight_busbw.labels(**self.labels).set(busbw_gbps)
        if exchange_seconds is not None:
            self.preflight_exchange.labels(**self.labels).set(exchange_seconds)

    def observe_device_memory(self, allocated: int, reserved: int, peak: int) -> None:
        lb = self.labels
        self.device_peak_bytes = max(self.device_peak_bytes or 0, peak)
        self.cuda_memory_bytes.labels(**lb).set(peak)
        for kind, value in (("allocated", allocated), ("reserved", reserved), ("peak", peak)):
            self.device_memory_bytes.labels(**lb, kind=kind).set(value)

    def observe_peak_memory(self, host: int, device: int | None) -> None:
        """This rank's peaks since its process started (observe.memory.PeakMemory)."""
        self.peak_memory_bytes.labels(**self.labels, kind="host").set(host)
        if device is not None:
            self.peak_memory_bytes.labels(**self.labels, kind="device").set(device)
