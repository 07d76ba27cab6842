"""The generated CRD applies to a real API server and its CEL rules are enforced there."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_cluster import REPO_ROOT, wait_for
from kubernetes import client, dynamic
from kubernetes.client.rest import ApiException

pytestmark = pytest.mark.integration

CRD_FILE = REPO_ROOT / "crds" / "kubetrain.io_trainingjobs.yaml"
EXAMPLE_FILE = REPO_ROOT / "examples" / "quickstart.yaml"
FIELD_MANAGER = "kubetrain-tests"


def load(path: Path) -> dict[str, Any]:
    if not path.exists():
        pytest.skip(f"{path.relative_to(REPO_ROOT)} does not exist yet")
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def trainingjobs(admin_api: client.ApiClient) -> Any:
    """Server-side apply the CRD, wait until it is Established, return the TrainingJob resource."""
    crd = load(CRD_FILE)
    dyn = dynamic.DynamicClient(admin_api)
    crds = dyn.resources.get(api_version="apiextensions.k8s.io/v1", kind="CustomResourceDefinition")
    applied = crds.server_side_apply(
        body=crd, name=crd["metadata"]["name"], field_manager=FIELD_MANAGER, force_conflicts=True
    )
    assert applied.metadata.managedFields, "server-side apply records managed fields"

    def established() -> bool:
        conditions = crds.get(name=crd["metadata"]["name"]).status.conditions or []
        return any(c.type == "Established" and c.status == "True" for c in conditions)

    wait_for(established, 30, what="CRD Established")
    # Discovery may lag the Established condition a little.
    dyn = dynamic.DynamicClient(admin_api)
    return wait_for(
        lambda: dyn.resources.get(api_version="kubetrain.io/v1alpha1", kind="TrainingJob"),
        30,
        what="TrainingJob in discovery",
        ignore=(Exception,),
    )


def example_job(name: str) -> dict[str, Any]:
    job = copy.deepcopy(load(EXAMPLE_FILE))
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
