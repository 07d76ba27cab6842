"""Failures the operator must answer, against the real control plane with kwok GPU nodes: a lost node
whose pods stay Terminating, an eviction, a preemption and a node about to go (disruptions, not counted),
a job resumed after its deadline would have passed while suspended, and an edit of its size. (Progress
that cannot be reported is in test_progress_reporting.py: it needs an operator under a trimmed RBAC and
no other operator running.)"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from support.cluster import kubeconfig_path
from support.jobs import TrainingJobs
from support.kwok import kwok_job, set_node_ready
from support.operator_process import OperatorProcess
from support.waiting import wait_for

from kubetrain.core import api
from kubetrain.core.api import TrainingJobSpec
from kubetrain.operator.jobs import builders as b

pytestmark = pytest.mark.integration

UNREACHABLE = "kwok.kubetrain.io/unreachable"
"""kwok leaves a terminating pod with this label Terminating, as a lost node's kubelet would."""


@pytest.fixture(scope="module")
def operator(crd: None, kube_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    with OperatorProcess(kubeconfig_path(), tmp_path_factory.mktemp("operator") / "operator.log") as op:
        yield op


class Jobs(TrainingJobs):
    def create(self, name: str, **spec: Any) -> dict[str, Any]:
        return self.submit(kwok_job(name, {"workers": 2, **spec}))

    def running(self, name: str, generation: int, timeout: float = 90, workers: int = 2) -> dict[str, Any]:
        def ok(s: dict[str, Any]) -> bool:
            pods = [p for p in self.pods(name) if p.metadata.labels.get(b.LABEL_GENERATION) == str(generation)
                    and p.status.phase == "Running" and not p.metadata.deletion_timestamp]
            return s.get("phase") == "Running" and s.get("restartGeneration", 0) == generation and len(pods) == workers
        return self.wait_status(name, ok, timeout, what=f"{name} Running in generation {generation}")


@pytest.fixture
def jobs(admin_api: client.ApiClient, namespace: str, operator: OperatorProcess) -> Jobs:
    return Jobs(admin_api, namespace, operator)


def test_a_lost_nodes_terminating_pod_is_force_deleted_and_the_new_gang_runs(jobs: Jobs) -> None:
    jobs.create("lost", restartPolicy={"nodeNotReadyGraceSeconds": 2, "backoffSeconds": 0})
    jobs.running("lost", 0)
    victim = next(p for p in jobs.pods("lost") if p.metadata.name == "lost-worker-1")
    jobs.core.patch_namespaced_pod(victim.metadata.name, jobs.ns, {"metadata": {"labels": {UNREACHABLE: "true"}}})
    set_node_ready(jobs.core, victim.spec.node_name, False)
    try:
        st = jobs.running("lost", 1)
        assert st["failures"] == {"NodeLost": 1}
        assert all(p.metadata.uid != victim.metadata.uid for p in jobs.pods("lost"))
    finally:
        set_node_ready(jobs.core, victim.spec.node_name, True)


def test_a_job_deleted_in_the_foreground_gets_no_new_gang_while_its_pods_go(jobs: Jobs) -> None:
    """Foreground deletion: the garbage collector deletes the pods before the job, which a live job would
    answer with a gang restart; a job being deleted gets none, and goes."""
    jobs.create("dying", restartPolicy={"backoffSeconds": 0})
    jobs.running("dying", 0)
    jobs.custom.delete_namespaced_custom_object(api.GROUP, api.VERSION, jobs.ns, api.PLURAL, "dying",
                                                propagation_policy="Foreground")
    generations: set[str] = set()

    def gone() -> bool:
        generations.update(p.metadata.labels.get(b.LABEL_GENERATION, "?") for p in jobs.pods("dying"))
        try:
            jobs.get("dying")
        except ApiException as exc:
            return exc.status == 404
        return False

    wait_for(gone, 60, what="the job and its pods deleted", interval=0.1)
    assert generations <= {"0"}, f"pods of generations {sorted(generations)} for a job being deleted"


def test_an_eviction_restarts_the_gang_without_spending_the_backoff_limit(jobs: Jobs) -> None:
    jobs.create("evict", restartPolicy={"backoffLimit": 0, "backoffSeconds": 0})
    jobs.running("evict", 0)
    eviction = client.V1Eviction(metadata=client.V1ObjectMeta(name="evict-worker-1", namespace=jobs.ns))
    jobs.core.create_namespaced_pod_eviction("evict-worker-1", jobs.ns, eviction)
    st = jobs.running("evict", 1)
    assert (st["restartCount"], st["ignoredRestarts"], st["failures"]) == (1, 1, {"Disrupted": 1}), st
    assert "not counted against backoffLimit" in next(e.message for e in jobs.events("evict") if e.reason == "Disrupted")


def test_a_node_about_to_go_moves_the_gang_elsewhere_without_spending_the_backoff_limit(jobs: Jobs) -> None:
    """Karpenter's taint on worker 1's node: the gang stops (SIGTERM: the trainer checkpoints) and generation 1
    runs on other nodes (the taint keeps new pods off it), not counted against backoffLimit 0."""
    jobs.create("spot", resources={"gpusPerWorker": 8}, restartPolicy={"backoffLimit": 0, "backoffSeconds": 0})
    jobs.running("spot", 0)
    doomed = next(p for p in jobs.pods("spot") if p.metadata.name == "spot-worker-1").spec.node_name
    taint = {"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}
    taints = jobs.core.read_node(doomed).spec.taints or []
    jobs.core.patch_node(doomed, {"spec": {"taints": [*[t.to_dict() for t in taints], taint]}})
    try:
        st = jobs.running("spot", 1)
        where = {p.metadata.name: p.spec.node_name for p in jobs.pods("spot")}
        print(f"spot: {st['message']}; generation 1 on {where}")
        assert (st["restartCount"], st["ignoredRestarts"], st["failures"]) == (1, 1, {"Disrupted": 1}), st
        assert doomed not in where.values(), where
        said = next(e.message for e in jobs.events("spot") if e.reason == "Disrupted")
        assert f"node {doomed} is about to go (taint karpenter.sh/disrupted)" in said, said
    finally:
        jobs.core.patch_node(doomed, {"spec": {"taints": [t.to_dict() for t in taints]}})


def test_suspended_time_does_not_count_against_the_active_deadline(jobs: Jobs) -> None:
    jobs.create("pause", activeDeadlineSeconds=15)
    first = jobs.running("pause", 0)["startTime"]
    jobs.patch_spec("pause", {"suspend": True})
    jobs.wait_status("pause", lambda s: s.get("phase") == "Suspended", what="Suspended")
    time.sleep(16)  # longer than the whole deadline, all of it suspended
    jobs.patch_spec("pause", {"suspend": False})
    st = jobs.running("pause", 1)
    assert st["startTime"] > first and st.get("reason") != "DeadlineExceeded", st


def test_a_workers_edit_restarts_the_gang_at_its_new_size_and_updates_its_config(jobs: Jobs) -> None:
    jobs.create("resize", restartPolicy={"backoffLimit": 0, "backoffSeconds": 0})
    jobs.running("resize", 0)
    for size, generation in ((3, 1), (1, 2)):
        jobs.patch_spec("resize", {"workers": size})
        st = jobs.wait_status("resize", lambda s, g=generation, n=size: s.get("phase") == "Running"
                              and s.get("restartGeneration") == g and s.get("workersReady") == n, 90,
                              what=f"resize Running with {size} worker(s)")
        live = [p for p in jobs.pods("resize") if not p.metadata.deletion_timestamp]
        assert sorted(p.metadata.name for p in live) == [f"resize-worker-{i}" for i in range(size)], live
        config = jobs.core.read_namespaced_config_map("resize-config", jobs.ns).data["config.json"]
        assert TrainingJobSpec.model_validate(json.loads(config)).workers == size  # the trainer's reading of it
    assert (st["failures"], st["ignoredRestarts"], st["restartCount"]) == ({}, 2, 2), st


def gpu_pod(name: str, priority: str) -> dict[str, Any]:
    """A pod that takes a whole kwok node's 8 GPUs (the namespace routes it to kwok)."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"priorityClassName": priority, "containers": [{
                "name": "c", "image": "kwok.invalid/none", "resources": {"limits": {"nvidia.com/gpu": "8"}}}]}}


@pytest.fixture
def priorities(admin_api: client.ApiClient) -> Iterator[tuple[str, str]]:
    sched = client.SchedulingV1Api(admin_api)
    names = ("kubetrain-test-lowest", "kubetrain-test-high")
    # Below the default 0: a pod another test left behind is never the scheduler's cheaper victim.
    for name, value in zip(names, (-10, 1000), strict=True):
        with contextlib.suppress(client.ApiException):  # 409: kept from an earlier run
            sched.create_priority_class(client.V1PriorityClass(metadata=client.V1ObjectMeta(name=name), value=value))
    yield names


def test_a_worker_preempted_by_the_scheduler_is_a_disruption_not_counted(
    jobs: Jobs, priorities: tuple[str, str],
) -> None:
    """The real kube-scheduler preempts a worker for a higher-priority pod (DisruptionTarget,
    PreemptionByScheduler): the gang restarts without spending backoffLimit 0."""
    low, high = priorities
    jobs.create("preempt", resources={"gpusPerWorker": 8}, scheduling={"priorityClassName": low},
                restartPolicy={"backoffLimit": 0, "backoffSeconds": 0})
    jobs.running("preempt", 0)
    nodes = {n.metadata.name for n in jobs.core.list_node(label_selector="type=kwok").items}
    busy = {p.spec.node_name for p in jobs.pods("preempt")}
    for i, _ in enumerate(sorted(nodes - busy)):  # fill every other GPU node, so only a worker can make room
        jobs.core.create_namespaced_pod(jobs.ns, gpu_pod(f"filler-{i}", high))
    jobs.core.create_namespaced_pod(jobs.ns, gpu_pod("preemptor", high))
    st = jobs.wait_status("preempt", lambda s: s.get("restartCount", 0) >= 1, 90, what="preemption restart")
    assert (st["ignoredRestarts"], st["failures"]) == (1, {"Disrupted": 1}), st
    assert st["phase"] != "Failed", st
