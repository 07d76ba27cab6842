"""bench/goodput_lib.py: the fault schedule, the trainer's TensorBoard step records read back, goodput from them."""

from __future__ import annotations

import json

import goodput_lib as gl  # bench/, on pytest's pythonpath (pyproject.toml)
import pytest

from kubetrain.trainer.observe.tensorboard import event, record

TOKENS = 2048


def test_the_schedule_is_seeded_one_fault_of_each_kind_every_period_between_checkpoints():
    a = gl.schedule(7, 100, gl.FAULT_KINDS, 2, 20)
    assert a == gl.schedule(7, 100, gl.FAULT_KINDS, 2, 20)
    assert a != gl.schedule(8, 100, gl.FAULT_KINDS, 2, 20)
    assert sorted(f.kind for f in a) == sorted(gl.FAULT_KINDS)
    for k, f in enumerate(a, start=1):
        assert 90 <= f.at_s <= 110 * k and abs(f.at_s - 100 * k) <= 10
        assert f.worker in (0, 1) and 3 <= f.phase <= 12
    assert [f.kind for f in gl.schedule(7, 100, [gl.OOM, gl.KILL], 2, 20)] in ([gl.OOM, gl.KILL], [gl.KILL, gl.OOM])
    with pytest.raises(ValueError, match="unknown fault kinds"):
        gl.schedule(7, 100, ["reboot"], 2, 20)


def test_a_fault_goes_at_its_phase_or_the_two_steps_after():
    f = gl.Fault(gl.HANG, 10, 1, 4)
    assert [s for s in range(1, 50) if gl.in_phase(s, f, 20)] == [4, 5, 6, 24, 25, 26, 44, 45, 46]


def test_event_files_as_the_trainer_writes_them_read_back_even_cut_short():
    data = record(event(100.0, 0, file_version="brain.Event:2"))
    data += record(event(101.5, 1, {"train/loss": 5.5, gl.TPS_TAG: 1024.0, "train/lr": 0.003}))
    data += record(event(102.0, 2, {gl.TPS_TAG: 4096.0}))
    datas, used = gl.records(data + data[:10])
    assert used == len(data)
    first, one, two = map(gl.parse_event, datas)
    assert (first.wall, first.step, first.file_version, first.values) == (100.0, 0, "brain.Event:2", {})
    assert (one.wall, one.step, one.values[gl.TPS_TAG], one.values["train/loss"]) == (101.5, 1, 1024.0, 5.5)
    assert two.step == 2 and two.file_version is None
    [ex] = gl.executions({"f": [first, one, two]}, TOKENS)
    assert ex.started == 100.0 and [(s.step, s.seconds) for s in ex.steps] == [(1, 2.0), (2, 0.5)]


def run(name: str, started: float, steps: range, wall0: float, step_s: float = 1.0) -> list[gl.Event]:
    """An execution's events: its file's first record at ``started``, then one step a second from ``wall0``."""
    out = [gl.Event(started, 0, file_version="brain.Event:2")]
    out += [gl.Event(wall0 + i, s, {gl.TPS_TAG: TOKENS / step_s}) for i, s in enumerate(steps)]
    return out


def test_goodput_keeps_the_last_execution_of_each_step_and_times_each_recovery():
    # steps 1-30 from t=10 (checkpoint at 20), a kill at t=40.5, steps 21-50 again from t=50 (checkpoint at 40),
    # a preemption at t=75.2 that finishes step 46 and checkpoints, steps 47-60 from t=90; done at t=110.
    files = {"a": run("a", 5, range(1, 31), 10), "b": run("b", 45, range(21, 47), 50),
             "c": run("c", 85, range(47, 61), 90)}
    execs = gl.executions(files, TOKENS)
    faults = [gl.AppliedFault(gl.KILL, 0, 40, 40, 40.5, 30, "p0"), gl.AppliedFault(gl.EVICT, 1, 70, 70, 75.2, 45, "p1"),
              gl.AppliedFault(gl.OOM, 0, 120, 120, skipped="the job had finished")]
    r = gl.goodput("kubetrain", execs, 0.0, 110.0, 60, faults, 2)
    assert (r.wall_s, r.kept_step_s, r.goodput, r.steps, r.step_executions) == (110.0, 60.0, round(60 / 110, 4), 60, 70)
    assert (r.steps_redone, r.executions, r.restarts, r.missing_steps, r.mean_step_s, r.mean_interval_s) == \
        (10, 3, 2, 0, 1.0, 1.0)
    kill, evict, oom = r.faults
    assert (kill.at_s, kill.step, kill.recovered_after_s, kill.steps_redone) == (40.5, 30, 9.5, 10)
    assert (evict.at_s, evict.recovered_after_s, evict.steps_redone) == (75.2, 14.8, 0)
    assert (oom.at_s, oom.recovered_after_s, oom.skipped) == (None, None, "the job had finished")
    table = gl.table([r])
    assert "| kubetrain | 110.0 | 60.0 | 54.5 % | 54.5 % | 2 | 10 | kill | 40.5 | 30 | 9.5 | 9.5 | 10 |" in table
    assert "|  |  |  |  |  |  |  | oom | — | — | skipped: the job had finished | — | — |" in table


def test_steps_redone_count_from_where_the_interrupted_execution_was():
    # an OOM at step 30 resumes from 20; a preemption at step 25 checkpoints 25 and resumes there: nothing redone,
    # though step 30 had been reached before.
    files = {"a": run("a", 0, range(1, 31), 10), "b": run("b", 45, range(21, 26), 50),
             "c": run("c", 60, range(26, 41), 65)}
    faults = [gl.AppliedFault(gl.OOM, 0, 40, 40, 40.0, 30), gl.AppliedFault(gl.EVICT, 1, 50, 50, 54.5, 25)]
    oom, evict = gl.goodput("x", gl.executions(files, TOKENS), 0, 80, 40, faults, 2).faults
    assert (oom.steps_redone, evict.steps_redone, evict.recovered_after_s) == (10, 0, 10.5)


def test_intervals_count_what_runs_between_two_steps_of_one_execution():
    # 0.5 s steps recorded 1 s apart; the second execution redoes step 3 and goes on: its first step counts its
    # own 0.5 s, the others the 1 s since the step before.
    files = {"a": run("a", 0, range(1, 4), 10, step_s=0.5), "b": run("b", 20, range(3, 6), 30, step_s=0.5)}
    r = gl.goodput("x", gl.executions(files, TOKENS), 0, 40, 5, [], 1)
    assert (r.kept_step_s, r.kept_interval_s, r.goodput_intervals, r.steps_redone) == (2.5, 4.0, 0.1, 1)


def test_a_fault_without_a_restart_before_the_next_has_no_recovery_time():
    files = {"a": run("a", 5, range(1, 41), 10), "b": run("b", 55, range(21, 61), 60)}
    faults = [gl.AppliedFault(gl.OOM, 0, 20, 20, 20.0, 10), gl.AppliedFault(gl.KILL, 0, 40, 40, 49.0, 39)]
    oom, kill = gl.goodput("x", gl.executions(files, TOKENS), 0, 110, 60, faults, 1).faults
    assert (oom.recovered_after_s, oom.steps_redone) == (None, None)
    assert (kill.recovered_after_s, kill.steps_redone, kill.executions) == (11.0, 20, 1)


def test_a_recovery_whose_first_process_dies_is_back_when_kept_steps_come_and_settled_with_the_last():
    # a kill at step 30 (checkpoint 20): the kubelet restarts the container, which trains 21-40 before the gang is
    # deleted (checkpoint at 35 on SIGTERM) and recreated; the new gang trains 36-60 from t=75.
    files = {"a": run("a", 0, range(1, 31), 10), "b": run("b", 42, range(21, 41), 45),
             "c": run("c", 70, range(36, 61), 75)}
    r = gl.goodput("x", gl.executions(files, TOKENS), 0, 100, 60, [gl.AppliedFault(gl.KILL, 0, 40, 40, 40.0, 30)], 1)
    [kill] = r.faults
    assert (kill.recovered_after_s, kill.settled_after_s, kill.executions) == (5.0, 35.0, 2)
    assert (kill.steps_redone, r.steps_redone) == (15, 15)  # a's 21-30, b's 36-40


def test_the_raw_record_gives_the_same_result_again():
    files = {"a": run("a", 5, range(1, 31), 10), "b": run("b", 45, range(21, 47), 50)}
    execs = gl.executions(files, TOKENS)
    faults = [gl.AppliedFault(gl.KILL, 0, 40, 40, 40.5, 30, "p0", "SIGKILL", "Error exit 137")]
    first = gl.goodput("kubetrain", execs, 0.0, 80.0, 46, faults, 1)
    again = gl.from_raw("kubetrain", json.loads(json.dumps(gl.raw(execs, 0.0, 80.0, faults))), 46, 1)
    assert again == first and again.faults[0].outcome == "Error exit 137"
    assert gl.raw(execs, 0.0, 80.0, faults)["executions"][1]["steps"].startswith("21 22 23")


def test_two_node_faults_have_a_fault_that_recreates_a_pod_between_them():
    for seed in range(30):
        kinds = [f.kind for f in gl.schedule(seed, 60, gl.FAULT_KINDS, 2, 20)]
        first, second = sorted(kinds.index(k) for k in gl.NODE_FAULTS)
        assert set(kinds[first + 1:second]) & set(gl.MOVES_A_POD), (seed, kinds)
    assert not gl.node_faults_apart([gl.FREEZE_NODE, gl.KILL, gl.KILL_NODE, gl.DELETE])
    assert gl.node_faults_apart([gl.FREEZE_NODE, gl.EVICT, gl.KILL_NODE])
    assert gl.node_faults_apart([gl.FREEZE_NODE, gl.KILL_NODE])  # nothing could go between them


def test_the_summary_compares_with_the_undisturbed_run_and_the_peer():
    def result(system: str, goodput: float, recoveries: list[tuple[str, float]]) -> gl.Goodput:
        faults = [gl.FaultResult(kind, 10.0, 10.0, 5, seconds, 0) for kind, seconds in recoveries]
        return gl.Goodput(system, 100.0, goodput * 100, goodput, goodput * 100, goodput, 100, 100, 0, 1, len(faults),
                          1.0, 1.0, faults)

    lines = gl.summary([result(gl.UNDISTURBED, 0.9, []),
                        result(gl.KUBETRAIN, 0.81, [(gl.KILL, 5.0), (gl.KILL_NODE, 40.0)]),
                        result(gl.TRAINER_V2, 0.45, [(gl.KILL, 8.0), (gl.KILL_NODE, 30.0)])])
    assert lines == ["kubetrain: mean recovery 22.5 s over 2 faults", "Trainer v2 (JobSet): mean recovery 19.0 s over 2 faults",
                     "kubetrain under faults / undisturbed: 0.900x goodput", "kubetrain / Trainer v2: 1.80x goodput",
                     "fault kinds kubetrain recovered slower from: kill-node (40.0 s vs 30.0 s)"]
