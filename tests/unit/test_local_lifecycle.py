"""The local backend carries out every lifecycle action, with real (tiny) worker processes."""

import json
import signal
import threading
from datetime import UTC, datetime
from pathlib import Path

import pytest
from support.waiting import wait_for

from kubetrain.core import cli, hardware
from kubetrain.core.api import Phase, TrainingJob
from kubetrain.core.lifecycle import Action, CreateWorkers, DeleteJob, Transition, step
from kubetrain.core.local import LocalRun, LocalRunError, RunOptions

GEN0_FAILS = "import os, sys; sys.exit({code} if os.environ['KUBETRAIN_RESTART_GENERATION'] == '0' else 0)"


def job(command: str, **spec) -> TrainingJob:
    return TrainingJob.model_validate({
        "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "t"},
        "spec": {"workers": 2, "maxSteps": 1, "command": ["python", "-c", command],
                 "restartPolicy": {"backoffSeconds": 0, "backoffLimit": 2}, **spec}})


def local(tmp_path: Path, command: str, **spec) -> LocalRun:
    return LocalRun(job(command, **spec), tmp_path, RunOptions(output_dir=tmp_path / "out", poll_seconds=0.05,
                                                                quiet=True))


def alive(run: LocalRun) -> list[int]:
    return [p.rank for p in run.gen.procs if p.popen.poll() is None] if run.gen else []


def test_suspended_manifest_ends_at_once_without_starting_a_worker(tmp_path):
    s = local(tmp_path, "pass", suspend=True).run()
    assert (s.phase, s.reason, s.restarts) == ("Suspended", "Suspended", 0)
    assert not (tmp_path / "out" / "logs").exists()


def test_create_then_succeed(tmp_path):
    s = local(tmp_path, "pass").run()
    assert (s.phase, s.reason, s.restarts) == ("Succeeded", "Succeeded", 0)
    assert sorted(p.name for p in (tmp_path / "out" / "logs" / "gen-0").iterdir()) == ["rank-0.log", "rank-1.log"]


def test_restart_gang_then_succeed(tmp_path):
    s = local(tmp_path, GEN0_FAILS.format(code=1)).run()
    assert (s.phase, s.restarts, s.failures) == ("Succeeded", 1, {"ExitCode": 1})  # one failure, one restart
    assert (tmp_path / "out" / "logs" / "gen-1").is_dir()


def test_permanent_exit_code_fails(tmp_path):
    s = local(tmp_path, GEN0_FAILS.format(code=2)).run()
    assert (s.phase, s.reason, s.restarts, s.failures) == ("Failed", "PermanentError", 0, {"PermanentExitCode": 1})


def test_wait_while_running_then_suspend_stops_the_gang(tmp_path):
    run = local(tmp_path, "import time; time.sleep(60)")
    now = datetime.now(UTC)
    for _ in range(3):  # create, Running (an Event), then wait on a running gang
        t = step(run.spec, run.job_status, run.observe(), now)
        run.job_status = t.status
        run.carry_out(t, now)
    assert t.decision.action == Action.WAIT and t.effects == () and alive(run) == [0, 1]
    run.spec = run.spec.model_copy(update={"suspend": True})
    t = step(run.spec, run.job_status, run.observe(), now)
    run.carry_out(t, now)
    assert (t.decision.action, t.status.phase, run.gen) == (Action.SUSPEND, Phase.SUSPENDED, None)


def interrupt_once_ready(run: LocalRun, ready: Path, workers: int) -> threading.Thread:
    """Ctrl-C (as the signal handler sees it) once every worker has written its file under `ready`."""
    def press() -> None:
        wait_for(lambda: len(list(ready.iterdir())) == workers, 30, interval=0.02, what="the workers' ready files")
        run._on_interrupt(signal.SIGINT, None)
    thread = threading.Thread(target=press, daemon=True)
    thread.start()
    return thread


def test_ctrl_c_suspends_a_gang_that_stops_on_sigterm(tmp_path):
    ready = tmp_path / "ready"
    ready.mkdir()
    run = local(tmp_path, f"import os, time; open('{ready}/' + os.environ['RANK'], 'w'); time.sleep(60)")
    interrupt_once_ready(run, ready, 2)
    s = run.run()
    assert (s.phase, s.reason) == ("Suspended", "Interrupted")


def test_ctrl_c_after_the_workers_finished_is_a_success(tmp_path):
    """The stop came as the last step ended: every worker exits 0, and the run is over, not resumable."""
    ready = tmp_path / "ready"
    ready.mkdir()
    run = local(tmp_path, "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          f"open('{ready}/' + os.environ['RANK'], 'w'); time.sleep(1)")
    interrupt_once_ready(run, ready, 2)
    s = run.run()
    assert (s.phase, s.reason) == ("Succeeded", "Succeeded")


def test_stale_generation_is_stopped_before_the_next_starts(tmp_path):
    run = local(tmp_path, "import time; time.sleep(60)")
    now = datetime.now(UTC)
    run.carry_out(Transition(run.job_status, (CreateWorkers(0, (0, 1)),)), now)
    procs = list(run.gen.procs)
    run.job_status = run.job_status.model_copy(update={"restart_generation": 1, "phase": Phase.RESTARTING})
    t = step(run.spec, run.job_status, run.observe(), now)
    run.carry_out(t, now)
    assert t.decision.action == Action.DELETE_STALE and run.gen is None
    assert all(p.popen.poll() is not None for p in procs)


def test_delete_job_keeps_the_local_output(tmp_path):
    run = local(tmp_path, "pass")
    (tmp_path / "out").mkdir()
    run.carry_out(Transition(run.job_status, (DeleteJob(),)), datetime.now(UTC))
    assert (tmp_path / "out").is_dir()


def test_metrics_ports_past_65535_on_one_host_are_refused_before_anything_starts(tmp_path):
    big = job("pass", metricsPort=65530)
    with pytest.raises(LocalRunError, match=r"spec.metricsPort: 8 processes on one host need ports 65530-65537"):
        LocalRun(big, tmp_path, RunOptions(output_dir=tmp_path / "out", workers=8))
    assert not (tmp_path / "out").exists()


ON_A_GPU_HOST = pytest.mark.skipif(Path("/proc/driver/nvidia").exists(), reason="workers would train on the GPU")


@ON_A_GPU_HOST
def test_slow_bf16_on_this_cpu_is_said_before_the_start_and_after_the_result(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(hardware, "bf16_slowdown", lambda: 5.4)
    monkeypatch.setattr(hardware, "this_cpu_native_bf16", lambda: False)
    manifest = tmp_path / "job.yaml"
    manifest.write_text(job("pass", precision="bf16").model_dump_json(by_alias=True, exclude_none=True))
    assert cli.main(["run", str(manifest), "--output-dir", str(tmp_path / "out"), "-q"]) == 0
    out, err = capsys.readouterr()
    notice = "bf16 is slow on this CPU (no AVX512-BF16, AMX or Arm BF16: bf16 is emulated): a bf16 matrix product took 5.4x"
    assert notice in err and notice in out.split("tokens/s")[-1]  # before the start, and after the result line
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert (summary["bf16_slowdown"], summary["bf16_emulated"]) == (5.4, True)


@ON_A_GPU_HOST
def test_an_fp32_run_measures_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(hardware, "bf16_slowdown", lambda: pytest.fail("fp32 needs no bf16 measurement"))
    s = local(tmp_path, "pass", precision="fp32").run()
    assert (s.phase, s.bf16_slowdown, s.bf16_emulated) == ("Succeeded", None, None)
