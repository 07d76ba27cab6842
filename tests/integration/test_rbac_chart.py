"""Acceptance 2: the operator runs under the chart's own RBAC, and that RBAC is minimal.

The chart's ClusterRole/Role are rendered with helm, applied to the real API server and bound to a
ServiceAccount; the operator process then runs with a kubeconfig holding only that ServiceAccount's
TokenRequest token. A TrainingJob must reach Running on the kwok GPU nodes (RBAC sufficient, no
403 anywhere in the operator's log), and the same identity is refused Secrets (RBAC minimal).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_tool as ht
import pytest
from helm_rbac import ChartIdentity, assert_no_forbidden, assert_secrets_refused, run_job_to_running
from kubernetes import client
from kubernetes.client.rest import ApiException

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def helm_ok() -> None:
    try:
        ht.helm_binary()
    except ht.HelmUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture()
def tmp(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path


def test_cluster_scope_rbac_runs_a_job_and_refuses_secrets(
    helm_ok: None, kube_cluster: Any, admin_api: client.ApiClient, namespace: str, tmp: Path
) -> None:
    with ChartIdentity(admin_api, namespace, tmp) as ident:
        # The identity is exactly the chart's: it may list pods everywhere but not read Secrets.
        client.CoreV1Api(ident.api).list_pod_for_all_namespaces(limit=1)
        assert_secrets_refused(ident)
        with ht.OperatorProcess(ident.kubeconfig, tmp / "operator.log") as op:
            status = run_job_to_running(admin_api, namespace, op)
            assert status["workersSummary"] == "2/2"
            pods = client.CoreV1Api(admin_api).list_namespaced_pod(namespace, label_selector="kubetrain.io/job-name=rbac")
            assert len(pods.items) == 2 and all(p.status.phase == "Running" for p in pods.items)
            events = client.CoreV1Api(admin_api).list_namespaced_event(namespace).items
            assert any(e.source and e.source.component == "kubetrain-operator" for e in events)
        assert_no_forbidden(op)


def test_namespaced_scope_rbac_runs_a_job(
    helm_ok: None, kube_cluster: Any, admin_api: client.ApiClient, namespace: str, tmp: Path
) -> None:
    with ChartIdentity(admin_api, namespace, tmp, **{"rbac.scope": "namespaced"}) as ident:
        assert_secrets_refused(ident)
        with pytest.raises(ApiException) as err:  # no pods outside its namespace
            client.CoreV1Api(ident.api).list_pod_for_all_namespaces(limit=1)
        assert err.value.status == 403
        with ht.OperatorProcess(ident.kubeconfig, tmp / "operator.log", f"--namespace={namespace}") as op:
            run_job_to_running(admin_api, namespace, op, "rbac-ns")
        assert_no_forbidden(op)
