"""Background (asynchronous) durable checkpoints, checkpoint.asyncSave, on CPU with 2 gloo processes per gang.

- An asyncSave run trains exactly like a synchronous one, and the checkpoints it writes in the background
  hold the same tensors, bit for bit (ddp and fsdp); resuming from either (by one process, DCP resharding)
  gives the same final loss.
- A rank killed (SIGKILL) while its background write is in flight: nothing of that save is committed, the
  gang resumes from the previous committed checkpoint, never from the torn directory, and goes on exactly
  like the uninterrupted run. The write is made slow by a test fault, background.WRITE_DELAY_ENV (every
  background write sleeps before writing its files), so the kill lands inside it deterministically: the
  test kills rank 1 as soon as rank 0 logs that the save is staged.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from support.dcp_files import count_tensors, differences, read_dcp
from support.trainer_harness import Gang, Run, rel_diff, tiny_spec
from support.waiting import wait_for

from kubetrain.core.progress import COMMIT_MARKER, complete_checkpoints
from kubetrain.trainer.checkpoint.background import WRITE_DELAY_ENV
from kubetrain.trainer.checkpoint.directory import writing_name
from kubetrain.trainer.checkpoint.safe_load import safe_load

pytestmark = pytest.mark.e2e

STEPS = 8
EVERY = 2
"""Saves at 2, 4, 6 (in the background when asyncSave) and 8 (the last step: always waited for)."""
STRATEGIES = ("ddp", "fsdp")
WRITE_DELAY = "3"
"""Seconds each background write of the killed gang sleeps: the window the kill must land in."""
TORN_STEP = 4
SENTINEL = "written-by-the-killed-generation"


def spec(strategy: str, background: bool) -> dict[str, Any]:
    return tiny_spec(strategy=strategy, maxSteps=STEPS,
                     checkpoint={"everySteps": EVERY, "keep": 3, "asyncSave": background})


def step_dir(run_out: Path, step: int) -> Path:
    return run_out / "checkpoints" / f"step-{step:08d}"


def torn_dir(run_out: Path, step: int) -> Path:
    """Where a save of `step` is written until it is committed (renamed to step_dir)."""
    return run_out / "checkpoints" / f"step-{step:08d}.{writing_name(None)}"


def kill_during_write(gang: Gang) -> None:
    """SIGKILL rank 1 once rank 0 has staged step TORN_STEP: its write (rank 1's too) sleeps WRITE_DELAY s."""
    staged = f"checkpoint step {TORN_STEP} staged in"
    wait_for(lambda: staged in (gang.out / "rank-0.log").read_text(errors="replace"), 180, interval=0.02,
             what=f"rank 0 to stage step {TORN_STEP}")
    gang.procs[1].kill()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("async-ckpt")
    gangs = {f"{s}_{mode}": Gang(root / f"{s}_{mode}", spec(s, mode == "async"))
             for s in STRATEGIES for mode in ("sync", "async")}
    killed = Gang(root / "killed", spec("fsdp", True), env={WRITE_DELAY_ENV: WRITE_DELAY})
    kill_during_write(killed)
    done: dict[str, Any] = {name: g.wait() for name, g in gangs.items()}
    done["killed"] = killed.wait()
    done["killed_committed"] = [s for s, _ in complete_checkpoints(killed.out / "checkpoints")]
    torn = torn_dir(killed.out, TORN_STEP)
    done["torn_files"] = sorted(str(p.relative_to(torn)) for p in torn.rglob("*"))
    (torn / SENTINEL).write_text("")  # gone once the next generation removed the torn directory
    # Phase 2: each run's step-6 checkpoint (written in the background when asyncSave) resumed to the end by
    # one process (DCP reshards; twice the micro batch keeps the global batch), and the killed gang's next
    # generation (no fault).
    resumed = {}
    for name in gangs:
        out = root / f"{name}_resumed"
        shutil.copytree(step_dir(root / name, 6), step_dir(out, 6))
        one = {**spec(name.split("_")[0], name.endswith("async")), "microBatchSize": 4}
        resumed[f"{name}_resumed"] = Gang(out, one, world_size=1)
    resumed["killed_gen1"] = Gang(killed.out, spec("fsdp", True), generation=1)
    done.update({name: g.wait() for name, g in resumed.items()})
    return done


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_background_saves_train_exactly_like_synchronous_ones(runs: dict[str, Any], strategy: str) -> None:
    sync, background = runs[f"{strategy}_sync"], runs[f"{strategy}_async"]
    for run in (sync, background):
        assert run.exit_codes == [0, 0], run.log(0)[-3000:] + run.log(1)[-3000:]
        assert run.progress["checkpoints"] == [2, 4, 6, 8] and run.progress["lastCheckpoint"]["step"] == 8
        assert [s for s, _ in complete_checkpoints(run.ckpt_dir)] == [4, 6, 8]  # keep: 3
    assert background.losses == sync.losses  # staging copies; it never changes what training computes
    log = background.log(0)
    for step in (2, 4, 6):
        assert f"checkpoint step {step} staged in " in log and f"checkpoint step {step} committed: write took" in log
    assert "committed in" in log.split(f"checkpoint step {STEPS} ")[-1]  # the last save waited for its write
    assert "staged in" not in sync.log(0)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("step", [4, 6])
def test_a_background_checkpoint_equals_the_synchronous_one_bit_for_bit(
    runs: dict[str, Any], strategy: str, step: int
) -> None:
    sync, background = (step_dir(runs[f"{strategy}_{m}"].out, step) for m in ("sync", "async"))
    assert (background / COMMIT_MARKER).is_file()
    a, b = read_dcp(sync / "dcp"), read_dcp(background / "dcp")
    assert count_tensors(a) >= 4 * 2  # every parameter and both Adam moments of each
    assert differences(a, b) == []
    assert differences(safe_load(sync / "engine.pt"), safe_load(background / "engine.pt")) == []
    for rank in (0, 1):  # torch's generator; Python's is never seeded (each process starts it from the OS)
        rng = f"rng/rank-{rank:05d}.pt"
        assert differences(safe_load(sync / rng)["torch"], safe_load(background / rng)["torch"]) == []
    # trainer.json is the state as of the saved step, though the commit came steps later
    assert json.loads((sync / "trainer.json").read_text()) == json.loads((background / "trainer.json").read_text())


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resuming_a_background_checkpoint_equals_resuming_a_synchronous_one(
    runs: dict[str, Any], strategy: str
) -> None:
    sync, background = runs[f"{strategy}_sync_resumed"], runs[f"{strategy}_async_resumed"]
    for run in (sync, background):
        assert run.exit_codes == [0], run.log(0)[-3000:]
        assert run.progress["resumedFrom"] == 6 and sorted(run.losses) == [7, 8]
    assert background.losses[STEPS] == sync.losses[STEPS]
    assert rel_diff(background.losses, runs[f"{strategy}_sync"].losses) <= 1e-4  # 1 process vs 2: summation order


def test_a_rank_killed_during_a_background_write_leaves_nothing_committed(runs: dict[str, Any]) -> None:
    gen0: Run = runs["killed"]
    assert gen0.exit_codes[1] == 137 and gen0.exit_codes[0] != 0, gen0.log(0)[-3000:]
    # the save of step 2 was committed (by the save of step 4, which waited for its write) ...
    assert runs["killed_committed"] == [2]
    assert gen0.progress["lastCheckpoint"]["step"] == 2  # progress only ever names committed checkpoints
    # ... the one of step 4 not: its small parts are there, no data file of the state and no marker
    assert "rng/rank-00000.pt" in runs["torn_files"] and COMMIT_MARKER not in runs["torn_files"]
    assert "dcp/.metadata" not in runs["torn_files"]
    # still running, or failed (its collective lost rank 1) when rank 0 noticed the loss late
    assert f"checkpoint step {TORN_STEP} not committed: exiting with its background write " in gen0.log(0)


def test_the_next_generation_resumes_from_the_previous_commit_and_removes_the_torn_directory(
    runs: dict[str, Any],
) -> None:
    gen1: Run = runs["killed_gen1"]
    assert gen1.exit_codes == [0, 0], gen1.log(0)[-3000:]
    assert gen1.progress["resumedFrom"] == 2
    again = {r["step"]: r["loss"] for r in gen1.records if r["generation"] == 1}
    assert sorted(again) == list(range(3, STEPS + 1))
    assert rel_diff(again, runs["fsdp_async"].losses) <= 1e-6
    assert not (torn_dir(gen1.out, TORN_STEP) / SENTINEL).exists() and not torn_dir(gen1.out, TORN_STEP).exists()
    assert [s for s, _ in complete_checkpoints(gen1.ckpt_dir)] == [4, 6, 8]
