"""Hang detection through `kubetrain run`: a rank stopped from outside (the built-in trainer, defaults only)
and a custom script's rank stuck in a sleep are named, their stacks saved, and the gang resumes."""

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from support.paths import EXAMPLE_DATA, QUICKSTART
from support.processes import rank_pid
from support.trainer_harness import run_cli
from support.waiting import wait_for

pytestmark = pytest.mark.e2e
HERE = Path(__file__).parent


def manifest(tmp_path: Path, spec: dict) -> Path:
    f = tmp_path / "job.yaml"
    f.write_text(json.dumps({"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                             "metadata": {"name": "hang"}, "spec": spec}))
    return f


def test_a_stopped_rank_of_the_trainer_is_named_and_the_run_resumes(tmp_path):
    spec = yaml.safe_load(QUICKSTART.read_text())["spec"]
    spec.update(maxSteps=120, data={"path": str(EXAMPLE_DATA)}, precision="fp32")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "kubetrain.core", "run", str(manifest(tmp_path, spec)),
                             "--output-dir", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        beat = out / "hang-watch" / "beats" / "rank-1.beat"

        def between_checkpoints() -> bool:  # a rank stopped in a save is given phaseSeconds (300 s) instead
            b = json.loads(beat.read_text())
            return b["phase"] == "train" and b["step"] > 20 and 3 <= b["step"] % 20 <= 12

        wait_for(between_checkpoints, 120, interval=0.05, what="rank 1 between two checkpoints",
                 ignore=(OSError, ValueError))
        os.kill(rank_pid(out / "hang-watch" / "beats", 1), signal.SIGSTOP)
        stopped = time.monotonic()
        text, _ = proc.communicate(timeout=400)
    finally:
        proc.kill()
    print(text[-3000:])
    assert proc.returncode == 0, text[-3000:]
    verdict = next(line for line in text.splitlines() if line.startswith("restarting: hung:"))
    assert verdict.startswith("restarting: hung: rank 1 on worker 1 is stopped (SIGSTOP) at step "), verdict
    assert "rank 0 waits in" in verdict
    assert "hang:   rank 1: stopped (SIGSTOP)" in text
    assert "Succeeded" in text and "1 restart(s)" in text
    hang = out / "logs" / "gen-0" / "hang"
    stacks = (hang / "rank-0.txt").read_text()
    assert 'File "' in stacks and "loop.py" in stacks
    # Rank 0's flight recorder: its last collective, never retired, is the one it waits in.
    last = pickle.loads((hang / "fr_trace_rank_0").read_bytes())["entries"][-1]
    assert last["profiling_name"].startswith("gloo:") and not last["retired"], last
    assert not (hang / "fr_trace_rank_1").exists()  # a stopped process writes nothing
    print(f"verdict and restart {time.monotonic() - stopped:.0f}s after SIGSTOP (run total)")


def test_a_custom_scripts_rank_stuck_in_a_sleep_gets_the_same_verdict(tmp_path):
    spec = {"workers": 2, "procsPerWorker": 2, "command": ["python", str(HERE / "hang_script.py")],
            "args": ["40", "3", "10"], "metricsPort": 19600,
            "restartPolicy": {"backoffSeconds": 0.2, "hangDetection": {"minSeconds": 5, "startSeconds": 60}}}
    out = tmp_path / "out"
    r = run_cli(["run", str(manifest(tmp_path, spec)), "--output-dir", str(out)], timeout=300)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-3000:]
    verdict = next(line for line in text.splitlines() if line.startswith("restarting: hung:"))
    print(verdict)
    assert verdict.startswith("restarting: hung: rank 3 on worker 1 is in load_next_batch (hang_script.py:20) "
                              "at step 9; ranks 0-2 wait in all_reduce (torch.distributed)"), verdict
    stack = (out / "logs" / "gen-0" / "hang" / "rank-3.txt").read_text()
    assert "in load_next_batch" in stack and "hang_script.py" in stack
    assert "done rank=3" in (out / "logs" / "gen-1" / "rank-3.log").read_text()  # generation 1 ran to the end
