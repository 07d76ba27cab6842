"""The newcomer's path: examples/quickstart.yaml through `kubetrain run` with the real trainer.

Two real runs (2 gloo processes, FSDP2, bf16, GA 2, activation checkpointing):
an uninterrupted one, and one where rank 1 is killed at step 30. The second must
restart the gang once, resume from the step-20 checkpoint and end on exactly the
same loss (issue #2, acceptance 1 and 2).
"""

import json
from pathlib import Path

import pytest
from support.paths import QUICKSTART
from support.trainer_harness import run_cli

from kubetrain.core import hardware

pytestmark = pytest.mark.e2e


def run(tmp: Path, name: str, *extra: str) -> tuple[dict, str]:
    out = tmp / name
    r = run_cli(["run", str(QUICKSTART), "--output-dir", str(out), "--summary-json", str(tmp / f"{name}.json"), *extra],
                timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((tmp / f"{name}.json").read_text()), r.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quickstart")
    return run(tmp, "clean"), run(tmp, "failed", "--fail-at", "1:30")


def test_quickstart_trains_and_loss_falls(runs):
    (s, err), _ = runs
    assert (s["phase"], s["steps"], s["restarts"], s["checkpoints"]) == ("Succeeded", 60, 0, [20, 40, 60])
    assert s["final_loss"] < 0.8 * s["initial_loss"]
    assert s["tokens_per_second"] > 0
    assert s["network_transport"] == "gloo"  # CPU: rank 0 reports the backend, no NCCL to probe
    assert "metrics: http://127.0.0.1:9400-9401/metrics" in err
    # bf16 on this CPU: measured before the start, and said when it is the slower precision
    assert s["bf16_slowdown"] > 0
    assert ("bf16 is slow on this CPU" in err) == (s["bf16_slowdown"] >= hardware.SLOW_BF16)
    native = hardware.this_cpu_native_bf16()
    assert s["bf16_emulated"] == (None if native is None else not native)


def test_fail_at_restarts_once_resumes_from_step_20_and_resume_is_exact(runs):
    (clean, _), (failed, err) = runs
    assert (failed["phase"], failed["restarts"], failed["resumed_from"]) == ("Succeeded", 1, [20])
    assert failed["failures"] == {"ExitCode": 1}
    assert "worker 1 exited with code 137" in err
    assert failed["initial_loss"] == clean["initial_loss"]
    # goodput: the clean run lost nothing; the restart cost its downtime and the steps past checkpoint 20
    assert (clean["goodput"]["lost_seconds"], clean["goodput"]["steps_lost"]) == (0.0, 0)
    assert 0 < failed["goodput"]["steps_lost"] <= 10 and failed["goodput"]["lost_seconds"] > 0
    assert failed["goodput"]["productive_seconds"] > 0
    assert failed["final_loss"] == pytest.approx(clean["final_loss"], rel=1e-5)


def test_every_generation_runs_the_preflight_and_the_summary_shows_it(runs):
    (clean, _), (failed, _) = runs
    pf = clean["preflight"]
    assert (pf["generation"], pf["worldSize"], [r["rank"] for r in pf["ranks"]]) == (0, 2, [0, 1])
    assert [r["worker"] for r in pf["ranks"]] == [0, 1] and all(r["node"] for r in pf["ranks"])
    assert all(r["gflops"] > 0 and r["exchangeSeconds"] > 0 for r in pf["ranks"])
    assert pf["busBandwidthGbps"] > 0 and pf["slowestRank"] in (0, 1) and 0 < pf["seconds"] < 10
    assert failed["preflight"]["generation"] == 1  # the restarted gang ran its own
