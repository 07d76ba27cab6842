"""kwok's fake GPU nodes and the pods on them: make a pod fail or finish, a node NotReady, a job's
pods land on kwok. The labels and annotations are the ones the stages in hack/kwok/stages/ read."""

from __future__ import annotations

import json
from typing import Any

from kubernetes import client

from kubetrain.core import api

POD_FAIL_STAGE = "pod-container-running-failed.stage.kwok.x-k8s.io"
POD_SUCCEED_LABEL = "kwok.kubetrain.io/succeed"
NODE_NOT_READY_STAGE = "node-not-ready.stage.kwok.x-k8s.io"
FAKE_NODE_SELECTOR = "type=kwok"

KWOK_TAINT = {"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}
"""hack/nodes.sh taints the kwok nodes when the cluster has a real node: pods land on the real
node unless their namespace routes them to kwok (KWOK_NAMESPACE_ANNOTATIONS)."""
KWOK_NAMESPACE_ANNOTATIONS = {
    # The API server's PodNodeSelector and PodTolerationRestriction admission plugins apply these
    # to every pod of the namespace, so the operator's pods need no test-only scheduling fields.
    "scheduler.alpha.kubernetes.io/node-selector": FAKE_NODE_SELECTOR,
    "scheduler.alpha.kubernetes.io/defaultTolerations": json.dumps([{**KWOK_TAINT, "operator": "Equal"}]),
}

KWOK_CHECKPOINT = {"ephemeral": True}
"""spec.checkpoint of jobs whose pods land on kwok nodes: kwok pods have no storage (no provisioner
binds a claim for them), so a default checkpoint claim would stay Pending and block the pods."""


def kwok_job(name: str, spec: dict[str, Any] | None = None, namespace: str | None = None) -> dict[str, Any]:
    """A TrainingJob manifest for pods on kwok nodes: ``spec`` with ephemeral checkpoints, unless it
    says where checkpoints go itself (checkpoint.ephemeral or checkpoint.claimName)."""
    spec = dict(spec or {})
    checkpoint = dict(spec.get("checkpoint") or {})
    if "ephemeral" not in checkpoint and "claimName" not in checkpoint:
        spec["checkpoint"] = {**checkpoint, **KWOK_CHECKPOINT}
    metadata = {"name": name, **({"namespace": namespace} if namespace else {})}
    return {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": metadata, "spec": spec}


def fail_pod(
    core: client.CoreV1Api,
    namespace: str,
    name: str,
    exit_code: int = 1,
    reason: str = "Error",
    message: str = "failed by test",
) -> None:
    """Make a Running pod on a kwok node fail: phase Failed, containers terminated with ``exit_code``.

    kwok's pod-container-running-failed stage applies once the pod is Running.
    """
    annotations = {
        f"{POD_FAIL_STAGE}/exit-code": str(exit_code),
        f"{POD_FAIL_STAGE}/reason": reason,
        f"{POD_FAIL_STAGE}/message": message,
        f"{POD_FAIL_STAGE}/delay": "0s",
        f"{POD_FAIL_STAGE}/jitter-delay": "0s",
    }
    core.patch_namespaced_pod(name, namespace, {"metadata": {"annotations": annotations,
                                                             "labels": {POD_FAIL_STAGE: "true"}}})


def succeed_pod(core: client.CoreV1Api, namespace: str, name: str) -> None:
    """Make a Running pod on a kwok node finish: phase Succeeded, exit code 0."""
    core.patch_namespaced_pod(name, namespace, {"metadata": {"labels": {POD_SUCCEED_LABEL: "true"}}})


def succeed_workers(core: client.CoreV1Api, namespace: str, pods: list[client.V1Pod]) -> None:
    """succeed_pod for each of a job's worker pods, worker 0 last: once it exits 0 the job succeeds and
    its cleanPodPolicy deletes the workers still running, which a later patch would not find."""
    for pod in sorted(pods, key=lambda p: p.metadata.name, reverse=True):
        succeed_pod(core, namespace, pod.metadata.name)


def node_ready(core: client.CoreV1Api, name: str) -> bool:
    for cond in core.read_node(name).status.conditions or []:
        if cond.type == "Ready":
            return bool(cond.status == "True")
    return False


def set_node_ready(core: client.CoreV1Api, name: str, ready: bool) -> None:
    """Mark a kwok node NotReady (``ready=False``) or Ready again, through kwok's node-not-ready stage."""
    if ready:
        body: dict[str, Any] = {"metadata": {"labels": {NODE_NOT_READY_STAGE: None}}}
    else:
        body = {
            "metadata": {
                "labels": {NODE_NOT_READY_STAGE: "true"},
                "annotations": {f"{NODE_NOT_READY_STAGE}/delay": "0s", f"{NODE_NOT_READY_STAGE}/jitter-delay": "0s"},
            }
        }
    core.patch_node(name, body)


def fake_node_manifest(
    name: str,
    *,
    gpus: int = 8,
    rdma: int = 8,
    cpu: str = "96",
    memory: str = "1Ti",
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A Node that kwok manages (same shape as hack/nodes.sh); create it with CoreV1Api.create_node."""
    resources = {"cpu": cpu, "memory": memory, "pods": "110", "nvidia.com/gpu": str(gpus)}
    if rdma:
        resources["rdma/ib"] = str(rdma)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {"type": "kwok", "kubernetes.io/hostname": name, **(labels or {})},
        },
        "status": {"capacity": resources, "allocatable": resources},
    }


def static_claim(core: client.CoreV1Api, namespace: str, name: str = "checkpoints") -> str:
    """A claim bound to a static volume (its name is returned, to delete): durable checkpoints for pods on
    kwok nodes, which no provisioner serves. The volume is never mounted (kwok runs no containers)."""
    volume = f"ckpt-{namespace}-{name}"
    spec = {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "",
            "hostPath": {"path": "/tmp/kubetrain-kwok-never-mounted"}, "claimRef": {"namespace": namespace, "name": name}}
    core.create_persistent_volume({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": volume},
                                   "spec": spec})
    core.create_namespaced_persistent_volume_claim(namespace, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
        "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "", "volumeName": volume,
                 "resources": {"requests": {"storage": "1Gi"}}}})
    return volume
