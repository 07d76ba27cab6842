"""The generated CRD applies to a real API server and its CEL rules are enforced there."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, dynamic
from kubernetes.client.rest import ApiException
from support.paths import CRD_FILE, QUICKSTART, REPO_ROOT, SWEEP_CRD_FILE
from support.resources import FIELD_MANAGER, apply, wait_established
from support.waiting import wait_for

from kubetrain.core.api import GROUP, PLURAL, SWEEP_PLURAL, VERSION
from kubetrain.core.validate import load_documents, problems_of

pytestmark = pytest.mark.integration


def load(path: Path) -> dict[str, Any]:
    if not path.exists():
        pytest.skip(f"{path.relative_to(REPO_ROOT)} does not exist yet")
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def trainingjobs(admin_api: client.ApiClient) -> Any:
    """Server-side apply the CRD, wait until it is Established, return the TrainingJob resource."""
    crd = load(CRD_FILE)
    applied = apply(admin_api, crd, FIELD_MANAGER)
    assert applied.metadata.managedFields, "server-side apply records managed fields"
    wait_established(admin_api, [crd["metadata"]["name"]])
    # Discovery may lag the Established condition a little.
    dyn = dynamic.DynamicClient(admin_api)
    return wait_for(
        lambda: dyn.resources.get(api_version="kubetrain.io/v1alpha1", kind="TrainingJob"),
        30,
        what="TrainingJob in discovery",
        ignore=(Exception,),
    )


def example_job(name: str) -> dict[str, Any]:
    job = copy.deepcopy(load(QUICKSTART))
    job["metadata"] = {"name": name}
    return job


def test_valid_training_job_is_accepted(trainingjobs: Any, namespace: str) -> None:
    job = example_job("valid")
    created = trainingjobs.server_side_apply(body=job, name="valid", namespace=namespace, field_manager=FIELD_MANAGER)
    assert created.spec.strategy == job["spec"]["strategy"]
    assert created.spec.workers == job["spec"]["workers"]


def test_deepspeed_options_without_deepspeed_strategy_are_rejected(trainingjobs: Any, namespace: str) -> None:
    job = example_job("bad-deepspeed")
    job["spec"]["strategy"] = "ddp"
    job["spec"].pop("fsdp", None)
    job["spec"]["deepspeed"] = {"zeroStage": 2}
    with pytest.raises(ApiException) as rejected:
        trainingjobs.create(body=job, namespace=namespace)
    assert rejected.value.status == 422
    assert "deepspeed options need strategy 'deepspeed'" in rejected.value.body

    # The same spec with the matching strategy passes the rule.
    job["spec"]["strategy"] = "deepspeed"
    accepted = trainingjobs.create(body=job, namespace=namespace)
    assert accepted.spec.deepspeed.zeroStage == 2


def test_overlong_name_is_rejected_with_rule_message(trainingjobs: Any, namespace: str) -> None:
    name = "x" * 51
    with pytest.raises(ApiException) as rejected:
        trainingjobs.server_side_apply(
            body=example_job(name), name=name, namespace=namespace, field_manager=FIELD_MANAGER
        )
    assert rejected.value.status == 422
    assert "metadata.name must be at most 50 characters" in rejected.value.body


MANIFESTS = REPO_ROOT / "tests" / "unit" / "manifests"
VALIDATE_ONLY = {
    "bad-kind.yaml": "a PyTorchJob, not sent to the TrainingJob resource",
    "bad-namespace.yaml": "the namespace is the request's: kubectl sends it in the URL, which the API server refuses",
    "bad-nan-free-form.yaml": "JSON has no NaN: kubectl cannot send it",
    "bad-infinite.yaml": "JSON has no infinity: kubectl cannot send it",
    "bad-not-utf8.yaml": "not a manifest kubectl can read",
    "bad-deep.yaml": "the API server nests further; `kubetrain validate` stops at 100 levels",
    "bad-pod-template-owned.yaml": "the CRD types podTemplate, kubetrain's own fields are the operator's (and the "
                                   "chart's admission policy's) to refuse",
    "bad-duplicate-key.yaml": "kubectl's strict YAML reading refuses the file: the API server, sent JSON, never sees it",
    "bad-tag.yaml": "a YAML tag is the client's reading: kubectl would send !!binary's decoded bytes; validate refuses it",
    "bad-list-item.yaml": "a List is split by kubectl, which sends each item alone (the bad item is bad-workers' case)",
}


@pytest.mark.parametrize(
    "name", sorted(p.name for p in MANIFESTS.glob("bad-*.yaml") if p.name not in VALIDATE_ONLY)
)
def test_the_api_server_refuses_what_validate_refuses(
    trainingjobs: Any, admin_api: client.ApiClient, namespace: str, name: str
) -> None:
    """The CRD and `kubetrain validate` agree: the server names each field validate names."""
    (doc,) = load_documents(MANIFESTS / name)  # read as kubectl reads YAML (1e18 is a number)
    problems = problems_of(doc)
    assert problems, f"{name} is valid to kubetrain validate"
    with pytest.raises(ApiException) as rejected:
        client.CustomObjectsApi(admin_api).create_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, doc, field_validation="Strict"
        )
    assert rejected.value.status in (400, 422), rejected.value.body
    for problem in problems:
        assert problem.path in rejected.value.body, (problem, rejected.value.body)


@pytest.mark.parametrize(("patch", "field"), [
    ({"strategy": "ddp"}, "spec.strategy"),
    ({"model": {"dModel": 512}}, "spec.model"),
    ({"command": ["python", "train.py"]}, "spec.command"),  # an optional field set afterwards
    ({"podTemplate": {"spec": {"nodeSelector": {"pool": "a"}}}}, "spec.podTemplate"),
])
def test_an_immutable_field_cannot_be_edited_but_workers_can(
    trainingjobs: Any, namespace: str, patch: dict[str, Any], field: str,
) -> None:
    name = "edit-" + field.split(".")[1].lower()
    trainingjobs.create(body=example_job(name), namespace=namespace)
    with pytest.raises(ApiException) as refused:
        trainingjobs.patch(body={"spec": patch}, name=name, namespace=namespace, content_type="application/merge-patch+json")
    assert refused.value.status == 422 and f"{field} cannot change once the job exists" in refused.value.body
    edited = trainingjobs.patch(body={"spec": {"workers": 3, "suspend": True}}, name=name, namespace=namespace,
                                content_type="application/merge-patch+json")
    assert (edited.spec.workers, edited.spec.suspend) == (3, True)


@pytest.mark.parametrize(("pod_template", "field"), [
    ({"spec": {"containers": [{"name": "trainer", "securityContext": {"privileged": "yes"}}]}},
     "spec.podTemplate.spec.containers[0].securityContext.privileged"),
    ({"spec": [1]}, "spec.podTemplate.spec"),
    ({"spec": {"containers": [{"image": "busybox"}]}}, "spec.podTemplate.spec.containers[0].name"),
    ({"spec": {"containers": [{"name": "trainer", "resources": {"limits": {"memory": "lots"}}}]}},
     "spec.podTemplate.spec.containers[0].resources.limits.memory"),
])
def test_the_api_server_types_a_pod_template_as_a_pod(
    trainingjobs: Any, namespace: str, pod_template: dict[str, Any], field: str,
) -> None:
    job = example_job("typed") | {"spec": example_job("typed")["spec"] | {"podTemplate": pod_template}}
    with pytest.raises(ApiException) as refused:
        trainingjobs.create(body=job, namespace=namespace, dry_run="All")
    assert refused.value.status == 422 and field in refused.value.body, refused.value.body


def test_a_well_typed_pod_template_is_accepted_as_written(trainingjobs: Any, namespace: str) -> None:
    pod_template = {"metadata": {"labels": {"team": "vision"}}, "spec": {
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "containers": [{"name": "trainer",
                        "resources": {"limits": {"cpu": "1500m", "memory": "4Gi", "nvidia.com/gpu": 1}},
                        "env": [{"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
                        "ports": [{"name": "debug", "containerPort": 5678}]}]}}
    job = example_job("typed-ok") | {"spec": example_job("typed-ok")["spec"] | {"podTemplate": pod_template}}
    created = trainingjobs.create(body=job, namespace=namespace).to_dict()
    assert created["spec"]["podTemplate"] == pod_template  # no default added, nothing pruned


def grid_sweep(name: str, sampler: str, high: float) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingSweep", "metadata": {"name": name},
            "spec": {"template": {"spec": {"maxSteps": 10}}, "sampler": {"type": sampler},
                     "parameters": [{"path": "maxSteps", "type": "int", "low": 1, "high": high, "step": 1},
                                    {"path": "model.nLayers", "type": "int", "low": 1, "high": 2, "step": 1}]}}


@pytest.mark.parametrize(("sampler", "high", "refused"), [
    ("grid", 1e9, True),  # two billion combinations: one object could exhaust the operator's memory
    ("grid", 5001, True),  # 10002: the product of the parameters' values counts, not each alone
    ("grid", 5000, False),  # exactly 10000
    ("random", 1e9, False),  # sampling never lists the range
])
def test_the_api_server_bounds_a_grid_sweep_as_validate_does(
    admin_api: client.ApiClient, namespace: str, sampler: str, high: float, refused: bool,
) -> None:
    crd = load(SWEEP_CRD_FILE)
    apply(admin_api, crd, FIELD_MANAGER)
    wait_established(admin_api, [crd["metadata"]["name"]])
    doc = grid_sweep(f"grid-{sampler}-{int(high)}", sampler, high)
    assert bool(problems_of(doc)) == refused
    custom = client.CustomObjectsApi(admin_api)
    if not refused:
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, SWEEP_PLURAL, doc, field_validation="Strict")
        return
    with pytest.raises(ApiException) as rejected:
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, SWEEP_PLURAL, doc, field_validation="Strict")
    assert rejected.value.status == 422, rejected.value.body
    assert "spec.parameters" in rejected.value.body
    assert "the grid sampler tries every combination of the parameters' values" in rejected.value.body


def test_the_api_server_refuses_a_sweep_parameter_over_suspend(admin_api: client.ApiClient, namespace: str) -> None:
    crd = load(SWEEP_CRD_FILE)
    apply(admin_api, crd, FIELD_MANAGER)
    wait_established(admin_api, [crd["metadata"]["name"]])
    doc = grid_sweep("tune-suspend", "random", 10)
    doc["spec"]["parameters"][0] = {"path": "suspend", "type": "categorical", "values": [True, False]}
    (problem,) = problems_of(doc)
    with pytest.raises(ApiException) as rejected:
        client.CustomObjectsApi(admin_api).create_namespaced_custom_object(
            GROUP, VERSION, namespace, SWEEP_PLURAL, doc, field_validation="Strict", dry_run="All")
    assert rejected.value.status == 422, rejected.value.body
    assert problem.path in rejected.value.body and "suspend pauses and resumes a job" in rejected.value.body


@pytest.mark.parametrize(("change", "refused"), [
    ({"queue": "team-b"}, True),  # its Workload's quota stays reserved in team-a
    ({"queue": None}, True),  # the operator would no longer finish that Workload
    ({"queue": "team-a", "priorityClassName": "high"}, False),  # the rest of scheduling stays editable
])
def test_a_jobs_queue_holds_once_set(trainingjobs: Any, namespace: str, change: dict[str, Any], refused: bool) -> None:
    name = "queued-" + "-".join(k.lower() for k in change)[:20] + ("-refused" if refused else "")
    job = example_job(name)
    job["spec"]["scheduling"] = {"queue": "team-a"}
    trainingjobs.create(body=job, namespace=namespace)
    patch = {"spec": {"scheduling": change}}
    if not refused:
        edited = trainingjobs.patch(body=patch, name=name, namespace=namespace,
                                    content_type="application/merge-patch+json")
        assert edited.spec.scheduling.priorityClassName == "high"
        return
    with pytest.raises(ApiException) as rejected:
        trainingjobs.patch(body=patch, name=name, namespace=namespace, content_type="application/merge-patch+json")
    assert rejected.value.status == 422
    assert "spec.scheduling.queue cannot change or be removed once set" in rejected.value.body


def test_a_queue_may_be_given_to_a_job_that_had_none(trainingjobs: Any, namespace: str) -> None:
    trainingjobs.create(body=example_job("queue-later"), namespace=namespace)
    edited = trainingjobs.patch(body={"spec": {"scheduling": {"queue": "team-a"}}}, name="queue-later",
                                namespace=namespace, content_type="application/merge-patch+json")
    assert edited.spec.scheduling.queue == "team-a"
