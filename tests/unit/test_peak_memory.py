"""Peak memory per rank in the open (observe/memory.py): this process's figures, the steps the gang gathers them
at, rank 0's report, its way into status (and one Warning Event per memory notice), and the metric."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry
from support.process_group import gloo_world_of_one

from kubetrain.core.api import ConditionReason, MemoryReport, RankMemory, TrainingJobStatus
from kubetrain.core.cli import memory_line
from kubetrain.core.lifecycle.model import Observed
from kubetrain.core.lifecycle.status import memory_event, take_progress
from kubetrain.core.preflight import MAX_REPORTED_RANKS
from kubetrain.core.progress import Progress
from kubetrain.trainer.observe import memory
from kubetrain.trainer.observe.memory import NO_DEVICE, PeakMemory, memory_report, report_due, status_bytes
from kubetrain.trainer.observe.metrics import Metrics

STATUS = "Name:\tpython\nVmPeak:\t  900000 kB\nVmHWM:\t  123456 kB\nVmRSS:\t  100000 kB\n"


@pytest.mark.parametrize(("field", "found"), [
    ("VmHWM", 123456 * 1024), ("VmRSS", 100000 * 1024), ("VmSwap", None), ("Name", None),
])
def test_status_fields_in_bytes(field: str, found: int | None) -> None:
    assert status_bytes(STATUS, field) == found


@pytest.mark.parametrize(("step", "first", "final", "checkpoint", "due"), [
    (1, True, False, False, True), (7, False, False, False, False), (10, False, False, True, True),
    (13, False, True, False, True), (memory.REPORT_EVERY_STEPS, False, False, False, True),
])
def test_the_gang_gathers_at_the_steps_progress_goes_out_at_once(step, first, final, checkpoint, due) -> None:
    assert report_due(step, first=first, final=final, checkpoint=checkpoint) is due


def test_rank_0s_report_names_every_rank_and_worker() -> None:
    report = memory_report(2, 10, [(5, NO_DEVICE), (9, NO_DEVICE), (7, NO_DEVICE), (6, NO_DEVICE)], procs=2)
    assert (report.generation, report.step, report.host_peak_bytes, report.device_peak_bytes) == (2, 10, 9, None)
    assert [(r.rank, r.worker, r.host_peak_bytes, r.device_peak_bytes) for r in report.ranks] == [
        (0, 0, 5, None), (1, 0, 9, None), (2, 1, 7, None), (3, 1, 6, None)]
    gpu = memory_report(0, 1, [(5, 40), (6, 30)], procs=2)
    assert gpu.device_peak_bytes == 40 and [r.device_peak_bytes for r in gpu.ranks] == [40, 30]


def test_a_large_gang_lists_its_highest_host_peaks() -> None:
    rows = [(r, NO_DEVICE) for r in range(MAX_REPORTED_RANKS + 44)]
    report = memory_report(0, 1, rows, procs=8)
    assert len(report.ranks) == MAX_REPORTED_RANKS and report.ranks[0].rank == 44  # the lowest 44 left out
    assert report.host_peak_bytes == MAX_REPORTED_RANKS + 43


def test_a_rank_reports_its_peaks_each_step_and_gathers_at_report_steps() -> None:
    metrics = Metrics("j", 0, None, registry=CollectorRegistry())
    with gloo_world_of_one():
        peaks = PeakMemory(rank=0, generation=3, procs=1, device=torch.device("cpu"), metrics=metrics)
        quiet: dict[str, Any] = {}
        assert peaks.after_step(7, quiet, first=False, final=False, checkpoint=False) is None
        report = peaks.after_step(10, record := {}, first=False, final=False, checkpoint=True)
    assert quiet["host_peak_bytes"] > 0 and "device_peak_bytes" not in quiet  # the CPU has no device peak
    assert report is not None and report.step == 10 and report.generation == 3
    assert [(r.rank, r.host_peak_bytes) for r in report.ranks] == [(0, record["host_peak_bytes"])]
    assert metrics.registry.get_sample_value("kubetrain_trainer_peak_memory_bytes",
                                             {"job": "j", "rank": "0", "kind": "host"}) == record["host_peak_bytes"]


def test_the_device_peak_outlives_the_per_step_reset() -> None:
    metrics = Metrics("j", 0, None, registry=CollectorRegistry())
    for peak in (300, 100):  # each step's own peak (torch's is reset every step)
        metrics.observe_device_memory(50, 400, peak)
    assert metrics.device_peak_bytes == 300


def _status_after(progress: Progress, status: TrainingJobStatus | None = None) -> TrainingJobStatus:
    status = status or TrainingJobStatus(restart_generation=progress.generation)
    take_progress(status, Observed(progress=progress), datetime(2025, 1, 1, tzinfo=UTC))
    return status


def test_the_report_reaches_status_and_a_notice_warns_once() -> None:
    report = MemoryReport(generation=0, step=1, host_peak_bytes=9, ranks=[RankMemory(rank=0, worker=0, host_peak_bytes=9)],
                          notices=["checkpoint.memory is off: worker 0: ..."])
    before = TrainingJobStatus()
    after = _status_after(Progress(step=1, memory=report), before.model_copy(deep=True))
    assert after.memory == report
    event = memory_event(before, after)
    assert event is not None and event.type == "Warning" and event.reason == ConditionReason.MEMORY_BUDGET
    assert event.message == "checkpoint.memory is off: worker 0: ..."
    again = _status_after(Progress(step=2, memory=report), after.model_copy(deep=True))
    assert memory_event(after, again) is None  # said once


def test_a_restarted_gang_keeps_the_last_figures_until_it_reports_its_own() -> None:
    old = MemoryReport(generation=0, step=40, host_peak_bytes=9)
    status = TrainingJobStatus(restart_generation=1, memory=old, current_step=40)
    after = _status_after(Progress(generation=1, step=31), status)
    assert after.memory == old  # the generation that ran out of memory left these
    new = MemoryReport(generation=1, step=31, host_peak_bytes=7)
    assert _status_after(Progress(generation=1, step=32, memory=new), after).memory == new


def test_the_run_summary_says_the_highest_peaks_and_the_notices() -> None:
    report = MemoryReport(step=4, host_peak_bytes=3 * 2**30, device_peak_bytes=2**31, notices=["tier off"], ranks=[
        RankMemory(rank=0, worker=0, host_peak_bytes=2**30, device_peak_bytes=2**31),
        RankMemory(rank=1, worker=0, host_peak_bytes=3 * 2**30, device_peak_bytes=2**30)])
    assert memory_line(report.dump()) == "memory: peak host 3.00 GiB (rank 1), GPU 2.00 GiB (rank 0) at step 4; tier off"


def test_a_large_models_frees_are_unmapped_and_a_small_ones_keep_glibcs_own_threshold() -> None:
    """glibc's mallopt(M_MMAP_THRESHOLD) answers 1 when set (in a child: the setting is the process's); a small
    model and a user's MALLOC_MMAP_THRESHOLD_ leave it alone."""
    large = memory.LARGE_MODEL_BYTES // 4
    assert memory.mmap_threshold(large) == memory.MMAP_THRESHOLD_BYTES == 256 * 1024
    assert memory.mmap_threshold(large - 1) is None
    assert memory.unmap_large_frees(large - 1, {}) is False
    assert memory.unmap_large_frees(large, {"MALLOC_MMAP_THRESHOLD_": "65536"}) is False
    child = subprocess.run([sys.executable, "-c", "from kubetrain.trainer.observe import memory; "
                            f"print(memory.unmap_large_frees({large}, {{}}))"], capture_output=True, text=True,
                           check=True)
    assert child.stdout.strip() == "True"
