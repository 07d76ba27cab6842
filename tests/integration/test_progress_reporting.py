"""Rank 0's progress reaches the job's status through the real API server, under real RBAC.

The operator runs under the chart's own RBAC (a TokenRequest login, as in test_rbac_chart.py), so
the API server's escalation check on the per-job Role `<job>-progress` is the real one. Worker
pods are kwok pods: no kubelet runs them, so the test plays worker 0's container. It runs the
real trainer (and, for custom scripts, the real helper) as local processes with exactly what a
pod would have: KUBETRAIN_POD_NAME/NAMESPACE, the API server's address and CA, and a TokenRequest
token of the job's own ServiceAccount (`<job>-worker`). The status must show what they
report, and the same token must be refused everything but get/patch of <job>-worker-0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from support.helm_rbac import ChartIdentity, assert_no_forbidden
from support.identities import bearer_client, token_for
from support.jobs import StatusCheck, TrainingJobs
from support.kubectl import kubectl
from support.kwok import kwok_job
from support.operator_process import OperatorProcess
from support.resources import wait_gone
from support.trainer_harness import Gang, tiny_spec
from support.waiting import wait_for

from kubetrain.core import api, contract
from kubetrain.core.progress import Progress
from kubetrain.trainer.observe import progress as pp

pytestmark = pytest.mark.integration


class Job:
    """The test's one kwok TrainingJob, run by ``op``."""

    def __init__(self, admin: client.ApiClient, ns: str, name: str, op: OperatorProcess):
        self.jobs = TrainingJobs(admin, ns, op)
        self.custom, self.core, self.ns, self.name = self.jobs.custom, self.jobs.core, ns, name

    def create(self, **spec: Any) -> None:
        self.jobs.submit(kwok_job(self.name, {"workers": 2, "resources": {"gpusPerWorker": 1}, **spec}))

    def status(self) -> dict[str, Any]:
        return self.jobs.status(self.name)

    def wait(self, pred: StatusCheck, timeout: float = 60, what: str = "") -> dict[str, Any]:
        return self.jobs.wait_status(self.name, pred, timeout, what)

    def wait_running(self) -> dict[str, Any]:
        return self.wait(lambda s: s.get("phase") == "Running" and s.get("workersReady") == 2, 90, "Running")


def pod_env(admin: client.ApiClient, ns: str, pod: str, tmp: Path, sa: str | None = None) -> dict[str, str]:
    """What a worker container has: its pod's identity, the API server, the ServiceAccount token (of the job's
    own ServiceAccount `<job>-worker`, unless `sa` names another) and CA."""
    sa = sa or pod.rsplit("-", 1)[0]  # <job>-worker-<i> runs as <job>-worker
    token = tmp / f"token-{sa}"
    token.write_text(token_for(admin, ns, sa))
    cfg = admin.configuration
    assert cfg.host.startswith("https://") and cfg.ssl_ca_cert, "the test API server is HTTPS with its own CA"
    return {contract.POD_NAME: pod, contract.POD_NAMESPACE: ns, pp.API_SERVER_ENV: cfg.host,
            pp.TOKEN_FILE_ENV: str(token), pp.CA_FILE_ENV: str(cfg.ssl_ca_cert)}


def worker0_sa(core: client.CoreV1Api, ns: str, pod: str) -> str:
    return str(core.read_namespaced_pod(pod, ns).spec.service_account_name)


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m kubetrain.trainer.observe.progress` as a custom script would run it in the pod."""
    return subprocess.run([sys.executable, "-m", "kubetrain.trainer.observe.progress", *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **env})


def test_trainer_progress_reaches_status_and_rbac_is_exact(
    helm_ok: None, kube_cluster: Any, admin_api: client.ApiClient, namespace: str, tmp_path: Path
) -> None:
    rbac = client.RbacAuthorizationV1Api(admin_api)
    with ChartIdentity(admin_api, namespace, tmp_path) as ident, \
            OperatorProcess(ident.kubeconfig, tmp_path / "operator.log") as op:
        job = Job(admin_api, namespace, "prog", op)
        job.create(maxSteps=6)
        job.wait_running()
        # The per-job RBAC, created by the operator under the chart's RBAC (escalation check passed).
        role = rbac.read_namespaced_role("prog-progress", namespace)
        assert [(r.resources, r.resource_names, r.verbs) for r in role.rules] == [(["pods"], ["prog-worker-0"], ["get", "patch"])]
        binding = rbac.read_namespaced_role_binding("prog-progress", namespace)
        assert [(s.kind, s.name, s.namespace) for s in binding.subjects] == [("ServiceAccount", "prog-worker", namespace)]
        assert worker0_sa(job.core, namespace, "prog-worker-0") == "prog-worker"
        uid = job.custom.get_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, "prog")["metadata"]["uid"]
        assert role.metadata.owner_references[0].uid == uid == binding.metadata.owner_references[0].uid
        worker0 = job.core.read_namespaced_pod("prog-worker-0", namespace)
        env = worker0.spec.containers[0].env
        env_from = {e.name: e.value_from.field_ref.field_path for e in env if e.value_from and e.value_from.field_ref}
        assert env_from == {contract.POD_NAME: "metadata.name", contract.POD_NAMESPACE: "metadata.namespace",
                            contract.NODE_NAME: "spec.nodeName"}
        limits = {e.name: e.value_from.resource_field_ref.resource for e in env
                  if e.value_from and e.value_from.resource_field_ref}
        assert limits == {contract.MEMORY_LIMIT: "limits.memory"}  # the pod's memory budget (checkpoint/budget.py)
        assert not job.status().get("currentStep")

        # Worker 0's container: the real trainer, 6 steps, a checkpoint every 3 steps.
        env = pod_env(admin_api, namespace, "prog-worker-0", tmp_path)
        run = Gang(tmp_path / "train", tiny_spec(maxSteps=6, checkpoint={"everySteps": 3}), world_size=1,
                   env={**env, contract.JOB: "prog"}).wait()
        assert run.exit_codes == [0], run.log()
        assert "reporting progress as the kubetrain.io/progress annotation on pod" in run.log()
        assert "could not annotate" not in run.log(), run.log()
        st = job.wait(lambda s: s.get("currentStep") == 6 and (s.get("lastCheckpoint") or {}).get("step") == 6,
                      30, "currentStep 6, lastCheckpoint 6")
        assert st["loss"] == f"{run.progress['loss']:.4f}" and st["lastProgressTime"]
        assert st["lastCheckpoint"]["path"] == run.progress["lastCheckpoint"]["path"]
        assert st["phase"] == "Running" and not st.get("restartCount")
        assert (st["percentComplete"], st["eta"]) == ("100%", "0.0s") and st["tokensPerSecond"] > 0
        header, row = kubectl("get", "tj", "prog", "-n", namespace).stdout.splitlines()[:2]
        print(f"kubectl get tj:\n{header}\n{row}")
        assert header.split()[:8] == ["NAME", "PHASE", "WORKERS", "STEP", "DONE", "ETA", "LOSS", "RESTARTS"]
        assert row.split()[3:7] == ["6", "100%", "0.0s", st["loss"]]
        raw = job.core.read_namespaced_pod("prog-worker-0", namespace).metadata.annotations[contract.PROGRESS_ANNOTATION]
        assert Progress.model_validate_json(raw) == Progress.model_validate(run.progress), "the progress.json record"

        # The same token may touch nothing else: not worker 1, not a delete, not a list, not Secrets.
        worker1 = cli({**env, contract.POD_NAME: "prog-worker-1"}, "--step", "99")
        assert worker1.returncode == 1 and "HTTP 403" in worker1.stderr, worker1.stderr
        assert "prog-worker-1" in worker1.stderr
        assert job.status()["currentStep"] == 6
        as_worker = client.CoreV1Api(bearer_client(admin_api, Path(env[pp.TOKEN_FILE_ENV]).read_text()))
        as_worker.read_namespaced_pod("prog-worker-0", namespace)  # allowed
        refused = {
            "patch worker-1": lambda: as_worker.patch_namespaced_pod("prog-worker-1", namespace, {"metadata": {"labels": {"x": "y"}}}),
            "get worker-1": lambda: as_worker.read_namespaced_pod("prog-worker-1", namespace),
            "delete worker-0": lambda: as_worker.delete_namespaced_pod("prog-worker-0", namespace),
            "list pods": lambda: as_worker.list_namespaced_pod(namespace),
            "list secrets": lambda: as_worker.list_namespaced_secret(namespace),
        }
        for what, call in refused.items():
            with pytest.raises(ApiException) as err:
                call()
            assert err.value.status == 403, what
        assert "x" not in (job.core.read_namespaced_pod("prog-worker-1", namespace).metadata.labels or {})
        # Another job's workers (their own ServiceAccount) and any other pod of the namespace (`default`) are
        # refused this job's worker 0.
        for other in ("other-worker", "default"):
            if other != "default":
                client.CoreV1Api(admin_api).create_namespaced_service_account(namespace, {"metadata": {"name": other}})
            stranger = client.CoreV1Api(bearer_client(admin_api, token_for(admin_api, namespace, other)))
            with pytest.raises(ApiException) as err:
                stranger.patch_namespaced_pod("prog-worker-0", namespace, {"metadata": {"annotations": {
                    contract.PROGRESS_ANNOTATION: '{"step": 999}'}}})
            assert err.value.status == 403, other

        # Deleting the job garbage-collects its Role and RoleBinding with the rest.
        job.custom.delete_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, "prog")
        wait_gone(lambda: rbac.read_namespaced_role("prog-progress", namespace), 60, what="Role GC")
        wait_gone(lambda: rbac.read_namespaced_role_binding("prog-progress", namespace), 60, what="RoleBinding GC")
    assert_no_forbidden(op)
    # Scoped to this test's namespace: the operator watches all of them, and another test's may be terminating.
    assert not [line for line in op.log().splitlines() if "ProgressReportingForbidden" in line and namespace in line]


def test_custom_script_progress_holds_off_hang_detection_until_it_stops(
    helm_ok: None, kube_cluster: Any, admin_api: client.ApiClient, namespace: str, tmp_path: Path
) -> None:
    """progressDeadlineSeconds with real reports: no restart while rank 0 reports (throttled, every
    second here), a NoProgress gang restart once it stops. Before, no pod ever reported: a job with
    a deadline was restarted every deadline, forever."""
    deadline, steps = 6, 14
    script = (
        "import sys, time\n"
        "from kubetrain.trainer.observe.progress import report_progress\n"
        f"for step in range(1, {steps} + 1):\n"
        f"    report_progress(step, loss=10.0 / step, max_steps={steps}, checkpoint_step=step if step % 5 == 0 else None,"
        " checkpoint_path=f'/checkpoints/step-{step:08d}')\n"
        "    time.sleep(1.0)\n"
    )
    with ChartIdentity(admin_api, namespace, tmp_path) as ident, \
            OperatorProcess(ident.kubeconfig, tmp_path / "operator.log") as op:
        job = Job(admin_api, namespace, "script", op)
        job.create(command=["python", "train.py"], maxSteps=steps,
                   restartPolicy={"progressDeadlineSeconds": deadline, "backoffSeconds": 0})
        job.wait_running()
        env = {**pod_env(admin_api, namespace, "script-worker-0", tmp_path), contract.RANK: "0",
               pp.INTERVAL_ENV: "1", contract.JOB: "script"}
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                              env={**os.environ, **env})
        took = time.monotonic() - t0
        assert proc.returncode == 0 and "could not annotate" not in proc.stderr, proc.stderr
        assert took > 2 * deadline, "the reports must span more than the deadline to prove anything"
        st = job.status()  # a restart is written at once, progress alone at most every 30 s
        assert not st.get("restartCount"), f"restarted while rank 0 reported: {st}\n{op.tail()}"
        assert st["lastCheckpoint"]["step"] == 10 and st["lastCheckpoint"]["path"] == "/checkpoints/step-00000010"
        # Rank 0 went quiet: a hang, after the deadline.
        st = job.wait(lambda s: s.get("restartCount", 0) >= 1, 60, "NoProgress restart")
        assert st["failures"] == {"NoProgress": 1} and st["currentStep"] == steps, json.dumps(st)
    assert_no_forbidden(op)


def test_refused_progress_rbac_is_a_condition_not_a_hang_restart(
    helm_ok: None, admin_api: client.ApiClient, namespace: str, tmp_path: Path, crd: None,
) -> None:
    ident = ChartIdentity(admin_api, namespace, tmp_path)
    for doc in ident.rbac:  # the chart's RBAC without roles/rolebindings: the progress Role is refused
        if doc["kind"] == "ClusterRole":
            doc["rules"] = [r for r in doc["rules"] if not {"roles", "rolebindings"} & set(r.get("resources", []))]
    with ident, OperatorProcess(ident.kubeconfig, tmp_path / "operator.log") as op:
        jobs = TrainingJobs(admin_api, namespace, op)
        jobs.submit(kwok_job("blind", {"workers": 2, "restartPolicy": {"progressDeadlineSeconds": 3, "backoffSeconds": 0}}))
        jobs.wait_status("blind", lambda s: s.get("phase") == "Running", 90, what="blind Running")
        st = jobs.wait_status("blind", lambda s: any(c["type"] == "ProgressUnknown" and c["status"] == "True"
                                                     for c in s.get("conditions") or []), 30, what="ProgressUnknown")
        cond = next(c for c in st["conditions"] if c["type"] == "ProgressUnknown")
        assert cond["reason"] == "ProgressReportingForbidden", cond
        time.sleep(8)  # more than twice the deadline: a gang that cannot report is not taken for hung
        assert jobs.status("blind").get("restartCount", 0) == 0, jobs.status("blind")
        wait_for(lambda: any(e.reason == "ProgressReportingForbidden" for e in jobs.events("blind")), 10,
                 what="ProgressReportingForbidden Event")
