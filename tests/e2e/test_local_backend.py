"""The local backend's supervisor with a real multi-process custom-command job.

The worker is a user's own script (tests/e2e/script_worker.py) run through
spec.command, so these tests exercise process start, the env contract, the
shared lifecycle policy (gang restart, backoff, permanent exit codes) and the
summary without torch. The built-in trainer is covered by test_quickstart.py.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.trainer_harness import run_cli

pytestmark = pytest.mark.e2e
HERE = Path(__file__).parent


def manifest(tmp_path: Path, name: str = "script", workers: int = 2, procs: int = 1, **restart) -> Path:
    policy = {"backoffLimit": 2, "backoffSeconds": 0.2, **restart}
    f = tmp_path / f"{name}.yaml"
    f.write_text(json.dumps({
        "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
        "spec": {
            "workers": workers, "procsPerWorker": procs, "maxSteps": 12,
            "command": [sys.executable, str(HERE / "script_worker.py")],
            "restartPolicy": policy, "metricsPort": 19400,
        },
    }))
    return f


def test_clean_run_succeeds_and_writes_summary(tmp_path):
    r = run_cli(["run", str(manifest(tmp_path, procs=2)), "--output-dir", str(tmp_path / "out"), "--summary-json",
             str(tmp_path / "s.json")])
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "s.json").read_text())
    assert (s["name"], s["phase"], s["steps"], s["restarts"]) == ("script", "Succeeded", 12, 0)
    assert s["checkpoints"] == [4, 8, 12]
    assert s["world_size"] == 4
    assert s["initial_loss"] == 10.0 and s["final_loss"] == pytest.approx(10.0 / 12)
    assert "metrics: http://127.0.0.1:19400-19403/metrics" in r.stderr
    assert sorted(p.name for p in (tmp_path / "out" / "logs" / "gen-0").iterdir()) == [
        f"rank-{i}.log" for i in range(4)
    ]


def test_fail_at_restarts_whole_gang_once_from_checkpoint(tmp_path):
    # rank 0 writes the checkpoints and these script ranks do not synchronise, so kill rank 0 itself
    r = run_cli(["run", str(manifest(tmp_path)), "--output-dir", str(tmp_path / "out"), "--fail-at", "0:6"])
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (s["phase"], s["restarts"], s["resumed_from"], s["failures"]) == ("Succeeded", 1, [4], {"ExitCode": 1})
    assert "worker 0 exited with code 137: restarting the whole gang from the checkpoint at step 4" in r.stderr
    assert (tmp_path / "out" / "logs" / "gen-1").is_dir() and not (tmp_path / "out" / "logs" / "gen-2").exists()


def test_ephemeral_checkpoints_still_survive_a_local_restart(tmp_path):
    """spec.checkpoint.ephemeral is about pods' emptyDirs: the same manifest runs locally, durable as ever."""
    f = manifest(tmp_path)
    job = json.loads(f.read_text())
    job["spec"]["checkpoint"] = {"ephemeral": True}
    f.write_text(json.dumps(job))
    r = run_cli(["run", str(f), "--output-dir", str(tmp_path / "out"), "--fail-at", "0:6"])
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (s["phase"], s["restarts"], s["resumed_from"]) == ("Succeeded", 1, [4])
    assert "checkpoint.ephemeral applies to pods only: local checkpoints survive restarts" in r.stderr
    assert "restarting the whole gang from the checkpoint at step 4" in r.stderr


def test_permanent_exit_code_fails_at_once(tmp_path):
    r = run_cli(["run", str(manifest(tmp_path)), "--output-dir", str(tmp_path / "out")],
            env={"SCRIPT_EXIT_STEP": "3", "SCRIPT_EXIT_CODE": "2"})
    assert r.returncode == 1
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (s["phase"], s["reason"], s["restarts"]) == ("Failed", "PermanentError", 0)
    assert "worker 0 exited with code 2" in r.stderr


def test_backoff_limit_is_enforced(tmp_path):
    r = run_cli(["run", str(manifest(tmp_path, backoffLimit=1)), "--output-dir", str(tmp_path / "out")],
            env={"SCRIPT_EXIT_STEP": "2", "SCRIPT_EXIT_CODE": "1"})
    assert r.returncode == 1
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (s["phase"], s["reason"], s["restarts"], s["failures"]) == (
        "Failed", "BackoffLimitExceeded", 1, {"ExitCode": 2})


def test_ctrl_c_stops_workers_and_rerun_resumes(tmp_path):
    f, out = manifest(tmp_path), tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "kubetrain.core", "run", str(f), "--output-dir", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "SCRIPT_MAX_STEPS": "400"})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (out / "checkpoints" / "step-00000004").exists():
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "stopping: asking workers to checkpoint" in err
    s = json.loads((out / "summary.json").read_text())
    assert s["phase"] == "Suspended" and 4 <= s["steps"] < 400
    r = run_cli(["run", str(f), "--output-dir", str(out)], env={"SCRIPT_MAX_STEPS": "40"})
    assert r.returncode == 0, r.stderr
    assert "resuming the unfinished run" in r.stderr
    s2 = json.loads((out / "summary.json").read_text())
    assert s2["resumed_from"] and s2["resumed_from"][0] >= 4 and s2["steps"] == 40


def test_bad_manifest_and_bad_fail_at_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: kubetrain.io/v1alpha1\nkind: TrainingJob\nmetadata: {name: b}\nspec: {workers: 0}\n")
    r = run_cli(["run", str(bad)])
    assert r.returncode == 2 and "spec.workers: must be >= 1" in r.stderr
    r = run_cli(["run", str(manifest(tmp_path)), "--fail-at", "5:3"])
    assert r.returncode == 2 and "rank 5 does not exist (world size 2)" in r.stderr
