"""The lifecycle policies (decide), table-driven. `now` is always passed in."""

from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

import pytest

from kubetrain.core import contract
from kubetrain.core.api import TrainingJobSpec
from kubetrain.core.lifecycle import (
    Action,
    FailureKind,
    WorkerPhase,
    WorkerState,
    backoff_seconds,
)
from kubetrain.core.lifecycle import JobView as Observed
from kubetrain.core.lifecycle import decide as decide_policy


@dataclass(frozen=True)
class History:
    """The remembered part of the job's view, given apart from the workers to keep the tables short."""

    restart_count: int = 0
    start_time: datetime | None = None
    last_restart_time: datetime | None = None


def decide(s: TrainingJobSpec, obs: Observed, h: History, now: datetime):
    return decide_policy(s, replace(obs, restart_count=h.restart_count, start_time=h.start_time,
                                    last_restart_time=h.last_restart_time), now)


T0 = datetime(2026, 1, 1, tzinfo=UTC)
R, S, F, M, P = WorkerPhase.RUNNING, WorkerPhase.SUCCEEDED, WorkerPhase.FAILED, WorkerPhase.MISSING, WorkerPhase.PENDING


def spec(**kw) -> TrainingJobSpec:
    base = {"workers": 3, "restartPolicy": {"backoffLimit": 2, "backoffSeconds": 4, "maxBackoffSeconds": 10}}
    base.update(kw)
    return TrainingJobSpec.model_validate(base)


def gang(*phases, gen=0, codes=None, **kw) -> Observed:
    codes = codes or {}
    workers = tuple(WorkerState(i, ph, exit_code=codes.get(i)) for i, ph in enumerate(phases))
    return Observed(generation=gen, workers=workers, **kw)


def fresh(n=3, gen=0) -> Observed:
    return Observed(generation=gen, workers=tuple(WorkerState(i, M, created=False) for i in range(n)))


def test_new_job_creates_the_gang():
    d = decide(spec(), fresh(), History(), T0)
    assert (d.action, d.phase, d.generation) == (Action.CREATE_WORKERS, "Created", 0)


def test_partially_created_gang_creates_the_rest():
    obs = Observed(0, (WorkerState(0, R), WorkerState(1, M, created=False), WorkerState(2, M, created=False)))
    d = decide(spec(), obs, History(start_time=T0), T0)
    assert d.action == Action.CREATE_WORKERS and "2 of 3" in d.message


def test_all_running_is_running():
    d = decide(spec(), gang(R, R, R), History(start_time=T0), T0)
    assert (d.action, d.phase) == (Action.WAIT, "Running")


def test_pending_workers_wait():
    d = decide(spec(), gang(R, P, R), History(start_time=T0), T0)
    assert (d.action, d.phase, d.reason) == (Action.WAIT, "Created", "WaitingForWorkers")


def test_rank0_success_succeeds_even_if_others_still_run():
    d = decide(spec(), gang(S, R, R), History(start_time=T0), T0)
    assert (d.action, d.phase) == (Action.SUCCEED, "Succeeded")


@pytest.mark.parametrize(
    ("restarts", "expected_delay"),
    [(0, 4.0), (1, 8.0), (2, None)],  # backoffLimit 2: the third failure fails the job
)
def test_retryable_failure_restarts_whole_gang_with_backoff_until_limit(restarts, expected_delay):
    d = decide(spec(), gang(R, F, R, codes={1: 137}, gen=restarts), History(restart_count=restarts, start_time=T0), T0)
    if expected_delay is None:
        assert (d.action, d.phase, d.reason) == (Action.FAIL, "Failed", "BackoffLimitExceeded")
        assert "backoffLimit=2" in d.message
    else:
        assert (d.action, d.phase, d.reason) == (Action.RESTART_GANG, "Restarting", "ExitCode")
        assert d.generation == restarts + 1
        assert d.requeue_after == expected_delay
        assert d.failed_workers == (1,)
        assert "worker 1 exited with code 137" in d.message


def test_backoff_is_capped():
    assert [backoff_seconds(spec(), n) for n in range(4)] == [4, 8, 10, 10]


def test_permanent_exit_code_fails_without_restart():
    d = decide(spec(), gang(R, F, R, codes={1: 2}), History(start_time=T0), T0)
    assert (d.action, d.reason, d.failure_kind) == (Action.FAIL, "PermanentError", FailureKind.PERMANENT_EXIT_CODE)


def test_permanent_exit_codes_are_configurable():
    s = spec(restartPolicy={"permanentExitCodes": [42]})
    assert decide(s, gang(R, F, R, codes={1: 2}), History(start_time=T0), T0).action == Action.RESTART_GANG
    assert decide(s, gang(R, F, R, codes={1: 42}), History(start_time=T0), T0).action == Action.FAIL


def test_permanent_failure_wins_over_retryable_in_the_same_gang():
    d = decide(spec(), gang(F, F, R, codes={0: 137, 1: 127}), History(start_time=T0), T0)
    assert d.reason == "PermanentError" and d.failed_workers == (0, 1)


def test_a_rank_that_lost_its_peer_is_not_named_as_the_cause():
    # worker 0 exits 3 (its all-reduce lost a peer) because worker 2 was killed: name worker 2
    d = decide(spec(), gang(F, R, F, codes={0: 3, 2: 137}), History(start_time=T0), T0)
    assert d.action == Action.RESTART_GANG and d.failed_workers == (0, 2)
    assert d.message.startswith("worker 2 exited with code 137")
    alone = decide(spec(), gang(F, R, R, codes={0: 3}), History(start_time=T0), T0)
    assert alone.message.startswith("worker 0 exited with code 3 (it lost a peer rank mid-collective)")


def test_root_cause_prefers_any_failure_over_a_lost_peer():
    assert contract.root_cause([3, 137]) == 137
    assert contract.root_cause([1, 137]) == 1  # the first real failure, in the order seen
    assert contract.root_cause([3, 3]) == 3
    assert contract.root_cause([]) is None
    assert contract.exit_code(-9) == 137 and contract.exit_code(2) == 2


def test_deleted_worker_restarts_gang():
    obs = Observed(0, (WorkerState(0, R), WorkerState(1, M, created=True), WorkerState(2, R)))
    d = decide(spec(), obs, History(start_time=T0), T0)
    assert (d.action, d.failure_kind) == (Action.RESTART_GANG, FailureKind.DELETED)


@pytest.mark.parametrize(("reason", "kind"), [("Evicted", FailureKind.EVICTED), ("OOMKilled", FailureKind.OOM_KILLED)])
def test_evicted_and_oom_are_classified(reason, kind):
    obs = Observed(0, (WorkerState(0, R), WorkerState(1, F, exit_code=137, reason=reason), WorkerState(2, R)))
    assert decide(spec(), obs, History(start_time=T0), T0).failure_kind == kind


def test_node_not_ready_restarts_only_after_grace():
    s = spec(restartPolicy={"nodeNotReadyGraceSeconds": 60})
    obs = Observed(0, (WorkerState(0, R), WorkerState(1, R, node_not_ready_since=T0), WorkerState(2, R)))
    assert decide(s, obs, History(start_time=T0), T0 + timedelta(seconds=59)).action == Action.WAIT
    d = decide(s, obs, History(start_time=T0), T0 + timedelta(seconds=60))
    assert (d.action, d.failure_kind) == (Action.RESTART_GANG, FailureKind.NODE_LOST)


def test_no_progress_restarts_with_reason():
    s = spec(restartPolicy={"progressDeadlineSeconds": 120})
    obs = gang(R, R, R, running_since=T0, last_progress_time=T0 + timedelta(seconds=30))
    assert decide(s, obs, History(start_time=T0), T0 + timedelta(seconds=149)).action == Action.WAIT
    d = decide(s, obs, History(start_time=T0), T0 + timedelta(seconds=150))
    assert (d.action, d.reason) == (Action.RESTART_GANG, "NoProgress")
    assert "no progress for 120s" in d.message


def test_no_progress_disabled_by_default():
    obs = gang(R, R, R, running_since=T0)
    assert decide(spec(), obs, History(start_time=T0), T0 + timedelta(days=3)).action == Action.WAIT


def test_next_generation_waits_for_stale_workers_then_backoff():
    h = History(restart_count=1, start_time=T0, last_restart_time=T0)
    stale = Observed(1, tuple(WorkerState(i, M, created=False) for i in range(3)), stale_workers=2)
    assert decide(spec(), stale, h, T0).action == Action.DELETE_STALE
    gone = fresh(gen=1)
    d = decide(spec(), gone, h, T0 + timedelta(seconds=3))
    assert (d.action, d.reason) == (Action.WAIT, "BackoffWait") and d.requeue_after == pytest.approx(1.0)
    d = decide(spec(), gone, h, T0 + timedelta(seconds=4))
    assert (d.action, d.phase, d.generation) == (Action.CREATE_WORKERS, "Restarting", 1)


def test_suspend_deletes_workers_then_waits():
    s = spec(suspend=True)
    assert decide(s, gang(R, R, R), History(start_time=T0), T0).action == Action.SUSPEND
    d = decide(s, fresh(), History(start_time=T0), T0)
    assert (d.action, d.phase) == (Action.WAIT, "Suspended")


def test_active_deadline_fails_the_job():
    s = spec(activeDeadlineSeconds=600)
    assert decide(s, gang(R, R, R), History(start_time=T0), T0 + timedelta(seconds=599)).action == Action.WAIT
    d = decide(s, gang(R, R, R), History(start_time=T0), T0 + timedelta(seconds=600))
    assert (d.action, d.reason) == (Action.FAIL, "DeadlineExceeded")


@pytest.mark.parametrize(
    ("observed", "memory", "origin"),
    [
        ({"last_checkpoint": 40}, False,
         "restarting the whole gang from the checkpoint at step 40 (restart 1 of at most 2"),
        ({}, False, "restarting the whole gang from step 0: no complete checkpoint yet (restart 1"),
        ({"last_checkpoint": 40, "checkpoints_durable": False}, False,
         "restarting the whole gang from step 0: checkpoints are ephemeral (spec.checkpoint.ephemeral) (restart 1"),
        # checkpoint.memory (the default): the ranks may load a newer step they all hold in memory
        ({"last_checkpoint": 40}, True,
         "restarting the whole gang from the checkpoint at step 40 (or a newer one in memory) (restart 1"),
        ({}, True, "restarting the whole gang from step 0 (or a checkpoint in memory): no complete checkpoint yet"),
    ],
)
def test_restart_message_names_the_step_the_next_generation_starts_from(observed, memory, origin):
    s = spec(checkpoint={"memory": {"enabled": memory}})
    d = decide(s, gang(R, F, R, codes={1: 137}, **observed), History(start_time=T0), T0)
    assert d.action == Action.RESTART_GANG
    assert d.message.startswith(f"worker 1 exited with code 137: {origin}"), d.message
    assert d.message.endswith("in 4s)")
    # the next generation's own messages say the same while it waits and starts
    h = History(restart_count=1, start_time=T0, last_restart_time=T0)
    gone = Observed(1, fresh(gen=1).workers, **observed)
    waiting = decide(s, gone, h, T0 + timedelta(seconds=1))
    created = decide(s, gone, h, T0 + timedelta(seconds=4))
    step_part = d.message.removeprefix("worker 1 exited with code 137: restarting the whole gang ").split(" (restart")[0]
    assert waiting.message.startswith(f"starting generation 1 {step_part} in 3.0s")
    assert created.message == f"creating 3 of 3 worker(s) of generation 1 {step_part}"


def test_status_shows_percent_eta_throughput_and_mfu_from_rank_0s_report():
    from kubetrain.core.api import TrainingJobStatus  # noqa: PLC0415
    from kubetrain.core.lifecycle import Observed as Seen  # noqa: PLC0415
    from kubetrain.core.lifecycle.status import take_progress  # noqa: PLC0415
    from kubetrain.core.progress import Progress  # noqa: PLC0415

    now = datetime(2026, 3, 1, tzinfo=UTC)
    status = TrainingJobStatus(max_steps=200)
    take_progress(status, Seen(progress=Progress(step=50, step_seconds=2.0, tokens_per_second=1234.6, mfu=0.412)), now)
    assert (status.percent_complete, status.eta, status.tokens_per_second, status.mfu) == ("25%", "5m00s", 1235, "41.2%")
    take_progress(status, Seen(progress=Progress(step=200, step_seconds=2.0, tokens_per_second=1000.0)), now)
    assert (status.percent_complete, status.eta, status.mfu) == ("100%", "0.0s", "41.2%")  # no peak known: kept
    old_gen = TrainingJobStatus(max_steps=200, restart_generation=1)
    take_progress(old_gen, Seen(progress=Progress(step=50, generation=0, step_seconds=2.0)), now)
    assert old_gen.eta is None  # an older generation's rates say nothing about this one


def test_goodput_counts_productive_time_and_what_a_restart_costs():
    from kubetrain.core.api import TrainingJobStatus  # noqa: PLC0415
    from kubetrain.core.contract import format_time  # noqa: PLC0415
    from kubetrain.core.lifecycle import Observed as Seen  # noqa: PLC0415
    from kubetrain.core.lifecycle.status import take_progress  # noqa: PLC0415
    from kubetrain.core.progress import Progress  # noqa: PLC0415

    t0 = datetime(2026, 3, 1, tzinfo=UTC)
    st = TrainingJobStatus(max_steps=100)
    for s in range(1, 36):  # generation 0: a step a second up to step 35
        take_progress(st, Seen(progress=Progress(step=s, step_seconds=1.0)), t0 + timedelta(seconds=s))
    assert st.goodput.productive_seconds == 34.0 and st.goodput.lost_seconds == 0.0
    st.restart_generation, st.goodput.restarted_at = 1, format_time(t0 + timedelta(seconds=40))  # the machine's part
    first = Progress(step=31, generation=1, resumed_from=30, step_seconds=1.0)
    take_progress(st, Seen(progress=first), t0 + timedelta(seconds=50))
    g = st.goodput
    # 15 s from the last step (35) to the new first one, and the 5 steps redone move from productive to lost.
    assert (g.steps_lost, g.lost_seconds, g.productive_seconds) == (5, 20.0, 29.0)
    take_progress(st, Seen(progress=Progress(step=32, generation=1, step_seconds=1.0)), t0 + timedelta(seconds=51))
    assert st.goodput.productive_seconds == 30.0 and st.goodput.restarted_at is None
    # Every second from the first step on is either: 50 s, of which 30 s trained steps the job keeps (1-30,
    # 31, 32 less the first step's own start), as bench/goodput.py counts kept step intervals.
    assert st.goodput.productive_seconds + st.goodput.lost_seconds == 51 - 1
    # A suspension's time is not counted: no restartedAt, only the steps redone.
    st.restart_generation = 2
    take_progress(st, Seen(progress=Progress(step=31, generation=2, resumed_from=30, step_seconds=1.0)),
                  t0 + timedelta(seconds=500))
    assert (st.goodput.steps_lost, st.goodput.lost_seconds, st.goodput.productive_seconds) == (7, 22.0, 28.0)


def test_goodput_counts_a_late_record_at_the_time_rank_0_wrote_it():
    """The last record before a fault often reaches the operator seconds late (the step it names was not 6 s
    of training): productive time runs to the record's own time stamp, and the restart's cost from there."""
    from kubetrain.core.api import TrainingJobStatus  # noqa: PLC0415
    from kubetrain.core.contract import format_time  # noqa: PLC0415
    from kubetrain.core.lifecycle import Observed as Seen  # noqa: PLC0415
    from kubetrain.core.lifecycle.status import take_progress  # noqa: PLC0415
    from kubetrain.core.progress import Progress  # noqa: PLC0415

    t0 = datetime(2026, 3, 1, tzinfo=UTC)

    def record(step: int, written: float, seen: float, **kw) -> Seen:
        return Seen(progress=Progress(step=step, step_seconds=0.25, time=format_time(t0 + timedelta(seconds=written)),
                                      **kw), progress_seen=t0 + timedelta(seconds=seen))

    st = TrainingJobStatus(max_steps=100)
    take_progress(st, record(1, 1, 1), t0)
    take_progress(st, record(20, 6, 6), t0)
    take_progress(st, record(40, 11, 17), t0)  # written at 11 s, seen at 17 s
    assert st.goodput.productive_seconds == 10.0
    st.restart_generation, st.goodput.restarted_at = 1, format_time(t0 + timedelta(seconds=18))
    take_progress(st, record(41, 25, 25, generation=1, resumed_from=40), t0)
    assert (st.goodput.productive_seconds, st.goodput.lost_seconds) == (10.0, 14.0)  # 11 s -> 25 s
    take_progress(st, record(60, 31, 40, generation=1), t0)
    ahead = record(80, 50, 45, generation=1)  # a pod's clock ahead of the operator's: the operator's time
    take_progress(st, ahead, t0)
    assert st.goodput.productive_seconds == 10.0 + 6 + 14


def test_status_says_where_rank_0_exported_the_model():
    from kubetrain.core.api import TrainingJobStatus  # noqa: PLC0415
    from kubetrain.core.lifecycle import Observed as Seen  # noqa: PLC0415
    from kubetrain.core.lifecycle.status import take_progress  # noqa: PLC0415
    from kubetrain.core.progress import Progress  # noqa: PLC0415

    now = datetime(2026, 3, 1, tzinfo=UTC)
    status = TrainingJobStatus(max_steps=10)
    take_progress(status, Seen(progress=Progress(step=10)), now)
    assert status.export is None
    take_progress(status, Seen(progress=Progress(step=10, finished=True, export="s3://b/job/export")), now)
    assert status.export == "s3://b/job/export"
