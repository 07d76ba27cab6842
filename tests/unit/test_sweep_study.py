"""The Optuna side of a sweep: samplers, pruners, and the study rebuilt from a status."""

import math

import pytest
from optuna.pruners import MedianPruner, NopPruner, SuccessiveHalvingPruner
from optuna.samplers import GridSampler, RandomSampler, TPESampler
from optuna.trial import TrialState as OptunaState

from kubetrain.core.api import TrainingSweepSpec, TrialRecord, TrialState, TrialValue
from kubetrain.core.sweep import study

LR = {"path": "optimizer.lr", "low": 1e-3, "high": 1e-1, "log": True}
LAYERS = {"path": "model.nLayers", "type": "int", "low": 1, "high": 4}


def sweep_spec(*parameters, max_steps=100, **fields):
    return TrainingSweepSpec.model_validate({
        "template": {"spec": {"maxSteps": max_steps}}, "parameters": list(parameters) or [LR, LAYERS], **fields})


def record(index, state, value=None, intermediate=(), **fields):
    return TrialRecord(index=index, job_name=f"s-{index}", params={"optimizer.lr": 0.01, "model.nLayers": 2},
                       state=state, value=value, intermediate=[TrialValue(step=s, value=v) for s, v in intermediate],
                       **fields)


@pytest.mark.parametrize(("sampler", "kind"), [("tpe", TPESampler), ("random", RandomSampler)])
def test_samplers(sampler, kind):
    assert isinstance(study.sampler(sweep_spec(sampler={"type": sampler}), 1), kind)


def test_grid_sampler_searches_every_value():
    spec = sweep_spec({"path": "model.nLayers", "type": "int", "low": 1, "high": 4, "step": 1},
                      {"path": "precision", "type": "categorical", "values": ["fp32", "bf16"]},
                      sampler={"type": "grid"})
    sampler = study.sampler(spec, 0)
    assert isinstance(sampler, GridSampler)
    assert sampler._search_space == {"model.nLayers": [1, 2, 3, 4], "precision": ["fp32", "bf16"]}


@pytest.mark.parametrize(("pruner", "kind"), [("asha", SuccessiveHalvingPruner), ("median", MedianPruner),
                                              ("none", NopPruner)])
def test_pruners(pruner, kind):
    assert isinstance(study.pruner(sweep_spec(pruner={"type": pruner})), kind)


@pytest.mark.parametrize(("max_steps", "pruner", "min_steps", "interval"), [
    (100, {}, 10, 5),
    (5, {}, 1, 1),
    (1000, {"minSteps": 50, "intervalSteps": 5}, 50, 50),  # widened so maxSteps fits in 20 values
    (1000, {"intervalSteps": 100}, 100, 100),
])
def test_min_steps_and_interval(max_steps, pruner, min_steps, interval):
    spec = sweep_spec(max_steps=max_steps, pruner=pruner)
    assert study.min_steps(spec) == min_steps
    assert study.interval(spec) == interval


def test_rebuild_holds_every_trial_in_index_order():
    trials = [
        record(0, TrialState.COMPLETE, 1.5, [(10, 2.0)], pruner_state={"completed_rung_0": 2.0}),
        record(1, TrialState.PRUNED, 3.0, [(10, 3.0)]),
        record(2, TrialState.FAILED),
        record(3, TrialState.RUNNING, intermediate=[(10, 2.5), (20, 2.2)]),
        record(4, TrialState.PENDING),
    ]
    rebuilt = study.rebuild(sweep_spec(), list(reversed(trials)), 0)
    got = rebuilt.get_trials()
    assert [t.number for t in got] == [0, 1, 2, 3, 4]
    assert [t.state for t in got] == [OptunaState.COMPLETE, OptunaState.PRUNED, OptunaState.FAIL,
                                      OptunaState.RUNNING, OptunaState.RUNNING]
    assert [t.value for t in got] == [1.5, 3.0, None, None, None]
    assert got[0].system_attrs == {"completed_rung_0": 2.0}
    assert got[3].intermediate_values == {10: 2.5, 20: 2.2}
    assert got[4].params == {"optimizer.lr": 0.01, "model.nLayers": 2}


def test_a_pruned_trial_without_a_value_diverged_and_ranks_last():
    diverged = record(0, TrialState.PRUNED, intermediate=[(10, 2.0)], step=17)
    got = study.rebuild(sweep_spec(), [diverged], 0).get_trials()[0]
    assert got.value is None and math.isnan(got.intermediate_values[17])
    assert got.intermediate_values[10] == 2.0


def test_asha_judges_a_rebuilt_running_trial_and_its_bookkeeping_is_read_back():
    spec = sweep_spec(pruner={"type": "asha", "minSteps": 10, "reductionFactor": 2})
    first = record(0, TrialState.RUNNING, intermediate=[(10, 1.0)], pruner_state={"completed_rung_0": 1.0})
    worse = record(1, TrialState.RUNNING, intermediate=[(10, 4.0)])
    prune, attrs = study.should_prune(study.rebuild(spec, [first, worse], 0), 1)
    assert prune and attrs == {"completed_rung_0": 4.0}
    better = record(1, TrialState.RUNNING, intermediate=[(10, 0.5)])
    prune, attrs = study.should_prune(study.rebuild(spec, [first, better], 0), 1)
    assert not prune and attrs == {"completed_rung_0": 0.5}


def test_median_prunes_below_the_median_of_complete_trials_only_after_the_startup_trials():
    spec = sweep_spec(pruner={"type": "median", "startupTrials": 2, "minSteps": 10})
    done = [record(i, TrialState.COMPLETE, 1.0, [(10, 1.0 + i)]) for i in range(2)]
    bad = record(2, TrialState.RUNNING, intermediate=[(10, 9.0)])
    assert study.should_prune(study.rebuild(spec, [*done, bad], 0), 2) == (True, {})
    assert study.should_prune(study.rebuild(spec, [done[0], bad], 0), 1) == (False, {})  # one complete trial
    early = record(2, TrialState.RUNNING, intermediate=[(5, 9.0)])  # before minSteps
    assert study.should_prune(study.rebuild(spec, [*done, early], 0), 2) == (False, {})


def test_the_same_status_and_seed_give_the_same_parameters():
    spec = sweep_spec(sampler={"type": "tpe", "startupTrials": 1})
    trials = [record(0, TrialState.COMPLETE, 1.0), record(1, TrialState.RUNNING)]
    asked = [study.ask(study.rebuild(spec, trials, study.sampler_seed(spec, 2)), spec, study.sampler_seed(spec, 2))
             for _ in range(2)]
    assert asked[0] == asked[1]
    assert set(asked[0]) == {"optimizer.lr", "model.nLayers"}
    other = study.ask(study.rebuild(spec, trials, 99), spec, 99)
    assert other != asked[0]


def test_sampler_seeds_differ_per_trial_except_for_the_grid():
    spec = sweep_spec(seed=5)
    assert len({study.sampler_seed(spec, i) for i in range(500)}) == 500
    grid = sweep_spec({"path": "precision", "type": "categorical", "values": ["fp32", "bf16"]},
                      sampler={"type": "grid"}, seed=5)
    assert {study.sampler_seed(grid, i) for i in range(3)} == {5}


def test_the_grid_sampler_walks_its_grid_once_whatever_the_other_trials_did():
    spec = sweep_spec({"path": "model.nLayers", "type": "int", "low": 1, "high": 3, "step": 1},
                      {"path": "precision", "type": "categorical", "values": ["fp32", "bf16"]},
                      sampler={"type": "grid"}, seed=3)
    trials: list[TrialRecord] = []
    for index in range(6):
        seed = study.sampler_seed(spec, index)
        params = study.ask(study.rebuild(spec, trials, seed), spec, seed)
        state = [TrialState.COMPLETE, TrialState.FAILED, TrialState.RUNNING][index % 3]
        trials.append(TrialRecord(index=index, job_name=f"s-{index}", params=params, state=state,
                                  value=1.0 if state == TrialState.COMPLETE else None))
    assert sorted((t.params["model.nLayers"], t.params["precision"]) for t in trials) == [
        (1, "bf16"), (1, "fp32"), (2, "bf16"), (2, "fp32"), (3, "bf16"), (3, "fp32")]
