"""Smoke tests: the control plane from hack/ behaves like a real cluster."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from support.cluster import pinned_kubernetes_version
from support.identities import impersonating_client
from support.kwok import FAKE_NODE_SELECTOR, fail_pod, fake_node_manifest, node_ready, set_node_ready, succeed_pod
from support.pods import container_exit_codes, wait_pod_phase
from support.resources import wait_gone
from support.waiting import wait_for

pytestmark = pytest.mark.integration


def pod_manifest(
    name: str, *, node_name: str | None = None, gpus: int = 0, owner: dict[str, Any] | None = None
) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "worker", "image": "kubetrain/none:test"}
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    spec: dict[str, Any] = {"containers": [container], "restartPolicy": "Never"}
    if node_name:
        spec["nodeName"] = node_name
    metadata: dict[str, Any] = {"name": name}
    if owner:
        metadata["ownerReferences"] = [owner]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def owner_ref(obj: Any, kind: str, api_version: str = "v1") -> dict[str, Any]:
    return {"apiVersion": api_version, "kind": kind, "name": obj.metadata.name, "uid": obj.metadata.uid}


def test_server_reports_pinned_version(admin_api: client.ApiClient) -> None:
    assert client.VersionApi(admin_api).get_code().git_version == pinned_kubernetes_version()


def test_fake_gpu_nodes_are_ready(core_v1: client.CoreV1Api) -> None:
    nodes = core_v1.list_node(label_selector=FAKE_NODE_SELECTOR).items
    assert len(nodes) >= 4
    for node in nodes:
        assert node.status.allocatable["nvidia.com/gpu"] == "8"
        assert node.status.allocatable["rdma/ib"] == "8"
        assert node_ready(core_v1, node.metadata.name)


def test_pod_bound_to_fake_node_runs(core_v1: client.CoreV1Api, namespace: str) -> None:
    node = core_v1.list_node(label_selector=FAKE_NODE_SELECTOR).items[0].metadata.name
    core_v1.create_namespaced_pod(namespace, pod_manifest("bound", node_name=node))
    pod = wait_pod_phase(core_v1, namespace, "bound", "Running")
    assert pod.spec.node_name == node
    assert pod.status.container_statuses[0].state.running is not None


def test_scheduler_places_gpu_pod(core_v1: client.CoreV1Api, namespace: str) -> None:
    core_v1.create_namespaced_pod(namespace, pod_manifest("gpu", gpus=8))
    pod = wait_pod_phase(core_v1, namespace, "gpu", "Running")
    node = core_v1.read_node(pod.spec.node_name)
    assert node.metadata.labels["type"] == "kwok"


def test_unschedulable_gpu_request_stays_pending(core_v1: client.CoreV1Api, namespace: str) -> None:
    core_v1.create_namespaced_pod(namespace, pod_manifest("too-big", gpus=9))

    def unschedulable() -> bool:
        conditions = core_v1.read_namespaced_pod("too-big", namespace).status.conditions or []
        return any(c.type == "PodScheduled" and c.reason == "Unschedulable" for c in conditions)

    wait_for(unschedulable, 30, what="PodScheduled=False/Unschedulable")
    assert core_v1.read_namespaced_pod("too-big", namespace).status.phase == "Pending"


def test_fail_pod_helper_sets_exit_code(core_v1: client.CoreV1Api, namespace: str) -> None:
    core_v1.create_namespaced_pod(namespace, pod_manifest("crash", gpus=1))
    wait_pod_phase(core_v1, namespace, "crash", "Running")
    fail_pod(core_v1, namespace, "crash", exit_code=137, reason="OOMKilled")
    pod = wait_pod_phase(core_v1, namespace, "crash", "Failed")
    assert container_exit_codes(pod) == {"worker": 137}
    assert pod.status.container_statuses[0].state.terminated.reason == "OOMKilled"


def test_succeed_pod_helper(core_v1: client.CoreV1Api, namespace: str) -> None:
    core_v1.create_namespaced_pod(namespace, pod_manifest("done", gpus=1))
    wait_pod_phase(core_v1, namespace, "done", "Running")
    succeed_pod(core_v1, namespace, "done")
    pod = wait_pod_phase(core_v1, namespace, "done", "Succeeded")
    assert container_exit_codes(pod) == {"worker": 0}


def test_node_not_ready_helper(core_v1: client.CoreV1Api) -> None:
    # A node of its own, so other tests keep their capacity.
    name = f"kwok-chaos-{uuid.uuid4().hex[:6]}"
    core_v1.create_node(fake_node_manifest(name))
    try:
        wait_for(lambda: node_ready(core_v1, name), 30, what=f"node {name} Ready")
        set_node_ready(core_v1, name, False)
        wait_for(lambda: not node_ready(core_v1, name), 30, what=f"node {name} NotReady")

        # kube-controller-manager's node lifecycle controller reacts with the not-ready taint.
        def tainted() -> bool:
            taints = core_v1.read_node(name).spec.taints or []
            return any(t.key == "node.kubernetes.io/not-ready" for t in taints)

        wait_for(tainted, 30, what="node.kubernetes.io/not-ready taint")
        set_node_ready(core_v1, name, True)
        wait_for(lambda: node_ready(core_v1, name), 30, what=f"node {name} Ready again")
    finally:
        core_v1.delete_node(name)


def test_garbage_collector_deletes_dependents(core_v1: client.CoreV1Api, namespace: str) -> None:
    owner = core_v1.create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="owner"))
    )
    ref = owner_ref(owner, "ConfigMap")
    core_v1.create_namespaced_config_map(namespace, {"metadata": {"name": "dependent", "ownerReferences": [ref]}})
    core_v1.create_namespaced_pod(namespace, pod_manifest("dependent-pod", owner=ref))
    wait_pod_phase(core_v1, namespace, "dependent-pod", "Running")

    core_v1.delete_namespaced_config_map("owner", namespace, propagation_policy="Background")

    wait_gone(lambda: core_v1.read_namespaced_config_map("dependent", namespace), 60, what="dependent ConfigMap GC")
    wait_gone(lambda: core_v1.read_namespaced_pod("dependent-pod", namespace), 60, what="dependent Pod GC")


def test_restricted_identity_is_refused(core_v1: client.CoreV1Api, namespace: str, service_account: Any) -> None:
    reader = service_account(
        "pod-reader",
        rules=[client.V1PolicyRule(api_groups=[""], resources=["pods"], verbs=["get", "list", "watch"])],
    )
    pods = client.CoreV1Api(reader.api)
    # Allowed: the token authenticates and the Role grants list.
    assert pods.list_namespaced_pod(namespace).items == []

    with pytest.raises(ApiException) as refused:
        pods.create_namespaced_pod(namespace, pod_manifest("not-allowed"))
    assert refused.value.status == 403
    assert reader.username in refused.value.body

    with pytest.raises(ApiException) as refused_elsewhere:
        pods.list_namespaced_pod("default")
    assert refused_elsewhere.value.status == 403
    # The admin identity can do what the restricted one cannot.
    core_v1.create_namespaced_pod(namespace, pod_manifest("allowed"))


def test_impersonated_user_without_bindings_is_refused(admin_api: client.ApiClient, namespace: str) -> None:
    nobody = impersonating_client(admin_api, "jane@example.com")
    with pytest.raises(ApiException) as refused:
        client.CoreV1Api(nobody).list_namespaced_pod(namespace)
    assert refused.value.status == 403
    assert "jane@example.com" in refused.value.body
