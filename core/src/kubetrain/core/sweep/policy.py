"""The sweep policy: one pure step from (spec, status, observed trials, now) to a transition.

Both sweep backends (the local `kubetrain sweep` runner and the operator's sweep controller)
observe their trials' jobs, call :func:`step`, write the status it returns and carry out its
effects, nothing more. Everything the sweep remembers is in its status: each trial's parameters,
state, value, intermediate values and the pruner's bookkeeping. The Optuna study is rebuilt from it
on every step, so the same status and observations always give the same transition, and a backend
that restarts loses nothing.

Trial indices are unique and never reused: a trial is recorded (with its parameters) before its
job is created, and its job's name is derived from its index, so a backend that dies between the
two creates that same job on its next step instead of a duplicate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import datetime

import optuna

from kubetrain.core.api import (
    FINISHED_SWEEP_PHASES,
    FINISHED_TRIAL_STATES,
    MAX_TRIAL_MESSAGE,
    Condition,
    Phase,
    SweepPhase,
    SweepReason,
    TrainingSweepSpec,
    TrainingSweepStatus,
    TrialRecord,
    TrialState,
    TrialValue,
)
from kubetrain.core.contract import format_time
from kubetrain.core.lifecycle.status import set_condition
from kubetrain.core.sweep import space, study
from kubetrain.core.sweep.model import (
    Effect,
    StartTrial,
    StopTrial,
    SweepEvent,
    SweepTransition,
    TrialObservation,
)

PHASE_CONDITIONS = (SweepPhase.RUNNING, SweepPhase.SUCCEEDED, SweepPhase.FAILED)
STOPPED_JOB_PHASES = (None, Phase.SUSPENDED, Phase.SUCCEEDED, Phase.FAILED)
"""Job phases in which a trial's job holds no workers: a finished trial's job in any other phase is stopped."""
MAX_PROBLEMS_SHOWN = 3


def step(name: str, spec: TrainingSweepSpec, status: TrainingSweepStatus,
         observed: Mapping[int, TrialObservation], now: datetime) -> SweepTransition:
    """The sweep `name`'s next status and effects. `observed` holds every recorded trial's job by index
    (a missing index, or phase None: that job does not exist).

    The backend must write the returned status BEFORE it carries out a StartTrial: the trial (its
    index and parameters) is then recorded before its job exists, and a StartTrial repeated after a
    crash creates the same job (its name is deterministic), never a second trial. StopTrial and
    StartTrial are idempotent. A finished sweep changes nothing but stopping jobs still running.
    The transition's requeue_after is None: what a sweep waits for is a change of one of its jobs.
    """
    new = status.model_copy(deep=True)
    if new.phase in FINISHED_SWEEP_PHASES:
        return SweepTransition(new, tuple(_stop_leftovers(new, observed)))
    problems = space.check_space(spec)
    if problems:
        leftovers = _stop_leftovers(new, observed)
        failed = _finish_failed(spec, new, SweepReason.INVALID_SPEC, _invalid_message(problems), now)
        return SweepTransition(failed.status, (*leftovers, *failed.effects))
    new.start_time = new.start_time or format_time(now)
    effects = _stop_leftovers(new, observed)  # trials this step finishes are stopped below, once
    to_judge = []
    for record in new.trials:
        record_effects, judge = _observe(spec, record, observed.get(record.index), now)
        effects += record_effects
        to_judge += [record] if judge else []
    effects += _prune(spec, new, to_judge, now)
    if _count(new, TrialState.FAILED) > spec.max_failed_trials:
        message = f"{_count(new, TrialState.FAILED)} trials failed, more than maxFailedTrials ({spec.max_failed_trials})"
        transition = _finish_failed(spec, new, SweepReason.TOO_MANY_FAILED_TRIALS, message, now)
        return SweepTransition(transition.status, (*effects, *transition.effects))
    effects += _start_trials(name, spec, new, now)
    effects += _settle(spec, status.phase, new, now)
    return SweepTransition(new, tuple(effects))


# --------------------------------------------------------------------------- one trial


def _invalid_message(problems: list[space.SpecProblem]) -> str:
    shown = "; ".join(f"spec.{path}: {reason}" for path, reason in problems[:MAX_PROBLEMS_SHOWN])
    more = len(problems) - MAX_PROBLEMS_SHOWN
    return "invalid search space: " + shown + (f" (and {more} more)" if more > 0 else "")


def _observe(spec: TrainingSweepSpec, record: TrialRecord, obs: TrialObservation | None,
             now: datetime) -> tuple[list[Effect], bool]:
    """One unfinished trial brought up to date with its job: effects, and whether the pruner should judge it."""
    if record.state in FINISHED_TRIAL_STATES:
        return [], False
    if obs is None or obs.phase is None:
        if record.state == TrialState.PENDING:  # recorded, its job not created yet (or the create was lost)
            return [StartTrial(record.index, record.job_name, dict(record.params))], False
        return _end(record, TrialState.FAILED, f"TrainingJob {record.job_name} was deleted", now), False
    record.state = TrialState.RUNNING
    record.step = obs.step
    if obs.phase == Phase.SUCCEEDED:
        return _complete(spec, record, obs, now), False
    if obs.phase == Phase.FAILED:
        return _end(record, TrialState.FAILED, obs.message or f"TrainingJob {record.job_name} failed", now), False
    if obs.loss is not None and not math.isfinite(obs.loss):
        why = f"its loss diverged ({obs.loss}) at step {obs.step}"
        return [*_end(record, TrialState.PRUNED, why, now), StopTrial(record.index, record.job_name, SweepReason.PRUNED)], False
    return [], _take_intermediate(spec, record, obs)


def _take_intermediate(spec: TrainingSweepSpec, record: TrialRecord, obs: TrialObservation) -> bool:
    """Record the objective's metric at the start of its interval (once per interval, from the first whole one on).

    Every trial is compared at the same steps, whatever step each happened to be observed at.
    """
    every = study.interval(spec)
    at = obs.step // every * every
    value = obs.metric(spec.objective.metric)
    if value is None or not math.isfinite(value) or at < every:
        return False
    if record.intermediate and record.intermediate[-1].step >= at:
        return False  # this interval is recorded, or the job went back to an older checkpoint
    record.intermediate.append(TrialValue(step=at, value=value))
    return True


def _objective(spec: TrainingSweepSpec, record: TrialRecord, final: float | None) -> float | None:
    if final is not None and not math.isfinite(final):
        return None
    if spec.objective.value == "final":
        return final
    values = [v.value for v in record.intermediate] + ([final] if final is not None else [])
    return min(values, default=None)


def _complete(spec: TrainingSweepSpec, record: TrialRecord, obs: TrialObservation, now: datetime) -> list[Effect]:
    _take_intermediate(spec, record, obs)
    metric = spec.objective.metric
    value = _objective(spec, record, obs.metric(metric))
    if value is None:
        needs = ("an evaluation: the template's evalEverySteps, or a custom command that reports eval_loss"
                 if metric == "evalLoss" else "rank 0's progress reports: spec.progressReporting")
        why = f"TrainingJob {record.job_name} succeeded without reporting a finite {metric} (the sweep needs {needs})"
        return _end(record, TrialState.FAILED, why, now)
    record.value = value
    shown = "loss" if metric == "loss" else metric
    return _end(record, TrialState.COMPLETE, f"{spec.objective.value} {shown} {value:.6g} at step {obs.step}", now)


EVENT_REASONS = {
    TrialState.COMPLETE: ("Normal", SweepReason.TRIAL_COMPLETED),
    TrialState.PRUNED: ("Normal", SweepReason.TRIAL_PRUNED),
    TrialState.FAILED: ("Warning", SweepReason.TRIAL_FAILED),
}


def _end(record: TrialRecord, state: TrialState, message: str, now: datetime) -> list[Effect]:
    """Finish a trial; the Event that says so. The status keeps the message's start only (every trial is in it)."""
    kept = message if len(message) <= MAX_TRIAL_MESSAGE else message[: MAX_TRIAL_MESSAGE - 3] + "..."
    record.state, record.message, record.completion_time = state, kept, format_time(now)
    kind, reason = EVENT_REASONS[state]
    return [SweepEvent(kind, reason, f"trial {record.index} ({record.job_name}): {message}")]


# --------------------------------------------------------------------------- pruning


def _prune(spec: TrainingSweepSpec, status: TrainingSweepStatus, to_judge: list[TrialRecord],
           now: datetime) -> list[Effect]:
    """Ask the pruner about each trial with a new intermediate value; stop the ones it prunes."""
    if not to_judge or spec.pruner.type == "none":
        return []
    rebuilt = study.rebuild(spec, status.trials, study.sampler_seed(spec, len(status.trials)))
    effects: list[Effect] = []
    for record in to_judge:
        prune, record.pruner_state = study.should_prune(rebuilt, record.index)
        if prune:
            last = record.intermediate[-1]
            record.value = last.value
            why = f"pruned at step {last.step} (loss {last.value:.6g})"
            effects += [*_end(record, TrialState.PRUNED, why, now),
                        StopTrial(record.index, record.job_name, SweepReason.PRUNED)]
    return effects


def _stop_leftovers(status: TrainingSweepStatus, observed: Mapping[int, TrialObservation]) -> list[Effect]:
    """StopTrial for every finished trial whose job still runs (a stop that was lost, or not done yet)."""
    out: list[Effect] = []
    for record in status.trials:
        obs = observed.get(record.index)
        if record.state in FINISHED_TRIAL_STATES and obs is not None and obs.phase not in STOPPED_JOB_PHASES:
            reason: str = record.state
            if record.state == TrialState.PRUNED:
                reason = SweepReason.PRUNED
            elif status.phase in FINISHED_SWEEP_PHASES:
                reason = status.reason  # the sweep ended while the trial ran
            out.append(StopTrial(record.index, record.job_name, reason))
    return out


# --------------------------------------------------------------------------- new trials


def _count(status: TrainingSweepStatus, *states: TrialState) -> int:
    return sum(1 for t in status.trials if t.state in states)


def trial_limit(spec: TrainingSweepSpec) -> int:
    """Trials the sweep runs in all: maxTrials, or the grid's size when that is smaller."""
    grid = space.grid_size(spec)
    return spec.max_trials if grid is None else min(spec.max_trials, grid)


def _start_trials(name: str, spec: TrainingSweepSpec, status: TrainingSweepStatus, now: datetime) -> list[Effect]:
    """Record new trials (parameters from the sampler) while fewer than parallelism run and more are due."""
    effects: list[Effect] = []
    rebuilt: optuna.Study | None = None
    while (_count(status, TrialState.PENDING, TrialState.RUNNING) < spec.parallelism
           and len(status.trials) < trial_limit(spec)
           and _count(status, TrialState.FAILED) <= spec.max_failed_trials):
        index = len(status.trials)
        seed = study.sampler_seed(spec, index)
        if rebuilt is None:
            rebuilt = study.rebuild(spec, status.trials, seed)
        params = study.ask(rebuilt, spec, seed)
        record = TrialRecord(index=index, job_name=space.trial_job_name(name, index), params=params,
                             start_time=format_time(now))
        status.trials.append(record)
        try:
            space.trial_spec(spec.template, params)
        except space.TrialSpecError as exc:  # parameters that clash with each other (or with the template)
            effects += _end(record, TrialState.FAILED, f"its parameters make an invalid TrainingJob: {exc}", now)
            rebuilt = None  # the study must see it failed, not running
            continue
        effects.append(StartTrial(index, record.job_name, dict(params)))
    return effects


# --------------------------------------------------------------------------- the sweep's phase


def _tally(spec: TrainingSweepSpec, status: TrainingSweepStatus) -> None:
    """Counters, the printer column's summary and the best trial so far."""
    status.trials_running = _count(status, TrialState.PENDING, TrialState.RUNNING)
    status.trials_complete = _count(status, TrialState.COMPLETE)
    status.trials_pruned = _count(status, TrialState.PRUNED)
    status.trials_failed = _count(status, TrialState.FAILED)
    finished = status.trials_complete + status.trials_pruned + status.trials_failed
    status.trials_summary = f"{finished}/{max(trial_limit(spec), len(status.trials))}"
    complete = [t for t in status.trials if t.state == TrialState.COMPLETE and t.value is not None]
    best = min(complete, key=lambda t: (t.value, t.index), default=None)
    if best is not None:
        status.best_trial, status.best_value, status.best_params = best.index, best.value, dict(best.params)


def _best(spec: TrainingSweepSpec, status: TrainingSweepStatus) -> str:
    if status.best_trial is None or status.best_value is None:
        return "no trial completed yet"
    params = ", ".join(f"{k}={v}" for k, v in (status.best_params or {}).items())
    return f"best {spec.objective.metric} {status.best_value:.6g} by trial {status.best_trial} ({params})"


def _settle(spec: TrainingSweepSpec, was: SweepPhase, status: TrainingSweepStatus, now: datetime) -> list[Effect]:
    """The sweep's phase from its trials (Running while any is unfinished or more are due), and its Event."""
    _tally(spec, status)
    unfinished = status.trials_running > 0 or len(status.trials) < trial_limit(spec)
    if not status.trials:
        phase, reason, message = SweepPhase.PENDING, SweepReason.CREATED, "no trial started yet"
    elif unfinished:
        phase, reason = SweepPhase.RUNNING, SweepReason.TRIALS_RUNNING
        message = f"{status.trials_running} running, {status.trials_summary} finished; {_best(spec, status)}"
    elif status.trials_complete:
        phase, reason, message = SweepPhase.SUCCEEDED, SweepReason.COMPLETED, _best(spec, status)
    else:
        phase, reason = SweepPhase.FAILED, SweepReason.NO_TRIAL_COMPLETED
        message = (f"no trial completed: {status.trials_pruned} pruned, {status.trials_failed} failed"
                   f" of {len(status.trials)}")
    return _set_phase(status, was, phase, reason, message, now)


def _set_phase(status: TrainingSweepStatus, was: SweepPhase, phase: SweepPhase, reason: str, message: str,
               now: datetime) -> list[Effect]:
    status.phase, status.reason, status.message = phase, reason, message
    if phase in FINISHED_SWEEP_PHASES:
        status.completion_time = status.completion_time or format_time(now)
    conds = [c.dump() for c in status.conditions]
    for kind in PHASE_CONDITIONS:
        was_true = any(c.get("type") == kind and c.get("status") == "True" for c in conds)
        if kind == phase or was_true:
            conds = set_condition(conds, kind, kind == phase, reason, message, now)
    status.conditions = [Condition.model_validate(c) for c in conds]
    if phase == was or phase == SweepPhase.PENDING:
        return []
    return [SweepEvent("Warning" if phase == SweepPhase.FAILED else "Normal", reason, message)]


def _finish_failed(spec: TrainingSweepSpec, status: TrainingSweepStatus, reason: SweepReason, message: str,
                   now: datetime) -> SweepTransition:
    """Fail the sweep: every unfinished trial ends Failed and its job is stopped."""
    was = status.phase
    effects: list[Effect] = []
    for record in status.trials:
        if record.state not in FINISHED_TRIAL_STATES:
            record.state, record.completion_time = TrialState.FAILED, format_time(now)
            record.message = f"stopped: the sweep failed ({reason})"
            effects.append(StopTrial(record.index, record.job_name, reason))
    _tally(spec, status)
    effects += _set_phase(status, was, SweepPhase.FAILED, reason, message, now)
    return SweepTransition(status, tuple(effects))
