"""Status bookkeeping shared by both backends: rank 0's progress and the phase conditions."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from kubetrain.core import contract
from kubetrain.core.api import (
    FABRIC_DEGRADED,
    FABRIC_TRANSPORTS,
    CheckpointRef,
    Condition,
    ConditionReason,
    Goodput,
    Phase,
    TrainingJobSpec,
    TrainingJobStatus,
)
from kubetrain.core.contract import format_duration, format_time, parse_time
from kubetrain.core.lifecycle.model import Observed, Reason, RecordEvent, WorkerPhase
from kubetrain.core.lifecycle.policies import JobView
from kubetrain.core.progress import Progress

PROGRESS_UNKNOWN = "ProgressUnknown"
"""Condition: rank 0's progress cannot be known, so restartPolicy.progressDeadlineSeconds is not applied."""
PHASE_CONDITIONS = (Phase.RUNNING, Phase.RESTARTING, Phase.SUSPENDED, Phase.SUCCEEDED, Phase.FAILED)
"""Phases with a condition of their own (Created is kept True once the gang exists)."""


def take_progress(status: TrainingJobStatus, observed: Observed, now: datetime) -> None:
    """Rank 0's report, and any checkpoint the backend found itself, into status.

    A new step is progress (lastProgressTime moves): a higher one, or any other step reported by
    the current generation -- a gang resumed from an older checkpoint re-trains steps below
    currentStep, and that is progress too, not a hang. The checkpoint is taken whenever it changed
    (rank 0 reports the commit after the step itself). resumedFromStep is the current generation's
    own report of the checkpoint it loaded (none: it started from scratch), and resumedFrom the tier that
    checkpoint came from (memory or durable). networkTransport is the current generation's report too, kept
    while a record does not say (an older trainer). A record with a fetch becomes status.fetch, and one
    the fetch wrote before the trainer ran (fetch_record) says nothing of steps.
    """
    progress = observed.progress
    seen = observed.progress_seen or now
    if progress is not None and progress.fetch is not None:
        status.fetch = progress.fetch
    if progress is not None and not fetch_record(progress):
        current_gen = progress.generation == status.restart_generation
        advanced = progress.step > status.current_step or (current_gen and progress.step != status.current_step)
        if current_gen and advanced:
            _count_time(status, progress, _written(progress, seen))
        if advanced:
            status.current_step = progress.step
            status.loss = f"{progress.loss:.4f}" if progress.loss is not None else status.loss
            status.last_progress_time = format_time(seen)
        if current_gen:
            # A custom command knows its own step count (spec.maxSteps is the built-in trainer's, equal to it there).
            status.max_steps = progress.max_steps or status.max_steps
            status.resumed_from_step = progress.resumed_from or 0
            status.resumed_from = progress.resumed_tier if progress.resumed_from is not None else None
            status.network_transport = progress.network_transport or status.network_transport
            status.memory = progress.memory or status.memory
            _take_rates(status, progress)
        ck = progress.last_checkpoint
        if ck is not None:
            ref = CheckpointRef(step=ck.step, path=ck.path, time=ck.time)
            if status.last_checkpoint != ref:
                status.last_checkpoint = ref
    found = observed.checkpoint
    if found is not None and (status.last_checkpoint is None or status.last_checkpoint.step < found.step):
        status.last_checkpoint = found


def memory_event(before: TrainingJobStatus, after: TrainingJobStatus) -> RecordEvent | None:
    """One Warning Event for the memory notices rank 0 reported that status did not hold yet (the memory tier or
    background staging does not fit the pods' memory); a restarted gang that says the same says nothing new."""
    seen = set(before.memory.notices) if before.memory is not None else set()
    new = [n for n in (after.memory.notices if after.memory is not None else []) if n not in seen]
    return RecordEvent("Warning", ConditionReason.MEMORY_BUDGET, "; ".join(new)) if new else None


def fetch_record(progress: Progress) -> bool:
    """The fetch's own record (kubetrain.trainer.data.fetch, in the init container): no step yet. Taken for a step,
    its step 0 of a restarted generation would move currentStep back and count as progress."""
    return progress.fetch is not None and progress.step == 0


def _count_time(status: TrainingJobStatus, progress: Progress, now: datetime) -> None:
    """A new step of the current generation (called before currentStep takes it): the time since the
    generation's previous step was productive. At a restarted generation's first step, the steps between the
    checkpoint it resumed from and the highest step reached before, which it trains again, move from productive
    to lost (at the previous mean step time), and so does the time since the last step before the restart
    (finding the failure, the restart, the start of the new generation): productive is then what the job keeps,
    as the wall-clock accounting of bench/goodput.py counts it."""
    g = status.goodput
    last = parse_time(g.step_time) or parse_time(status.last_progress_time)
    if g.generation == status.restart_generation and last is not None:
        g.productive_seconds = round(g.productive_seconds + max(0.0, (now - last).total_seconds()), 3)
    elif status.current_step > 0:  # a later generation's first step
        redone = max(0, status.current_step - (progress.resumed_from or 0))
        redo = min(g.productive_seconds, redone * (g.step_seconds or 0.0))  # counted productive when first trained
        g.steps_lost += redone
        g.productive_seconds = round(g.productive_seconds - redo, 3)
        g.lost_seconds = round(g.lost_seconds + _restart_seconds(g, last, now) + redo, 3)
    g.generation, g.restarted_at, g.step_time = status.restart_generation, None, format_time(now, micros=True)
    g.step_seconds = progress.step_seconds or g.step_seconds


def _written(progress: Progress, seen: datetime) -> datetime:
    """When rank 0 wrote the record: its own time stamp, which a record delayed on its way (the last one before a
    fault often is, by seconds) keeps; `seen` where it has none or says later (a clock ahead of the operator's)."""
    stamp = parse_time(progress.time)
    return stamp if stamp is not None and stamp <= seen else seen


def _restart_seconds(g: Goodput, last_step: datetime | None, now: datetime) -> float:
    """What a gang restart cost in wall time: from the last step before it to the new generation's first step
    (`now`); none after a suspension (restartedAt unset), whose time is not counted."""
    restarted = parse_time(g.restarted_at)
    if restarted is None:
        return 0.0
    since = last_step if last_step is not None and last_step <= restarted else restarted
    return max(0.0, (now - since).total_seconds())


def count_gpu_hours(status: TrainingJobStatus, spec: TrainingJobSpec, observed: Observed, now: datetime,
                    progressed: bool) -> None:
    """status.gpuHours up to now, when the GPUs the worker pods hold changed or rank 0 reported a step (the
    status is written then anyway): a job that only holds its GPUs costs no status write for it. Between two
    counts the job holds goodput.gpusHeld (gpu_hours_now). A count whose status is not written leaves the
    anchor where it was, so the next one counts the same time once."""
    g = status.goodput
    per_worker = spec.resources.gpus_per_worker
    held = per_worker * sum(1 for w in observed.workers if w.phase == WorkerPhase.RUNNING
                            or (w.phase == WorkerPhase.PENDING and w.node is not None))
    g.lost_gpu_hours = round(g.lost_seconds * per_worker * spec.workers / 3600, 4)
    if held == g.gpus_held and not (progressed and held):
        return
    status.gpu_hours = gpu_hours_now(status.gpu_hours, g, now)
    g.gpus_held = held
    g.gpus_counted_at = format_time(now) if held else None


def gpu_hours_now(counted: float, g: Goodput, now: datetime) -> float:
    """status.gpuHours (`counted`) with the GPUs held since goodput.gpusCountedAt counted up to `now`."""
    since = parse_time(g.gpus_counted_at)
    if since is None or not g.gpus_held:
        return counted
    return round(counted + g.gpus_held * max(0.0, (now - since).total_seconds()) / 3600, 4)


def _take_rates(status: TrainingJobStatus, progress: Progress) -> None:
    """Percent, ETA, tokens/s, MFU and eval loss from the current generation's report."""
    if status.max_steps > 0:
        status.percent_complete = f"{min(100, status.current_step * 100 // status.max_steps)}%"
    if progress.step_seconds:
        status.eta = format_duration(max(0, status.max_steps - status.current_step) * progress.step_seconds)
    if progress.tokens_per_second:
        status.tokens_per_second = round(progress.tokens_per_second)
    if progress.mfu is not None:
        status.mfu = f"{progress.mfu * 100:.1f}%"
    if progress.eval_loss is not None:
        status.eval_loss = f"{progress.eval_loss:.4f}"
    if progress.export is not None:
        status.export = progress.export


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
                "lastTransitionTime": format_time(now) if changed else c.get("lastTransitionTime", format_time(now)),
            })
        else:
            out.append(c)
    if not found and (value or add_false):
        out.append({"type": type_, "status": status, "reason": reason, "message": message,
                    "lastTransitionTime": format_time(now)})
    return out


def phase_conditions(
    phase: str, reason: str, message: str, conditions: list[dict[str, Any]], now: datetime
) -> list[Condition]:
    """Created stays True once set; the phase's own condition is True, the other phase conditions False."""
    conds = list(conditions)
    if phase == Phase.CREATED:
        conds = set_condition(conds, Phase.CREATED, True, reason, message, now)
    elif phase not in (Phase.PENDING, Phase.SUSPENDED):
        conds = set_condition(conds, Phase.CREATED, True, Reason.GANG_CREATED, "worker pods created", now)
    for t in PHASE_CONDITIONS:
        was_true = any(c.get("type") == t and c.get("status") == "True" for c in conds)
        if t == phase or was_true:
            conds = set_condition(conds, t, t == phase, reason, message, now)
    return [Condition.model_validate(c) for c in conds]


PROGRESS_UNKNOWN_MESSAGES = {
    Reason.PROGRESS_REPORTING_OFF: "progressReporting is false: progressDeadlineSeconds is not applied",
    Reason.PROGRESS_REPORTING_FORBIDDEN: "the progress Role or RoleBinding was refused (see Events): "
                                         "progressDeadlineSeconds is not applied until they exist",
}


def progress_condition(spec: TrainingJobSpec, job: JobView, conds: list[Condition], now: datetime) -> list[Condition]:
    """ProgressUnknown=True while a progress deadline is set but rank 0 cannot report: the deadline is then
    not applied, rather than restarting a healthy gang it cannot see."""
    if spec.restart_policy.progress_deadline_seconds is None:
        return conds
    raw = [c.dump() for c in conds]
    why = job.progress_unknown
    if why is not None:
        raw = set_condition(raw, PROGRESS_UNKNOWN, True, why, PROGRESS_UNKNOWN_MESSAGES.get(why, why), now)
    else:
        raw = set_condition(raw, PROGRESS_UNKNOWN, False, Reason.PROGRESS_REPORTED, "rank 0 can report progress", now)
    return [Condition.model_validate(c) for c in raw]


NO_NETWORK_TRANSPORTS = (contract.TRANSPORT_LOCAL, contract.TRANSPORT_GLOO)
"""Transports that do not say anything about the fabric: one node (P2P/SHM), or no NCCL at all (gloo)."""


def fabric_mismatch(fabric: str, transport: str | None) -> tuple[ConditionReason, str] | None:
    """(reason, message) when rank 0's NCCL transport is not the one spec.fabric is for. None without a
    fabric, before the transport is known, when it is the fabric's, or when no network is in play."""
    expected = FABRIC_TRANSPORTS.get(fabric)
    if expected is None or transport is None or transport == expected or transport in NO_NETWORK_TRANSPORTS:
        return None
    message = f"spec.fabric {fabric} expects NCCL transport {expected}, but rank 0 reports {transport}"
    if transport == contract.TRANSPORT_SOCKET:
        return ConditionReason.NCCL_FALLBACK_TO_SOCKET, (
            f"{message}: NCCL fell back to TCP sockets; check the fabric's device resource, plugin and "
            "NCCL_IB_HCA/NCCL_SOCKET_IFNAME (docs/scheduling.md, Fabrics)")
    return ConditionReason.UNEXPECTED_TRANSPORT, message


def fabric_condition(
    spec: TrainingJobSpec, status: TrainingJobStatus, conds: list[Condition], now: datetime
) -> tuple[list[Condition], RecordEvent | None]:
    """FabricDegraded=True while rank 0's NCCL transport is not spec.fabric's, with one Warning Event as it
    turns True (or its reason changes); False (FabricInUse) once a later report is fine. Absent until a
    mismatch is seen (no fabric, nothing reported yet, or only the fabric's own transport so far)."""
    transport = status.network_transport
    if FABRIC_TRANSPORTS.get(spec.fabric) is None or transport is None:
        return conds, None
    raw = [c.dump() for c in conds]
    bad = fabric_mismatch(spec.fabric, transport)
    event = None
    if bad is None:
        raw = set_condition(raw, FABRIC_DEGRADED, False, ConditionReason.FABRIC_IN_USE,
                            f"rank 0 reports NCCL transport {transport} (spec.fabric {spec.fabric})", now)
    else:
        reason, message = bad
        if not any(c.get("type") == FABRIC_DEGRADED and c.get("status") == "True" and c.get("reason") == reason
                   for c in raw):
            event = RecordEvent("Warning", reason, message)
        raw = set_condition(raw, FABRIC_DEGRADED, True, reason, message, now)
    return [Condition.model_validate(c) for c in raw], event
