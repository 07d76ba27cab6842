"""`kubetrain sweep` with the real trainer: a small TrainingSweep run through the CLI, stopped by
Ctrl-C in the middle, then resumed to the end.

Four trials of a tiny transformer, two at a time, over a grid of learning rates: one that learns
(0.01) and three that barely move the loss. ASHA with reductionFactor 100 keeps only the best trial
at its rung, so the slow learners that reach it after the good one are pruned. The grid's order is
fixed by the sweep's seed (seed 5: the good rate comes first), so pruning happens on every run.
"""

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.paths import EXAMPLE_DATA
from support.ports import free_port
from support.trainer_harness import run_cli, tiny_spec
from support.waiting import WaitTimeout, wait_for

from kubetrain.core.validate import load_job

pytestmark = pytest.mark.e2e

NAME = "tiny-sweep"
GOOD_LR = 0.01
STOP_S = 30.0
"""How long a stopped trial may take to checkpoint and end."""


def sweep_manifest(directory: Path) -> Path:
    spec = tiny_spec(maxSteps=300, checkpoint={"everySteps": 50, "keep": 2},
                     optimizer={"lr": 1e-4, "minLr": 0.0, "warmupSteps": 0}, metricsPort=free_port(2))
    spec["data"] = {"path": os.path.relpath(EXAMPLE_DATA, directory)}  # relative to the manifest, as a user writes it
    f = directory / "sweep.yaml"
    f.write_text(yaml.safe_dump({
        "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingSweep", "metadata": {"name": NAME},
        "spec": {
            "maxTrials": 4, "parallelism": 2, "seed": 5,
            "sampler": {"type": "grid"},
            "pruner": {"type": "asha", "minSteps": 40, "reductionFactor": 100},
            "parameters": [{"path": "optimizer.lr", "type": "categorical", "values": [GOOD_LR, 1e-6, 1e-5, 1e-4]}],
            "template": {"spec": spec},
        },
    }))
    return f


def processes_using(directory: Path) -> list[int]:
    """Live processes whose command line or environment names `directory` (a trial's run and its workers)."""
    needle = str(directory).encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (needle in (entry / "cmdline").read_bytes()
                                         or needle in (entry / "environ").read_bytes()):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def ended_in_time(directory: Path, timeout: float) -> bool:
    try:
        return wait_for(lambda: not processes_using(directory), timeout, interval=0.2)
    except WaitTimeout:
        return False


def read_status(out: Path) -> dict[str, Any]:
    try:
        return json.loads((out / "sweep-status.json").read_text())
    except (OSError, ValueError):
        return {}


@dataclass
class Session:
    code: int
    stdout: str
    stderr: str
    status_when_stopped: dict[str, Any] = field(default_factory=dict)
    pruned_gone: dict[int, bool] = field(default_factory=dict)
    """Each trial seen Pruned: were its processes gone within STOP_S?"""


def run_session(manifest: Path, out: Path, interrupt_when: Callable[[dict[str, Any]], bool] | None = None) -> Session:
    """`kubetrain sweep` until it ends, checking every pruned trial's processes; SIGINT once `interrupt_when` holds.
    Nothing here blocks: a tiny trial trains 30-50 steps a second, so a wait would let the good one finish."""
    cmd = [sys.executable, "-m", "kubetrain.core", "sweep", str(manifest), "--output-dir", str(out),
           "--summary-json", str(out.parent / "summary.json")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    session = Session(0, "", "")
    pruned_at: dict[int, tuple[float, Path]] = {}
    deadline = time.monotonic() + 150
    while proc.poll() is None and time.monotonic() < deadline:
        status = read_status(out)
        if interrupt_when is not None and interrupt_when(status):
            proc.send_signal(signal.SIGINT)
            session.status_when_stopped, interrupt_when = status, None
        for trial in status.get("trials", []):
            if trial["state"] == "Pruned":
                pruned_at.setdefault(trial["index"], (time.monotonic(), out / "trials" / trial["jobName"]))
        check_pruned(session, pruned_at, final=False)
        time.sleep(0.1)
    session.stdout, session.stderr = proc.communicate(timeout=STOP_S * 2)
    session.code = proc.returncode
    check_pruned(session, pruned_at, final=True)
    return session


def check_pruned(session: Session, pruned_at: dict[int, tuple[float, Path]], final: bool) -> None:
    """Record each pruned trial's processes as gone in time (True) or not (False) once that is known."""
    for index, (seen, directory) in pruned_at.items():
        if index in session.pruned_gone:
            continue
        left = seen + STOP_S - time.monotonic()
        if not processes_using(directory):
            session.pruned_gone[index] = True
        elif final or left < 0:
            session.pruned_gone[index] = final and ended_in_time(directory, max(0.0, left))


def mid_sweep(out: Path) -> Callable[[dict[str, Any]], bool]:
    """True once two trials have been recorded and the good one (never pruned) has trained past a checkpoint:
    a slow learner past step 60 may be pruned before the interrupt lands, and then nothing would resume."""
    def ready(status: dict[str, Any]) -> bool:
        trials = status.get("trials", [])
        good = [t["step"] for t in trials if t["state"] == "Running" and t["params"]["optimizer.lr"] == GOOD_LR]
        return len(trials) >= 2 and any(s >= 60 for s in good)
    return ready


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    manifest, out = sweep_manifest(tmp), tmp / "out"
    first = run_session(manifest, out, mid_sweep(out))
    left_after_stop = processes_using(out)
    second = run_session(manifest, out)
    return {"tmp": tmp, "out": out, "first": first, "second": second, "left_after_stop": left_after_stop,
            "manifest": manifest}


def test_ctrl_c_stops_every_trial_and_exits_130(sweep):
    first = sweep["first"]
    assert first.code == 130, first.stderr[-3000:]
    finished = [t for t in first.status_when_stopped["trials"] if t["state"] in ("Complete", "Pruned", "Failed")]
    assert len(finished) < 4, "the sweep was interrupted in the middle"
    assert "stopping: asking every running trial to checkpoint and exit" in first.stderr
    assert sweep["left_after_stop"] == []


def test_rerun_resumes_and_completes_without_a_duplicate_trial(sweep):
    second, out = sweep["second"], sweep["out"]
    assert second.code == 0, second.stderr[-3000:]
    assert "resuming the sweep saved in" in second.stderr
    status = read_status(out)
    assert status["phase"] == "Succeeded"
    assert [t["index"] for t in status["trials"]] == [0, 1, 2, 3]
    assert [t["jobName"] for t in status["trials"]] == [f"{NAME}-{i}" for i in range(4)]
    assert sorted(t["params"]["optimizer.lr"] for t in status["trials"]) == sorted([GOOD_LR, 1e-6, 1e-5, 1e-4])
    good = next(t for t in status["trials"] if t["params"]["optimizer.lr"] == GOOD_LR)
    log = (out / "trials" / good["jobName"] / "run.log").read_text()
    assert "resuming the unfinished run" in log, "the trial interrupted mid-run continued from its checkpoint"


def test_parallelism_is_never_exceeded(sweep):
    events = [json.loads(line) for line in (sweep["out"] / "processes.jsonl").read_text().splitlines()]
    running, most = set(), 0
    for e in sorted(events, key=lambda e: (e["time"], e["event"] == "start")):  # an exit before a start at one time
        if e["event"] == "start":
            running.add(e["index"])
            most = max(most, len(running))
        else:
            running.discard(e["index"])
    assert most == 2
    assert running == set()


def test_pruned_trials_are_stopped_and_their_processes_end(sweep):
    status = read_status(sweep["out"])
    pruned = [t for t in status["trials"] if t["state"] == "Pruned"]
    assert pruned, "a slow learner is pruned"
    assert all(t["params"]["optimizer.lr"] != GOOD_LR for t in pruned)
    assert all(t["step"] < 300 and t["message"].startswith("pruned at step") for t in pruned)
    seen = {**sweep["first"].pruned_gone, **sweep["second"].pruned_gone}
    assert seen and all(seen.values())
    assert processes_using(sweep["out"]) == []


def test_best_manifest_is_a_valid_job_with_the_best_params(sweep):
    out, second = sweep["out"], sweep["second"]
    status = read_status(out)
    best = status["trials"][status["bestTrial"]]
    assert best["state"] == "Complete" and best["params"]["optimizer.lr"] == GOOD_LR
    job = load_job(out / "best.yaml")
    assert job.metadata.name == f"{NAME}-best"
    assert job.spec.optimizer.lr == GOOD_LR
    assert Path(job.spec.data.path) == EXAMPLE_DATA.resolve()  # runs from anywhere
    summary = json.loads((sweep["tmp"] / "summary.json").read_text())
    assert (summary["best"]["trial"], summary["best"]["params"]) == (status["bestTrial"], status["bestParams"])
    assert summary["timings"]["unpruned_estimate_seconds"] > 0
    assert f"best: trial {status['bestTrial']}" in second.stdout
    assert "without pruning: ~" in second.stdout


def test_export_template_is_the_template_as_a_job_of_its_own(sweep, tmp_path):
    r = run_cli(["sweep", str(sweep["manifest"]), "--export-template"])
    assert r.returncode == 0, r.stderr
    (tmp_path / "t.yaml").write_text(r.stdout)
    job = load_job(tmp_path / "t.yaml")
    assert job.metadata.name == f"{NAME}-template"
    assert not job.metadata.labels
    assert job.spec.optimizer.lr == 1e-4 and job.spec.max_steps == 300
    assert Path(job.spec.data.path) == EXAMPLE_DATA.resolve()


def test_an_eval_loss_sweep_picks_its_best_trial_by_the_eval_loss(tmp_path):
    """objective.metric evalLoss: each Complete trial's value is its final eval loss (not its training loss), and
    the best trial is the one with the lowest."""
    spec = tiny_spec(maxSteps=20, evalEverySteps=10, evalBatches=2, metricsPort=free_port(2),
                     checkpoint={"everySteps": 10, "keep": 1}, optimizer={"lr": 1e-3, "minLr": 0.0, "warmupSteps": 2})
    manifest = tmp_path / "eval-sweep.yaml"
    manifest.write_text(yaml.safe_dump({
        "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingSweep", "metadata": {"name": "eval-sweep"},
        "spec": {"maxTrials": 3, "parallelism": 1, "sampler": {"type": "grid"}, "pruner": {"type": "none"},
                 "objective": {"metric": "evalLoss"}, "template": {"spec": spec},
                 "parameters": [{"path": "optimizer.lr", "type": "categorical", "values": [1e-2, 1e-3, 1e-5]}]},
    }))
    out = tmp_path / "out"
    done = run_cli(["sweep", str(manifest), "--output-dir", str(out)], timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    status = read_status(out)
    summaries = {t["index"]: json.loads((out / "trials" / t["jobName"] / "summary.json").read_text())
                 for t in status["trials"]}
    values = {t["index"]: t["value"] for t in status["trials"]}
    print(f"evalLoss sweep: values {values}; eval losses "
          f"{ {i: s['eval_loss'] for i, s in summaries.items()} }; training losses "
          f"{ {i: s['final_loss'] for i, s in summaries.items()} }; best trial {status['bestTrial']}")
    assert len(values) == 3 and all(t["state"] == "Complete" for t in status["trials"])
    assert all(values[i] == summaries[i]["eval_loss"] != summaries[i]["final_loss"] for i in values)
    assert status["bestTrial"] == min(values, key=values.__getitem__) and status["bestValue"] == min(values.values())
