"""checkpoint.memory on CPU, with the real trainer (2 gloo processes): a gang restarted with every rank's memory
tier resumes from it, exactly as from the durable checkpoint of the same step; a gang in which one rank's tier
is gone (its pod recreated) falls back to the durable tier; and `kubetrain run` resumes from memory after an
injected failure, says so, and removes the tier's directory at the end.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.trainer_harness import Gang, Run, memory_tier_env, tiny_job, tiny_spec

from kubetrain.core.progress import checkpoint_dirname

pytestmark = pytest.mark.e2e

MAX_STEPS = 16
FAIL_AT_STEP = 13
"""Rank 1 dies after step 13: the memory tier (every 5 steps) and the durable tier (every 10) both hold step 10."""


def _spec(strategy: str) -> dict[str, Any]:
    # Durable saves in the foreground: step 10 is committed before step 11 starts, however fast the steps.
    return tiny_spec(strategy=strategy, maxSteps=MAX_STEPS, preflight={"enabled": False},
                     checkpoint={"everySteps": 10, "keep": 2, "asyncSave": False})


def _env(out: Path) -> dict[str, str]:
    return {**memory_tier_env(out / "shm", 5, 2**30), "KUBETRAIN_DEBUG_PARAM_NORM": "1"}


def _steps(out: Path, rank: int) -> list[str]:
    return sorted(p.name for p in (out / "shm" / f"rank-{rank}").glob("step-*"))


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def resumed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Generation 0 fails; generation 1 runs twice from copies of what it left: with both ranks' memory tiers,
    and with rank 1's gone."""
    strategy = request.param
    root = tmp_path_factory.mktemp(f"memory-{strategy}")
    memory, durable = root / "memory", root / "durable"
    gen0 = Gang(memory, _spec(strategy), env={**_env(memory), "KUBETRAIN_FAIL_AT": f"1:{FAIL_AT_STEP}"}).wait()
    held = [_steps(memory, r) for r in (0, 1)]
    shutil.copytree(memory, durable)
    shutil.rmtree(durable / "shm" / "rank-1")  # as a recreated pod's /dev/shm
    gangs = [Gang(out, _spec(strategy), generation=1, env=_env(out)) for out in (memory, durable)]  # side by side
    from_memory, from_durable = (g.wait() for g in gangs)
    return {"gen0": gen0, "held": held, "memory": from_memory, "durable": from_durable,
            "kept": [_steps(memory, r) for r in (0, 1)], "root": root}


def _gen1(run: Run) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss"], r["param_norm"]) for r in run.records if r["generation"] == 1]


def test_each_rank_keeps_only_its_newest_step_in_memory(resumed: dict[str, Any]) -> None:
    gen0: Run = resumed["gen0"]
    assert 137 in gen0.exit_codes, gen0.log(1)[-2000:]
    assert resumed["held"] == [[checkpoint_dirname(10)]] * 2
    assert resumed["kept"] == [[checkpoint_dirname(15)]] * 2  # after generation 1's save at step 15


def test_a_gang_holding_the_step_in_memory_resumes_from_memory(resumed: dict[str, Any]) -> None:
    run: Run = resumed["memory"]
    assert run.exit_codes == [0, 0], run.log(0)[-3000:]
    assert (run.progress["resumedFrom"], run.progress["resumedTier"]) == (10, "memory")
    assert "resumed from the memory tier" in run.log(0)


def test_a_rank_without_its_memory_tier_makes_the_gang_resume_from_durable(resumed: dict[str, Any]) -> None:
    run: Run = resumed["durable"]
    assert run.exit_codes == [0, 0], run.log(0)[-3000:]
    assert (run.progress["resumedFrom"], run.progress["resumedTier"]) == (10, "durable")
    assert f"checkpoints/{checkpoint_dirname(10)} (step 10)" in run.log(0)


def test_restoring_from_memory_equals_restoring_from_durable(resumed: dict[str, Any]) -> None:
    memory, durable = _gen1(resumed["memory"]), _gen1(resumed["durable"])
    assert [s for s, _, _ in memory] == list(range(11, MAX_STEPS + 1))
    assert memory == durable  # every loss and parameter norm, bit for bit


def test_kubetrain_run_resumes_from_memory_and_removes_it(tmp_path: Path) -> None:
    """Rank 1 dies after step 17: the memory tier holds step 15, the durable tier step 10."""
    spec = tiny_spec(workers=2, maxSteps=20, checkpoint={"everySteps": 10, "keep": 2, "memory": {"everySteps": 5}},
                     restartPolicy={"backoffSeconds": 0.2}, metricsPort=19480, preflight={"enabled": False})
    manifest = tmp_path / "job.yaml"
    manifest.write_text(json.dumps(tiny_job("memory", spec)))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "kubetrain.core", "run", str(manifest), "--output-dir", str(out),
                           "--fail-at", "1:17"], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert (s["phase"], s["restarts"], s["resumed_from"], s["resumed_tiers"]) == ("Succeeded", 1, [15], ["memory"])
    assert "resumed from step 15 (memory)" in proc.stdout
    assert s["goodput"]["steps_lost"] <= 2  # at most steps 16 and 17 again, not 11 to 17
    memory = s["memory"]  # every rank's peak, gathered by rank 0 of the last generation (status.memory)
    assert (memory["generation"], memory["step"], memory["notices"]) == (1, 20, [])  # the tier fit the machine
    assert [(r["rank"], r["worker"]) for r in memory["ranks"]] == [(0, 0), (1, 1)]
    assert all(r["hostPeakBytes"] > 0 and r.get("devicePeakBytes") is None for r in memory["ranks"])
    log = (out / "logs" / "gen-1" / "rank-0.log").read_text()
    where = re.search(r"resumed from the memory tier \((/dev/shm/kubetrain-[^)]+)\) \(step 15\)", log)
    assert where, log[-2000:]
    assert not Path(where.group(1)).exists()  # removed when the run ended
