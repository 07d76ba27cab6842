"""The chart's ValidatingAdmissionPolicies on the real API server: a TrainingJob whose podTemplate asks for
the host (privileged, hostPath, nodeName, another ServiceAccount, a capability nobody allowed) is refused
at create, naming the field and the chart value; with that value set, the same job is accepted. And a
job's workers, who may patch worker 0 to report progress, may change nothing else of it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from support import helm_tool as ht
from support.helm_rbac import ChartIdentity
from support.identities import bearer_client, token_for
from support.jobs import TrainingJobs
from support.kwok import kwok_job
from support.operator_process import OperatorProcess
from support.resources import apply
from support.waiting import wait_for

from kubetrain.core import contract
from kubetrain.core.api import GROUP, PLURAL, VERSION

# Alone (support/lanes.py): admission policies over every namespace's TrainingJobs.
pytestmark = [pytest.mark.integration, pytest.mark.whole_cluster]

HOSTILE = {
    "privileged": ({"containers": [{"name": "trainer", "securityContext": {"privileged": True}}]},
                   "spec.podTemplate.spec: a privileged container gets the whole node", "allowPrivileged"),
    "hostpath": ({"volumes": [{"name": "root", "hostPath": {"path": "/"}}]},
                 "spec.podTemplate.spec.volumes: hostPath mounts a directory of the node", "allowHostPath"),
    "nodename": ({"nodeName": "kwok-gpu-0"}, "spec.podTemplate.spec.nodeName: would bypass the scheduler", None),
    "foreign-sa": ({"serviceAccountName": "cluster-admin-sa"},
                   "spec.podTemplate.spec.serviceAccountName: runs the workers with another ServiceAccount",
                   "allowServiceAccount"),
}


def policy_docs(queues_in: tuple[str, ...] = (), **allow: bool) -> list[dict[str, Any]]:
    docs = ht.render(set_values={"queues.requiredIn": list(queues_in), **{f"podPolicy.{k}": v for k, v in allow.items()}})
    return [d for d in docs if d["kind"].startswith("ValidatingAdmissionPolicy")]


@pytest.fixture
def installed(admin_api: client.ApiClient, crd: None) -> Iterator[client.AdmissionregistrationV1Api]:
    ht.require_helm()
    adm = client.AdmissionregistrationV1Api(admin_api)
    yield adm
    for d in policy_docs():
        name = d["metadata"]["name"]
        if d["kind"] == "ValidatingAdmissionPolicy":
            adm.delete_validating_admission_policy(name)
        else:
            adm.delete_validating_admission_policy_binding(name)


def job(name: str, pod_spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingJob", "metadata": {"name": name},
            "spec": {"podTemplate": {"spec": pod_spec}}}


def refusal(custom: client.CustomObjectsApi, ns: str, body: dict[str, Any]) -> str | None:
    """The API server's message when it refuses the create (dry run: nothing is stored), else None."""
    try:
        custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body, dry_run="All")
    except ApiException as exc:
        assert exc.status in (403, 422), exc.body
        return str(exc.body)
    return None


def test_the_api_server_refuses_a_podtemplate_that_asks_for_the_host_unless_the_chart_allows_it(
    admin_api: client.ApiClient, namespace: str, installed: client.AdmissionregistrationV1Api,
) -> None:
    custom = client.CustomObjectsApi(admin_api)
    for d in policy_docs():
        apply(admin_api, d)
    # The API server compiles a new policy asynchronously: wait until it refuses the first case.
    first = job("privileged", HOSTILE["privileged"][0])
    wait_for(lambda: refusal(custom, namespace, first), 30, what="the admission policy in force")
    for name, (pod_spec, message, _) in HOSTILE.items():
        said = refusal(custom, namespace, job(name, pod_spec))
        assert said is not None and message in said, (name, said)
    assert refusal(custom, namespace, job("plain", {"containers": [{"name": "trainer", "env": [{"name": "A", "value": "1"}]}]})) is None

    for d in policy_docs(allowPrivileged=True, allowHostPath=True, allowServiceAccount=True):
        apply(admin_api, d)
    hostpath = job("hostpath", HOSTILE["hostpath"][0])
    wait_for(lambda: refusal(custom, namespace, hostpath) is None, 30, what="the relaxed policy in force")
    for name, (pod_spec, _, setting) in HOSTILE.items():
        said = refusal(custom, namespace, job(name, pod_spec))
        assert (said is None) == (setting is not None), (name, said)  # nodeName stays kubetrain's own


def test_a_namespace_that_requires_a_queue_refuses_a_job_without_one(
    admin_api: client.ApiClient, namespace: str, installed: client.AdmissionregistrationV1Api,
) -> None:
    custom = client.CustomObjectsApi(admin_api)
    for d in policy_docs(queues_in=(namespace,)):
        apply(admin_api, d)
    unqueued = job("unqueued", {})
    said = wait_for(lambda: refusal(custom, namespace, unqueued), 30, what="the queue requirement in force")
    assert f"spec.scheduling.queue: required in namespace {namespace} (chart value queues.requiredIn)" in said
    queued = job("queued", {}) | {"spec": {"scheduling": {"queue": "team-a"}}}
    assert refusal(custom, namespace, queued) is None


def with_caps(name: str, caps: list[str], fabric: str = "none") -> dict[str, Any]:
    body = job(name, {"containers": [{"name": "trainer", "securityContext": {"capabilities": {"add": caps}}}]})
    return body | {"spec": body["spec"] | {"fabric": fabric}}


def test_added_capabilities_are_judged_as_the_operator_judges_them(
    admin_api: client.ApiClient, namespace: str, installed: client.AdmissionregistrationV1Api,
) -> None:
    custom = client.CustomObjectsApi(admin_api)
    for d in policy_docs(allowedCapabilities=["SYS_PTRACE"]):
        apply(admin_api, d)
    admin_only = with_caps("admin", ["CAP_SYS_ADMIN", "CHOWN"])
    said = wait_for(lambda: refusal(custom, namespace, admin_only), 30, what="the capability check in force")
    assert "spec.podTemplate.spec: trainer adds CAP_SYS_ADMIN, beyond Pod Security baseline and the fabric's" in said
    assert "(chart value podPolicy.allowedCapabilities)" in said
    assert "IPC_LOCK" in str(refusal(custom, namespace, with_caps("ipc", ["IPC_LOCK"])))
    for fine in (with_caps("rdma", ["IPC_LOCK"], "infiniband"), with_caps("tcpx", ["NET_ADMIN"], "tcpx"),
                 with_caps("ptrace", ["SYS_PTRACE", "NET_BIND_SERVICE"])):
        assert refusal(custom, namespace, fine) is None, fine["metadata"]["name"]


def test_a_jobs_workers_may_patch_worker_0s_progress_and_nothing_else(
    helm_ok: None, admin_api: client.ApiClient, namespace: str, tmp_path: Path,
    installed: client.AdmissionregistrationV1Api,
) -> None:
    for d in policy_docs():
        apply(admin_api, d)
    with ChartIdentity(admin_api, namespace, tmp_path) as ident, \
            OperatorProcess(ident.kubeconfig, tmp_path / "operator.log") as op:
        jobs = TrainingJobs(admin_api, namespace, op)
        jobs.submit(kwok_job("guarded", {"workers": 1}))
        jobs.wait_status("guarded", lambda s: s.get("phase") == "Running", 60, what="guarded Running")
        worker = client.CoreV1Api(bearer_client(admin_api, token_for(admin_api, namespace, "guarded-worker")))
        pod = "guarded-worker-0"

        def patch(body: dict[str, Any]) -> str | None:
            try:
                worker.patch_namespaced_pod(pod, namespace, body)
            except ApiException as exc:
                assert exc.status in (403, 422), exc.body
                return str(exc.body)
            return None

        # The API server compiles a new policy asynchronously: wait until it refuses a label.
        said = wait_for(lambda: patch({"metadata": {"labels": {"team": "x"}}}), 30, what="the worker policy in force")
        assert "pod guarded-worker-0: guarded-worker (the job's workers) may change only its annotation " \
               "kubetrain.io/progress, not its labels: team" in said, said
        progress = '{"step": 3}'
        assert patch({"metadata": {"annotations": {contract.PROGRESS_ANNOTATION: progress}}}) is None
        image = client.CoreV1Api(admin_api).read_namespaced_pod(pod, namespace).spec.containers[0].image
        said = patch({"spec": {"containers": [{"name": "trainer", "image": "evil:latest"}]}})
        assert said is not None and "not its spec (an image)" in said, said
        said = patch({"metadata": {"labels": {contract.LABEL_JOB: "other"}, "annotations": {"x": "y"}}})
        assert said is not None and "not its labels: kubetrain.io/job-name" in said, said
        said = patch({"metadata": {"annotations": {"x": "y"}}})
        assert said is not None and "not its other annotations: x" in said, said
        now = client.CoreV1Api(admin_api).read_namespaced_pod(pod, namespace)
        assert (now.spec.containers[0].image, now.metadata.annotations[contract.PROGRESS_ANNOTATION]) == (image, progress)
        assert now.metadata.labels[contract.LABEL_JOB] == "guarded" and "team" not in now.metadata.labels
