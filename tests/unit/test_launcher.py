"""The per-worker launcher (kubetrain.core.launcher) and how both backends use it: child envs,
commands that cannot start, the file the operator ships in a job's ConfigMap, local command rewriting."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.processes import rank_pid, stopped
from support.waiting import wait_for

from kubetrain.core import contract, hangs, launcher, ports
from kubetrain.core.api import TrainingJob
from kubetrain.core.local import LocalRun, RunOptions, ensure_writable, worker_command
from kubetrain.operator.jobs import builders

TORCH_VARS = (
    contract.RANK, contract.LOCAL_RANK, contract.WORLD_SIZE, contract.LOCAL_WORLD_SIZE, contract.NODE_RANK,
    contract.PET_NNODES, contract.PET_NPROC_PER_NODE, contract.PET_NODE_RANK,
)


def job(**spec) -> TrainingJob:
    return TrainingJob.model_validate({
        "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "ddp", "namespace": "team-a"}, "spec": spec,
    })


def pod_env(j: TrainingJob, index: int) -> dict[str, str]:
    return {e["name"]: e["value"] for e in builders.worker_env(j, index, 0) if "value" in e}


def pod_child_envs(j: TrainingJob) -> list[dict[str, str]]:
    return [env for i in range(j.spec.workers) for env in launcher.child_envs(pod_env(j, i))]


def test_child_envs_of_two_pods_with_two_procs_each_get_the_whole_contract():
    envs = pod_child_envs(job(workers=2, procsPerWorker=2, command=["python", "train.py"]))
    assert [(e["RANK"], e["LOCAL_RANK"], e["NODE_RANK"]) for e in envs] == [
        ("0", "0", "0"), ("1", "1", "0"), ("2", "0", "1"), ("3", "1", "1")]
    master = "ddp-worker-0.ddp.team-a.svc"
    for e in envs:
        assert (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["PET_NNODES"], e["PET_NPROC_PER_NODE"]) == ("4", "2", "2", "2")
        assert e["PET_NODE_RANK"] == e["NODE_RANK"]
        assert e["MASTER_ADDR"] == e["PET_MASTER_ADDR"] == master and e["MASTER_PORT"] == e["PET_MASTER_PORT"] == "29500"
        assert (e[contract.JOB], e[contract.CHECKPOINT_DIR], e[contract.OUTPUT_DIR]) == (
            "ddp", "/checkpoints", "/var/run/kubetrain")
    assert [e[contract.METRICS_PORT] for e in envs] == ["9400", "9401", "9400", "9401"]  # one pod, one IP each


def test_local_backend_gives_every_rank_the_pods_contract(tmp_path):
    j = job(workers=2, procsPerWorker=2, command=["python", "train.py"])
    run = LocalRun(j, tmp_path, RunOptions(output_dir=tmp_path / "out"))
    local = [e for n in range(2) for e in launcher.child_envs(run._worker_env(n, 1, 29999))]
    assert [[e[v] for v in TORCH_VARS] for e in local] == [[e[v] for v in TORCH_VARS] for e in pod_child_envs(j)]
    assert {e["MASTER_ADDR"] for e in local} == {"127.0.0.1"} and {e["MASTER_PORT"] for e in local} == {"29999"}
    assert [e[contract.METRICS_PORT] for e in local] == ["9400", "9401", "9402", "9403"]  # one host
    assert {e[contract.CHECKPOINT_DIR] for e in local} == {str(tmp_path / "out" / "checkpoints")}
    assert {e[contract.RESTART_GENERATION] for e in local} == {"1"}


def test_local_ranks_share_the_machines_cores_unless_the_job_or_the_shell_chose(tmp_path, monkeypatch):
    for var in contract.THREAD_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)

    def threads(**spec) -> tuple[str, str]:
        run = LocalRun(job(command=["python", "train.py"], **spec), tmp_path, RunOptions(output_dir=tmp_path / "out"))
        env = run._worker_env(0, 0, 29999)
        return env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"]

    assert threads(workers=2) == ("2", "2")  # 4 cores, 2 ranks
    assert threads(workers=2, procsPerWorker=4) == ("1", "1")  # 8 ranks on 4 cores: still one each
    assert threads(workers=2, env=[{"name": "OMP_NUM_THREADS", "value": "3"}]) == ("3", "2")
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    assert threads(workers=1) == ("4", "1")


def test_child_envs_of_a_pod_with_four_procs():
    envs = launcher.child_envs({
        "PET_NPROC_PER_NODE": "4", "PET_NNODES": "2", "NODE_RANK": "1", "PET_MASTER_ADDR": "job-worker-0",
        "PET_MASTER_PORT": "29500", "KUBETRAIN_METRICS_PORT": "9400",
    })
    assert [e["RANK"] for e in envs] == ["4", "5", "6", "7"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2", "3"]
    assert {e["WORLD_SIZE"] for e in envs} == {"8"} and {e["MASTER_ADDR"] for e in envs} == {"job-worker-0"}
    assert [e["KUBETRAIN_METRICS_PORT"] for e in envs] == ["9400", "9401", "9402", "9403"]


def test_torch_env_of_a_whole_worker_leaves_the_ranks_to_its_launcher_unless_it_is_one_process():
    whole = contract.torch_env(contract.WorkerPlacement.worker(1, 2, 3), "m", 29500)
    procs = [contract.torch_env(contract.WorkerPlacement(1, i, 2, 3), "m", 29500) for i in range(2)]
    assert contract.RANK not in whole and contract.LOCAL_RANK not in whole
    assert [(p[contract.RANK], p[contract.LOCAL_RANK]) for p in procs] == [("2", "0"), ("3", "1")]
    per_rank = (contract.RANK, contract.LOCAL_RANK)
    assert all({k: v for k, v in p.items() if k not in per_rank} == whole for p in procs)
    single = contract.torch_env(contract.WorkerPlacement.worker(2, 1, 3), "m", 29500)
    assert (single[contract.RANK], single[contract.LOCAL_RANK], single[contract.WORLD_SIZE]) == ("2", "0", "3")


def test_a_malformed_contract_variable_is_named():
    with pytest.raises(ValueError, match="PET_NPROC_PER_NODE/LOCAL_WORLD_SIZE='two': not an integer"):
        launcher.child_envs({"PET_NPROC_PER_NODE": "two"})


def started(command: list[str], path: Path) -> tuple[object, str]:
    """start() with stdout to a log file, as the local backend does; what the log then holds."""
    log = path / "rank-0.log"
    with log.open("wb") as out:
        proc = launcher.start(command, {"PATH": str(path)}, stdout=out)
    return proc, log.read_text()


def test_a_command_not_found_exits_127_with_one_line(tmp_path):
    proc, said = started(["no-such-command", "--flag"], tmp_path)
    assert isinstance(proc, launcher.NotStarted) and proc.poll() == proc.wait() == 127
    assert said == "kubetrain: no-such-command: command not found on PATH (exit 127)\n"
    proc, said = started([str(tmp_path / "missing.sh")], tmp_path)
    assert (proc.poll(), said) == (127, f"kubetrain: {tmp_path}/missing.sh: no such file (exit 127)\n")


def test_a_file_that_cannot_be_executed_exits_126_or_names_its_interpreter(tmp_path):
    plain = tmp_path / "train.sh"
    plain.write_text("echo hi\n")
    proc, said = started(["train.sh"], tmp_path)  # found on PATH by name, but no execute bit
    assert (proc.poll(), said) == (126, "kubetrain: train.sh: cannot execute: Permission denied (exit 126)\n")
    script = tmp_path / "run"
    script.write_text("#!/no/such/interpreter\n")
    script.chmod(0o755)
    proc, said = started(["run"], tmp_path)
    assert proc.poll() == 127
    assert said == f"kubetrain: run: {script} exists but cannot be started: its #! interpreter was not found (exit 127)\n"


def test_a_command_that_starts_is_a_popen(tmp_path):
    proc = launcher.start([sys.executable, "-c", "import os; raise SystemExit(int(os.environ['X']))"], {"X": "5"})
    assert isinstance(proc, subprocess.Popen) and proc.wait() == 5


# ---------------------------------------------------------------- the file a pod runs


@pytest.fixture
def configmap_dir(tmp_path) -> Path:
    """The job's ConfigMap as a pod mounts it at /etc/kubetrain."""
    d = tmp_path / "etc-kubetrain"
    d.mkdir()
    j = job(workers=2, procsPerWorker=2, command=["python", "train.py"])
    for name, text in builders.config_map(j)["data"].items():
        (d / name).write_text(text)
    return d


def pod_launcher(configmap_dir: Path, *command: str, env: dict[str, str], **kw) -> subprocess.Popen:
    """`python3 /etc/kubetrain/launcher.py -- COMMAND` with neither site-packages nor PYTHONPATH: kubetrain
    is not importable, as in a user's own image."""
    return subprocess.Popen(
        [sys.executable, "-S", "-E", str(configmap_dir / launcher.SCRIPT), "--", *command],
        env={"PATH": os.environ["PATH"], **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_the_configmap_launcher_runs_without_kubetrain_and_starts_every_rank(configmap_dir):
    no_kubetrain = subprocess.run([sys.executable, "-S", "-E", "-c", "import kubetrain.core"], capture_output=True)
    assert no_kubetrain.returncode != 0  # what makes this test mean something
    env = {"PET_NPROC_PER_NODE": "2", "PET_NNODES": "2", "NODE_RANK": "1", "PET_MASTER_ADDR": "ddp-worker-0"}
    # one write per line: the ranks share the pod's stdout
    show = "import os, sys; sys.stdout.write('{RANK} {LOCAL_RANK} {MASTER_ADDR}\\n'.format(**os.environ))"
    p = pod_launcher(configmap_dir, sys.executable, "-S", "-c", show, env=env)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert sorted(out.splitlines()) == ["2 0 ddp-worker-0", "3 1 ddp-worker-0"]


def test_the_configmap_launcher_exits_127_for_a_command_not_found_without_a_traceback(configmap_dir):
    p = pod_launcher(configmap_dir, "no-such-command", env={"PET_NPROC_PER_NODE": "2"})
    out, err = p.communicate(timeout=60)
    assert p.returncode == 127
    assert err == "kubetrain: no-such-command: command not found on PATH (exit 127)\n"  # once, not per rank
    p = pod_launcher(configmap_dir, env={})
    assert p.communicate(timeout=60)[1].startswith("usage:") and p.returncode == 2


def test_the_launcher_reports_the_root_cause_and_stops_the_other_ranks(configmap_dir):
    # local rank 0 loses its peer at once (exit 3); local rank 1, the real cause, fails a moment later
    code = ("import os, sys, time; r = int(os.environ['LOCAL_RANK']); time.sleep(0.3 * r); "
            "sys.exit(3 if r == 0 else 7 if r == 1 else time.sleep(600))")
    p = pod_launcher(configmap_dir, sys.executable, "-S", "-c", code, env={"PET_NPROC_PER_NODE": "3"})
    p.communicate(timeout=60)
    assert p.returncode == 7  # rank 2 (sleeping) was terminated, not waited for


def test_a_rank_that_nccl_aborted_is_not_the_root_cause(configmap_dir):
    # local rank 0 is aborted at once (SIGABRT, exit 134: NCCL's watchdog after its peer failed); local rank 1,
    # the real cause, fails a moment later and is reported
    code = ("import os, sys, time; r = int(os.environ['LOCAL_RANK']); time.sleep(0.3 * r); "
            "os.abort() if r == 0 else sys.exit(7)")
    p = pod_launcher(configmap_dir, sys.executable, "-S", "-c", code, env={"PET_NPROC_PER_NODE": "2"})
    p.communicate(timeout=60)
    assert p.returncode == 7


def test_the_launcher_forwards_sigterm_to_every_rank(configmap_dir, tmp_path):
    code = ("import os, signal, sys, time; r = os.environ['RANK']; "
            "signal.signal(signal.SIGTERM, lambda *_: (open(os.path.join(sys.argv[1], 'term-' + r), 'w').close(), "
            "sys.exit(143))); open(os.path.join(sys.argv[1], 'up-' + r), 'w').close(); time.sleep(600)")
    p = pod_launcher(configmap_dir, sys.executable, "-S", "-c", code, str(tmp_path), env={"PET_NPROC_PER_NODE": "2"})
    deadline = time.monotonic() + 60
    while not ((tmp_path / "up-0").exists() and (tmp_path / "up-1").exists()):
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=60)
    assert p.returncode == 143
    assert (tmp_path / "term-0").exists() and (tmp_path / "term-1").exists()


# ---------------------------------------------------------------- restarting in place

# Each rank records the generation it runs; generation 0 does what `first` says, later ones exit 0. A rank
# that sees the launcher's own variables exits 9 (a one-process trainer would take itself for the launcher).
IN_PLACE_RANK = (
    "import os, sys, time; d = sys.argv[1]; g = os.environ['KUBETRAIN_RESTART_GENERATION']; "
    "r = os.environ['LOCAL_RANK']; sys.exit(9) if 'KUBETRAIN_GENERATION_FILE' in os.environ else None; "
    "open(os.path.join(d, 'ran-' + g + '-' + r), 'w').close(); "
    "sys.exit(0) if g != '0' else None; FIRST")


def in_place_launcher(configmap_dir: Path, tmp_path: Path, first: str, wait: str = "60") -> tuple[subprocess.Popen, Path]:
    gen = tmp_path / "generation"
    gen.write_text("0")
    env = {"PET_NPROC_PER_NODE": "2", contract.RESTART_GENERATION: "0", contract.GENERATION_FILE: str(gen),
           contract.IN_PLACE_WAIT: wait, contract.RAN_FILE: str(tmp_path / "ran-generation")}
    code = IN_PLACE_RANK.replace("FIRST", first)
    return pod_launcher(configmap_dir, sys.executable, "-S", "-c", code, str(tmp_path), env=env), gen


def wait_for_files(d: Path, *names: str) -> None:
    """Until a file matches each name (a glob pattern)."""
    deadline = time.monotonic() + 60
    while not all(list(d.glob(n)) for n in names):
        assert time.monotonic() < deadline, sorted(p.name for p in d.iterdir())
        time.sleep(0.05)


def test_a_worker_that_lost_its_peers_waits_and_runs_the_next_generation(configmap_dir, tmp_path):
    p, gen = in_place_launcher(configmap_dir, tmp_path, "sys.exit(3)")
    wait_for_files(tmp_path, "ran-0-0", "ran-0-1")
    time.sleep(launcher.PEER_LOST_GRACE_SECONDS + 0.5)
    assert p.poll() is None  # a lost peer is another worker's failure: this pod stays
    gen.write_text("2")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert (tmp_path / "ran-2-0").exists() and (tmp_path / "ran-2-1").exists()
    assert "waiting up to 60s for the next generation" in err and "starting generation 2 in place (was 0)" in err


def _accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_worker_that_lost_its_peers_is_not_ready_until_its_next_generation(configmap_dir, tmp_path):
    """The readiness probe's port: open while a generation runs, closed while the launcher waits for the next
    one after its ranks lost their peers (the operator's sign that the gang broke), open again after."""
    gen, port = tmp_path / "generation", ports.free_port()
    gen.write_text("0")
    env = {"PET_NPROC_PER_NODE": "1", contract.RESTART_GENERATION: "0", contract.GENERATION_FILE: str(gen),
           contract.IN_PLACE_WAIT: "60", contract.GANG_PROBE_PORT: str(port)}
    code = ("import os, sys, time; g = os.environ['KUBETRAIN_RESTART_GENERATION']; d = sys.argv[1]; "
            "open(os.path.join(d, 'ran-' + g), 'w').close(); "
            "[time.sleep(0.05) for _ in iter(lambda: os.path.exists(os.path.join(d, 'go-' + g)), True)]; "
            "sys.exit(3 if g == '0' else 0)")
    p = pod_launcher(configmap_dir, sys.executable, "-S", "-c", code, str(tmp_path), env=env)
    wait_for_files(tmp_path, "ran-0")
    wait_for(lambda: _accepts(port), 30, interval=0.1, what="the probe port open in generation 0")
    (tmp_path / "go-0").touch()  # generation 0's rank exits as a rank whose peer went away
    wait_for(lambda: not _accepts(port), 30, interval=0.1, what="the probe port closed while waiting")
    gen.write_text("1")
    wait_for_files(tmp_path, "ran-1")
    wait_for(lambda: _accepts(port), 30, interval=0.1, what="the probe port open in generation 1")
    (tmp_path / "go-1").touch()
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert not _accepts(port)


def test_the_probe_port_closes_at_once_and_opens_again_at_once():
    """A generation that comes right after the launcher began to wait reopens the port: closed, it stops
    listening at once, though its serving thread still waits in accept()."""
    probe = launcher.GangProbe(ports.free_port())
    try:
        for _ in range(5):
            probe.open()
            assert probe.sock is not None and _accepts(probe.port)
            probe.close()
            assert not _accepts(probe.port)
    finally:
        probe.close()


def test_a_new_generation_kills_the_running_processes_and_starts_them_again(configmap_dir, tmp_path):
    p, gen = in_place_launcher(configmap_dir, tmp_path, "time.sleep(600)")
    wait_for_files(tmp_path, "ran-0-0", "ran-0-1")
    gen.write_text("1")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert (tmp_path / "ran-1-0").exists() and (tmp_path / "ran-1-1").exists()


def test_a_worker_whose_ranks_stopped_with_the_gang_waits_for_the_next_generation(configmap_dir, tmp_path):
    # Another worker's pod was deleted: every rank checkpoints and exits 143, this launcher got no SIGTERM.
    p, gen = in_place_launcher(configmap_dir, tmp_path, "sys.exit(143)")
    wait_for_files(tmp_path, "ran-0-0", "ran-0-1")
    time.sleep(1)
    assert p.poll() is None
    gen.write_text("1")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert (tmp_path / "ran-1-0").exists() and (tmp_path / "ran-1-1").exists()


def test_a_worker_whose_own_process_fails_still_exits_with_its_code(configmap_dir, tmp_path):
    p, _ = in_place_launcher(configmap_dir, tmp_path, "sys.exit(7 if r == '1' else 3)")
    p.communicate(timeout=60)
    assert p.returncode == 7


def test_a_restarted_container_waits_for_the_next_generation_instead_of_rerunning_the_failed_one(
        configmap_dir, tmp_path):
    p, gen = in_place_launcher(configmap_dir, tmp_path, "sys.exit(7 if r == '1' else 3)")
    p.communicate(timeout=60)
    assert p.returncode == 7 and (tmp_path / "ran-generation").read_text().strip() == "0"
    for ran in tmp_path.glob("ran-0-*"):
        ran.unlink()
    # The kubelet starts the container again in the same pod: same env, same files.
    again, _ = in_place_launcher(configmap_dir, tmp_path, "sys.exit(7 if r == '1' else 3)")
    time.sleep(1)
    assert again.poll() is None and not list(tmp_path.glob("ran-0-*"))
    gen.write_text("1")
    out, err = again.communicate(timeout=60)
    assert again.returncode == 0, err
    assert (tmp_path / "ran-1-0").exists() and (tmp_path / "ran-1-1").exists()
    assert "generation 0 failed in this pod before this container restarted" in err
    assert (tmp_path / "ran-generation").read_text().strip() == "1"


# A rank that can stand by: started with KUBETRAIN_STANDBY it notes its pid, then reads its generation.
STANDBY_RANK = """import os, sys
d, r = sys.argv[1], os.environ['LOCAL_RANK']
if os.environ.get('KUBETRAIN_STANDBY'):
    open(os.path.join(d, 'standby-%s-%d' % (r, os.getpid())), 'w').close()
    line = sys.stdin.readline().strip()
    if not line:
        sys.exit(0)
    os.environ['KUBETRAIN_RESTART_GENERATION'] = line
g = os.environ['KUBETRAIN_RESTART_GENERATION']
open(os.path.join(d, 'ran-%s-%s-%d' % (g, r, os.getpid())), 'w').close()
sys.exit(3 if g == '0' else 0)
"""


def test_a_waiting_worker_starts_its_ranks_on_standby_and_hands_them_the_next_generation(tmp_path):
    gen = tmp_path / "generation"
    gen.write_text("0")
    env = {**os.environ, "PET_NPROC_PER_NODE": "2", contract.RESTART_GENERATION: "0",
           contract.GENERATION_FILE: str(gen), contract.IN_PLACE_WAIT: "60"}
    run = "import sys; from kubetrain.core.launcher import launch; sys.exit(launch(sys.argv[1:], standby=True))"
    p = subprocess.Popen([sys.executable, "-c", run, sys.executable, "-c", STANDBY_RANK, str(tmp_path)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_files(tmp_path, "ran-0-0-*", "ran-0-1-*", "standby-0-*", "standby-1-*")
    standby = sorted(f.name.rsplit("-", 1)[1] for f in tmp_path.glob("standby-*"))
    assert not list(tmp_path.glob("ran-1-*"))  # on standby: started, not running a generation
    gen.write_text("1")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert sorted(f.name.rsplit("-", 1)[1] for f in tmp_path.glob("ran-1-*")) == standby  # the same processes


def test_a_worker_told_no_new_generation_in_time_exits_75(configmap_dir, tmp_path):
    p, _ = in_place_launcher(configmap_dir, tmp_path, "sys.exit(3)", wait="0.5")
    out, err = p.communicate(timeout=60)
    assert p.returncode == contract.IN_PLACE_GAVE_UP_EXIT_CODE == 75
    assert "no new generation within 0.5s; exiting 75" in err


def test_a_waiting_worker_stops_on_sigterm(configmap_dir, tmp_path):
    p, _ = in_place_launcher(configmap_dir, tmp_path, "sys.exit(3)")
    wait_for_files(tmp_path, "ran-0-0", "ran-0-1")
    time.sleep(launcher.PEER_LOST_GRACE_SECONDS + 0.5)  # past the grace: waiting for a generation
    assert p.poll() is None
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 143 and "waiting up to 60s" in err


# ---------------------------------------------------------------- local backend


def test_local_python_is_the_interpreter_kubetrain_runs_under():
    spec = job(command=["python", "train.py"], args=["--epochs", "3"]).spec
    assert worker_command(spec, python="/venv/bin/python") == ["/venv/bin/python", "train.py", "--epochs", "3"]
    assert worker_command(job(command=["python3", "-m", "pkg"]).spec, python="/p") == ["/p", "-m", "pkg"]
    for command in (["python3.11", "t.py"], ["/usr/bin/python", "t.py"], ["torchrun", "t.py"]):
        assert worker_command(job(command=command).spec, python="/p") == command
    assert worker_command(job().spec, python="/p") == ["/p", "-m", "kubetrain.trainer"]


def test_local_directories_exist_before_any_process_starts(tmp_path):
    ckpt, out = tmp_path / "a" / "checkpoints", tmp_path / "out"
    ensure_writable(ckpt, out)
    assert ckpt.is_dir() and out.is_dir()


BEATING_RANK = """
import json, os, sys, time
where, rank = os.environ["KUBETRAIN_HEARTBEAT_DIR"], os.environ["RANK"]
def beat(step):
    with open(os.path.join(where, "rank-%s.beat.tmp" % rank), "w") as f:
        f.write(json.dumps({"step": step, "phase": "train"}))
    os.replace(os.path.join(where, "rank-%s.beat.tmp" % rank), os.path.join(where, "rank-%s.beat" % rank))
def stuck_in_the_data_loader():
    time.sleep(600)
for step in range(1, 1000):
    if rank == "1" and step == 4:
        stuck_in_the_data_loader()
    beat(step)
    time.sleep(0.1)
"""


def test_the_configmap_launcher_finds_a_silent_rank_saves_every_stack_and_exits_124(configmap_dir, tmp_path):
    """A custom command's ranks write heartbeats (JSON, no kubetrain); one stops at step 4. The launcher,
    without kubetrain itself, declares the worker hung, asks each rank for its stack (the sitecustomize it
    puts on their PYTHONPATH registered the dump), saves them and exits 124 naming where each rank is."""
    hang = "min=1,factor=2,phase=5,start=5"
    env = {"PET_NPROC_PER_NODE": "2", contract.HANG: hang, contract.OUTPUT_DIR: str(tmp_path / "out"),
           contract.HANG_DIR: str(tmp_path / "hangs"), contract.RESTART_GENERATION: "2"}
    t0 = time.monotonic()
    p = pod_launcher(configmap_dir, sys.executable, "-c", BEATING_RANK, env=env)
    _out, err = p.communicate(timeout=60)
    assert p.returncode == contract.HUNG_EXIT_CODE, err
    assert time.monotonic() - t0 < 30
    lines = [line for line in err.splitlines() if "hang:" in line]
    assert "rank 1 is in stuck_in_the_data_loader (<string>:9) at step 3" in lines[0], lines
    # Rank 0 kept beating: it is not odd, and "waits" wherever its stack was taken: mostly in the sleep
    # between beats (line 14), under load at times inside a beat's write.
    assert re.search(r"rank 0 waits in (<module> \(<string>:14\)|beat \(<string>:\d+\))$", lines[0]), lines
    saved = tmp_path / "hangs" / "gen-2"
    assert sorted(f.name for f in saved.iterdir()) == ["rank-0.txt", "rank-1.txt"]
    assert 'line 9 in stuck_in_the_data_loader' in (saved / "rank-1.txt").read_text()


def test_a_rank_stopped_from_outside_is_reported_after_seconds_not_after_min_seconds(configmap_dir, tmp_path):
    """SIGSTOP of one rank of a custom command: the kernel says it is stopped, so the launcher reports it once
    it is STOPPED_SECONDS silent, under a minSeconds of 120, and ends without the settle time."""
    env = {"PET_NPROC_PER_NODE": "2", contract.HANG: "min=120,factor=10,phase=120,start=120",
           contract.OUTPUT_DIR: str(tmp_path / "out"), contract.HANG_DIR: str(tmp_path / "hangs")}
    beats = tmp_path / "out" / "hang-watch" / "beats"
    p = pod_launcher(configmap_dir, sys.executable, "-c", BEATING_RANK.replace('rank == "1" and step == 4', 'False'),
                     env=env)
    try:
        wait_for_files(beats, "rank-0.beat", "rank-1.beat")
        os.kill(wait_for(lambda: rank_pid(beats, 1), 30, what="rank 1's process"), signal.SIGSTOP)
        _out, err = p.communicate(timeout=60)  # 120 s of minSeconds would time out here
    finally:
        p.kill()
    assert p.returncode == contract.HUNG_EXIT_CODE, err
    lines = [line for line in err.splitlines() if "hang:" in line]
    assert "rank 1 is stopped (SIGSTOP) at step" in lines[0], lines
    assert f"past a limit of {hangs.STOPPED_SECONDS:.0f}s" in lines[1], lines


def test_a_worker_whose_gang_restarted_while_it_saved_its_stacks_runs_the_new_generation(configmap_dir, tmp_path):
    """Both workers of a hung gang find it silent at about the same moment; the first report restarts the
    gang. The second worker, which learns of the new generation while it saves its stacks, runs it instead
    of exiting 124: that exit would be counted as a failure of the new generation."""
    gen = tmp_path / "generation"
    gen.write_text("0")
    env = {"PET_NPROC_PER_NODE": "2", contract.HANG: "min=1,factor=2,phase=5,start=5",
           contract.OUTPUT_DIR: str(tmp_path / "out"), contract.HANG_DIR: str(tmp_path / "hangs"),
           contract.RESTART_GENERATION: "0", contract.GENERATION_FILE: str(gen), contract.IN_PLACE_WAIT: "60"}
    rank = "import os, sys\nif os.environ['KUBETRAIN_RESTART_GENERATION'] != '0': sys.exit(0)\n" + BEATING_RANK
    p = pod_launcher(configmap_dir, sys.executable, "-c", rank, env=env)
    wait_for_files(tmp_path / "hangs" / "gen-0", "rank-1.txt")  # saved; it now waits HANG_SETTLE_SECONDS
    gen.write_text("1")
    _out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert "generation 1 began while this worker reported its hang" in err
    assert "starting generation 1 in place (was 0)" in err


def test_a_stopping_worker_whose_rank_hangs_ends_without_waiting_out_the_grace_period(configmap_dir, tmp_path):
    """SIGTERM reaches a rank that cannot act on it (here it ignores it and stops beating; in a gang, one
    blocked joining peers that are gone): the hang watch ends it instead of the pod's grace period."""
    env = {"PET_NPROC_PER_NODE": "2", contract.HANG: "min=1,factor=2,phase=5,start=5",
           contract.OUTPUT_DIR: str(tmp_path / "out"), contract.HANG_DIR: str(tmp_path / "hangs")}
    rank = "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + BEATING_RANK.replace(
        'rank == "1" and step == 4', 'step == 30')
    p = pod_launcher(configmap_dir, sys.executable, "-c", rank, env=env)
    wait_for_files(tmp_path / "out" / "hang-watch" / "beats", "rank-0.beat", "rank-1.beat")
    p.send_signal(signal.SIGTERM)
    _out, err = p.communicate(timeout=60)
    assert p.returncode == 143, err
    assert "hang: " in err and (tmp_path / "hangs" / "gen-0" / "rank-0.txt").exists()


def test_a_stop_signal_that_comes_while_a_rank_is_started_reaches_it(monkeypatch):
    """The signal handler can run between a child's start and its listing (a loaded machine runs the child
    first): that child gets the signal all the same, not a wait for its own end."""
    stop: list[int] = []
    started = launcher.start

    def start_then_signalled(command, env):
        child = started(command, env)
        stop.append(signal.SIGTERM)  # what `forward` records when it runs here, before the child is listed
        return child

    monkeypatch.setattr(launcher, "start", start_then_signalled)
    children: list = []
    code = launcher._start([sys.executable, "-S", "-c", "import time; time.sleep(60)"], [dict(os.environ)], children,
                           stop)
    assert code is None and len(children) == 1
    assert children[0].wait(timeout=20) == -signal.SIGTERM


def test_a_peer_answers_while_its_launcher_lives_and_not_while_it_is_stopped(tmp_path):
    """hangs.peer_answers against a real launcher's probe: a live one accepts, a SIGSTOPped one leaves the
    connection in its kernel's backlog, a port nobody listens on refuses (the backend learns of that worker
    otherwise), and a name that does not resolve is no verdict."""
    port = ports.free_port()
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); import launcher; "
            f"p = launcher.GangProbe({port}); p.open(); print('listening', flush=True); time.sleep(600)")
    peer = subprocess.Popen([sys.executable, "-S", "-c", code, str(Path(launcher.__file__).parent)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout is not None and peer.stdout.readline().strip() == "listening"
        assert hangs.peer_answers("127.0.0.1", port, timeout=1.0) is True
        os.kill(peer.pid, signal.SIGSTOP)
        # The signal takes effect when the kernel next runs the process (late on a loaded machine): until then
        # its probe could still accept.
        wait_for(lambda: stopped(peer.pid), 30, what="the peer's launcher stopped")
        t0 = time.monotonic()
        assert hangs.peer_answers("127.0.0.1", port, timeout=1.0) is False
        assert 0.9 < time.monotonic() - t0 < 5
        watch = hangs.PeerWatch({1: "127.0.0.1"}, port)
        assert watch.silent() == [] and watch.silent() == [1]  # named on the second miss in a row
        os.kill(peer.pid, signal.SIGCONT)
        assert hangs.peer_answers("127.0.0.1", port, timeout=1.0) is True and watch.silent() == []
    finally:
        os.kill(peer.pid, signal.SIGCONT)
        peer.kill()
        peer.wait()
    assert hangs.peer_answers("127.0.0.1", port, timeout=1.0) is True  # refused: nothing listens
    assert hangs.peer_answers("no-such-worker.invalid", port, timeout=1.0) is None


WAITING_RANK = """
import json, os, time
where, rank = os.environ["KUBETRAIN_HEARTBEAT_DIR"], os.environ["RANK"]
def in_all_reduce():
    time.sleep(600)
for step in range(1, 4):
    with open(os.path.join(where, "rank-%s.beat.tmp" % rank), "w") as f:
        f.write(json.dumps({"step": step, "phase": "train"}))
    os.replace(os.path.join(where, "rank-%s.beat.tmp" % rank), os.path.join(where, "rank-%s.beat" % rank))
    time.sleep(0.1)
in_all_reduce()
"""


def test_a_worker_whose_peer_froze_names_it_in_seconds_and_not_while_it_answers(configmap_dir, tmp_path):
    """Two launchers as two workers' pods. Worker 0's rank waits in a collective (quiet, running) under a
    minSeconds of 120; worker 1's launcher answers on its probe port, so worker 0 waits on. Worker 1's whole
    pod is then stopped (its node frozen): worker 0 names it within seconds and exits 124."""
    port, gen = ports.free_port(), tmp_path / "generation"
    gen.write_text("0")
    peer_env = {"PET_NPROC_PER_NODE": "1", contract.RESTART_GENERATION: "0", contract.GENERATION_FILE: str(gen),
                contract.IN_PLACE_WAIT: "600", contract.GANG_PROBE_PORT: str(port)}
    peer = pod_launcher(configmap_dir, sys.executable, "-c", "import time; time.sleep(600)", env=peer_env,
                        start_new_session=True)
    env = {"PET_NPROC_PER_NODE": "1", contract.HANG: "min=120,factor=10,phase=120,start=120",
           contract.OUTPUT_DIR: str(tmp_path / "out"), contract.HANG_DIR: str(tmp_path / "hangs"),
           contract.PEER_HOSTS: "1=127.0.0.1", contract.GANG_PROBE_PORT: str(port)}
    try:
        wait_for(lambda: _accepts(port), 30, interval=0.1, what="worker 1's probe port")
        worker = pod_launcher(configmap_dir, sys.executable, "-c", WAITING_RANK, env=env)
        with pytest.raises(subprocess.TimeoutExpired):  # quiet past PEER_ASK_SECONDS, but its peer answers
            worker.wait(timeout=hangs.PEER_ASK_SECONDS + 6)
        os.killpg(peer.pid, signal.SIGSTOP)
        frozen = time.monotonic()
        _out, err = worker.communicate(timeout=60)
        took = time.monotonic() - frozen
    finally:
        os.killpg(peer.pid, signal.SIGCONT)
        os.killpg(peer.pid, signal.SIGKILL)
        peer.wait()
    assert worker.returncode == contract.HUNG_EXIT_CODE, err
    lines = [line for line in err.splitlines() if "hang:" in line]
    assert "worker 1 (127.0.0.1) does not answer (its node frozen, cut off or gone): rank 0 waits in " \
           "in_all_reduce" in lines[0], lines
    assert took < hangs.PEER_ANSWER_SECONDS * hangs.PEER_MISSES + 4, took
    assert (tmp_path / "hangs" / "gen-0" / "rank-0.txt").exists()
