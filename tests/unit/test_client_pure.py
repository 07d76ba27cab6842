"""kubetrain.client's pure parts: API errors by kind with the server's message, progress parsing, the wait
loop over canned statuses, manifest loading, `describe` text and hints, pod facts, local status."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from support.paths import REPO_ROOT

from kubetrain.core.api import (
    Condition,
    Goodput,
    Phase,
    TrainingJob,
    TrainingJobStatus,
    TrainingSweep,
    TrainingSweepStatus,
)
from kubetrain.core.client import errors
from kubetrain.core.client.cluster import worker_of
from kubetrain.core.client.describe import describe_text, next_step
from kubetrain.core.client.local import LocalClient, job_status, matches
from kubetrain.core.client.model import (
    Event,
    Manifest,
    TrainingClient,
    Worker,
    best_trial_of,
    load_manifest,
    parse_duration,
    parse_number,
    progress_of,
    wait_outcome,
)
from kubetrain.core.progress import Progress, write_progress
from kubetrain.core.validate import load_sweep


class FakeApiException(Exception):
    def __init__(self, status: int, body: str | bytes, reason: str = "Reason"):
        super().__init__(f"({status}) {reason}")
        self.status, self.body, self.reason = status, body, reason


def status_body(code: int, reason: str, message: str) -> str:
    return json.dumps({"kind": "Status", "status": "Failure", "code": code, "reason": reason, "message": message})


@pytest.mark.parametrize(("code", "reason", "kind"), [
    (401, "Unauthorized", errors.Unauthorized), (403, "Forbidden", errors.Forbidden),
    (404, "NotFound", errors.NotFound), (409, "AlreadyExists", errors.Conflict), (422, "Invalid", errors.Invalid),
    (500, "InternalError", errors.ApiError),
])
def test_api_errors_are_typed_and_keep_the_servers_message(code: int, reason: str, kind: type) -> None:
    exc = errors.api_error(FakeApiException(code, status_body(code, reason, "the server's words")), "submitting ns/x")
    assert type(exc) is kind and isinstance(exc, errors.ClientError)
    assert (exc.status, exc.reason, exc.message) == (code, reason, "the server's words")
    assert str(exc) == ("submitting ns/x: not found" if code == 404 else f"submitting ns/x: the server's words (HTTP {code})")


def test_an_error_without_a_status_body_or_status_says_what_it_has() -> None:
    exc = errors.api_error(FakeApiException(502, b"<html>bad gateway</html>", "Bad Gateway"), "listing")
    assert (type(exc), exc.message) == (errors.ApiError, "<html>bad gateway</html>")
    refused = errors.api_error(ConnectionRefusedError("connection refused"), "listing TrainingJobs")
    assert (type(refused), refused.status, str(refused)) == (errors.ApiError, None, "listing TrainingJobs: connection refused")


def test_progress_is_parsed_from_status_strings() -> None:
    assert [parse_duration(t) for t in ("42.0s", "3m05s", "1h02m", "", None, "soon")] == [42.0, 185.0, 3720.0, None,
                                                                                        None, None]
    assert [parse_number(t) for t in ("2.3456", "45%", None, "nan-ish")] == [2.3456, 45.0, None, None]
    st = TrainingJobStatus(phase=Phase.RUNNING, current_step=45, max_steps=100, loss="2.5000", eta="4m10s",
                           percent_complete="45%")
    u = progress_of("j", st)
    assert (u.phase, u.step, u.max_steps, u.loss, u.eta, u.eta_seconds, u.percent) == (
        "Running", 45, 100, 2.5, "4m10s", 250.0, 45.0)
    assert progress_of("j", None).step == 0


@pytest.mark.parametrize(("phase", "until", "outcome"), [
    ("Running", "Succeeded", "wait"), ("Succeeded", "Succeeded", "done"), ("Succeeded", "Running", "done"),
    ("Failed", "Succeeded", "failed"), ("Failed", "Failed", "done"), ("Suspended", "Suspended", "done"),
    ("Pending", "Running", "wait"),
])
def test_wait_outcome(phase: str, until: str, outcome: str) -> None:
    assert wait_outcome(phase, until) == outcome


JOB: dict[str, Any] = {"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "j"},
                       "spec": {"maxSteps": 10}}


class Canned(TrainingClient):
    """A client whose get() returns the next of some statuses (the last one for ever)."""

    def __init__(self, statuses: list[TrainingJobStatus]):
        self.statuses, self.poll_seconds = statuses, 0.0

    def get(self, name: str) -> TrainingJob:
        st = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        return TrainingJob.model_validate({**JOB, "status": st.dump()})

    def submit(self, obj: Manifest) -> TrainingJob | TrainingSweep: raise NotImplementedError
    def list(self, selector: str | Mapping[str, str] | None = None) -> list[TrainingJob]: return []
    def delete(self, name: str) -> None: ...
    def suspend(self, name: str) -> TrainingJob: raise NotImplementedError
    def resume(self, name: str) -> TrainingJob: raise NotImplementedError
    def events(self, name: str) -> list[Event]: return []
    def workers(self, name: str) -> list[Worker]: return []
    def _log_text(self, name: str, rank: int, tail: int | None) -> str: return ""
    def _log_stream(self, name: str, rank: int, tail: int | None) -> Iterator[str]: yield ""
    def get_sweep(self, name: str) -> TrainingSweep: raise NotImplementedError
    def list_sweeps(self, selector: str | Mapping[str, str] | None = None) -> list[TrainingSweep]: return []


def test_wait_calls_back_on_each_change_and_returns_at_succeeded() -> None:
    run = [TrainingJobStatus(phase=Phase.CREATED), TrainingJobStatus(phase=Phase.RUNNING),
           TrainingJobStatus(phase=Phase.RUNNING), TrainingJobStatus(phase=Phase.RUNNING, current_step=5, loss="1.5000"),
           TrainingJobStatus(phase=Phase.SUCCEEDED, current_step=10, loss="1.0000")]
    seen: list[tuple[str, int, float | None]] = []
    job = Canned(run).wait("j", on_progress=lambda u: seen.append((u.phase, u.step, u.loss)))
    assert job.status is not None and job.status.phase == Phase.SUCCEEDED
    assert seen == [("Created", 0, None), ("Running", 0, None), ("Running", 5, 1.5), ("Succeeded", 10, 1.0)]


def test_wait_raises_naming_the_reason_or_the_timeout() -> None:
    failed = TrainingJobStatus(phase=Phase.FAILED, reason="BackoffLimitExceeded", message="worker 1 exited 3")
    with pytest.raises(errors.JobFailed) as caught:
        Canned([TrainingJobStatus(phase=Phase.RUNNING), failed]).wait("j")
    assert (caught.value.reason, str(caught.value)) == (
        "BackoffLimitExceeded", "j failed: BackoffLimitExceeded: worker 1 exited 3")
    assert Canned([failed]).wait("j", until="Failed").status == failed
    started = time.monotonic()
    with pytest.raises(errors.WaitTimeout, match=r"^j: not Succeeded after 0.2s \(phase Running\)$"):
        Canned([TrainingJobStatus(phase=Phase.RUNNING)]).wait("j", timeout=0.2)
    assert time.monotonic() - started < 5


def test_load_manifest_validates_as_kubetrain_validate_and_sends_only_settable_metadata(tmp_path: Path) -> None:
    with pytest.raises(errors.InvalidManifest) as caught:
        load_manifest({**JOB, "spec": {"workers": 0}})
    assert caught.value.problems == ["spec.workers: must be >= 1"], caught.value.problems
    job = TrainingJob.model_validate({**JOB, "metadata": {"name": "j", "uid": "u-1", "resourceVersion": "7"},
                                      "status": {"phase": "Running"}})
    body, model = load_manifest(job)
    assert body["metadata"] == {"name": "j"} and "status" not in body and model.metadata.name == "j"
    path = tmp_path / "job.yaml"
    path.write_text("apiVersion: kubetrain.io/v1alpha1\nkind: TrainingJob\nmetadata: {name: from-file}\nspec: {}\n")
    assert load_manifest(path)[0] == {"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                                      "metadata": {"name": "from-file"}, "spec": {}}
    with pytest.raises(errors.ClientError, match="cannot read"):
        load_manifest(tmp_path / "missing.yaml")


def pod(phase: str, container_state: dict[str, Any] | None = None, scheduled: bool = True) -> dict[str, Any]:
    return {"metadata": {"name": "j-worker-1", "labels": {"kubetrain.io/replica-index": "1",
                                                          "kubetrain.io/restart-generation": "2"}},
            "spec": {"nodeName": "" if not scheduled else "gpu-1"},
            "status": {"phase": phase,
                       "conditions": [] if scheduled else [{"type": "PodScheduled", "status": "False",
                                                            "reason": "Unschedulable", "message": "0/4 nodes: gpu"}],
                       "containerStatuses": [{"name": "trainer", "restartCount": 1, "state": container_state or {}}]}}


def test_worker_facts_from_pods() -> None:
    pulling = worker_of(pod("Pending", {"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}}))
    assert (pulling.index, pulling.generation, pulling.state, pulling.message, pulling.restarts) == (
        1, 2, "ImagePullBackOff", "no such image", 1)
    assert worker_of(pod("Pending", scheduled=False)).state == "Unschedulable"
    done = worker_of(pod("Failed", {"terminated": {"reason": "Error", "exitCode": 3}}))
    assert (done.phase, done.state, done.exit_code) == ("Failed", "Error", 3)


def blocked(reason: str) -> TrainingJobStatus:
    return TrainingJobStatus(phase=Phase.CREATED, conditions=[Condition(
        type="WorkersBlocked", status="True", reason=reason, message="j-worker-0: ErrImagePull: not found")])


def test_describe_text_and_what_to_do_next() -> None:
    job = TrainingJob.model_validate({**JOB, "metadata": {"name": "j", "namespace": "ml",
                                                          "creationTimestamp": "2026-01-01T00:00:00Z"}})
    job.status = blocked("ImagePullFailed")
    job.status.goodput = Goodput(productive_seconds=90, lost_seconds=10, steps_lost=3)
    workers = [Worker(index=0, generation=0, phase="Pending", name="j-worker-0", state="ErrImagePull",
                      message="pull access denied")]
    events = [Event(type="Warning", reason="WorkersBlocked", message="image", time="2026-01-01T00:00:30Z", count=3)]
    text = describe_text(job, events, workers, datetime(2026, 1, 1, 0, 1, tzinfo=UTC))
    assert "Namespace:   ml" in text and "Goodput:     90.0% (productive 90.0s, lost 10.0s, 3 step(s) redone)" in text
    assert "ErrImagePull" in text and "WorkersBlocked (x3)" in text and "30s" in text
    assert text.splitlines()[-1].startswith("Next:        check spec.image") and "kubectl describe pod j-worker-0" in text
    assert "spec.resources" in (next_step("j", blocked("Unschedulable"), []) or "")
    failed = TrainingJobStatus(phase=Phase.FAILED, reason="BackoffLimitExceeded")
    assert "kubetrain logs j --rank 1" in (next_step("j", failed, [Worker(1, 0, "Failed")]) or "")
    assert "kubetrain resume j" in (next_step("j", TrainingJobStatus(phase=Phase.SUSPENDED), []) or "")
    assert next_step("j", TrainingJobStatus(phase=Phase.RUNNING), []) is None


def test_label_selectors_locally() -> None:
    labels = {"team": "nlp", "tier": "prod"}
    assert matches(labels, "team=nlp,tier!=dev") and matches(labels, {"team": "nlp"}) and matches(labels, "team")
    assert not matches(labels, "team==cv") and not matches(labels, "!team") and matches(None, None)


def test_local_status_from_progress_then_summary(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    log.write_text("kubetrain: running\nkubetrain run: cannot create /x: Permission denied\n")
    assert job_status(tmp_path, 10, 0.0, alive=True, log=log).phase == Phase.CREATED
    write_progress(tmp_path, Progress(job="j", step=4, max_steps=10, loss=2.0, step_seconds=1.0))
    running = job_status(tmp_path, 10, 0.0, alive=True, log=log)
    assert (running.phase, running.current_step, running.loss, running.eta, running.percent_complete) == (
        "Running", 4, "2.0000", "6.0s", "40%")
    gone = job_status(tmp_path, 10, 0.0, alive=False, log=log)
    assert (gone.phase, gone.reason, gone.message) == ("Failed", "RunnerExited",
                                                       "kubetrain run: cannot create /x: Permission denied")
    (tmp_path / "summary.json").write_text(json.dumps({"phase": "Succeeded", "reason": "Succeeded", "message": "",
                                                       "steps": 10, "final_loss": 1.25, "restarts": 1}))
    done = job_status(tmp_path, 10, 0.0, alive=False, log=log)
    assert (done.phase, done.current_step, done.loss, done.restart_count) == ("Succeeded", 10, "1.2500", 1)
    assert job_status(tmp_path, 10, time.time() + 60, alive=False, log=log).phase == "Failed"  # an older run's summary


def test_best_trial_and_its_manifest() -> None:
    sweep = load_sweep(REPO_ROOT / "examples" / "sweep.yaml")
    assert best_trial_of(sweep) is None
    path = sweep.spec.parameters[0].path
    first = sweep.spec.parameters[0]
    value = first.values[0] if first.values else first.low
    sweep.status = TrainingSweepStatus(best_trial=3, best_value=1.5, best_params={path: value})
    best = best_trial_of(sweep)
    assert best is not None and (best.index, best.value, best.params) == (3, 1.5, {path: value})
    assert best.manifest["kind"] == "TrainingJob" and best.manifest["metadata"]["name"] == f"{sweep.metadata.name}-best"
    load_manifest(best.manifest)  # valid as it stands: submit() takes it


def test_a_local_sweep_is_read_from_its_status_file(tmp_path: Path) -> None:
    kt = LocalClient(tmp_path)
    sweep = load_sweep(REPO_ROOT / "examples" / "sweep.yaml")
    name = sweep.metadata.name
    control = tmp_path / ".client" / name
    control.mkdir(parents=True)
    (control / "manifest.yaml").write_text((REPO_ROOT / "examples" / "sweep.yaml").read_text())
    # a runner that is gone: pid 0 is never a process whose command line is this one
    (control / "run.json").write_text(json.dumps({"kind": "TrainingSweep", "pid": 0, "started": 0.0,
                                                  "command": ["kubetrain", "sweep"]}))
    (control / "run.log").write_text("kubetrain sweep: cannot create runs/x: Permission denied\n")
    gone = kt.get_sweep(name).status
    assert gone is not None and (gone.phase, gone.reason) == ("Failed", "RunnerExited"), gone
    path = sweep.spec.parameters[0].path
    done = TrainingSweepStatus(phase="Succeeded", best_trial=1, best_value=0.5, best_params={path: 0.01})
    (tmp_path / name).mkdir()
    (tmp_path / name / "sweep-status.json").write_text(done.model_dump_json(by_alias=True))
    assert kt.wait_sweep(name, timeout=1).status == done
    assert [s.metadata.name for s in kt.list_sweeps()] == [name] and kt.list() == []
    best = kt.best_trial(name)
    assert best is not None and (best.index, best.params) == (1, {path: 0.01})
    with pytest.raises(errors.NotFound):
        kt.get(name)  # a sweep, not a job


def test_describe_counts_gpu_hours_up_to_now():
    from kubetrain.core.api import TrainingJobStatus  # noqa: PLC0415
    from kubetrain.core.client.describe import gpu_line  # noqa: PLC0415

    now = datetime(2026, 3, 1, 12, tzinfo=UTC)
    st = TrainingJobStatus.model_validate({"gpuHours": 10.0, "goodput": {
        "gpusHeld": 16, "gpusCountedAt": "2026-03-01T11:30:00Z", "lostGpuHours": 1.5}})
    assert gpu_line(st, now) == "GPU-hours:   18.00 allocated, 1.50 lost to restarts (16 GPU(s) held now)"
    assert gpu_line(TrainingJobStatus(), now) is None


def test_status_shows_the_eval_loss_and_where_the_export_is() -> None:
    from kubetrain.core.client.describe import status_lines  # noqa: PLC0415

    st = TrainingJobStatus(phase=Phase.SUCCEEDED, current_step=6, max_steps=6, loss="2.1000", eval_loss="2.3000",
                           export="s3://ml/runs/llama-lora/export")
    lines = status_lines("llama-lora", "ml", st)
    assert "Step:        6/6  loss 2.1000  eval loss 2.3000" in lines
    assert "Export:      s3://ml/runs/llama-lora/export" in lines
    assert not any(line.startswith("Export:") for line in status_lines("q", "ml", TrainingJobStatus()))
