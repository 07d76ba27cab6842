"""The chart's RBAC applied to the real API server for one release, as a login of its own
(TokenRequest token): shared by test_rbac_chart.py, test_helm_image.py and test_progress_reporting.py."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from . import helm_tool as ht
from .cluster import kubeconfig_path
from .identities import bearer_client, token_for, token_kubeconfig
from .jobs import TrainingJobs
from .kwok import kwok_job
from .operator_process import OperatorProcess
from .resources import apply, apply_crds, delete

RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")


class ChartIdentity:
    """The chart's RBAC objects, applied for one release in ``namespace``; removed on exit."""

    def __init__(self, admin: client.ApiClient, namespace: str, tmp: Path, **values: Any):
        self.admin, self.ns = admin, namespace
        self.docs = ht.render(set_values={"fullnameOverride": f"kt-{namespace}"[:50], "rbac.userRoles": False, **values},
                              namespace=namespace)  # the operator's identity; the roles for people are one per cluster
        self.rbac = [d for d in self.docs if d["kind"] in RBAC_KINDS]
        self.sa = ht.find(self.docs, "ServiceAccount")["metadata"]["name"]
        self.tmp = tmp

    def __enter__(self) -> ChartIdentity:
        apply_crds(self.admin, self.docs)
        for d in self.rbac:
            apply(self.admin, d)
        token = token_for(self.admin, self.ns, self.sa)
        self.kubeconfig = token_kubeconfig(kubeconfig_path(), token, self.tmp / "sa.kubeconfig")
        self.api = bearer_client(self.admin, token)
        return self

    def __exit__(self, *_: object) -> None:
        for d in reversed(self.rbac):
            if d["kind"] in ("ClusterRole", "ClusterRoleBinding"):
                delete(self.admin, d)


def run_job_to_running(admin: client.ApiClient, ns: str, op: OperatorProcess, name: str = "rbac") -> dict[str, Any]:
    jobs = TrainingJobs(admin, ns, op)
    spec = {"workers": 2, "resources": {"gpusPerWorker": 8}, "restartPolicy": {"backoffSeconds": 0}}
    jobs.submit(kwok_job(name, spec))
    return jobs.wait_status(name, lambda st: st.get("phase") == "Running", 90, f"TrainingJob {ns}/{name} Running")


def assert_no_forbidden(op: OperatorProcess) -> None:
    log = op.log()
    # RBAC refusals read 'User "system:serviceaccount:..." cannot <verb> resource ...', or for a Role the
    # operator may not grant (escalation check) 'user "system:serviceaccount:..." ... is attempting to grant
    # RBAC permissions not currently held'; other 403s (e.g. NamespaceTerminating in a namespace another
    # test is deleting) are not about RBAC.
    refusal = r'User \\?"system:serviceaccount:[^"]*\\?" cannot |attempting to grant RBAC permissions not currently held'
    bad = [line for line in log.splitlines() if re.search(refusal, line)]
    assert not bad, "the operator hit RBAC refusals:\n" + "\n".join(bad[:20])


def assert_secrets_refused(identity: ChartIdentity) -> None:
    core = client.CoreV1Api(identity.api)
    for call in (lambda: core.list_namespaced_secret(identity.ns), lambda: core.list_secret_for_all_namespaces(),
                 lambda: core.read_namespaced_secret("anything", identity.ns)):
        with pytest.raises(ApiException) as err:
            call()
        assert err.value.status == 403, err.value
