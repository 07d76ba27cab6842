"""The generation fence's rules (checkpoint/fence.py): who may write into the durable tier."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest
from support.process_group import gloo_world_of_one

from kubetrain.core.progress import COMMIT_MARKER
from kubetrain.trainer.checkpoint.directory import TrainerState, commit_checkpoint, prepare_dir, writing_name
from kubetrain.trainer.checkpoint.fence import FENCE_FILE, Fence, StaleGeneration, on_directory, parse, stale_reason
from kubetrain.trainer.config import ConfigError

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


def _committed_by_the_newer_gang(root: Path, step: int) -> Path:
    final = root / f"step-{step:08d}"
    (final / "rng").mkdir(parents=True)
    (final / "rng" / "rank-00000.pt").write_bytes(b"newer")
    (final / COMMIT_MARKER).write_text("{}\n")
    return final


def _private_save(root: Path, step: int, gang: Fence, content: bytes) -> Path:
    """What a gang's ranks leave before rank 0 commits: every part in the gang's private directory."""
    path = prepare_dir(root, step, writing_name(gang))
    (path / "rng").mkdir()
    (path / "rng" / "rank-00000.pt").write_bytes(content)
    return path


def test_a_stale_gang_that_passed_the_fence_never_replaces_a_newer_commit(tmp_path: Path) -> None:
    """Frozen after its last fence check (the check and the commit are not atomic), thawed once the newer gang
    committed the same step: the rename is refused, the newer checkpoint stays byte for byte, and the stale
    gang's private directory goes."""
    old, new = on_directory(tmp_path, Fence(RUN, 0)), on_directory(tmp_path, Fence(RUN, 1))
    old.claim()
    with gloo_world_of_one():
        mine = _private_save(tmp_path, 8, Fence(RUN, 0), b"stale")
        new.claim()
        final = _committed_by_the_newer_gang(tmp_path, 8)
        marker = (final / COMMIT_MARKER).stat().st_mtime_ns
        checks = iter([None, None])  # the two checks before the marker pass: read before the newer gang claimed

        def check() -> None:
            if next(checks, "late") == "late":
                old.check(what="commit of step 8")

        with pytest.raises(StaleGeneration, match="commit of step 8"):
            commit_checkpoint(tmp_path, mine, TrainerState(step=8), keep=3, before_commit=check)
    assert (final / "rng" / "rank-00000.pt").read_bytes() == b"newer"
    assert (final / COMMIT_MARKER).stat().st_mtime_ns == marker
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000008"]


def test_a_save_is_written_aside_and_committed_by_rename(tmp_path: Path) -> None:
    """Until the rename, the step's own directory does not exist: a frozen gang writing a step holds nothing a
    newer gang's save of that step would share, and resume never sees a half-written step."""
    with gloo_world_of_one():
        path = _private_save(tmp_path, 4, Fence(RUN, 0), b"mine")
        assert path.name.startswith("step-00000004.writing-g0-")
        assert len({writing_name(Fence(RUN, 0)), writing_name(Fence(RUN, 1)), writing_name(Fence("other", 0))}) == 3
        assert not (tmp_path / "step-00000004").exists()
        final = commit_checkpoint(tmp_path, path, TrainerState(step=4), keep=3)
    assert final == tmp_path / "step-00000004"
    assert (final / COMMIT_MARKER).is_file() and (final / "rng" / "rank-00000.pt").read_bytes() == b"mine"
    assert not path.exists()


def test_the_same_step_committed_first_by_an_older_gang_stands(tmp_path: Path) -> None:
    """The other order: the old gang's commit landed first (accepted: a complete checkpoint of the same step).
    The current gang keeps it, says so, and leaves no private directory behind."""
    with gloo_world_of_one():
        final = _committed_by_the_newer_gang(tmp_path, 8)
        mine = _private_save(tmp_path, 8, Fence(RUN, 1), b"current")
        assert commit_checkpoint(tmp_path, mine, TrainerState(step=8), keep=3) == final
    assert (final / "rng" / "rank-00000.pt").read_bytes() == b"newer"
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000008"]


@pytest.mark.parametrize("code", [errno.ENOTSUP, errno.EXDEV])
def test_a_filesystem_that_renames_no_directory_is_named_as_a_configuration_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    """Faked (no FUSE mount here): the claim's filesystem refuses a directory rename, as object-store FUSE mounts
    do. The save fails once with the field and the way out, not again at every restart, and leaves nothing."""
    with gloo_world_of_one():
        path = _private_save(tmp_path, 4, Fence(RUN, 0), b"mine")

        def refuse(self: Path, target: Path) -> None:
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(Path, "rename", refuse)
        with pytest.raises(ConfigError, match=rf"^spec\.checkpoint: the filesystem under {tmp_path} refused to "
                           rf"rename {path.name} to step-00000004 \({os.strerror(code)}\): .*checkpoint\.uri"):
            commit_checkpoint(tmp_path, path, TrainerState(step=4), keep=3)
    assert list(tmp_path.glob("step-*")) == []


def test_a_rename_that_fails_for_another_reason_is_raised_as_it_is(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Faked: an I/O error may pass (a restart retries the save): it is not called a configuration error."""
    with gloo_world_of_one():
        path = _private_save(tmp_path, 4, Fence(RUN, 0), b"mine")

        def fail(self: Path, target: Path) -> None:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        monkeypatch.setattr(Path, "rename", fail)
        with pytest.raises(OSError) as raised:
            commit_checkpoint(tmp_path, path, TrainerState(step=4), keep=3)
    assert raised.type is OSError and raised.value.errno == errno.EIO
