"""`kubetrain validate`: exit codes and one field-path message per problem."""

from pathlib import Path

import pytest

from kubetrain.core.cli import main

MANIFESTS = Path(__file__).parent / "manifests"
REPO = Path(__file__).resolve().parents[2]

# file -> the exact line(s) `kubetrain validate` must print for it
EXPECTED = {
    "bad-workers.yaml": ["spec.workers: must be >= 1"],
    "bad-zero-stage.yaml": ["spec.deepspeed.zeroStage: must be <= 3"],
    "bad-deepspeed-with-ddp.yaml": ["spec.deepspeed: deepspeed options need strategy 'deepspeed'"],
    "bad-precision.yaml": ["spec.precision: must be one of 'fp32', 'bf16' or 'fp16'"],
    "bad-unknown-field.yaml": ["spec.checkpoint.evrySteps: unknown field"],
    "bad-heads.yaml": ["spec.model.nHeads: model.dModel must be divisible by model.nHeads"],
    "bad-kind.yaml": ["apiVersion: must be kubetrain.io/v1alpha1", "kind: must be TrainingJob"],
    "bad-offload.yaml": ["spec.deepspeed.offloadParam: deepspeed.offloadParam needs zeroStage 3"],
    "bad-name.yaml": ["metadata.name: must be a lowercase DNS label (a-z, 0-9, '-')"],
    "bad-type.yaml": ["spec.maxSteps: must be an integer"],
    "bad-fp16-deepspeed-cpu.yaml": [
        "spec.precision: precision fp16 with strategy deepspeed needs GPUs (DeepSpeed has no fp16 on CPU); use bf16"
    ],
    "bad-args-without-command.yaml": ["spec.command: args needs command (custom script mode)"],
    "bad-ephemeral-with-claim.yaml": [
        "spec.checkpoint.ephemeral: checkpoint.ephemeral cannot be combined with checkpoint.claimName "
        "(a claim is durable storage): drop one"
    ],
}


def test_every_broken_manifest_is_covered():
    assert sorted(p.name for p in MANIFESTS.glob("bad-*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_broken_manifest_exits_2_with_field_path(name, capsys):
    assert main(["validate", str(MANIFESTS / name)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"{MANIFESTS / name}: {line}" for line in EXPECTED[name]]


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_examples_are_valid(path, capsys):
    assert main(["validate", str(path)]) == 0
    assert "valid TrainingJob" in capsys.readouterr().out


def test_several_problems_in_one_manifest_are_all_reported(tmp_path, capsys):
    f = tmp_path / "many.yaml"
    f.write_text(
        "apiVersion: kubetrain.io/v1alpha1\nkind: TrainingJob\nmetadata: {name: many}\n"
        "spec: {workers: -1, maxSteps: 0, optimizer: {lr: 0}}\n"
    )
    assert main(["validate", str(f)]) == 2
    err = capsys.readouterr().err
    assert "spec.workers: must be >= 1" in err
    assert "spec.maxSteps: must be >= 1" in err
    assert "spec.optimizer.lr: must be > 0.0" in err


def test_not_yaml_and_missing_file(tmp_path, capsys):
    f = tmp_path / "broken.yaml"
    f.write_text("spec: [unclosed\n")
    assert main(["validate", str(f), str(tmp_path / "absent.yaml")]) == 2
    err = capsys.readouterr().err
    assert "not valid YAML" in err
    assert "absent.yaml: cannot read" in err
