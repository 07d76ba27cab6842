"""The CRD is generated from the models, structural, and in sync with crds/."""

import json
import os
import re
import runpy
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from support.builds import shown

from kubetrain.core import api
from kubetrain.core.cli import main
from kubetrain.core.crd import crd, crd_yaml, pod_template_source, sweep_crd

REPO = Path(__file__).resolve().parents[2]


def test_crds_dir_matches_models(capsys):
    committed = (REPO / "crds" / "kubetrain.io_trainingjobs.yaml").read_text()
    assert main(["crd"]) == 0
    assert capsys.readouterr().out == committed, "crds/ drifted from kubetrain.core.api: run `make crds`"


def _walk(node, path="$"):
    """Every node of kubetrain's own schema; a podTemplate's inside is core/v1's (see _walk_pod_template)."""
    yield path, node
    if path.endswith(".podTemplate"):
        return
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


def _walk_pod_template(node, path):
    yield path, node
    for key, sub in node.get("properties", {}).items():
        yield from _walk_pod_template(sub, f"{path}.{key}")
    for key, suffix in (("items", "[]"), ("additionalProperties", "{}")):
        if isinstance(node.get(key), dict):
            yield from _walk_pod_template(node[key], path + suffix)


@pytest.mark.parametrize("where", ["job", "sweep"])
def test_the_pod_template_is_core_v1s_pod_template_spec_structural(where):
    """The API server types a podTemplate as it types a pod: every node typed (int-or-string and quantities
    by their marker), list-map keys required, nothing required at the top (a podTemplate is partial)."""
    spec = _spec_schema() if where == "job" else \
        _sweep_schema()["properties"]["spec"]["properties"]["template"]["properties"]["spec"]
    tpl = spec["properties"]["podTemplate"]
    assert tpl["description"]
    if where == "job":  # a sweep's whole template cannot change
        assert any(r["rule"] == "self == oldSelf" for r in tpl["x-kubernetes-validations"])
    nodes = dict(_walk_pod_template(tpl, "podTemplate"))
    for path, node in nodes.items():
        assert "type" in node or node.get("x-kubernetes-int-or-string") is True, f"{path} has no type"
        for banned in ("$ref", "anyOf", "oneOf", "allOf", "default", "description", "format"):
            assert banned not in node or path == "podTemplate", f"{path} has {banned}"
        if node.get("properties"):
            assert "additionalProperties" not in node, f"{path}: properties and additionalProperties"
        if node.get("x-kubernetes-list-type") == "map":
            assert set(node["x-kubernetes-list-map-keys"]) <= set(node["items"]["required"]), path
    pod = tpl["properties"]["spec"]
    assert "required" not in pod and "required" not in tpl
    containers = pod["properties"]["containers"]
    assert containers["type"] == "array" and containers["items"]["type"] == "object"
    assert containers["items"]["required"] == ["name"] and containers["x-kubernetes-list-map-keys"] == ["name"]
    container = containers["items"]["properties"]
    assert container["securityContext"]["properties"]["privileged"] == {"type": "boolean"}
    assert container["image"] == {"type": "string"}
    assert container["resources"]["properties"]["limits"]["additionalProperties"]["x-kubernetes-int-or-string"]
    assert nodes["podTemplate.spec.containers[].ports[].containerPort"]["type"] == "integer"
    assert nodes["podTemplate.spec.containers[].livenessProbe.httpGet.port"] == {"x-kubernetes-int-or-string": True}
    assert nodes["podTemplate.spec.tolerations[]"]["type"] == "object"
    assert nodes["podTemplate.metadata.labels"] == {"type": "object", "additionalProperties": {"type": "string"}}
    assert pod_template_source()["kubernetesVersion"].startswith("v1.")


def download_k8s_module(version: str, source: Path) -> None:
    """The k8s.io/kubernetes module into the Go module cache (a fresh machine's unit tier can run before the
    background build fetched it); skipped without Go, except under CI, where the check must run."""
    if shutil.which("go") is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{source} is not in the Go module cache and Go is not on PATH")
        pytest.skip(f"{source} is not in the Go module cache and Go is not on PATH to download it")
    with shown(f"downloading k8s.io/kubernetes@{version} into the Go module cache (hack/k8s/go.mod)"):
        subprocess.run(["go", "mod", "download", f"k8s.io/kubernetes@{version}"], cwd=REPO / "hack" / "k8s",
                       check=True, timeout=600)
    assert source.exists(), f"go mod download did not write {source}"


def test_the_committed_pod_template_schema_is_what_hack_writes_from_its_source():
    script = runpy.run_path(str(REPO / "hack" / "podspec-schema.py"), run_name="podspec_schema")
    version = script["k8s_version"]()
    source = script["default_source"](version)
    if not source.exists():
        download_k8s_module(version, source)
    schemas = json.loads(source.read_text())["components"]["schemas"]
    assert script["pod_template_schema"](schemas) == pod_template_source()["schema"], \
        "core/src/kubetrain/core/podspec_schema.json drifted: run hack/podspec-schema.py and `make crds`"
    assert pod_template_source()["kubernetesVersion"] == script["k8s_version"]()


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
    rules = [r for r in rules if "oldSelf" not in r["rule"]]  # transition rules: see below
    assert [(r["rule"], r["message"]) for r in rules] == [(r.cel, r.message) for r in api.SPEC_RULES]


def test_every_spec_field_but_the_editable_ones_is_immutable():
    props = _spec_schema()["properties"]
    immutable = {name for name, p in props.items()
                 if any(v["rule"] == "self == oldSelf" for v in p.get("x-kubernetes-validations", []))}
    assert immutable == set(props) - set(api.MUTABLE_SPEC_FIELDS)
    assert {"strategy", "model", "checkpoint", "podTemplate", "maxSteps"} <= immutable
    optional = [v["rule"] for v in _spec_schema()["x-kubernetes-validations"] if "oldSelf" in v["rule"]]
    assert "has(self.podTemplate) == has(oldSelf.podTemplate)" in optional


def _spec_schema():
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def test_every_count_and_duration_has_a_maximum():
    """No accepted value overflows later (timedelta, 2**n backoff) or leaves int64."""
    numbers = [(p, n) for p, n in _walk(_spec_schema(), "spec") if n["type"] in ("integer", "number")]
    unbounded = [p for p, n in numbers if "maximum" not in n and (n["type"] == "integer" or p.endswith("Seconds"))]
    assert unbounded == []
    props = _spec_schema()["properties"]
    assert props["activeDeadlineSeconds"]["maximum"] == api.MAX_DEADLINE_SECONDS == 365 * 24 * 3600
    assert props["restartPolicy"]["properties"]["maxBackoffSeconds"]["maximum"] == api.MAX_BACKOFF_SECONDS == 24 * 3600


def test_the_longest_name_with_the_most_workers_gives_hostnames_within_63_characters():
    longest = api.ObjectMeta(name="x" * 50).name
    with pytest.raises(ValidationError):
        api.ObjectMeta(name=longest + "x")
    assert len(f"{longest}-worker-{api.MAX_WORKERS - 1}") <= 63


def test_name_rule_in_cel_and_in_python_agree():
    root_rules = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["x-kubernetes-validations"]
    assert f"self.metadata.name.matches('{api.JOB_NAME_PATTERN}')" in [r["rule"] for r in root_rules]
    for name in ["job", "a", "job-1", "1job", "9", "team.job", "-job", "job-", "Job", "j-0-b"]:
        cel_accepts = re.fullmatch(api.JOB_NAME_PATTERN, name) is not None
        try:
            api.ObjectMeta(name=name)
            python_accepts = True
        except ValidationError:
            python_accepts = False
        assert cel_accepts == python_accepts, name


# --------------------------------------------------------------------------- TrainingSweep

UNTYPED_SWEEP_NODES = {"$.spec.parameters[].values[]", "$.status.trials[].params{}", "$.status.bestParams{}"}
"""A parameter's value is a number, string or boolean (the type of the field it sets): any JSON value."""


def _sweep_schema():
    return sweep_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_sweep_crd_in_crds_dir_matches_models(capsys):
    committed = (REPO / "crds" / "kubetrain.io_trainingsweeps.yaml").read_text()
    assert main(["crd", "--kind", "TrainingSweep"]) == 0
    assert capsys.readouterr().out == committed, "crds/ drifted from kubetrain.core.api: run `make crds`"


def test_sweep_schema_is_structural_but_for_parameter_values():
    untyped = set()
    for path, node in _walk(_sweep_schema()):
        if "type" not in node:
            untyped.add(path)
            assert node == {"x-kubernetes-preserve-unknown-fields": True, "description": "A number, string or boolean."}
        for banned in ("$ref", "anyOf", "oneOf", "allOf", "title", "const"):
            assert banned not in node, f"{path} has {banned}"
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node
        if node.get("properties"):
            assert "additionalProperties" not in node, f"{path}: properties and additionalProperties"
    assert untyped == UNTYPED_SWEEP_NODES


def test_every_sweep_spec_field_is_documented():
    fields = [(p, n) for p, n in _walk(_sweep_schema()["properties"]["spec"], "spec") if not p.endswith(("[]", "{}"))]
    assert [p for p, n in fields if not n.get("description")] == []
    assert len(fields) > len(api.TrainingSweepSpec.model_fields)  # nested fields (the template's) are walked too


def test_sweep_cel_rules_come_from_the_shared_rule_lists():
    spec = _sweep_schema()["properties"]["spec"]
    rules = [r for r in spec["x-kubernetes-validations"] if "oldSelf" not in r["rule"]]
    assert [(r["rule"], r["message"]) for r in rules] == [(r.cel, r.message) for r in api.SWEEP_RULES if r.cel]
    per_parameter = spec["properties"]["parameters"]["items"]["x-kubernetes-validations"]
    assert [(r["rule"], r["message"]) for r in per_parameter] == [
        (r.cel, r.message) for r in api.PARAMETER_RULES if r.cel]
    template = spec["properties"]["template"]["properties"]["spec"]["x-kubernetes-validations"]
    assert [(r["rule"], r["message"]) for r in template] == [(r.cel, r.message) for r in api.SPEC_RULES]


def test_sweep_names_columns_and_editable_fields():
    obj = yaml.safe_load(crd_yaml(api.SWEEP_KIND))
    assert obj["metadata"]["name"] == "trainingsweeps.kubetrain.io"
    assert obj["spec"]["names"]["shortNames"] == api.SWEEP_SHORT_NAMES
    version = obj["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Trials"] == ".status.trialsSummary" and columns["Best"] == ".status.bestValue"
    props = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    immutable = {name for name, p in props.items()
                 if any(v["rule"] == "self == oldSelf" for v in p.get("x-kubernetes-validations", []))}
    assert immutable == set(props) - set(api.SWEEP_MUTABLE_SPEC_FIELDS)
