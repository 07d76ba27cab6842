"""Kueue admission for jobs with spec.scheduling.queue, as pure functions.

Kueue admits Workloads; it has no integration of its own for TrainingJobs. The operator plays the part
Kueue's job integrations play for built-in kinds: it keeps one Workload per job (one pod set: the gang),
holds the gang until Kueue admits that Workload (worker pods then carry the assigned flavors' node labels
and tolerations, or wait at Kueue's topology gate), stops it on eviction, gives the quota back (clears the
admission) once the evicted gang is gone, and marks the Workload Finished when the job ends.

spec.suspend is the user's alone: the hold is never written into it. A suspended job's Workload is
deactivated (spec.active false, Kueue's own way to stop a Workload: it evicts it and queues it no more), and
resuming activates it again. The I/O is in kueue/io.py; the lifecycle sees only "suspended".
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kubetrain.core import contract
from kubetrain.core.api import ADMITTED, FINISHED_PHASES, ConditionReason, Phase, TrainingJob
from kubetrain.core.lifecycle import set_condition
from kubetrain.operator.runtime.objects import owner_reference

__all__ = ["Placement", "QueuePlan", "QueueView", "kueue_queue", "place", "plan_invalid", "plan_queue", "workload",
           "workload_name"]

WORKLOAD_API_VERSION = f"{contract.KUEUE_GROUP}/{contract.KUEUE_VERSION}"
WORKLOAD_PRIORITY_SOURCE = "kueue.x-k8s.io/workloadpriorityclass"
POD_PRIORITY_SOURCE = "scheduling.k8s.io/priorityclass"
LOOK_AGAIN = frozenset({ConditionReason.KUEUE_MISSING, ConditionReason.PRIORITY_CLASS_MISSING,
                        ConditionReason.FOREIGN_OBJECT})
"""Admitted reasons that no watched object's event ends (a CRD or a priority class created, a foreign Workload
deleted: it carries no job label, so the Workload watch does not see it)."""
LOOK_AGAIN_SECONDS = 30.0
REQUEUED_REASONS = frozenset({"Preempted", "NodeFailures"})
"""Eviction reasons after which Kueue's own integrations mark a Workload Requeued=True."""


@dataclass(frozen=True)
class QueueView:
    """What the I/O layer found for one queued job, beyond its Workload."""

    workload: dict[str, Any] | None = None
    flavors: dict[str, dict[str, Any]] = field(default_factory=dict)
    """ResourceFlavor name -> its spec, for the flavors the Workload's admission names."""
    priority: tuple[str, str, int] | None = None
    """(source, class name, value) of the Workload's priority; None: no priority class."""
    priority_missing: str | None = None
    """The message when the priority class named on the job does not exist."""
    kueue_missing: bool = False
    """The API server does not serve Kueue's Workload kind."""
    workload_foreign: str | None = None
    """The message when the Workload's name is held by an object this job does not own."""


@dataclass(frozen=True)
class Placement:
    """Where Kueue's admission puts the gang: merged into every worker pod."""

    workload: str
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    topology: bool = False
    """Admitted by topology-aware scheduling: pods wait at Kueue's topology gate for their nodes."""


@dataclass
class QueuePlan:
    hold: bool = False
    """No gang may run: the job counts as suspended (beside its own spec.suspend)."""
    active: bool | None = None
    """The Workload's spec.active to write (false while the job is suspended); None: it already says so."""
    create: dict[str, Any] | None = None
    delete: str | None = None
    """A Workload that no longer describes the gang (its size changed): deleted once the gang is gone."""
    workload_status: dict[str, Any] | None = None
    """The Workload's new status (written with its resourceVersion as a precondition)."""
    condition: tuple[bool, str, str] | None = None
    """The job's Admitted condition: (value, reason, message)."""
    placement: Placement | None = None


def kueue_queue(job: TrainingJob) -> str | None:
    """The job's Kueue LocalQueue: spec.scheduling.queue, unless it names the Volcano queue of `gang: volcano`."""
    sched = job.spec.scheduling
    return None if sched.gang == "volcano" else sched.queue


def workload_name(job: TrainingJob, uid: str) -> str:
    """Per job incarnation: a job deleted and created again under its name never meets the old Workload."""
    return f"trainingjob-{job.metadata.name}-{uid[:5]}"


def workload(job: TrainingJob, body: dict[str, Any], pod: dict[str, Any],
             priority: tuple[str, str, int] | None) -> dict[str, Any]:
    """The Workload Kueue admits for the job: one pod set, the gang, with `pod` (a worker pod of the job) as
    its template (Kueue sums its requests and matches its node selector and affinity against the flavors)."""
    pod_set: dict[str, Any] = {
        "name": contract.WORKLOAD_POD_SET, "count": job.spec.workers,
        "template": {"metadata": {"labels": pod["metadata"]["labels"]}, "spec": pod["spec"]},
    }
    annotations = (body.get("metadata") or {}).get("annotations") or {}
    topology = {"required": annotations.get(contract.KUEUE_REQUIRED_TOPOLOGY),
                "preferred": annotations.get(contract.KUEUE_PREFERRED_TOPOLOGY)}
    if any(topology.values()):
        pod_set["topologyRequest"] = {k: v for k, v in topology.items() if v} | {
            "podIndexLabel": contract.LABEL_INDEX}
    spec: dict[str, Any] = {"queueName": job.spec.scheduling.queue, "podSets": [pod_set],
                            "active": not job.spec.suspend}
    if priority is not None:
        spec.update(priorityClassSource=priority[0], priorityClassName=priority[1], priority=priority[2])
    meta = {"name": workload_name(job, body["metadata"]["uid"]), "namespace": job.metadata.namespace,
            "labels": {contract.LABEL_JOB: job.metadata.name, contract.QUEUE_LABEL: str(job.spec.scheduling.queue)},
            "ownerReferences": [owner_reference(body)]}
    if job.spec.suspend:
        meta["annotations"] = {contract.WORKLOAD_SUSPENDED_ANNOTATION: "true"}
    return {"apiVersion": WORKLOAD_API_VERSION, "kind": "Workload", "metadata": meta, "spec": spec}


def _condition(obj: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == type_), None)


def _holds(obj: dict[str, Any], type_: str) -> bool:
    c = _condition(obj, type_)
    return c is not None and c.get("status") == "True"


def _pod_set(wl: dict[str, Any]) -> dict[str, Any]:
    return next(iter((wl.get("spec") or {}).get("podSets") or []), {})


def _matches(existing: dict[str, Any], desired: dict[str, Any]) -> bool:
    """Whether the Workload still describes the gang: its size and every container's requests."""
    have, want = _pod_set(existing), _pod_set(desired)

    def requests(ps: dict[str, Any]) -> list[Any]:
        spec = (ps.get("template") or {}).get("spec") or {}
        return [(c.get("resources") or {}) for c in [*spec.get("initContainers", []), *spec.get("containers", [])]]
    return have.get("count") == want.get("count") and requests(have) == requests(want)


def plan_queue(job: TrainingJob, body: dict[str, Any], view: QueueView, gang_gone: bool, phase: str | None,
               pod: Callable[[], dict[str, Any]], now: datetime) -> QueuePlan:
    """What Kueue's view of a queued job means for it. `gang_gone`: no worker pod of the job is still
    running or terminating (an evicted gang's quota is given back only then); `phase`: the job's phase;
    `pod`: builds a worker pod of the job (the Workload's template; only queued jobs need one)."""
    if kueue_queue(job) is None:
        return QueuePlan()
    wl = view.workload
    if phase in FINISHED_PHASES:
        return _finished(wl, str(phase), now)
    desired = workload(job, body, pod(), view.priority)
    if (blocked := _blocked(view)) is not None:  # the create is tried again each LOOK_AGAIN_SECONDS
        retry = wl is None and not view.priority_missing
        return QueuePlan(hold=gang_gone, condition=(False, *blocked), create=desired if retry else None)
    if wl is None:
        return _suspended(job, desired, QueuePlan(hold=gang_gone, condition=_queued(job, None), create=desired))
    return _suspended(job, wl, _planned(job, wl, desired, view, gang_gone, now))


def _planned(job: TrainingJob, wl: dict[str, Any], desired: dict[str, Any], view: QueueView, gang_gone: bool,
             now: datetime) -> QueuePlan:
    """The plan of a queued job whose Workload exists, by that Workload's state."""
    if not _matches(wl, desired):
        message = f"the gang changed: Workload {wl['metadata']['name']} is replaced once its pods are gone"
        return QueuePlan(hold=True, condition=(False, ConditionReason.QUEUED, message),
                         delete=wl["metadata"]["name"] if gang_gone else None)
    plan = QueuePlan(active=_activity(job, wl))
    if plan.active is not True and _evicted_now(wl):  # activated: it queues again
        return _evicted(wl, gang_gone, plan, now)
    if _holds(wl, "Admitted"):
        cq = ((wl.get("status") or {}).get("admission") or {}).get("clusterQueue", "")
        plan.condition = (True, str(ConditionReason.QUOTA_RESERVED), f"Workload {wl['metadata']['name']} admitted "
                          f"by ClusterQueue {cq}")
        plan.placement = placement(wl, view.flavors)
        return plan
    plan.hold, plan.condition = True, _queued(job, wl)
    return plan


def _activity(job: TrainingJob, wl: dict[str, Any]) -> bool | None:
    """The spec.active to write: false when the job is suspended, true again on resume only where this
    operator deactivated it (WORKLOAD_SUSPENDED_ANNOTATION); None: leave it."""
    active = (wl.get("spec") or {}).get("active", True)
    ours = contract.WORKLOAD_SUSPENDED_ANNOTATION in ((wl.get("metadata") or {}).get("annotations") or {})
    if job.spec.suspend and active:
        return False
    if not job.spec.suspend and not active and ours:
        return True
    return None


def _evicted_now(wl: dict[str, Any]) -> bool:
    """Evicted, and not merely still marked so by a deactivation that ended (Kueue clears the condition only
    when it reserves quota again: until then the Workload queues)."""
    ev = _condition(wl, "Evicted")
    if ev is None or ev.get("status") != "True":
        return False
    ended = ev.get("reason") == "Deactivated" and (wl.get("spec") or {}).get("active", True)
    return not (ended and (wl.get("status") or {}).get("admission") is None)


def _suspended(job: TrainingJob, wl: dict[str, Any], plan: QueuePlan) -> QueuePlan:
    """A suspended job's plan says so: its Workload deactivated (or being), Kueue's quota not its to wait for."""
    if not job.spec.suspend or plan.delete is not None:
        return plan
    plan.hold = True
    plan.placement = None
    plan.condition = (False, str(ConditionReason.DEACTIVATED), f"Workload {wl['metadata']['name']} deactivated: "
                      "the job is suspended (spec.suspend); resuming activates it again")
    return plan


def _blocked(view: QueueView) -> tuple[str, str] | None:
    """(reason, message) when the job's Workload cannot be made as it is; None when nothing stands in the way."""
    if view.kueue_missing:
        return (ConditionReason.KUEUE_MISSING, f"the API server does not serve {WORKLOAD_API_VERSION} Workload: "
                "install Kueue to run a job with spec.scheduling.queue")
    if view.priority_missing:
        return ConditionReason.PRIORITY_CLASS_MISSING, view.priority_missing
    if view.workload_foreign:
        return ConditionReason.FOREIGN_OBJECT, view.workload_foreign
    return None


def plan_invalid(view: QueueView, now: datetime) -> QueuePlan:
    """A job whose stored spec this operator refuses fails: its Workload, if it has one, is finished, so that
    its quota and its place in the queue go to the jobs behind it."""
    return _finished(view.workload, Phase.FAILED, now)


def _finished(wl: dict[str, Any] | None, phase: str, now: datetime) -> QueuePlan:
    """The plan of a job that ended: its Workload (if any) Finished."""
    return QueuePlan(workload_status=None if wl is None else _finish(wl, phase, now))


def _queued(job: TrainingJob, wl: dict[str, Any] | None) -> tuple[bool, str, str]:
    reserved = _condition(wl, "QuotaReserved") if wl is not None else None
    why = (reserved or {}).get("message") or "waiting for Kueue to admit it"
    name = wl["metadata"]["name"] if wl is not None else "(being created)"
    return False, str(ConditionReason.QUEUED), f"Workload {name} in LocalQueue {job.spec.scheduling.queue}: {why}"


def _evicted(wl: dict[str, Any], gang_gone: bool, plan: QueuePlan, now: datetime) -> QueuePlan:
    """Kueue evicted the Workload: stop the gang (it checkpoints on SIGTERM); once its pods are gone, give
    the quota back (clear the admission) so that Kueue can queue the Workload again."""
    ev = _condition(wl, "Evicted") or {}
    message = f"Workload {wl['metadata']['name']} evicted by Kueue ({ev.get('reason')}): {ev.get('message', '')}"
    plan.hold, plan.condition = True, (False, str(ConditionReason.EVICTED), message)
    if gang_gone and (wl.get("status") or {}).get("admission") is not None:
        plan.workload_status = _unreserved(wl, str(ev.get("reason") or ""), str(ev.get("message") or ""), now)
    return plan


def _with(status: dict[str, Any], type_: str, value: bool, reason: str, message: str,
          now: datetime) -> dict[str, Any]:
    conds = set_condition(status.get("conditions") or [], type_, value, reason, message[:32768], now,
                          add_false=True)
    return {**status, "conditions": conds}


def _unreserved(wl: dict[str, Any], reason: str, message: str, now: datetime) -> dict[str, Any]:
    """As Kueue's integrations leave an evicted Workload once its job stopped: no admission,
    QuotaReserved and Admitted False, Requeued (True after a preemption or a node failure)."""
    status = {**(wl.get("status") or {}), "admission": None}
    status = _with(status, "Requeued", reason in REQUEUED_REASONS, reason or "Evicted", message, now)
    status = _with(status, "QuotaReserved", False, "Pending", message, now)
    if _holds(wl, "Admitted"):
        status = _with(status, "Admitted", False, "NoReservation", "The workload has no reservation", now)
    return status


def _finish(wl: dict[str, Any], phase: str, now: datetime) -> dict[str, Any] | None:
    """The Workload of a finished job: Finished, its quota released. None when it already says so."""
    if _holds(wl, "Finished"):
        return None
    reason = "Succeeded" if phase == Phase.SUCCEEDED else "Failed"
    status = {**(wl.get("status") or {}), "admission": None}
    status = _with(status, "Finished", True, reason, f"TrainingJob {phase}", now)
    status = _with(status, "QuotaReserved", False, "Finished", "Workload has finished", now)
    if _holds(wl, "Admitted"):
        status = _with(status, "Admitted", False, "Finished", "Workload has finished", now)
    return status


def placement(wl: dict[str, Any], flavors: dict[str, dict[str, Any]]) -> Placement:
    """The admitted pod set's flavors' node labels and tolerations, and whether Kueue placed it by topology."""
    assignments = ((wl.get("status") or {}).get("admission") or {}).get("podSetAssignments") or []
    psa: dict[str, Any] = next((a for a in assignments if a.get("name") == contract.WORKLOAD_POD_SET), {})
    selector: dict[str, str] = {}
    tolerations: list[dict[str, Any]] = []
    for name in sorted(set((psa.get("flavors") or {}).values())):
        spec = flavors.get(name) or {}
        selector.update(spec.get("nodeLabels") or {})
        tolerations.extend(t for t in spec.get("tolerations") or [] if t not in tolerations)
    return Placement(wl["metadata"]["name"], selector, tuple(tolerations), psa.get("topologyAssignment") is not None)


def flavor_names(wl: dict[str, Any] | None) -> list[str]:
    """The ResourceFlavors an admitted Workload's pod set was assigned."""
    if wl is None:
        return []
    assignments = ((wl.get("status") or {}).get("admission") or {}).get("podSetAssignments") or []
    return sorted({f for a in assignments for f in (a.get("flavors") or {}).values()})


def place(pod: dict[str, Any], where: Placement | None) -> dict[str, Any]:
    """A worker pod with Kueue's placement: the flavors' node labels (the job's own keys win, as Kueue's
    integrations refuse to override them) and tolerations; the topology gate when Kueue assigns its node."""
    if where is None:
        return pod
    pod = copy.deepcopy(pod)
    spec, meta = pod["spec"], pod["metadata"]
    spec["nodeSelector"] = {**where.node_selector, **(spec.get("nodeSelector") or {})}
    spec["tolerations"] = [*(spec.get("tolerations") or []),
                           *(t for t in where.tolerations if t not in (spec.get("tolerations") or []))]
    for key in ("nodeSelector", "tolerations"):
        if not spec[key]:
            del spec[key]
    if where.topology:
        spec["schedulingGates"] = [*(spec.get("schedulingGates") or []), {"name": contract.KUEUE_TOPOLOGY_GATE}]
        meta["labels"].update({contract.KUEUE_TAS_LABEL: "true", contract.KUEUE_POD_SET_LABEL: contract.WORKLOAD_POD_SET})
        meta.setdefault("annotations", {})[contract.KUEUE_WORKLOAD_ANNOTATION] = where.workload
    return pod


def admitted_condition(conditions: list[dict[str, Any]], plan: QueuePlan, now: datetime
                       ) -> tuple[list[dict[str, Any]], tuple[str, str, str] | None]:
    """The job's conditions with its Admitted condition, and an Event when its reason changes."""
    if plan.condition is None:
        return conditions, None
    value, reason, message = plan.condition
    old = next((c for c in conditions if c.get("type") == ADMITTED), None)
    event = None
    if old is None or old.get("reason") != reason:
        event = ("Warning" if reason in {ConditionReason.EVICTED, *LOOK_AGAIN} else "Normal", reason, message)
    return set_condition(conditions, ADMITTED, value, reason, message, now, add_false=True), event
