"""One sweep reconcile as pure functions: trial TrainingJobs -> observations -> sweep policy -> a SweepPlan.

`plan(sweep_body, jobs, now)` returns what the I/O layer (sweeps/apply.py) carries out, in this order:
the ONE status write (on the resourceVersion the plan was made from), then the trial TrainingJobs
to create (owned by the sweep), the trial jobs to suspend, and the Events. The policy
(kubetrain.core.sweep.policy.step) decides and keeps the status; this module only turns jobs into
observations and effects into Kubernetes objects, and never talks to the API server or reads a clock.

A sweep in a finished phase keeps its status: the policy's step then only stops trial jobs that
still run (a crash between the status write and the suspend, or a job resumed by hand, must not
keep GPUs busy for a trial the sweep no longer counts), and nothing looks at it again until an event.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from kubetrain.core import api, contract
from kubetrain.core.api import (
    FINISHED_SWEEP_PHASES,
    FINISHED_TRIAL_STATES,
    Condition,
    ConditionReason,
    Phase,
    SweepPhase,
    SweepReason,
    TrainingSweep,
    TrainingSweepStatus,
)
from kubetrain.core.contract import format_time
from kubetrain.core.lifecycle import set_condition
from kubetrain.core.sweep import policy, space
from kubetrain.core.sweep.model import StartTrial, StopTrial, SweepEvent, TrialObservation
from kubetrain.core.validate import stored_object

__all__ = ["SweepPlan", "finished", "needs_live_look", "observation", "observe",
           "owned_jobs", "plan", "sweep_owner_reference", "trial_key"]

Event = tuple[str, str, str]
"""(type Normal|Warning, reason, message)."""


@dataclass
class SweepPlan:
    status: dict[str, Any] | None = None
    """The whole new status (wire form), or None when it did not change."""
    create: list[dict[str, Any]] = field(default_factory=list)
    """Trial TrainingJobs to create, each owned by the sweep (a 409 of its own job is fine)."""
    suspend: list[str] = field(default_factory=list)
    """Trial TrainingJobs to stop: spec.suspend=true (pods go, the job and its checkpoints stay)."""
    events: list[Event] = field(default_factory=list)
    requeue_after: float | None = None
    """When the policy wants to look again (None: on the next change)."""
    foreign: list[str] = field(default_factory=list)
    """Jobs labelled as this sweep's trials that it does not own (never observed, never touched)."""
    finished: bool = False
    """The sweep's status is in a finished phase (after this plan's status write)."""


# --------------------------------------------------------------------------- observe


def trial_key(job: Mapping[str, Any]) -> tuple[str, str] | None:
    """(namespace, sweep) of a TrainingJob labelled as a sweep's trial; None for any other job."""
    meta = job.get("metadata") or {}
    sweep = (meta.get("labels") or {}).get(contract.LABEL_SWEEP)
    return (meta["namespace"], sweep) if sweep and meta.get("namespace") else None


def _owned_by(obj: Mapping[str, Any], uid: str | None) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return uid is not None and any(ref.get("uid") == uid for ref in refs)


def owned_jobs(sweep: Mapping[str, Any], jobs: Iterable[Mapping[str, Any]]) -> tuple[dict[str, Mapping[str, Any]], list[str]]:
    """The sweep's trial jobs by name, and the names of the labelled jobs it does not own (sorted)."""
    uid = (sweep.get("metadata") or {}).get("uid")
    owned: dict[str, Mapping[str, Any]] = {}
    foreign: list[str] = []
    for job in jobs:
        name = job["metadata"]["name"]
        if _owned_by(job, uid):
            owned[name] = job
        else:
            foreign.append(name)
    return owned, sorted(foreign)


def parse_loss(raw: object) -> float | None:
    """status.loss of a TrainingJob (a string, rounded for display) as a number; None when unset or
    unparsable. "nan" and "inf" stay what they are: the policy prunes a trial whose loss diverged."""
    if not isinstance(raw, str | int | float) or isinstance(raw, bool):
        return None
    try:
        return float(raw)
    except ValueError:
        return None


def observation(job: Mapping[str, Any] | None) -> TrialObservation:
    """What the policy sees of one trial's TrainingJob (phase None: no such job)."""
    if job is None:
        return TrialObservation(phase=None)
    status = job.get("status") or {}
    try:
        phase = Phase(status.get("phase") or Phase.PENDING)
    except ValueError:
        phase = Phase.PENDING
    try:
        step = int(status.get("currentStep") or 0)
    except (TypeError, ValueError):
        step = 0
    return TrialObservation(phase=phase, step=step, loss=parse_loss(status.get("loss")),
                            message=str(status.get("message") or ""), eval_loss=parse_loss(status.get("evalLoss")))


def observe(status: TrainingSweepStatus, owned: Mapping[str, Mapping[str, Any]]) -> dict[int, TrialObservation]:
    """Every recorded trial's observation, by index."""
    return {t.index: observation(owned.get(t.job_name)) for t in status.trials}


def finished(status: Mapping[str, Any] | None) -> bool:
    return (status or {}).get("phase") in FINISHED_SWEEP_PHASES


def needs_live_look(sweep: Mapping[str, Any], jobs: Iterable[Mapping[str, Any]]) -> bool:
    """A trial the status counts as unfinished has no job in the cache: confirm with a live read before
    the policy takes that absence for a deleted job (the watch can lag the operator's own creates)."""
    raw = sweep.get("status") or {}
    if finished(raw):
        return False
    owned, _ = owned_jobs(sweep, jobs)
    status = _status_of(sweep)
    return any(t.state not in FINISHED_TRIAL_STATES and t.job_name not in owned for t in status.trials)


# --------------------------------------------------------------------------- plan


def _sweep_model(body: Mapping[str, Any]) -> tuple[TrainingSweep | None, list[str], list[str]]:
    return stored_object(TrainingSweep, body)


def _status_of(body: Mapping[str, Any]) -> TrainingSweepStatus:
    """The recorded status; top-level fields this version does not know are dropped. A status that does
    not validate raises: it holds the trials, and stepping from an empty one would overwrite them."""
    fields = TrainingSweepStatus.model_fields
    known = {f.alias or name for name, f in fields.items()} | set(fields)
    raw = {k: v for k, v in (body.get("status") or {}).items() if k in known}
    try:
        return TrainingSweepStatus.model_validate(raw)
    except ValidationError as exc:
        meta = body.get("metadata") or {}
        raise ValueError(f"sweep {meta.get('namespace')}/{meta.get('name')}: its status does not validate, "
                         f"not stepping it: {exc}") from None


def sweep_owner_reference(body: Mapping[str, Any]) -> dict[str, Any]:
    """The ownerReference that makes a trial job the sweep's (garbage-collected with it)."""
    meta = body["metadata"]
    return {"apiVersion": api.API_VERSION, "kind": api.SWEEP_KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def plan(body: Mapping[str, Any], jobs: Sequence[Mapping[str, Any]], now: datetime,
         refused: tuple[str, str] | None = None) -> SweepPlan:
    """One reconcile of the sweep `body`, given the TrainingJobs labelled as its trials. `refused`: (reason,
    message) of the last trial job create the API server refused or found its name taken, None once one was made."""
    owned, foreign = owned_jobs(body, jobs)
    old = _status_of(body)
    sweep, problems, unknown = _sweep_model(body)
    if unknown and old.phase not in FINISHED_SWEEP_PHASES:
        return _outdated(old, unknown, now, foreign)
    if sweep is None:
        if old.phase in FINISHED_SWEEP_PHASES:
            return SweepPlan(foreign=foreign, finished=True)
        return _invalid(old, problems, now, foreign)
    t = policy.step(sweep.metadata.name, sweep.spec, old, observe(old, owned), now)
    if old.phase in FINISHED_SWEEP_PHASES:  # only its leftover trials to stop: no status, no Events again
        stops = [e.job_name for e in t.effects if isinstance(e, StopTrial)]
        return SweepPlan(suspend=_to_suspend(stops, owned), foreign=foreign, finished=True)
    generation = int((body.get("metadata") or {}).get("generation") or 0)
    new = t.status.model_copy(update={"observed_generation": generation})
    new.conditions = _trials_blocked(new.conditions, None if new.phase in FINISHED_SWEEP_PHASES else refused, now)
    out = SweepPlan(requeue_after=t.requeue_after, foreign=foreign, finished=new.phase in FINISHED_SWEEP_PHASES)
    if new.dump() != old.dump():
        out.status = new.dump()
    stops = []
    for effect in t.effects:
        if isinstance(effect, StartTrial):
            out.create.append(_trial_job(body, sweep, effect))
        elif isinstance(effect, StopTrial):
            stops.append(effect.job_name)
        elif isinstance(effect, SweepEvent):
            out.events.append((effect.type, effect.reason, effect.message))
    out.suspend = _to_suspend(stops, owned)
    return out


def _trials_blocked(conditions: list[Condition], refused: tuple[str, str] | None, now: datetime) -> list[Condition]:
    """TrialsBlocked: True with the API server's word while a trial job cannot be created, False once one was."""
    conds = [c.dump() for c in conditions]
    if refused is not None:
        conds = set_condition(conds, api.TRIALS_BLOCKED, True, refused[0], refused[1], now)
    elif any(c.get("type") == api.TRIALS_BLOCKED and c.get("status") == "True" for c in conds):
        conds = set_condition(conds, api.TRIALS_BLOCKED, False, ConditionReason.TRIALS_CREATED, "every trial's job was created", now)
    else:
        return conditions
    return [Condition.model_validate(c) for c in conds]


def _trial_job(body: Mapping[str, Any], sweep: TrainingSweep, effect: StartTrial) -> dict[str, Any]:
    """The trial's TrainingJob, owned by the sweep (deleted with it by the garbage collector)."""
    manifest = space.trial_manifest(sweep.metadata.name, body["metadata"].get("namespace"), sweep.spec,
                                    effect.index, effect.params)
    manifest["metadata"]["ownerReferences"] = [sweep_owner_reference(body)]
    return manifest


def _to_suspend(stops: Iterable[str], owned: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The jobs of the StopTrial effects not already asked to stop: the policy repeats a stop until the
    job's phase says it holds no pods, and the job controller turns spec.suspend into that phase a
    moment later."""
    return [name for name in dict.fromkeys(stops) if _running(owned.get(name))]


def _running(job: Mapping[str, Any] | None) -> bool:
    """The job exists, is not being deleted, and nobody has asked it to suspend yet."""
    if job is None or (job.get("spec") or {}).get("suspend") is True:
        return False
    return not (job.get("metadata") or {}).get("deletionTimestamp")


def _invalid(old: TrainingSweepStatus, problems: list[str], now: datetime, foreign: list[str]) -> SweepPlan:
    """A spec the API server accepted but the model refuses: Failed once, with every problem named."""
    message = "invalid spec: " + "; ".join(problems)
    new = old.model_copy(update={"phase": SweepPhase.FAILED, "reason": SweepReason.INVALID_SPEC, "message": message,
                                 "completion_time": format_time(now)})
    return SweepPlan(status=new.dump(), events=[("Warning", SweepReason.INVALID_SPEC, message)], foreign=foreign,
                     finished=True)


def _outdated(old: TrainingSweepStatus, unknown: list[str], now: datetime, foreign: list[str]) -> SweepPlan:
    """Fields this operator does not know (the CRD is newer): the sweep starts no trial until an operator that
    knows them comes (a trial made without them would train something else than the manifest says); the trials
    already running go on. OperatorOutdated and one Event say so."""
    message = (f"{', '.join(unknown)}: not known to this operator (the TrainingSweep CRD is newer than the "
               "operator); no trial starts until the operator is upgraded")
    conds = [c.dump() for c in old.conditions]
    said = any(c.get("type") == api.OPERATOR_OUTDATED and c.get("status") == "True" for c in conds)
    new = old.model_copy(update={"message": message})
    new.conditions = [Condition.model_validate(c) for c in set_condition(
        conds, api.OPERATOR_OUTDATED, True, ConditionReason.UNKNOWN_FIELDS, message, now)]
    events: list[Event] = [] if said else [("Warning", ConditionReason.UNKNOWN_FIELDS, message)]
    return SweepPlan(status=None if new.dump() == old.dump() else new.dump(), events=events, foreign=foreign)


def foreign_message(names: Sequence[str]) -> str:
    """The Warning Event's message for labelled jobs the sweep does not own."""
    return (f"TrainingJob {', '.join(names)} carries the label {contract.LABEL_SWEEP} of this sweep but is not "
            "owned by it: not adopted, not counted as a trial; delete it or remove the label")


FOREIGN_REASON = ConditionReason.FOREIGN_OBJECT
CREATE_REJECTED_REASON = ConditionReason.CREATE_REJECTED
