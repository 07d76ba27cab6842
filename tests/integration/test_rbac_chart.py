"""Acceptance 2: the operator runs under the chart's own RBAC, and that RBAC is minimal.

The chart's ClusterRole/Role are rendered with helm, applied to the real API server and bound to a
ServiceAccount; the operator process then runs with a kubeconfig holding only that ServiceAccount's
TokenRequest token. A TrainingJob must reach Running on the kwok GPU nodes (RBAC sufficient, no
403 anywhere in the operator's log), and the same identity is refused Secrets (RBAC minimal).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_tool as ht
import pytest
from helm_rbac import ChartIdentity, assert_no_forbidden, assert_secrets_refused, run_job_to_running
from k8s_cluster import wait_for
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


# kopf's peering is not leader election: instances of EQUAL priority all pause ("Pausing all
# operators, including self"); only the highest priority runs. This wrapper pins the priorities;
# `python -m kubetrain.operator` picks a random one per process (or --priority).
PRIORITY_WRAPPER = (
    "import asyncio, sys, kopf; from kubetrain.operator import handlers; "
    "asyncio.run(kopf.operator(clusterwide=True, standalone=False, peering_name=sys.argv[1], "
    "priority=int(sys.argv[2]), liveness_endpoint=sys.argv[3]))"
)


def _peers(admin: client.ApiClient, peering: str) -> int:
    obj = client.CustomObjectsApi(admin).get_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", peering)
    return len(obj.get("status") or {})


def test_kopf_peering_under_chart_rbac_one_active_replica(
    helm_ok: None, kube_cluster: Any, admin_api: client.ApiClient, namespace: str, tmp: Path
) -> None:
    """operator.replicas=2 RBAC: two instances (distinct priorities) keep the chart's ClusterKopfPeering
    alive, the higher one runs the job to Running, and nothing is refused."""
    peering = f"kt-{namespace}"[:50]
    with ChartIdentity(admin_api, namespace, tmp, **{"operator.replicas": 2, "peering.name": peering}) as ident:
        def op(log: str, priority: int) -> ht.OperatorProcess:
            return ht.OperatorProcess(ident.kubeconfig, tmp / log, command=[
                sys.executable, "-c", PRIORITY_WRAPPER, peering, str(priority), f"http://127.0.0.1:{ht.free_port()}/healthz"])

        with op("active.log", 200) as active, op("standby.log", 100) as standby:
            wait_for(lambda: _peers(admin_api, peering) == 2, 60, what="both operators in the peering object")
            run_job_to_running(admin_api, namespace, active, "peered")
        for log in (active.log(), standby.log()):  # kopf warns on equal priorities and then pauses everyone
            assert "Pausing all operators" not in log and "same priority" not in log
        assert_no_forbidden(active)
        assert_no_forbidden(standby)


def test_two_chart_replicas_one_active_and_failover(
    helm_ok: None, kube_cluster: Any, admin_api: client.ApiClient, namespace: str, tmp: Path
) -> None:
    """What the chart's Deployment does with replicas=2: the same command twice with --peering. Each
    picks its own random priority, so exactly one pauses; when the active one exits, the standby
    resumes and runs the next job."""
    peering = f"kt-{namespace}"[:50]
    with ChartIdentity(admin_api, namespace, tmp, **{"operator.replicas": 2, "peering.name": peering}) as ident, \
            ht.OperatorProcess(ident.kubeconfig, tmp / "a.log", f"--peering={peering}") as a, \
            ht.OperatorProcess(ident.kubeconfig, tmp / "b.log", f"--peering={peering}") as b:
        wait_for(lambda: _peers(admin_api, peering) == 2, 60, what="both operators in the peering object")
        paused = "Pausing operations in favour of"
        wait_for(lambda: (paused in a.log()) != (paused in b.log()), 60, what="exactly one operator paused")
        active, standby = (b, a) if paused in a.log() else (a, b)
        run_job_to_running(admin_api, namespace, active, "first")
        assert "same priority" not in active.log() + standby.log()

        active.__exit__(None, None, None)  # SIGTERM: kopf removes its peering record on the way out
        wait_for(lambda: "Resuming operations" in standby.log(), 60, what="the standby resumed")
        run_job_to_running(admin_api, namespace, standby, "second")
        assert_no_forbidden(standby)
