"""The CRD is generated from the models, structural, and in sync with crds/."""

from pathlib import Path

import yaml

from kubetrain.core import api
from kubetrain.core.cli import main
from kubetrain.core.crd import crd, crd_yaml

REPO = Path(__file__).resolve().parents[2]


def test_crds_dir_matches_models(capsys):
    committed = (REPO / "crds" / "kubetrain.io_trainingjobs.yaml").read_text()
    assert main(["crd"]) == 0
    assert capsys.readouterr().out == committed, "crds/ drifted from kubetrain.core.api: run `make crds`"


def _walk(node, path="$"):
    yield path, node
    for key, sub in node.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural():
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        assert "type" in node, f"{path} has no type"
        for banned in ("$ref", "anyOf", "oneOf", "allOf", "title", "const"):
            assert banned not in node, f"{path} has {banned}"
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node
        if node.get("properties"):
            assert "additionalProperties" not in node, f"{path}: properties and additionalProperties"


def test_every_spec_field_is_documented():
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    fields = [(p, n) for p, n in _walk(schema["properties"]["spec"], "spec") if not p.endswith(("[]", "{}"))]
    undocumented = [p for p, n in fields if not n.get("description")]
    assert undocumented == []


def test_names_columns_status_and_defaults():
    obj = yaml.safe_load(crd_yaml())
    spec = obj["spec"]
    assert obj["metadata"]["name"] == "trainingjobs.kubetrain.io"
    assert spec["names"]["shortNames"] == ["tj", "tjob"]
    version = spec["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Phase"] == ".status.phase"
    assert columns["Workers"] == ".status.workersSummary"
    assert columns["Step"] == ".status.currentStep"
    assert columns["Restarts"] == ".status.restartCount"
    props = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert props["workers"]["default"] == 1 and props["workers"]["minimum"] == 1
    assert props["deepspeed"]["properties"]["zeroStage"]["maximum"] == 3
    assert props["strategy"]["enum"] == ["ddp", "fsdp", "deepspeed"]
    assert props["checkpoint"]["default"] == {}
    assert props["checkpoint"]["properties"]["everySteps"]["default"] == 50


def test_cel_rules_come_from_the_shared_rule_list():
    version = crd()["spec"]["versions"][0]
    rules = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["x-kubernetes-validations"]
    assert [(r["rule"], r["message"]) for r in rules] == [(r.cel, r.message) for r in api.SPEC_RULES]
