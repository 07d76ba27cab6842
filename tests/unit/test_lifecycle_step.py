"""lifecycle.step: the whole transition (new status + effects), one table per policy. `now` is passed in."""

from datetime import UTC, datetime, timedelta

import pytest

from kubetrain.core import contract
from kubetrain.core.api import (
    FABRIC_DEGRADED,
    CheckpointRef,
    ConditionReason,
    Phase,
    TrainingJobSpec,
    TrainingJobStatus,
)
from kubetrain.core.contract import format_time
from kubetrain.core.lifecycle import (
    Action,
    CreateWorkers,
    DeleteJob,
    DeleteWorkers,
    Observed,
    Reason,
    RecordEvent,
    Scope,
    WorkerPhase,
    WorkerState,
    step,
)
from kubetrain.core.lifecycle.status import fabric_condition, fabric_mismatch
from kubetrain.core.progress import CheckpointRecord, Progress

T0 = datetime(2026, 1, 1, tzinfo=UTC)
R, S, F, P = WorkerPhase.RUNNING, WorkerPhase.SUCCEEDED, WorkerPhase.FAILED, WorkerPhase.PENDING


def spec(**kw) -> TrainingJobSpec:
    base = {"workers": 2, "maxSteps": 100,
            "restartPolicy": {"backoffLimit": 2, "backoffSeconds": 4, "maxBackoffSeconds": 10}}
    return TrainingJobSpec.model_validate({**base, **kw})


def running(**kw) -> TrainingJobStatus:
    base = {"phase": "Running", "gangCreated": True, "startTime": format_time(T0), "runningSince": format_time(T0)}
    return TrainingJobStatus.model_validate({**base, **kw})


def workers(*phases, codes=None) -> Observed:
    codes = codes or {}
    return Observed(workers=tuple(WorkerState(i, ph, exit_code=codes.get(i)) for i, ph in enumerate(phases)))


def kinds(effects) -> list[type]:
    return [type(e) for e in effects]


# --------------------------------------------------------------------------- start


def test_start_creates_every_worker_and_remembers_the_start_time():
    t = step(spec(), TrainingJobStatus(), Observed(), T0)
    assert t.effects[0] == CreateWorkers(0, (0, 1))
    assert t.effects[1] == RecordEvent("Normal", Reason.CREATING_WORKERS, t.status.message)
    assert (t.status.phase, t.status.gang_created, t.status.start_time) == (Phase.CREATED, True, format_time(T0))
    assert (t.status.max_steps, t.status.workers_total, t.requeue_after) == (100, 2, 2.0)
    assert [c.type for c in t.status.conditions] == ["Created"]


def test_start_creates_only_the_missing_workers():
    st = TrainingJobStatus.model_validate({"phase": "Created", "startTime": format_time(T0)})
    t = step(spec(workers=3), st, Observed(workers=(WorkerState(1, P),)), T0)
    assert t.effects == (CreateWorkers(0, (0, 2)),)  # same phase: no second Event


def test_all_running_sets_running_since_once_and_clears_the_failure_time():
    st = TrainingJobStatus.model_validate({"phase": "Created", "gangCreated": True, "lastFailureTime": "x"})
    t = step(spec(), st, workers(R, R), T0)
    assert (t.status.phase, t.status.running_since, t.status.last_failure_time) == (Phase.RUNNING, format_time(T0), None)
    later = step(spec(), t.status, workers(R, R), T0 + timedelta(seconds=5))
    assert later.status.running_since == format_time(T0) and later.effects == ()


# --------------------------------------------------------------------------- progress


def test_a_new_step_is_progress_and_a_checkpoint_is_taken():
    ck = CheckpointRecord(step=40, path="/c/40", time="t")
    p = Progress(step=42, loss=1.25, generation=0, last_checkpoint=ck, resumed_from=0)
    t = step(spec(), running(), Observed(workers=workers(R, R).workers, progress=p), T0)
    assert (t.status.current_step, t.status.loss, t.status.last_progress_time) == (42, "1.2500", format_time(T0))
    assert t.status.last_checkpoint == CheckpointRef(step=40, path="/c/40", time="t")
    same = step(spec(), t.status, Observed(workers=workers(R, R).workers, progress=p), T0 + timedelta(seconds=9))
    assert same.status.last_progress_time == format_time(T0)  # the same step again is not progress


def test_the_tier_a_generation_resumed_from_is_its_own_report_until_the_next_restart():
    p = Progress(step=31, generation=0, resumed_from=30, resumed_tier="memory")
    t = step(spec(), running(), Observed(workers=workers(R, R).workers, progress=p), T0)
    assert (t.status.resumed_from_step, t.status.resumed_from) == (30, "memory")
    assert t.status.dump()["resumedFrom"] == "memory"
    restarted = step(spec(), t.status, workers(R, F, codes={1: 137}), T0)
    assert (restarted.status.resumed_from_step, restarted.status.resumed_from) == (0, None)


def test_a_checkpoint_found_by_the_backend_counts_when_newer():
    found = CheckpointRef(step=50, path="/c/50")
    t = step(spec(), running(lastCheckpoint={"step": 40}), Observed(workers=workers(R, R).workers, checkpoint=found), T0)
    assert t.status.last_checkpoint == found
    older = step(spec(), t.status, Observed(workers=workers(R, R).workers, checkpoint=CheckpointRef(step=10)), T0)
    assert older.status.last_checkpoint == found


# --------------------------------------------------------------------------- restart / backoff / permanent


def test_restart_deletes_every_worker_counts_the_failure_and_starts_a_new_generation():
    st = running(lastCheckpoint={"step": 40}, resumedFromStep=20)
    t = step(spec(), st, workers(R, F, codes={1: 137}), T0)
    assert kinds(t.effects) == [DeleteWorkers, RecordEvent]
    assert t.effects[0] == DeleteWorkers(Scope.ALL) and t.effects[1].type == "Warning"
    assert "from the checkpoint at step 40" in t.effects[1].message
    s = t.status
    assert (s.phase, s.reason, s.restart_count, s.restart_generation) == (Phase.RESTARTING, "ExitCode", 1, 1)
    assert (s.gang_created, s.running_since, s.resumed_from_step, s.failures) == (False, None, 0, {"ExitCode": 1})
    assert (s.last_restart_time, s.last_failure_time, s.last_checkpoint.step) == (format_time(T0), format_time(T0), 40)
    assert t.requeue_after == 4.0


def test_next_generation_waits_for_its_backoff_then_starts():
    t = step(spec(), running(), workers(R, F, codes={1: 137}), T0)
    wait = step(spec(), t.status, Observed(), T0 + timedelta(seconds=1))
    assert (wait.decision.reason, wait.effects, wait.requeue_after) == (Reason.BACKOFF_WAIT, (), pytest.approx(3.0))
    go = step(spec(), wait.status, Observed(), T0 + timedelta(seconds=4))
    assert go.effects == (CreateWorkers(1, (0, 1)),) and go.status.gang_created


def test_ephemeral_checkpoints_are_forgotten_with_the_gang():
    t = step(spec(checkpoint={"ephemeral": True}), running(lastCheckpoint={"step": 40}),
             Observed(workers=workers(R, F, codes={1: 1}).workers, checkpoints_durable=False), T0)
    assert t.status.last_checkpoint is None and "checkpoints are ephemeral" in t.status.message


def test_permanent_exit_code_fails_counts_and_cleans_up():
    t = step(spec(), running(), workers(R, F, codes={1: 127}), T0)
    assert (t.status.phase, t.status.reason, t.status.completion_time) == (Phase.FAILED, "PermanentError", format_time(T0))
    assert t.status.failures == {"PermanentExitCode": 1}
    assert t.effects == (DeleteWorkers(Scope.UNFINISHED), RecordEvent("Warning", "PermanentError", t.status.message))


def test_backoff_limit_fails_the_job():
    t = step(spec(), running(restartCount=2, restartGeneration=2), workers(F, R, codes={0: 1}), T0)
    assert (t.status.phase, t.status.reason, t.status.restart_count) == (Phase.FAILED, "BackoffLimitExceeded", 2)


def test_no_progress_restarts_the_gang():
    s = spec(restartPolicy={"progressDeadlineSeconds": 60})
    t = step(s, running(), workers(R, R), T0 + timedelta(seconds=60))
    assert (t.decision.action, t.status.reason, t.status.failures) == (Action.RESTART_GANG, "NoProgress", {"NoProgress": 1})


def test_node_lost_past_its_grace_restarts_the_gang():
    obs = Observed(workers=(WorkerState(0, R), WorkerState(1, R, node_not_ready_since=T0)))
    s = spec(restartPolicy={"nodeNotReadyGraceSeconds": 30})
    assert step(s, running(), obs, T0 + timedelta(seconds=29)).decision.action == Action.WAIT
    assert step(s, running(), obs, T0 + timedelta(seconds=30)).status.reason == "NodeLost"


def test_a_node_that_died_is_lost_once_the_job_made_no_progress_for_the_grace():
    """The node lifecycle controller says NotReady ~50 s after a node dies; the job stopped progressing then:
    the grace counts from the last progress, not from NotReady."""
    s = spec(restartPolicy={"nodeNotReadyGraceSeconds": 60})
    died = Observed(workers=(WorkerState(0, R), WorkerState(1, R, node_not_ready_since=T0 + timedelta(seconds=50))))
    st = running(lastProgressTime=format_time(T0))
    assert step(s, st, died, T0 + timedelta(seconds=55)).decision.action == Action.WAIT
    assert step(s, st, died, T0 + timedelta(seconds=60)).status.reason == "NodeLost"
    trains = running(lastProgressTime=format_time(T0 + timedelta(seconds=58)))  # its ranks there still meet
    assert step(s, trains, died, T0 + timedelta(seconds=100)).decision.action == Action.WAIT


def test_a_node_that_died_under_a_broken_gang_is_lost_without_its_grace():
    """The worker left on a healthy node lost its peers (its launcher waits for the next generation): the gang
    cannot progress, so the NotReady node's worker is lost at once, not after the grace."""
    s = spec(restartPolicy={"nodeNotReadyGraceSeconds": 60})
    st = running(lastProgressTime=format_time(T0))
    gone = WorkerState(1, R, node_not_ready_since=T0 + timedelta(seconds=48))
    broken = Observed(workers=(WorkerState(0, R, peers_lost_since=T0 + timedelta(seconds=1)), gone))
    t = step(s, st, broken, T0 + timedelta(seconds=48))
    assert (t.decision.action, t.status.reason) == (Action.RESTART_GANG, "NodeLost")
    whole = Observed(workers=(WorkerState(0, R), gone))  # no one lost a peer: the grace applies
    assert step(s, st, whole, T0 + timedelta(seconds=48)).decision.action == Action.WAIT
    unready = Observed(workers=(WorkerState(0, R, peers_lost_since=T0 + timedelta(seconds=1)), WorkerState(1, R)))
    assert step(s, st, unready, T0 + timedelta(seconds=48)).decision.action == Action.WAIT  # every node Ready


def test_not_ready_from_the_last_restart_or_for_a_moment_is_no_broken_gang():
    """After a restart (backoff 5 s) a kept worker lost its peers when the old gang stopped, and stays not Ready
    until its launcher reads the new generation: no sign against a NotReady node for 10 s after it was told.
    Nor is a worker not Ready for under 3 s (a restarted kubelet's pods, until their probe answers)."""
    s = spec(restartPolicy={"nodeNotReadyGraceSeconds": 60, "backoffSeconds": 5})
    restarted = T0 + timedelta(seconds=30)
    gone = WorkerState(1, R, node_not_ready_since=T0 + timedelta(seconds=20))

    def at(now: datetime) -> TrainingJobStatus:  # progress a second ago: the grace is far
        return running(lastProgressTime=format_time(now - timedelta(seconds=1)), restartGeneration=1,
                       restartCount=1, lastRestartTime=format_time(restarted))

    for since, now in [(restarted + timedelta(seconds=2), restarted + timedelta(seconds=8)),  # the old gang's
                       (restarted + timedelta(seconds=40), restarted + timedelta(seconds=41))]:  # a blip
        seen = Observed(workers=(WorkerState(0, R, peers_lost_since=since), gone))
        t = step(s, at(now), seen, now)
        assert t.decision.action == Action.WAIT, (since, now)
    assert t.decision.requeue_after == 3.0  # the look when the blip would count (3 s, +1 for the cut second)
    later = Observed(workers=(WorkerState(0, R, peers_lost_since=restarted + timedelta(seconds=40)), gone))
    now = restarted + timedelta(seconds=44)  # lost in this generation, for 4 s
    t = step(s, at(now), later, now)
    assert (t.decision.action, t.status.reason) == (Action.RESTART_GANG, "NodeLost")


def test_a_worker_gone_after_creation_restarts_the_gang():
    t = step(spec(), running(), Observed(workers=(WorkerState(0, R),)), T0)
    assert (t.decision.action, t.status.reason) == (Action.RESTART_GANG, "Deleted")


# --------------------------------------------------------------------------- deadline / stale / suspend / success


def test_active_deadline_fails_the_job():
    t = step(spec(activeDeadlineSeconds=10), running(), workers(R, R), T0 + timedelta(seconds=10))
    assert (t.status.phase, t.status.reason) == (Phase.FAILED, Reason.DEADLINE_EXCEEDED)
    assert t.effects[0] == DeleteWorkers(Scope.UNFINISHED)


def test_old_generation_is_deleted_before_anything_else():
    t = step(spec(), running(restartGeneration=1, gangCreated=False), Observed(stale_workers=2), T0)
    assert t.effects[0] == DeleteWorkers(Scope.STALE) and t.requeue_after == 1.0


def test_suspend_deletes_the_gang_and_resuming_starts_a_new_generation():
    t = step(spec(suspend=True), running(), workers(R, R), T0)
    assert t.effects[0] == DeleteWorkers(Scope.ALL)
    assert (t.status.phase, t.status.restart_generation, t.status.gang_created) == (Phase.SUSPENDED, 1, False)
    idle = step(spec(suspend=True), t.status, Observed(), T0)
    assert idle.effects == () and idle.status.phase == Phase.SUSPENDED
    resumed = step(spec(), idle.status, Observed(), T0)
    assert resumed.effects[0] == CreateWorkers(1, (0, 1)) and resumed.status.restart_count == 0


def test_a_job_created_suspended_never_starts_a_worker():
    t = step(spec(suspend=True), TrainingJobStatus(), Observed(), T0)
    assert t.effects == (RecordEvent("Normal", Reason.SUSPENDED, "job is suspended"),)
    assert (t.status.phase, t.status.start_time) == (Phase.SUSPENDED, None)


def test_success_of_worker_0_finishes_the_job():
    t = step(spec(), running(), workers(S, R), T0)
    assert (t.status.phase, t.status.completion_time) == (Phase.SUCCEEDED, format_time(T0))
    assert t.effects == (DeleteWorkers(Scope.UNFINISHED), RecordEvent("Normal", "Succeeded", "worker 0 finished training"))


@pytest.mark.parametrize(("policy", "effects"), [("All", [DeleteWorkers(Scope.ALL)]),
                                                  ("Running", [DeleteWorkers(Scope.UNFINISHED)]),
                                                  ("None", [DeleteWorkers(Scope.RESTARTING)])])
def test_clean_pod_policy_decides_what_a_finished_job_deletes(policy, effects):
    t = step(spec(cleanPodPolicy=policy), running(), workers(S, R), T0)
    assert list(t.effects[:-1]) == effects


# --------------------------------------------------------------------------- finished: TTL / clean-up


def test_finished_job_keeps_its_status_and_expires_after_its_ttl():
    done = TrainingJobStatus.model_validate({"phase": "Succeeded", "completionTime": format_time(T0)})
    s = spec(ttlSecondsAfterFinished=60)
    early = step(s, done, workers(S, R), T0 + timedelta(seconds=20))
    assert early.status is done and early.decision is None
    assert (early.effects, early.requeue_after) == ((DeleteWorkers(Scope.UNFINISHED),), 40.0)
    late = step(s, done, Observed(), T0 + timedelta(seconds=60))
    assert kinds(late.effects) == [DeleteWorkers, DeleteJob, RecordEvent]
    assert late.effects[2].reason == Reason.TTL_EXPIRED


def test_finished_job_without_ttl_is_never_deleted_or_restarted():
    done = TrainingJobStatus.model_validate({"phase": "Failed", "completionTime": format_time(T0)})
    t = step(spec(), done, workers(F, F, codes={0: 1, 1: 1}), T0 + timedelta(days=9))
    assert t.effects == (DeleteWorkers(Scope.UNFINISHED),) and t.requeue_after is None


# --------------------------------------------------------------------------- failure rules and disruptions


def disrupted(i: int = 1, phase=WorkerPhase.MISSING) -> Observed:
    others = tuple(WorkerState(j, R) for j in range(2) if j != i)
    return Observed(workers=(*others, WorkerState(i, phase, reason="Disrupted")))


def test_a_disruption_restarts_without_counting_against_the_backoff_limit():
    s = spec(restartPolicy={"backoffLimit": 0, "backoffSeconds": 4})
    t = step(s, running(), disrupted(), T0)
    assert (t.decision.action, t.status.reason, t.status.failures) == (Action.RESTART_GANG, "Disrupted", {"Disrupted": 1})
    assert (t.status.restart_count, t.status.ignored_restarts) == (1, 1)
    assert "not counted against backoffLimit: a disruption" in t.status.message
    again = step(s, running(restartCount=1, ignoredRestarts=1, restartGeneration=1), disrupted(0, F), T0)
    assert again.decision.action == Action.RESTART_GANG  # still no counted restart spent
    counted = step(s, running(restartCount=1, ignoredRestarts=1, restartGeneration=1), workers(R, F, codes={1: 1}), T0)
    assert (counted.status.phase, counted.status.reason) == (Phase.FAILED, "BackoffLimitExceeded")


def test_a_node_about_to_go_restarts_the_gang_elsewhere_without_counting():
    doomed = WorkerState(1, R, node="spot-7", node_terminating="aws-node-termination-handler/spot-itn")
    t = step(spec(restartPolicy={"backoffLimit": 0}), running(), Observed(workers=(WorkerState(0, R), doomed)), T0)
    assert (t.decision.action, t.status.reason, t.status.ignored_restarts) == (Action.RESTART_GANG, "Disrupted", 1)
    assert "worker 1's node spot-7 is about to go (taint aws-node-termination-handler/spot-itn)" in t.status.message
    assert t.effects[0] == DeleteWorkers(Scope.ALL)  # graceful: SIGTERM, and the trainer checkpoints
    placed = WorkerState(1, P, node="spot-7", node_terminating="aws-node-termination-handler/spot-itn")
    waiting = step(spec(), running(), Observed(workers=(WorkerState(0, R), placed)), T0)
    assert waiting.decision.action != Action.RESTART_GANG  # not yet running: nothing to save or move yet


def test_kubelet_eviction_is_a_disruption_too():
    obs = Observed(workers=(WorkerState(0, R), WorkerState(1, F, exit_code=137, reason="Evicted")))
    t = step(spec(restartPolicy={"backoffLimit": 0}), running(), obs, T0)
    assert (t.decision.action, t.status.ignored_restarts) == (Action.RESTART_GANG, 1)


@pytest.mark.parametrize(("rules", "observed", "want"), [
    ([{"action": "FailJob", "onExitCodes": [42]}], workers(R, F, codes={1: 42}),
     (Phase.FAILED, "PermanentError", "listed in restartPolicy.rules[0]")),
    ([{"action": "RestartGang", "onExitCodes": [2]}], workers(R, F, codes={1: 2}),
     (Phase.RESTARTING, "ExitCode", "restart 1 of at most 2")),
    ([{"action": "RestartGangAndIgnore", "onFailures": ["OOMKilled"]}],
     Observed(workers=(WorkerState(0, R), WorkerState(1, F, exit_code=137, reason="OOMKilled"))),
     (Phase.RESTARTING, "OOMKilled", "not counted against backoffLimit: restartPolicy.rules[0]")),
    ([{"action": "RestartGang", "onFailures": ["Disrupted"]}], disrupted(), (Phase.RESTARTING, "Disrupted", "restart 1 of")),
    ([{"action": "FailJob", "onFailures": ["NodeLost"]}],
     Observed(workers=(WorkerState(0, R), WorkerState(1, R, node_not_ready_since=T0 - timedelta(hours=1)))),
     (Phase.FAILED, "PermanentError", "listed in restartPolicy.rules[0]")),
])
def test_the_first_matching_rule_decides(rules, observed, want):
    t = step(spec(restartPolicy={"backoffLimit": 2, "rules": rules}), running(), observed, T0)
    assert (t.status.phase, t.status.reason) == want[:2] and want[2] in t.status.message, t.status.message


def test_a_permanent_exit_code_still_fails_when_no_rule_matches():
    s = spec(restartPolicy={"rules": [{"action": "RestartGang", "onExitCodes": [9]}]})
    assert step(s, running(), workers(R, F, codes={1: 127}), T0).status.reason == "PermanentError"


# --------------------------------------------------------------------------- suspended time, unknown progress


def test_a_resumed_job_counts_its_deadline_from_the_resume():
    s = spec(activeDeadlineSeconds=3600)
    suspended = step(spec(suspend=True, activeDeadlineSeconds=3600), running(), workers(R, R), T0).status
    later = T0 + timedelta(hours=2)
    resumed = step(s, suspended, Observed(), later)
    assert resumed.effects[0] == CreateWorkers(1, (0, 1)) and resumed.status.start_time == format_time(later)
    t = step(s, resumed.status, workers(R, R), later + timedelta(minutes=59))
    assert t.status.phase == Phase.RUNNING


def test_progress_that_cannot_be_reported_is_a_condition_not_a_restart():
    s = spec(restartPolicy={"progressDeadlineSeconds": 60})
    obs = Observed(workers=workers(R, R).workers, progress_unknown=Reason.PROGRESS_REPORTING_FORBIDDEN)
    t = step(s, running(), obs, T0 + timedelta(hours=1))
    assert t.decision.action == Action.WAIT and t.status.restart_count == 0
    cond = next(c for c in t.status.conditions if c.type == "ProgressUnknown")
    assert (cond.status, cond.reason) == ("True", "ProgressReportingForbidden")
    healed = step(s, t.status, workers(R, R), T0 + timedelta(hours=1))
    assert next(c for c in healed.status.conditions if c.type == "ProgressUnknown").status == "False"


def test_a_gang_that_does_not_run_in_time_is_released_and_counted():
    s = spec(restartPolicy={"startTimeoutSeconds": 300, "backoffLimit": 1})
    created = step(s, TrainingJobStatus(), Observed(), T0).status
    assert created.gang_created_time == format_time(T0)
    half = Observed(workers=(WorkerState(0, R), WorkerState(1, P)))
    assert step(s, created, half, T0 + timedelta(seconds=299)).decision.action == Action.WAIT
    t = step(s, created, half, T0 + timedelta(seconds=300))
    assert (t.decision.action, t.status.reason, t.effects[0]) == (Action.RESTART_GANG, "StartTimeout", DeleteWorkers(Scope.ALL))
    assert "did not run within 300s" in t.status.message and "worker 1 is pending" in t.status.message
    assert (t.status.gang_created_time, t.status.failures) == (None, {"StartTimeout": 1})
    running = step(s, created, workers(R, R), T0 + timedelta(seconds=100)).status
    assert step(s, running, workers(R, R), T0 + timedelta(hours=5)).decision.action == Action.WAIT


def test_a_running_job_is_looked_at_again_when_its_next_deadline_can_pass():
    s = spec(restartPolicy={"progressDeadlineSeconds": 60}, activeDeadlineSeconds=3600)
    st = running(lastProgressTime=format_time(T0 + timedelta(seconds=50)))
    assert step(s, st, workers(R, R), T0 + timedelta(seconds=95)).requeue_after == pytest.approx(15.0)
    blind = Observed(workers=workers(R, R).workers, progress_unknown=Reason.PROGRESS_REPORTING_OFF)
    assert step(s, st, blind, T0 + timedelta(seconds=95)).requeue_after == 30.0  # no progress deadline applies
    assert step(spec(), st, workers(R, R), T0).requeue_after == 30.0


@pytest.mark.parametrize("new_size", [1, 3])
def test_a_workers_edit_restarts_the_gang_at_its_new_size_without_counting(new_size):
    st = running(workersTotal=2, lastCheckpoint={"step": 40})
    obs = workers(R, R)
    t = step(spec(workers=new_size, restartPolicy={"backoffLimit": 0}), st, obs, T0)
    assert (t.decision.action, t.status.reason, t.effects[0]) == (Action.RESTART_GANG, "Resized", DeleteWorkers(Scope.ALL))
    assert t.effects[1].type == "Normal" and f"from 2 to {new_size}" in t.status.message
    assert "from the checkpoint at step 40" in t.status.message
    assert (t.status.failures, t.status.ignored_restarts, t.status.workers_total) == ({}, 1, new_size)
    nxt = step(spec(workers=new_size), t.status, Observed(), T0 + timedelta(seconds=t.requeue_after))
    assert nxt.effects[0] == CreateWorkers(1, tuple(range(new_size)))


# --------------------------------------------------------------------------- network transport and FabricDegraded


def test_rank0s_transport_goes_into_status_and_stays_while_records_do_not_say():
    gang = workers(R, R).workers
    t = step(spec(), running(), Observed(gang, progress=Progress(step=1, network_transport="Socket")), T0)
    assert (t.status.phase, t.status.network_transport) == (Phase.RUNNING, contract.TRANSPORT_SOCKET)
    t = step(spec(), t.status, Observed(gang, progress=Progress(step=2)), T0 + timedelta(seconds=1))
    assert (t.status.current_step, t.status.network_transport) == (2, contract.TRANSPORT_SOCKET)  # older trainer
    old_gen = Progress(generation=0, step=5, network_transport="IB")
    t = step(spec(), running(restartGeneration=1, networkTransport="OFI"), Observed(gang, progress=old_gen), T0)
    assert t.status.network_transport == contract.TRANSPORT_OFI  # only the current generation speaks


@pytest.mark.parametrize(("fabric", "transport", "reason", "expected"), [
    ("efa", "Socket", ConditionReason.NCCL_FALLBACK_TO_SOCKET, "OFI"),
    ("infiniband", "Socket", ConditionReason.NCCL_FALLBACK_TO_SOCKET, "IB"),
    ("roce", "Socket", ConditionReason.NCCL_FALLBACK_TO_SOCKET, "IB"),
    ("aks-infiniband", "Socket", ConditionReason.NCCL_FALLBACK_TO_SOCKET, "IB"),
    ("tcpx", "Socket", ConditionReason.NCCL_FALLBACK_TO_SOCKET, "GPUDirectTCPX"),
    ("tcpxo", "Socket", ConditionReason.NCCL_FALLBACK_TO_SOCKET, "FasTrak"),
    ("efa", "IB", ConditionReason.UNEXPECTED_TRANSPORT, "OFI"),
    ("tcpxo", "GPUDirectTCPX", ConditionReason.UNEXPECTED_TRANSPORT, "FasTrak"),
])
def test_fabric_degraded_names_expected_and_chosen_transport(fabric, transport, reason, expected):
    status = running(networkTransport=transport)
    conds, event = fabric_condition(spec(fabric=fabric), status, status.conditions, T0)
    [c] = [c for c in conds if c.type == FABRIC_DEGRADED]
    assert (c.status, c.reason) == ("True", reason)
    assert f"spec.fabric {fabric} expects NCCL transport {expected}, but rank 0 reports {transport}" in c.message
    assert event == RecordEvent("Warning", reason, c.message)


@pytest.mark.parametrize(("fabric", "transport"), [
    ("none", "Socket"),  # no fabric asked for: sockets are what it is
    ("efa", None),  # nothing reported yet
    ("efa", "OFI"), ("infiniband", "IB"), ("roce", "IB"), ("aks-infiniband", "IB"),
    ("tcpx", "GPUDirectTCPX"), ("tcpxo", "FasTrak"),
    ("efa", "P2P/SHM"),  # one node: no network in play
    ("infiniband", "gloo"),  # no NCCL at all (CPU)
])
def test_no_fabric_degraded_condition(fabric, transport):
    status = running(networkTransport=transport) if transport else running()
    conds, event = fabric_condition(spec(fabric=fabric), status, status.conditions, T0)
    assert conds == status.conditions and event is None
    assert fabric_mismatch(fabric, transport) is None


def test_fabric_degraded_warns_once_and_clears_when_the_fabric_is_used():
    s, st = spec(fabric="efa"), running(networkTransport="Socket")
    conds, first = fabric_condition(s, st, st.conditions, T0)
    conds, again = fabric_condition(s, st, conds, T0 + timedelta(seconds=30))
    [c] = [c for c in conds if c.type == FABRIC_DEGRADED]
    assert first is not None and again is None and c.last_transition_time == format_time(T0)
    fixed = running(networkTransport="OFI")
    conds, event = fabric_condition(s, fixed, conds, T0 + timedelta(seconds=60))
    [c] = [c for c in conds if c.type == FABRIC_DEGRADED]
    assert (c.status, c.reason, event) == ("False", ConditionReason.FABRIC_IN_USE, None)
    assert c.last_transition_time == format_time(T0 + timedelta(seconds=60))


# --------------------------------------------------------------------------- GPU-hours


def test_gpu_hours_count_the_gpus_pods_hold_without_a_status_change_while_nothing_moves():
    sp = spec(resources={"gpusPerWorker": 8})
    placed = Observed(workers=(WorkerState(0, R), WorkerState(1, P, node="n1")))
    st = step(sp, running(), placed, T0).status
    assert (st.gpu_hours, st.goodput.gpus_held, st.goodput.gpus_counted_at) == (0.0, 16, format_time(T0))
    quiet = step(sp, st, placed, T0 + timedelta(minutes=30)).status
    assert quiet.gpu_hours == 0.0 and quiet.goodput == st.goodput  # no write owed for holding alone
    half = Progress(step=5, step_seconds=1.0)
    later = step(sp, st, Observed(workers=placed.workers, progress=half), T0 + timedelta(minutes=30)).status
    assert later.gpu_hours == 8.0 and later.goodput.gpus_counted_at == format_time(T0 + timedelta(minutes=30))
    unwritten = step(sp, st, Observed(workers=placed.workers, progress=half), T0 + timedelta(minutes=45)).status
    assert unwritten.gpu_hours == 12.0  # counted again from the written anchor: the same time once
    gone = step(sp, later, Observed(workers=(WorkerState(0, R), WorkerState(1, P))), T0 + timedelta(hours=1)).status
    assert (gone.gpu_hours, gone.goodput.gpus_held) == (16.0, 8)  # 16 GPUs for 30 min; unplaced holds none


def test_lost_gpu_hours_are_the_lost_time_of_the_whole_gang_and_cpu_jobs_count_none():
    lost = running(goodput={"lostSeconds": 900.0})
    st = step(spec(resources={"gpusPerWorker": 8}), lost, workers(R, R), T0).status
    assert st.goodput.lost_gpu_hours == 4.0  # 15 min x 16 GPUs
    cpu = step(spec(), lost, workers(R, R), T0 + timedelta(hours=1)).status
    assert (cpu.gpu_hours, cpu.goodput.lost_gpu_hours, cpu.goodput.gpus_held) == (0.0, 0.0, 0)
