"""`kubetrain validate` on TrainingSweep manifests: the schema, the rules and the search space, one line each."""

import copy
from pathlib import Path

import pytest
import yaml

from kubetrain.core.cli import main
from kubetrain.core.validate import ManifestError, check_sweep, load_job, load_sweep, problems_of

REPO = Path(__file__).resolve().parents[2]
SWEEP = {
    "apiVersion": "kubetrain.io/v1alpha1",
    "kind": "TrainingSweep",
    "metadata": {"name": "lr"},
    "spec": {
        "template": {"spec": {"maxSteps": 200, "optimizer": {"minLr": 0}}},
        "parameters": [{"path": "optimizer.lr", "low": 1e-4, "high": 1e-1, "log": True}],
    },
}


def sweep(**changes):
    """SWEEP with `changes` applied: dotted paths (numbers index lists) to a new value, or to None to drop it."""
    doc = copy.deepcopy(SWEEP)
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        node = doc
        for name in parents:
            node = node[int(name)] if name.isdigit() else node[name]
        if value is None:
            del node[leaf]
        else:
            node[int(leaf) if leaf.isdigit() else leaf] = value
    return doc


# changes to SWEEP -> the lines `kubetrain validate` prints for it
BROKEN = [
    ({"spec__template__spec__suspend": True},
     ["spec.template.spec.suspend: trial jobs start unsuspended: drop template.spec.suspend (a queue such as Kueue "
      "suspends and resumes them itself)"]),
    ({"spec__parameters__0__path": "optimizer.lrr"},
     ["spec.parameters[0].path: optimizer has no field 'lrr'; its fields: beta1, beta2, gradClip, lr, minLr, name, "
      "warmupSteps, weightDecay"]),
    ({"spec__parameters__0__low": 0},
     ["spec.parameters[0].log: log needs a float or int parameter with low > 0, and no step"]),
    ({"spec__parameters__0__type": "int"},
     ["spec.parameters[0].type: an int parameter needs whole numbers for low, high and step"]),
    ({"spec__parameters__0": {"path": "strategy", "type": "categorical", "values": ["ddp", "tpu"]}},
     ["spec.parameters[0].values[1]: \"tpu\" makes an invalid TrainingJob: strategy: must be 'ddp', 'fsdp' or "
      "'deepspeed'"]),
    ({"spec__parameters": []}, ["spec.parameters: must have at least 1 items"]),
    ({"spec__parameters": None}, ["spec.parameters: required"]),
    ({"spec__template__spec__model": {"nHeads": 3}},
     ["spec.template.spec.model.nHeads: model.dModel must be divisible by model.nHeads"]),
    ({"spec__samplr": {"type": "grid"}}, ["spec.samplr: unknown field"]),
    ({"spec__sampler": {"type": "grid"}},
     ["spec.sampler.type: the grid sampler needs values or step on every parameter"]),
    ({"spec__sampler": {"type": "grid"},
      "spec__parameters__0": {"path": "maxSteps", "type": "int", "low": 1, "high": 1e9, "step": 1}},
     ["spec.parameters: the grid sampler tries every combination of the parameters' values: at most 10000 (use "
      "sampler random or tpe for a larger space, or coarser steps)"]),
    ({"spec__parameters__0": {"path": "checkpoint.dir", "type": "categorical", "values": ["/a", "/b"]}},
     ["spec.parameters[0].path: checkpoint.dir names where a job keeps its checkpoints, not a hyperparameter: "
      "every trial keeps its own"]),
    ({"spec__parameters__0": {"path": "suspend", "type": "categorical", "values": [True, False]}},
     ["spec.parameters[0].path: suspend pauses and resumes a job, not a hyperparameter: the sweep decides when "
      "each trial runs"]),
    ({"spec__objective": {"metric": "evalLoss"}},
     ["spec.objective.metric: evalLoss needs an evaluation in every trial: set template.spec.evalEverySteps (a "
      "custom command reports its own eval_loss)"]),
    ({"spec__maxTrials": 501}, ["spec.maxTrials: must be <= 500"]),
    ({"metadata__name": "s" * 47}, ["metadata.name: must have at most 46 characters"]),
    ({"spec": None}, ["spec: required"]),
    ({"apiVersion": "v1"}, ["apiVersion: must be kubetrain.io/v1alpha1"]),
]


@pytest.mark.parametrize(("changes", "lines"), BROKEN, ids=[b[1][0][:50] for b in BROKEN])
def test_a_broken_sweep_names_each_problem(changes, lines):
    assert [str(p) for p in problems_of(sweep(**changes))] == lines
    assert check_sweep(sweep(**changes))[0] is None


def test_a_valid_sweep():
    found, problems = check_sweep(SWEEP)
    assert problems == [] and found is not None
    assert found.spec.parameters[0].path == "optimizer.lr"
    assert problems_of(SWEEP) == []


def test_numbers_are_read_as_the_api_server_reads_them():
    whole = sweep(spec__parameters__0={"path": "microBatchSize", "type": "categorical", "values": [8.0, 16]})
    assert problems_of(whole) == []  # 8.0 arrives as the integer 8


def test_other_kinds_are_judged_as_training_jobs_as_before():
    assert [str(p) for p in problems_of({"apiVersion": "v1", "kind": "Pod"})] == [
        "apiVersion: must be kubetrain.io/v1alpha1", "kind: must be TrainingJob"]
    assert [str(p) for p in check_sweep({"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob"})[1]] == [
        "kind: must be TrainingSweep"]
    assert [str(p) for p in check_sweep([])[1]] == ["(root): must be a mapping (a TrainingSweep manifest)"]


def test_load_sweep_takes_the_one_sweep_of_a_file(tmp_path):
    job = {"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "j"}, "spec": {}}
    both = tmp_path / "both.yaml"
    both.write_text(yaml.safe_dump_all([job, SWEEP]))
    assert load_sweep(both).metadata.name == "lr"
    assert load_job(both).metadata.name == "j"
    two = tmp_path / "two.yaml"
    two.write_text(yaml.safe_dump_all([SWEEP, SWEEP]))
    with pytest.raises(ManifestError, match="must hold exactly one TrainingSweep, found 2"):
        load_sweep(two)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(sweep(spec__parameters__0__path="optimizer")))
    with pytest.raises(ManifestError) as err:
        load_sweep(bad)
    assert [p.path for p in err.value.problems] == ["spec.parameters[0].path"]


def test_the_example_sweep_is_valid():
    assert load_sweep(REPO / "examples" / "sweep.yaml").spec.max_trials >= 1


def test_validate_command_exits_2_on_a_broken_sweep(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(sweep(spec__parameters__0__path="optimizer.lrr")))
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(SWEEP))
    assert main(["validate", str(good)]) == 0
    assert main(["validate", str(bad)]) == 2
    assert capsys.readouterr().err.startswith(f"{bad}: spec.parameters[0].path: optimizer has no field 'lrr'")


def test_a_trial_jobs_labels_and_annotations_follow_the_api_servers_rules():
    """Every trial job carries the template's metadata: a label the API server would refuse fails the sweep
    at validation, not each trial's create."""
    sweep = {"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingSweep", "metadata": {"name": "s"},
             "spec": {"template": {"metadata": {"labels": {"cost center": "x"}}, "spec": {}},
                      "parameters": [{"path": "optimizer.lr", "type": "float", "low": 0.001, "high": 0.1}]}}
    assert [str(p) for p in problems_of(sweep)] == [
        "spec.template.metadata: labels: key 'cost center' must be a label key: an optional DNS subdomain and '/', "
        "then a name of letters, digits, '-', '_' or '.' (at most 253 and 63 characters)"]
    sweep["spec"]["template"]["metadata"] = {"annotations": {"note": 3}}
    assert [str(p) for p in problems_of(sweep)] == ["spec.template.metadata: annotations must map strings to strings"]
    sweep["spec"]["template"]["metadata"] = {"labels": {"team": "a"}, "annotations": {"Note/x": "y"}, "name": "kept"}
    assert problems_of(sweep) == []
