"""Background checkpoint writes (checkpoint/background.py, CheckpointManager): the pure decisions, the in-flight
save's states, and the manager's rules on a one-process gloo group with a real tiny engine: commit only
after the write finished, at most one write in flight, the last save waits for its write, a failed
write fails the rank and is never committed, and exiting never commits a write still in flight."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
from support.process_group import gloo_world_of_one
from support.trainer_harness import tiny_spec
from support.waiting import wait_for

from kubetrain.core.api import CheckpointSpec, TrainingJobSpec
from kubetrain.core.progress import COMMIT_MARKER, complete_checkpoints
from kubetrain.trainer.checkpoint import background
from kubetrain.trainer.checkpoint.background import (
    WRITE_DELAY_ENV,
    CheckpointWriteError,
    InFlight,
    commit_due,
    save_waits_for_its_write,
    writes_in_background,
    writes_running,
)
from kubetrain.trainer.checkpoint.directory import TrainerState
from kubetrain.trainer.checkpoint.manager import CheckpointManager
from kubetrain.trainer.model import build_model
from kubetrain.trainer.observe.metrics import Metrics
from kubetrain.trainer.parallel.engines import make_engine


@pytest.mark.parametrize(
    ("strategy", "enabled", "expected"),
    [("ddp", True, True), ("fsdp", True, True), ("deepspeed", True, False), ("ddp", False, False)],
)
def test_background_writes_for_ddp_and_fsdp_only(strategy: str, enabled: bool, expected: bool) -> None:
    assert writes_in_background(CheckpointSpec(async_save=enabled), strategy) is expected


@pytest.mark.parametrize(
    ("final", "stopping", "waits"), [(False, False, False), (True, False, True), (False, True, True), (True, True, True)]
)
def test_the_last_save_and_a_stop_wait_for_their_write(final: bool, stopping: bool, waits: bool) -> None:
    assert save_waits_for_its_write(final=final, stopping=stopping) is waits


@pytest.mark.parametrize(
    ("in_flight", "finished", "world", "commit"),
    [(False, 0, 2, False), (False, 2, 2, False), (True, 0, 2, False), (True, 1, 2, False), (True, 2, 2, True),
     (True, 1, 1, True)],
)
def test_commit_only_when_every_ranks_write_finished(in_flight: bool, finished: int, world: int, commit: bool) -> None:
    assert commit_due(in_flight, finished, world) is commit


def in_flight(future: Future[Any]) -> InFlight:
    return InFlight(4, Path("/ckpt/step-00000004"), TrainerState(step=4), future, started=0.0, stall=0.01)


def test_an_in_flight_write_is_finished_only_once_its_future_succeeded() -> None:
    future: Future[Any] = Future()
    job = in_flight(future)
    assert not job.finished() and job.ended is None and job.status() == "still running"
    future.set_result(None)
    assert job.finished() and job.ended is not None and job.status() == "finished"


def test_a_failed_write_raises_naming_the_step_and_directory() -> None:
    future: Future[Any] = Future()
    future.set_exception(OSError("No space left on device"))
    job = in_flight(future)
    assert job.status() == "failed: No space left on device"
    for check in (job.finished, lambda: job.wait(1.0)):
        with pytest.raises(CheckpointWriteError, match=r"checkpoint step 4: .* /ckpt/step-00000004 failed: No space"):
            check()


def test_waiting_for_a_stuck_write_is_bounded() -> None:
    with pytest.raises(CheckpointWriteError, match="did not finish within 0 s"):
        in_flight(Future()).wait(0.05)


# ---------------------------------------------------------------- the manager on one process


class Reports:
    """The loop's Reporter as the manager sees it: the commits it is told about."""

    def __init__(self) -> None:
        self.commits: list[tuple[int, Path, float]] = []

    def resumed(self, step: int, tier: str = "durable") -> None:
        pass

    def checkpoint(self, state: TrainerState, path: Path, seconds: float) -> None:
        self.commits.append((state.step, path, seconds))


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[CheckpointManager]:
    with gloo_world_of_one():
        spec = TrainingJobSpec.model_validate(tiny_spec(checkpoint={"everySteps": 2, "keep": 3}))
        engine = make_engine(spec, build_model(spec.model, False, spec.seed), torch.device("cpu"), 1)
        m = CheckpointManager(tmp_path, spec.checkpoint, engine, Metrics("t", 0, None), Reports())
        yield m
        # a test that left a write running: let it end before the group goes
        wait_for(lambda: not writes_running(), 30, what="the background write to end")
        m.close()


def committed(m: CheckpointManager) -> list[int]:
    return [s for s, _ in complete_checkpoints(m.root)]


def finish_step(m: CheckpointManager) -> None:
    """What the loop does after each step on a world of one: vote, then decide."""
    m.after_step(1 if m.write_done() else 0)


def test_a_background_save_is_committed_after_its_write_finished(manager: CheckpointManager) -> None:
    state = TrainerState(step=2, world_size=1, strategy="ddp")
    assert manager.maybe_save(state, final=False, stopping=False) is None
    assert manager.in_flight is not None and committed(manager) == []
    state.samples_seen = 99  # training goes on: the commit writes the state as of step 2
    wait_for(lambda: manager.write_done(), 30, what="the write")
    finish_step(manager)
    assert manager.in_flight is None and committed(manager) == [2]
    assert '"samples_seen": 0' in (manager.root / "step-00000002" / "trainer.json").read_text()
    reports: Any = manager.reporter
    assert [(s, p.name) for s, p, _ in reports.commits] == [(2, "step-00000002")]


def test_at_most_one_write_in_flight(manager: CheckpointManager, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WRITE_DELAY_ENV, "0.5")
    manager.maybe_save(TrainerState(step=2, world_size=1), final=False, stopping=False)
    finish_step(manager)  # still writing: nothing to commit yet
    assert committed(manager) == []
    manager.maybe_save(TrainerState(step=4, world_size=1), final=False, stopping=False)
    # the save of step 4 waited for step 2's write and committed it before staging its own
    assert committed(manager) == [2] and manager.in_flight is not None and manager.in_flight.step == 4
    assert manager.in_flight.stall >= 0.4  # the wait is part of the stall


def test_the_last_save_commits_the_pending_one_and_itself(manager: CheckpointManager) -> None:
    manager.maybe_save(TrainerState(step=2, world_size=1), final=False, stopping=False)
    path = manager.maybe_save(TrainerState(step=3, world_size=1), final=True, stopping=False)
    assert path is not None and path.name == "step-00000003"
    assert manager.in_flight is None and committed(manager) == [2, 3]


def test_a_failed_write_fails_the_rank_and_is_never_committed(
    manager: CheckpointManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = background.storage_writer

    def broken(directory: Path) -> Any:
        writer = real(directory)

        def fail(*_: Any) -> Any:
            raise OSError("disk full")

        writer.write_data = fail
        return writer

    monkeypatch.setattr(background, "storage_writer", broken)
    manager.maybe_save(TrainerState(step=2, world_size=1), final=False, stopping=False)
    wait_for(lambda: manager.in_flight is not None and manager.in_flight.future.done(), 30, what="the write")
    with pytest.raises(CheckpointWriteError, match=r"(?s)checkpoint step 2: .*step-00000002\.writing failed: .*disk full"):
        manager.write_done()
    manager.close()
    assert committed(manager) == [] and not (manager.root / "step-00000002" / COMMIT_MARKER).exists()


def test_exiting_never_commits_a_write_in_flight(manager: CheckpointManager, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(WRITE_DELAY_ENV, "0.3")
    manager.maybe_save(TrainerState(step=2, world_size=1), final=False, stopping=False)
    job = manager.in_flight
    manager.close()
    assert job is not None and writes_running()
    wait_for(lambda: job.future.done(), 30, what="the write")
    assert committed(manager) == []
