"""kubetrain.client against the real API server, with one operator (watching this module's namespace) for
every test. Worker pods are kwok pods: the test plays worker 0's progress report (the pod annotation the
operator reads) and ends the pods through kwok's stages, from the wait's own progress callback.

- submit -> wait Succeeded: the callback sees Running, then step 5 and its loss;
- wait on a job whose worker fails (backoffLimit 0) raises JobFailed naming the status's reason;
- suspend -> Suspended, resume -> Running, delete -> NotFound; `kubetrain describe` of the running job;
- a ServiceAccount allowed only to read jobs gets Forbidden carrying the API server's message;
- `describe` of a blocked (unschedulable) job ends with what to do; a sweep's wait and best trial.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from support import lanes
from support.cluster import kubeconfig_path
from support.identities import service_account_identity
from support.jobs import TrainingJobs
from support.kwok import KWOK_NAMESPACE_ANNOTATIONS, fail_pod, kwok_job, succeed_workers
from support.operator_process import OperatorProcess
from support.resources import not_found_ok, wait_default_service_account
from support.sweeps import finish_trial, kwok_sweep
from support.waiting import wait_for

from kubetrain.client import ClusterClient, Forbidden, JobFailed, NotFound, ProgressUpdate
from kubetrain.core import contract
from kubetrain.core.cli import main
from kubetrain.core.client.describe import describe_text
from kubetrain.core.progress import Progress

pytestmark = pytest.mark.integration
SPEC: dict[str, Any] = {"workers": 2, "maxSteps": 10, "restartPolicy": {"backoffLimit": 0, "backoffSeconds": 0}}


@pytest.fixture(scope="module")
def ns(core_v1: client.CoreV1Api, crd: None) -> Iterator[str]:
    name = lanes.namespace(f"client-{uuid.uuid4().hex[:6]}")
    core_v1.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(
        name=name, labels={"kubetrain.io/test": "true"}, annotations=KWOK_NAMESPACE_ANNOTATIONS)))
    wait_default_service_account(core_v1, name)
    yield name
    with not_found_ok():
        core_v1.delete_namespace(name)


@pytest.fixture(scope="module")
def operator(ns: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    with OperatorProcess(kubeconfig_path(), log, f"--namespace={ns}") as op:
        yield op


@pytest.fixture(scope="module")
def kt(ns: str, operator: OperatorProcess) -> ClusterClient:
    return ClusterClient(ns, kubeconfig=str(kubeconfig_path()), poll_seconds=0.3)


def report_progress(core: client.CoreV1Api, ns: str, job: str, step: int, loss: float) -> None:
    """What rank 0's progress reporter (observe/progress.py) does in a real pod: the progress record on worker 0's annotation."""
    record = Progress(job=job, step=step, max_steps=10, loss=loss, step_seconds=0.5,
                      time=contract.format_time(datetime.now(UTC)))
    core.patch_namespaced_pod(f"{job}-worker-0", ns, {"metadata": {"annotations": {
        contract.PROGRESS_ANNOTATION: json.dumps(record.dump())}}})


def test_submit_then_wait_succeeded_sees_progress(kt: ClusterClient, core_v1: client.CoreV1Api, ns: str,
                                                  operator: OperatorProcess, tmp_path: Path) -> None:
    manifest = tmp_path / "job.yaml"
    manifest.write_text(json.dumps(kwok_job("fine", SPEC)))  # JSON is YAML: submit takes a file path
    created = kt.submit(manifest)
    assert (created.metadata.name, created.metadata.namespace) == ("fine", ns)
    seen: list[ProgressUpdate] = []

    def play(u: ProgressUpdate) -> None:
        seen.append(u)
        if u.phase == "Running" and u.step == 0:
            report_progress(core_v1, ns, "fine", 5, 2.25)
        elif u.step == 5:
            succeed_workers(core_v1, ns, core_v1.list_namespaced_pod(ns, label_selector=f"{contract.LABEL_JOB}=fine").items)

    job = kt.wait("fine", timeout=120, on_progress=play)
    assert job.status is not None and job.status.phase == "Succeeded", operator.tail()
    at_five = next(u for u in seen if u.step == 5)
    assert (at_five.loss, at_five.max_steps, at_five.percent) == (2.25, 10, 50.0), seen
    assert at_five.eta_seconds == pytest.approx(2.5), seen  # 5 steps left at 0.5 s each
    assert [j.metadata.name for j in kt.list({"missing": "label"})] == []
    assert "fine" in [j.metadata.name for j in kt.list()]


def test_wait_on_a_failing_job_raises_its_reason(kt: ClusterClient, core_v1: client.CoreV1Api, ns: str) -> None:
    kt.submit(kwok_job("breaks", SPEC))

    def fail_when_running(u: ProgressUpdate) -> None:
        if u.phase == "Running":
            fail_pod(core_v1, ns, "breaks-worker-1", exit_code=3)

    with pytest.raises(JobFailed) as caught:
        kt.wait("breaks", timeout=120, on_progress=fail_when_running)
    assert caught.value.reason == "BackoffLimitExceeded", caught.value
    assert str(caught.value).startswith("breaks failed: BackoffLimitExceeded"), caught.value
    print(describe_text(kt.get("breaks"), kt.events("breaks"), kt.workers("breaks"), datetime.now(UTC)))


def test_suspend_resume_delete(kt: ClusterClient, ns: str) -> None:
    kt.submit(kwok_job("pausing", SPEC))
    kt.wait("pausing", until="Running", timeout=90)
    text = describe_text(kt.get("pausing"), kt.events("pausing"), kt.workers("pausing"), datetime.now(UTC))
    print(text)
    assert "Phase:       Running" in text and "pausing-worker-1" in text.split("Per worker:")[1]
    assert kt.suspend("pausing").spec.suspend is True
    assert kt.wait("pausing", until="Suspended", timeout=90).status.phase == "Suspended"  # type: ignore[union-attr]
    assert kt.resume("pausing").spec.suspend is False
    kt.wait("pausing", until="Running", timeout=90)
    assert any(e.reason for e in kt.events("pausing"))
    kt.delete("pausing")
    with pytest.raises(NotFound) as caught:
        kt.delete("pausing")
    assert str(caught.value) == f"deleting TrainingJob {ns}/pausing: not found"


def test_a_forbidden_call_raises_forbidden_with_the_api_servers_message(admin_api: client.ApiClient, ns: str) -> None:
    reader = service_account_identity(admin_api, ns, "reader", [client.V1PolicyRule(
        api_groups=["kubetrain.io"], resources=["trainingjobs"], verbs=["get", "list"])])
    try:
        kt = ClusterClient(ns, api_client=reader.api)
        assert isinstance(kt.list(), list)  # allowed
        with pytest.raises(Forbidden) as caught:
            kt.submit(kwok_job("denied", SPEC))
    finally:
        reader.api.close()
    err = caught.value
    assert err.status == 403 and err.reason == "Forbidden", err
    assert f'User "{reader.username}" cannot create resource "trainingjobs"' in err.message, err.message
    assert str(err).startswith(f"submitting {ns}/denied: trainingjobs.kubetrain.io is forbidden"), err


def test_describe_of_a_blocked_job_says_what_to_do(kt: ClusterClient, ns: str) -> None:
    kt.submit(kwok_job("nowhere", {**SPEC, "scheduling": {"nodeSelector": {"kubetrain.io/test-pool": ns}}}))
    def blocked() -> bool:
        st = kt.get("nowhere").status
        return st is not None and any(c.type == "WorkersBlocked" and c.status == "True" for c in st.conditions)

    wait_for(blocked, 60, what=f"WorkersBlocked in {ns}")
    text = describe_text(kt.get("nowhere"), kt.events("nowhere"), kt.workers("nowhere"), datetime.now(UTC))
    print(text)
    assert "Unschedulable" in text and "Phase:       Created" in text
    assert text.splitlines()[-1].startswith("Next:        no node fits a worker"), text
    kt.delete("nowhere")


def test_a_sweep_waited_for_and_its_best_trial(kt: ClusterClient, admin_api: client.ApiClient, ns: str,
                                               operator: OperatorProcess, capsys: pytest.CaptureFixture[str]) -> None:
    kt.submit(kwok_sweep("tune", maxTrials=1, parallelism=1))
    finish_trial(TrainingJobs(admin_api, ns, operator), "tune-0", loss=1.5)
    sweep = kt.wait_sweep("tune", timeout=90)
    assert sweep.status is not None and (sweep.status.phase, sweep.status.trials_complete) == ("Succeeded", 1)
    assert [s.metadata.name for s in kt.list_sweeps()] == ["tune"]
    best = kt.best_trial("tune")
    assert best is not None and (best.index, best.value) == (0, 1.5), best
    assert best.manifest["metadata"]["name"] == "tune-best" and "optimizer.lr" in best.params
    assert main(["describe", "sweep/tune", "-n", ns, "--kubeconfig", str(kubeconfig_path())]) == 0
    said = capsys.readouterr().out
    print(said)
    assert "Phase:       Succeeded" in said and "Best:        trial 0, job tune-0" in said, said
    kt.delete_sweep("tune")
