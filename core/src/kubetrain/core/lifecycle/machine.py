"""The whole transition: `step(spec, status, observed, now) -> Transition`.

Both backends call it and carry out what it returns, nothing more: the operator turns the effects
into API calls and writes the status; the local backend turns them into process signals and keeps
the status in memory. Everything the status remembers across reconciles -- restarts, failures,
generation, start and restart times, progress -- is written here and only here.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from kubetrain.core.api import FINISHED_PHASES, Phase, TrainingJobSpec, TrainingJobStatus
from kubetrain.core.contract import format_time, parse_time
from kubetrain.core.lifecycle.model import (
    Action,
    CreateWorkers,
    Decision,
    DeleteJob,
    DeleteWorkers,
    Effect,
    KeepWorkers,
    Observed,
    Reason,
    RecordEvent,
    Scope,
    Transition,
    WorkerPhase,
    WorkerState,
)
from kubetrain.core.lifecycle.policies import JobView, decide
from kubetrain.core.lifecycle.preflight import preflight_condition
from kubetrain.core.lifecycle.status import (
    count_gpu_hours,
    fabric_condition,
    memory_event,
    phase_conditions,
    progress_condition,
    take_progress,
)

CREATE_RECHECK_SECONDS = 2.0
"""How soon to look again after creating workers."""


def view(spec: TrainingJobSpec, status: TrainingJobStatus, observed: Observed, gang_size: int | None = None) -> JobView:
    """The job as the policies see it: every worker index of the current generation, missing ones filled in."""
    present = {w.index: w for w in observed.workers}
    workers = tuple(present.get(i) or WorkerState(i, WorkerPhase.MISSING, created=status.gang_created)
                    for i in range(spec.workers))
    return JobView(
        generation=status.restart_generation,
        workers=workers,
        stale_workers=observed.stale_workers,
        restart_count=status.restart_count,
        ignored_restarts=status.ignored_restarts,
        start_time=parse_time(status.start_time),
        last_restart_time=parse_time(status.last_restart_time),
        running_since=parse_time(status.running_since),
        gang_created_time=parse_time(status.gang_created_time),
        last_progress_time=parse_time(status.last_progress_time),
        last_checkpoint=status.last_checkpoint.step if status.last_checkpoint else None,
        checkpoints_durable=observed.checkpoints_durable,
        progress_unknown=observed.progress_unknown,
        disruption=observed.disruption,
        resuming=status.phase == Phase.SUSPENDED and not spec.suspend,
        gang_size=gang_size,
        fetch=status.fetch,
    )


def step(spec: TrainingJobSpec, status: TrainingJobStatus, observed: Observed, now: datetime) -> Transition:
    """One reconcile of the lifecycle: the new status and the effects that get the job there."""
    if status.phase in FINISHED_PHASES:
        return finished(spec, status, now)
    new = status.model_copy(deep=True)
    new.max_steps, new.workers_total = spec.max_steps, spec.workers
    take_progress(new, observed, now)
    count_gpu_hours(new, spec, observed, now, progressed=new.last_progress_time != status.last_progress_time)
    resized = status.gang_created and status.workers_total not in (0, spec.workers)
    job = view(spec, new, observed, status.workers_total if resized else None)
    d = decide(spec, job, now)
    effects = _carry_out(spec, new, job, d, now)
    if d.phase != status.phase and d.action not in (Action.RESTART_GANG, Action.FAIL, Action.SUCCEED):
        effects.append(RecordEvent("Normal", d.reason, d.message))
    new.phase, new.reason, new.message = d.phase, d.reason, d.message
    conds = phase_conditions(d.phase, d.reason, d.message, [c.dump() for c in status.conditions], now)
    new.conditions = progress_condition(spec, job, conds, now)
    new.conditions, fabric_event = fabric_condition(spec, new, new.conditions, now)
    if fabric_event is not None:
        effects.append(fabric_event)
    new.conditions, preflight_event = preflight_condition(spec, new, observed, new.conditions, now)
    if preflight_event is not None:
        effects.append(preflight_event)
    if (memory_warning := memory_event(status, new)) is not None:
        effects.append(memory_warning)
    requeue = CREATE_RECHECK_SECONDS if d.action == Action.CREATE_WORKERS else d.requeue_after
    return Transition(new, tuple(effects), requeue, d)


def _count_failure(status: TrainingJobStatus, d: Decision) -> None:
    if d.failure_kind is not None:
        kind = d.failure_kind.value
        status.failures = {**status.failures, kind: status.failures.get(kind, 0) + 1}


def _new_gang(status: TrainingJobStatus, generation: int) -> None:
    """The next generation starts from nothing: no workers yet, not running, nothing resumed."""
    status.restart_generation = generation
    status.gang_created = False
    status.running_since = None
    status.gang_created_time = None
    status.resumed_from_step = 0  # until rank 0 of the new generation reports what it loaded
    status.resumed_from = None
    status.network_transport = None  # likewise: the new gang may land on other nodes


def _carry_out(spec: TrainingJobSpec, st: TrainingJobStatus, job: JobView, d: Decision, now: datetime) -> list[Effect]:
    """The decision's effects, and what the status remembers of it."""
    if d.action == Action.CREATE_WORKERS:
        # A resumed job's activeDeadlineSeconds counts from the resume, as a Kubernetes Job's does.
        resumed = st.phase == Phase.SUSPENDED
        st.start_time = format_time(now) if resumed or not st.start_time else st.start_time
        st.gang_created_time = st.gang_created_time or format_time(now)
        st.gang_created = True  # the operator writes status after the creates succeed
        missing = tuple(w.index for w in job.workers if w.phase == WorkerPhase.MISSING)
        return [CreateWorkers(d.generation, missing, tuple(w.index for w in job.workers if w.held))]
    if d.hang is not None:
        st.last_hang = d.hang
    if d.action == Action.RESTART_GANG:
        _count_failure(st, d)
        st.restart_count += 1
        st.ignored_restarts += int(d.ignored)
        _new_gang(st, d.generation)
        if spec.checkpoint.ephemeral:
            st.last_checkpoint = None  # it was in the pods being deleted
        st.last_restart_time = st.goodput.restarted_at = format_time(now)
        planned = d.failure_kind is None  # a resize, not a failure
        if not planned:
            st.last_failure_time = st.last_failure_time or format_time(now)
        kept: list[Effect] = [KeepWorkers(d.generation, d.keep)] if d.keep else []
        return [*kept, DeleteWorkers(Scope.ALL, d.keep),
                RecordEvent("Normal" if planned else "Warning", d.reason, d.message)]
    if d.action == Action.DELETE_STALE:
        return [DeleteWorkers(Scope.STALE)]
    if d.action == Action.SUSPEND:
        if st.gang_created:  # resuming starts a new gang from the latest checkpoint
            _new_gang(st, st.restart_generation + 1)
        return [DeleteWorkers(Scope.ALL)]
    if d.action in (Action.FAIL, Action.SUCCEED):
        st.completion_time = format_time(now)
        _count_failure(st, d)
        event = RecordEvent("Warning" if d.action == Action.FAIL else "Normal", d.reason, d.message)
        return [*_clean_up(spec), event]
    if d.phase == Phase.RUNNING and st.running_since is None:
        st.running_since = format_time(now)
        st.last_failure_time = None
    return []


def _clean_up(spec: TrainingJobSpec) -> list[Effect]:
    """What cleanPodPolicy deletes once the job finished."""
    scope = {"All": Scope.ALL, "Running": Scope.UNFINISHED}.get(spec.clean_pod_policy, Scope.RESTARTING)
    return [DeleteWorkers(scope)]


def finished(spec: TrainingJobSpec, status: TrainingJobStatus, now: datetime) -> Transition:
    """A finished job: cleanPodPolicy for leftovers, then the TTL. Nothing is ever created again."""
    effects = _clean_up(spec)
    ttl, done = spec.ttl_seconds_after_finished, parse_time(status.completion_time)
    if ttl is None or done is None:
        return Transition(status, tuple(effects))
    expires = done + timedelta(seconds=ttl)
    if now < expires:
        return Transition(status, tuple(effects), (expires - now).total_seconds())
    expired = RecordEvent("Normal", Reason.TTL_EXPIRED, f"deleting the job {ttl}s after it finished")
    return Transition(status, (*effects, DeleteJob(), expired))
