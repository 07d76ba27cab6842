"""Acceptance 1 (cluster part): `helm install` of charts/kubetrain into the real control plane creates
the CRD, RBAC, Service and Deployment (the operator image is not pullable here, so the Deployment is
asserted as an object, not as ready), and `helm uninstall` removes them again."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from kubernetes import client
from support import helm_tool as ht
from support.cluster import kubeconfig_path
from support.resources import wait_gone
from support.waiting import wait_for

# Alone (support/lanes.py): the chart's cluster-wide roles and admission policies.
pytestmark = [pytest.mark.integration, pytest.mark.whole_cluster]


def _helm(*args: str) -> str:
    return ht.helm(*args, "--kubeconfig", str(kubeconfig_path())).stdout


@pytest.mark.parametrize("values", [{}, {"operator.replicas": 2, "rbac.scope": "namespaced"}],
                         ids=["defaults", "replicas2-namespaced"])
def test_helm_install_creates_crd_rbac_deployment(
    helm_ok: None, kube_cluster: Any, admin_api: client.ApiClient, namespace: str, values: dict[str, Any]
) -> None:
    release = f"kt{uuid.uuid4().hex[:6]}"
    lease = f"kubetrain-{release}"
    sets = [a for k, v in {**values, "leaderElection.leaseName": lease}.items()
            for a in ("--set-json", f'{k}={v!r}'.replace("'", '"'))]
    out = _helm("install", release, str(ht.CHART), "--namespace", namespace, *sets)
    assert "STATUS: deployed" in out
    try:
        full = f"{release}-kubetrain"
        ext = client.ApiextensionsV1Api(admin_api)
        rbac = client.RbacAuthorizationV1Api(admin_api)
        core = client.CoreV1Api(admin_api)
        crd = ext.read_custom_resource_definition("trainingjobs.kubetrain.io")
        assert crd.spec.names.short_names == ["tj", "tjob"]
        role = rbac.read_cluster_role(full)
        assert all("secrets" not in (r.resources or []) for r in role.rules)
        assert rbac.read_cluster_role("kubetrain-edit").metadata.labels[
            "rbac.authorization.k8s.io/aggregate-to-edit"] == "true"  # the roles for people
        binding = rbac.read_cluster_role_binding(full)
        assert binding.subjects[0].name == full and binding.subjects[0].namespace == namespace
        assert core.read_namespaced_service_account(full, namespace)
        svc = core.read_namespaced_service(f"{full}-metrics", namespace)
        assert svc.spec.ports[0].name == "metrics"
        dep = client.AppsV1Api(admin_api).read_namespaced_deployment(full, namespace)
        assert dep.spec.replicas == values.get("operator.replicas", 1)
        c = dep.spec.template.spec.containers[0]
        assert c.security_context.read_only_root_filesystem and c.security_context.capabilities.drop == ["ALL"]
        assert dep.spec.template.spec.security_context.run_as_non_root
        # The ReplicaSet controller made the operator pod(s) from the Deployment.
        wait_for(lambda: len(core.list_namespaced_pod(namespace, label_selector=f"app.kubernetes.io/instance={release}").items)
                 == dep.spec.replicas, 60, what="operator pods created")
        if values.get("rbac.scope") == "namespaced":
            assert rbac.read_namespaced_role(full, namespace).rules
            assert f"--namespace={namespace}" in c.args
        if values.get("operator.replicas", 1) > 1:
            assert {"--leader-elect", f"--leader-elect-lease={lease}", f"--leader-elect-namespace={namespace}"} <= set(c.args)
            role = rbac.read_namespaced_role(f"{full}-leader-election", namespace)
            assert [r.resource_names for r in role.rules] == [None, [lease]]
        status = _helm("status", release, "--namespace", namespace)
        assert "STATUS: deployed" in status
    finally:
        _helm("uninstall", release, "--namespace", namespace, "--wait", "--timeout", "60s")
    wait_gone(lambda: client.RbacAuthorizationV1Api(admin_api).read_cluster_role(f"{release}-kubetrain"),
              30, what="ClusterRole removed by helm uninstall")
    # CRDs from crds/ are never deleted by helm (and jobs of other releases keep working).
    client.ApiextensionsV1Api(admin_api).read_custom_resource_definition("trainingjobs.kubetrain.io")
