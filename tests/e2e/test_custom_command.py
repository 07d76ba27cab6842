"""A user's own torchrun-style DDP script (ddp_script.py) as a custom command, 2 workers x 2
processes: kubetrain spawns every rank with the full contract env, through `kubetrain run` (the
local backend) and through the per-worker launcher exactly as a pod runs it."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support.ports import free_port
from support.trainer_harness import run_cli

from kubetrain.core import contract, launcher
from kubetrain.core.api import TrainingJob
from kubetrain.operator.jobs import builders

pytestmark = pytest.mark.e2e
HERE = Path(__file__).parent
SCRIPT = HERE / "ddp_script.py"
EPOCHS = 4
START = re.compile(r"^start rank=(\d+) local_rank=(\d+) world=(\d+) dist_rank=(\d+) dist_world=(\d+)$", re.M)


def ddp_spec(command: list[str] | None = None, args: list[str] | None = None) -> dict[str, Any]:
    return {
        "workers": 2, "procsPerWorker": 2,
        "command": command or ["python", str(SCRIPT)],  # `python`: the interpreter kubetrain runs under
        "args": [str(EPOCHS), "1", "--batch-size", "16"] if args is None else args,
        "restartPolicy": {"backoffLimit": 2, "backoffSeconds": 0.2}, "metricsPort": 19500,
    }


def manifest(tmp_path: Path, spec: dict[str, Any]) -> Path:
    f = tmp_path / "ddp.yaml"
    f.write_text(json.dumps({"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                             "metadata": {"name": "ddp"}, "spec": spec}))
    return f


def starts(text: str) -> list[tuple[int, ...]]:
    """(rank, local_rank, world, dist_rank, dist_world) of every `start` line."""
    return sorted(tuple(int(v) for v in m) for m in START.findall(text))


def losses(text: str, rank: int) -> list[float]:
    return [float(v) for v in re.findall(rf"^epoch \d+ rank {rank} loss ([\d.]+)$", text, re.M)]


def snapshot_epochs(ckpt: Path) -> int:
    return int(torch.load(ckpt / "snapshot.pt", map_location="cpu")["EPOCHS_RUN"])


def test_ddp_script_runs_as_two_workers_of_two_processes(tmp_path):
    out = tmp_path / "out"
    r = run_cli(["run", str(manifest(tmp_path, ddp_spec())), "--output-dir", str(out)], timeout=300)
    assert r.returncode == 0, r.stderr
    s = json.loads((out / "summary.json").read_text())
    assert (s["phase"], s["restarts"], s["world_size"]) == ("Succeeded", 0, 4)
    logs = {rank: (out / "logs" / "gen-0" / f"rank-{rank}.log").read_text() for rank in range(4)}
    for rank, log in logs.items():  # each rank: its own RANK, LOCAL_RANK = RANK mod 2, one process group
        assert starts(log) == [(rank, rank % 2, 4, rank, 4)], log
        assert f"done rank={rank}" in log
    assert snapshot_epochs(out / "checkpoints") == EPOCHS
    first, *_, last = losses(logs[0], 0)
    assert last < first


def test_a_killed_rank_restarts_the_gang_once_and_the_script_resumes_from_its_snapshot(tmp_path):
    out = tmp_path / "out"
    r = run_cli(["run", str(manifest(tmp_path, ddp_spec())), "--output-dir", str(out), "--fail-at", "1:2"],
                timeout=300)
    assert r.returncode == 0, r.stderr
    s = json.loads((out / "summary.json").read_text())
    assert (s["phase"], s["restarts"]) == ("Succeeded", 1)
    assert "restarting: worker 0 exited with code" in r.stderr
    assert "failure drill: rank 1 exits 137 in epoch 2" in (out / "logs" / "gen-0" / "rank-1.log").read_text()
    for rank in range(4):  # snapshots after epochs 1 and 2 were saved before rank 1 went away
        log = (out / "logs" / "gen-1" / f"rank-{rank}.log").read_text()
        assert f"resume rank={rank} epoch=2" in log and f"done rank={rank}" in log, log
        assert not re.search(rf"^epoch [01] rank {rank} ", log, re.M)  # no epoch trained twice
    assert not (out / "logs" / "gen-2").exists()
    assert snapshot_epochs(out / "checkpoints") == EPOCHS


def test_a_command_not_found_fails_the_job_permanently_with_127(tmp_path):
    out = tmp_path / "out"
    r = run_cli(["run", str(manifest(tmp_path, ddp_spec(["no-such-command"], []))), "--output-dir", str(out)])
    assert r.returncode == 1
    s = json.loads((out / "summary.json").read_text())
    assert (s["phase"], s["reason"], s["restarts"]) == ("Failed", "PermanentError", 0)
    assert "exited with code 127, listed in restartPolicy.permanentExitCodes" in s["message"]
    assert "kubetrain: no-such-command: command not found on PATH (exit 127)" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_the_pod_launcher_trains_the_script_as_a_pod_runs_it(tmp_path):
    """Two launchers, one per worker pod, started with the container command and env the operator
    builds; the ConfigMap's files stand in /etc/kubetrain; kubetrain is not importable by the launcher."""
    job = TrainingJob.model_validate({"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                                      "metadata": {"name": "ddp", "namespace": "ml"}, "spec": ddp_spec()})
    etc, ckpt = tmp_path / "etc-kubetrain", tmp_path / "checkpoints"  # the ConfigMap and claim mounts
    etc.mkdir()
    ckpt.mkdir()
    for name, text in builders.config_map(job)["data"].items():
        (etc / name).write_text(text)
    port = str(free_port())
    procs = []
    for index in range(job.spec.workers):
        pod = builders.worker_pod(job, index, 0, builders.WorkerSettings())
        container = pod["spec"]["containers"][0]
        command = [*container["command"], *container.get("args", [])]
        assert command[:3] == ["python3", f"{builders.CONFIG_MOUNT}/{launcher.SCRIPT}", "--"]
        # the image's python3 (here without site-packages: no kubetrain) runs the ConfigMap's file
        command[:2] = [sys.executable, "-S", "-E", str(etc / launcher.SCRIPT)]
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        (tmp_path / f"out-{index}").mkdir()  # the pod's emptyDir
        env.update({  # what differs from a pod: one host, no cluster DNS, local paths for the mounts
            contract.MASTER_ADDR: "127.0.0.1", contract.PET_MASTER_ADDR: "127.0.0.1",
            contract.MASTER_PORT: port, contract.PET_MASTER_PORT: port,
            contract.CHECKPOINT_DIR: str(ckpt), contract.CONFIG: str(etc / "config.json"),
            contract.OUTPUT_DIR: str(tmp_path / f"out-{index}"), contract.METRICS_PORT: "0",
            contract.RAN_FILE: str(tmp_path / f"out-{index}" / "ran-generation"),  # each pod has its own
            contract.GANG_PROBE_PORT: str(free_port()),  # each pod has its own address
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # the image's `python`
            "OMP_NUM_THREADS": "1",
        })
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    for index, text in enumerate(outputs):  # each pod's stdout holds its own two ranks
        assert starts(text) == [(2 * index + lr, lr, 4, 2 * index + lr, 4) for lr in range(2)], text
        assert {f"done rank={2 * index + lr}" for lr in range(2)} <= set(text.splitlines())
    assert snapshot_epochs(ckpt) == EPOCHS
    first, *_, last = losses(outputs[0], 0)
    assert last < first
