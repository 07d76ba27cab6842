"""Hugging Face Trainer scripts as custom commands (issue 32): examples/hf-trainer through `kubetrain run`.

train.py (with KubetrainCallback): a rank killed mid-run, the gang resumes from the newest committed
checkpoint-N and the job's status says so; SIGTERM on one rank -> a committed checkpoint and exit 143 on all.
plain.py (no kubetrain import): killed once, it resumes through transformers' own get_last_checkpoint.
A tiny Llama on 2 CPU processes: each generation costs a few seconds, mostly importing transformers.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.paths import REPO_ROOT
from support.trainer_harness import Gang, run_cli

from kubetrain.core import hangs
from kubetrain.core.client.local import job_status
from kubetrain.core.progress import COMMIT_MARKER, committed_hf_checkpoints

pytestmark = pytest.mark.e2e
EXAMPLES = REPO_ROOT / "examples"
EXAMPLE = EXAMPLES / "hf-trainer"
FAIL_ONCE = Path(__file__).parent / "hf_fail_once.py"


def example_job(tmp_path: Path, args: list[str], **spec: Any) -> Path:
    """examples/hf-trainer/job.yaml with shorter args (and spec overrides), written beside the test."""
    job = yaml.safe_load((EXAMPLE / "job.yaml").read_text())
    job["spec"].update(args=args, **spec)
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(job))
    return path


def test_example_resumes_from_the_newest_committed_checkpoint_after_a_killed_rank(tmp_path):
    out = tmp_path / "out"
    job = example_job(tmp_path, ["--max-steps", "16", "--save-steps", "5", "--eval-steps", "8"])
    # The manifest's command, hf-trainer/train.py, is relative to examples/ (as to /workspace in the image).
    r = run_cli(["run", str(job), "--output-dir", str(out), "--fail-at", "1:13", "--quiet"], cwd=EXAMPLES,
                timeout=180)
    assert r.returncode == 0, r.stderr[-4000:]
    s = json.loads((out / "summary.json").read_text())
    assert (s["phase"], s["restarts"], s["steps"], s["max_steps"]) == ("Succeeded", 1, 16, 16), s
    assert s["resumed_from"] == [10]  # checkpoint-10 is the newest committed when rank 1 dies after step 13
    assert s["checkpoints"] == [5, 10, 15, 16]
    assert s["final_loss"] < s["initial_loss"] - 0.3 and s["eval_loss"] is not None
    progress = json.loads((out / "progress.json").read_text())
    assert (progress["generation"], progress["resumedFrom"], progress["finished"]) == (1, 10, True)
    assert progress["lastCheckpoint"]["step"] == 16 and progress["learningRate"] > 0
    assert [step for step, _ in committed_hf_checkpoints(out / "checkpoints")] == [10, 15, 16]  # save_total_limit 3
    gen1 = (out / "logs" / "gen-1" / "rank-0.log").read_text()
    assert f"kubetrain: resuming from {out / 'checkpoints' / 'checkpoint-10'} (step 10)" in gen1
    status = job_status(out, 100, time.time(), alive=False, log=out / "none.log", workers=2)
    assert (status.resumed_from_step, status.current_step, status.max_steps) == (10, 16, 16)
    assert status.loss == f"{progress['loss']:.4f}" and status.last_checkpoint is not None
    assert hangs.read_beat(str(out / "hang-watch" / "beats" / "rank-1.beat")) == (16, hangs.TRAIN)


def test_sigterm_on_one_rank_saves_a_committed_checkpoint_on_all_and_exits_143(tmp_path):
    out = tmp_path / "out"
    gang = Gang(out, {}, 2, timeout=120, command=[
        sys.executable, str(EXAMPLE / "train.py"), "--max-steps", "300", "--save-steps", "1000"])
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        progress = _read(out / "progress.json")
        if progress.get("step", 0) >= 3 or any(p.poll() is not None for p in gang.procs):
            break
        time.sleep(0.1)
    gang.procs[1].send_signal(signal.SIGTERM)  # one rank only: the all-reduced flag stops both
    run = gang.wait()
    assert run.exit_codes == [143, 143], run.log(0)[-3000:] + run.log(1)[-3000:]
    done = committed_hf_checkpoints(out / "checkpoints")
    assert len(done) == 1 and 3 <= done[0][0] < 300, done
    step = done[0][0]
    marker = json.loads((done[0][1] / COMMIT_MARKER).read_text())
    assert (marker["step"], marker["worldSize"]) == (step, 2)
    assert f"kubetrain: stop signal: saving at step {step}, then exit 143" in run.log(0)
    assert (run.progress["step"], run.progress["lastCheckpoint"]["step"], run.progress["finished"]) == (step, step, False)


def test_a_plain_script_resumes_through_its_own_get_last_checkpoint(tmp_path):
    out = tmp_path / "out"
    job = example_job(tmp_path, ["--max-steps", "12", "--save-steps", "5"], workers=1,
                      command=["python", str(FAIL_ONCE), str(EXAMPLE / "plain.py")])
    r = run_cli(["run", str(job), "--output-dir", str(out), "--fail-at", "0:8", "--quiet"], timeout=180)
    assert r.returncode == 0, r.stderr[-4000:]
    s = json.loads((out / "summary.json").read_text())
    assert (s["phase"], s["restarts"]) == ("Succeeded", 1), s
    assert "hf_fail_once: rank 0 exits after step 8" in (out / "logs" / "gen-0" / "rank-0.log").read_text()
    gen1 = (out / "logs" / "gen-1" / "rank-0.log").read_text()
    assert f"resuming from {out / 'checkpoints' / 'checkpoint-5'}" in gen1
    final = json.loads((out / "checkpoints" / "checkpoint-12" / "trainer_state.json").read_text())
    assert final["global_step"] == 12
    assert not list((out / "checkpoints").glob(f"*/{COMMIT_MARKER}"))  # nothing of kubetrain's ran in it
    assert not (out / "progress.json").exists()


def _read(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}
