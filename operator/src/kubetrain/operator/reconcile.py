"""One reconcile, as pure functions: observe children -> decide (shared policy) -> plan.

`plan(job_body, pods, nodes, now, settings, progress, claim_phase)` returns a Plan: objects to create,
pods to delete, the ONE status to write, Events to record, and when to look
again. The I/O layer (kubetrain.operator.k8s) carries it out; nothing here talks
to the API server or reads a clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from pydantic import ValidationError

from kubetrain.core import contract
from kubetrain.core.api import (
    CheckpointRef,
    Condition,
    TrainingJob,
    TrainingJobSpec,
    TrainingJobStatus,
)
from kubetrain.core.lifecycle import Action, Decision, History, Observed, WorkerPhase, WorkerState, decide
from kubetrain.core.progress import Progress
from kubetrain.core.validate import _path, _reason
from kubetrain.operator import builders as b
from kubetrain.operator.conditions import (
    announce,
    blocked_pods,
    checkpoints_durable,
    recheck_after,
    waits_for_volume,
    workers_blocked,
)

FINISHED = ("Succeeded", "Failed")


def ts(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_ts(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


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


# --------------------------------------------------------------------------- observe


def _pod_labels(pod: dict[str, Any]) -> dict[str, str]:
    return pod.get("metadata", {}).get("labels") or {}


def pod_generation(pod: dict[str, Any]) -> int:
    return int(_pod_labels(pod).get(b.LABEL_GENERATION, "-1"))


def worker_state(index: int, pod: dict[str, Any] | None, created: bool, nodes: dict[str, datetime | None]) -> WorkerState:
    """A Pod (or its absence) as the lifecycle policy sees it."""
    if pod is None:
        return WorkerState(index, WorkerPhase.MISSING, created=created)
    status = pod.get("status") or {}
    phase = status.get("phase", "Pending")
    node_since = nodes.get(pod.get("spec", {}).get("nodeName") or "")
    if pod["metadata"].get("deletionTimestamp") and phase not in ("Succeeded", "Failed"):
        return WorkerState(index, WorkerPhase.MISSING, reason="Deleted", created=True)
    if phase == "Succeeded":
        return WorkerState(index, WorkerPhase.SUCCEEDED, exit_code=0)
    if phase == "Failed":
        code, reason = None, status.get("reason")
        for cs in status.get("containerStatuses") or []:
            term = (cs.get("state") or {}).get("terminated") or {}
            if cs.get("name") == b.CONTAINER and term:
                code = container_exit_code(term)
                if term.get("reason") == "OOMKilled":
                    reason = "OOMKilled"
        return WorkerState(index, WorkerPhase.FAILED, exit_code=code, reason=reason)
    wp = WorkerPhase.RUNNING if phase == "Running" else WorkerPhase.PENDING
    return WorkerState(index, wp, node_not_ready_since=node_since)


def container_exit_code(terminated: dict[str, Any]) -> int | None:
    """The container's exit code, as a shell would give it for a command the runtime could not start:
    runc reports such a container as StartError with 128, and 128 alone would count as retryable."""
    if terminated.get("reason") == "StartError":
        message = terminated.get("message") or ""
        exec_failed = 'exec: "' in message  # runc could not exec the command (not a mount or workingDir)
        if exec_failed and ("executable file not found" in message or "no such file or directory" in message):
            return contract.COMMAND_NOT_FOUND_EXIT_CODE
        if exec_failed and "permission denied" in message:
            return contract.COMMAND_NOT_EXECUTABLE_EXIT_CODE
    code = terminated.get("exitCode")
    return int(code) if code is not None else None


def is_ready(pod: dict[str, Any]) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return (pod.get("status") or {}).get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in conds
    )


def observe(
    spec: TrainingJobSpec,
    status: TrainingJobStatus,
    pods: list[dict[str, Any]],
    nodes: dict[str, datetime | None],
) -> Observed:
    gen = status.restart_generation
    current = {int(_pod_labels(p).get(b.LABEL_INDEX, "-1")): p for p in pods if pod_generation(p) == gen}
    stale = sum(1 for p in pods if pod_generation(p) != gen)
    workers = tuple(worker_state(i, current.get(i), status.gang_created, nodes) for i in range(spec.workers))
    return Observed(
        generation=gen,
        workers=workers,
        stale_workers=stale,
        last_progress_time=parse_ts(status.last_progress_time),
        running_since=parse_ts(status.running_since),
        last_checkpoint=status.last_checkpoint.step if status.last_checkpoint else None,
        checkpoints_durable=not spec.checkpoint.ephemeral,
    )


# --------------------------------------------------------------------------- status


def set_condition(
    conditions: list[dict[str, Any]], type_: str, value: bool, reason: str, message: str, now: datetime,
    add_false: bool = False,
) -> list[dict[str, Any]]:
    """A new condition list; lastTransitionTime moves only when the status value changes.

    A condition not there yet is added when True, or when False with `add_false` (a phase condition
    appears once it holds; CheckpointsDurable=False is news from the start)."""
    status = "True" if value else "False"
    out, found = [], False
    for c in conditions:
        if c.get("type") == type_:
            found = True
            changed = c.get("status") != status
            out.append({
                "type": type_, "status": status, "reason": reason, "message": message,
                "lastTransitionTime": ts(now) if changed else c.get("lastTransitionTime", ts(now)),
            })
        else:
            out.append(c)
    if not found and (value or add_false):
        out.append({"type": type_, "status": status, "reason": reason, "message": message,
                    "lastTransitionTime": ts(now)})
    return out


def conditions_for(
    phase: str, reason: str, message: str, conditions: list[dict[str, Any]], now: datetime
) -> list[Condition]:
    """Created stays True once set; the phase's own condition is True, the other phase conditions False."""
    conds = list(conditions)
    if phase == "Created":
        conds = set_condition(conds, "Created", True, reason, message, now)
    elif phase not in ("Pending", "Suspended"):
        conds = set_condition(conds, "Created", True, "GangCreated", "worker pods created", now)
    for t in ("Running", "Restarting", "Suspended", "Succeeded", "Failed"):
        was_true = any(c.get("type") == t and c.get("status") == "True" for c in conds)
        if t == phase or was_true:
            conds = set_condition(conds, t, t == phase, reason, message, now)
    return [Condition.model_validate(c) for c in conds]


# --------------------------------------------------------------------------- plan


def _job_model(body: dict[str, Any]) -> tuple[TrainingJob | None, list[str]]:
    """Validate what the API server accepted; returns the problems the schema could not express."""
    data = {k: body.get(k) for k in ("apiVersion", "kind", "spec") if body.get(k) is not None}
    meta = body.get("metadata", {})
    data["metadata"] = {"name": meta.get("name"), "namespace": meta.get("namespace"),
                        "labels": meta.get("labels"), "annotations": meta.get("annotations")}
    try:
        job = TrainingJob.model_validate(data)
    except ValidationError as exc:
        return None, [f"{_path(e['loc'])}: {_reason(e)}" for e in exc.errors()]
    problems = [f"spec.{p}: {m}" for p, m in job.spec.rule_violations()]
    return (None if problems else job), problems


def _status_of(body: dict[str, Any]) -> TrainingJobStatus:
    raw = dict(body.get("status") or {})
    raw = {k: v for k, v in raw.items() if k in TrainingJobStatus.model_fields or
           any(f.alias == k for f in TrainingJobStatus.model_fields.values())}
    try:
        return TrainingJobStatus.model_validate(raw)
    except ValidationError:
        return TrainingJobStatus()


def plan(
    body: dict[str, Any],
    pods: list[dict[str, Any]],
    nodes: dict[str, datetime | None],
    now: datetime,
    settings: b.Settings,
    progress: Progress | None = None,
    claim_phase: str | None = None,
) -> Plan:
    """One reconcile. `claim_phase`: the checkpoint claim's phase ("Missing" if absent), when the caller
    looked it up because pods wait for a volume (claim_to_check); None otherwise."""
    old = _status_of(body)
    old_dump = old.dump()
    out = Plan()
    job, problems = _job_model(body)
    if job is None:
        if old.phase != "Failed":
            message = "invalid spec: " + "; ".join(problems)
            new = old.model_copy(update={"phase": "Failed", "reason": "InvalidSpec", "message": message,
                                         "completion_time": ts(now)})
            new.conditions = conditions_for("Failed", "InvalidSpec", message, [c.dump() for c in old.conditions], now)
            out.status = new.dump()
            out.events.append(("Warning", "InvalidSpec", message))
        return out
    spec = job.spec
    owner = b.owner_reference(body)
    ours = [p for p in pods if _pod_labels(p).get(b.LABEL_JOB) == job.metadata.name]

    if old.phase in FINISHED:
        return _finished(job, body, old, ours, now, out)

    status = old.model_copy(deep=True)
    status.max_steps = spec.max_steps
    status.workers_total = spec.workers
    status.observed_generation = int(body.get("metadata", {}).get("generation") or 0)
    if progress is not None:
        _apply_progress(status, progress, now)

    observed = observe(spec, status, ours, nodes)
    history = History(
        restart_count=status.restart_count,
        start_time=parse_ts(status.start_time),
        last_restart_time=parse_ts(status.last_restart_time),
    )
    d = decide(spec, observed, history, now)
    out.decision = d
    out.requeue_after = d.requeue_after
    current = [p for p in ours if pod_generation(p) == observed.generation]

    if d.action == Action.CREATE_WORKERS:
        if status.start_time is None:
            status.start_time = ts(now)
        out.create.extend(_shared_children(job, owner))
        present = {int(_pod_labels(p).get(b.LABEL_INDEX, "-1")) for p in current}
        out.create.extend(
            b.worker_pod(job, i, d.generation, settings, owner) for i in range(spec.workers) if i not in present
        )
        status.gang_created = True  # written after the creates succeed (the I/O layer writes status last)
        out.requeue_after = 2.0
    elif d.action == Action.RESTART_GANG:
        out.delete_pods = _alive(ours)
        kind = d.failure_kind.value if d.failure_kind else "Unknown"
        status.failures = {**status.failures, kind: status.failures.get(kind, 0) + 1}
        status.restart_count += 1
        status.restart_generation = d.generation
        status.gang_created = False
        status.running_since = None
        status.resumed_from_step = 0  # until rank 0 of the new generation reports what it loaded
        if spec.checkpoint.ephemeral:
            status.last_checkpoint = None  # it was in the pods being deleted
        status.last_restart_time = ts(now)
        status.last_failure_time = status.last_failure_time or ts(now)
        out.events.append(("Warning", d.reason, d.message))
    elif d.action in (Action.DELETE_STALE, Action.SUSPEND):
        suspend = d.action == Action.SUSPEND
        out.delete_pods = _alive([p for p in ours if suspend or pod_generation(p) != observed.generation])
        if suspend and status.gang_created:
            status.gang_created = False
            status.running_since = None
            status.restart_generation += 1  # resuming starts a new gang from the latest checkpoint
            status.resumed_from_step = 0
    elif d.action == Action.FAIL:
        status.completion_time = ts(now)
        if d.failure_kind is not None:
            kind = d.failure_kind.value
            status.failures = {**status.failures, kind: status.failures.get(kind, 0) + 1}
        out.delete_pods = _clean(spec, ours)
        out.events.append(("Warning", d.reason, d.message))
    elif d.action == Action.SUCCEED:
        status.completion_time = ts(now)
        out.delete_pods = _clean(spec, ours)
        out.events.append(("Normal", "Succeeded", d.message))

    ready = sum(1 for p in current if is_ready(p))
    if d.action in (Action.RESTART_GANG, Action.SUSPEND):
        ready = 0
    status.workers_ready = ready
    status.workers_summary = f"{ready}/{spec.workers}"
    if d.action == Action.WAIT and d.phase == "Running" and status.running_since is None:
        status.running_since = ts(now)
        status.last_failure_time = None
    if d.phase != old.phase and d.action not in (Action.RESTART_GANG, Action.FAIL, Action.SUCCEED):
        out.events.append(("Normal", d.reason, d.message))
    status.phase = d.phase  # type: ignore[assignment]
    status.reason, status.message = d.reason, d.message
    conds = conditions_for(d.phase, d.reason, d.message, [x.dump() for x in old.conditions], now)
    status.conditions = _side_conditions(job, d, current, claim_phase, conds, now, out)
    new_dump = status.dump()
    if new_dump != old_dump:
        out.status = new_dump
    return out


def _side_conditions(
    job: TrainingJob, d: Decision, current: list[dict[str, Any]], claim_phase: str | None,
    conds: list[Condition], now: datetime, out: Plan,
) -> list[Condition]:
    """CheckpointsDurable and WorkersBlocked over the phase conditions; one Warning Event each time
    one of them turns bad (not on every reconcile)."""
    starting = d.action in (Action.WAIT, Action.CREATE_WORKERS)  # a gang going away is not blocked
    blocked = blocked_pods(current, now) if starting else []
    if starting and (wait := recheck_after(current, now)) is not None:
        out.requeue_after = min(out.requeue_after or wait, wait)
    raw = [x.dump() for x in conds]
    for want in (checkpoints_durable(job), workers_blocked(job, blocked, claim_phase)):
        if announce(raw, want):
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
    job, _ = _job_model(body)
    return b.claim_name(job) if job is not None else None


def _apply_progress(status: TrainingJobStatus, progress: Progress, now: datetime) -> None:
    """Rank 0's report (worker 0 of the current generation) into status.

    A new step is progress (lastProgressTime moves): a higher one, or any other step reported by
    the current generation -- a gang resumed from an older checkpoint re-trains steps below
    currentStep, and that is progress too, not a hang. The checkpoint is taken whenever it changed
    (rank 0 reports the commit after the step itself). resumedFromStep is the current generation's
    own report of the checkpoint it loaded (none: it started from scratch).
    """
    current_gen = progress.generation == status.restart_generation
    if progress.step > status.current_step or (current_gen and progress.step != status.current_step):
        status.current_step = progress.step
        status.loss = f"{progress.loss:.4f}" if progress.loss is not None else status.loss
        status.last_progress_time = ts(now)
    if current_gen:
        status.resumed_from_step = progress.resumed_from or 0
    ck = progress.last_checkpoint
    if ck is not None:
        ref = CheckpointRef(step=ck.step, path=ck.path, time=ck.time)
        if status.last_checkpoint != ref:
            status.last_checkpoint = ref


def _shared_children(job: TrainingJob, owner: dict[str, Any]) -> list[dict[str, Any]]:
    objs = [b.headless_service(job, owner), b.config_map(job, owner)]
    for optional in (b.checkpoint_claim(job, owner), b.pod_group(job, owner),
                     b.progress_role(job, owner), b.progress_role_binding(job, owner)):
        if optional is not None:
            objs.append(optional)
    return objs


def _alive(pods: list[dict[str, Any]]) -> list[str]:
    """Names of the pods not already being deleted."""
    return [p["metadata"]["name"] for p in pods if not p["metadata"].get("deletionTimestamp")]


def _clean(spec: TrainingJobSpec, pods: list[dict[str, Any]]) -> list[str]:
    """Pods to delete when the job finishes, per cleanPodPolicy."""
    if spec.clean_pod_policy == "None":
        return []
    if spec.clean_pod_policy == "All":
        return _alive(pods)
    return _alive([p for p in pods if (p.get("status") or {}).get("phase") in ("Pending", "Running", None)])


def _finished(job: TrainingJob, body: dict[str, Any], old: TrainingJobStatus, pods, now: datetime, out: Plan) -> Plan:
    """A finished job: apply cleanPodPolicy to leftovers, then the TTL. Never create anything again."""
    out.delete_pods = _clean(job.spec, pods)
    ttl = job.spec.ttl_seconds_after_finished
    done = parse_ts(old.completion_time)
    if ttl is not None and done is not None:
        expires = done + timedelta(seconds=ttl)
        if now >= expires:
            out.delete_job = True
            out.events.append(("Normal", "TTLExpired", f"deleting the job {ttl}s after it finished"))
        else:
            out.requeue_after = (expires - now).total_seconds()
    return out
