"""Kueue admission on the real control plane, with Kueue's controller and webhooks built from its Go
module (tests/support/kueue.py): the operator keeps each queued job's Workload, Kueue admits, queues and
preempts it, and the job's gang follows; spec.suspend stays the user's, and deactivates the Workload.

Quota and queueing run on kwok nodes; preemption runs on real pods of the trainer image, where a
preempted gang really gets SIGTERM, writes its checkpoint and later resumes from it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from support.cluster import kubeconfig_path
from support.conditions import condition
from support.jobs import TrainingJobs
from support.kwok import fake_node_manifest, kwok_job, succeed_workers
from support.operator_process import OperatorProcess
from support.real_pods import TRAINER_IMAGE, RealJobs, progress_step, quickstart
from support.resources import not_found_ok
from support.waiting import wait_for

from kubetrain.core import api, contract
from kubetrain.core.cli import main

pytestmark = pytest.mark.integration

K = (contract.KUEUE_GROUP, contract.KUEUE_VERSION)
GANG = {"workers": 2, "resources": {"gpusPerWorker": 8, "cpu": "1", "memory": "1Gi"}}


@pytest.fixture(scope="module")
def operator(crd: None, kueue: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    """Started after Kueue, so that it watches Workloads from the start; real pods get the real trainer image."""
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    with OperatorProcess(kubeconfig_path(), log, trainer_image=TRAINER_IMAGE) as op:
        yield op


class Queue:
    """A ResourceFlavor, a ClusterQueue (preemption of lower priorities within it) for one namespace, and
    its LocalQueue `q`; WorkloadPriorityClasses `low-*` and `high-*`. Removed when the test ends."""

    def __init__(self, admin_api: client.ApiClient, namespace: str, quota: dict[str, str]):
        self.custom = client.CustomObjectsApi(admin_api)
        self.ns = namespace
        self.tag = uuid.uuid4().hex[:6]
        self.cq, self.low, self.high = f"cq-{self.tag}", f"low-{self.tag}", f"high-{self.tag}"
        self.made: list[tuple[str, str | None, str]] = []
        self._make("resourceflavors", None, {"kind": "ResourceFlavor", "metadata": {"name": f"flavor-{self.tag}"}})
        for name, value in ((self.low, 100), (self.high, 1000)):
            self._make("workloadpriorityclasses", None, {"kind": "WorkloadPriorityClass",
                                                         "metadata": {"name": name}, "value": value})
        flavor = {"name": f"flavor-{self.tag}", "resources": [{"name": k, "nominalQuota": v} for k, v in quota.items()]}
        self._make("clusterqueues", None, {"kind": "ClusterQueue", "metadata": {"name": self.cq}, "spec": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            "preemption": {"withinClusterQueue": "LowerPriority"},
            "resourceGroups": [{"coveredResources": list(quota), "flavors": [flavor]}]}})
        self._make("localqueues", namespace, {"kind": "LocalQueue", "metadata": {"name": "q"},
                                             "spec": {"clusterQueue": self.cq}})

    def _make(self, plural: str, ns: str | None, obj: dict[str, Any]) -> None:
        obj = {"apiVersion": "/".join(K), **obj}
        if ns is None:
            self.custom.create_cluster_custom_object(*K, plural, obj)
        else:
            self.custom.create_namespaced_custom_object(*K, ns, plural, obj)
        self.made.append((plural, ns, obj["metadata"]["name"]))

    def delete(self) -> None:
        for plural, ns, name in reversed(self.made):
            with not_found_ok():
                if ns is None:
                    self.custom.delete_cluster_custom_object(*K, plural, name)
                else:
                    self.custom.delete_namespaced_custom_object(*K, ns, plural, name)

    def workload(self, job: str) -> dict[str, Any]:
        found = self.find_workload(job)
        assert found is not None, f"no Workload of {job}"
        return found

    def find_workload(self, job: str) -> dict[str, Any] | None:
        items = self.custom.list_namespaced_custom_object(*K, self.ns, contract.WORKLOAD_PLURAL,
                                                          label_selector=f"{contract.LABEL_JOB}={job}")["items"]
        assert len(items) <= 1, [i["metadata"]["name"] for i in items]
        return dict(items[0]) if items else None


def admitted(status: dict[str, Any]) -> dict[str, Any] | None:
    return condition(status, api.ADMITTED)


def live_pods(jobs: TrainingJobs, name: str) -> list[client.V1Pod]:
    return [p for p in jobs.pods(name) if not p.metadata.deletion_timestamp]


@pytest.fixture
def gpu_queue(admin_api: client.ApiClient, namespace: str) -> Iterator[Queue]:
    q = Queue(admin_api, namespace, {"cpu": "100", "memory": "100Gi", "nvidia.com/gpu": "16"})
    yield q
    q.delete()


def test_quota_for_one_gang_admits_one_job_and_the_next_when_it_finishes(
        admin_api: client.ApiClient, core_v1: client.CoreV1Api, namespace: str, operator: OperatorProcess,
        gpu_queue: Queue) -> None:
    jobs = TrainingJobs(admin_api, namespace, operator)
    for name in ("first", "second"):
        jobs.submit(kwok_job(name, {**GANG, "scheduling": {"queue": "q"}}))
        if name == "first":
            jobs.wait_status(name, lambda st: st.get("phase") in ("Created", "Running"), 60, "first admitted")
    first, second = jobs.status("first"), jobs.wait_status(
        "second", lambda st: (c := admitted(st)) and "insufficient" in c["message"], 60, "second queued")
    print(f"first: {first['phase']}, Admitted={admitted(first)}\nsecond: {second['phase']}, "
          f"Admitted={admitted(second)}")
    assert second["phase"] == "Suspended" and jobs.get("second")["spec"]["suspend"] is False  # held, not suspended
    assert live_pods(jobs, "second") == [] and len(live_pods(jobs, "first")) == 2
    wl = gpu_queue.workload("first")
    assert wl["spec"]["podSets"][0]["count"] == 2 and wl["status"]["admission"]["clusterQueue"] == gpu_queue.cq
    assert wl["metadata"]["ownerReferences"][0]["name"] == "first"
    wait_for(lambda: all(p.status.phase == "Running" for p in live_pods(jobs, "first")), 60, what="first running")
    succeed_workers(core_v1, namespace, live_pods(jobs, "first"))
    jobs.wait_status("first", lambda st: st.get("phase") == "Succeeded", 60, "first Succeeded")
    wait_for(lambda: any(c["type"] == "Finished" and c["status"] == "True"
                         for c in gpu_queue.workload("first")["status"]["conditions"]), 30, what="Workload Finished")
    st = jobs.wait_status("second", lambda st: st.get("phase") in ("Created", "Running"), 60, "second admitted")
    assert (c := admitted(st)) is not None and c["status"] == "True"
    # The Event is recorded after the status that says the same: wait for it, as a user's `kubectl get events` would.
    wait_for(lambda: {"Queued", "QuotaReserved"} <= {e.reason for e in jobs.events("second")}, 30,
             what="the Queued and QuotaReserved Events of the second job")


def test_a_job_managed_by_multikueue_gets_its_workload_and_no_pods(
        admin_api: client.ApiClient, namespace: str, operator: OperatorProcess, gpu_queue: Queue) -> None:
    jobs = TrainingJobs(admin_api, namespace, operator)
    jobs.submit(kwok_job("mk", {**GANG, "scheduling": {"queue": "q"}, "managedBy": "kueue.x-k8s.io/multikueue"}))
    wl = wait_for(lambda: (w := gpu_queue.find_workload("mk")) is not None and any(
        c["type"] == "Admitted" and c["status"] == "True" for c in (w.get("status") or {}).get("conditions") or [])
        and w, 60, what="mk's Workload admitted")
    assert wl["spec"]["queueName"] == "q"
    assert jobs.pods("mk") == [] and jobs.status("mk") == {}  # MultiKueue's worker cluster runs it
    assert jobs.get("mk")["spec"]["suspend"] is False  # the user's: never written for Kueue


def test_a_queued_job_suspended_and_resumed_through_the_cli_deactivates_and_reactivates_its_workload(
        admin_api: client.ApiClient, core_v1: client.CoreV1Api, namespace: str, operator: OperatorProcess,
        gpu_queue: Queue, capsys: pytest.CaptureFixture[str]) -> None:
    """`kubetrain suspend` on an admitted, running job: its Workload deactivated (Kueue evicts it, the quota goes
    back), phase Suspended, and nothing undoes the suspend; `kubetrain resume`: reactivated, admitted again,
    Running, with no failure counted."""
    jobs = TrainingJobs(admin_api, namespace, operator)
    jobs.submit(kwok_job("paused", {**GANG, "scheduling": {"queue": "q"}}))
    jobs.wait_status("paused", lambda st: st.get("phase") == "Running", 90, "paused running")
    cli = ["-n", namespace, "--kubeconfig", str(kubeconfig_path())]
    assert main(["suspend", "paused", *cli]) == 0
    said = capsys.readouterr().out
    print(said)
    assert "paused suspended (phase Suspended; Kueue: Deactivated: Workload" in said, said
    wl = gpu_queue.workload("paused")
    assert wl["spec"]["active"] is False
    wait_for(lambda: not (gpu_queue.workload("paused").get("status") or {}).get("admission"), 60,
             what="the quota given back once the gang is gone")
    assert live_pods(jobs, "paused") == [] and jobs.get("paused")["spec"]["suspend"] is True
    evicted = condition(gpu_queue.workload("paused")["status"], "Evicted")
    assert evicted is not None and evicted["reason"] == "Deactivated", evicted
    assert main(["resume", "paused", *cli]) == 0
    said = capsys.readouterr().out
    print(said)
    assert "paused resumed (phase " in said, said
    st = jobs.wait_status("paused", lambda st: st.get("phase") == "Running", 90, "paused running again")
    assert gpu_queue.workload("paused")["spec"]["active"] is True
    assert st.get("restartCount", 0) == 0 and (c := admitted(st)) is not None and c["reason"] == "QuotaReserved"
    assert "Deactivated" in [e.reason for e in jobs.events("paused")]


def test_topology_aware_scheduling_keeps_the_gang_in_one_block(
        admin_api: client.ApiClient, core_v1: client.CoreV1Api, namespace: str, operator: OperatorProcess) -> None:
    """Kueue's topology-aware scheduling: block a cannot hold the 2 x 8-GPU gang (8 + 4 GPUs), block b can;
    the job's podset-required-topology annotation becomes the Workload's topologyRequest, the pods wait at
    Kueue's topology gate, and Kueue's ungater sends both to block b."""
    tag = uuid.uuid4().hex[:6]
    block, nodes = f"example.com/block-{tag}", {f"tas-{tag}-a0": ("a", 8), f"tas-{tag}-a1": ("a", 4),
                                               f"tas-{tag}-b0": ("b", 8), f"tas-{tag}-b1": ("b", 8)}
    for name, (b, gpus) in nodes.items():
        core_v1.create_node(fake_node_manifest(name, gpus=gpus, labels={block: b, "tas-test": tag}))
    queue = TopologyQueue(admin_api, namespace, tag, block)
    try:
        jobs = TrainingJobs(admin_api, namespace, operator)
        body = kwok_job("tas", {**GANG, "scheduling": {"queue": "q"}})
        body["metadata"]["annotations"] = {contract.KUEUE_REQUIRED_TOPOLOGY: block}
        jobs.submit(body)
        placed = wait_for(lambda: (ps := live_pods(jobs, "tas")) and len(ps) == 2 and all(
            p.spec.node_name for p in ps) and ps, 90, what="both workers bound")
        wl = queue.workload("tas")
        assert wl["spec"]["podSets"][0]["topologyRequest"]["required"] == block
        assert wl["status"]["admission"]["podSetAssignments"][0].get("topologyAssignment")
        where = {p.metadata.name: p.spec.node_name for p in placed}
        print(f"TAS placed the gang on {where}")
        assert all(nodes[n][0] == "b" for n in where.values()), where
        assert all(not p.spec.scheduling_gates for p in placed)  # Kueue's ungater lifted its gate
    finally:
        queue.delete()
        for name in nodes:
            with not_found_ok():
                core_v1.delete_node(name)


class TopologyQueue(Queue):
    """A Queue whose flavor is the test's nodes, placed by a Kueue Topology of (block, hostname)."""

    def __init__(self, admin_api: client.ApiClient, namespace: str, tag: str, block: str):
        self.custom, self.ns, self.tag, self.made = client.CustomObjectsApi(admin_api), namespace, tag, []
        self.cq = f"cq-{tag}"
        self._make("topologies", None, {"kind": "Topology", "metadata": {"name": f"topo-{tag}"}, "spec": {
            "levels": [{"nodeLabel": block}, {"nodeLabel": "kubernetes.io/hostname"}]}})
        self._make("resourceflavors", None, {"kind": "ResourceFlavor", "metadata": {"name": f"flavor-{tag}"},
                                             "spec": {"nodeLabels": {"tas-test": tag}, "topologyName": f"topo-{tag}"}})
        quota = {"cpu": "100", "memory": "100Gi", "nvidia.com/gpu": "64"}
        flavor = {"name": f"flavor-{tag}", "resources": [{"name": k, "nominalQuota": v} for k, v in quota.items()]}
        self._make("clusterqueues", None, {"kind": "ClusterQueue", "metadata": {"name": self.cq}, "spec": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            "resourceGroups": [{"coveredResources": list(quota), "flavors": [flavor]}]}})
        self._make("localqueues", namespace, {"kind": "LocalQueue", "metadata": {"name": "q"},
                                             "spec": {"clusterQueue": self.cq}})


def test_a_higher_priority_job_preempts_a_running_one_which_checkpoints_and_resumes(
        admin_api: client.ApiClient, real_namespace: str, operator: OperatorProcess) -> None:
    """Real pods: the quota (1 CPU) holds one gang of 2 x 500m. The low job trains; the high one preempts
    it; the low gang gets SIGTERM, checkpoints and is suspended; once the high one is done the low one is
    admitted again and resumes from the step it was stopped at, with no failure counted."""
    queue = Queue(admin_api, real_namespace, {"cpu": "1", "memory": "8Gi"})
    try:
        jobs = RealJobs(admin_api, real_namespace)
        sized = {"resources": {"cpu": "500m", "memory": "1Gi"}, "scheduling": {"queue": "q"}, "precision": "fp32",
                 "checkpoint": {"everySteps": 1000}}
        low = quickstart(**sized, maxSteps=400)
        low["metadata"]["labels"] = {contract.KUEUE_PRIORITY_CLASS_LABEL: queue.low}
        jobs.create(low, name="low")
        wait_for(lambda: progress_step(jobs.core, jobs.ns, "low") >= 20, 300, what="low's rank 0 at step >= 20")
        name = "low"
        high = quickstart(**sized, maxSteps=20)
        high["metadata"]["labels"] = {contract.KUEUE_PRIORITY_CLASS_LABEL: queue.high}
        jobs.create(high, name="high")
        try:
            stopped = jobs.wait(name, lambda st: (c := admitted(st)) is not None and c["reason"] == "Evicted"
                                and st.get("phase") == "Suspended", 120, "low evicted and suspended")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nhigh's Workload: {queue.find_workload('high')}") from exc
        print(f"low evicted: {admitted(stopped)['message']}")
        jobs.wait_phase("high", "Succeeded", 600)
        done = jobs.wait_phase(name, "Succeeded", 900)
        print(f"low: resumed from step {done.get('resumedFromStep')}, restarts {done.get('restartCount', 0)}, "
              f"generation {done.get('restartGeneration')}, final loss {done.get('loss')}")
        assert done.get("restartCount", 0) == 0 and done["restartGeneration"] == 1
        assert done.get("resumedFromStep", 0) >= 20  # the checkpoint written on SIGTERM, not step 0
        log = jobs.log("low-worker-0")
        assert f"(step {done['resumedFromStep']})" in log and "resumed from" in log, log[-2000:]
    finally:
        queue.delete()
