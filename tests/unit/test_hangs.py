"""Hang detection's policies (kubetrain.core.hangs), its verdict in the lifecycle, and how the operator reads it."""

from datetime import UTC, datetime, timedelta

import pytest

from kubetrain.core import contract, hangs
from kubetrain.core import lifecycle as lc
from kubetrain.core.api import TrainingJob, TrainingJobStatus
from kubetrain.core.hangs import HangReport, Limits, RankReport, Watch
from kubetrain.operator.jobs import builders
from kubetrain.operator.jobs.pod_facts import facts

NOW = datetime(2026, 11, 28, 12, 0, tzinfo=UTC)
STACK = """Thread 0x00007fd9dc9106c0 (most recent call first):
  File "/usr/lib/python3.11/selectors.py", line 415 in select
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007fda9a846b80 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2950 in all_reduce
  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/app/train.py", line 40 in step
  File "/app/train.py", line 52 in <module>
"""


def spec(**over):
    return TrainingJob.model_validate({"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                                       "metadata": {"name": "j", "namespace": "ns"},
                                       "spec": {"workers": 2, **over}})


def test_limits_travel_as_one_variable_and_off_is_none():
    lim = Limits(30, 10, 300, 900, explicit=120)
    assert Limits.decode(lim.encode()) == lim
    assert Limits.decode("off") is None and Limits.decode(None) is None
    with pytest.raises(ValueError, match="KUBETRAIN_HANG='min=1,typo=2': unknown key 'typo'"):
        Limits.decode("min=1,typo=2")
    # The collective timeout lies past every limit: the watch answers first, with stacks.
    assert lim.collective_timeout() == 900 + 120


def test_the_spec_turns_into_limits_with_progress_deadline_as_the_explicit_one():
    assert spec().spec.hang_limits == Limits(30, 10, 300, 900)
    assert spec(restartPolicy={"progressDeadlineSeconds": 90}).spec.hang_limits.explicit == 90
    assert spec(restartPolicy={"hangDetection": {"enabled": False}}).spec.hang_limits is None
    env = {e["name"]: e.get("value") for e in builders.worker_env(spec(), 1, 0)}
    assert env[contract.HANG] == "min=30,factor=10,phase=300,start=900"


DEFAULTS = Limits(30, 10, 300, 900)


def watch_of(steps, limits=DEFAULTS, t0=0.0, dt=1.0):
    """A watch that saw rank 0 advance through `steps` (step, phase), one observation every `dt` seconds."""
    w = Watch(limits)
    for i, beat in enumerate(steps):
        w.observe({0: beat}, t0 + i * dt)
    return w


def test_the_train_limit_follows_the_step_time_with_a_floor():
    fast = watch_of([(0, "start"), *((s, "train") for s in range(1, 12))])
    assert fast.limit(0) == 30  # 1 s steps x 10 < the 30 s floor
    slow = watch_of([(0, "start"), *((s, "train") for s in range(1, 12))], dt=7.0)
    assert slow.limit(0) == 70
    assert slow.silent(11 * 7.0 + 69) == [] and slow.silent(11 * 7.0 + 71)[0][:1] == (0,)


def test_a_slow_first_step_long_checkpoint_or_eval_is_not_a_hang():
    w = watch_of([(0, "start")])
    assert w.silent(899) == []  # start-up and the first step share startSeconds
    w = watch_of([(0, "start"), (1, "train")])
    assert w.limit(0) == 900  # no step time yet: the first interval may hold compilation
    w = watch_of([(0, "start"), *((s, "train") for s in range(1, 6)), (5, "checkpoint")])
    assert w.limit(0) == 300 and w.silent(5 + 299) == []
    # A checkpoint that took 200 s allows 600 s for the next one.
    w.observe({0: (6, "train")}, 6 + 200)
    w.observe({0: (7, "checkpoint")}, 6 + 201)
    assert w.limit(0) == pytest.approx(3 * 200)
    w.observe({0: (7, "eval")}, 5 + 210)
    assert w.limit(0) == 300


def test_a_stopped_rank_is_hung_after_seconds_in_any_phase_and_a_running_one_waits_its_limit():
    w = watch_of([(0, "start"), *((s, "train") for s in range(1, 12))], dt=0.2)
    quiet_since = 11 * 0.2
    assert w.quiet(quiet_since + 4.9, hangs.STOPPED_SECONDS) == []
    assert w.quiet(quiet_since + 5.1, hangs.STOPPED_SECONDS) == [0]
    assert w.silent(quiet_since + 5.1) == []  # running: a slow step has minSeconds (30)
    assert w.silent(quiet_since + 5.1, stopped=[0]) == [(0, pytest.approx(5.1), hangs.STOPPED_SECONDS)]
    saving = watch_of([(0, "start"), (1, "train"), (1, "checkpoint")])
    assert saving.silent(2 + 5.1, stopped=[0])[0][2] == hangs.STOPPED_SECONDS  # not phaseSeconds (300)
    quick = watch_of([(0, "start"), *((s, "train") for s in range(1, 12))], limits=Limits(1, 2, 300, 900))
    assert quick.silent(11 + 2.5, stopped=[0])[0][2] == 2  # a shorter limit of its own stays


def test_the_explicit_limit_replaces_the_adaptive_one_between_steps():
    w = watch_of([(0, "start"), *((s, "train") for s in range(1, 6))], limits=Limits(30, 10, 300, 900, 45))
    assert w.limit(0) == 45


def test_where_a_stack_is_named_by_its_main_thread():
    assert hangs.where_from_stack(STACK) == "in all_reduce (torch.distributed)"
    user = STACK.replace("torch/distributed/distributed_c10d.py", "site-packages/mylib/io.py")
    assert hangs.where_from_stack(user) == "in all_reduce (io.py:2950)"
    assert hangs.where_from_stack("") == "no Python stack"
    assert hangs.rank_report(3, 7, "stopped (SIGSTOP)", "").where == "stopped (SIGSTOP)"


def r(rank, where="in all_reduce (torch.distributed)", step=10, state="running"):
    return RankReport(rank, step, state, where)


def test_a_rank_in_uninterruptible_sleep_for_a_moment_is_running_and_one_that_stays_is_in_the_kernel(monkeypatch):
    # A process held in uninterruptible sleep cannot be made on demand here, so /proc's answers are scripted:
    # rank 0 is caught once in D (a write under I/O load), rank 1 stays there (a dead mount), rank 2 runs.
    looks = {100: iter([hangs.UNINTERRUPTIBLE, "running"]), 101: None, 102: None}
    answers = {101: hangs.UNINTERRUPTIBLE, 102: "running"}
    monkeypatch.setattr(hangs, "proc_state", lambda pid: next(looks[pid]) if looks[pid] else answers[pid])
    states = hangs.settled_states({0: 100, 1: 101, 2: 102}, settle_s=0.3)
    assert states == {0: "running", 1: hangs.UNINTERRUPTIBLE, 2: "running"}
    assert hangs.suspects([RankReport(r, 5, s, "in step") for r, s in states.items()]) == [1]


def test_the_odd_one_out():
    assert hangs.suspects([r(0), r(1, state="stopped (SIGSTOP)", where="stopped (SIGSTOP)"), r(2)]) == [1]
    assert hangs.suspects([r(0), r(1, step=9), r(2)]) == [1]  # behind the others
    assert hangs.suspects([r(0), r(1, where="in the data loader"), r(2), r(3)]) == [1]
    assert hangs.suspects([r(0), r(1)]) == []  # all in the same collective: no rank stands out
    assert hangs.suspects([r(0), r(1, where="in step (train.py:3)")]) == []  # one against one: no majority
    text = hangs.verdict([r(0), r(1, where="in the data loader"), r(2), r(3)], range(5),
                         {1: "worker 0 (pod j-worker-0, node n1)"})
    assert text == ("rank 1 on worker 0 (pod j-worker-0, node n1) is in the data loader at step 10; ranks 0, 2-3 "
                    "wait in all_reduce (torch.distributed); no report from rank 4")
    assert hangs.verdict([r(0), r(1)], range(2)).startswith("no single rank stands out: ranks 0-1 wait in all_reduce")


def test_a_report_fits_a_termination_message():
    many = tuple(r(i, where="in " + "x" * 500) for i in range(64))
    report = HangReport(10, 31.0, 30.0, many, "/checkpoints/hangs/gen-1", at=1.5e9)
    text = report.encode()
    assert len(text.encode()) <= 4096
    back = HangReport.decode(text)
    assert back is not None and len(back.ranks) == hangs.MAX_REPORTED_RANKS and back.at == 1.5e9
    assert HangReport.decode("exit status 1") is None and HangReport.decode(None) is None


def hung_worker(index, ranks, at, **kw):
    return lc.WorkerState(index, lc.WorkerPhase.FAILED, exit_code=contract.HUNG_EXIT_CODE,
                          hang=HangReport(10, 31.0, 30.0, ranks, f"/checkpoints/hangs/gen-0 ({index})", at=at),
                          pod=f"j-worker-{index}", node=f"node-{index}", **kw)


def running_status():
    return TrainingJobStatus(phase="Running", running_since="2026-11-28T11:00:00Z", gang_created=True,
                             workers_total=2)


def test_a_hang_waits_for_the_other_workers_reports_then_names_the_suspect():
    s = spec().spec
    w0 = hung_worker(0, (r(0),), at=NOW.timestamp() - 2)
    t = lc.step(s, running_status(), lc.Observed(workers=(w0, lc.WorkerState(1, lc.WorkerPhase.RUNNING))), NOW)
    assert t.decision.action == lc.Action.WAIT and t.decision.reason == "HangFound"
    assert "waiting up to 13s for the reports of worker(s) 1" in t.decision.message
    w1 = hung_worker(1, (r(1, state="stopped (SIGSTOP)", where="stopped (SIGSTOP)"),), at=NOW.timestamp() - 1)
    t = lc.step(s, running_status(), lc.Observed(workers=(w0, w1)), NOW)
    assert t.decision.action == lc.Action.RESTART_GANG and t.decision.failure_kind == lc.FailureKind.NO_PROGRESS
    hang = t.status.last_hang
    assert hang is not None and hang.step == 10 and (hang.silent_seconds, hang.limit_seconds) == (31.0, 30.0)
    assert [(x.rank, x.worker, x.pod, x.node, x.where) for x in hang.suspects] == [
        (1, 1, "j-worker-1", "node-1", "stopped (SIGSTOP)")]
    assert hang.message == ("rank 1 on worker 1 (pod j-worker-1, node node-1) is stopped (SIGSTOP) at step 10; "
                            "rank 0 waits in all_reduce (torch.distributed)")
    assert "/checkpoints/hangs/gen-0 (0)" in hang.dumps and "/checkpoints/hangs/gen-0 (1)" in hang.dumps
    event = next(e for e in t.effects if isinstance(e, lc.RecordEvent))
    assert event.type == "Warning" and event.reason == "NoProgress" and event.message.startswith("hung: rank 1 on")
    assert t.status.failures == {"NoProgress": 1}


def test_a_report_naming_a_stopped_rank_decides_without_waiting_for_the_others():
    stopped = hung_worker(1, (r(1, state=hangs.STOPPED, where=hangs.STOPPED),), at=NOW.timestamp() - 1)
    t = lc.step(spec().spec, running_status(), lc.Observed(workers=(lc.WorkerState(0, lc.WorkerPhase.RUNNING),
                                                                    stopped)), NOW)
    assert t.decision.action == lc.Action.RESTART_GANG and t.decision.failure_kind == lc.FailureKind.NO_PROGRESS
    assert t.status.last_hang.message == "rank 1 on worker 1 (pod j-worker-1, node node-1) is stopped (SIGSTOP) " \
                                         "at step 10; no report from rank 0"


def test_a_lone_report_decides_once_the_gather_time_passed():
    s = spec().spec
    w0 = hung_worker(0, (r(0),), at=(NOW - timedelta(seconds=20)).timestamp())
    t = lc.step(s, running_status(), lc.Observed(workers=(w0, lc.WorkerState(1, lc.WorkerPhase.RUNNING))), NOW)
    assert t.decision.action == lc.Action.RESTART_GANG
    assert t.status.last_hang.message == "no single rank stands out: rank 0 waits in all_reduce (torch.distributed); " \
                                         "no report from rank 1"


def test_the_operator_reads_a_hung_workers_report_from_its_termination_message():
    report = HangReport(10, 31.0, 30.0, (r(1, state="stopped (SIGSTOP)", where="stopped (SIGSTOP)"),), "/d", at=5.0)
    pod = {"metadata": {"name": "j-worker-1", "labels": {contract.LABEL_INDEX: "1", contract.LABEL_GENERATION: "0"}},
           "spec": {"restartPolicy": "Never", "nodeName": "n1"},
           "status": {"phase": "Failed", "containerStatuses": [{"name": contract.CONTAINER, "state": {"terminated": {
               "exitCode": contract.HUNG_EXIT_CODE, "message": report.encode()}}}]}}
    f = facts(pod)
    assert f.exit_code == contract.HUNG_EXIT_CODE and f.hang == report and f.node == "n1"
    pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] = 1
    assert facts(pod).hang is None  # a plain exit is no hang, whatever its message


def test_a_worker_that_sent_no_report_is_recreated_and_the_reporting_ones_are_kept_in_place():
    """A frozen or cut-off node's launcher cannot report, nor restart its worker in place: after the gathering
    the verdict keeps the workers that reported and recreates the silent one (on another node, once its node
    is NotReady: the operator then deletes its pod at once)."""
    s = spec(restartPolicy={"inPlace": True}).spec
    w0 = hung_worker(0, (r(0),), at=(NOW - timedelta(seconds=20)).timestamp(), in_place=True, restartable=True)
    silent = lc.WorkerState(1, lc.WorkerPhase.RUNNING, in_place=True, pod="j-worker-1", node="node-1")
    t = lc.step(s, running_status(), lc.Observed(workers=(w0, silent)), NOW)
    assert t.decision.action == lc.Action.RESTART_GANG and t.decision.keep == (0,)
    assert "in place, keeping 1 of 2 workers" in t.status.message
    both = lc.step(s, running_status(), lc.Observed(workers=(w0, hung_worker(1, (r(1),), at=NOW.timestamp() - 19,
                                                                           in_place=True, restartable=True))), NOW)
    assert both.decision.keep == (0, 1)  # both reported: both answer, both kept


def test_a_report_of_a_stopped_rank_keeps_the_workers_that_had_no_time_to_report():
    stopped = hung_worker(1, (r(1, state=hangs.STOPPED, where=hangs.STOPPED),), at=NOW.timestamp() - 1,
                          in_place=True, restartable=True)
    t = lc.step(spec(restartPolicy={"inPlace": True}).spec, running_status(),
                lc.Observed(workers=(lc.WorkerState(0, lc.WorkerPhase.RUNNING, in_place=True), stopped)), NOW)
    assert t.decision.action == lc.Action.RESTART_GANG and t.decision.keep == (0, 1)


def test_a_report_naming_a_worker_that_does_not_answer_restarts_at_once_and_recreates_only_that_worker():
    """A frozen node's worker cannot report; its peer's launcher found it not answering (hangs.PeerWatch). The
    verdict does not wait for the gathering: it names that worker, keeps the reporting one in place and
    recreates the silent one."""
    s = spec(restartPolicy={"inPlace": True}).spec
    w0 = lc.WorkerState(0, lc.WorkerPhase.FAILED, exit_code=contract.HUNG_EXIT_CODE, in_place=True, restartable=True,
                        hang=HangReport(10, 9.0, 5.0, (r(0),), "/d", at=NOW.timestamp() - 1, unanswered=(1,)),
                        pod="j-worker-0", node="node-0")
    frozen = lc.WorkerState(1, lc.WorkerPhase.RUNNING, in_place=True, restartable=False, pod="j-worker-1",
                            node="node-1")
    t = lc.step(s, running_status(), lc.Observed(workers=(w0, frozen)), NOW)
    assert t.decision.action == lc.Action.RESTART_GANG and t.decision.keep == (0,), t.decision
    hang = t.status.last_hang
    assert hang.message == ("worker 1 (pod j-worker-1, node node-1) does not answer (its node frozen, cut off or "
                            "gone): rank 0 waits in all_reduce (torch.distributed); no report from rank 1")
    assert [(x.rank, x.worker, x.node, x.where) for x in hang.suspects] == [(1, 1, "node-1", hangs.NOT_ANSWERING)]


def test_a_report_says_which_peers_did_not_answer():
    report = HangReport(10, 9.0, 5.0, (r(0),), "/d", at=5.0, generation=3, unanswered=(1, 7))
    assert HangReport.decode(report.encode()) == report
    assert HangReport.decode(HangReport(10, 9.0, 5.0, (r(0),)).encode()).unanswered == ()
