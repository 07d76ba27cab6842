"""In-place gang restarts in the lifecycle: which workers stay, and when their launchers are told."""

from datetime import UTC, datetime, timedelta

import pytest

from kubetrain.core import contract
from kubetrain.core.api import Phase, TrainingJobSpec, TrainingJobStatus
from kubetrain.core.contract import format_time
from kubetrain.core.lifecycle import (
    Action,
    CreateWorkers,
    DeleteWorkers,
    FailureKind,
    KeepWorkers,
    Observed,
    Reason,
    RecordEvent,
    Scope,
    WorkerPhase,
    WorkerState,
    step,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
R, F, P = WorkerPhase.RUNNING, WorkerPhase.FAILED, WorkerPhase.PENDING


def spec(**kw) -> TrainingJobSpec:
    policy = {"backoffSeconds": 4, "inPlace": True, **kw.pop("restartPolicy", {})}
    return TrainingJobSpec.model_validate({"workers": 4, "maxSteps": 100, "restartPolicy": policy, **kw})


def running(**kw) -> TrainingJobStatus:
    base = {"phase": "Running", "gangCreated": True, "startTime": format_time(T0), "runningSince": format_time(T0)}
    return TrainingJobStatus.model_validate({**base, **kw})


def gang(*workers: WorkerState, stale: int = 0) -> Observed:
    return Observed(workers=workers, stale_workers=stale)


def w(i: int, phase: WorkerPhase = R, **kw) -> WorkerState:
    return WorkerState(i, phase, in_place=True, **kw)


def test_a_failed_worker_is_recreated_and_the_running_ones_are_kept():
    t = step(spec(), running(), gang(w(0), w(1, F, exit_code=1), w(2), w(3)), T0)
    assert t.decision is not None and t.decision.keep == (0, 2, 3)
    assert t.effects[:2] == (KeepWorkers(1, (0, 2, 3)), DeleteWorkers(Scope.ALL, (0, 2, 3)))
    assert isinstance(t.effects[2], RecordEvent) and "in place, keeping 3 of 4 workers" in t.effects[2].message
    assert (t.status.phase, t.status.restart_generation, t.status.restart_count) == (Phase.RESTARTING, 1, 1)
    assert t.status.failures == {"ExitCode": 1}


def restarted(t0: datetime = T0) -> TrainingJobStatus:
    return step(spec(), running(), gang(w(0), w(1, F, exit_code=1), w(2), w(3)), t0).status


def test_kept_workers_wait_for_the_stale_pod_and_the_backoff_then_start_with_the_recreated_one():
    st = restarted()
    kept = (w(0, held=True), w(2, held=True), w(3, held=True))
    t = step(spec(), st, gang(*kept, stale=1), T0 + timedelta(seconds=1))
    assert t.effects == (DeleteWorkers(Scope.STALE),)
    t = step(spec(), t.status, gang(*kept), T0 + timedelta(seconds=2))
    assert t.decision is not None and (t.decision.action, t.decision.reason) == (Action.WAIT, Reason.BACKOFF_WAIT)
    t = step(spec(), t.status, gang(*kept), T0 + timedelta(seconds=4))
    assert t.effects == (CreateWorkers(1, (1,), (0, 2, 3)),)
    assert "creating 1 of 4 worker(s) of generation 1 and restarting 3 in place" in t.status.message


def test_kept_workers_told_and_the_new_one_running_is_a_running_gang():
    st = step(spec(), restarted(), gang(w(0, held=True), w(2, held=True), w(3, held=True)),
              T0 + timedelta(seconds=4)).status
    t = step(spec(), st, gang(w(0), w(1), w(2), w(3)), T0 + timedelta(seconds=6))
    assert (t.status.phase, t.status.running_since) == (Phase.RUNNING, format_time(T0 + timedelta(seconds=6)))


def test_a_hang_keeps_every_worker_and_tells_them_all_after_the_backoff():
    s = spec(restartPolicy={"progressDeadlineSeconds": 60})
    t = step(s, running(), gang(w(0), w(1), w(2), w(3)), T0 + timedelta(seconds=61))
    assert t.decision is not None and t.decision.failure_kind == FailureKind.NO_PROGRESS
    assert t.decision.keep == (0, 1, 2, 3)
    held = gang(*(w(i, held=True) for i in range(4)))
    t = step(s, t.status, held, T0 + timedelta(seconds=66))
    assert t.effects == (CreateWorkers(1, (), (0, 1, 2, 3)),)


@pytest.mark.parametrize(("why", "the_spec", "workers"), [
    ("inPlace false", spec(restartPolicy={"inPlace": False}), (w(0), w(1, F, exit_code=1), w(2), w(3))),
    ("a launcher gave up", spec(),
     (w(0), w(1, F, exit_code=contract.IN_PLACE_GAVE_UP_EXIT_CODE), w(2), w(3))),
])
def test_every_worker_is_recreated_when_in_place_is_not_safe(why, the_spec, workers):
    t = step(the_spec, running(), gang(*workers), T0)
    assert t.decision is not None and t.decision.action == Action.RESTART_GANG, why
    assert t.decision.keep == () and t.effects[0] == DeleteWorkers(Scope.ALL), why


def test_only_running_workers_on_ready_nodes_that_can_restart_in_place_are_kept():
    t = step(spec(), running(), gang(
        w(0, P), w(1, F, exit_code=1), WorkerState(2, R), w(3, node_not_ready_since=T0)), T0)
    assert t.decision is not None and t.decision.action == Action.RESTART_GANG and t.decision.keep == ()
    t = step(spec(workers=5), running(), gang(w(0, P), w(1, F, exit_code=1), WorkerState(2, R), w(3), w(4)), T0)
    assert t.decision is not None and t.decision.keep == (3, 4)


def test_only_the_worker_on_a_node_about_to_go_is_moved():
    t = step(spec(), running(), gang(w(0), w(1), w(2, node="spot-3", node_terminating="karpenter.sh/disrupted"),
                                    w(3)), T0)
    assert t.decision is not None and t.decision.keep == (0, 1, 3) and t.status.ignored_restarts == 1


def test_a_gang_that_never_ran_is_recreated_whole():
    s = spec(restartPolicy={"startTimeoutSeconds": 30})
    st = TrainingJobStatus.model_validate({"phase": "Created", "gangCreated": True, "startTime": format_time(T0),
                                           "gangCreatedTime": format_time(T0)})
    t = step(s, st, gang(w(0), w(1), w(2), w(3, P)), T0 + timedelta(seconds=31))
    assert t.decision is not None and t.decision.failure_kind == FailureKind.START_TIMEOUT
    assert t.decision.keep == ()


def test_the_gave_up_exit_is_explained():
    t = step(spec(), running(), gang(w(0), w(1, F, exit_code=contract.IN_PLACE_GAVE_UP_EXIT_CODE), w(2), w(3)), T0)
    assert "its launcher was told no new generation in time" in t.status.message


@pytest.mark.parametrize(("fields", "in_place", "launcher"), [
    ({}, True, True),
    ({"restartPolicy": {"inPlace": False}}, False, True),
    ({"checkpoint": {"ephemeral": True}}, False, True),
    ({"scheduling": {"gang": "kubernetes"}}, False, True),
    ({"command": ["python3", "x.py"]}, False, False),
    ({"command": ["python3", "x.py"], "procsPerWorker": 2}, True, True),
    ({"command": ["python3", "x.py"], "restartPolicy": {"inPlace": True}}, True, True),
    ({"scheduling": {"gang": "coscheduling"}}, True, True),
])
def test_in_place_is_on_where_safe_unless_told_and_runs_every_pod_under_the_launcher(fields, in_place, launcher):
    """Unset, a gang restarts in place with durable checkpoints, no PodGroup per generation, and workers that
    run the launcher anyway; a one-process command does only when asked (its image then needs python3)."""
    s = TrainingJobSpec.model_validate({"workers": 2, **fields})
    assert (s.restarts_in_place, s.runs_launcher) == (in_place, launcher)


@pytest.mark.parametrize("fields", [
    {"checkpoint": {"ephemeral": True}},
    {"scheduling": {"gang": "kubernetes"}},
])
def test_in_place_true_refuses_what_cannot_keep_a_pod(fields):
    s = spec(**fields)
    assert [path for path, _ in s.rule_violations()] == ["restartPolicy.inPlace"]
