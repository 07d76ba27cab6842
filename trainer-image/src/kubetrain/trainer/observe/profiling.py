"""torch.profiler over chosen steps: spec.profile.steps on every rank, or, on rank 0, the next N steps of
a running job when asked (contract.PROFILE_ANNOTATION on its pod, or contract.PROFILE_REQUEST_FILE in a
local run's output directory). Traces go to <checkpoint dir>/profiles as `rank<R>-steps<A>-<B>.pt.trace.json`
(Chrome trace format: TensorBoard's profiler plugin and Perfetto open them).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kubetrain.core import contract
from kubetrain.core.api import TrainingJobSpec

log = logging.getLogger("kubetrain.trainer")
REQUEST = re.compile(r"^\s*([0-9]{1,6})\s*(?::.*)?$")
MAX_REQUESTED_STEPS = 1000


def requested_steps(value: str | None) -> int | None:
    """`N` or `N:<tag>` -> N (1 to MAX_REQUESTED_STEPS); None for anything else."""
    match = REQUEST.match(value or "")
    if match is None:
        return None
    n = int(match.group(1))
    return n if 1 <= n <= MAX_REQUESTED_STEPS else None


class StepProfiler:
    """Call before_step(step) and after_step(step) around every optimizer step (step counts from 1)."""

    def __init__(self, spec: TrainingJobSpec, rank: int, ckpt_root: Path, device: torch.device,
                 requests: Callable[[], str | None] = lambda: None) -> None:
        self.rank, self.dir, self.requests = rank, ckpt_root / contract.PROFILES_DIR, requests
        self.window = spec.profile.first_last if spec.profile is not None else None
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.handled: str | None = requests()  # a request made before this generation started is not new
        self.active: profile | None = None

    def before_step(self, step: int) -> None:
        raw = self.requests()
        if raw != self.handled and raw is not None and (n := requested_steps(raw)) is not None and self.active is None:
            self.handled, self.window = raw, (step, step + n - 1)
            log.info("profiling steps %d-%d as asked (%s=%r)", step, step + n - 1, contract.PROFILE_ANNOTATION, raw)
        if self.window is not None and step == self.window[0] and self.active is None:
            self.active = profile(activities=self.activities, record_shapes=True, with_stack=False)
            self.active.__enter__()

    def after_step(self, step: int) -> Path | None:
        if self.active is None or self.window is None or step < self.window[1]:
            return None
        self.active.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"rank{self.rank}-steps{self.window[0]}-{self.window[1]}.pt.trace.json"
        self.active.export_chrome_trace(str(path))
        self.active, self.window = None, None
        log.info("profiler trace of rank %d written: %s", self.rank, path)
        return path
