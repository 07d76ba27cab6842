"""A sweep's search space: which spec fields it may tune, their distributions, and the trial manifests."""

import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from kubetrain.core import contract
from kubetrain.core.api import TrainingJobTemplate, TrainingSweepSpec
from kubetrain.core.sweep import space

LR = {"path": "optimizer.lr", "low": 1e-3, "high": 1e-1, "log": True}


def sweep_spec(*parameters, template=None, metadata=None, **fields):
    return TrainingSweepSpec.model_validate({
        "template": {"spec": template or {}, **({"metadata": metadata} if metadata else {})},
        "parameters": list(parameters) or [LR],
        **fields,
    })


# parameter -> the (path, reason) check_space gives, in a template with defaults only
PROBLEMS = [
    ({"path": "optimizer.lrr", "low": 1, "high": 2},
     ("parameters[0].path", "optimizer has no field 'lrr'; its fields: beta1, beta2, gradClip, lr, minLr, name, "
                            "warmupSteps, weightDecay")),
    ({"path": "optimizer", "low": 1, "high": 2},
     ("parameters[0].path", "optimizer is an object, not a value: name one of its fields (beta1, beta2, gradClip, lr, "
                            "minLr, name, warmupSteps, weightDecay)")),
    ({"path": "podTemplate.spec", "low": 1, "high": 2},
     ("parameters[0].path", "podTemplate is a mapping, not an object with fields")),
    ({"path": "strategy.kind", "type": "categorical", "values": ["a"]},
     ("parameters[0].path", "strategy is a string, not an object with fields")),
    ({"path": "workers.count", "type": "int", "low": 1, "high": 2},
     ("parameters[0].path", "workers is an integer, not an object with fields")),
    ({"path": "command", "type": "categorical", "values": ["a"]},
     ("parameters[0].path", "command is a list, not a single value a parameter can set")),
    ({"path": "checkpoint.dir", "type": "categorical", "values": ["/ckpt/a", "/ckpt/b"]},
     ("parameters[0].path", "checkpoint.dir names where a job keeps its checkpoints, not a hyperparameter: every "
                            "trial keeps its own")),
    ({"path": "microBatchSize", "low": 1, "high": 64},
     ("parameters[0].type", "microBatchSize is an integer field: use type int")),
    ({"path": "strategy", "low": 1, "high": 2},
     ("parameters[0].type", "strategy holds a string: use type categorical")),
    ({"path": "activationCheckpointing", "type": "int", "low": 0, "high": 1},
     ("parameters[0].type", "activationCheckpointing holds a boolean: use type categorical")),
    ({"path": "optimizer.lr", "low": 0, "high": 1e-2},
     ("parameters[0].low", "0.0 makes an invalid TrainingJob: optimizer.lr: must be greater than 0")),
    ({"path": "optimizer.lr", "low": 0, "high": 1e-2, "log": True},
     ("parameters[0].log", "log needs a float or int parameter with low > 0, and no step")),
    ({"path": "optimizer.lr", "low": 1e-5, "high": 1e-2},
     ("parameters[0].low", "1e-05 makes an invalid TrainingJob: optimizer.minLr: optimizer.minLr must not exceed "
                           "optimizer.lr")),
    ({"path": "optimizer.beta1", "low": 0.5, "high": 1},
     ("parameters[0].high", "1.0 makes an invalid TrainingJob: optimizer.beta1: must be less than 1")),
    ({"path": "optimizer.beta1", "low": 0.1, "high": 0.9, "step": 0.3},
     ("parameters[0].step", "high - low must be a multiple of step")),
    ({"path": "strategy", "type": "categorical", "values": ["ddp", "tpu"]},
     ("parameters[0].values[1]", "\"tpu\" makes an invalid TrainingJob: strategy: must be 'ddp', 'fsdp' or 'deepspeed'")),
    ({"path": "microBatchSize", "type": "categorical", "values": [8, "16"]},
     ("parameters[0].values[1]", "\"16\" makes an invalid TrainingJob: microBatchSize: must be a valid integer")),
    ({"path": "model.nHeads", "type": "categorical", "values": [4, 3]},
     ("parameters[0].values[1]", "3 makes an invalid TrainingJob: model.nHeads: model.dModel must be divisible by "
                                 "model.nHeads")),
    ({"path": "optimizer.warmupSteps", "type": "int", "low": 0.5, "high": 10},
     ("parameters[0].type", "an int parameter needs whole numbers for low, high and step")),
    ({"path": "optimizer.lr", "low": 1e-2, "high": 1e-3},
     ("parameters[0].low", "a float or int parameter needs low and high, with low < high")),
    ({"path": "optimizer.lr", "type": "categorical"},
     ("parameters[0].values", "a categorical parameter needs values; a float or int parameter takes low and high "
                              "instead")),
]


@pytest.mark.parametrize(("parameter", "problem"), PROBLEMS, ids=[p[1][1][:40] for p in PROBLEMS])
def test_a_parameter_that_cannot_give_valid_jobs_is_refused(parameter, problem):
    assert space.check_space(sweep_spec(parameter)) == [problem]


@pytest.mark.parametrize("parameter", [
    LR,
    {"path": "optimizer.lr", "type": "int", "low": 1, "high": 3},  # an int parameter may set a float field
    {"path": "optimizer.warmupSteps", "type": "int", "low": 0, "high": 100, "step": 10},
    {"path": "model.nLayers", "type": "int", "low": 1, "high": 8, "log": True},
    {"path": "precision", "type": "categorical", "values": ["fp32", "bf16"]},
    {"path": "activationCheckpointing", "type": "categorical", "values": [True, False]},
    {"path": "optimizer.beta1", "low": 0.5, "high": 0.9, "step": 0.1},
])
def test_a_parameter_over_a_scalar_field_within_its_bounds_is_accepted(parameter):
    assert space.check_space(sweep_spec(parameter)) == []


def test_bounds_are_checked_against_the_template_as_written():
    param = {"path": "optimizer.lr", "low": 1e-5, "high": 1e-2}
    assert space.check_space(sweep_spec(param, template={"optimizer": {"minLr": 0}})) == []
    deepspeed = {"path": "deepspeed.zeroStage", "type": "int", "low": 0, "high": 3}
    assert space.check_space(sweep_spec(deepspeed, template={"strategy": "deepspeed"})) == []
    assert space.check_space(sweep_spec(deepspeed))[0] == (
        "parameters[0].low", "0 makes an invalid TrainingJob: deepspeed: deepspeed options need strategy 'deepspeed'")


def test_sweep_rules_and_template_rules_are_reported_once():
    twice = sweep_spec(LR, LR)
    assert space.check_space(twice) == [("parameters", "every parameter needs its own path (a spec field is tuned once)")]
    grid = sweep_spec(LR | {"log": False}, sampler={"type": "grid"})
    assert space.check_space(grid) == [("sampler.type", "the grid sampler needs values or step on every parameter")]
    bad_template = sweep_spec(template={"model": {"nHeads": 3}})
    assert space.check_space(bad_template) == [
        ("template.spec.model.nHeads", "model.dModel must be divisible by model.nHeads")]


@pytest.mark.parametrize(("parameter", "expected"), [
    (LR, FloatDistribution(1e-3, 1e-1, log=True)),
    ({"path": "optimizer.beta1", "low": 0.5, "high": 0.9, "step": 0.1}, FloatDistribution(0.5, 0.9, step=0.1)),
    ({"path": "model.nLayers", "type": "int", "low": 1, "high": 8}, IntDistribution(1, 8)),
    ({"path": "model.nLayers", "type": "int", "low": 2, "high": 8, "step": 2}, IntDistribution(2, 8, step=2)),
    ({"path": "model.nLayers", "type": "int", "low": 1, "high": 8, "log": True}, IntDistribution(1, 8, log=True)),
    ({"path": "precision", "type": "categorical", "values": ["fp32", "bf16"]}, CategoricalDistribution(["fp32", "bf16"])),
])
def test_distributions(parameter, expected):
    dists = space.distributions(sweep_spec(parameter))
    assert dists == {parameter["path"]: expected}
    if isinstance(expected, IntDistribution):
        assert isinstance(expected.low, int) and isinstance(expected.step, int)


def test_grid_size_and_values():
    beta = {"path": "optimizer.beta1", "low": 0.1, "high": 0.5, "step": 0.1}
    layers = {"path": "model.nLayers", "type": "int", "low": 2, "high": 8, "step": 2}
    precision = {"path": "precision", "type": "categorical", "values": ["fp32", "bf16"]}
    spec = sweep_spec(beta, layers, precision, sampler={"type": "grid"})
    assert space.grid_values(spec.parameters[0]) == [0.1, 0.2, 0.3, 0.4, 0.5]
    assert space.grid_values(spec.parameters[1]) == [2, 4, 6, 8]
    assert space.grid_size(spec) == 5 * 4 * 2
    assert space.grid_size(sweep_spec(beta, layers)) is None  # not the grid sampler


def test_trial_manifest_is_the_template_as_written_with_the_parameters_set():
    spec = sweep_spec(
        LR, {"path": "model.nLayers", "type": "int", "low": 1, "high": 4},
        template={"maxSteps": 300, "optimizer": {"minLr": 0}},
        metadata={"labels": {"team": "nlp"}, "annotations": {"note": "x"}},
    )
    manifest = space.trial_manifest("lr", "research", spec, 7, {"optimizer.lr": 0.01, "model.nLayers": 3})
    assert manifest == {
        "apiVersion": "kubetrain.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {
            "name": "lr-7",
            "namespace": "research",
            "labels": {"team": "nlp", contract.LABEL_SWEEP: "lr", contract.LABEL_TRIAL: "7"},
            "annotations": {"note": "x"},
        },
        "spec": {"maxSteps": 300, "optimizer": {"minLr": 0.0, "lr": 0.01}, "model": {"nLayers": 3}},
    }
    assert spec.template.spec.optimizer.lr == 3e-3  # the template itself is not changed
    assert "model" not in spec.template.model_dump(exclude_unset=True)["spec"]


def test_trial_manifest_without_namespace_or_template_metadata():
    manifest = space.trial_manifest("s", None, sweep_spec(), 0, {"optimizer.lr": 0.01})
    assert manifest["metadata"] == {"name": "s-0", "labels": {contract.LABEL_SWEEP: "s", contract.LABEL_TRIAL: "0"}}
    assert manifest["spec"] == {"optimizer": {"lr": 0.01}}


def test_best_manifest_is_ready_to_run_and_not_a_trial():
    spec = sweep_spec(metadata={"labels": {"team": "nlp"}})
    manifest = space.best_manifest("lr", "ns", spec, {"optimizer.lr": 0.02})
    assert manifest["metadata"] == {"name": "lr-best", "namespace": "ns", "labels": {"team": "nlp"}}
    assert manifest["spec"] == {"optimizer": {"lr": 0.02}}
    longest = "s" * 46
    assert space.best_job_name(longest) == "s" * 45 + "-best"  # job names have at most 50 characters


def test_trial_spec_refuses_parameters_that_clash():
    template = TrainingJobTemplate.model_validate({"spec": {"optimizer": {"minLr": 1e-3}}})
    assert space.trial_spec(template, {"optimizer.lr": 1e-2}).optimizer.lr == 1e-2
    with pytest.raises(space.TrialSpecError) as err:
        space.trial_spec(template, {"optimizer.lr": 1e-4})
    assert err.value.problems == [("optimizer.minLr", "optimizer.minLr must not exceed optimizer.lr")]
    with pytest.raises(space.TrialSpecError, match="microBatchSize: must be a valid integer"):
        space.trial_spec(template, {"microBatchSize": 2.5})


def test_trial_job_names():
    assert space.trial_job_name("sweep", 0) == "sweep-0"
    assert space.trial_job_name("sweep", 499) == "sweep-499"
