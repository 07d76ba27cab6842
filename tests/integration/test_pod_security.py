"""Pod Security Admission on the real API server: the operator's default worker pods are admitted in
a namespace that enforces `restricted` and reach Running on kwok nodes; a pod without the operator's
securityContext is refused there (so these tests can fail); each fabric profile is admitted exactly at
the level builders.FabricProfile.pod_security names.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from support import helm_tool as ht
from support import lanes
from support.cluster import kubeconfig_path
from support.jobs import TrainingJobs
from support.kwok import KWOK_NAMESPACE_ANNOTATIONS, kwok_job
from support.operator_process import OperatorProcess
from support.resources import not_found_ok, wait_default_service_account
from support.waiting import wait_for

from kubetrain.core.api import TrainingJob
from kubetrain.operator.jobs import builders as b

pytestmark = pytest.mark.integration

ENFORCE = "pod-security.kubernetes.io/enforce"
ABSENT_CLASS = "kubetrain-test-absent"
"""A StorageClass no cluster has: the default claim stays Pending, its pods are still created (and judged)."""

NamespaceFactory = Callable[[str], str]


@pytest.fixture(scope="module")
def operator(crd: None, kube_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    with OperatorProcess(kubeconfig_path(), tmp_path_factory.mktemp("operator") / "operator.log") as op:
        yield op


@pytest.fixture
def psa_namespace(core_v1: client.CoreV1Api) -> Iterator[NamespaceFactory]:
    """``psa_namespace(level)``: a fresh namespace that enforces that Pod Security level from its creation
    (no label patch racing the admission plugin's namespace cache), its pods routed to kwok; deleted after."""
    created: list[str] = []

    def make(level: str) -> str:
        name = lanes.namespace(f"psa-{level}-{uuid.uuid4().hex[:6]}")
        core_v1.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(
            name=name, labels={"kubetrain.io/test": "true", ENFORCE: level}, annotations=KWOK_NAMESPACE_ANNOTATIONS)))
        created.append(name)
        wait_default_service_account(core_v1, name)
        return name

    yield make
    for name in created:
        with not_found_ok():
            core_v1.delete_namespace(name)


def worker_pod(namespace: str, name: str, **spec: Any) -> dict[str, Any]:
    """Worker 0 of a kwok job as the operator would create it."""
    job = TrainingJob.model_validate(kwok_job(name, {"workers": 2, **spec}, namespace))
    pod = b.worker_pod(job, 0, 0, b.WorkerSettings(trainer_image="kubetrain/trainer:test"))
    pod["spec"].pop("serviceAccountName")  # the operator creates the job's own with the job: none in a dry run
    return pod


def admission(core: client.CoreV1Api, namespace: str, pod: dict[str, Any]) -> str | None:
    """None when the API server admits the pod (a dry run: nothing is stored), else its refusal."""
    try:
        core.create_namespaced_pod(namespace, pod, dry_run="All")
    except ApiException as exc:
        assert exc.status == 403, exc.body
        return str(exc.body)
    return None


def test_default_workers_are_admitted_under_restricted_and_run(
        admin_api: client.ApiClient, psa_namespace: NamespaceFactory, operator: OperatorProcess) -> None:
    jobs = TrainingJobs(admin_api, psa_namespace("restricted"), operator)
    jobs.submit(kwok_job("plain", {"workers": 2}))  # every default but kwok's ephemeral checkpoints
    durable = {"ephemeral": False, "storageClassName": ABSENT_CLASS, "storageSize": "1Gi"}
    jobs.submit(kwok_job("durable", {"workers": 2, "checkpoint": durable}))
    st = jobs.wait_status("plain", lambda s: s.get("phase") == "Running" and s.get("workersReady") == 2, 90,
                          what="plain Running")
    assert st["workersSummary"] == "2/2"
    for pod in jobs.pods("plain"):
        assert pod.status.phase == "Running"
        assert pod.spec.security_context.run_as_non_root and pod.spec.security_context.seccomp_profile.type == \
            "RuntimeDefault"
        assert pod.spec.containers[0].security_context.capabilities.drop == ["ALL"]
    rbac = client.RbacAuthorizationV1Api(admin_api)
    assert rbac.read_namespaced_role(b.progress_rbac_name("plain"), jobs.ns).rules[0].resource_names == \
        ["plain-worker-0"]
    # The claim's fsGroup is allowed too: admitted (created), waiting for a claim no class will bind.
    pods = wait_for(lambda: len(p := jobs.pods("durable")) == 2 and p, 60, what="durable pods admitted")
    assert all(p.spec.security_context.fs_group == b.TRAINER_GID for p in pods)


def test_a_pod_without_the_operators_security_context_is_refused(
        admin_api: client.ApiClient, core_v1: client.CoreV1Api, psa_namespace: NamespaceFactory,
        operator: OperatorProcess) -> None:
    ns = psa_namespace("restricted")
    assert admission(core_v1, ns, worker_pod(ns, "default")) is None
    bare = {"spec": {"securityContext": {}, "containers": [{"name": "trainer", "securityContext": {}}]}}
    refusal = admission(core_v1, ns, worker_pod(ns, "bare", podTemplate=bare))
    assert refusal is not None and 'violates PodSecurity \\"restricted:latest\\"' in refusal, refusal
    for missing in ("allowPrivilegeEscalation != false", "unrestricted capabilities", "runAsNonRoot != true",
                    "seccompProfile"):
        assert missing in refusal, (missing, refusal)
    # The operator's own create of such a pod meets the same refusal: no pod is created.
    jobs = TrainingJobs(admin_api, ns, operator)
    jobs.submit(kwok_job("bare", {"workers": 2, "podTemplate": {"spec": {"securityContext": {}}}}))
    wait_for(lambda: [line for line in operator.log().splitlines()
                      if "bare-worker-0" in line and "violates PodSecurity" in line], 60,
             what="the operator's pod create refused")
    assert not jobs.pods("bare")


def test_each_fabric_is_admitted_at_the_level_its_profile_names(
        core_v1: client.CoreV1Api, psa_namespace: NamespaceFactory) -> None:
    namespaces = {level: psa_namespace(level) for level in b.POD_SECURITY_LEVELS}
    seen = {}
    for fabric, profile in b.FABRICS.items():
        for level, ns in namespaces.items():
            admitted = admission(core_v1, ns, worker_pod(ns, f"f-{fabric}", fabric=fabric)) is None
            seen[fabric, level] = admitted
            needed = b.POD_SECURITY_LEVELS.index(profile.pod_security)
            assert admitted == (b.POD_SECURITY_LEVELS.index(level) >= needed), (fabric, level, seen)
    assert not seen["infiniband", "baseline"] and seen["infiniband", "privileged"] and seen["none", "restricted"]


def test_the_operators_own_pod_is_admitted_under_restricted(
        core_v1: client.CoreV1Api, psa_namespace: NamespaceFactory, helm_ok: None) -> None:
    """The chart's Deployment, as the pod its ReplicaSet would create (PSA enforces on pods only)."""
    template = ht.find(ht.render(), "Deployment")["spec"]["template"]
    template["spec"].pop("serviceAccountName")  # the release's ServiceAccount is not in this namespace
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "operator", **template["metadata"]},
           "spec": template["spec"]}
    ns = psa_namespace("restricted")
    assert admission(core_v1, ns, pod) is None
    pod["spec"]["securityContext"] = pod["spec"]["containers"][0]["securityContext"] = {}
    assert 'violates PodSecurity \\"restricted:latest\\"' in (admission(core_v1, ns, pod) or "")
