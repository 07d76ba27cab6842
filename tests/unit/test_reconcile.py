"""The operator's pure reconcile: (job, pods, nodes, now) -> Plan. No API server here."""

import asyncio
import copy
import json
from datetime import UTC, datetime, timedelta

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kubetrain.core import contract, hangs
from kubetrain.core.api import Fetch, TrainingJob
from kubetrain.core.hangs import HangReport, RankReport
from kubetrain.core.progress import CheckpointRecord, Progress
from kubetrain.operator.controller import Controller
from kubetrain.operator.jobs import builders as b
from kubetrain.operator.jobs.apply import namespace_terminating
from kubetrain.operator.jobs.cache import slim_pod
from kubetrain.operator.jobs.plan import (
    PEERS_LOST_SETTLE_SECONDS,
    SILENT_FORGET_SECONDS,
    Observation,
    claim_to_check,
    forgotten,
    plan,
    set_condition,
    settles_in,
    silence_checks,
    silent_for,
    unanswering_nodes,
)
from kubetrain.operator.jobs.pod_facts import container_exit_code, facts
from kubetrain.operator.jobs.pod_patches import overlay
from kubetrain.operator.runtime.settings import OperatorSettings

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
S = b.WorkerSettings(trainer_image="trainer:test")


def body(status=None, **spec):
    base = {"workers": 2, "restartPolicy": {"backoffLimit": 1, "backoffSeconds": 0}}
    base.update(spec)
    return {
        "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "j", "namespace": "ns", "uid": "uid-1", "generation": 1,
                     "creationTimestamp": "2026-03-01T11:59:00Z"},
        "spec": base, "status": status or {},
    }


def pod(i, gen=0, phase="Running", ready=True, exit_code=None, node="n1", deleting=False):
    job = TrainingJob.model_validate({"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                                      "metadata": {"name": "j", "namespace": "ns"},
                                      "spec": {"workers": 2, "restartPolicy": {"inPlace": True}}})
    p = b.worker_pod(job, i, gen, S)
    p["spec"]["nodeName"] = node
    st = {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if exit_code is not None:
        st["containerStatuses"] = [{"name": "trainer", "state": {"terminated": {"exitCode": exit_code}}}]
    if phase == "Running":
        st["podIP"] = f"10.0.0.{10 + i}"
    p["status"] = st
    if deleting:
        p["metadata"]["deletionTimestamp"] = "2026-03-01T12:00:00Z"
    return p


def test_new_job_creates_service_config_and_all_pods_and_writes_status():
    p = plan(Observation(body(), [], {}, T0), S)
    kinds = [o["kind"] for o in p.create]
    assert kinds == ["Service", "ConfigMap", "ServiceAccount", "PersistentVolumeClaim", "Role", "RoleBinding", "Pod",
                     "Pod"]
    assert [o["metadata"]["name"] for o in p.create if o["kind"] == "Pod"] == ["j-worker-0", "j-worker-1"]
    assert all(o["metadata"]["ownerReferences"][0]["uid"] == "uid-1" for o in p.create)
    assert p.status["phase"] == "Created" and p.status["gangCreated"] is True
    assert p.status["workersSummary"] == "0/2" and p.status["startTime"] == "2026-03-01T12:00:00Z"
    assert p.events[0][:2] == ("Normal", "CreatingWorkers")


def test_the_workers_carry_the_job_s_uid_which_fences_its_checkpoints():
    """KUBETRAIN_RUN_ID is the stored job's uid: without it the trainer fences nothing, and a stale worker
    cut off on its node could commit beside the gang that replaced it."""
    p = plan(Observation(body(), [], {}, T0), S)
    for pod in (o for o in p.create if o["kind"] == "Pod"):
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env[contract.RUN_ID] == "uid-1", env


def test_operator_restart_mid_creation_creates_only_the_missing_pods():
    p = plan(Observation(body(status={"phase": "Created"}), [pod(0, phase="Pending")], {}, T0), S)
    assert [o["metadata"]["name"] for o in p.create if o["kind"] == "Pod"] == ["j-worker-1"]


def test_all_running_sets_running_with_ready_count_and_condition():
    st = {"phase": "Created", "gangCreated": True, "startTime": "2026-03-01T12:00:00Z"}
    p = plan(Observation(body(status=st), [pod(0), pod(1)], {}, T0), S)
    assert not p.create and p.status["phase"] == "Running" and p.status["workersSummary"] == "2/2"
    assert p.status["runningSince"] == "2026-03-01T12:00:00Z"
    cond = {c["type"]: c for c in p.status["conditions"]}
    assert cond["Running"]["status"] == "True" and cond["Created"]["status"] == "True"
    # Nothing changed on the next pass: no status write at all
    again = plan(Observation(body(status=p.status), [pod(0), pod(1)], {}, T0 + timedelta(seconds=5)), S)
    assert again.status is None and again.events == []


@pytest.mark.parametrize("pods", [
    [pod(0, deleting=True), pod(1, phase="Failed", exit_code=137, deleting=True)],  # the GC deleting them
    [pod(0)],  # one already gone
    [],  # all gone: a job that is not being deleted would get a new gang here
])
def test_a_job_being_deleted_is_never_restarted_recreated_or_written(pods):
    st = {"phase": "Running", "gangCreated": True, "startTime": "2026-03-01T12:00:00Z"}
    dying = body(status=st)
    dying["metadata"]["deletionTimestamp"] = "2026-03-01T12:00:05Z"
    p = plan(Observation(dying, pods, {}, T0 + timedelta(seconds=10)), S)
    assert (p.create, p.delete_pods, p.force_delete_pods, p.status, p.events) == ([], [], [], None, [])
    alive = plan(Observation(body(status=st), pods, {}, T0 + timedelta(seconds=10)), S)
    assert alive.create or alive.delete_pods or alive.status  # the same pods move a live job


RECREATE = {"restartPolicy": {"backoffLimit": 1, "backoffSeconds": 0, "inPlace": False}}
IN_PLACE = {"restartPolicy": {"backoffLimit": 1, "backoffSeconds": 0, "inPlace": True}}


def test_retryable_failure_deletes_whole_gang_and_bumps_generation_once():
    st = {"phase": "Running", "gangCreated": True, "startTime": "2026-03-01T12:00:00Z"}
    p = plan(Observation(body(status=st, **RECREATE), [pod(0), pod(1, phase="Failed", exit_code=137)], {}, T0), S)
    assert sorted(p.delete_pods) == ["j-worker-0", "j-worker-1"]
    assert (p.status["phase"], p.status["restartCount"], p.status["restartGeneration"]) == ("Restarting", 1, 1)
    assert p.status["failures"] == {"ExitCode": 1}
    assert p.events[0][:2] == ("Warning", "ExitCode")
    # next pass: the old pods are terminating -> wait, never a second restart, never new pods yet
    terminating = [pod(0, deleting=True), pod(1, phase="Failed", exit_code=137, deleting=True)]
    p2 = plan(Observation(body(status=p.status, **RECREATE), terminating, {}, T0), S)
    assert p2.status is None or p2.status["restartCount"] == 1
    assert not p2.create and not p2.delete_pods
    # gone -> generation 1 is created
    p3 = plan(Observation(body(status=p.status, **RECREATE), [], {}, T0), S)
    assert [o["metadata"]["labels"][b.LABEL_GENERATION] for o in p3.create if o["kind"] == "Pod"] == ["1", "1"]


def test_each_pod_to_delete_is_named_with_its_uid():
    st = {"phase": "Running", "gangCreated": True, "startTime": "2026-03-01T12:00:00Z"}
    pods = [pod(0), pod(1, phase="Failed", exit_code=137)]
    for i, p in enumerate(pods):
        p["metadata"]["uid"] = f"uid-{i}"
    p = plan(Observation(body(status=st, **RECREATE), pods, {}, T0), S)
    assert sorted(p.delete_pods) == ["j-worker-0", "j-worker-1"]
    assert p.pod_uids == {"j-worker-0": "uid-0", "j-worker-1": "uid-1"}


def test_permanent_failure_and_backoff_limit_fail_the_job():
    st = {"phase": "Running", "gangCreated": True}
    p = plan(Observation(body(status=st), [pod(0), pod(1, phase="Failed", exit_code=127)], {}, T0), S)
    assert (p.status["phase"], p.status["reason"]) == ("Failed", "PermanentError")
    assert p.delete_pods == ["j-worker-0"]  # cleanPodPolicy Running: the still-running one
    st = {"phase": "Running", "gangCreated": True, "restartCount": 1, "restartGeneration": 1}
    p = plan(Observation(body(status=st), [pod(0, gen=1), pod(1, gen=1, phase="Failed", exit_code=1)], {}, T0), S)
    assert (p.status["phase"], p.status["reason"]) == ("Failed", "BackoffLimitExceeded")
    assert p.status["completionTime"] == "2026-03-01T12:00:00Z"


def test_node_not_ready_past_grace_restarts():
    st = {"phase": "Running", "gangCreated": True}
    nodes = {"n2": T0 - timedelta(seconds=61)}
    p = plan(Observation(body(status=st), [pod(0), pod(1, node="n2")], nodes, T0), S)
    assert p.status["phase"] == "Restarting" and p.status["failures"] == {"NodeLost": 1}


@pytest.mark.parametrize(("finished", "restarted"), [("2026-03-01T11:59:00Z", True), ("2026-03-01T11:59:40Z", False)])
def test_a_kept_worker_that_had_already_finished_is_not_waited_for(finished, restarted):
    """Worker 1 was kept in place for generation 1 (restarted at 11:59:30) as its trainer exited 0 at 11:59:00:
    it never runs generation 1, and the gang restarts at once, uncounted. Finished after the restart, it ran
    generation 1 and simply finished before worker 0."""
    st = {"phase": "Running", "gangCreated": True, "restartGeneration": 1, "restartCount": 1,
          "lastRestartTime": "2026-03-01T11:59:30Z"}
    done = pod(1, gen=1, phase="Succeeded", exit_code=0)
    done["status"]["containerStatuses"][0]["state"]["terminated"]["finishedAt"] = finished
    p = plan(Observation(body(status=st), [pod(0, gen=1), done], {}, T0), S)
    assert (p.status["phase"] == "Restarting") == restarted, p.status
    if restarted:
        assert p.status["ignoredRestarts"] == 1 and "worker 1 had finished before this generation began" in \
            p.status["message"]


def test_a_worker_on_a_node_about_to_go_restarts_the_gang_uncounted():
    st = {"phase": "Running", "gangCreated": True}
    p = plan(Observation(body(status=st), [pod(0), pod(1, node="n2")], {}, T0,
                         terminating={"n2": "karpenter.sh/disrupted"}), S)
    assert (p.status["phase"], p.status["failures"], p.status["ignoredRestarts"]) == ("Restarting", {"Disrupted": 1}, 1)
    assert "node n2 is about to go (taint karpenter.sh/disrupted)" in p.status["message"]
    tolerant = pod(1, node="n2")
    tolerant["spec"]["tolerations"] = [{"key": "karpenter.sh/disrupted", "operator": "Exists"}]
    stays = plan(Observation(body(status=st), [pod(0), tolerant], {}, T0, terminating={"n2": "karpenter.sh/disrupted"}), S)
    assert stays.status is None or stays.status["phase"] == "Running"  # its podTemplate tolerates the taint


NOT_READY_AT = T0 - timedelta(seconds=61)
"""A node NotReady past the default grace (60 s)."""


@pytest.mark.parametrize(("last_progress", "restarted"), [
    (T0 - timedelta(seconds=5), False),  # progress after the node went NotReady, within the grace: training goes on
    (NOT_READY_AT - timedelta(seconds=1), True),  # the last progress was before: no sign the gang still trains
    (None, True),  # no progress ever seen: the grace alone
])
def test_a_notready_node_restarts_the_gang_only_when_the_job_stops_making_progress(last_progress, restarted):
    st = {"phase": "Running", "gangCreated": True, "runningSince": "2026-03-01T11:00:00Z", "currentStep": 40}
    if last_progress is not None:
        st["lastProgressTime"] = last_progress.strftime("%Y-%m-%dT%H:%M:%SZ")
    p = plan(Observation(body(status=st), [pod(0), pod(1, node="n2")], {"n2": NOT_READY_AT}, T0), S)
    assert (p.status["phase"] == "Restarting") == restarted, p.status
    if restarted:
        assert p.status["failures"] == {"NodeLost": 1} and p.force_delete_pods == ["j-worker-1"]
        return
    cond = {c["type"]: c for c in p.status["conditions"]}["NodesNotReady"]
    assert cond["status"] == "True" and cond["reason"] == "NodeNotReady" and "node n2 NotReady" in cond["message"]
    assert "still makes progress" in cond["message"] and not p.delete_pods and not p.force_delete_pods
    warnings = [e for e in p.events if e[:2] == ("Warning", "NodeNotReady")]
    assert len(warnings) == 1 and "n2" in warnings[0][2]
    assert p.requeue_after is not None and p.requeue_after <= 55  # looks again when the grace could run out


@pytest.mark.parametrize(("not_ready", "node_count", "restarted"), [
    (1, 10, True),  # one node of ten: the node's fault, its worker is moved
    (5, 10, True),  # 50%, under the threshold
    (6, 10, False),  # 60% of the cluster at once: a partition of the control plane, not of six nodes
    (2, 2, False),  # every node of the cluster
    (1, 0, True),  # node count unknown: never a disruption
])
def test_a_cluster_wide_disruption_restarts_no_gang(not_ready, node_count, restarted):
    st = {"phase": "Running", "gangCreated": True, "runningSince": "2026-03-01T11:00:00Z", "currentStep": 40,
          "lastProgressTime": (NOT_READY_AT - timedelta(seconds=1)).strftime("%Y-%m-%dT%H:%M:%SZ")}
    nodes = {"n2": NOT_READY_AT, **{f"x{i}": NOT_READY_AT for i in range(not_ready - 1)}}
    p = plan(Observation(body(status=st), [pod(0), pod(1, node="n2")], nodes, T0, node_count=node_count), S)
    assert (p.status["phase"] == "Restarting") == restarted, p.status
    if restarted:
        return
    assert not p.delete_pods and not p.force_delete_pods and p.status["restartCount"] == 0
    cond = {c["type"]: c for c in p.status["conditions"]}["NodesNotReady"]
    assert (cond["status"], cond["reason"]) == ("True", "ClusterDisruption")
    assert f"{not_ready} of the cluster's {node_count} nodes are NotReady at once" in cond["message"]
    assert [e for e in p.events if e[:2] == ("Warning", "ClusterDisruption")]


def test_a_notready_node_warns_once_and_ready_again_clears_the_condition():
    st = {"phase": "Running", "gangCreated": True, "runningSince": "2026-03-01T11:00:00Z", "currentStep": 40,
          "lastProgressTime": "2026-03-01T11:59:58Z"}
    first = plan(Observation(body(status=st), [pod(0), pod(1, node="n2")], {"n2": NOT_READY_AT}, T0), S)
    again = plan(Observation(body(status=first.status), [pod(0), pod(1, node="n2")], {"n2": NOT_READY_AT},
                             T0 + timedelta(seconds=1)), S)
    assert not [e for e in again.events if e[1] == "NodeNotReady"]
    ready = plan(Observation(body(status=first.status), [pod(0), pod(1, node="n2")], {}, T0 + timedelta(seconds=2)), S)
    cond = {c["type"]: c for c in ready.status["conditions"]}["NodesNotReady"]
    assert (cond["status"], cond["reason"]) == ("False", "NodesReady")


def test_deleted_worker_restarts_gang():
    st = {"phase": "Running", "gangCreated": True}
    p = plan(Observation(body(status=st), [pod(0)], {}, T0), S)
    assert p.status["phase"] == "Restarting" and p.status["failures"] == {"Deleted": 1}


def test_progress_flows_into_status():
    st = {"phase": "Running", "gangCreated": True, "runningSince": "2026-03-01T11:00:00Z"}
    prog = Progress(step=42, loss=2.5, generation=0,
                    last_checkpoint=CheckpointRecord(step=40, path="/checkpoints/step-00000040", time="t"))
    p = plan(Observation(body(status=st), [pod(0), pod(1)], {}, T0, progress=prog), S)
    assert p.status["currentStep"] == 42 and p.status["loss"] == "2.5000"
    assert p.status["lastCheckpoint"] == {"step": 40, "path": "/checkpoints/step-00000040", "time": "t"}
    assert p.status["lastProgressTime"] == "2026-03-01T12:00:00Z"


def _progressed(st: dict, step: int, written_ago: float | None, checkpoint: int | None = None) -> Observation:
    ck = CheckpointRecord(step=checkpoint, path="/c", time="t") if checkpoint else None
    prog = Progress(step=step, loss=2.4, generation=0, last_checkpoint=ck)
    written = T0 - timedelta(seconds=written_ago) if written_ago is not None else None
    return Observation(body(status=st), [pod(0), pod(1)], {}, T0, progress=prog,
                       progress_seen=T0 - timedelta(seconds=8), status_written=written)


def test_progress_alone_is_written_at_most_every_30s_with_the_time_it_was_seen():
    st = {"phase": "Running", "gangCreated": True, "runningSince": "2026-03-01T11:00:00Z", "currentStep": 40,
          "lastProgressTime": "2026-03-01T11:59:00Z"}
    settled = plan(_progressed(st, 60, written_ago=31), S).status
    assert settled is not None and settled["currentStep"] == 60
    assert settled["lastProgressTime"] == "2026-03-01T11:59:52Z"  # when the step was seen, not when written
    again = plan(_progressed(settled, 80, written_ago=12), S)
    assert again.status is None  # progress alone, 12 s after the last status write: not yet ...
    assert again.requeue_after is not None and 17.5 <= again.requeue_after <= 18  # ... but 30 s after it
    assert plan(_progressed(settled, 80, written_ago=None), S).status is not None  # a new leader writes at once
    with_checkpoint = plan(_progressed(settled, 80, written_ago=12, checkpoint=50), S)
    assert with_checkpoint.status is not None and with_checkpoint.status["lastCheckpoint"]["step"] == 50
    assert with_checkpoint.status["currentStep"] == 80  # any other change carries the newest progress


def test_progress_reporting_off_creates_no_rbac():
    p = plan(Observation(body(progressReporting=False), [], {}, T0), S)
    assert [o["kind"] for o in p.create] == ["Service", "ConfigMap", "ServiceAccount", "PersistentVolumeClaim", "Pod",
                                             "Pod"]


def test_a_network_policy_comes_with_every_new_gang_when_the_operator_makes_them():
    on = b.WorkerSettings(trainer_image="trainer:test", network_policy=b.WorkerNetworkPolicy())
    p = plan(Observation(body(), [], {}, T0), on)
    (np,) = [o for o in p.create if o["kind"] == "NetworkPolicy"]
    assert np["metadata"]["name"] == "j-workers" and np["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert not [o for o in plan(Observation(body(), [], {}, T0), S).create if o["kind"] == "NetworkPolicy"]


def test_progress_rbac_is_created_again_with_every_new_gang():
    """Creates are idempotent (409 = there): a Role deleted by hand comes back at the next gang."""
    st = {"phase": "Restarting", "restartCount": 1, "restartGeneration": 1}
    p = plan(Observation(body(status=st), [], {}, T0), S)
    assert {"Role", "RoleBinding"} <= {o["kind"] for o in p.create}
    role = next(o for o in p.create if o["kind"] == "Role")
    assert role["rules"][0]["resourceNames"] == ["j-worker-0"]
    assert role["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


def test_checkpoint_reported_after_its_step_still_reaches_status():
    """Rank 0 reports step 50, then (same step) the checkpoint it committed at 50."""
    st = {"phase": "Running", "gangCreated": True, "runningSince": "2026-03-01T11:00:00Z"}
    p = plan(Observation(body(status=st), [pod(0), pod(1)], {}, T0, progress=Progress(step=50, loss=2.0)), S)
    assert p.status["currentStep"] == 50 and "lastCheckpoint" not in p.status
    ck = CheckpointRecord(step=50, path="/checkpoints/step-00000050", time="t50")
    later = T0 + timedelta(seconds=1)
    p2 = plan(Observation(body(status=p.status), [pod(0), pod(1)], {}, later, progress=Progress(step=50, loss=2.0, last_checkpoint=ck)), S)
    assert p2.status["lastCheckpoint"] == {"step": 50, "path": "/checkpoints/step-00000050", "time": "t50"}
    assert p2.status["lastProgressTime"] == "2026-03-01T12:00:00Z"  # no new step: the hang clock does not move


def test_resumed_gang_retraining_older_steps_is_progress_not_a_hang():
    """Generation 1 resumed from the checkpoint at 40 after generation 0 reached 47: steps 40, 41, ...
    are below currentStep but they are progress; without it progressDeadlineSeconds would restart the
    gang again until it passed 47."""
    st = {"phase": "Running", "gangCreated": True, "restartCount": 1, "restartGeneration": 1,
          "runningSince": "2026-03-01T11:59:00Z", "currentStep": 47, "loss": "2.0000",
          "lastProgressTime": "2026-03-01T11:50:00Z"}
    pods = [pod(0, gen=1), pod(1, gen=1)]
    spec = {"restartPolicy": {"backoffLimit": 3, "backoffSeconds": 0, "progressDeadlineSeconds": 90}}
    p = plan(Observation(body(status=st, **spec), pods, {}, T0, progress=Progress(step=41, loss=2.4, generation=1)), S)
    assert p.status["currentStep"] == 41 and p.status["lastProgressTime"] == "2026-03-01T12:00:00Z"
    later = T0 + timedelta(seconds=80)  # 140 s after runningSince, 80 s after the last report
    p2 = plan(Observation(body(status=p.status, **spec), pods, {}, later, progress=Progress(step=41, loss=2.4, generation=1)), S)
    assert p2.status is None or p2.status["phase"] == "Running"
    # a stale record of the previous generation with a lower step is not progress
    p3 = plan(Observation(body(status=st, **spec), pods, {}, later, progress=Progress(step=41, loss=2.4, generation=0)), S)
    assert p3.status["phase"] == "Restarting" and p3.status["failures"] == {"NoProgress": 1}


def test_suspend_then_resume():
    running = {"type": "Running", "status": "True", "reason": "AllWorkersRunning", "lastTransitionTime": "x"}
    st = {"phase": "Running", "gangCreated": True, "conditions": [running]}
    p = plan(Observation(body(status=st, suspend=True), [pod(0), pod(1)], {}, T0), S)
    assert sorted(p.delete_pods) == ["j-worker-0", "j-worker-1"] and p.status["phase"] == "Suspended"
    assert p.status["restartGeneration"] == 1
    cond = {c["type"]: c for c in p.status["conditions"]}
    assert cond["Suspended"]["status"] == "True" and cond["Running"]["status"] == "False"
    p2 = plan(Observation(body(status=p.status), [], {}, T0), S)
    assert [o["metadata"]["labels"][b.LABEL_GENERATION] for o in p2.create if o["kind"] == "Pod"] == ["1", "1"]


def test_finished_job_ttl_and_never_resurrected():
    st = {"phase": "Succeeded", "completionTime": "2026-03-01T11:59:00Z"}
    p = plan(Observation(body(status=st, ttlSecondsAfterFinished=120), [], {}, T0), S)
    assert not p.delete_job and p.requeue_after == 60 and not p.create
    p = plan(Observation(body(status=st, ttlSecondsAfterFinished=60), [], {}, T0), S)
    assert p.delete_job and not p.create


def test_invalid_spec_fails_with_field_path():
    p = plan(Observation(body(model={"dModel": 100, "nHeads": 3}), [], {}, T0), S)
    assert p.status["phase"] == "Failed" and p.status["reason"] == "InvalidSpec"
    assert "spec.model.nHeads: model.dModel must be divisible by model.nHeads" in p.status["message"]
    assert not p.create


def test_a_field_from_a_newer_crd_holds_a_new_job_and_leaves_a_running_one_running():
    """The CRD was upgraded before the operator: the API server gives every stored job the new fields'
    defaults. A job not started yet waits (Pending, OperatorOutdated, one Event) instead of failing as an
    invalid spec; a running job goes on without them and says so once."""
    new = body(futureParallelism={"degree": 1}, checkpoint={"everySteps": 10, "futureTier": {}})
    p = plan(Observation(new, [], {}, T0), S)
    assert not p.create and p.status["phase"] == "Pending" and p.status["reason"] == "UnknownFields"
    assert p.status["message"].startswith("spec.checkpoint.futureTier, spec.futureParallelism: not known to this "
                                          "operator (the TrainingJob CRD is newer than the operator); the job waits")
    assert [e[:2] for e in p.events] == [("Warning", "UnknownFields")]
    cond = {c["type"]: c for c in p.status["conditions"]}["OperatorOutdated"]
    assert (cond["status"], cond["reason"]) == ("True", "UnknownFields")
    again = plan(Observation({**new, "status": p.status}, [], {}, T0 + timedelta(seconds=5)), S)
    assert again.status is None and again.events == [] and not again.create  # said once, still waiting

    st = {"phase": "Running", "gangCreated": True, "startTime": "2026-03-01T12:00:00Z"}
    running = body(status=st, futureParallelism={"degree": 1})
    p = plan(Observation(running, [pod(0), pod(1)], {}, T0), S)
    assert p.status["phase"] == "Running" and not p.create and not p.delete_pods
    cond = {c["type"]: c for c in p.status["conditions"]}["OperatorOutdated"]
    assert cond["status"] == "True" and "goes on without them" in cond["message"]
    assert [e[:2] for e in p.events] == [("Warning", "UnknownFields")]
    again = plan(Observation({**running, "status": p.status}, [pod(0), pod(1)], {}, T0 + timedelta(seconds=5)), S)
    assert again.status is None and again.events == []


def test_condition_time_moves_only_on_change():
    c = set_condition([], "Running", True, "A", "m", T0)
    c2 = set_condition(c, "Running", True, "B", "other message", T0 + timedelta(seconds=9))
    assert c2[0]["lastTransitionTime"] == c[0]["lastTransitionTime"] and c2[0]["reason"] == "B"
    c3 = set_condition(c2, "Running", False, "C", "m", T0 + timedelta(seconds=20))
    assert c3[0]["lastTransitionTime"] == "2026-03-01T12:00:20Z"


def test_namespace_terminating_is_told_apart_from_rbac_refusals():
    def forbidden(causes):
        exc = ApiException(status=403, reason="Forbidden")
        exc.body = json.dumps({"kind": "Status", "code": 403, "reason": "Forbidden",
                               "details": {"kind": "roles", "causes": causes}})
        return exc

    assert namespace_terminating(forbidden([{"reason": "NamespaceTerminating", "field": "metadata.namespace"}]))
    assert not namespace_terminating(forbidden([]))  # an RBAC refusal has no such cause
    not_found = forbidden([{"reason": "NamespaceTerminating"}])
    not_found.status = 404
    assert not namespace_terminating(not_found)
    garbled = ApiException(status=403, reason="Forbidden")
    garbled.body = "<html>proxy says no</html>"
    assert not namespace_terminating(garbled)


def conditions(status) -> dict[str, dict]:
    return {c["type"]: c for c in status["conditions"]}


def test_durable_checkpoints_by_default_on_a_claim_the_job_owns():
    p = plan(Observation(body(), [], {}, T0), S)
    pvc = next(o for o in p.create if o["kind"] == "PersistentVolumeClaim")
    assert pvc["metadata"]["name"] == "j-checkpoints" and pvc["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    cond = conditions(p.status)["CheckpointsDurable"]
    assert (cond["status"], cond["reason"]) == ("True", "DefaultClaim") and "j-checkpoints" in cond["message"]
    assert [e for e in p.events if e[0] == "Warning"] == []


def test_ephemeral_job_says_so_once_before_it_runs():
    spec = {"checkpoint": {"ephemeral": True}}
    p = plan(Observation(body(**spec), [], {}, T0), S)
    assert "PersistentVolumeClaim" not in [o["kind"] for o in p.create]
    cond = conditions(p.status)["CheckpointsDurable"]
    assert (cond["status"], cond["reason"]) == ("False", "EphemeralCheckpoints")
    warnings = [e for e in p.events if e[0] == "Warning"]
    assert warnings == [("Warning", "EphemeralCheckpoints", cond["message"])]
    st = {**p.status, "phase": "Running", "runningSince": "2026-03-01T12:00:00Z"}
    again = plan(Observation(body(status=st, **spec), [pod(0), pod(1)], {}, T0 + timedelta(seconds=5)), S)
    assert [e for e in again.events if e[0] == "Warning"] == []


def unschedulable(p, message="0/4 nodes are available: 4 node(s) didn't match Pod's node affinity/selector."):
    p["spec"].pop("nodeName")
    p["status"] = {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "lastProbeTime": None,
         "lastTransitionTime": "2026-03-01T11:59:00Z", "reason": "Unschedulable", "message": message}]}
    return p


def test_blocked_workers_get_a_condition_and_one_event_per_reason_then_clear():
    st = {"phase": "Created", "gangCreated": True, "startTime": "2026-03-01T12:00:00Z"}
    pods = [unschedulable(pod(0, phase="Pending")), pod(1, phase="Pending", ready=False)]
    p = plan(Observation(body(status=st), pods, {}, T0), S)
    assert p.status["phase"] == "Created" and not p.delete_pods  # the job waits, it does not fail
    cond = conditions(p.status)["WorkersBlocked"]
    assert (cond["status"], cond["reason"]) == ("True", "Unschedulable")
    assert cond["message"].startswith("worker pods cannot start; the job waits: j-worker-0 cannot be scheduled: 0/4")
    assert [e[:2] for e in p.events] == [("Warning", "Unschedulable")]
    later = T0 + timedelta(seconds=5)
    again = plan(Observation(body(status=p.status), pods, {}, later), S)
    assert again.status is None and again.events == []  # not one Event per reconcile
    pulling = pod(0, phase="Pending", ready=False)
    pulling["status"]["containerStatuses"] = [{"name": "trainer", "ready": False, "restartCount": 0,
                                               "state": {"waiting": {"reason": "ImagePullBackOff",
                                                                     "message": "Back-off pulling image"}}}]
    other = plan(Observation(body(status=p.status), [pulling, pods[1]], {}, later), S)
    assert [e[:2] for e in other.events] == [("Warning", "ImagePullFailed")]
    running = plan(Observation(body(status=other.status), [pod(0), pod(1)], {}, later), S)
    cond = conditions(running.status)["WorkersBlocked"]
    assert (cond["status"], cond["reason"]) == ("False", "WorkersStarting") and running.status["phase"] == "Running"
    assert [e for e in running.events if e[0] == "Warning"] == []


def test_pending_claim_is_named_when_the_pods_wait_for_it():
    st = {"phase": "Created", "gangCreated": True}
    pods = [unschedulable(pod(i, phase="Pending"), "0/4 nodes are available: pod has unbound immediate "
                          "PersistentVolumeClaims.") for i in (0, 1)]
    assert claim_to_check(body(status=st), pods, T0) == "j-checkpoints"
    assert claim_to_check(body(status=st), [unschedulable(pod(0, phase="Pending"))], T0) is None  # not for a volume
    assert claim_to_check(body(status=st), [pod(0), pod(1)], T0) is None
    p = plan(Observation(body(status=st), pods, {}, T0, claim_phase="Pending"), S)
    cond = conditions(p.status)["WorkersBlocked"]
    assert cond["reason"] == "CheckpointClaimPending"
    assert "the checkpoint claim j-checkpoints is Pending, not bound to a volume" in cond["message"]
    assert "(and 1 more pod(s) alike)" in cond["message"]


def test_resumed_from_step_is_the_current_generations_own_report():
    ck = {"step": 40, "path": "/checkpoints/step-00000040", "time": "t40"}
    st = {"phase": "Running", "gangCreated": True, "restartCount": 1, "restartGeneration": 1,
          "runningSince": "2026-03-01T11:59:00Z", "currentStep": 47, "lastCheckpoint": ck}
    pods = [pod(0, gen=1), pod(1, gen=1)]
    p = plan(Observation(body(status=st), pods, {}, T0, progress=Progress(step=41, generation=1, resumed_from=40)), S)
    assert p.status["resumedFromStep"] == 40
    fresh = plan(Observation(body(status={**st, "resumedFromStep": 7}), pods, {}, T0, progress=Progress(step=3, generation=1)), S)
    assert fresh.status["resumedFromStep"] == 0  # no checkpoint loaded: started from scratch
    stale = plan(Observation(body(status=st), pods, {}, T0, progress=Progress(step=41, generation=0, resumed_from=20)), S)
    assert stale.status["resumedFromStep"] == 0  # another generation's report is not this one's


def test_gang_restart_names_the_checkpoint_it_restarts_from():
    ck = {"step": 40, "path": "/checkpoints/step-00000040", "time": "t40"}
    st = {"phase": "Running", "gangCreated": True, "lastCheckpoint": ck, "resumedFromStep": 20,
          "restartGeneration": 0}
    failed = [pod(0), pod(1, phase="Failed", exit_code=137)]
    spec = {"restartPolicy": {"backoffLimit": 3, "backoffSeconds": 0}}
    p = plan(Observation(body(status=st, **spec), failed, {}, T0), S)
    assert "restarting the whole gang from the checkpoint at step 40 (or a newer one in memory) in place, " \
        "keeping 1 of 2 workers (restart 1 of at most 3" in p.status["message"]
    assert p.events[0][2] == p.status["message"] and p.status["lastCheckpoint"]["step"] == 40
    assert p.status["resumedFromStep"] == 0  # until the new generation reports what it loaded
    eph = plan(Observation(body(status=st, checkpoint={"ephemeral": True}, **spec), failed, {}, T0), S)
    assert "from step 0 (or a checkpoint in memory): checkpoints are ephemeral (spec.checkpoint.ephemeral)" in eph.status["message"]
    assert "lastCheckpoint" not in eph.status  # it was in the pods being deleted
    none = plan(Observation(body(status={k: v for k, v in st.items() if k != "lastCheckpoint"}, **spec), failed, {}, T0), S)
    assert "from step 0 (or a checkpoint in memory): no complete checkpoint yet" in none.status["message"]


@pytest.mark.parametrize(("message", "code"), [
    ('failed to create containerd task: failed to create shim task: OCI runtime create failed: runc create failed: '
     'unable to start container process: exec: "no-such-command": executable file not found in $PATH: unknown', 127),
    ('... exec: "/opt/train.sh": permission denied: unknown', 126),
    ("failed to create containerd task: context deadline exceeded", 128),
    ('runc create failed: unable to start container process: error during container init: error mounting '
     '"/data/x" to rootfs at "/data": no such file or directory: unknown', 128),  # a mount, not the command
])
def test_a_command_the_runtime_cannot_start_exits_like_a_shell(message, code):
    assert container_exit_code({"exitCode": 128, "reason": "StartError", "message": message}) == code
    assert container_exit_code({"exitCode": 137, "reason": "Error"}) == 137


RUNNING = {"phase": "Running", "gangCreated": True, "startTime": "2026-03-01T11:00:00Z",
           "runningSince": "2026-03-01T11:00:00Z"}


@pytest.mark.parametrize(("action", "status", "spec", "pods", "want"), [
    ("CreateWorkers", {}, {}, [], {"pods": ["j-worker-0", "j-worker-1"], "delete": []}),
    ("Wait", RUNNING, {}, [pod(0), pod(1)], {"pods": [], "delete": []}),
    ("RestartGang", RUNNING, RECREATE, [pod(0), pod(1, phase="Failed", exit_code=1)],
     {"pods": [], "delete": ["j-worker-0", "j-worker-1"], "event": "ExitCode"}),
    ("RestartGang", RUNNING, IN_PLACE, [pod(0), pod(1, phase="Failed", exit_code=1)],
     {"pods": [], "delete": ["j-worker-1"], "event": "ExitCode"}),
    ("DeleteStale", {**RUNNING, "restartGeneration": 1, "gangCreated": False}, {}, [pod(0), pod(1, gen=1)],
     {"pods": [], "delete": ["j-worker-0"]}),
    ("Suspend", RUNNING, {"suspend": True}, [pod(0), pod(1)],
     {"pods": [], "delete": ["j-worker-0", "j-worker-1"], "event": "Suspended"}),
    ("Succeed", RUNNING, {}, [pod(0, phase="Succeeded"), pod(1)],
     {"pods": [], "delete": ["j-worker-1"], "event": "Succeeded"}),
    ("Fail", RUNNING, {}, [pod(0), pod(1, phase="Failed", exit_code=2)],
     {"pods": [], "delete": ["j-worker-0"], "event": "PermanentError"}),
])
def test_every_lifecycle_action_becomes_api_calls(action, status, spec, pods, want):
    p = plan(Observation(body(status=status, **spec), pods, {}, T0), S)
    assert p.decision is not None and p.decision.action == action
    assert [o["metadata"]["name"] for o in p.create if o["kind"] == "Pod"] == want["pods"]
    assert sorted(p.delete_pods) == want["delete"]
    if "event" in want:
        assert want["event"] in [reason for _, reason, _ in p.events]
    assert p.status is not None and p.status["phase"] == p.decision.phase


def with_trainer_exit(p, code):
    p["status"]["containerStatuses"] = [{"name": "trainer", "state": {"terminated": {"exitCode": code}}},
                                        {"name": "sidecar", "state": {"running": {}}}]
    return p


def test_trainer_exit_decides_even_when_a_sidecar_keeps_the_pod_running():
    done = plan(Observation(body(status=RUNNING), [with_trainer_exit(pod(0), 0), pod(1)], {}, T0), S)
    assert (done.status["phase"], done.delete_pods) == ("Succeeded", ["j-worker-0", "j-worker-1"])
    failed = plan(Observation(body(status=RUNNING), [pod(0), with_trainer_exit(pod(1), 1)], {}, T0), S)
    assert (failed.status["phase"], failed.status["reason"]) == ("Restarting", "ExitCode")


def disrupt(p):
    p["status"]["conditions"].append({"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"})
    p["metadata"]["deletionTimestamp"] = "2026-03-01T12:00:00Z"
    return p


def test_a_preempted_worker_is_a_disruption_even_once_its_pod_is_gone():
    limit0 = {"backoffLimit": 0, "backoffSeconds": 0}
    live = plan(Observation(body(status=RUNNING, restartPolicy=limit0), [pod(0), disrupt(pod(1))], {}, T0), S)
    gone = plan(Observation(body(status=RUNNING, restartPolicy=limit0), [pod(0)], {}, T0, gone=[disrupt(pod(1))]), S)
    deleted = plan(Observation(body(status=RUNNING, restartPolicy=limit0), [pod(0)], {}, T0), S)
    for p in (live, gone):
        assert (p.status["phase"], p.status["reason"], p.status["ignoredRestarts"]) == ("Restarting", "Disrupted", 1)
    assert (deleted.status["phase"], deleted.status["reason"]) == ("Failed", "BackoffLimitExceeded")


def test_refused_progress_rbac_is_a_condition_and_no_hang_restart():
    st = {**RUNNING, "lastProgressTime": "2026-03-01T10:00:00Z"}
    spec = {"restartPolicy": {"progressDeadlineSeconds": 60}}
    refused = plan(Observation(body(status=st, **spec), [pod(0), pod(1)], {}, T0, progress_refused=True), S)
    assert refused.status["phase"] == "Running" and refused.status["restartCount"] == 0
    cond = next(c for c in refused.status["conditions"] if c["type"] == "ProgressUnknown")
    assert (cond["status"], cond["reason"]) == ("True", "ProgressReportingForbidden")
    hung = plan(Observation(body(status=st, **spec), [pod(0), pod(1)], {}, T0), S)
    assert hung.status["reason"] == "NoProgress"


def test_pods_on_a_lost_node_are_deleted_at_once_even_when_terminating():
    lost = {"n1": T0 - timedelta(seconds=61), "n2": None}
    restart = plan(Observation(body(status=RUNNING, **RECREATE), [pod(0, node="n2"), pod(1, node="n1")], lost, T0), S)
    assert (restart.status["reason"], restart.force_delete_pods, restart.delete_pods) == (
        "NodeLost", ["j-worker-1"], ["j-worker-0"])
    st = {**RUNNING, "restartGeneration": 1, "gangCreated": False, "restartCount": 1}
    stuck = plan(Observation(body(status=st), [pod(1, node="n1", deleting=True)], lost, T0), S)
    assert (stuck.decision.action, stuck.force_delete_pods) == ("DeleteStale", ["j-worker-1"])
    healthy = plan(Observation(body(status=st), [pod(1, node="n2", deleting=True)], lost, T0), S)
    assert (healthy.force_delete_pods, healthy.delete_pods) == ([], [])  # a kubelet will confirm it


def test_a_pod_a_restart_deletes_goes_at_once_from_a_node_just_notready():
    """Its kubelet cannot confirm the deletion and the worker's next pod waits on its name: no grace to wait out.
    A pod that no restart deletes is left its node's grace (nodeNotReadyGraceSeconds)."""
    just = {"n1": T0 - timedelta(seconds=2)}
    st = {**RUNNING, "restartGeneration": 1, "gangCreated": False, "restartCount": 1}
    stuck = plan(Observation(body(status=st), [pod(1, node="n1", deleting=True)], just, T0), S)
    assert (stuck.decision.action, stuck.force_delete_pods) == ("DeleteStale", ["j-worker-1"])
    running = plan(Observation(body(status=RUNNING), [pod(0, node="n2"), pod(1, node="n1")], just, T0), S)
    assert running.force_delete_pods == [] and running.delete_pods == []


def test_on_success_a_pod_whose_containers_all_ended_is_kept_even_if_its_phase_lags():
    rank0 = pod(0)
    rank0["status"]["containerStatuses"] = [{"name": "trainer", "state": {"terminated": {"exitCode": 0}}}]
    sidecar = with_trainer_exit(pod(1), 0)  # the trainer ended, its sidecar still runs
    p = plan(Observation(body(status=RUNNING), [rank0, sidecar], {}, T0), S)
    assert (p.status["phase"], p.delete_pods) == ("Succeeded", ["j-worker-1"])  # rank 0's log is kept


def test_a_profile_request_on_the_job_goes_to_worker_0_of_the_current_generation_once():
    b_ = body(status={"phase": "Running", "restartGeneration": 1, "gangCreated": True})
    b_["metadata"]["annotations"] = {"kubetrain.io/profile": "5:a"}
    pods = [pod(0, gen=1), pod(1, gen=1)]
    assert plan(Observation(b_, pods, {}, T0), S).patch_pods == {"j-worker-0": {"annotations": {"kubetrain.io/profile": "5:a"}}}
    pods[0]["metadata"].setdefault("annotations", {})["kubetrain.io/profile"] = "5:a"
    assert plan(Observation(b_, pods, {}, T0), S).patch_pods == {}  # already there
    assert plan(Observation(b_, [pod(0, gen=0)], {}, T0), S).patch_pods == {}  # an old generation's pod: not rank 0 now


# --------------------------------------------------------------------------- restarting in place


def kept(i, gen, told):
    """A pod an in-place restart moved to `gen` whose launcher was last told generation `told`."""
    p = pod(i, gen=told)
    p["metadata"]["labels"][b.LABEL_GENERATION] = str(gen)
    return p


def test_an_in_place_restart_moves_the_running_pods_and_deletes_only_the_failed_one():
    p = plan(Observation(body(status=RUNNING, **IN_PLACE), [pod(0), pod(1, phase="Failed", exit_code=1)], {}, T0), S)
    assert p.decision is not None and p.decision.keep == (0,)
    assert p.delete_pods == ["j-worker-1"] and not p.create
    assert p.patch_pods == {"j-worker-0": {"labels": {b.LABEL_GENERATION: "1"}}}
    assert p.status["restartGeneration"] == 1 and p.status["workersSummary"] == "0/2"


def test_kept_pods_are_told_their_generation_when_the_recreated_pod_is_created():
    st = plan(Observation(body(status=RUNNING, **IN_PLACE), [pod(0), pod(1, phase="Failed", exit_code=1)], {}, T0), S).status
    stale = plan(Observation(body(status=st, **IN_PLACE), [kept(0, 1, 0), pod(1, phase="Failed", exit_code=1, deleting=True)], {}, T0), S)
    assert stale.decision.action == "DeleteStale" and not stale.patch_pods and not stale.delete_pods
    go = plan(Observation(body(status=st, **IN_PLACE), [kept(0, 1, 0)], {}, T0), S)
    assert [o["metadata"]["name"] for o in go.create if o["kind"] == "Pod"] == ["j-worker-1"]
    # Told with worker 0's address, which it keeps: a lookup of a name is never what a kept worker waits on.
    assert go.patch_pods == {"j-worker-0": {"annotations": {contract.GENERATION_ANNOTATION: "1", contract.MASTER_ANNOTATION: "1 10.0.0.10"}}}
    assert "creating 1 of 2 worker(s) of generation 1 and restarting 1 in place" in go.status["message"]
    running = plan(Observation(body(status=go.status, **IN_PLACE), [kept(0, 1, 1), pod(1, gen=1)], {}, T0), S)
    assert running.status["phase"] == "Running" and not running.patch_pods and not running.create


def test_a_kept_worker_learns_the_address_of_a_recreated_worker_0_once_its_pod_has_one():
    """contract.MASTER_ANNOTATION: told the generation alone while the new worker 0 has no IP, then its IP (the
    new pods are not patched: their first lookup comes after worker 0's pod was published)."""
    st = plan(Observation(body(status=RUNNING, **IN_PLACE), [pod(0, phase="Failed", exit_code=1), pod(1)], {}, T0), S).status
    go = plan(Observation(body(status=st, **IN_PLACE), [kept(1, 1, 0)], {}, T0), S)
    assert [o["metadata"]["name"] for o in go.create if o["kind"] == "Pod"] == ["j-worker-0"]
    told = {contract.GENERATION_ANNOTATION: "1", contract.MASTER_ANNOTATION: "1"}
    assert go.patch_pods == {"j-worker-1": {"annotations": told}}
    waiting = kept(1, 1, 0)
    waiting["metadata"]["annotations"].update(told)
    pending = plan(Observation(body(status=go.status, **IN_PLACE), [pod(0, gen=1, phase="Pending"), waiting], {}, T0), S)
    assert not pending.patch_pods
    placed = plan(Observation(body(status=go.status, **IN_PLACE), [pod(0, gen=1), waiting], {}, T0), S)
    assert placed.patch_pods == {"j-worker-1": {"annotations": {contract.MASTER_ANNOTATION: "1 10.0.0.10"}}}
    waiting["metadata"]["annotations"][contract.MASTER_ANNOTATION] = "1 10.0.0.10"
    assert not plan(Observation(body(status=go.status, **IN_PLACE), [pod(0, gen=1), waiting], {}, T0), S).patch_pods


def test_a_plan_made_while_the_kept_pods_patches_are_in_flight_sees_them_moved():
    decided = plan(Observation(body(status=RUNNING, **IN_PLACE), [pod(0), pod(1, phase="Failed", exit_code=1)], {}, T0), S)
    assert decided.delete_pods == ["j-worker-1"] and decided.patch_pods == {"j-worker-0": {"labels": {b.LABEL_GENERATION: "1"}}}
    unmoved = [pod(0)]  # worker 1 gone; worker 0's label patch not landed yet
    go = plan(Observation(body(status=decided.status, **IN_PLACE), overlay(unmoved, decided.patch_pods), {}, T0), S)
    assert [o["metadata"]["name"] for o in go.create if o["kind"] == "Pod"] == ["j-worker-1"]
    assert go.patch_pods == {"j-worker-0": {"annotations": {contract.GENERATION_ANNOTATION: "1", contract.MASTER_ANNOTATION: "1 10.0.0.10"}}}
    blind = plan(Observation(body(status=decided.status, **IN_PLACE), unmoved, {}, T0), S)  # worker 0 taken for a stale pod
    assert blind.decision.action == "DeleteStale" and blind.delete_pods == ["j-worker-0"]


def test_a_pod_built_without_in_place_is_recreated():
    old = pod(0)
    del old["metadata"]["annotations"]["kubetrain.io/in-place"]  # made before in-place restarts existed
    p = plan(Observation(body(status=RUNNING, **IN_PLACE), [old, pod(1, phase="Failed", exit_code=1)], {}, T0), S)
    assert sorted(p.delete_pods) == ["j-worker-0", "j-worker-1"] and not p.patch_pods


def restarted(i, exit_code, restarts=0, running=False, handled=None):
    """Worker i's trainer container failed in its pod (restartPolicy OnFailure) after `restarts` restarts
    there: as the kubelet reports it before it starts the container again, or after (`running`)."""
    p = pod(i)
    term = {"exitCode": exit_code, "reason": "Error"}
    cs = {"name": "trainer", "restartCount": restarts, "state": {"terminated": term}}
    if running:
        cs = {"name": "trainer", "restartCount": restarts + 1, "state": {"running": {}}, "lastState": {"terminated": term}}
    p["status"]["containerStatuses"] = [cs]
    if handled is not None:
        p["metadata"]["annotations"][contract.FAILURES_HANDLED_ANNOTATION] = str(handled)
    return p


@pytest.mark.parametrize("running", [False, True])
def test_a_worker_restarted_in_its_pod_is_kept_and_its_failure_counted_once(running):
    p = plan(Observation(body(status=RUNNING, **IN_PLACE), [pod(0), restarted(1, 137, running=running)], {}, T0), S)
    assert p.decision is not None and p.decision.keep == (0, 1)
    assert not p.delete_pods and not p.create  # no pod recreated: the kubelet restarted worker 1 in its pod
    moved = {"labels": {b.LABEL_GENERATION: "1"}}
    assert p.patch_pods == {"j-worker-0": moved,
                            "j-worker-1": {**moved, "annotations": {contract.FAILURES_HANDLED_ANNOTATION: "1"}}}
    assert (p.status["restartGeneration"], p.status["restartCount"], p.status["failures"]) == (1, 1, {"ExitCode": 1})
    assert "worker 1 exited with code 137" in p.status["message"] and "keeping 2 of 2" in p.status["message"]
    # After the patch, worker 1's failure is this restart's: both are told generation 1, nothing restarts again.
    again = restarted(1, 137, running=running, handled=1)
    again["metadata"]["labels"][b.LABEL_GENERATION] = "1"
    go = plan(Observation(body(status=p.status, **IN_PLACE), [kept(0, 1, 0), again], {}, T0), S)
    told = {"annotations": {contract.GENERATION_ANNOTATION: "1", contract.MASTER_ANNOTATION: "1 10.0.0.10"}}
    assert not [o for o in go.create if o["kind"] == "Pod"] and not go.delete_pods
    assert go.patch_pods == {"j-worker-0": told, "j-worker-1": told}
    assert go.status["restartCount"] == 1 and "restarting 2 in place" in go.status["message"]


def test_a_second_failure_in_the_same_pod_recreates_that_pod():
    """The kubelet would back its restart off (10 s, doubling): a new pod starts sooner."""
    p = plan(Observation(body(status=RUNNING, **IN_PLACE), [pod(0), restarted(1, 1, restarts=1, handled=1)], {}, T0), S)
    assert p.decision is not None and p.decision.keep == (0,)
    assert p.delete_pods == ["j-worker-1"]


def test_a_failed_job_deletes_a_worker_its_kubelet_would_restart_whatever_the_clean_pod_policy():
    plain = pod(0)
    plain["spec"]["restartPolicy"] = "Never"  # still running, but nothing restarts it
    for policy, deleted in (("Running", ["j-worker-0", "j-worker-1"]), ("None", ["j-worker-1"])):
        p = plan(Observation(body(status=RUNNING, cleanPodPolicy=policy, **IN_PLACE), [plain, restarted(1, 127, running=True)], {}, T0), S)
        assert (p.status["phase"], p.status["reason"]) == ("Failed", "PermanentError")
        assert sorted(p.delete_pods) == deleted, policy


# ------------------------------------------------------------------ the fetch of model.hfUri before training

FETCHED = {"model": {"hfUri": "s3://models/llama"}}


def in_fetch(p, state, phase="Pending"):
    """A worker pod whose init container `fetch` is in `state`; the trainer waits for it."""
    p["status"] = {"phase": phase, "conditions": [{"type": "PodScheduled", "status": "True"},
                                                  {"type": "Initialized", "status": "False"}],
                   "initContainerStatuses": [{"name": contract.FETCH_CONTAINER, "restartCount": 0, "state": state}],
                   "containerStatuses": [{"name": "trainer", "state": {"waiting": {"reason": "PodInitializing"}}}]}
    return p


def test_a_running_fetch_shows_in_status_and_is_neither_blocked_nor_a_late_start_nor_a_step():
    """A restarted gang fetches for longer than startTimeoutSeconds: it waits, saying what it fetches and how
    far worker 0 got, and the fetch's record (step 0) does not move currentStep back."""
    policy = {"backoffLimit": 3, "backoffSeconds": 0, "startTimeoutSeconds": 60, "progressDeadlineSeconds": 60}
    st = {"phase": "Restarting", "gangCreated": True, "restartGeneration": 1, "restartCount": 1, "currentStep": 500,
          "gangCreatedTime": "2026-03-01T11:00:00Z", "lastProgressTime": "2026-03-01T10:59:00Z"}
    fetch = Fetch(uri="s3://models/llama", field="model.hfUri", bytes=int(1.2 * 2**30), total_bytes=int(3.4 * 2**30))
    record = Progress(job="j", generation=1, fetch=fetch)
    pods = [in_fetch(pod(i, gen=1), {"running": {"startedAt": "2026-03-01T11:00:30Z"}}) for i in (0, 1)]
    p = plan(Observation(body(st, restartPolicy=policy, **FETCHED), pods, {}, T0, progress=record), S)
    assert not p.delete_pods and not p.create and p.requeue_after == 5.0
    assert (p.status["phase"], p.status["currentStep"], p.status["restartCount"]) == ("Restarting", 500, 1)
    assert p.status["message"] == \
        "2 of 2 worker(s) pending: 2 fetching model.hfUri s3://models/llama (1.2 GiB of 3.4 GiB)"
    assert p.status["fetch"] == {"uri": "s3://models/llama", "field": "model.hfUri", "bytes": fetch.bytes,
                                 "totalBytes": fetch.total_bytes, "done": False}
    assert "WorkersBlocked" not in conditions(p.status) and [e for e in p.events if e[0] == "Warning"] == []
    # A worker that is not fetching but waiting (here: for a node) is still late.
    late = [pods[0], unschedulable(pod(1, gen=1))]
    p = plan(Observation(body(st, restartPolicy=policy, **FETCHED), late, {}, T0, progress=record), S)
    assert p.status["phase"] == "Restarting" and p.status["failures"] == {"StartTimeout": 1}


SAID = "configuration error: model.hfUri: s3://models/llama: the bucket does not exist"


@pytest.mark.parametrize("restart_policy, state", [
    ("Never", {"terminated": {"exitCode": 2, "reason": "Error", "message": SAID + "\n"}}),
    ("OnFailure", {"waiting": {"reason": "CrashLoopBackOff"}}),  # the kubelet retries it: its last exit counts
])
def test_a_fetch_that_exits_2_fails_the_job_once_naming_the_field_and_the_uri(restart_policy, state):
    bad = in_fetch(pod(1), state, phase="Failed" if restart_policy == "Never" else "Pending")
    bad["spec"]["restartPolicy"] = restart_policy
    bad["status"]["initContainerStatuses"][0]["lastState"] = {"terminated": {"exitCode": 2, "message": SAID}}
    st = {"phase": "Created", "gangCreated": True}
    p = plan(Observation(body(st, **FETCHED), [in_fetch(pod(0), {"running": {}}), bad], {}, T0), S)
    message = (f"worker 1's fetch exited with code 2 ({SAID}), listed in restartPolicy.permanentExitCodes: "
               "not restarting")
    assert (p.status["phase"], p.status["reason"], p.status["message"]) == ("Failed", "PermanentError", message)
    assert ("Warning", "PermanentError", message) in p.events
    transient = in_fetch(pod(1), {"terminated": {"exitCode": 1, "reason": "Error"}}, phase="Failed")
    transient["spec"]["restartPolicy"] = "Never"
    p = plan(Observation(body(st, **FETCHED), [in_fetch(pod(0), {"running": {}}), transient], {}, T0), S)
    assert p.status["phase"] == "Restarting" and p.status["message"].startswith("worker 1's fetch exited with code 1:")


def peers_lost(p: dict, since: str = "2026-03-01T11:59:50Z") -> dict:
    """A kept worker whose launcher closed its readiness probe's port after its processes lost their peers."""
    p["status"]["containerStatuses"] = [{"name": "trainer", "ready": False,
                                         "state": {"running": {"startedAt": "2026-03-01T11:00:00Z"}}}]
    p["status"]["conditions"] = [{"type": "Ready", "status": "False", "lastTransitionTime": since}]
    return p


def test_a_silent_node_under_a_gang_that_lost_its_peers_restarts_it_at_once():
    """Worker 0 waits for the next generation (its peers went away) and worker 1's node has not renewed its
    Lease for 20 s: the gang restarts now, within the grace, and worker 1's pod is forced off the node."""
    st = {"phase": "Running", "gangCreated": True, "runningSince": "2026-03-01T11:00:00Z", "currentStep": 40,
          "lastProgressTime": "2026-03-01T11:59:48Z"}
    silent = {"n2": T0 - timedelta(seconds=21)}  # the controller's cache.silent, merged into the nodes
    p = plan(Observation(body(status=st), [peers_lost(pod(0)), pod(1, node="n2")], silent, T0), S)
    assert p.status["phase"] == "Restarting" and p.status["failures"] == {"NodeLost": 1}, p.status
    assert "j-worker-1" in p.delete_pods and "j-worker-0" not in p.delete_pods  # worker 0 is kept in place
    going = [peers_lost(pod(0)), pod(1, gen=0, node="n2", deleting=True)]
    assert plan(Observation(body(status=p.status), going, silent, T0), S).force_delete_pods == ["j-worker-1"]
    calm = plan(Observation(body(status=st), [pod(0), pod(1, node="n2")], silent, T0), S)
    assert calm.status["phase"] == "Running"  # nobody lost a peer: the grace counts from the last progress


def test_after_a_silent_node_s_restart_its_new_worker_avoids_the_node_and_the_waiting_one_restarts_nothing():
    """The restart above is done: worker 1 is created off the silent node (the scheduler would put it back until
    the node is NotReady), and worker 0, still waiting for the generation that restart began, is no new loss."""
    st = {"phase": "Running", "gangCreated": True, "runningSince": "2026-03-01T11:00:00Z", "currentStep": 40,
          "lastProgressTime": "2026-03-01T11:59:48Z"}
    silent = {"n2": T0 - timedelta(seconds=21)}
    p = plan(Observation(body(status=st), [peers_lost(pod(0)), pod(1, node="n2")], silent, T0), S)
    later = T0 + timedelta(seconds=2)
    kept = [peers_lost(pod(0, gen=1))]
    q = plan(Observation(body(status=p.status), kept, silent, later, silent=frozenset(silent)), S)
    [new] = [o for o in q.create if o["kind"] == "Pod"]
    terms = new["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["n2"]} in \
        terms["nodeSelectorTerms"][0]["matchExpressions"], new["spec"]
    placed = [peers_lost(pod(0, gen=1)), pod(1, gen=1, node="n2")]  # had it gone there anyway
    again = plan(Observation(body(status={**p.status, "phase": "Running"}), placed, silent, later), S)
    assert again.decision is None or again.decision.failure_kind is None, again.decision  # no second NodeLost


def test_the_operators_slim_copy_of_a_pod_still_says_it_lost_its_peers():
    """The pod cache drops the containers of every pod (slim_pod) but the gang probe's variable, from which
    pod_facts knows that the pod's readiness is the probe's: without it a lost peer was never seen."""
    whole = peers_lost(pod(0))
    assert facts(whole).peers_lost_since is not None
    assert facts(slim_pod(copy.deepcopy(whole))).peers_lost_since == facts(whole).peers_lost_since
    assert silence_checks([slim_pod(copy.deepcopy(whole)), slim_pod(pod(1, node="n2"))], {}, {}) == {"n2"}


def test_leases_are_read_while_a_worker_lost_its_peers_and_while_a_node_is_silent():
    whole, broken = [pod(0), pod(1, node="n2")], [peers_lost(pod(0)), pod(1, node="n2")]
    assert silence_checks(whole, {}, {}) == set()
    assert silence_checks(broken, {}, {}) == {"n2"}  # n1's kubelet just said worker 0 is not Ready
    assert silence_checks(broken, {"n2": T0}, {}) == set()  # NotReady already: nothing to read
    assert silence_checks(whole, {}, {"n2": T0}) == {"n2"}  # found silent: read until it speaks again
    assert forgotten({"n2": T0 - timedelta(seconds=121), "n3": T0 - timedelta(seconds=30)}, T0) == ["n2"]
    assert silent_for(None, T0) is None
    assert silent_for(T0 - timedelta(seconds=5), T0) == 15.0
    assert silent_for(T0 - timedelta(seconds=25), T0) == 0.0


def reported_frozen(at: datetime) -> list[dict]:
    """Worker 0 ended hung, its report naming worker 1 (on n2) as not answering; worker 1's pod still Running."""
    w0 = pod(0, phase="Failed", exit_code=contract.HUNG_EXIT_CODE)
    report = HangReport(40, 9.0, 5.0, (RankReport(0, 40, "running", "in all_reduce"),), "/d", at=at.timestamp(),
                        generation=0, unanswered=(1,))
    w0["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = report.encode()
    w1 = pod(1, node="n2")
    for p in (w0, w1):
        p["metadata"]["creationTimestamp"] = "2026-03-01T11:00:00Z"
    return [w0, w1]


def test_the_node_of_a_worker_that_did_not_answer_is_read_and_its_successor_is_not():
    pods = reported_frozen(T0 - timedelta(seconds=1))
    assert facts(pods[0]).hang is not None and facts(pods[0]).hang.unanswered == (1,)
    assert unanswering_nodes(pods, T0) == {"n2": T0 - timedelta(seconds=1)}
    pods[1]["metadata"]["creationTimestamp"] = "2026-03-01T12:00:00Z"  # worker 1's next pod, made after the report
    assert unanswering_nodes(pods, T0) == {}
    assert unanswering_nodes([pod(0), pod(1, node="n2")], T0) == {}


@pytest.mark.parametrize(("renewed", "silent"), [(-4.0, True), (+2.0, False)])
def test_a_node_whose_worker_did_not_answer_is_silent_until_its_kubelet_speaks_after(renewed, silent):
    """The controller reads the node's Lease: renewed before the report (4 s earlier: nowhere near the 20 s
    that would say so alone), the kubelet fell silent with its worker, and the node is lost to the job now;
    renewed after it, only the worker failed."""
    reported = T0 - timedelta(seconds=1)
    ctl = Controller(client.ApiClient(), OperatorSettings(), clock=lambda: T0)
    try:
        key = ("ns", "j")
        ctl.job_event("ADDED", body())
        for p in reported_frozen(reported):
            p["metadata"].update(resourceVersion="5", ownerReferences=[{"uid": "uid-1"}])
            ctl.pod_event("ADDED", p)
        assert len(ctl.cache.pods(key)) == 2

        async def heard_at(node):
            return reported + timedelta(seconds=renewed) if node == "n2" else T0

        ctl.applier.node_heard_at = heard_at  # the Lease, as the API server would give it
        asyncio.run(ctl._check_silence(key))
        assert ("n2" in ctl.cache.silent) is silent, ctl.cache.silent
        assert "n1" not in ctl.cache.silent
    finally:
        ctl.applier.close()


def test_a_worker_still_ready_seconds_after_its_peer_lost_it_has_its_node_read():
    """A killed node: worker 0 lost its peers at 11:59:50 (its kubelet said so within a second), and worker 1's
    pod on n2 still says Ready, as it did before: its kubelet reports nothing. Its node is read against that
    moment once PEERS_LOST_SETTLE_SECONDS have passed; a pod Ready again since, or made since, is not."""
    lost = datetime(2026, 3, 1, 11, 59, 50, tzinfo=UTC)
    w1 = pod(1, node="n2")
    w1["status"]["conditions"][0]["lastTransitionTime"] = "2026-03-01T11:00:30Z"
    pods = [peers_lost(pod(0)), w1]
    for p in pods:
        p["metadata"]["creationTimestamp"] = "2026-03-01T11:00:00Z"
    assert unanswering_nodes(pods, lost + timedelta(seconds=PEERS_LOST_SETTLE_SECONDS)) == {"n2": lost}
    assert unanswering_nodes(pods, lost + timedelta(seconds=3)) == {}  # its kubelet may still say so
    assert settles_in(pods, lost + timedelta(seconds=3)) == pytest.approx(PEERS_LOST_SETTLE_SECONDS - 3)
    assert settles_in(pods, lost + timedelta(seconds=9)) is None
    again = copy.deepcopy(pods)
    again[1]["status"]["conditions"][0]["lastTransitionTime"] = "2026-03-01T11:59:52Z"  # restarted, Ready again
    assert unanswering_nodes(again, T0) == {}
    successor = copy.deepcopy(pods)
    successor[1]["metadata"]["creationTimestamp"] = "2026-03-01T11:59:55Z"
    assert unanswering_nodes(successor, T0) == {}
    assert unanswering_nodes([pods[0], pod(1, node="n2", ready=False)], T0) == {}


def test_a_silent_node_that_speaks_again_leaves_the_mark_though_no_pod_of_the_job_is_there():
    """A node marked silent is read again by any job's reconcile: restored, it must not keep every job's new
    pods off it until the mark is forgotten."""
    reported = T0 - timedelta(seconds=1)
    ctl = Controller(client.ApiClient(), OperatorSettings(), clock=lambda: T0)
    lease = {"n2": reported - timedelta(seconds=4)}

    async def heard_at(node):
        return lease.get(node, T0)

    try:
        ctl.job_event("ADDED", body())
        for p in reported_frozen(reported):
            p["metadata"].update(resourceVersion="5", ownerReferences=[{"uid": "uid-1"}])
            ctl.pod_event("ADDED", p)
        ctl.applier.node_heard_at = heard_at
        asyncio.run(ctl._check_silence(("ns", "j")))
        assert "n2" in ctl.cache.silent
        other = body()
        other["metadata"].update(name="other", uid="uid-2")
        ctl.job_event("ADDED", other)  # no pod anywhere
        lease["n2"] = T0  # its kubelet is back
        ctl._leases.clear()  # past LEASE_READ_SECONDS
        asyncio.run(ctl._check_silence(("ns", "other")))
        assert "n2" not in ctl.cache.silent and "n2" not in ctl.cache.unanswering
    finally:
        ctl.applier.close()


def test_a_recent_verdict_of_a_worker_not_answering_names_its_node_after_the_report_is_gone():
    """The restart a report began clears it from the pods (worker 0 runs the next generation); the verdict in
    status.lastHang still names the node, so a reconcile that missed the report marks the node all the same."""
    verdict = {"time": "2026-03-01T11:59:58Z", "generation": 0, "suspects": [
        {"rank": 1, "worker": 1, "pod": "j-worker-1", "node": "n2", "where": hangs.NOT_ANSWERING},
        {"rank": 0, "worker": 0, "pod": "j-worker-0", "node": "n1", "where": "in all_reduce"}]}
    assert unanswering_nodes([pod(0)], T0, verdict) == {"n2": T0 - timedelta(seconds=2)}
    assert unanswering_nodes([pod(0)], T0 + timedelta(seconds=SILENT_FORGET_SECONDS), verdict) == {}
    assert unanswering_nodes([pod(0)], T0, {**verdict, "suspects": verdict["suspects"][1:]}) == {}
