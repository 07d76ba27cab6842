"""The local sweep backend's parts: the table, the state-change lines, the time estimate, the manifests a
user runs, the Optuna storage mirror, and trial runs observed and stopped (tiny custom-command jobs)."""

import io
import json
import os
import sys
import time
from datetime import UTC, datetime, timedelta

import optuna
import pytest
import yaml

from kubetrain.core.api import Phase, SweepReason, TrainingSweep, TrainingSweepSpec, TrainingSweepStatus, TrialRecord
from kubetrain.core.cli import main
from kubetrain.core.contract import LABEL_SWEEP, format_time, threads_per_process
from kubetrain.core.sweep import report
from kubetrain.core.sweep.local import runnable_anywhere, template_manifest
from kubetrain.core.sweep.mirror import INDEX_ATTR, StudyMirror
from kubetrain.core.sweep.model import SweepEvent, TrialObservation
from kubetrain.core.sweep.trials import LocalTrials, ended, from_disk, local_manifest
from kubetrain.core.sweep.view import SweepView
from kubetrain.core.validate import check

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def spec(**extra) -> TrainingSweepSpec:
    return TrainingSweepSpec.model_validate({
        "maxTrials": 4, "parallelism": 2,
        "parameters": [{"path": "optimizer.lr", "low": 1e-5, "high": 0.1, "log": True},
                       {"path": "microBatchSize", "type": "int", "low": 2, "high": 8}],
        "template": {"spec": {"maxSteps": 100, "optimizer": {"minLr": 0.0}}}, **extra})


def trial(index: int, state: str, seconds: float | None = None, **kw) -> TrialRecord:
    end = format_time(T0 + timedelta(seconds=seconds)) if seconds is not None else None
    return TrialRecord(index=index, job_name=f"s-{index}", params={"optimizer.lr": 0.003 * (index + 1),
                       "microBatchSize": 4}, state=state, start_time=format_time(T0), completion_time=end, **kw)


def status(*trials: TrialRecord, **kw) -> TrainingSweepStatus:
    return TrainingSweepStatus(trials=list(trials), **kw)


# --------------------------------------------------------------------------- text


@pytest.mark.parametrize(("value", "text"), [
    (0.003, "0.003"), (1.2345e-5, "1.23e-05"), (0.0312345, "0.0312"), (512, "512"), (True, "True"),
    ("fsdp", "fsdp"), (0.0, "0"), (2.5e6, "2.50e+06"),
])
def test_values_are_short(value, text):
    assert report.format_value(value) == text


@pytest.mark.parametrize(("seconds", "text"), [(42.04, "42.0s"), (185, "3m05s"), (3720, "1h02m")])
def test_durations(seconds, text):
    assert report.format_duration(seconds) == text


def test_table_has_counts_best_and_one_row_per_trial():
    st = status(trial(0, "Complete", 30, value=2.5, step=100), trial(1, "Pruned", 10, value=4.0, step=30),
                trial(2, "Running", step=40), trial(3, "Pending"),
                trials_running=2, trials_pruned=1, best_trial=0, best_value=2.5,
                best_params={"optimizer.lr": 0.003, "microBatchSize": 4})
    lines = report.table("s", spec(), st, live={2: 3.25})
    assert lines[0] == ("sweep s: 2/4 done | running 2 | pruned 1 | failed 0 | "
                        "best #0 2.5000 (optimizer.lr=0.003 microBatchSize=4)")
    assert lines[1].split() == ["#", "params", "step", "loss", "state"]
    assert lines[2].split() == ["0", "optimizer.lr=0.003", "microBatchSize=4", "100/100", "2.5000", "Complete", "*"]
    assert lines[3].split()[-3:] == ["30/100", "4.0000", "Pruned"]
    assert lines[4].split()[-3:] == ["40/100", "3.2500", "Running"]  # the live loss of a running trial
    assert lines[5].split()[-3:] == ["0/100", "-", "Pending"]
    assert len({len(ln.split("  ")[0]) for ln in lines[2:]}) == 1  # aligned index column


def test_long_params_are_cut_so_a_row_stays_one_line():
    record = trial(0, "Running")
    record.params = {f"model.field{i}": 0.001 * i for i in range(12)}
    row = report.table("s", spec(), status(record))[2]
    assert "..." in row and len(row) < report.PARAMS_WIDTH + 40


def test_change_lines():
    assert report.change_line(trial(0, "Pending")) is None
    assert report.change_line(trial(0, "Running")) == "trial 0 Running: optimizer.lr=0.003 microBatchSize=4"
    pruned = trial(1, "Pruned", 12, value=4.0, step=30, message="pruned at step 30 (loss 4)")
    assert report.change_line(pruned) == "trial 1 Pruned after 12.0s: pruned at step 30 (loss 4)"
    assert report.change_line(trial(2, "Complete", 61, value=2.0, step=100)) == (
        "trial 2 Complete after 1m01s: loss 2.0000 at step 100")


def test_time_without_pruning_is_the_mean_complete_trial_times_trials_over_parallelism():
    st = status(trial(0, "Complete", 30), trial(1, "Complete", 50), trial(2, "Pruned", 5), trial(3, "Failed", 1))
    t = report.timing(spec(), st, sweep_seconds=60.0)
    assert (t.mean_complete_seconds, t.trials, t.parallelism) == (40.0, 4, 2)
    assert t.unpruned_seconds == 80.0
    took, estimate = t.lines()
    assert took == "sweep wall time: 1m00s (60.0s)"
    assert estimate == ("without pruning: ~1m20s (40.0s per complete trial x 4 trials / parallelism 2 = 80.0s); "
                        "25% saved")


def test_no_estimate_without_a_complete_trial_and_no_negative_saving():
    none = report.timing(spec(), status(trial(0, "Pruned", 5)), 10.0)
    assert none.unpruned_seconds is None and "no estimate" in none.lines()[1]
    slow = report.timing(spec(parallelism=1), status(trial(0, "Complete", 10)), 30.0)
    assert slow.lines()[1].endswith("no time saved")


def test_sweep_seconds_from_the_status():
    st = status(start_time=format_time(T0), completion_time=format_time(T0 + timedelta(seconds=95)))
    assert report.sweep_seconds(st) == 95.0
    assert report.sweep_seconds(status(start_time=format_time(T0))) is None


# --------------------------------------------------------------------------- the live view


def test_view_off_a_terminal_writes_one_line_per_state_change():
    out = io.StringIO()
    view = SweepView(out, "s", spec())
    view.update(status(trial(0, "Pending")), {})
    view.update(status(trial(0, "Running")), {})
    view.update(status(trial(0, "Running", step=50)), {0: 3.0})
    view.event(SweepEvent("Normal", SweepReason.TRIAL_PRUNED, "trial 0 (s-0): pruned"))  # the next line says it
    view.update(status(trial(0, "Pruned", 9, message="pruned at step 50 (loss 3)")), {})
    view.event(SweepEvent("Warning", SweepReason.NO_TRIAL_COMPLETED, "no trial completed"))
    assert out.getvalue().splitlines() == [
        "trial 0 Running: optimizer.lr=0.003 microBatchSize=4",
        "trial 0 Pruned after 9.0s: pruned at step 50 (loss 3)",
        "warning: NoTrialCompleted: no trial completed",
    ]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_view_on_a_terminal_redraws_the_table_in_place():
    out = Terminal()
    view = SweepView(out, "s", spec())
    view.update(status(trial(0, "Running")), {})
    first = out.getvalue()
    assert first.count("\n") == 3 and "\033[" not in first
    view.update(status(trial(0, "Running")), {})  # unchanged: nothing written
    assert out.getvalue() == first
    view.event(SweepEvent("Normal", "Created", "hello"))
    view.update(status(trial(0, "Running", step=5)), {0: 4.0})
    assert out.getvalue()[len(first):].startswith("\033[3F\033[JCreated: hello\nsweep s:")
    assert "5/100" in out.getvalue().splitlines()[-1]


def test_quiet_view_shows_events_only():
    out = io.StringIO()
    view = SweepView(out, "s", spec(), quiet=True)
    view.update(status(trial(0, "Running")), {})
    view.event(SweepEvent("Normal", SweepReason.TRIAL_COMPLETED, "trial 0 (s-0): final loss 2"))
    assert out.getvalue() == "TrialCompleted: trial 0 (s-0): final loss 2\n"


# --------------------------------------------------------------------------- manifests


def sweep(name: str = "lr", **meta) -> TrainingSweep:
    return TrainingSweep.model_validate({
        "metadata": {"name": name}, "spec": {**spec().dump(), "template": {
            "metadata": {"labels": {"team": "ml"}, **meta},
            "spec": {"maxSteps": 100, "data": {"path": "data"}, "optimizer": {"lr": 0.001, "minLr": 0.0}}}}})


def test_exported_template_is_a_valid_job_of_its_own(tmp_path):
    m = template_manifest(sweep(), tmp_path)
    job, problems = check(m)
    assert problems == [] and job is not None
    assert m["metadata"] == {"name": "lr-template", "labels": {"team": "ml"}}
    assert m["spec"] == {"maxSteps": 100, "data": {"path": str(tmp_path / "data")},
                         "optimizer": {"lr": 0.001, "minLr": 0.0}}
    assert LABEL_SWEEP not in m["metadata"]["labels"]


def test_a_long_sweep_name_still_gives_a_valid_template_name(tmp_path):
    m = template_manifest(sweep("s" + "x" * 45), tmp_path)
    assert check(m)[1] == [] and m["metadata"]["name"].endswith("-template")


def test_runnable_anywhere_only_changes_a_relative_data_path(tmp_path):
    assert runnable_anywhere({"spec": {"data": {"path": "/abs"}}}, tmp_path)["spec"]["data"]["path"] == "/abs"
    assert runnable_anywhere({"spec": {"data": {"path": "d", "glob": "*.md"}}}, tmp_path)["spec"]["data"] == {
        "path": str(tmp_path / "d"), "glob": "*.md"}
    assert runnable_anywhere({"spec": {}}, tmp_path)["spec"]["data"]["path"] == str(tmp_path / "data")


def test_local_trial_manifest_keeps_checkpoints_in_the_trial_and_gets_its_own_ports():
    m = {"kind": "TrainingJob", "spec": {"checkpoint": {"dir": "/checkpoints", "everySteps": 5}, "maxSteps": 9}}
    assert local_manifest(m, 9402)["spec"] == {"checkpoint": {"everySteps": 5}, "maxSteps": 9, "metricsPort": 9402}
    assert local_manifest(m, None)["spec"]["checkpoint"] == {"everySteps": 5}
    assert m["spec"]["checkpoint"]["dir"] == "/checkpoints"  # the policy's manifest is left alone


@pytest.mark.parametrize(("cores", "parallelism", "world", "threads"), [(2, 2, 1, 1), (16, 2, 2, 4), (8, 3, 1, 2),
                                                                         (4, 8, 1, 1)])
def test_threads_share_the_cores(cores, parallelism, world, threads):
    assert threads_per_process(cores, parallelism * world) == threads


# --------------------------------------------------------------------------- observations from files


def test_an_ended_run_is_observed_from_its_summary(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"phase": "Succeeded", "steps": 100, "final_loss": 2.5}))
    assert ended(tmp_path, 0, 90, 2.7) == TrialObservation(Phase.SUCCEEDED, 100, 2.5)
    (tmp_path / "summary.json").write_text(json.dumps({"phase": "Failed", "message": "worker 0 exited with code 2"}))
    assert ended(tmp_path, 1, 7, 3.0).message == "worker 0 exited with code 2"
    (tmp_path / "summary.json").unlink()
    (tmp_path / "run.log").write_text("starting\nTraceback ...\nValueError: boom\n\n")
    assert ended(tmp_path, 1, 7, 3.0) == TrialObservation(Phase.FAILED, 7, 3.0, "ValueError: boom")


def test_a_trial_of_an_earlier_session_is_observed_from_its_directory(tmp_path):
    assert from_disk(tmp_path, 0, None).phase is None
    (tmp_path / "summary.json").write_text(json.dumps({"phase": "Suspended", "steps": 30, "final_loss": 4.0}))
    assert from_disk(tmp_path, 0, None) == TrialObservation(Phase.SUSPENDED, 30, None)


# --------------------------------------------------------------------------- the Optuna mirror


def test_mirror_adds_each_finished_trial_once_also_after_a_restart(tmp_path):
    url, s = f"sqlite:///{tmp_path / 'o.db'}", spec()
    running = status(trial(0, "Complete", 30, value=2.5, step=100), trial(1, "Running", step=10))
    assert StudyMirror(url, "s", s).sync(running) == 1
    done = status(trial(0, "Complete", 30, value=2.5, step=100), trial(1, "Pruned", 8, value=4.0, step=30))
    again = StudyMirror(url, "s", s)  # a resumed sweep
    assert again.sync(done) == 1 and again.sync(done) == 0
    trials = optuna.load_study(study_name="s", storage=url).trials
    assert [(t.user_attrs[INDEX_ATTR], t.state.name, t.value) for t in trials] == [
        (0, "COMPLETE", 2.5), (1, "PRUNED", 4.0)]
    assert trials[0].duration == timedelta(seconds=30)
    StudyMirror(url, "s", s, fresh=True)
    assert optuna.load_study(study_name="s", storage=url).trials == []


# --------------------------------------------------------------------------- trial runs


def script_manifest(name: str, code: str) -> dict:
    return {"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
            "spec": {"command": [sys.executable, "-c", code], "maxSteps": 1, "metricsPort": 29400}}


def wait_phase(trials: LocalTrials, index: int, name: str, phases: tuple, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        trials.pump()
        obs = trials.observe(index, name)
        if obs.phase in phases:
            return obs
        time.sleep(0.1)
    raise AssertionError(f"trial {index} never reached {phases}: {trials.observe(index, name)}")


def test_a_stopped_trial_ends_suspended_and_a_start_waits_for_it(tmp_path):
    trials = LocalTrials(tmp_path, tmp_path, parallelism=1)
    worker = ("import os, time; open(os.environ['KUBETRAIN_OUTPUT_DIR'] + '/pid', 'w').write(str(os.getpid())); "
              "time.sleep(60)")
    trials.start(0, "s-0", script_manifest("s-0", worker))
    wait_phase(trials, 0, "s-0", (Phase.RUNNING,))
    pid_file = tmp_path / "trials" / "s-0" / "pid"
    deadline = time.monotonic() + 60
    while (not pid_file.is_file() or not pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)  # until the trial's worker runs
    trials.stop(0)
    trials.start(1, "s-1", script_manifest("s-1", "import sys; sys.exit(2)"))
    assert trials.observe(1, "s-1").phase == Phase.PENDING  # queued until trial 0 has ended
    assert wait_phase(trials, 0, "s-0", (Phase.SUSPENDED,)).message == "stopped by the sweep"
    with pytest.raises(ProcessLookupError):  # the trial's run stopped its worker before it ended
        os.kill(int(pid_file.read_text()), 0)
    failed = wait_phase(trials, 1, "s-1", (Phase.FAILED,))
    assert "exited with code 2" in failed.message
    trials.stop_all()
    events = [json.loads(ln) for ln in (tmp_path / "processes.jsonl").read_text().splitlines()]
    assert [(e["index"], e["event"]) for e in events] == [(0, "start"), (0, "exit"), (1, "start"), (1, "exit")]
    assert (tmp_path / "trials" / "s-0" / "job.yaml").is_file()


# --------------------------------------------------------------------------- the command


def write_sweep(tmp_path, **spec_changes) -> str:
    doc = sweep().dump()
    doc["spec"].update(spec_changes)
    f = tmp_path / "sweep.yaml"
    f.write_text(json.dumps(doc))
    return str(f)


def test_export_template_prints_the_job_and_starts_nothing(tmp_path, capsys):
    assert main(["sweep", write_sweep(tmp_path), "--export-template", "--output-dir", str(tmp_path / "out")]) == 0
    job = yaml.safe_load(capsys.readouterr().out)
    assert (job["kind"], job["metadata"]["name"]) == ("TrainingJob", "lr-template")
    assert not (tmp_path / "out").exists()


def test_a_bad_sweep_manifest_exits_2_naming_the_field(tmp_path, capsys):
    bad = write_sweep(tmp_path, parameters=[{"path": "optimizer.nope", "low": 0.1, "high": 1.0}])
    assert main(["sweep", bad]) == 2
    assert "spec.parameters[0].path" in capsys.readouterr().err


def test_an_output_dir_of_another_sweep_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "sweep-status.json").write_text(status(trial(0, "Running")).model_dump_json(by_alias=True))
    assert main(["sweep", write_sweep(tmp_path), "--output-dir", str(out)]) == 2
    assert "holds another sweep's trials (s-0, ...)" in capsys.readouterr().err
    (out / "sweep-status.json").write_text("{not json")
    assert main(["sweep", write_sweep(tmp_path), "--output-dir", str(out)]) == 2
    assert "pass --fresh to start over" in capsys.readouterr().err


def test_a_sweep_whose_trials_fail_exits_1_with_the_trials_reason(tmp_path, capsys):
    doc = sweep().dump()
    doc["spec"].update(maxTrials=2, maxFailedTrials=0, parameters=[{"path": "seed", "type": "int", "low": 1, "high": 9}])
    doc["spec"]["template"]["spec"].update(command=["python", "-c", "import sys; print('no GPU here'); sys.exit(2)"],
                                           metricsPort=29600)
    f = tmp_path / "failing.yaml"
    f.write_text(json.dumps(doc))
    out = tmp_path / "out"
    assert main(["sweep", str(f), "--output-dir", str(out), "--summary-json", str(tmp_path / "s.json")]) == 1
    captured = capsys.readouterr()
    assert "TooManyFailedTrials" in captured.err
    assert "logs of the failed trials: " + str(out / "trials" / "lr-0" / "run.log") in captured.out
    summary = json.loads((tmp_path / "s.json").read_text())
    assert (summary["phase"], summary["best"]["trial"]) == ("Failed", None)
    trials = summary["status"]["trials"]
    # Both trials run at once: whichever exits first fails the sweep, and the other is stopped with it.
    assert [t["state"] for t in trials] == ["Failed", "Failed"]
    assert any("exited with code 2" in t["message"] for t in trials), trials
    assert not (out / "best.yaml").exists()
