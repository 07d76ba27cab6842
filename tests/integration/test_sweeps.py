"""TrainingSweeps run by the operator (a real process) against the real control plane.

The kwok tests play each trial's rank 0: its progress record (the kubetrain.io/progress annotation on
worker 0, as workers report it) and the exit of its worker (kwok stages). They check what the sweep
controller does about it: trial jobs owned by the sweep, never more than `parallelism` at once, a
best trial in status and in `kubectl get trainingsweeps`, a pruned trial's job suspended (its pods
deleted, the job kept), no trial lost or duplicated across an operator crash, trial jobs
garbage-collected with their sweep, and labelled jobs it does not own left alone. The operator runs
under the chart's own RBAC where that matters (a TokenRequest login, as in test_rbac_chart.py).

The last test runs a small sweep whose trials really train: pods of the trainer image on the
cluster's real node, each Complete with the loss its rank 0 reported.
"""

from __future__ import annotations

import itertools
import math
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from support.cluster import kubeconfig_path
from support.conditions import condition
from support.helm_rbac import ChartIdentity, assert_no_forbidden
from support.kubectl import kubectl
from support.kwok import kwok_job, succeed_pod
from support.operator_process import OperatorProcess
from support.ports import free_port
from support.real_pods import TRAINER_IMAGE
from support.resources import wait_gone
from support.sweeps import MAX_STEPS, TrainingSweeps, finish_trial, kwok_sweep, report_progress, train_trial
from support.waiting import holds, wait_for

from kubetrain.core import api, contract

pytestmark = pytest.mark.integration

LOSSES = {0: 2.0, 1: 1.0, 2: 3.0, 3: 2.5}
"""The final loss each trial reports, by index: trial 1 is the best."""


def trial_names(status: dict[str, Any]) -> list[str]:
    return [t["jobName"] for t in status.get("trials") or []]


def states(status: dict[str, Any]) -> dict[str, str]:
    return {t["jobName"]: t["state"] for t in status.get("trials") or []}


def finished(job: dict[str, Any]) -> bool:
    return (job.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def unfinished_jobs(sweeps: TrainingSweeps, name: str) -> list[str]:
    """Trial jobs that hold (or will hold) pods."""
    return [j["metadata"]["name"] for j in sweeps.trial_jobs(name) if not j["spec"].get("suspend") and not finished(j)]


def run_to_the_end(sweeps: TrainingSweeps, name: str, parallelism: int, timeout: float = 90,
                   finished_already: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Finish every trial the sweep starts (trial i reports LOSSES[i]) until it is Succeeded; checks on
    the way that no more than ``parallelism`` trial jobs ever run at once. The trial jobs in
    ``finished_already`` the test finished itself: the sweep is left to record them."""
    deadline = time.monotonic() + timeout
    done: set[str] = set(finished_already)
    while (st := sweeps.status(name)).get("phase") != "Succeeded":
        assert st.get("phase") != "Failed" and time.monotonic() < deadline, sweeps.explain(name)
        running = unfinished_jobs(sweeps, name)
        assert len(running) <= parallelism, f"more than {parallelism} trials at once: {running}"
        todo = [t for t in st.get("trials") or [] if t["state"] in ("Pending", "Running") and t["jobName"] not in done]
        if not todo:
            time.sleep(0.2)
            continue
        trial = todo[0]
        finish_trial(sweeps.jobs, trial["jobName"], LOSSES[trial["index"]])
        done.add(trial["jobName"])
    return st


def owner_uids(job: dict[str, Any]) -> list[tuple[str, str, bool]]:
    return [(r["kind"], r["uid"], bool(r.get("controller"))) for r in job["metadata"].get("ownerReferences") or []]


@pytest.fixture
def operator(crd: None, kube_cluster: Any, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    """The operator as admin, watching the test's namespace only."""
    with OperatorProcess(kubeconfig_path(), tmp_path / "operator.log", f"--namespace={namespace}",
                         metrics_port=free_port()) as op:
        yield op


def test_sweep_runs_trials_as_owned_jobs_to_the_best_trial(
    helm_ok: None, kube_cluster: Any, admin_api: client.ApiClient, namespace: str, tmp_path: Path
) -> None:
    with ChartIdentity(admin_api, namespace, tmp_path) as ident, \
            OperatorProcess(ident.kubeconfig, tmp_path / "operator.log") as op:  # cluster-wide, as the chart runs it
        sweeps = TrainingSweeps(admin_api, namespace, op)
        uid = sweeps.submit(kwok_sweep("lr"))["metadata"]["uid"]
        st = sweeps.wait_status("lr", lambda s: len(s.get("trials") or []) == 2, 30, "two trials recorded")
        assert trial_names(st) == ["lr-0", "lr-1"] and st["phase"] == "Running"
        jobs = wait_for(lambda: len(j := sweeps.trial_jobs("lr")) == 2 and j, 30, what="two trial jobs")
        params = {t["jobName"]: t["params"]["optimizer.lr"] for t in st["trials"]}
        for job in jobs:
            meta = job["metadata"]
            assert owner_uids(job) == [(api.SWEEP_KIND, uid, True)], meta
            assert meta["labels"][contract.LABEL_TRIAL] == meta["name"].rsplit("-", 1)[1]
            assert job["spec"]["optimizer"]["lr"] == params[meta["name"]]
        assert params["lr-0"] != params["lr-1"]

        st = run_to_the_end(sweeps, "lr", parallelism=2)
        assert trial_names(st) == ["lr-0", "lr-1", "lr-2"] and set(states(st).values()) == {"Complete"}
        assert (st["bestTrial"], st["bestValue"], st["trialsSummary"]) == (1, LOSSES[1], "3/3")
        assert st["bestParams"] == {"optimizer.lr": params["lr-1"]} and st["completionTime"]
        assert st["observedGeneration"] == 1
        assert [j["metadata"]["name"] for j in sweeps.trial_jobs("lr")] == ["lr-0", "lr-1", "lr-2"]

        header, row = kubectl("get", "trainingsweeps", "-n", namespace).stdout.splitlines()[:2]
        assert header.split()[:6] == ["NAME", "PHASE", "TRIALS", "RUNNING", "PRUNED", "BEST"]
        assert row.split()[:6] == ["lr", "Succeeded", "3/3", "0", "0", "1"]
        assert kubectl("get", "sweep", "lr", "-n", namespace, "-o", "jsonpath={.status.bestTrial}").stdout == "1"
        reasons = wait_for(lambda: {e.reason for e in sweeps.events("lr")} >= {"TrialCompleted", "Completed"}
                           and {e.reason for e in sweeps.events("lr")}, 10, what="the sweep's Events")
        assert "CreateRejected" not in reasons and "ForeignObject" not in reasons
    assert_no_forbidden(op)


def test_operator_killed_mid_sweep_loses_and_duplicates_no_trial(
    admin_api: client.ApiClient, namespace: str, operator: OperatorProcess
) -> None:
    sweeps = TrainingSweeps(admin_api, namespace, operator)
    sweeps.submit(kwok_sweep("crash", maxTrials=4))
    sweeps.wait_status("crash", lambda s: len(s.get("trials") or []) == 2, 30, "two trials recorded")
    first_uids: dict[str, str] = {}

    def remember() -> None:
        for job in sweeps.trial_jobs("crash"):
            assert first_uids.setdefault(job["metadata"]["name"], job["metadata"]["uid"]) == job["metadata"]["uid"], \
                f"trial job {job['metadata']['name']} was created twice"

    finish_trial(sweeps.jobs, "crash-0", LOSSES[0])
    # The job's success starts the sweep's next step (record trial 2, create its job): kill the operator then.
    operator.kill()
    remember()
    # Trial 1's rank 0 reports its last loss and exits while no operator runs.
    report_progress(sweeps.core, namespace, "crash-1", MAX_STEPS, LOSSES[1])
    succeed_pod(sweeps.core, namespace, "crash-1-worker-0")
    wait_for(lambda: sweeps.core.read_namespaced_pod("crash-1-worker-0", namespace).status.phase == "Succeeded", 30,
             what="crash-1's worker Succeeded")
    operator.start()
    # Both finished by the test: the restarted operator may record trial 0 only after the first status read.
    st = run_to_the_end(sweeps, "crash", parallelism=2, finished_already=frozenset({"crash-0", "crash-1"}))
    remember()
    assert [t["index"] for t in st["trials"]] == [0, 1, 2, 3], "trial indices contiguous, none lost"
    assert trial_names(st) == [j["metadata"]["name"] for j in sweeps.trial_jobs("crash")], \
        "exactly one TrainingJob per recorded trial"
    assert set(states(st).values()) == {"Complete"} and st["bestTrial"] == 1


def test_pruned_trial_is_suspended_and_its_pods_deleted(
    helm_ok: None, kube_cluster: Any, admin_api: client.ApiClient, namespace: str, tmp_path: Path
) -> None:
    """Under the chart's namespaced RBAC (the suspend is a patch the Role must allow). The pruned trial's job
    stays; resumed by hand it is suspended again, unless it is first taken out of the sweep."""
    with ChartIdentity(admin_api, namespace, tmp_path, **{"rbac.scope": "namespaced"}) as ident, \
            OperatorProcess(ident.kubeconfig, tmp_path / "operator.log", f"--namespace={namespace}") as op:
        sweeps = TrainingSweeps(admin_api, namespace, op)
        sweeps.submit(kwok_sweep("prune", maxTrials=2, pruner={"type": "asha", "minSteps": 10}))
        sweeps.wait_status("prune", lambda s: len(s.get("trials") or []) == 2, 30, "two trials recorded")
        train_trial(sweeps.jobs, "prune-0", 10, 1.0)
        sweeps.wait_status("prune", lambda s: s["trials"][0].get("intermediate"), 30, "trial 0's loss at step 10")
        train_trial(sweeps.jobs, "prune-1", 10, 50.0)  # much worse at the same step
        st = sweeps.wait_status("prune", lambda s: states(s).get("prune-1") == "Pruned", 30, "prune-1 Pruned")
        assert "pruned at step 10" in st["trials"][1]["message"] and st["trialsPruned"] == 1
        job = sweeps.jobs.wait_status("prune-1", lambda s: s.get("phase") == "Suspended", 30, "prune-1 Suspended")
        assert job["phase"] == "Suspended" and sweeps.jobs.get("prune-1")["spec"]["suspend"] is True
        wait_for(lambda: not sweeps.jobs.pods("prune-1"), 30, what="the pruned trial's pods deleted")
        assert sweeps.jobs.get("prune-1"), "the pruned trial's job stays (to inspect or resume)"
        wait_for(lambda: "TrialPruned" in {e.reason for e in sweeps.events("prune")}, 10, what="TrialPruned Event")

        finish_trial(sweeps.jobs, "prune-0", 0.8)
        st = sweeps.wait_status("prune", lambda s: s.get("phase") == "Succeeded", 30, "Succeeded")
        assert (st["bestTrial"], st["bestValue"], st["trialsSummary"]) == (0, 0.8, "2/2")
        assert sweeps.jobs.status("prune-1")["phase"] == "Suspended"

        # Resumed by hand, the pruned trial is stopped again by its (finished) sweep...
        sweeps.jobs.patch_spec("prune-1", {"suspend": False})
        wait_for(lambda: sweeps.jobs.get("prune-1")["spec"]["suspend"] is True, 30, what="prune-1 suspended again")
        # ...unless it is taken out of the sweep first (its label removed): then it runs on.
        resume = {"metadata": {"labels": {contract.LABEL_SWEEP: None}}, "spec": {"suspend": False}}
        sweeps.custom.patch_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL, "prune-1", resume)
        sweeps.jobs.wait_status("prune-1", lambda s: s.get("phase") == "Running", 30, "prune-1 resumed")
        holds(lambda: sweeps.jobs.get("prune-1")["spec"]["suspend"] is False, 3, what="prune-1 left running")
        assert sweeps.status("prune") == st, "the finished sweep's status did not change"
    assert_no_forbidden(op)


def sweep_series(op: OperatorProcess, namespace: str, sweep: str) -> list[str]:
    """The operator's kubetrain_operator_sweep_* samples of one sweep, as /metrics serves them."""
    with urllib.request.urlopen(f"http://127.0.0.1:{op.metrics_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return [line for line in text.splitlines() if line.startswith("kubetrain_operator_sweep_")
            and f'namespace="{namespace}"' in line and f'sweep="{sweep}"' in line]


def test_deleting_a_sweep_deletes_its_trials_but_not_jobs_it_does_not_own(
    admin_api: client.ApiClient, namespace: str, operator: OperatorProcess
) -> None:
    sweeps = TrainingSweeps(admin_api, namespace, operator)
    stray = kwok_job("stray", {"workers": 1})
    stray["metadata"]["labels"] = {contract.LABEL_SWEEP: "gc"}  # claims to be a trial of the sweep
    sweeps.jobs.submit(stray)
    sweeps.submit(kwok_sweep("gc"))
    wait_for(lambda: {"gc-0", "gc-1"} <= {j["metadata"]["name"] for j in sweeps.trial_jobs("gc")}, 60,
             what="two trial jobs")
    warning = wait_for(lambda: [e for e in sweeps.events("gc") if e.reason == "ForeignObject"], 15,
                       what="ForeignObject Warning")[0]
    assert warning.type == "Warning" and "stray" in warning.message
    assert trial_names(sweeps.status("gc")) == ["gc-0", "gc-1"], "the stray job is not counted as a trial"
    series = wait_for(lambda: len(sweep_series(operator, namespace, "gc")) == len(api.TrialState) and
                      sweep_series(operator, namespace, "gc"), 15, what="the sweep's metrics")
    assert all(line.startswith("kubetrain_operator_sweep_trials{") for line in series), "no best value yet"
    wait_for(lambda: all(p.status.phase == "Running" for p in sweeps.jobs.pods("gc-0")) and sweeps.jobs.pods("gc-0"),
             30, what="gc-0's pods Running")

    sweeps.delete("gc")
    for job in ("gc-0", "gc-1"):
        wait_gone(lambda job=job: sweeps.jobs.get(job), 30, what=f"{job} garbage-collected")
    wait_for(lambda: not sweeps.jobs.pods("gc-0"), 30, what="gc-0's pods garbage-collected")
    wait_for(lambda: not sweep_series(operator, namespace, "gc"), 15, what="the sweep's metrics removed")
    assert sweeps.jobs.get("stray")["metadata"].get("deletionTimestamp") is None, "not the sweep's: it stays"


def test_a_refused_trial_job_is_one_warning_and_is_created_once_allowed(
    admin_api: client.ApiClient, namespace: str, operator: OperatorProcess
) -> None:
    sweeps = TrainingSweeps(admin_api, namespace, operator)
    counted = "count/trainingjobs.kubetrain.io"
    quota = client.V1ResourceQuota(metadata=client.V1ObjectMeta(name="one-job"),
                                   spec=client.V1ResourceQuotaSpec(hard={counted: "1"}))
    sweeps.core.create_namespaced_resource_quota(namespace, quota)
    # Until the quota controller has computed its usage, admission refuses every create ("status unknown"). On a
    # fresh cluster it first discovers the CRD's resource (its 30 s discovery period) and then recounts a quota only
    # when its spec.hard changes or at its 5-minute resync: a growing ConfigMap limit changes hard meanwhile.
    pokes = itertools.count(1000)

    def computed() -> bool:
        st = sweeps.core.read_namespaced_resource_quota("one-job", namespace).status
        if counted in (st.used or {}):
            return True
        sweeps.core.patch_namespaced_resource_quota(
            "one-job", namespace, {"spec": {"hard": {"count/configmaps": str(next(pokes))}}})
        return False
    wait_for(computed, 120, interval=5, what="the quota's usage computed")
    sweeps.submit(kwok_sweep("quota", maxTrials=2))
    [warning] = wait_for(lambda: [e for e in sweeps.events("quota") if e.reason == "CreateRejected"], 15,
                         what="CreateRejected Warning")
    assert warning.type == "Warning" and "exceeded quota" in warning.message, warning.message
    assert len(sweeps.trial_jobs("quota")) == 1
    assert [t["state"] for t in sweeps.status("quota")["trials"]].count("Pending") >= 1, "the refused one waits"
    blocked = wait_for(lambda: condition(sweeps.status("quota"), api.TRIALS_BLOCKED), 30, what="TrialsBlocked")
    assert blocked["status"] == "True" and blocked["reason"] == "CreateRejected" and "exceeded quota" in blocked["message"]

    sweeps.core.patch_namespaced_resource_quota("one-job", namespace, {"spec": {"hard": {counted: "5"}}})
    wait_for(lambda: len(sweeps.trial_jobs("quota")) == 2, 90, what="the refused trial's job created after all")
    wait_for(lambda: (condition(sweeps.status("quota"), api.TRIALS_BLOCKED) or {}).get("status") == "False", 30,
             what="TrialsBlocked False once the job was created")
    # Retried with backoff until the quota allowed it: one Event, not one per retry.
    assert [e.reason for e in sweeps.events("quota")].count("CreateRejected") == 1
    st = run_to_the_end(sweeps, "quota", parallelism=2)
    assert trial_names(st) == ["quota-0", "quota-1"] and set(states(st).values()) == {"Complete"}


def test_only_the_leader_steps_sweeps_and_its_successor_carries_on(
    helm_ok: None, kube_cluster: Any, admin_api: client.ApiClient, namespace: str, tmp_path: Path
) -> None:
    """Two replicas with leader election (the chart's replicas=2 flags and Lease Role): the standby keeps
    its caches warm but never writes a sweep; once the leader stops, the new one finishes the sweep."""
    lease = f"kt-{namespace}"[:50]
    args = ("--leader-elect", f"--leader-elect-lease={lease}", f"--leader-elect-namespace={namespace}")
    chart = ChartIdentity(admin_api, namespace, tmp_path, **{"operator.replicas": 2, "leaderElection.leaseName": lease})
    with chart as ident, OperatorProcess(ident.kubeconfig, tmp_path / "a.log", *args) as a, \
            OperatorProcess(ident.kubeconfig, tmp_path / "b.log", *args) as b:
        won = "acquired the leader lease"
        wait_for(lambda: won in a.log() or won in b.log(), 60, what="a leader")
        leader, standby = (a, b) if won in a.log() else (b, a)
        sweeps = TrainingSweeps(admin_api, namespace, leader)
        sweeps.submit(kwok_sweep("ha"))
        finish_trial(sweeps.jobs, "ha-0", LOSSES[0])
        sweeps.wait_status("ha", lambda s: len(s.get("trials") or []) == 3, 30, "trial 2 recorded")
        assert f"{namespace}/ha:" in leader.log() and f"{namespace}/ha:" not in standby.log(), "the standby stepped"
        leader.stop()  # a clean stop releases the Lease: the standby takes over at once
        wait_for(lambda: won in standby.log(), 30, what="the standby leads")
        sweeps.op = standby
        st = run_to_the_end(sweeps, "ha", parallelism=2)
        assert trial_names(st) == ["ha-0", "ha-1", "ha-2"] == [j["metadata"]["name"] for j in sweeps.trial_jobs("ha")]
        assert st["bestTrial"] == 1
    assert_no_forbidden(leader)
    assert_no_forbidden(standby)


# --------------------------------------------------------------------------- real pods


@pytest.fixture
def real_operator(crd: None, real_namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    """The operator from this checkout, putting the real trainer image into the trials' pods."""
    with OperatorProcess(kubeconfig_path(), tmp_path / "operator.log", f"--namespace={real_namespace}",
                         trainer_image=TRAINER_IMAGE) as op:
        yield op


def real_sweep(name: str) -> dict[str, Any]:
    """Two trials (a grid over the learning rate), both at once, each a tiny fp32 model for 20 steps."""
    template = {"workers": 1, "strategy": "ddp", "precision": "fp32", "microBatchSize": 2, "maxSteps": 20,
                "seed": 1, "model": {"dModel": 32, "nLayers": 1, "nHeads": 2, "seqLen": 32},
                "data": {"path": "data"}, "optimizer": {"minLr": 1e-5, "warmupSteps": 2},
                "checkpoint": {"everySteps": 10, "keep": 1}, "restartPolicy": {"backoffLimit": 1}}
    return {"apiVersion": api.API_VERSION, "kind": api.SWEEP_KIND, "metadata": {"name": name},
            "spec": {"template": {"spec": template}, "maxTrials": 2, "parallelism": 2,
                     "parameters": [{"path": "optimizer.lr", "type": "categorical", "values": [0.003, 0.001]}],
                     "sampler": {"type": "grid"}, "pruner": {"type": "none"}}}


def test_sweep_trials_train_in_real_pods(admin_api: client.ApiClient, real_namespace: str,
                                         real_operator: OperatorProcess) -> None:
    sweeps = TrainingSweeps(admin_api, real_namespace, real_operator)
    start = time.monotonic()
    sweeps.submit(real_sweep("real"))
    st = sweeps.wait_status("real", lambda s: s.get("phase") in ("Succeeded", "Failed"), 900, "the sweep finished")
    print(f"real sweep {st['phase']} in {time.monotonic() - start:.0f} s: {st.get('message')}")
    assert st["phase"] == "Succeeded", sweeps.explain("real")
    assert set(states(st).values()) == {"Complete"} and len(st["trials"]) == 2
    assert {t["params"]["optimizer.lr"] for t in st["trials"]} == {0.003, 0.001}
    for trial in st["trials"]:
        job = sweeps.jobs.status(trial["jobName"])
        assert job["phase"] == "Succeeded" and job["currentStep"] == 20
        assert math.isfinite(trial["value"]) and trial["value"] == float(job["loss"])
        log = sweeps.jobs.core.read_namespaced_pod_log(f"{trial['jobName']}-worker-0", real_namespace)
        assert re.search(r"loss", log), log[-2000:]
    assert st["bestValue"] == min(t["value"] for t in st["trials"])
