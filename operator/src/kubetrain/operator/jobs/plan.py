"""One reconcile, as pure functions: observe the pods -> lifecycle.step -> a Plan of API calls.

`plan(seen, settings)` takes one Observation (the job, its pods, nodes, the claim, refusals, Kueue's view,
the time) and returns a Plan: objects to create,
pods to delete, the ONE status to write, Events to record, and when to look again. The lifecycle
(kubetrain.core.lifecycle.step) decides and keeps the status; this module only turns pods into
observations and effects into Kubernetes objects. The I/O layer carries the Plan out; nothing here
talks to the API server or reads a clock.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import ValidationError

from kubetrain.core import api, contract, hangs, pod_template
from kubetrain.core import lifecycle as lc
from kubetrain.core.api import FINISHED_PHASES, Condition, Phase, TrainingJob, TrainingJobSpec, TrainingJobStatus
from kubetrain.core.contract import format_time
from kubetrain.core.lifecycle import (
    Action,
    Decision,
    Observed,
    Reason,
    WorkerPhase,
    WorkerState,
    cluster_disruption,
    phase_conditions,
    set_condition,
    step,
)
from kubetrain.core.progress import Progress
from kubetrain.core.validate import stored_object
from kubetrain.operator.jobs import builders as b
from kubetrain.operator.jobs import fabrics, storage
from kubetrain.operator.jobs.conditions import (
    Want,
    announce,
    blocked_pods,
    checkpoints_durable,
    nodes_not_ready,
    operator_outdated,
    recheck_after,
    refused,
    waits_for_volume,
    workers_blocked,
)
from kubetrain.operator.jobs.pod_facts import PodFacts, container_exit_code, disrupted, facts
from kubetrain.operator.jobs.runtimes import (
    RUNTIME_LOOK_AGAIN_SECONDS,
    RuntimeLookup,
    WithRuntime,
    applied,
    with_runtime,
)
from kubetrain.operator.kueue import plan as kueue
from kubetrain.operator.runtime.objects import owner_reference

__all__ = ["Observation", "Plan", "claim_to_check", "container_exit_code", "deletion_overdue", "plan", "set_condition"]

OVERDUE_DELETION_SECONDS = 10.0
"""A pod still cached this long past its deletionTimestamp (when the kubelet must have ended it) is read
live, at most once per this many seconds per job: a watch that reconnected does not replay the
deletions it missed, and a job waiting for such a pod to go would wait for ever."""


@dataclass
class Plan:
    create: list[dict[str, Any]] = field(default_factory=list)
    delete_pods: list[str] = field(default_factory=list)
    delete_job: bool = False
    status: dict[str, Any] | None = None
    """The whole new status, or None when it did not change."""
    events: list[tuple[str, str, str]] = field(default_factory=list)
    """(type Normal|Warning, reason, message)."""
    requeue_after: float | None = None
    decision: Decision | None = None
    force_delete_pods: list[str] = field(default_factory=list)
    """Pods to delete at once (grace 0): their node is lost, no kubelet will ever confirm a graceful delete."""
    pod_uids: dict[str, str] = field(default_factory=dict)
    """Name -> UID of each pod to delete: the delete holds only for that pod, never for a later one of the same
    name (a worker's name repeats across generations)."""
    patch_pods: dict[str, dict[str, dict[str, str]]] = field(default_factory=dict)
    """Pod name -> labels and annotations to set ({"labels": ..., "annotations": ...}): a kept pod's new
    generation, the generation its launcher is to run, a profile request on the job passed to rank 0's pod."""
    queue: kueue.QueuePlan = field(default_factory=kueue.QueuePlan)
    """Kueue: the job's Workload to create, delete, update or (de)activate."""


# --------------------------------------------------------------------------- observe


def _pod_labels(pod: dict[str, Any]) -> dict[str, str]:
    return pod.get("metadata", {}).get("labels") or {}


def tolerates(pod: dict[str, Any], key: str) -> bool:
    """The pod tolerates a taint with this key (any effect)."""
    return any((t.get("key") == key) or (not t.get("key") and t.get("operator") == "Exists")
               for t in (pod.get("spec") or {}).get("tolerations") or [])


def worker_state(index: int, pod: dict[str, Any], nodes: Mapping[str, datetime | None],
                 terminating: Mapping[str, str] | None = None, began: datetime | None = None) -> WorkerState:
    """A Pod as the lifecycle sees it (pod_facts); `began`: when the current generation was started (its
    restart), None for the first."""
    f = facts(pod)
    node_not_ready_since = nodes.get(f.node or "") if nodes else None
    taint = terminating.get(f.node or "") if terminating else None
    if taint is not None and tolerates(pod, taint):
        taint = None  # the job chose to stay on such a node: its end is a drain or a NotReady node
    where = {"pod": pod["metadata"]["name"], "node": f.node, "hang": f.hang, "said": f.said, "failed_in": f.failed_in}
    if f.restartable:
        return WorkerState(index, f.phase, exit_code=f.exit_code, reason=f.reason, in_place=f.in_place,
                           restartable=True, node_not_ready_since=node_not_ready_since, **where)
    if f.phase not in (WorkerPhase.RUNNING, WorkerPhase.PENDING):
        early = began is not None and f.ended_at is not None and f.ended_at < began
        return WorkerState(index, f.phase, exit_code=f.exit_code, reason=f.reason, ended_before=early, **where)
    return WorkerState(index, f.phase, node_not_ready_since=node_not_ready_since, in_place=f.in_place, held=f.held,
                       fetching=f.fetching, node=f.node, node_terminating=taint, peers_lost_since=f.peers_lost_since)


def observe(
    spec: TrainingJobSpec, status: TrainingJobStatus, pods: list[dict[str, Any]],
    nodes: Mapping[str, datetime | None], progress: Progress | None, gone: Sequence[dict[str, Any]] = (),
    progress_refused: bool = False, progress_seen: datetime | None = None, disruption: str | None = None,
    terminating: Mapping[str, str] | None = None,
) -> Observed:
    """`gone`: the last copies of this job's deleted pods that were disrupted (the cache keeps them), so a
    preempted worker whose pod vanished before this reconcile still counts as disrupted, not deleted.
    `progress_seen` and `disruption`: as Observed has them; `terminating`: node -> its termination taint."""
    gen = status.restart_generation
    current = {facts(p).index: p for p in pods if facts(p).generation == gen}
    began = contract.parse_time(status.last_restart_time) if gen > 0 else None
    workers = [worker_state(i, pod, nodes, terminating, began) for i, pod in sorted(current.items())
               if 0 <= i < spec.workers]
    gone_now = {facts(p).index for p in gone if facts(p).generation == gen and disrupted(p)}
    workers += [WorkerState(i, WorkerPhase.MISSING, reason="Disrupted") for i in sorted(gone_now - current.keys())
                if 0 <= i < spec.workers]
    unknown = (Reason.PROGRESS_REPORTING_OFF if not spec.progress_reporting
               else Reason.PROGRESS_REPORTING_FORBIDDEN if progress_refused else None)
    return Observed(
        workers=tuple(workers),
        stale_workers=sum(1 for p in pods if facts(p).generation != gen),
        progress=progress,
        progress_seen=progress_seen,
        checkpoints_durable=not spec.checkpoint.ephemeral,
        progress_unknown=unknown,
        disruption=disruption,
    )


PROGRESS_FIELDS = frozenset({"currentStep", "loss", "evalLoss", "percentComplete", "eta", "tokensPerSecond", "mfu",
                             "goodput", "gpuHours", "lastProgressTime"})
"""Status fields that only say how far a running job got: what every report of rank 0 changes."""
PROGRESS_WRITE_SECONDS = 30.0
"""Progress alone is written to status at most this often (rank 0 reports every 10 s): two status writes per
running job per minute instead of six. Any other change (phase, a condition, a checkpoint, a restart) is
written at once, with the newest progress."""


def progress_write_later(old: dict[str, Any], new: dict[str, Any], now: datetime,
                         written: datetime | None) -> float | None:
    """Seconds until a status change that is progress alone is due (PROGRESS_WRITE_SECONDS after this operator
    last wrote the status, `written`); None when the change is to be written now (or there is none)."""
    changed = {k for k in old.keys() | new.keys() if old.get(k) != new.get(k)}
    if not changed or not changed <= PROGRESS_FIELDS or written is None or not old.get("lastProgressTime"):
        return None
    left = PROGRESS_WRITE_SECONDS - (now - written).total_seconds()
    return left if left > 0 else None


def _write_status(out: Plan, old: dict[str, Any], status: dict[str, Any], now: datetime,
                  written: datetime | None) -> None:
    """The new status into the plan when it changed, unless it is progress alone and not due yet: then the
    plan looks again when it is (the step is written then, or sooner with any other change)."""
    if (later := progress_write_later(old, status, now, written)) is not None:
        out.requeue_after = min(out.requeue_after or later, later)
    elif status != old:
        out.status = status


# --------------------------------------------------------------------------- plan


def _job_model(body: dict[str, Any]) -> tuple[TrainingJob | None, list[str], list[str]]:
    return stored_object(TrainingJob, body)


def _status_of(body: dict[str, Any]) -> TrainingJobStatus:
    raw = dict(body.get("status") or {})
    raw = {k: v for k, v in raw.items() if k in TrainingJobStatus.model_fields or
           any(f.alias == k for f in TrainingJobStatus.model_fields.values())}
    try:
        return TrainingJobStatus.model_validate(raw)
    except ValidationError:
        return TrainingJobStatus()


@dataclass(frozen=True)
class Observation:
    """What one reconcile of a job observed, as one value: the controller builds it (JobController._plan)
    and plan() reads nothing else. A new fact is one field here and its use."""

    body: dict[str, Any]
    """The TrainingJob as the API server stores it."""
    pods: list[dict[str, Any]]
    """Its worker pods, every generation, as the cache holds them (with the patches in flight applied)."""
    nodes: Mapping[str, datetime | None]
    """Node name -> since when it is not Ready (None: Ready)."""
    now: datetime
    node_count: int = 0
    """How many nodes the cluster has, as the node cache knows them (0: unknown, never a disruption)."""
    progress: Progress | None = None
    """Rank 0's newest progress record."""
    progress_seen: datetime | None = None
    """When the operator first saw that record's step (None: now)."""
    status_written: datetime | None = None
    """When this operator last wrote the job's status (None: not since it started or took over)."""
    claim_phase: str | None = None
    """The checkpoint claim's phase ("Missing" if absent), when it was looked up because pods wait for a
    volume (claim_to_check); None otherwise."""
    gone: Sequence[dict[str, Any]] = ()
    """The last copies of the job's deleted pods that were disrupted (see observe())."""
    progress_refused: bool = False
    """The API refused the job's progress Role or RoleBinding."""
    create_refused: str | None = None
    """The API server's message when it refused a worker pod."""
    foreign: str | None = None
    """A child's name held by an object this job does not own."""
    queue: kueue.QueueView = field(default_factory=kueue.QueueView)
    silent: frozenset[str] = frozenset()
    """Nodes found silent while a gang on them broke (NODE_SILENT_SECONDS): in `nodes` as NotReady, and kept off
    by the pods this plan creates, which the scheduler would place there until the node is NotReady."""
    """Kueue's view of a job with a LocalQueue (its Workload, flavors, priority)."""
    terminating: Mapping[str, str] = field(default_factory=dict)
    """Node name -> the termination taint it carries: it is about to go."""
    runtime: RuntimeLookup | None = None
    """The live read of the job's runtime (runtimes.to_read); None where none was made."""
    storage_classes: Sequence[dict[str, Any]] | None = None
    """The StorageClasses, read live for a job whose checkpoint claim may need sharing (storage.to_read); None where
    they were not read."""


def plan(seen: Observation, settings: b.WorkerSettings) -> Plan:
    """One reconcile of the job `seen` observed."""
    if (seen.body.get("metadata") or {}).get("deletionTimestamp"):
        # Being deleted (the garbage collector may be removing its pods first, under foreground deletion): its
        # pods' ends are no failures, and nothing is created, restarted or written for a job that is going.
        return Plan()
    return _plan(seen, settings)


def _plan(seen: Observation, settings: b.WorkerSettings) -> Plan:
    body, now, view = seen.body, seen.now, seen.queue
    old = _status_of(body)
    job, problems, unknown = _job_model(body)
    if job is None:
        return _invalid(old, problems, now, kueue.plan_invalid(view, now))
    if unknown and not _started(old):
        return _waiting(old, operator_outdated(unknown, started=False), now)
    stored, rt = old, with_runtime(job, old, seen.runtime)
    ready = _effective(seen, old, rt, settings)
    if isinstance(ready, Plan):
        return ready
    job, old = ready.job, ready.status
    ours = [p for p in seen.pods if _pod_labels(p).get(b.LABEL_JOB) == job.metadata.name]
    gang_gone = not any(facts(p).running for p in ours)
    template = functools.partial(b.worker_pod, job, 0, 0, settings)  # a queued job's Workload template
    q = kueue.plan_queue(job, body, view, gang_gone, old.phase, template, now)
    if job.spec.managed_by not in (None, contract.MANAGED_BY_OPERATOR):
        return Plan(queue=q)  # another controller (MultiKueue) runs it: only its Workload is ours
    if q.hold and not job.spec.suspend:  # waiting for Kueue: held as if suspended, spec.suspend left the user's
        job = job.model_copy(update={"spec": job.spec.model_copy(update={"suspend": True})})
    disruption = cluster_disruption(sum(1 for v in seen.nodes.values() if v is not None), seen.node_count)
    observed = observe(job.spec, old, ours, seen.nodes, seen.progress, seen.gone, seen.progress_refused,
                       seen.progress_seen, disruption, seen.terminating)
    t = step(job.spec, old, observed, now)
    if t.status.phase in FINISHED_PHASES and old.phase not in FINISHED_PHASES:
        # The job ends in this plan: its Workload is finished with it, not on whatever event comes next
        # (the echo of this plan's own status write re-plans nothing).
        q = kueue.plan_queue(job, body, view, gang_gone, t.status.phase, template, now)
    lost = set(_lost(job.spec, ours, seen.nodes, now)) if disruption is None else set()
    out = Plan(requeue_after=t.requeue_after, decision=t.decision, queue=q)
    if q.condition is not None and q.condition[1] in kueue.LOOK_AGAIN:  # no event says when it is installed
        out.requeue_after = min(out.requeue_after or kueue.LOOK_AGAIN_SECONDS, kueue.LOOK_AGAIN_SECONDS)
    for effect in t.effects:
        _translate(effect, job, body, ours, t, settings, out, lost)
    _off_silent(out.create, seen.silent)
    for name, notes in profile_request(body, ours, t.status.restart_generation).items():
        _patch(out, name, "annotations", notes)
    for name, notes in master_told(ours, t.status.restart_generation).items():
        _patch(out, name, "annotations", notes)
    if t.decision is not None:
        blocked = Blocked(seen.claim_phase, seen.create_refused, seen.foreign, tuple(unknown), seen.nodes,
                          _last_progress(observed, t.status), disruption, tuple(filter(None, [applied(old, rt.ignored)])))
        _write_status(out, stored.dump(), _presented(job, body, ours, t, blocked, now, out), now, seen.status_written)
    return out


def _effective(seen: Observation, old: TrainingJobStatus, rt: WithRuntime,
               settings: b.WorkerSettings) -> storage.Placed | Plan:
    """The job to run, over its runtime and with its checkpoint storage settled; or the plan of a job that waits
    for either, or is refused (`old`: the stored status)."""
    now = seen.now
    if rt.waiting is not None:
        return _waiting(old, rt.waiting, now, RUNTIME_LOOK_AGAIN_SECONDS)
    refused = rt.problems or admission_problems(rt.job, rt.status, settings, rt)
    if refused:
        return _invalid(old, refused, now, kueue.plan_invalid(seen.queue, now))
    placed = storage.place(rt.job, rt.status, seen.storage_classes, settings.checkpoint_store)
    if placed.waiting is not None:
        return _waiting(old, placed.waiting, now, storage.LOOK_AGAIN_SECONDS)
    return placed


def _last_progress(observed: Observed, status: TrainingJobStatus) -> datetime | None:
    """When the job last advanced; None where rank 0 cannot report progress (then it says nothing)."""
    return None if observed.progress_unknown else contract.parse_time(status.last_progress_time)


def admission_problems(job: TrainingJob, old: TrainingJobStatus, settings: b.WorkerSettings,
                       rt: WithRuntime | None = None) -> list[str]:
    """What this operator's settings refuse of a job that has not started (its podTemplate's host-level fields and
    what it would take of its fabric's own, a fabric that mounts the node's directories unless a
    ClusterTrainingRuntime chose it, a daemon image of its own, a missing queue): a job that already ran keeps
    running when they are tightened (an upgrade never fails a running job). `job` is over its runtime (`rt`)."""
    if _started(old):
        return []
    own = rt.own if rt is not None else job.spec
    found = [] if rt is not None and rt.trusted_fabric else host_fabric_problems(job, settings)
    if own.fabric_options is not None and own.fabric_options.daemon_image is not None:
        found.append(f"spec.{api.DAEMON_IMAGE_RULE.path}: {api.DAEMON_IMAGE_RULE.message}")
    ns = job.metadata.namespace or ""
    if ns in settings.queue_required_in and job.spec.scheduling.queue is None:
        found.append(f"spec.scheduling.queue: required in namespace {ns} (chart value queues.requiredIn)")
    template = rt.own_template if rt is not None else job.spec.pod_template
    if own.pod_template is not None:
        found += fabric_owned_problems(job, own.pod_template)
    if template is not None:
        caps = fabrics.profile(job.spec).all_capabilities()
        found += [f"spec.{path}: {reason}" for path, reason in
                  pod_template.host_problems(template, settings.pod_policy, caps)]
    return found


def fabric_owned_problems(job: TrainingJob, template: dict[str, Any]) -> list[str]:
    """What a job's own podTemplate would take of its fabric's: a sidecar of the profile's name (its image, its
    command, as root), or a mount of the profile's node directories into a container of the job's."""
    profile = fabrics.profile(job.spec)
    sidecars = {c["name"] for c in profile.sidecars}
    host = {v["name"] for v in profile.volumes if "hostPath" in v}
    raw = template.get("spec")
    spec: dict[str, Any] = raw if isinstance(raw, dict) else {}
    found = []
    for kind in pod_template.CONTAINER_LISTS:
        for c in spec.get(kind) or []:
            if not isinstance(c, dict):
                continue
            if c.get("name") in sidecars:
                found.append(f"spec.podTemplate.spec.{kind}[{c['name']}]: the {job.spec.fabric} fabric's own sidecar")
            found += [f"spec.podTemplate.spec.{kind}[{c.get('name')}].volumeMounts[{m['name']}]: a directory of "
                      f"the node that the {job.spec.fabric} fabric mounts for its own use"
                      for m in c.get("volumeMounts") or [] if isinstance(m, dict) and m.get("name") in host]
    found += [f"spec.podTemplate.spec.volumes[{v['name']}]: the {job.spec.fabric} fabric's own volume"
              for v in spec.get("volumes") or [] if isinstance(v, dict) and v.get("name") in host]
    return found


def profile_request(body: dict[str, Any], pods: list[dict[str, Any]], generation: int) -> dict[str, dict[str, str]]:
    """The job's kubetrain.io/profile annotation onto worker 0 of the current generation, where rank 0
    reads it (the response to its progress patch carries its pod's annotations)."""
    asked = ((body.get("metadata") or {}).get("annotations") or {}).get(contract.PROFILE_ANNOTATION)
    name = b.worker_name(body["metadata"]["name"], 0)
    for p in pods:
        if p["metadata"]["name"] == name and facts(p).generation == generation and facts(p).running:
            have = (p["metadata"].get("annotations") or {}).get(contract.PROFILE_ANNOTATION)
            return {name: {contract.PROFILE_ANNOTATION: asked}} if asked and asked != have else {}
    return {}


def _started(old: TrainingJobStatus) -> bool:
    return old.phase not in (Phase.PENDING, None) or bool(old.restart_count)


def host_fabric_problems(job: TrainingJob, settings: b.WorkerSettings) -> list[str]:
    """A job's own fabric whose profile mounts directories of the node (tcpx, tcpxo: /sys, /proc/sys, beside a root
    daemon), where the operator's podPolicy does not allow hostPath volumes."""
    host = [v["hostPath"]["path"] for v in fabrics.profile(job.spec).volumes if "hostPath" in v]
    if not host or settings.pod_policy.allow_host_path:
        return []
    return [f"spec.fabric: {job.spec.fabric} mounts {', '.join(host)} of the node and runs a root daemon: only "
            "through a ClusterTrainingRuntime (spec.runtimeRef; docs/runtimes.md) or where this cluster's operator "
            "allows hostPath volumes (chart value podPolicy.allowHostPath)"]


def _waiting(old: TrainingJobStatus, want: Want, now: datetime, look_again: float | None = None) -> Plan:
    """A job not started yet that waits, Pending, with the condition `want` says: for an operator that knows its
    spec's fields (running it without them could run it wrong; failing it would lose it to a CRD applied a moment
    before the operator's upgrade), or for its runtime."""
    out = Plan(requeue_after=look_again)
    raw = [c.dump() for c in old.conditions]
    if announce(raw, want):
        out.events.append(("Warning", want.reason, want.message))
    new = old.model_copy(update={"phase": Phase.PENDING, "reason": want.reason, "message": want.message})
    new.conditions = [Condition.model_validate(c)
                      for c in set_condition(raw, want.type, want.value, want.reason, want.message, now, add_false=True)]
    if new.dump() != old.dump():
        out.status = new.dump()
    return out


def _invalid(old: TrainingJobStatus, problems: list[str], now: datetime, queue: kueue.QueuePlan) -> Plan:
    """A spec the API server accepted but the model refuses: Failed once, with every problem named."""
    out = Plan(queue=queue)
    if old.phase != Phase.FAILED:
        message = "invalid spec: " + "; ".join(problems)
        new = old.model_copy(update={"phase": Phase.FAILED, "reason": Reason.INVALID_SPEC, "message": message,
                                     "completion_time": format_time(now)})
        new.conditions = phase_conditions(Phase.FAILED, Reason.INVALID_SPEC, message,
                                          [c.dump() for c in old.conditions], now)
        out.status = new.dump()
        out.events.append(("Warning", Reason.INVALID_SPEC, message))
    return out


def _translate(
    effect: lc.Effect, job: TrainingJob, body: dict[str, Any], ours: list[dict[str, Any]], t: lc.Transition,
    settings: b.WorkerSettings, out: Plan, lost: set[str],
) -> None:
    """One lifecycle effect as Kubernetes objects to create or delete. `lost`: pods on a lost node,
    deleted at once (grace 0) even when already Terminating."""
    if isinstance(effect, lc.CreateWorkers):
        owner = owner_reference(body)
        out.create.extend(_shared_children(job, owner, effect.generation, settings))
        placed = job.model_copy(update={"status": t.status})  # the nodes this transition says to avoid
        out.create.extend(kueue.place(b.worker_pod(placed, i, effect.generation, settings, owner), out.queue.placement)
                          for i in effect.indices)
        master = "" if 0 in effect.indices else master_ip(ours, effect.generation)  # a new worker 0 has none yet
        told = f"{effect.generation} {master}" if master else str(effect.generation)
        for name in _named(ours, effect.generation, effect.resume):  # their launchers start it now
            _patch(out, name, "annotations", {contract.GENERATION_ANNOTATION: str(effect.generation),
                                              contract.MASTER_ANNOTATION: told})
    elif isinstance(effect, lc.KeepWorkers):
        for p in _of(ours, effect.generation - 1, effect.indices):
            _patch(out, p["metadata"]["name"], "labels", {b.LABEL_GENERATION: str(effect.generation)})
            if failures := facts(p).failures:  # its failure, restarted in the pod, is this restart's
                _patch(out, p["metadata"]["name"], "annotations", {contract.FAILURES_HANDLED_ANNOTATION: str(failures)})
    elif isinstance(effect, lc.DeleteWorkers):
        kept = set(_named(ours, t.status.restart_generation - 1, effect.keep))
        scoped = [p for p in _in_scope(effect.scope, ours, t.status.restart_generation)
                  if p["metadata"]["name"] not in kept]
        out.force_delete_pods.extend(p["metadata"]["name"] for p in scoped if p["metadata"]["name"] in lost)
        out.delete_pods.extend(_alive([p for p in scoped if p["metadata"]["name"] not in lost]))
        out.pod_uids.update({p["metadata"]["name"]: p["metadata"]["uid"] for p in scoped if p["metadata"].get("uid")})
    elif isinstance(effect, lc.RecordEvent):
        out.events.append((effect.type, effect.reason, effect.message))
    elif isinstance(effect, lc.DeleteJob):
        out.delete_job = True


def master_ip(pods: list[dict[str, Any]], generation: int) -> str | None:
    """The pod IP of worker 0 of `generation` (None: no such pod, being deleted, or no IP yet)."""
    zero = [p for p in _of(pods, generation, (0,)) if not p["metadata"].get("deletionTimestamp")]
    if not zero:
        return None
    return (zero[0].get("status") or {}).get("podIP") or None


def master_told(pods: list[dict[str, Any]], generation: int) -> dict[str, dict[str, str]]:
    """Pod name -> the annotation that gives a kept worker, told `generation` before worker 0's new pod had an
    address (contract.MASTER_ANNOTATION: the generation alone), that address once it has one."""
    ip = master_ip(pods, generation)
    if ip is None:
        return {}
    return {p["metadata"]["name"]: {contract.MASTER_ANNOTATION: f"{generation} {ip}"} for p in pods
            if facts(p).generation == generation
            and (p["metadata"].get("annotations") or {}).get(contract.MASTER_ANNOTATION) == str(generation)}


def _named(pods: list[dict[str, Any]], generation: int, indices: Sequence[int]) -> list[str]:
    """The names of the pods of `generation` with these worker indices."""
    return [p["metadata"]["name"] for p in _of(pods, generation, indices)]


def _of(pods: list[dict[str, Any]], generation: int, indices: Sequence[int]) -> list[dict[str, Any]]:
    want = set(indices)
    return [p for p in pods if facts(p).generation == generation and facts(p).index in want]


def _patch(out: Plan, pod: str, part: str, values: dict[str, str]) -> None:
    out.patch_pods.setdefault(pod, {}).setdefault(part, {}).update(values)


def _in_scope(scope: lc.Scope, pods: list[dict[str, Any]], generation: int) -> list[dict[str, Any]]:
    if scope == lc.Scope.STALE:
        return [p for p in pods if facts(p).generation != generation]
    if scope == lc.Scope.UNFINISHED:
        return [p for p in pods if facts(p).running]
    if scope == lc.Scope.RESTARTING:
        return [p for p in pods if (f := facts(p)).restarts_here and f.running]
    return pods


@dataclass(frozen=True)
class Blocked:
    """What the I/O layer knows beyond the pods' own status: why workers cannot start, which nodes are NotReady."""

    claim_phase: str | None = None
    create_refused: str | None = None
    foreign: str | None = None
    unknown: tuple[str, ...] = ()
    """Spec fields this operator does not know (a newer CRD): a running job goes on without them."""
    nodes: Mapping[str, datetime | None] = field(default_factory=dict)
    """NotReady nodes: name -> since when (the node cache's)."""
    last_progress: datetime | None = None
    """When the job last advanced (status.lastProgressTime); None: unknown, or rank 0 cannot report it."""
    disruption: str | None = None
    """Why the cluster looks disrupted (lifecycle.cluster_disruption); None: it does not."""
    runtime: tuple[Want, ...] = ()
    """RuntimeResolved, for a job with a runtime applied."""


def _presented(
    job: TrainingJob, body: dict[str, Any], ours: list[dict[str, Any]], t: lc.Transition, blocked: Blocked,
    now: datetime, out: Plan,
) -> dict[str, Any]:
    """The lifecycle's status plus what only pods tell: readiness, and the side conditions."""
    d, status = t.decision, t.status.model_copy(deep=True)
    assert d is not None
    status.observed_generation = int(body.get("metadata", {}).get("generation") or 0)
    current = [p for p in ours if facts(p).generation == d.generation]
    gone = d.action in (Action.RESTART_GANG, Action.SUSPEND)
    status.workers_ready = 0 if gone else sum(1 for p in current if facts(p).ready)
    status.workers_summary = f"{status.workers_ready}/{job.spec.workers}"
    status.conditions = _side_conditions(job, d, current, blocked, status.conditions, now, out,
                                         status.checkpoint_store)
    return status.dump()


def _side_conditions(
    job: TrainingJob, d: Decision, current: list[dict[str, Any]], blocked: Blocked,
    conds: list[Condition], now: datetime, out: Plan, store: api.CheckpointStore | None = None,
) -> list[Condition]:
    """CheckpointsDurable and WorkersBlocked over the phase conditions; one Warning Event each time
    one of them turns bad (not on every reconcile; a refused create has its Event from the I/O layer)."""
    starting = d.action in (Action.WAIT, Action.CREATE_WORKERS)  # a gang going away is not blocked
    pods = blocked_pods(current, now) if starting else []
    if starting and (wait := recheck_after(current, now)) is not None:
        out.requeue_after = min(out.requeue_after or wait, wait)
    stuck = refused(blocked.create_refused, blocked.foreign) if starting else None
    raw, queued = kueue.admitted_condition([x.dump() for x in conds], out.queue, now)
    if queued is not None:
        out.events.append(queued)
    down = nodes_not_ready(job, current, blocked.nodes, blocked.last_progress, now, blocked.disruption)
    for want in (checkpoints_durable(job, store), stuck or workers_blocked(job, pods, blocked.claim_phase),
                 operator_outdated(blocked.unknown, started=True), down, *blocked.runtime):
        if want is not stuck and announce(raw, want):
            out.events.append(("Warning", want.reason, want.message))
        # CheckpointsDurable=False is there from the start; WorkersBlocked appears once it holds.
        raw = set_condition(raw, want.type, want.value, want.reason, want.message, now,
                            add_false=not want.bad_value)
    return [Condition.model_validate(x) for x in raw]


def claim_to_check(body: dict[str, Any], pods: list[dict[str, Any]], now: datetime) -> str | None:
    """The checkpoint claim worth a live look (its phase goes to plan()): only while a pod of the job
    is unschedulable for a volume, so the operator neither watches claims nor reads one per reconcile."""
    if not waits_for_volume(blocked_pods(pods, now)):
        return None
    job, _, _ = _job_model(body)
    return b.claim_name(job) if job is not None else None


def _shared_children(job: TrainingJob, owner: dict[str, Any], generation: int,
                     settings: b.WorkerSettings) -> list[dict[str, Any]]:
    objs = [b.headless_service(job, owner), b.config_map(job, owner)]
    for optional in (b.service_account(job, owner), b.checkpoint_claim(job, owner), b.pod_group(job, owner, generation),
                     b.progress_role(job, owner), b.progress_role_binding(job, owner),
                     b.worker_network_policy(job, settings.network_policy, owner)):
        if optional is not None:
            objs.append(optional)
    return objs


NODE_SILENT_SECONDS = 20.0
"""A node whose kubelet renewed its Lease this long ago (two renewals missed) while a worker on another node lost
its peers is lost to the job, before the node lifecycle controller says NotReady (its node-monitor-grace-period,
50 s by default): the kubelet and the gang fell silent together."""


def _off_silent(create: list[dict[str, Any]], silent: frozenset[str]) -> None:
    """Keep the worker pods to create off the silent nodes (a required node affinity, for their generation)."""
    for obj in create if silent else ():
        if obj.get("kind") == "Pod":
            obj["spec"]["affinity"] = b.avoid_nodes(obj["spec"].get("affinity"), sorted(silent))


SILENT_FORGET_SECONDS = 120.0
"""A silent mark older than this is dropped: a node that died is NotReady long before (the node lifecycle
controller's 50 s), and one that did not must not stay off every new pod for the operator's life."""


def silence_checks(pods: Iterable[dict[str, Any]], not_ready: Mapping[str, datetime | None],
                   silent: Mapping[str, datetime]) -> set[str]:
    """The nodes of the job's pods whose Lease to read now: while one of its workers lost its peers, each one
    not NotReady already, but the nodes of those workers (their kubelets just spoke); otherwise those found
    silent before (to see them speak again)."""
    seen = [facts(p) for p in pods]
    nodes = {f.node for f in seen if f.node and not_ready.get(f.node) is None}
    lost = {f.node for f in seen if f.peers_lost_since is not None}
    return (nodes - lost if lost else set()) | (nodes & set(silent))


PEERS_LOST_SETTLE_SECONDS = 5.0
"""How long after a worker lost its peers the other workers' kubelets have to say so of theirs (the gang probe
fails within a second, a container that ended is reported at once): one still Ready since before, on a node whose
kubelet has not renewed its Lease since, fell silent with its kubelet."""


def unanswering_nodes(pods: Iterable[dict[str, Any]], now: datetime,
                      last_hang: Mapping[str, Any] | None = None) -> dict[str, datetime]:
    """The nodes whose worker went silent, each with when that was seen, for the controller to hold against
    their Leases: a worker that a hang report names as not answering its launcher (hangs.PeerWatch), and one
    still Ready PEERS_LOST_SETTLE_SECONDS after another worker lost its peers. Either one's pod from before
    that moment: a successor placed after it, or a container Ready again since, is not the one gone silent.
    The report is gone from the pods once its restart began, so the verdict it left (`last_hang`, the job's
    status.lastHang) names such nodes too, for SILENT_FORGET_SECONDS."""
    seen = [(facts(p), p) for p in pods]
    out = _named_by_verdict(last_hang, now)
    named: dict[int, datetime] = {}
    for f, _p in seen:
        for index in f.hang.unanswered if f.hang is not None else ():
            reported = datetime.fromtimestamp(f.hang.at, UTC)
            named[index] = min(reported, named.get(index, reported))
    lost = peers_lost_at(f for f, _p in seen)
    if lost is not None and (now - lost).total_seconds() < PEERS_LOST_SETTLE_SECONDS:
        lost = None
    for f, p in seen:
        at = named.get(f.index) or (lost if lost is not None and _ready_since_before(f, p, lost) else None)
        created = contract.parse_time(p["metadata"].get("creationTimestamp"))
        if f.node and at is not None and created is not None and created <= at:
            out[f.node] = at
    return out


def _named_by_verdict(last_hang: Mapping[str, Any] | None, now: datetime) -> dict[str, datetime]:
    """The nodes of the suspects a recent hang verdict found not answering, with its time."""
    when = contract.parse_time((last_hang or {}).get("time"))
    if last_hang is None or when is None or (now - when).total_seconds() > SILENT_FORGET_SECONDS:
        return {}
    return {s["node"]: when for s in last_hang.get("suspects") or []
            if s.get("where") == hangs.NOT_ANSWERING and s.get("node")}


def peers_lost_at(seen: Iterable[PodFacts]) -> datetime | None:
    """When the first of the job's workers that lost their peers did."""
    return min((f.peers_lost_since for f in seen if f.peers_lost_since is not None), default=None)


def settles_in(pods: Iterable[dict[str, Any]], now: datetime) -> float | None:
    """Seconds until PEERS_LOST_SETTLE_SECONDS have passed since a worker lost its peers (None: none did, or
    they have)."""
    lost = peers_lost_at(facts(p) for p in pods)
    left = None if lost is None else PEERS_LOST_SETTLE_SECONDS - (now - lost).total_seconds()
    return left if left is not None and left > 0 else None


def _ready_since_before(f: PodFacts, pod: dict[str, Any], moment: datetime) -> bool:
    """Ready, not being deleted, and its Ready condition unchanged since before `moment`."""
    ready: dict[str, Any] = next(
        (c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), {})
    changed = contract.parse_time(ready.get("lastTransitionTime"))
    return f.ready and not pod["metadata"].get("deletionTimestamp") and changed is not None and changed <= moment


def forgotten(silent: Mapping[str, datetime], now: datetime) -> list[str]:
    """The silent marks to drop (SILENT_FORGET_SECONDS)."""
    return [n for n, heard in silent.items() if (now - heard).total_seconds() > SILENT_FORGET_SECONDS]


def silent_for(heard: datetime | None, now: datetime) -> float | None:
    """Seconds until a node last heard at `heard` counts as silent (0: it does; None: no Lease to tell)."""
    if heard is None:
        return None
    return max(0.0, NODE_SILENT_SECONDS - (now - heard).total_seconds())


def _lost(spec: TrainingJobSpec, pods: list[dict[str, Any]], nodes: Mapping[str, datetime | None],
          now: datetime) -> list[str]:
    """Pods of the job on a NotReady node that are going away (or must): they would stay Terminating forever
    and hold the next generation back, as the node lifecycle controller's pod GC would not remove them
    before its own, much longer, timeout. A pod a restart already deletes goes at once (its kubelet cannot
    confirm, and its worker's next pod waits on its name); another once the node is NotReady past its grace."""
    if not nodes:  # only NotReady nodes are kept
        return []
    grace = timedelta(seconds=spec.restart_policy.node_not_ready_grace_seconds)
    out = []
    for p in pods:
        since = nodes.get((p.get("spec") or {}).get("nodeName") or "")
        if since is not None and (p["metadata"].get("deletionTimestamp") or now - since >= grace):
            out.append(p["metadata"]["name"])
    return out


def deletion_overdue(pods: list[dict[str, Any]], now: datetime, read_live: datetime | None) -> bool:
    """Whether a cached pod is OVERDUE_DELETION_SECONDS past its deletionTimestamp and the job's pods
    were not read live within as long (None: never)."""
    late = timedelta(seconds=OVERDUE_DELETION_SECONDS)
    if read_live is not None and now - read_live < late:
        return False
    return any(t is not None and now - t >= late
               for t in (contract.parse_time(p["metadata"].get("deletionTimestamp")) for p in pods))


def _alive(pods: list[dict[str, Any]]) -> list[str]:
    """Names of the pods not already being deleted."""
    return [p["metadata"]["name"] for p in pods if not p["metadata"].get("deletionTimestamp")]
