"""Every failure answered, on the real API server: what the operator does when the API server refuses
what it asks for.

- A pod create refused (ResourceQuota) shows in the job's status (WorkersBlocked, CreateRejected,
  with the API server's message) and in ONE Warning Event, however often the operator retries.
- A name the job needs, taken by a pod the job does not own, is not adopted: one ForeignObject Event,
  the pod left alone. A job deleted and created again under its name does not take the old job's
  pods, which linger (a finalizer holds them) while the garbage collector deletes them.
- A status write carries the resourceVersion it was planned from: a stale writer gets 409 and
  re-reads the job instead of overwriting what the other writer wrote.

Each test runs its own operator, watching its test namespace only (`--namespace`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from support.cluster import kubeconfig_path
from support.jobs import TrainingJobs
from support.kwok import kwok_job
from support.operator_process import OperatorProcess
from support.waiting import wait_for

from kubetrain.core import api
from kubetrain.core.api import TrainingJob
from kubetrain.operator.jobs import builders as b
from kubetrain.operator.jobs.apply import Apis, Applier
from kubetrain.operator.jobs.cache import WatchCache

pytestmark = pytest.mark.integration

HOLD = "kubetrain.io/test-hold"
"""A finalizer of the tests' own: the pods of a deleted job linger until the test lets them go."""


class Jobs(TrainingJobs):
    def create(self, name: str, **spec: Any) -> dict[str, Any]:
        return self.submit(kwok_job(name, {"workers": 2, "restartPolicy": {"backoffSeconds": 0}, **spec}))

    def warnings(self, name: str, reason: str) -> list[client.CoreV1Event]:
        return [e for e in self.events(name) if e.reason == reason and e.type == "Warning"]

    def blocked(self, name: str, reason: str, timeout: float = 10) -> dict[str, Any]:
        """The WorkersBlocked condition once it is True with `reason`."""
        def holds(s: dict[str, Any]) -> dict[str, Any] | None:
            cond = next((c for c in s.get("conditions") or [] if c["type"] == "WorkersBlocked"), None)
            return cond if cond and cond["status"] == "True" and cond["reason"] == reason else None

        return holds(self.wait_status(name, holds, timeout, what=f"{name} WorkersBlocked={reason}")) or {}

    def release(self, pods: list[client.V1Pod]) -> None:
        for p in pods:
            if HOLD in (p.metadata.finalizers or []):
                rest = [f for f in p.metadata.finalizers if f != HOLD]
                self.core.patch_namespaced_pod(p.metadata.name, self.ns, {"metadata": {
                    "finalizers": rest or None, "resourceVersion": p.metadata.resource_version}})


@pytest.fixture
def jobs(admin_api: client.ApiClient, crd: None, namespace: str, tmp_path: Path) -> Iterator[Jobs]:
    """The test namespace's jobs, run by an operator of their own."""
    with OperatorProcess(kubeconfig_path(), tmp_path / "operator.log", "--namespace", namespace) as op:
        yield Jobs(admin_api, namespace, op)


def stays(check: Any, seconds: float, what: str) -> None:
    """`check()` holds now and every half second for `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        assert check(), what
        if time.monotonic() >= deadline:
            return
        time.sleep(0.5)


def test_a_pod_create_refused_by_quota_is_in_status_and_one_event(jobs: Jobs) -> None:
    quota = client.V1ResourceQuota(metadata=client.V1ObjectMeta(name="one-pod"),
                                   spec=client.V1ResourceQuotaSpec(hard={"pods": "1"}))
    jobs.core.create_namespaced_resource_quota(jobs.ns, quota)
    # Until the quota controller has computed its usage, admission refuses every pod ("status unknown").
    wait_for(lambda: (jobs.core.read_namespaced_resource_quota("one-pod", jobs.ns).status.hard or {}).get("pods"),
             30, what="the quota's status")
    jobs.create("quota")
    # A bound, not a target: the operator started for this test reconciles within seconds alone, ~15 s at load 25.
    cond = jobs.blocked("quota", "CreateRejected", timeout=60)
    # The two creates race for the one pod the quota allows: either worker may be the refused one.
    [admitted] = [p.metadata.name for p in jobs.pods("quota")]
    refused = ({"quota-worker-0", "quota-worker-1"} - {admitted}).pop()
    assert "exceeded quota" in cond["message"] and f'"{refused}"' in cond["message"], cond
    [event] = wait_for(lambda: jobs.warnings("quota", "CreateRejected"), 30, what="CreateRejected Event")
    assert "exceeded quota" in event.message
    # The operator keeps retrying (with backoff): the job still says why, and no Event is added.
    stays(lambda: len(jobs.warnings("quota", "CreateRejected")) == 1, 20, "one CreateRejected Event")
    assert jobs.blocked("quota", "CreateRejected", timeout=1)
    assert [p.metadata.name for p in jobs.pods("quota")] == [admitted]


def stranger(namespace: str, job: str, index: int) -> dict[str, Any]:
    """Worker `index` of `job` as the operator would make it (labels, name), but owned by no one."""
    model = TrainingJob.model_validate(kwok_job(job, {"workers": 2}, namespace))
    pod = b.worker_pod(model, index, 0, b.WorkerSettings(trainer_image="kubetrain/trainer:test"))
    pod["metadata"].pop("ownerReferences", None)
    pod["spec"].pop("serviceAccountName")  # the job's own is created with the job, after this pod
    return pod


def test_a_pod_the_job_does_not_own_is_neither_adopted_nor_touched(jobs: Jobs) -> None:
    made = jobs.core.create_namespaced_pod(jobs.ns, stranger(jobs.ns, "taken", 1))
    wait_for(lambda: jobs.core.read_namespaced_pod("taken-worker-1", jobs.ns).status.phase == "Running", 30,
             what="the stranger Running")
    jobs.create("taken")
    # Bounds for a loaded machine (the suite's lanes at load 15-25), not a speed target.
    [event] = wait_for(lambda: jobs.warnings("taken", "ForeignObject"), 60, what="ForeignObject Event")
    assert event.message.startswith("Pod taken-worker-1 exists and is not owned by this TrainingJob"), event.message
    assert jobs.blocked("taken", "ForeignObject", timeout=30)

    def untouched() -> bool:
        pod = jobs.core.read_namespaced_pod("taken-worker-1", jobs.ns)
        st = jobs.status("taken")
        return (pod.metadata.uid == made.metadata.uid and not pod.metadata.deletion_timestamp
                and not pod.metadata.owner_references and st.get("workersReady", 0) <= 1
                and st.get("phase") in (api.Phase.CREATED, api.Phase.PENDING) and st.get("restartCount", 0) == 0)

    stays(untouched, 8, "the stranger left alone and not counted as a worker")
    assert len(jobs.warnings("taken", "ForeignObject")) == 1


def hold_pods(jobs: Jobs, name: str) -> list[client.V1Pod]:
    for p in jobs.pods(name):
        jobs.core.patch_namespaced_pod(p.metadata.name, jobs.ns, {"metadata": {"finalizers": [HOLD]}})
    return jobs.pods(name)


def test_a_job_created_again_under_its_name_does_not_take_the_old_jobs_pods(jobs: Jobs) -> None:
    old_uid = jobs.create("again")["metadata"]["uid"]
    wait_for(lambda: [p for p in jobs.pods("again") if p.status.phase == "Running"][1:], 30, what="2 workers Running")
    old = hold_pods(jobs, "again")
    try:
        jobs.custom.delete_namespaced_custom_object(api.GROUP, api.VERSION, jobs.ns, api.PLURAL, "again")
        wait_for(lambda: all(p.metadata.deletion_timestamp for p in jobs.pods("again")), 30,
                 what="the garbage collector deleting the old pods")
        new_uid = jobs.create("again")["metadata"]["uid"]
        assert new_uid != old_uid
        wait_for(lambda: [e for e in jobs.warnings("again", "ForeignObject") if "again-worker" in e.message], 20,
                 what="a ForeignObject Event for an old pod")

        def not_adopted() -> bool:
            pods = jobs.pods("again")
            st = jobs.status("again")
            return ({p.metadata.uid for p in pods} == {p.metadata.uid for p in old}
                    and st.get("workersReady", 0) == 0 and st.get("phase") != api.Phase.RUNNING)

        stays(not_adopted, 5, "the old pods not adopted")
    finally:
        jobs.release(jobs.pods("again"))
    # Once they are gone, the new job makes its own.
    wait_for(lambda: jobs.status("again").get("phase") == api.Phase.RUNNING, 90, what="the new job Running")
    pods = jobs.pods("again")
    assert len(pods) == 2 and all(p.metadata.owner_references[0].uid == new_uid for p in pods)
    assert jobs.status("again").get("restartCount", 0) == 0


def test_a_stale_status_write_gets_a_conflict_and_loses_nothing(admin_api: client.ApiClient, crd: None,
                                                               namespace: str) -> None:
    """Two writers, no operator: the applier planned from an old copy; the other wrote since."""
    jobs = Jobs(admin_api, namespace)
    jobs.create("race", suspend=True)
    stale = jobs.get("race")
    custom = jobs.custom
    custom.patch_namespaced_custom_object_status(api.GROUP, api.VERSION, namespace, api.PLURAL, "race",
                                                 {"status": {"phase": "Suspended", "message": "the other writer"}})
    cache = WatchCache()
    cache.job_event(None, stale)
    applier = Applier(Apis.of(admin_api), cache, 2, lambda: datetime.now(UTC))
    key = (namespace, "race")
    try:
        written = asyncio.run(applier.write_status(key, stale, {"phase": "Pending", "message": "stale"}))
        assert written is False
        assert jobs.status("race") == {"phase": "Suspended", "message": "the other writer"}
        fresh = cache.job(key)
        assert fresh is not None and fresh["status"]["message"] == "the other writer"
        # Planned again from the fresh copy, the write goes through.
        assert asyncio.run(applier.write_status(key, fresh, {"phase": "Suspended", "message": "replanned"}))
        assert jobs.status("race")["message"] == "replanned"
    finally:
        applier.close()
