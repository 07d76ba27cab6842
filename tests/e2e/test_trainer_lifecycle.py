"""Trainer lifecycle on CPU (issue 3, items 2 and 4): SIGTERM checkpoints, torn checkpoints,
fp16 dynamic loss scaling, configuration errors, metrics, and the in-pod launcher.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from support.ports import free_port
from support.trainer_harness import Gang, Run, pythonpath, read_records, tiny_spec
from support.waiting import wait_for

from kubetrain.core.progress import COMMIT_MARKER, complete_checkpoints

pytestmark = pytest.mark.e2e

# FSDP + bf16 + gradient accumulation + activation checkpointing: the quickstart's path.
SIGTERM_SPEC = tiny_spec(
    strategy="fsdp",
    precision="bf16",
    activationCheckpointing=True,
    maxSteps=40,
    checkpoint={"everySteps": 1000, "keep": 2},
)


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


@pytest.fixture(scope="module")
def sigterm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Generation 0 gets SIGTERM on rank 1 only; a torn checkpoint is planted; generation 1 resumes."""
    out = tmp_path_factory.mktemp("sigterm")
    port = free_port()
    gang = Gang(out, SIGTERM_SPEC, env={"KUBETRAIN_METRICS_PORT": str(port)})
    wait_for(lambda: len(read_records(out)) >= 3, 180, interval=0.05, what="3 steps logged")
    metrics = _scrape(port)
    gang.procs[1].send_signal(signal.SIGTERM)
    gen0 = gang.wait()
    stopped_at = max(gen0.losses)
    # A save cut off mid-write: a later step directory with partial content and no commit marker.
    torn = out / "checkpoints" / f"step-{stopped_at + 2:08d}"
    (torn / "dcp").mkdir(parents=True)
    (torn / "dcp" / "__0_0.distcp").write_bytes(b"\x00" * 100)
    gen1 = Gang(out, SIGTERM_SPEC, generation=1).wait()
    return {"gen0": gen0, "gen1": gen1, "stopped_at": stopped_at, "metrics": metrics, "torn": torn}


def test_sigterm_while_joining_a_gang_that_never_forms_ends_the_rank_at_once(tmp_path: Path) -> None:
    """Both ranks wait in init_process_group for a third that never comes (a gang being torn down): a
    SIGTERM there must end them now (nothing to save yet), not after the collective timeout (60 s here)."""
    beats = tmp_path / "beats"
    beats.mkdir()
    gang = Gang(tmp_path / "out", SIGTERM_SPEC, env={"WORLD_SIZE": "3", "KUBETRAIN_HEARTBEAT_DIR": str(beats)})
    wait_for(lambda: all((beats / f"rank-{r}.beat").exists() for r in (0, 1)), 120, what="both ranks joining")
    time.sleep(1.0)  # into init_process_group's wait
    t0 = time.monotonic()
    gang.signal(signal.SIGTERM)
    run = gang.wait()
    assert run.exit_codes == [143, 143]
    assert time.monotonic() - t0 < 20  # the collective timeout is 60 s


def test_sigterm_on_one_rank_checkpoints_on_all_and_exits_143(sigterm: dict[str, Any]) -> None:
    gen0: Run = sigterm["gen0"]
    assert gen0.exit_codes == [143, 143], gen0.log(0)[-2000:] + gen0.log(1)[-2000:]
    step = sigterm["stopped_at"]
    assert 3 <= step < SIGTERM_SPEC["maxSteps"]
    assert gen0.progress["lastCheckpoint"]["step"] == step
    assert gen0.progress["finished"] is False
    committed = json.loads((gen0.ckpt_dir / f"step-{step:08d}" / COMMIT_MARKER).read_text())
    assert committed["step"] == step and committed["worldSize"] == 2


def test_torn_checkpoint_is_ignored_on_resume(sigterm: dict[str, Any]) -> None:
    gen1: Run = sigterm["gen1"]
    step = sigterm["stopped_at"]
    assert gen1.exit_codes == [0, 0], gen1.log(0)[-3000:]
    assert gen1.progress["resumedFrom"] == step
    assert gen1.progress["finished"] is True
    gen1_steps = sorted(r["step"] for r in gen1.records if r["generation"] == 1)
    assert gen1_steps == list(range(step + 1, SIGTERM_SPEC["maxSteps"] + 1))
    losses = gen1.losses
    assert losses[SIGTERM_SPEC["maxSteps"]] < losses[1] - 0.5
    # the torn directory was cleaned up by the next commit
    assert not sigterm["torn"].exists()
    assert [s for s, _ in complete_checkpoints(gen1.ckpt_dir)] == [step, SIGTERM_SPEC["maxSteps"]]


def test_metrics_endpoint(sigterm: dict[str, Any]) -> None:
    text: str = sigterm["metrics"]
    for name in ("step", "loss", "tokens_per_second", "step_seconds_count", "restart_generation"):
        assert f'kubetrain_trainer_{name}{{job="test",rank="0"' in text, name
    assert "kubetrain_trainer_mfu{" not in text  # no known peak FLOP/s on CPU


@pytest.fixture(scope="module")
def fp16_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """fp16 with an initial loss scale of 2^20: the first steps overflow and must be skipped."""
    root = tmp_path_factory.mktemp("fp16")
    env = {"KUBETRAIN_FP16_INIT_SCALE": str(2.0**20), "KUBETRAIN_DEBUG_PARAM_NORM": "1"}
    gangs = {
        name: Gang(root / name, tiny_spec(strategy=name, precision="fp16", maxSteps=12), env=env)
        for name in ("ddp", "fsdp")
    }
    return {name: g.wait() for name, g in gangs.items()}


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_fp16_dynamic_loss_scaling(fp16_runs: dict[str, Run], name: str) -> None:
    run = fp16_runs[name]
    assert run.exit_codes == [0, 0], run.log(0)[-3000:]
    recs = run.records
    skipped = [r for r in recs if r["skipped"]]
    assert recs[0]["skipped"] and len(skipped) >= 2
    # every skipped step halves the scale and leaves the parameters untouched
    for prev, rec in zip(recs, recs[1:], strict=False):
        if rec["skipped"]:
            assert rec["loss_scale"] == prev["loss_scale"] / 2
            assert rec["param_norm"] == prev["param_norm"]
        else:
            assert rec["param_norm"] != prev["param_norm"]
    assert recs[0]["loss_scale"] == 2.0**19
    assert recs[-1]["loss_scale"] < 2.0**20
    # the schedule only advances on real steps: the first real step runs at warmup lr of step 0
    first_real = next(r for r in recs if not r["skipped"])
    assert first_real["lr"] == pytest.approx(recs[0]["lr"])
    assert recs[-1]["loss"] < recs[0]["loss"] - 0.5


def _trainer(env: dict[str, str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PET_NPROC_PER_NODE")}
    full = {**base, "PYTHONPATH": pythonpath(), "OMP_NUM_THREADS": "1", "KUBETRAIN_DEVICE": "cpu", **env}
    return subprocess.run(
        [sys.executable, "-m", "kubetrain.trainer"],
        env=full,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"strategy": "zero"}, "strategy"),
        ({"model": {"dModel": 30, "nHeads": 4}}, "model.nHeads"),
        ({"data": {"path": "/nonexistent/kubetrain-data"}}, "data.path"),
        ({"model": {"hfPath": "/models/llama"}}, "model.hfPath"),
    ],
)
def test_configuration_errors_exit_2_naming_the_field(tmp_path: Path, patch: dict[str, Any], field: str) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny_spec(**patch)))
    env = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_PORT": str(free_port()),
        "KUBETRAIN_CONFIG": str(config),
        "KUBETRAIN_OUTPUT_DIR": str(tmp_path),
    }
    proc = _trainer(env, tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"configuration error: {field}:" in proc.stderr


def test_launcher_spawns_ranks_and_propagates_a_failure(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(tiny_spec(maxSteps=6, model={"nLayers": 1})))
    env = {
        "PET_NPROC_PER_NODE": "2",
        "PET_NNODES": "1",
        "NODE_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "KUBETRAIN_CONFIG": str(config),
        "KUBETRAIN_OUTPUT_DIR": str(tmp_path),
        "KUBETRAIN_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
        "KUBETRAIN_FAIL_AT": "1:3",
        "KUBETRAIN_DIST_TIMEOUT_SECONDS": "60",
    }
    proc = _trainer(env, tmp_path, timeout=180)
    # rank 0's all-reduce fails when rank 1 dies (exit 3, a lost peer); the launcher reports
    # rank 1's 137 whichever of the two it sees first
    assert proc.returncode == 137, proc.stderr[-3000:]
    assert "injected failure at step 3 on rank 1" in proc.stderr
    assert "another rank went away; exiting 3" in proc.stderr, proc.stderr[-3000:]
    assert [r["step"] for r in read_records(tmp_path)] == [1, 2]  # rank 0 stopped waiting for rank 1


def _step_dirs(ckpt: Path) -> dict[str, dict[str, tuple[int, int]]]:
    """Every step directory (committed or not, the gangs' private ones included) -> each file in it -> (size,
    mtime in ns): what a write, removal or rewrite by any gang changes."""
    return {p.name: {str(f.relative_to(p)): (f.stat().st_size, f.stat().st_mtime_ns)
                     for f in sorted(p.rglob("*")) if f.is_file()}
            for p in sorted(ckpt.glob("step-*"))}


def test_a_frozen_stale_generation_never_writes_beside_the_newer_one(tmp_path: Path) -> None:
    """A gang frozen (SIGSTOP: a node cut off from the API server) while its restarted generation trains on the
    same checkpoints; thawed, the old gang stops at its next save without touching a step directory."""
    ckpt = tmp_path / "checkpoints"
    spec = tiny_spec(maxSteps=40, checkpoint={"everySteps": 4, "keep": 100})
    env = {"KUBETRAIN_CHECKPOINT_DIR": str(ckpt), "KUBETRAIN_RUN_ID": "run-a"}
    old = Gang(tmp_path / "gen0", spec, world_size=1, env=env)
    # Frozen once its second save has begun: most often in the middle of writing step 8, the window in which a
    # thawed gang could otherwise write into, or remove, the step the newer gang committed meanwhile.
    wait_for(lambda: any(ckpt.glob("step-00000008*")), 180, interval=0.002, what="generation 0's second save")
    old.signal(signal.SIGSTOP)
    try:
        new = Gang(tmp_path / "gen1", spec, world_size=1, generation=1, env=env).wait()
        assert new.exit_codes == [0], new.log()[-3000:]
        before = _step_dirs(ckpt)
        assert list(before) == [f"step-{n:08d}" for n in range(4, 41, 4)], list(before)
        assert all(COMMIT_MARKER in files for files in before.values()), before
    finally:
        old.signal(signal.SIGCONT)
    stale = old.wait()
    assert stale.exit_codes == [1], stale.log()[-3000:]
    assert "this gang is generation 0 and generation 1 of this job has started since" in stale.log()
    assert _step_dirs(ckpt) == before  # nothing removed, rewritten or added by the stale gang
