"""The chart's RBAC applied to the real API server for one release, as a login of its own
(TokenRequest token): shared by test_rbac_chart.py and test_helm_image.py."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import helm_tool as ht
import pytest
from k8s_cluster import bearer_client, kubeconfig_path, kwok_job, wait_for
from kubernetes import client, dynamic
from kubernetes.client.rest import ApiException

from kubetrain.core import api

RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")


def apply(admin: client.ApiClient, body: dict[str, Any]) -> None:
    dyn = dynamic.DynamicClient(admin)
    res = dyn.resources.get(api_version=body["apiVersion"], kind=body["kind"])
    res.server_side_apply(body=body, name=body["metadata"]["name"], namespace=body["metadata"].get("namespace"),
                          field_manager="kubetrain-tests", force_conflicts=True)


def delete(admin: client.ApiClient, body: dict[str, Any]) -> None:
    dyn = dynamic.DynamicClient(admin)
    res = dyn.resources.get(api_version=body["apiVersion"], kind=body["kind"])
    try:
        res.delete(name=body["metadata"]["name"], namespace=body["metadata"].get("namespace"))
    except ApiException as exc:
        if exc.status != 404:
            raise


def crds_established(admin: client.ApiClient, docs: list[dict[str, Any]]) -> None:
    ext = client.ApiextensionsV1Api(admin)
    for crd in (d for d in docs if d["kind"] == "CustomResourceDefinition"):
        apply(admin, crd)

        def established(name: str = crd["metadata"]["name"]) -> bool:
            return any(c.type == "Established" and c.status == "True"
                       for c in ext.read_custom_resource_definition(name).status.conditions or [])

        wait_for(established, 30, what=f"CRD {crd['metadata']['name']} Established")


def token_for(admin: client.ApiClient, namespace: str, sa: str) -> str:
    req = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600))
    return client.CoreV1Api(admin).create_namespaced_service_account_token(sa, namespace, req).status.token


class ChartIdentity:
    """The chart's RBAC objects, applied for one release in ``namespace``; removed on exit."""

    def __init__(self, admin: client.ApiClient, namespace: str, tmp: Path, **values: Any):
        self.admin, self.ns = admin, namespace
        self.docs = ht.render(set_values={"fullnameOverride": f"kt-{namespace}"[:50], **values}, namespace=namespace)
        self.rbac = [d for d in self.docs if d["kind"] in RBAC_KINDS]
        self.sa = ht.find(self.docs, "ServiceAccount")["metadata"]["name"]
        self.tmp = tmp

    def __enter__(self) -> ChartIdentity:
        crds_established(self.admin, self.docs)
        for d in self.rbac:
            apply(self.admin, d)
        token = token_for(self.admin, self.ns, self.sa)
        self.kubeconfig = ht.token_kubeconfig(kubeconfig_path(), token, self.tmp / "sa.kubeconfig")
        self.api = bearer_client(self.admin, token)
        return self

    def __exit__(self, *_: object) -> None:
        for d in reversed(self.rbac):
            if d["kind"] in ("ClusterRole", "ClusterRoleBinding"):
                delete(self.admin, d)


def run_job_to_running(admin: client.ApiClient, ns: str, op: ht.OperatorProcess, name: str = "rbac") -> dict[str, Any]:
    custom = client.CustomObjectsApi(admin)
    custom.create_namespaced_custom_object(api.GROUP, api.VERSION, ns, api.PLURAL, kwok_job(
        name, {"workers": 2, "resources": {"gpusPerWorker": 8}, "restartPolicy": {"backoffSeconds": 0}}))

    def running() -> dict[str, Any] | None:
        st = custom.get_namespaced_custom_object(api.GROUP, api.VERSION, ns, api.PLURAL, name).get("status") or {}
        return st if st.get("phase") == "Running" else None

    try:
        return wait_for(running, 90, what=f"TrainingJob {ns}/{name} Running")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\noperator log:\n{op.tail()}") from exc


def assert_no_forbidden(op: ht.OperatorProcess) -> None:
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
