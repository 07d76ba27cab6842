"""The sweep policy: ask/tell bookkeeping, pruning, the sweep's phase, and the same answer from the same status."""

import math
from datetime import UTC, datetime

import pytest

from kubetrain.core.api import (
    GRID_TOO_LARGE,
    Phase,
    SweepPhase,
    SweepReason,
    TrainingSweepSpec,
    TrainingSweepStatus,
    TrialState,
)
from kubetrain.core.sweep import policy, space
from kubetrain.core.sweep.model import StartTrial, StopTrial, SweepEvent, TrialObservation

NOW = datetime(2025, 5, 1, 12, 0, tzinfo=UTC)
LR = {"path": "optimizer.lr", "low": 1e-3, "high": 1e-1, "log": True}
LAYERS = {"path": "model.nLayers", "type": "int", "low": 1, "high": 4}


def sweep_spec(*parameters, max_steps=100, **fields):
    return TrainingSweepSpec.model_validate({
        "template": {"spec": {"maxSteps": max_steps, "optimizer": {"minLr": 0}}},
        "parameters": list(parameters) or [LR, LAYERS],
        **fields,
    })


def job(phase=Phase.RUNNING, step=0, loss=None, message=""):
    return TrialObservation(phase, step=step, loss=loss, message=message)


def step(spec, status=None, jobs=None):
    return policy.step("s", spec, status or TrainingSweepStatus(), jobs or {}, NOW)


def of(kind, transition):
    return [e for e in transition.effects if isinstance(e, kind)]


def states(status):
    return [t.state for t in status.trials]


def running(spec, n):
    """The status once n trials were started and their jobs exist, and those jobs (Running, no loss yet)."""
    t = step(spec)
    assert len(t.status.trials) == n
    jobs = {i: job() for i in range(n)}
    return step(spec, t.status, jobs).status, jobs


def drive(spec, loss_of, limit=100):
    """Run a sweep to its end as a backend would, every job succeeding at once with loss_of(params)."""
    status, jobs = TrainingSweepStatus(), {}
    for _ in range(limit):
        t = step(spec, status, jobs)
        status = t.status
        for start in of(StartTrial, t):
            jobs[start.index] = job(Phase.SUCCEEDED, spec.template.spec.max_steps, loss_of(start.params))
        if status.phase in (SweepPhase.SUCCEEDED, SweepPhase.FAILED):
            return t
    raise AssertionError("the sweep did not finish")


# --------------------------------------------------------------------------- ask/tell bookkeeping


def test_the_first_step_records_parallelism_trials_before_starting_them():
    t = step(sweep_spec(parallelism=3, max_trials=5))
    starts = of(StartTrial, t)
    assert [(s.index, s.job_name) for s in starts] == [(0, "s-0"), (1, "s-1"), (2, "s-2")]
    assert [(r.index, r.job_name, r.params) for r in t.status.trials] == [(s.index, s.job_name, s.params) for s in starts]
    assert states(t.status) == [TrialState.PENDING] * 3
    assert all(r.start_time == "2025-05-01T12:00:00Z" for r in t.status.trials)
    assert (t.status.phase, t.status.reason) == (SweepPhase.RUNNING, SweepReason.TRIALS_RUNNING)
    assert (t.status.trials_running, t.status.trials_summary, t.status.start_time) == (3, "0/5", "2025-05-01T12:00:00Z")
    assert [c.type for c in t.status.conditions if c.status == "True"] == ["Running"]
    assert t.status.observed_generation == 0  # the backends set it


def test_max_trials_caps_the_trials_started():
    t = step(sweep_spec(parallelism=5, max_trials=2))
    assert [s.index for s in of(StartTrial, t)] == [0, 1]


def test_a_pending_trial_is_started_again_until_its_job_exists_then_it_runs():
    spec = sweep_spec(parallelism=2)
    first = step(spec)
    again = step(spec, first.status)
    assert of(StartTrial, again) == of(StartTrial, first)  # same indices, names and parameters
    assert again.status.trials == first.status.trials
    seen = step(spec, first.status, {0: job(Phase.CREATED)})
    assert states(seen.status) == [TrialState.RUNNING, TrialState.PENDING]
    assert [s.index for s in of(StartTrial, seen)] == [1]


def test_a_finished_trial_makes_room_for_the_next_index():
    spec = sweep_spec(parallelism=2, max_trials=4)
    status, jobs = running(spec, 2)
    t = step(spec, status, jobs | {0: job(Phase.SUCCEEDED, 100, 1.0)})
    assert [s.index for s in of(StartTrial, t)] == [2]
    assert [r.index for r in t.status.trials] == [0, 1, 2]
    assert (t.status.trials_complete, t.status.trials_running, t.status.trials_summary) == (1, 2, "1/4")


def test_a_deleted_job_fails_its_trial():
    spec = sweep_spec(max_trials=2)
    status, _ = running(spec, 1)
    t = step(spec, status, {})
    assert states(t.status)[0] == TrialState.FAILED
    assert t.status.trials[0].message == "TrainingJob s-0 was deleted"
    assert SweepEvent("Warning", SweepReason.TRIAL_FAILED, "trial 0 (s-0): TrainingJob s-0 was deleted") in t.effects
    assert [s.index for s in of(StartTrial, t)] == [1]


def test_a_failed_job_fails_its_trial_with_the_jobs_message():
    spec = sweep_spec(max_trials=2)
    status, _ = running(spec, 1)
    t = step(spec, status, {0: job(Phase.FAILED, 30, 2.0, "backoffLimit (3) exceeded")})
    assert (t.status.trials[0].state, t.status.trials[0].message) == (TrialState.FAILED, "backoffLimit (3) exceeded")
    assert t.status.trials[0].completion_time == "2025-05-01T12:00:00Z"


def test_a_long_failure_message_is_cut_to_fit_the_status():
    spec = sweep_spec(max_trials=2)
    status, _ = running(spec, 1)
    t = step(spec, status, {0: job(Phase.FAILED, 30, 2.0, "x" * 5000)})
    kept = t.status.trials[0].message
    assert len(kept) == 512 and kept.endswith("...")
    TrainingSweepStatus.model_validate(t.status.dump())  # what the operator reads back


@pytest.mark.parametrize(("objective", "reports", "final", "value"), [
    ("final", [(20, 2.0), (40, 0.5)], 0.8, 0.8),
    ("best", [(20, 2.0), (40, 0.5)], 0.8, 0.5),
    ("best", [(20, 2.0)], 0.8, 0.8),
    ("best", [], 0.8, 0.8),
])
def test_a_succeeded_job_completes_its_trial_with_its_final_or_best_loss(objective, reports, final, value):
    spec = sweep_spec(max_steps=100, objective={"value": objective}, pruner={"type": "none"})
    status, jobs = running(spec, 1)
    for at, loss in reports:
        status = step(spec, status, {0: job(step=at, loss=loss)}).status
    t = step(spec, status, {0: job(Phase.SUCCEEDED, 100, final)})
    assert (t.status.trials[0].state, t.status.trials[0].value) == (TrialState.COMPLETE, value)


def test_an_eval_loss_objective_picks_the_best_trial_by_its_eval_loss():
    spec = sweep_spec(max_trials=2, parallelism=2, objective={"metric": "evalLoss"}, pruner={"type": "none"},
                      template={"spec": {"maxSteps": 100, "optimizer": {"minLr": 0}, "evalEverySteps": 10}})
    status, _ = running(spec, 2)
    ends = {0: TrialObservation(Phase.SUCCEEDED, step=100, loss=0.5, eval_loss=2.0),  # the lower training loss
            1: TrialObservation(Phase.SUCCEEDED, step=100, loss=0.9, eval_loss=1.5)}
    t = step(spec, status, ends)
    assert [tr.value for tr in t.status.trials] == [2.0, 1.5] and t.status.best_trial == 1
    assert t.status.message.startswith("best evalLoss 1.5 by trial 1") and "final evalLoss 1.5" in \
        t.status.trials[1].message
    noeval = step(spec, status, {0: job(Phase.SUCCEEDED, 100, 0.5), 1: job()}).status.trials[0]
    assert noeval.state == TrialState.FAILED and "finite evalLoss" in noeval.message and "evalEverySteps" in \
        noeval.message


def test_a_succeeded_job_that_reported_no_loss_fails_its_trial():
    spec = sweep_spec(max_trials=1)
    status, _ = running(spec, 1)
    t = step(spec, status, {0: job(Phase.SUCCEEDED, 100)})
    assert t.status.trials[0].state == TrialState.FAILED
    assert "succeeded without reporting a finite loss" in t.status.trials[0].message
    assert (t.status.phase, t.status.reason) == (SweepPhase.FAILED, SweepReason.NO_TRIAL_COMPLETED)


def test_the_best_complete_trial_wins_and_the_sweep_succeeds_once_every_trial_finished():
    losses = iter([3.0, 1.0, 2.0])
    t = drive(sweep_spec(max_trials=3, parallelism=1), lambda _: next(losses))
    status = t.status
    assert (status.phase, status.reason) == (SweepPhase.SUCCEEDED, SweepReason.COMPLETED)
    assert (status.best_trial, status.best_value, status.best_params) == (1, 1.0, status.trials[1].params)
    assert (status.trials_complete, status.trials_running, status.trials_summary) == (3, 0, "3/3")
    assert status.completion_time == "2025-05-01T12:00:00Z"
    assert status.message.startswith("best loss 1 by trial 1 (optimizer.lr=")
    assert {c.type: c.status for c in status.conditions} == {"Running": "False", "Succeeded": "True"}
    assert SweepEvent("Normal", SweepReason.COMPLETED, status.message) in t.effects


def test_a_sweep_in_which_no_trial_completed_fails():
    t = drive(sweep_spec(max_trials=2, max_failed_trials=5), lambda _: math.nan)
    assert (t.status.phase, t.status.reason) == (SweepPhase.FAILED, SweepReason.NO_TRIAL_COMPLETED)
    assert t.status.best_trial is None
    assert of(SweepEvent, t)[-1].type == "Warning"


def test_parameters_that_clash_fail_their_trial_without_starting_a_job():
    spec = sweep_spec(
        {"path": "optimizer.lr", "type": "categorical", "values": [1e-3, 1e-2]},
        {"path": "optimizer.minLr", "type": "categorical", "values": [5e-4, 2e-3]},
        sampler={"type": "grid"}, parallelism=4, max_trials=4,
    )
    t = step(spec)
    clash = [r for r in t.status.trials if r.params == {"optimizer.lr": 1e-3, "optimizer.minLr": 2e-3}]
    assert len(clash) == 1 and clash[0].state == TrialState.FAILED
    assert "optimizer.minLr must not exceed optimizer.lr" in clash[0].message
    assert clash[0].index not in [s.index for s in of(StartTrial, t)]
    assert len(of(StartTrial, t)) == 3


# --------------------------------------------------------------------------- intermediate values and pruning


def test_intermediate_values_are_kept_once_per_interval_at_its_first_step():
    spec = sweep_spec(max_steps=400, pruner={"type": "none"})  # interval: 400 / 20 = 20
    status, _ = running(spec, 1)
    for at, loss in [(10, 9.0), (25, 5.0), (30, 4.0), (31, None), (47, 3.0), (45, 3.5), (60, None)]:
        status = step(spec, status, {0: job(step=at, loss=loss)}).status
    assert [(v.step, v.value) for v in status.trials[0].intermediate] == [(20, 5.0), (40, 3.0)]
    assert status.trials[0].step == 60


def test_asha_prunes_a_clearly_worse_trial_at_its_first_rung():
    spec = sweep_spec(parallelism=2, max_trials=2, pruner={"type": "asha", "minSteps": 10})
    status, jobs = running(spec, 2)
    early = step(spec, status, {0: job(step=8, loss=1.0), 1: job(step=8, loss=9.0)})
    assert of(StopTrial, early) == []  # before minSteps
    t = step(spec, early.status, {0: job(step=10, loss=1.0), 1: job(step=10, loss=9.0)})
    assert states(t.status) == [TrialState.RUNNING, TrialState.PRUNED]
    assert of(StopTrial, t) == [StopTrial(1, "s-1", SweepReason.PRUNED)]
    pruned = t.status.trials[1]
    assert (pruned.value, pruned.message, pruned.pruner_state) == (9.0, "pruned at step 10 (loss 9)", {"completed_rung_0": 9.0})
    assert t.status.trials[0].pruner_state == {"completed_rung_0": 1.0}
    assert SweepEvent("Normal", SweepReason.TRIAL_PRUNED, "trial 1 (s-1): pruned at step 10 (loss 9)") in t.effects
    assert t.status.trials_pruned == 1


def test_asha_keeps_a_trial_better_than_those_before_it_at_the_rung():
    spec = sweep_spec(parallelism=2, max_trials=2, pruner={"type": "asha", "minSteps": 10})
    status, _ = running(spec, 2)
    t = step(spec, status, {0: job(step=10, loss=9.0), 1: job(step=10, loss=1.0)})
    assert states(t.status) == [TrialState.RUNNING, TrialState.RUNNING]


def test_median_prunes_below_the_median_only_after_its_startup_trials_completed():
    spec = sweep_spec(parallelism=3, max_trials=3, pruner={"type": "median", "minSteps": 10, "startupTrials": 2})
    status, _ = running(spec, 3)
    status = step(spec, status, {0: job(step=10, loss=1.0), 1: job(step=10, loss=2.0), 2: job(step=5)}).status
    assert states(status) == [TrialState.RUNNING] * 3  # no trial completed yet
    late = job(step=10, loss=9.0)
    one_done = step(spec, status, {0: job(Phase.SUCCEEDED, 100, 0.5), 1: job(step=12, loss=2.0), 2: late})
    assert states(one_done.status) == [TrialState.COMPLETE, TrialState.RUNNING, TrialState.RUNNING]
    both_done = {0: job(Phase.SUCCEEDED, 100, 0.5), 1: job(Phase.SUCCEEDED, 100, 0.6)}
    t = step(spec, status, both_done | {2: late})
    assert states(t.status) == [TrialState.COMPLETE, TrialState.COMPLETE, TrialState.PRUNED]
    assert of(StopTrial, t) == [StopTrial(2, "s-2", SweepReason.PRUNED)]
    assert t.status.trials[2].pruner_state == {}  # the median pruner keeps no bookkeeping


def test_no_pruner_never_prunes():
    spec = sweep_spec(parallelism=2, max_trials=2, pruner={"type": "none"})
    status, _ = running(spec, 2)
    for at in (10, 20, 50):
        status = step(spec, status, {0: job(step=at, loss=1.0), 1: job(step=at, loss=100.0)}).status
    assert states(status) == [TrialState.RUNNING] * 2


def test_a_diverged_trial_is_pruned_without_a_value():
    spec = sweep_spec(max_trials=2)
    status, _ = running(spec, 1)
    t = step(spec, status, {0: job(step=30, loss=math.inf)})
    assert (t.status.trials[0].state, t.status.trials[0].value) == (TrialState.PRUNED, None)
    assert of(StopTrial, t) == [StopTrial(0, "s-0", SweepReason.PRUNED)]


@pytest.mark.parametrize(("phase", "stopped"), [
    (Phase.RUNNING, True), (Phase.RESTARTING, True), (Phase.PENDING, True),
    (Phase.SUSPENDED, False), (Phase.FAILED, False), (None, False),
])
def test_a_pruned_trials_job_is_stopped_until_it_holds_no_workers(phase, stopped):
    spec = sweep_spec(parallelism=2, max_trials=2, pruner={"type": "asha", "minSteps": 10})
    status, _ = running(spec, 2)
    status = step(spec, status, {0: job(step=10, loss=1.0), 1: job(step=10, loss=9.0)}).status
    t = step(spec, status, {0: job(step=12, loss=1.0), 1: job(phase, step=10, loss=9.0)})
    assert of(StopTrial, t) == ([StopTrial(1, "s-1", SweepReason.PRUNED)] if stopped else [])
    assert states(t.status) == [TrialState.RUNNING, TrialState.PRUNED]


def test_a_job_suspended_by_someone_else_keeps_its_trial_running():
    spec = sweep_spec(max_trials=1)
    status, _ = running(spec, 1)
    t = step(spec, status, {0: job(Phase.SUSPENDED, step=40, loss=2.0)})
    assert states(t.status) == [TrialState.RUNNING]
    assert of(StopTrial, t) == []


# --------------------------------------------------------------------------- failing the sweep


def test_too_many_failed_trials_fail_the_sweep_and_stop_the_others():
    spec = sweep_spec(parallelism=3, max_trials=10, max_failed_trials=1)
    status, _ = running(spec, 3)
    failed = job(Phase.FAILED, message="boom")
    t = step(spec, status, {0: failed, 1: failed, 2: job(step=5)})
    assert (t.status.phase, t.status.reason) == (SweepPhase.FAILED, SweepReason.TOO_MANY_FAILED_TRIALS)
    assert t.status.message == "2 trials failed, more than maxFailedTrials (1)"
    assert of(StartTrial, t) == []
    assert of(StopTrial, t) == [StopTrial(2, "s-2", SweepReason.TOO_MANY_FAILED_TRIALS)]
    assert states(t.status) == [TrialState.FAILED] * 3
    assert (t.status.trials_running, t.status.trials_failed) == (0, 3)
    assert t.status.completion_time == "2025-05-01T12:00:00Z"
    # finished: a later step changes nothing, but stops a job that still runs
    later = step(spec, t.status, {2: job(step=9)})
    assert later.status == t.status
    assert later.effects == (StopTrial(2, "s-2", SweepReason.TOO_MANY_FAILED_TRIALS),)
    assert step(spec, t.status, {2: job(Phase.SUSPENDED)}).effects == ()


def test_an_invalid_space_fails_the_sweep_once_with_the_problems():
    spec = sweep_spec({"path": "optimizer.lrr", "low": 1, "high": 2}, {"path": "microBatchSize", "low": 1, "high": 9})
    t = step(spec)
    assert (t.status.phase, t.status.reason, t.status.trials) == (SweepPhase.FAILED, SweepReason.INVALID_SPEC, [])
    assert t.status.message == (
        "invalid search space: spec.parameters[0].path: optimizer has no field 'lrr'; its fields: beta1, beta2, "
        "gradClip, lr, minLr, name, warmupSteps, weightDecay; "
        "spec.parameters[1].type: microBatchSize is an integer field: use type int")
    assert t.effects == (SweepEvent("Warning", SweepReason.INVALID_SPEC, t.status.message),)
    assert [c.type for c in t.status.conditions if c.status == "True"] == ["Failed"]
    again = step(spec, t.status)
    assert (again.status, again.effects) == (t.status, ())


# --------------------------------------------------------------------------- the same status, the same answer


def _midway():
    """A sweep with trials in every state, and the jobs a backend sees."""
    spec = sweep_spec(parallelism=3, max_trials=8, pruner={"type": "asha", "minSteps": 10}, seed=11)
    status, _ = running(spec, 3)
    status = step(spec, status, {0: job(step=10, loss=1.0), 1: job(step=10, loss=5.0), 2: job(step=10, loss=0.8)}).status
    jobs = {0: job(Phase.SUCCEEDED, 100, 0.7), 1: job(Phase.SUSPENDED, 10, 5.0), 2: job(step=30, loss=0.6)}
    return spec, step(spec, status, jobs).status, jobs


def test_the_same_status_and_observations_give_the_same_transition():
    spec, status, jobs = _midway()
    assert step(spec, status, jobs) == step(spec, status, jobs)


def test_a_status_read_back_from_json_gives_the_same_next_trials():
    spec, status, jobs = _midway()
    restarted = TrainingSweepStatus.model_validate(status.dump())
    assert restarted == status
    ahead = step(spec, status, jobs | {3: job(Phase.SUCCEEDED, 100, 0.9), 4: job(Phase.FAILED)})
    again = step(spec, restarted, jobs | {3: job(Phase.SUCCEEDED, 100, 0.9), 4: job(Phase.FAILED)})
    assert of(StartTrial, ahead) and of(StartTrial, ahead) == of(StartTrial, again)
    assert ahead.status == again.status


def test_the_seed_decides_the_parameters():
    params = {seed: [s.params for s in of(StartTrial, step(sweep_spec(parallelism=3, seed=seed)))] for seed in (1, 2)}
    assert params[1] == [s.params for s in of(StartTrial, step(sweep_spec(parallelism=3, seed=1)))]
    assert params[1] != params[2]
    assert len({str(p) for p in params[1]}) == 3  # each trial draws afresh


def test_the_grid_sampler_tries_each_point_once_then_the_sweep_ends():
    spec = sweep_spec(
        {"path": "model.nLayers", "type": "int", "low": 1, "high": 2, "step": 1},
        {"path": "precision", "type": "categorical", "values": ["fp32", "bf16"]},
        sampler={"type": "grid"}, parallelism=3, max_trials=10,
    )
    t = drive(spec, lambda p: p["model.nLayers"] + (p["precision"] == "bf16"))
    assert sorted((r.params["model.nLayers"], r.params["precision"]) for r in t.status.trials) == [
        (1, "bf16"), (1, "fp32"), (2, "bf16"), (2, "fp32")]
    assert (t.status.phase, t.status.trials_summary) == (SweepPhase.SUCCEEDED, "4/4")
    assert t.status.best_params == {"model.nLayers": 1, "precision": "fp32"}


HOSTILE_GRID = {"path": "maxSteps", "type": "int", "low": 1, "high": 1e9, "step": 1}
"""A billion grid points: a stored sweep that bypassed the API server's rule must cost nothing to refuse."""


def test_a_grid_beyond_the_bound_fails_the_sweep_without_building_it(monkeypatch):
    monkeypatch.setattr(space, "grid_values", lambda p: pytest.fail("the grid's values were listed"))
    spec = sweep_spec(HOSTILE_GRID, sampler={"type": "grid"})
    t = step(spec)
    assert (t.status.phase, t.status.reason, t.status.trials) == (SweepPhase.FAILED, SweepReason.INVALID_SPEC, [])
    assert t.status.message == (
        "invalid search space: spec.parameters: the grid sampler tries every combination of the parameters' values: "
        "at most 10000 (use sampler random or tpe for a larger space, or coarser steps)")


def test_a_grid_of_many_small_parameters_is_bounded_by_its_product():
    two = [{"path": p, "type": "categorical", "values": [1, 2]} for p in ("microBatchSize", "evalEverySteps")]
    ints = [{"path": f"checkpoint.{f}", "type": "int", "low": 1, "high": 100, "step": 1} for f in ("keep", "everySteps")]
    assert space.grid_size(sweep_spec(*two, *ints[:1], sampler={"type": "grid"})) == 400
    assert step(sweep_spec(*two, *ints[:1], sampler={"type": "grid"})).status.phase == SweepPhase.RUNNING
    failed = step(sweep_spec(*two, *ints, sampler={"type": "grid"})).status  # 40000
    assert (failed.phase, failed.message) == (SweepPhase.FAILED, "invalid search space: spec.parameters: " +
                                              GRID_TOO_LARGE)


def test_categorical_values_count_in_the_grid_though_the_api_server_sees_only_the_ranges():
    many = [{"path": p, "type": "categorical", "values": list(range(1, 101))} for p in ("microBatchSize", "evalEverySteps")]
    spec = sweep_spec(*many, {"path": "model.nLayers", "type": "int", "low": 1, "high": 2, "step": 1},
                      sampler={"type": "grid"})  # 100 x 100 x 2
    assert [path for path, _ in spec.rule_violations()] == ["parameters"]
    assert step(spec).status.message == "invalid search space: spec.parameters: " + GRID_TOO_LARGE


def test_random_sampling_over_the_same_range_never_lists_it(monkeypatch):
    monkeypatch.setattr(space, "grid_values", lambda p: pytest.fail("the grid's values were listed"))
    t = step(sweep_spec(HOSTILE_GRID, sampler={"type": "random"}, parallelism=2))
    assert len(of(StartTrial, t)) == 2 and all(1 <= e.params["maxSteps"] <= 1e9 for e in of(StartTrial, t))
