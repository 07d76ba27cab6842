"""Kueue itself on the test cluster, with no operator: the `kueue` fixture (tests/support/kueue.py) runs
Kueue's controller manager built from its Go module, and plain Kueue Workloads go through its quota
accounting, its admission and its validating webhook. Pods and Jobs outside Kueue's queues are still
created while its webhooks are installed."""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from support.conditions import condition
from support.kueue import Kueue
from support.resources import not_found_ok, wait_gone
from support.waiting import holds, wait_for

from kubetrain.core import contract

pytestmark = pytest.mark.integration

GROUP, VERSION, WORKLOADS = contract.KUEUE_GROUP, contract.KUEUE_VERSION, contract.WORKLOAD_PLURAL
GPU = "nvidia.com/gpu"
QUOTA = {"cpu": "100", "memory": "100Gi", GPU: "16"}


@dataclass(frozen=True)
class GpuQueue:
    """A ResourceFlavor, a ClusterQueue with QUOTA in it, and a LocalQueue in the test namespace."""

    namespace: str
    flavor: str
    cluster_queue: str
    local_queue: str


@pytest.fixture
def custom(admin_api: client.ApiClient) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(admin_api)


@pytest.fixture
def gpu_queue(kueue: Kueue, custom: client.CustomObjectsApi, namespace: str) -> Iterator[GpuQueue]:
    tag = uuid.uuid4().hex[:6]
    queue = GpuQueue(namespace, f"smoke-flavor-{tag}", f"smoke-cq-{tag}", "smoke-lq")
    resources = [{"name": name, "nominalQuota": value} for name, value in QUOTA.items()]
    cluster_scoped: list[tuple[str, dict[str, Any]]] = [
        ("resourceflavors", {"kind": "ResourceFlavor", "metadata": {"name": queue.flavor}}),
        ("clusterqueues", {"kind": "ClusterQueue", "metadata": {"name": queue.cluster_queue}, "spec": {
            "namespaceSelector": {},
            "resourceGroups": [{"coveredResources": list(QUOTA),
                                "flavors": [{"name": queue.flavor, "resources": resources}]}]}}),
    ]
    try:
        for plural, body in cluster_scoped:
            custom.create_cluster_custom_object(GROUP, VERSION, plural, {"apiVersion": f"{GROUP}/{VERSION}", **body})
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, "localqueues", {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": "LocalQueue", "metadata": {"name": queue.local_queue},
            "spec": {"clusterQueue": queue.cluster_queue}})
        yield queue
    finally:
        remove_queue(custom, queue)


def remove_queue(custom: client.CustomObjectsApi, queue: GpuQueue) -> None:
    """Everything the queue holds, then the queue, while Kueue runs: it releases its finalizers on the
    ClusterQueue and ResourceFlavor only once no Workload uses them."""
    custom.delete_collection_namespaced_custom_object(GROUP, VERSION, queue.namespace, WORKLOADS)
    wait_for(lambda: not custom.list_namespaced_custom_object(GROUP, VERSION, queue.namespace, WORKLOADS)["items"],
             30, what="the queue's Workloads deleted")
    with not_found_ok():
        custom.delete_namespaced_custom_object(GROUP, VERSION, queue.namespace, "localqueues", queue.local_queue)
    for plural, name in (("clusterqueues", queue.cluster_queue), ("resourceflavors", queue.flavor)):
        with not_found_ok():
            custom.delete_cluster_custom_object(GROUP, VERSION, plural, name)
        wait_gone(functools.partial(custom.get_cluster_custom_object, GROUP, VERSION, plural, name), 30,
                  what=f"{plural}/{name} gone")


def workload(name: str, queue: str, count: int, gpus_each: int, extra: dict[str, str] | None = None) -> dict[str, Any]:
    requests = {"cpu": "1", "memory": "1Gi", GPU: str(gpus_each), **(extra or {})}
    container = {"name": "worker", "image": "kubetrain/none:test",
                 "resources": {"requests": requests, "limits": {GPU: str(gpus_each)}}}
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "Workload", "metadata": {"name": name},
            "spec": {"queueName": queue, "podSets": [{"name": "workers", "count": count, "template": {
                "spec": {"restartPolicy": "Never", "containers": [container]}}}]}}


def is_true(wl: dict[str, Any], kind: str) -> bool:
    return (c := condition(wl.get("status") or {}, kind)) is not None and c["status"] == "True"


def wait_condition(custom: client.CustomObjectsApi, ns: str, name: str, kind: str,
                   status: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Until Workload `name` has condition `kind` (with `status`, if given): the Workload and the condition."""
    def seen() -> tuple[dict[str, Any], dict[str, Any]] | None:
        wl = read_workload(custom, ns, name)
        c = condition(wl.get("status") or {}, kind)
        return (wl, c) if c is not None and status in (None, c["status"]) else None
    found = wait_for(seen, 60, what=f"Workload {name!r}: {kind}={status or 'any'}")
    assert found is not None
    return found


def create_workload(custom: client.CustomObjectsApi, ns: str, body: dict[str, Any]) -> None:
    custom.create_namespaced_custom_object(GROUP, VERSION, ns, WORKLOADS, body)


def read_workload(custom: client.CustomObjectsApi, ns: str, name: str) -> dict[str, Any]:
    return dict(custom.get_namespaced_custom_object(GROUP, VERSION, ns, WORKLOADS, name))


def test_a_workload_that_fits_is_admitted_with_the_flavor_and_one_that_does_not_waits(
        custom: client.CustomObjectsApi, gpu_queue: GpuQueue) -> None:
    ns, lq = gpu_queue.namespace, gpu_queue.local_queue
    create_workload(custom, ns, workload("fits", lq, count=2, gpus_each=8))
    first, _ = wait_condition(custom, ns, "fits", "Admitted", "True")
    assert is_true(first, "QuotaReserved")
    admission = first["status"]["admission"]
    assert admission["clusterQueue"] == gpu_queue.cluster_queue
    [assignment] = admission["podSetAssignments"]
    assert assignment["name"] == "workers" and assignment["count"] == 2
    assert assignment["flavors"] == dict.fromkeys(QUOTA, gpu_queue.flavor)
    assert assignment["resourceUsage"][GPU] == "16"

    create_workload(custom, ns, workload("waits", lq, count=2, gpus_each=8))
    _, pending = wait_condition(custom, ns, "waits", "QuotaReserved")
    print(f"waits: {pending}")
    assert pending["status"] == "False"
    assert f"insufficient unused quota for {GPU} in flavor {gpu_queue.flavor}" in pending["message"]
    holds(lambda: not is_true(read_workload(custom, ns, "waits"), "QuotaReserved"), 3, what="'waits' stays pending")

    custom.delete_namespaced_custom_object(GROUP, VERSION, ns, WORKLOADS, "fits")
    wait_condition(custom, ns, "waits", "Admitted", "True")  # once 'fits' gave its quota back


def test_kueues_validating_webhook_refuses_an_invalid_workload(
        custom: client.CustomObjectsApi, gpu_queue: GpuQueue) -> None:
    """`pods` is a valid resource name for the CRD's schema; only Kueue's webhook reserves it."""
    body = workload("reserved-key", gpu_queue.local_queue, count=1, gpus_each=1, extra={"pods": "1"})
    with pytest.raises(ApiException) as refused:
        create_workload(custom, gpu_queue.namespace, body)
    status = json.loads(refused.value.body)
    print(f"refused: {status}")
    assert status["code"] == 403 and status["reason"] == "Forbidden"
    assert status["message"].startswith('admission webhook "vworkload.kb.io" denied the request')
    assert "requests[pods]" in status["message"] and "reserved for internal kueue use" in status["message"]


def test_pods_and_jobs_outside_kueue_still_run(kueue: Kueue, core_v1: client.CoreV1Api,
                                                admin_api: client.ApiClient, namespace: str) -> None:
    """Kueue's webhooks are installed but only on its own API group: the cluster's other creates are
    untouched, and Kueue's batch/job integration leaves a Job without a queue alone (not suspended)."""
    pod_spec = {"restartPolicy": "Never", "containers": [{"name": "main", "image": "kubetrain/none:test"}]}
    core_v1.create_namespaced_pod(namespace, {"apiVersion": "v1", "kind": "Pod",
                                              "metadata": {"name": "plain"}, "spec": pod_spec})
    batch = client.BatchV1Api(admin_api)
    batch.create_namespaced_job(namespace, {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "plain"},
                                            "spec": {"template": {"spec": pod_spec}}})
    wait_for(lambda: core_v1.read_namespaced_pod("plain", namespace).status.phase == "Running", 60,
             what="the plain Pod Running")
    job_pods = wait_for(lambda: [p for p in core_v1.list_namespaced_pod(
        namespace, label_selector="job-name=plain").items if p.status.phase == "Running"], 60,
        what="the Job's pod Running")
    assert len(job_pods) == 1
    assert not batch.read_namespaced_job("plain", namespace).spec.suspend
    assert kueue.proc is not None and kueue.proc.poll() is None  # its webhooks were there all along
