"""Acceptance 2: the operator runs under the chart's own RBAC, and that RBAC is minimal.

The chart's ClusterRole/Role are rendered with helm, applied to the real API server and bound to a
ServiceAccount; the operator process then runs with a kubeconfig holding only that ServiceAccount's
TokenRequest token. A TrainingJob must reach Running on the kwok GPU nodes (RBAC sufficient, no
403 anywhere in the operator's log), and the same identity is refused Secrets (RBAC minimal).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from support import helm_tool as ht
from support.cluster import component_stopped
from support.helm_rbac import ChartIdentity, assert_no_forbidden, assert_secrets_refused, run_job_to_running
from support.jobs import TrainingJobs
from support.kwok import kwok_job
from support.operator_process import OperatorProcess
from support.ports import free_port
from support.resources import apply, delete
from support.waiting import wait_for

from kubetrain.operator.runtime.settings import LeaderElection

pytestmark = pytest.mark.integration


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
        with OperatorProcess(ident.kubeconfig, tmp / "operator.log") as op:
            status = run_job_to_running(admin_api, namespace, op)
            assert status["workersSummary"] == "2/2"
            pods = client.CoreV1Api(admin_api).list_namespaced_pod(namespace, label_selector="kubetrain.io/job-name=rbac")
            assert len(pods.items) == 2 and all(p.status.phase == "Running" for p in pods.items)
            events = client.CoreV1Api(admin_api).list_namespaced_event(namespace).items
            assert any(e.source and e.source.component == "kubetrain-operator" for e in events)
        assert_no_forbidden(op)


def test_namespaced_scope_rbac_runs_jobs_in_each_watched_namespace(
    helm_ok: None, kube_cluster: Any, admin_api: client.ApiClient, namespace: str, other_namespace: str, tmp: Path
) -> None:
    watched = [namespace, other_namespace]
    values = {"rbac.scope": "namespaced", "rbac.watchNamespaces": watched}
    with ChartIdentity(admin_api, namespace, tmp, **values) as ident:
        assert_secrets_refused(ident)
        with pytest.raises(ApiException) as err:  # no pods outside its namespaces
            client.CoreV1Api(ident.api).list_pod_for_all_namespaces(limit=1)
        assert err.value.status == 403
        args = next(c["args"] for c in ht.find(ident.docs, "Deployment")["spec"]["template"]["spec"]["containers"]
                    if c["name"] == "operator")
        assert f"--namespace={namespace},{other_namespace}" in args  # the chart's own flag, as the operator runs
        with OperatorProcess(ident.kubeconfig, tmp / "operator.log", f"--namespace={namespace},{other_namespace}") as op:
            for ns in watched:
                run_job_to_running(admin_api, ns, op, "rbac-ns")
        assert_no_forbidden(op)


def _holder(admin: client.ApiClient, ns: str, lease: str) -> str:
    try:
        return client.CoordinationV1Api(admin).read_namespaced_lease(lease, ns).spec.holder_identity or ""
    except ApiException as exc:
        if exc.status == 404:
            return ""
        raise


def _worker_uids(admin: client.ApiClient, ns: str, job: str) -> set[str]:
    return {p.metadata.uid for p in TrainingJobs(admin, ns).pods(job)}


def _job_status(admin: client.ApiClient, ns: str, job: str) -> dict[str, Any]:
    return TrainingJobs(admin, ns).status(job)


WON = "acquired the leader lease"


def _leader_of(a: OperatorProcess, b: OperatorProcess) -> tuple[OperatorProcess, OperatorProcess]:
    """(leader, standby) once one of the two replicas has taken the Lease."""
    wait_for(lambda: WON in a.log() or WON in b.log(), 60, what="a leader")
    return (a, b) if WON in a.log() else (b, a)


def _two_replicas(admin: client.ApiClient, namespace: str, tmp: Path) -> tuple[str, ChartIdentity, tuple[str, ...]]:
    """The chart with operator.replicas=2: its Lease, its identity (not yet applied) and the operator
    flags its Deployment passes."""
    lease = f"kt-{namespace}"[:50]
    chart = ChartIdentity(admin, namespace, tmp, **{"operator.replicas": 2, "leaderElection.leaseName": lease})
    return lease, chart, ("--leader-elect", f"--leader-elect-lease={lease}", f"--leader-elect-namespace={namespace}")


def test_two_replicas_one_leader_and_failover(
    helm_ok: None, kube_cluster: Any, admin_api: client.ApiClient, namespace: str, tmp: Path
) -> None:
    """What the chart's Deployment runs with replicas=2, under its RBAC (Lease Role included): one
    replica holds the Lease and reconciles, the other only watches; when the leader is SIGKILLed
    (no release), the standby takes the Lease after it expires and carries on with the same gang."""
    lease, chart, args = _two_replicas(admin_api, namespace, tmp)
    with chart as ident:
        with OperatorProcess(ident.kubeconfig, tmp / "a.log", *args) as a, \
                OperatorProcess(ident.kubeconfig, tmp / "b.log", *args) as b:
            leader, standby = _leader_of(a, b)
            holder = _holder(admin_api, namespace, lease)
            assert holder and f"as {holder}" in leader.log() and WON not in standby.log()
            run_job_to_running(admin_api, namespace, leader, "first")
            assert "first:" not in standby.log(), "the standby reconciled"
            uids = _worker_uids(admin_api, namespace, "first")

            assert leader.proc is not None
            leader.proc.kill()  # no clean release: the standby must wait for the Lease to expire
            leader.proc.wait(10)
            wait_for(lambda: _holder(admin_api, namespace, lease) not in ("", holder), 60, what="the standby leads")
            run_job_to_running(admin_api, namespace, standby, "second")
            # the new leader took the first job over as it was: no gang restart over a cache it had not filled
            assert _worker_uids(admin_api, namespace, "first") == uids, standby.tail()
            first = _job_status(admin_api, namespace, "first")
            assert first["phase"] == "Running" and not first.get("restartCount"), first
        assert_no_forbidden(leader)
        assert_no_forbidden(standby)


def test_leader_releases_the_lease_on_shutdown(
    helm_ok: None, kube_cluster: Any, admin_api: client.ApiClient, namespace: str, tmp: Path
) -> None:
    """A clean stop (SIGTERM: a rollout or a drain) hands the Lease over at once, not after it expires."""
    lease, chart, args = _two_replicas(admin_api, namespace, tmp)
    with chart as ident:
        with OperatorProcess(ident.kubeconfig, tmp / "a.log", *args) as a:
            wait_for(lambda: _holder(admin_api, namespace, lease), 60, what="a leader")
            with OperatorProcess(ident.kubeconfig, tmp / "b.log", *args) as b:
                wait_for(lambda: "leader election on lease" in b.log(), 30, what="the standby started")
                a.__exit__(None, None, None)
                assert "released the leader lease" in a.log(), a.tail()
                t0 = time.monotonic()
                wait_for(lambda: WON in b.log(), 30, what="the standby took over")
                took = time.monotonic() - t0
                run_job_to_running(admin_api, namespace, b, "after-handover")
        # well under the 15 s Lease: it was handed over, not left to expire
        assert took < 12, f"handover took {took:.1f}s: the Lease was not released"


def _may(admin: client.ApiClient, user: str, namespace: str, verb: str, resource: str = "trainingjobs") -> bool:
    review = client.V1SubjectAccessReview(spec=client.V1SubjectAccessReviewSpec(
        user=user, resource_attributes=client.V1ResourceAttributes(
            namespace=namespace, verb=verb, group="kubetrain.io", resource=resource)))
    return bool(client.AuthorizationV1Api(admin).create_subject_access_review(review).status.allowed)


def test_namespace_editors_run_training_jobs_and_viewers_read_them(
    helm_ok: None, kube_cluster: Any, admin_api: client.ApiClient, namespace: str
) -> None:
    """The chart's kubetrain-edit, kubetrain-runtime-admin and kubetrain-view, aggregated by the cluster's own
    controller into `edit`, `admin` and `view`: a person bound to one in a namespace gets exactly that over
    TrainingJobs there, and only the namespace's admins write its TrainingRuntimes."""
    names = ("kubetrain-edit", "kubetrain-runtime-admin", "kubetrain-view")
    roles = [d for d in ht.render() if d["kind"] == "ClusterRole" and d["metadata"]["name"] in names]
    assert sorted(r["metadata"]["name"] for r in roles) == list(names)
    rbac = client.RbacAuthorizationV1Api(admin_api)
    try:
        for role in roles:
            apply(admin_api, role)
        for who, cluster_role in (("alice", "edit"), ("bob", "view"), ("carol", "admin")):
            rbac.create_namespaced_role_binding(namespace, client.V1RoleBinding(
                metadata=client.V1ObjectMeta(name=f"{who}-{cluster_role}"),
                role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="ClusterRole", name=cluster_role),
                subjects=[client.RbacV1Subject(kind="User", name=who, api_group="rbac.authorization.k8s.io")]))
        wait_for(lambda: _may(admin_api, "alice", namespace, "create") and _may(admin_api, "bob", namespace, "list"),
                 60, what="kubetrain-edit and kubetrain-view aggregated into edit and view")
        assert _may(admin_api, "alice", namespace, "delete")
        assert not _may(admin_api, "bob", namespace, "create") and not _may(admin_api, "bob", namespace, "delete")
        assert not _may(admin_api, "alice", "default", "create")  # bound in one namespace only
        wait_for(lambda: _may(admin_api, "carol", namespace, "create", "trainingruntimes"), 60,
                 what="kubetrain-runtime-admin aggregated into admin")
        assert _may(admin_api, "alice", namespace, "get", "trainingruntimes")
        assert not _may(admin_api, "alice", namespace, "create", "trainingruntimes")
        assert _may(admin_api, "bob", namespace, "list", "trainingruntimes")
    finally:  # cluster-scoped: a later `helm install` of the chart must find no such ClusterRole it does not own
        for role in roles:
            delete(admin_api, role)


STALL_SECONDS = 45
"""Longer than the renew deadline (10 s) and the Lease (15 s): every replica loses what it held."""


@pytest.mark.whole_cluster  # every other test's API server stops too
def test_an_api_server_stall_restarts_no_job_and_no_replica(
    helm_ok: None, kube_cluster: Any, admin_api: client.ApiClient, namespace: str, tmp: Path
) -> None:
    """kube-apiserver frozen (SIGSTOP) for 45 s under two replicas with the chart's RBAC and a running job:
    afterwards both replicas still run, exactly one leads, the job kept its gang, and a job created after the
    stall gets its pods within 60 s."""
    lease, chart, args = _two_replicas(admin_api, namespace, tmp)
    with chart as ident:
        with OperatorProcess(ident.kubeconfig, tmp / "a.log", *args) as a, \
                OperatorProcess(ident.kubeconfig, tmp / "b.log", *args) as b:
            run_job_to_running(admin_api, namespace, _leader_of(a, b)[0], "before")
            uids = _worker_uids(admin_api, namespace, "before")
            with component_stopped("kube-apiserver"):
                time.sleep(STALL_SECONDS)
            wait_for(lambda: _holder(admin_api, namespace, lease), 60, what="a leader after the stall")
            jobs, t0 = TrainingJobs(admin_api, namespace), time.monotonic()
            jobs.submit(kwok_job("after", {"workers": 2, "resources": {"gpusPerWorker": 8}}))
            wait_for(lambda: len(jobs.pods("after")) == 2, 60, what="the pods of a job created after the stall")
            print(f"pods of the job created after the stall in {time.monotonic() - t0:.1f} s")
            assert a.proc is not None and b.proc is not None
            assert a.proc.poll() is None and b.proc.poll() is None, f"a replica exited:\n{a.tail()}\n{b.tail()}"
            holder = _holder(admin_api, namespace, lease)
            leaders = [op for op in (a, b) if f"as {holder}" in op.log()]
            assert len(leaders) == 1, holder
            standby = b if leaders[0] is a else a
            assert "after:" not in standby.log(), "the replica without the Lease reconciled"
            before = _job_status(admin_api, namespace, "before")
            assert before["phase"] == "Running" and not before.get("restartCount"), before
            assert _worker_uids(admin_api, namespace, "before") == uids  # the gang kept, not recreated
        assert_no_forbidden(a)
        assert_no_forbidden(b)


def _starving(name: str, namespace: str, sa: str) -> list[dict[str, Any]]:
    """API Priority and Fairness set to refuse (429) every request of the ServiceAccount `namespace/sa`: a
    priority level with no seats of its own and none to borrow, and a FlowSchema that puts the account there."""
    level = {"apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "PriorityLevelConfiguration",
             "metadata": {"name": name},
             "spec": {"type": "Limited", "limited": {"nominalConcurrencyShares": 0, "lendablePercent": 0,
                                                     "borrowingLimitPercent": 0,
                                                     "limitResponse": {"type": "Reject"}}}}
    everything = {"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"], "namespaces": ["*"], "clusterScope": True}
    schema = {"apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "FlowSchema", "metadata": {"name": name},
              "spec": {"priorityLevelConfiguration": {"name": name}, "matchingPrecedence": 100,
                       "distinguisherMethod": {"type": "ByUser"},
                       "rules": [{"subjects": [{"kind": "ServiceAccount",
                                                "serviceAccount": {"name": sa, "namespace": namespace}}],
                                  "resourceRules": [everything],
                                  "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["*"]}]}]}}
    return [level, schema]


def test_api_priority_and_fairness_refusals_are_waited_out(
    helm_ok: None, kube_cluster: Any, admin_api: client.ApiClient, namespace: str, tmp: Path
) -> None:
    """The operator's ServiceAccount put on a priority level of API Priority and Fairness with no seats of its
    own and none to borrow (the API server still runs one of its requests at a time, and refuses the others
    with 429) while four jobs are created: the operator waits each 429 out (Retry-After, then backoff), counts
    no failure and stays up; once the FlowSchema goes, every job runs."""
    names = [f"starved-{i}" for i in range(4)]
    with ChartIdentity(admin_api, namespace, tmp) as ident:
        starve = _starving(f"kt-starve-{namespace}"[:60], namespace, ident.sa)
        with OperatorProcess(ident.kubeconfig, tmp / "operator.log") as op:
            jobs = TrainingJobs(admin_api, namespace)
            try:
                for doc in starve:
                    apply(admin_api, doc)
                time.sleep(2)  # the API server's APF configuration follows its objects asynchronously
                for name in names:
                    jobs.submit(kwok_job(name, {"workers": 2}))  # no GPUs: four gangs fit the kwok nodes
                wait_for(lambda: "answered 429" in op.log(), 60, what="the operator refused with 429")
                assert op.proc is not None and op.proc.poll() is None, op.tail()
            finally:
                for doc in reversed(starve):
                    delete(admin_api, doc)
            for name in names:
                st = jobs.wait_status(name, lambda s: s.get("phase") == "Running", 90, f"{name} Running")
                assert not st.get("restartCount") and not st.get("failures"), st
            refusals = [line for line in op.log().splitlines() if "answered 429" in line]
            print(f"{len(refusals)} reconciles refused with 429 and retried")
            assert "Traceback" not in op.log(), op.tail()  # waited out, never a failed reconcile


RENEW_DEADLINE = LeaderElection.renew_deadline
"""The operator's default (the chart sets none): the last renewal came before the partition."""
PARTITIONED_UID = 64123
"""The uid the partitioned replica runs as: iptables drops exactly its packets (the owner match)."""


@contextmanager
def traffic_dropped(uid: int, port: int) -> Iterator[None]:
    """Every TCP packet a process of `uid` sends to `port` dropped, not refused: its connections go half-open
    (writes never acknowledged, reads never answered) until the rule goes."""
    rule = ["OUTPUT", "-m", "owner", "--uid-owner", str(uid), "-p", "tcp", "--dport", str(port), "-j", "DROP"]
    subprocess.run(["iptables", "-I", *rule], check=True)
    try:
        yield
    finally:
        subprocess.run(["iptables", "-D", *rule], check=True)


def _as_uid(uid: int, kubeconfig: Path, home: Path) -> list[str]:
    """The operator's command as `uid` (no groups) with a copy of `kubeconfig` it can read, in `home` (a
    directory outside pytest's own, which only root may enter)."""
    home.chmod(0o755)
    own = home / "kubeconfig"
    shutil.copyfile(kubeconfig, own)
    own.chmod(0o644)
    return ["env", f"USER=uid{uid}", f"HOME={home}", f"KUBECONFIG={own}",  # no passwd entry: kopf takes $USER
            "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable, "-m",
            "kubetrain.operator", "--liveness", f"http://127.0.0.1:{free_port()}/healthz"]


def test_a_leader_cut_off_mid_reconcile_stops_and_the_standby_takes_over(
    helm_ok: None, kube_cluster: Any, admin_api: client.ApiClient, namespace: str, tmp: Path
) -> None:
    """The leader's traffic to the API server dropped (half-open connections) just as a job arrives: it stops
    reconciling within the renew deadline, the standby takes over and runs the job, and neither the cut-off
    leader nor its healed connections delete or create a pod twice."""
    lease, chart, args = _two_replicas(admin_api, namespace, tmp)
    port = int(admin_api.configuration.host.rsplit(":", 1)[1])
    with chart as ident, tempfile.TemporaryDirectory(prefix="kubetrain-uid-") as home:
        cut = OperatorProcess(ident.kubeconfig, tmp / "cut.log", *args,
                              command=_as_uid(PARTITIONED_UID, ident.kubeconfig, Path(home)))
        with cut:
            wait_for(lambda: WON in cut.log(), 60, what="the first replica leads")
            with OperatorProcess(ident.kubeconfig, tmp / "standby.log", *args) as standby:
                wait_for(lambda: "leader election on lease" in standby.log(), 30, what="the standby started")
                jobs = TrainingJobs(admin_api, namespace)
                with traffic_dropped(PARTITIONED_UID, port):
                    jobs.submit(kwok_job("cut", {"workers": 2, "resources": {"gpusPerWorker": 8}}))
                    t0 = time.monotonic()
                    wait_for(lambda: "lost the leader lease" in cut.log(), 30, what="the cut-off leader stops")
                    stopped = time.monotonic() - t0
                    wait_for(lambda: WON in standby.log(), 60, what="the standby leads")
                    st = jobs.wait_status("cut", lambda s: s.get("phase") == "Running", 90, "cut Running")
                    uids = _worker_uids(admin_api, namespace, "cut")
                print(f"the cut-off leader stopped {stopped:.1f} s after the partition")
                assert stopped < RENEW_DEADLINE + 2, "stopped past the renew deadline"
                time.sleep(20)  # healed: whatever the old leader's connections still carried has arrived
                assert _worker_uids(admin_api, namespace, "cut") == uids and len(uids) == 2
                after = _job_status(admin_api, namespace, "cut")
                assert after["phase"] == "Running" and not st.get("restartCount") and not after.get("restartCount")
                assert cut.proc is not None and cut.proc.poll() is None, cut.tail()  # a standby again
                assert WON not in cut.log().split("lost the leader lease", 1)[1]
        assert_no_forbidden(standby)
