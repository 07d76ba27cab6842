"""Every fabric profile on the real API server: the operator's worker pod is admitted (resources,
annotations, native sidecars, host paths all valid), carries the profile's requirements, and is
scheduled onto a kwok node that advertises the devices the profile requests. What each profile must
contain is checked against the clouds' sources in tests/unit/test_fabric_profiles.py."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from kubernetes.utils import parse_quantity
from support.cluster import kubeconfig_path
from support.jobs import TrainingJobs
from support.kwok import fake_node_manifest, kwok_job
from support.operator_process import OperatorProcess
from support.resources import not_found_ok
from support.waiting import wait_for

from kubetrain.core import api
from kubetrain.operator.jobs import fabrics

NODE_LABEL = "kubetrain.io/fabric-test"
DEVICES = {"rdma/ib": "8", "rdma/roce": "8", "rdma/shared_ib": "8", "vpc.amazonaws.com/efa": "32",
           "hugepages-2Mi": "10Gi", "nvidia.com/gpu": "8", "memory": "1Ti"}
"""What a node of each cloud's GPU pool advertises (its device plugins), all on one kwok node."""


@pytest.fixture(scope="module")
def operator(crd: None, kube_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    with OperatorProcess(kubeconfig_path(), tmp_path_factory.mktemp("operator") / "operator.log") as op:
        yield op


@pytest.fixture
def fabric_node(core_v1: client.CoreV1Api) -> Iterator[str]:
    """A kwok node of its own (other tests keep their capacity) with every fabric's devices, labelled
    as a p5.48xlarge so that an `instanceType` selector finds it."""
    name = f"kwok-fabric-{uuid.uuid4().hex[:6]}"
    node = fake_node_manifest(name, labels={NODE_LABEL: name, "node.kubernetes.io/instance-type": "p5.48xlarge"})
    for key in ("capacity", "allocatable"):
        node["status"][key].update(DEVICES)
    core_v1.create_node(node)
    try:
        yield name
    finally:
        with not_found_ok():
            core_v1.delete_node(name)


def scheduled_pod(jobs: TrainingJobs, name: str) -> client.V1Pod:
    def bound() -> client.V1Pod | None:
        pods = jobs.pods(name)
        return pods[0] if pods and pods[0].spec.node_name else None
    return wait_for(bound, 90, what=f"{name}'s worker scheduled")


def limits(pod: client.V1Pod) -> dict[str, str]:
    return dict(pod.spec.containers[0].resources.limits or {})


def env(pod: client.V1Pod) -> dict[str, str]:
    return {e.name: e.value for e in pod.spec.containers[0].env or [] if e.value is not None}


@pytest.fixture
def cluster_runtimes(admin_api: client.ApiClient) -> Iterator[Callable[[str, dict[str, Any]], str]]:
    """make(name, spec): a ClusterTrainingRuntime of a name unique to this test (runtimes outlive namespaces),
    deleted afterwards; returns its name."""
    custom, made = client.CustomObjectsApi(admin_api), []

    def make(name: str, spec: dict[str, Any]) -> str:
        unique = f"{name}-{uuid.uuid4().hex[:6]}"
        custom.create_cluster_custom_object(api.GROUP, api.VERSION, api.CLUSTER_RUNTIME_PLURAL, {
            "apiVersion": api.API_VERSION, "kind": api.CLUSTER_RUNTIME_KIND, "metadata": {"name": unique},
            "spec": spec})
        made.append(unique)
        return unique
    yield make
    for name in made:
        with not_found_ok():
            custom.delete_cluster_custom_object(api.GROUP, api.VERSION, api.CLUSTER_RUNTIME_PLURAL, name)


HOST_FABRICS = ("tcpx", "tcpxo")
"""Their daemon runs as root and they mount the node's /sys: a job gets them through a ClusterTrainingRuntime."""


def test_every_fabric_renders_a_pod_the_api_server_accepts_and_schedules_where_its_devices_are(
        admin_api: client.ApiClient, core_v1: client.CoreV1Api, namespace: str, fabric_node: str,
        operator: OperatorProcess, cluster_runtimes: Callable[[str, dict[str, Any]], str]) -> None:
    jobs = TrainingJobs(admin_api, namespace, operator)
    options = {"efa": {"instanceType": "p5.48xlarge"}}
    for fabric in fabrics.RENDERERS:
        spec: dict[str, Any] = {"workers": 1, "resources": {"gpusPerWorker": 1},
                                "scheduling": {"nodeSelector": {NODE_LABEL: fabric_node}}}
        if fabric in HOST_FABRICS:
            spec["runtimeRef"] = {"name": cluster_runtimes(fabric, {"fabric": fabric, "locked": ["fabric"]})}
        else:
            spec["fabric"] = fabric
        if fabric in options:
            spec["fabricOptions"] = options[fabric]
        jobs.submit(kwok_job(f"f-{fabric}", spec))
    pods = {fabric: scheduled_pod(jobs, f"f-{fabric}") for fabric in fabrics.RENDERERS}
    assert {f: p.spec.node_name for f, p in pods.items()} == {f: fabric_node for f in fabrics.RENDERERS}

    assert limits(pods["infiniband"])["rdma/ib"] == "1" and env(pods["infiniband"])["NCCL_IB_HCA"] == "mlx5"
    assert limits(pods["roce"])["rdma/roce"] == "1" and env(pods["roce"])["NCCL_IB_GID_INDEX"] == "3"
    assert limits(pods["aks-infiniband"])["rdma/shared_ib"] == "1"
    assert env(pods["aks-infiniband"])["NCCL_IB_PCI_RELAXED_ORDERING"] == "1"
    for fabric in ("infiniband", "roce", "aks-infiniband", "efa"):
        assert pods[fabric].spec.containers[0].security_context.capabilities.add == ["IPC_LOCK"], fabric
    efa = pods["efa"]
    # The API server writes quantities canonically (5120Mi reads back as 5Gi).
    assert {k: parse_quantity(limits(efa)[k]) for k in ("vpc.amazonaws.com/efa", "hugepages-2Mi", "memory")} == {
        "vpc.amazonaws.com/efa": 32, "hugepages-2Mi": 5120 * 2**20, "memory": 32000 * 2**20}
    assert efa.spec.node_selector["node.kubernetes.io/instance-type"] == "p5.48xlarge"
    assert env(efa)["FI_PROVIDER"] == "efa"
    for fabric, nics in (("tcpx", 4), ("tcpxo", 8)):
        pod = pods[fabric]
        (sidecar,) = pod.spec.init_containers
        assert (sidecar.name, sidecar.restart_policy) == (f"{fabric}-daemon", "Always"), fabric
        interfaces = json.loads(pod.metadata.annotations["networking.gke.io/interfaces"])
        assert len(interfaces) == nics + 1 and pod.metadata.annotations["networking.gke.io/default-interface"] == \
            "eth0"
        assert f"devices.gke.io/container.{fabric}-daemon" in pod.metadata.annotations
        assert {v.host_path.path for v in pod.spec.volumes if v.host_path} >= {
            "/home/kubernetes/bin/nvidia/lib64", "/sys", "/proc/sys"}
        assert env(pod)["LD_LIBRARY_PATH"] == "/usr/local/nvidia/lib64"


def test_a_worker_asking_for_more_devices_than_a_node_has_is_unschedulable_and_says_so(
        admin_api: client.ApiClient, namespace: str, fabric_node: str, operator: OperatorProcess) -> None:
    """A pool whose nodes lack the devices (here: 64 EFA where the node has 32): the job waits, naming
    the resource, instead of running over TCP."""
    jobs = TrainingJobs(admin_api, namespace, operator)
    jobs.submit(kwok_job("no-efa", {"fabric": "efa", "resources": {"extra": {"vpc.amazonaws.com/efa": "64"}},
                                    "scheduling": {"nodeSelector": {NODE_LABEL: fabric_node}}}))
    st = jobs.wait_status("no-efa", lambda s: any(c["type"] == "WorkersBlocked" and c["status"] == "True"
                                                  for c in s.get("conditions", [])), 90, what="WorkersBlocked")
    blocked = next(c for c in st["conditions"] if c["type"] == "WorkersBlocked")
    assert blocked["reason"] == "Unschedulable" and "vpc.amazonaws.com/efa" in blocked["message"], blocked


def test_the_api_server_refuses_fabric_options_that_cannot_apply_naming_the_field(
        admin_api: client.ApiClient, namespace: str, crd: None) -> None:
    jobs = TrainingJobs(admin_api, namespace)
    with pytest.raises(ApiException) as refused:
        jobs.submit(kwok_job("bad-nics", {"fabric": "tcpxo", "fabricOptions": {"gpuNetworks": ["a", "b", "c", "d"]}}))
    assert refused.value.status == 422
    assert "spec.fabricOptions.gpuNetworks" in refused.value.body and "8 for tcpxo" in refused.value.body
    with pytest.raises(ApiException) as orphan:
        jobs.submit(kwok_job("bad-orphan", {"fabricOptions": {"gidIndex": 1}}))
    assert "spec.fabricOptions" in orphan.value.body and "needs a fabric" in orphan.value.body


def test_a_runtime_gives_its_jobs_a_locked_image_and_fabric_and_refuses_overrides(
        admin_api: client.ApiClient, namespace: str, fabric_node: str, operator: OperatorProcess,
        cluster_runtimes: Callable[[str, dict[str, Any]], str]) -> None:
    """An admin's ClusterTrainingRuntime locks the image and the TCPX fabric with its daemon image: a tenant's job
    that references it runs with them; one that sets the image otherwise fails naming the field; a tenant's own
    daemon image is refused by the API server, and a tenant's own TCPX (host /sys, a root daemon) by the operator,
    whose podPolicy allows no hostPath."""
    image, daemon = "registry.example/ml/trainer:2.1", "registry.example/gke/tcpgpudmarxd:v2.0.12"
    runtime = cluster_runtimes("gpu-tcpx", {
        "image": image, "fabric": "tcpx", "fabricOptions": {"daemonImage": daemon},
        "scheduling": {"nodeSelector": {NODE_LABEL: fabric_node}}, "resources": {"gpusPerWorker": 1},
        "locked": ["image", "fabric", "fabricOptions"]})
    jobs = TrainingJobs(admin_api, namespace, operator)
    ref = {"kind": "ClusterTrainingRuntime", "name": runtime}
    jobs.submit(kwok_job("rt-ok", {"runtimeRef": ref, "workers": 1}))
    jobs.submit(kwok_job("rt-image", {"runtimeRef": ref, "workers": 1, "image": "registry.example/mine:1"}))
    jobs.submit(kwok_job("rt-own-tcpx", {"workers": 1, "fabric": "tcpx",
                                         "scheduling": {"nodeSelector": {NODE_LABEL: fabric_node}}}))
    with pytest.raises(ApiException) as daemon_refused:
        jobs.submit(kwok_job("rt-daemon", {"runtimeRef": ref, "fabricOptions": {"daemonImage": "evil.example/d:1"}}))

    pod = scheduled_pod(jobs, "rt-ok")
    assert pod.spec.containers[0].image == image
    assert [(c.name, c.image) for c in pod.spec.init_containers] == [("tcpx-daemon", daemon)]
    recorded = jobs.wait_status("rt-ok", lambda s: s.get("runtime"), 60, what="status.runtime")["runtime"]
    assert (recorded["kind"], recorded["name"], recorded["spec"]["image"]) == ("ClusterTrainingRuntime", runtime, image)
    failed = jobs.wait_status("rt-image", lambda s: s.get("phase") == "Failed", 60, what="rt-image Failed")
    assert failed["reason"] == "InvalidSpec" and \
        f'spec.image: locked by ClusterTrainingRuntime {runtime} to "{image}"' in failed["message"], failed
    own = jobs.wait_status("rt-own-tcpx", lambda s: s.get("phase") == "Failed", 60, what="rt-own-tcpx Failed")
    assert "spec.fabric: tcpx mounts" in own["message"] and "podPolicy.allowHostPath" in own["message"], own
    assert not jobs.pods("rt-image") and not jobs.pods("rt-own-tcpx")
    assert daemon_refused.value.status == 422 and "spec.fabricOptions.daemonImage" in daemon_refused.value.body
    print(f"runtime {runtime}: pod image {pod.spec.containers[0].image}, daemon {pod.spec.init_containers[0].image}; "
          f"override: {failed['message']}; own tcpx: {own['message'][:90]}...; daemonImage: 422")
