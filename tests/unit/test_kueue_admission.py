"""Kueue admission of queued jobs, as pure functions: the Workload, what its state means for the job, and
the plan a reconcile makes from it. The real Kueue runs in tests/integration/test_kueue.py."""

from datetime import UTC, datetime

from kubetrain.core import contract
from kubetrain.core.api import TrainingJob
from kubetrain.operator.jobs import builders as b
from kubetrain.operator.jobs.plan import Observation, plan
from kubetrain.operator.kueue import plan as kueue
from kubetrain.operator.kueue.plan import QueueView

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
S = b.WorkerSettings(trainer_image="trainer:test")
UID = "abcdef-123"


def body(status=None, labels=None, annotations=None, **spec):
    base = {"workers": 2, "resources": {"gpusPerWorker": 8}, "scheduling": {"queue": "team-a"}}
    base.update(spec)
    meta = {"name": "j", "namespace": "ns", "uid": UID, "generation": 1, "labels": labels or {},
            "annotations": annotations or {}, "creationTimestamp": "2026-03-01T11:59:00Z"}
    return {"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob", "metadata": meta, "spec": base,
            "status": status or {}}


def model(b_):
    return TrainingJob.model_validate({k: v for k, v in b_.items() if k != "status"})


def wl(conditions=(), admission=None, **spec_changes):
    job = model(body(**spec_changes))
    obj = kueue.workload(job, body(**spec_changes), b.worker_pod(job, 0, 0, S), None)
    obj["metadata"]["resourceVersion"] = "7"
    obj["status"] = {"conditions": [{"type": t, "status": s, "reason": r, "message": m,
                                     "lastTransitionTime": "2026-03-01T11:00:00Z"} for t, s, r, m in conditions]}
    if admission is not None:
        obj["status"]["admission"] = admission
    return obj


ADMISSION = {"clusterQueue": "cq", "podSetAssignments": [{"name": "workers", "count": 2,
                                                           "flavors": {"nvidia.com/gpu": "h100"}}]}
ADMITTED = [("QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue cq"),
            ("Admitted", "True", "Admitted", "The workload is admitted")]
FLAVORS = {"h100": {"nodeLabels": {"pool": "h100"}, "tolerations": [{"key": "gpu", "operator": "Exists"}]}}


def running_pod(i):
    p = b.worker_pod(model(body()), i, 0, S)
    p["status"] = {"phase": "Running"}
    return p


def qplan(view, b_=None, gang_gone=True, phase=None):
    b_ = b_ or body()
    job = model(b_)
    return kueue.plan_queue(job, b_, view, gang_gone, phase, lambda: b.worker_pod(job, 0, 0, S), T0)


def test_the_workload_is_one_pod_set_the_gang_in_the_jobs_queue_with_its_priority():
    job_body = body(labels={contract.KUEUE_PRIORITY_CLASS_LABEL: "high"},
                    annotations={contract.KUEUE_REQUIRED_TOPOLOGY: "cloud.provider.com/block"})
    job = model(job_body)
    w = kueue.workload(job, job_body, b.worker_pod(job, 0, 0, S), (kueue.WORKLOAD_PRIORITY_SOURCE, "high", 1000))
    assert w["apiVersion"] == "kueue.x-k8s.io/v1beta1" and w["metadata"]["name"] == "trainingjob-j-abcde"
    assert w["metadata"]["ownerReferences"][0]["uid"] == UID and w["metadata"]["labels"][contract.LABEL_JOB] == "j"
    spec = w["spec"]
    assert spec["queueName"] == "team-a" and spec["active"] is True
    assert (spec["priorityClassSource"], spec["priorityClassName"], spec["priority"]) == (
        "kueue.x-k8s.io/workloadpriorityclass", "high", 1000)
    (ps,) = spec["podSets"]
    assert ps["name"] == "workers" and ps["count"] == 2
    assert ps["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert ps["topologyRequest"] == {"required": "cloud.provider.com/block", "podIndexLabel": contract.LABEL_INDEX}


def test_a_new_queued_job_creates_its_workload_and_is_held_suspended():
    q = qplan(QueueView())
    assert q.hold and q.create is not None and q.create["spec"]["active"] is True and q.active is None
    assert q.condition is not None and q.condition[:2] == (False, "Queued")


def test_a_pending_workload_holds_the_job_and_says_what_kueue_says():
    why = "couldn't assign flavors to pod set workers: insufficient quota for nvidia.com/gpu, 16 more needed"
    q = qplan(QueueView(wl([("QuotaReserved", "False", "Pending", why)])))
    assert q.hold and q.create is None and q.condition is not None
    assert q.condition[1] == "Queued" and why in q.condition[2] and "team-a" in q.condition[2]


def test_admission_releases_the_gang_and_places_it_on_the_flavor():
    q = qplan(QueueView(wl(ADMITTED, ADMISSION), FLAVORS))
    assert not q.hold and q.active is None and q.condition == (True, "QuotaReserved", "Workload trainingjob-j-abcde "
                                                                 "admitted by ClusterQueue cq")
    assert q.placement is not None and q.placement.node_selector == {"pool": "h100"}
    pod = kueue.place(b.worker_pod(model(body(scheduling={"queue": "team-a", "nodeSelector": {"pool": "mine"}})),
                                   0, 0, S), q.placement)
    assert pod["spec"]["nodeSelector"] == {"pool": "mine"}  # the job's own key wins
    assert {"key": "gpu", "operator": "Exists"} in pod["spec"]["tolerations"]
    assert "schedulingGates" not in pod["spec"]


def test_a_gang_placed_by_topology_waits_at_kueues_gate():
    admission = {"clusterQueue": "cq", "podSetAssignments": [{**ADMISSION["podSetAssignments"][0],
                                                              "topologyAssignment": {"levels": ["block"]}}]}
    q = qplan(QueueView(wl(ADMITTED, admission), FLAVORS))
    pod = kueue.place(b.worker_pod(model(body()), 1, 0, S), q.placement)
    assert pod["spec"]["schedulingGates"] == [{"name": contract.KUEUE_TOPOLOGY_GATE}]
    assert pod["metadata"]["labels"][contract.KUEUE_TAS_LABEL] == "true"
    assert pod["metadata"]["labels"][contract.KUEUE_POD_SET_LABEL] == "workers"
    assert pod["metadata"]["annotations"][contract.KUEUE_WORKLOAD_ANNOTATION] == "trainingjob-j-abcde"


def test_eviction_stops_the_gang_and_gives_the_quota_back_only_once_it_is_gone():
    evicted = [*ADMITTED, ("Evicted", "True", "Preempted", "Preempted to accommodate a higher priority Workload")]
    running = qplan(QueueView(wl(evicted, ADMISSION)), gang_gone=False)
    assert running.hold and running.workload_status is None
    assert running.condition is not None and running.condition[1] == "Evicted" and "Preempted" in running.condition[2]
    gone = qplan(QueueView(wl(evicted, ADMISSION)), gang_gone=True)
    st = gone.workload_status
    assert gone.active is None and st is not None and st["admission"] is None
    conds = {c["type"]: c for c in st["conditions"]}
    assert conds["QuotaReserved"]["status"] == "False" and conds["QuotaReserved"]["reason"] == "Pending"
    assert conds["Admitted"]["status"] == "False" and conds["Requeued"]["status"] == "True"
    assert conds["Evicted"]["status"] == "True"  # Kueue's own to clear when it queues the Workload again


def test_a_finished_job_finishes_its_workload_once():
    q = qplan(QueueView(wl(ADMITTED, ADMISSION)), phase="Succeeded")
    st = q.workload_status
    assert st is not None and st["admission"] is None
    conds = {c["type"]: c for c in st["conditions"]}
    assert (conds["Finished"]["status"], conds["Finished"]["reason"]) == ("True", "Succeeded")
    assert conds["QuotaReserved"]["status"] == "False" and conds["Admitted"]["status"] == "False"
    done = wl([("Finished", "True", "Succeeded", "")])
    assert qplan(QueueView(done), phase="Succeeded").workload_status is None


def test_a_resized_gang_replaces_its_workload_after_its_pods_are_gone():
    old = wl(ADMITTED, ADMISSION)  # two workers
    resized = body(workers=4)
    running = qplan(QueueView(old), resized, gang_gone=False)
    assert running.hold and running.delete is None
    assert qplan(QueueView(old), resized, gang_gone=True).delete == "trainingjob-j-abcde"


def test_no_queue_or_a_volcano_queue_is_not_kueues():
    assert qplan(QueueView(), body(scheduling={})) == kueue.QueuePlan()
    assert qplan(QueueView(), body(scheduling={"queue": "v", "gang": "volcano"})) == kueue.QueuePlan()


def test_kueue_not_installed_or_a_missing_priority_class_is_said_and_looked_at_again():
    p = plan(Observation(body(), [], {}, T0, queue=QueueView(kueue_missing=True)), S)
    assert not [o for o in p.create if o["kind"] == "Pod"]
    cond = next(c for c in p.status["conditions"] if c["type"] == "Admitted")
    assert cond["reason"] == "KueueMissing" and "install Kueue" in cond["message"]
    assert ("Warning", "KueueMissing") in [e[:2] for e in p.events] and p.requeue_after == 30.0
    assert p.queue.create is not None, "the Workload is created as soon as Kueue is installed"
    p = plan(Observation(body(), [], {}, T0, queue=QueueView(priority_missing="WorkloadPriorityClass x does not exist")), S)
    assert next(c for c in p.status["conditions"] if c["type"] == "Admitted")["reason"] == "PriorityClassMissing"
    assert p.queue.create is None, "not without its priority"


def test_a_workload_name_held_by_someone_elses_workload_is_said_and_looked_at_again():
    taken = "Workload trainingjob-j-abcde exists and is not owned by this TrainingJob: not adopting it; delete or rename it"
    p = plan(Observation(body(), [], {}, T0, queue=QueueView(workload_foreign=taken)), S)
    assert p.status["phase"] == "Suspended" and not [o for o in p.create if o["kind"] == "Pod"]
    cond = next(c for c in p.status["conditions"] if c["type"] == "Admitted")
    assert (cond["status"], cond["reason"], cond["message"]) == ("False", "ForeignObject", taken)
    assert ("Warning", "ForeignObject") in [e[:2] for e in p.events] and p.requeue_after == 30.0
    assert p.queue.create is not None and p.queue.create["metadata"]["name"] == "trainingjob-j-abcde"


def test_reconcile_holds_a_queued_job_until_admitted_then_creates_placed_pods():
    held = plan(Observation(body(), [], {}, T0, queue=QueueView()), S)
    assert held.status["phase"] == "Suspended" and not [o for o in held.create if o["kind"] == "Pod"]
    assert held.queue.create is not None and "suspend" not in held.status
    assert ("Normal", "Queued") in [e[:2] for e in held.events]
    admitted = plan(Observation(body(status=held.status), [], {}, T0, queue=QueueView(wl(ADMITTED, ADMISSION),
                                                                                        FLAVORS)), S)
    pods = [o for o in admitted.create if o["kind"] == "Pod"]
    assert len(pods) == 2 and all(p_["spec"]["nodeSelector"] == {"pool": "h100"} for p_ in pods)
    assert admitted.queue.active is None and ("Normal", "QuotaReserved") in [e[:2] for e in admitted.events]


def test_reconcile_stops_an_evicted_gang_without_counting_a_failure():
    status = {"phase": "Running", "restartGeneration": 0, "gangCreated": True, "startTime": "2026-03-01T11:59:00Z"}
    evicted = wl([*ADMITTED, ("Evicted", "True", "Preempted", "preempted")], ADMISSION)
    p = plan(Observation(body(status=status), [running_pod(0), running_pod(1)], {}, T0, queue=QueueView(evicted)), S)
    assert sorted(p.delete_pods) == ["j-worker-0", "j-worker-1"] and p.status["phase"] == "Suspended"
    assert p.status.get("restartCount", 0) == 0 and ("Warning", "Evicted") in [e[:2] for e in p.events]


def test_a_job_another_controller_manages_gets_only_its_workload():
    b_ = body(managedBy="kueue.x-k8s.io/multikueue")
    p = plan(Observation(b_, [], {}, T0, queue=QueueView(wl(ADMITTED, ADMISSION))), S)
    assert p.create == [] and p.status is None and p.events == [] and p.queue.active is None
    p = plan(Observation(body(managedBy=contract.MANAGED_BY_OPERATOR, scheduling={}), [], {}, T0), S)
    assert [o["kind"] for o in p.create].count("Pod") == 2


def test_a_job_whose_stored_spec_is_refused_fails_and_finishes_its_workload():
    """A spec the CRD accepted that this operator's model refuses (one written under an older schema, say): the
    job fails, and its admitted Workload gives its quota back instead of holding the queue for ever."""
    bad = body(model={"dModel": 100, "nHeads": 3})
    p = plan(Observation(bad, [], {}, T0, queue=QueueView(wl(ADMITTED, ADMISSION))), S)
    assert p.status["phase"] == "Failed" and p.status["reason"] == "InvalidSpec"
    st = p.queue.workload_status
    assert st is not None and st["admission"] is None
    conds = {c["type"]: c for c in st["conditions"]}
    assert (conds["Finished"]["status"], conds["Finished"]["reason"]) == ("True", "Failed")
    assert conds["QuotaReserved"]["status"] == "False" and conds["Admitted"]["status"] == "False"
    failed = plan(Observation(bad | {"status": p.status}, [], {}, T0, queue=QueueView(wl([("Finished", "True", "Failed", "")]))), S)
    assert failed.status is None and failed.queue == kueue.QueuePlan()
    assert plan(Observation(bad, [], {}, T0), S).queue == kueue.QueuePlan()  # no Workload: nothing to finish


def test_the_plan_that_ends_a_queued_job_finishes_its_workload_too():
    status = {"phase": "Running", "restartGeneration": 0, "gangCreated": True, "startTime": "2026-03-01T11:59:00Z"}
    done = running_pod(0)
    done["status"] = {"phase": "Succeeded", "containerStatuses": [
        {"name": "trainer", "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}]}
    p = plan(Observation(body(status=status), [done, running_pod(1)], {}, T0, queue=QueueView(wl(ADMITTED, ADMISSION), FLAVORS)), S)
    assert p.status["phase"] == "Succeeded"
    conds = {c["type"]: c for c in p.queue.workload_status["conditions"]}
    assert (conds["Finished"]["status"], conds["Finished"]["reason"]) == ("True", "Succeeded")


DEACTIVATED = ("Evicted", "True", "Deactivated", "The workload is deactivated")


def test_suspending_an_admitted_job_deactivates_its_workload_and_stops_the_gang():
    q = qplan(QueueView(wl(ADMITTED, ADMISSION), FLAVORS), body(suspend=True), gang_gone=False)
    assert q.active is False and q.hold and q.placement is None
    assert q.condition is not None and q.condition[:2] == (False, "Deactivated")
    assert "trainingjob-j-abcde deactivated" in q.condition[2] and "spec.suspend" in q.condition[2]
    evicted = wl([*ADMITTED, DEACTIVATED], ADMISSION, suspend=True)  # Kueue's answer to spec.active false
    running = qplan(QueueView(evicted), body(suspend=True), gang_gone=False)
    assert running.active is None and running.hold and running.workload_status is None
    gone = qplan(QueueView(evicted), body(suspend=True), gang_gone=True)
    assert gone.workload_status is not None and gone.workload_status["admission"] is None  # the quota goes back
    assert gone.condition is not None and gone.condition[1] == "Deactivated"


def test_a_job_created_suspended_gets_an_inactive_workload():
    q = qplan(QueueView(), body(suspend=True))
    assert q.create is not None and q.create["spec"]["active"] is False and q.hold
    assert q.create["metadata"]["annotations"] == {contract.WORKLOAD_SUSPENDED_ANNOTATION: "true"}
    assert q.condition is not None and q.condition[1] == "Deactivated"


def test_resuming_activates_the_workload_which_queues_again():
    inactive = wl([("QuotaReserved", "False", "Pending", "Deactivated"), DEACTIVATED], suspend=True)
    q = qplan(QueueView(inactive))
    assert q.active is True and q.hold and q.condition is not None and q.condition[1] == "Queued"
    reactivated = wl([("QuotaReserved", "False", "Pending", "waiting"), ("Requeued", "True", "Reactivated", ""),
                      DEACTIVATED])  # Kueue clears Evicted only when it reserves quota again
    q = qplan(QueueView(reactivated))
    assert q.active is None and q.hold and q.condition is not None and q.condition[1] == "Queued"


def test_a_workload_deactivated_by_kueue_or_an_admin_stays_deactivated():
    theirs = wl([("QuotaReserved", "False", "Pending", ""), DEACTIVATED])
    theirs["spec"]["active"] = False
    q = qplan(QueueView(theirs))
    assert q.active is None and q.hold and q.condition is not None and q.condition[1] == "Evicted"


def test_reconcile_suspends_an_admitted_running_job_without_undoing_its_suspend():
    status = {"phase": "Running", "restartGeneration": 0, "gangCreated": True, "startTime": "2026-03-01T11:59:00Z"}
    p = plan(Observation(body(status=status, suspend=True), [running_pod(0), running_pod(1)], {}, T0,
                         queue=QueueView(wl(ADMITTED, ADMISSION), FLAVORS)), S)
    assert sorted(p.delete_pods) == ["j-worker-0", "j-worker-1"] and p.status["phase"] == "Suspended"
    assert p.status.get("restartCount", 0) == 0 and p.queue.active is False
    cond = next(c for c in p.status["conditions"] if c["type"] == "Admitted")
    assert (cond["status"], cond["reason"]) == ("False", "Deactivated")
