"""The generation fence's rules (checkpoint/fence.py): who may write into the durable tier."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from support.process_group import gloo_world_of_one

from kubetrain.core.progress import COMMIT_MARKER
from kubetrain.trainer.checkpoint.directory import TrainerState, commit_checkpoint
from kubetrain.trainer.checkpoint.fence import FENCE_FILE, Fence, StaleGeneration, on_directory, parse, stale_reason

RUN = "3f9c-uid"


@pytest.mark.parametrize(
    ("found", "mine", "stale"),
    [
        (None, Fence(RUN, 0), False),
        (Fence(RUN, 2), Fence(RUN, 2), False),
        (Fence(RUN, 1), Fence(RUN, 2), False),  # a newer gang starting
        (Fence(RUN, 3), Fence(RUN, 2), True),  # a newer gang started since
        (Fence("other", 0), Fence(RUN, 5), True),  # another run took the directory over
    ],
)
def test_stale_reason(found: Fence | None, mine: Fence, stale: bool) -> None:
    assert (stale_reason(found, mine) is not None) is stale


@pytest.mark.parametrize("text", [None, "", "{", "[]", '{"run": "a"}', '{"run": "a", "generation": "x"}'])
def test_an_unreadable_fence_is_no_fence(text: str | None) -> None:
    assert parse(text) is None


def test_a_newer_generation_fences_the_older_out(tmp_path: Path) -> None:
    old, new = on_directory(tmp_path, Fence(RUN, 0)), on_directory(tmp_path, Fence(RUN, 1))
    old.claim()
    old.check()
    new.claim()
    assert parse((tmp_path / FENCE_FILE).read_text()) == Fence(RUN, 1)
    with pytest.raises(StaleGeneration, match="generation 1 of this job has started since"):
        old.check(what="commit of step 8")
    with pytest.raises(StaleGeneration):
        old.claim()  # a stale gang that starts late does not take the fence back
    assert parse((tmp_path / FENCE_FILE).read_text()) == Fence(RUN, 1)
    new.check()


def test_a_new_run_takes_the_directory_over(tmp_path: Path) -> None:
    first, second = on_directory(tmp_path, Fence("run-a", 4)), on_directory(tmp_path, Fence("run-b", 0))
    first.claim()
    second.claim()  # the job deleted and created again on the same storage starts at generation 0
    second.check()
    with pytest.raises(StaleGeneration, match="another run"):
        first.check()


def test_without_a_run_id_nothing_is_fenced(tmp_path: Path) -> None:
    unfenced = on_directory(tmp_path, None)
    unfenced.claim()
    unfenced.check()
    assert not (tmp_path / FENCE_FILE).exists()


def test_a_gang_that_starts_while_the_commit_waits_for_every_part_refuses_that_commit(tmp_path: Path) -> None:
    """The fence is read after the wait for every rank's part (up to 30 s on a slow shared volume), right before
    the marker: a newer generation that claimed the directory meanwhile stops the stale commit."""
    old, new = on_directory(tmp_path, Fence(RUN, 0)), on_directory(tmp_path, Fence(RUN, 1))
    old.claim()
    step = tmp_path / "step-00000008"
    step.mkdir()

    def newer_gang_then_last_part() -> None:
        time.sleep(0.3)
        new.claim()
        (step / "rng").mkdir()
        (step / "rng" / "rank-00000.pt").write_bytes(b"x")

    writer = threading.Thread(target=newer_gang_then_last_part)
    with gloo_world_of_one():
        writer.start()
        with pytest.raises(StaleGeneration, match="commit of step 8"):
            commit_checkpoint(tmp_path, step, TrainerState(step=8), keep=3,
                              before_commit=lambda: old.check(what="commit of step 8"))
    writer.join()
    assert not (step / COMMIT_MARKER).exists()


def test_a_stale_commit_writes_nothing_where_a_newer_gang_started(tmp_path: Path) -> None:
    """Its step directory removed by the newer gang (a torn one to it), a stale rank 0 recreates nothing."""
    old, new = on_directory(tmp_path, Fence(RUN, 0)), on_directory(tmp_path, Fence(RUN, 1))
    old.claim()
    new.claim()
    step = tmp_path / "step-00000008"
    with gloo_world_of_one(), pytest.raises(StaleGeneration):
        commit_checkpoint(tmp_path, step, TrainerState(step=8), keep=3,
                          before_commit=lambda: old.check(what="commit of step 8"))
    assert not step.exists()
