"""Gang scheduling and topology, as pure rules: the PodGroup of each scheduling.gang (minMember,
minResources, owner), the pods' scheduler name, group label and annotation, the topology pod affinity,
and a missing PodGroup CRD as a WorkersBlocked condition with one Event and no pods (the applier
against a fake API). tests/integration/test_gang.py checks the same against a real API server and the
schedulers' own CRDs."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes.client.rest import ApiException
from support.fake_api import apis, fake_api, named

from kubetrain.core import api, contract
from kubetrain.core.api import TrainingJob
from kubetrain.operator.jobs import builders as b
from kubetrain.operator.jobs.apply import Applier, pod_group_spec
from kubetrain.operator.jobs.cache import WatchCache
from kubetrain.operator.jobs.conditions import gang_missing, refused
from kubetrain.operator.jobs.plan import Observation, Plan, plan
from kubetrain.operator.runtime.objects import owner_reference
from kubetrain.operator.runtime.settings import COSCHEDULING_SCHEDULER, parse_settings

NOW = datetime(2026, 11, 23, 12, 0, 0, tzinfo=UTC)
OWNER = owner_reference({"metadata": {"name": "llm", "uid": "u-1"}})


def job(**spec: Any) -> TrainingJob:
    return TrainingJob.model_validate({"apiVersion": api.API_VERSION, "kind": api.KIND,
                                       "metadata": {"name": "llm", "namespace": "team"}, "spec": spec})


def body(**spec: Any) -> dict[str, Any]:
    return {"apiVersion": api.API_VERSION, "kind": api.KIND, "spec": {"workers": 2, **spec}, "status": {},
            "metadata": {"name": "llm", "namespace": "team", "uid": "u-1", "generation": 1, "resourceVersion": "1"}}


# --------------------------------------------------------------------------- PodGroup and pods


@pytest.mark.parametrize(("gang", "api_version"), [("volcano", "scheduling.volcano.sh/v1beta1"),
                                                   ("coscheduling", "scheduling.x-k8s.io/v1alpha1")])
def test_the_pod_group_asks_for_every_worker_and_what_they_request_together(gang: str, api_version: str) -> None:
    j = job(workers=4, resources={"gpusPerWorker": 8, "cpu": "500m", "memory": "1.5Gi",
                                  "extra": {"example.com/fpga": "1"}}, scheduling={"gang": gang})
    pg = b.pod_group(j, OWNER)
    assert pg is not None
    assert (pg["apiVersion"], pg["kind"], pg["metadata"]["name"]) == (api_version, "PodGroup", "llm")
    assert pg["metadata"]["ownerReferences"] == [OWNER]
    assert pg["spec"] == {"minMember": 4, "minResources": {
        "cpu": "2000m", "memory": "6Gi", "nvidia.com/gpu": "32", "example.com/fpga": "4"}}


def test_min_resources_include_the_fabrics_devices_and_the_pod_templates_requests() -> None:
    template = {"spec": {"containers": [{"name": contract.CONTAINER, "resources": {"requests": {"cpu": "3"}}}]}}
    j = job(workers=2, fabric="efa", resources={"gpusPerWorker": 8}, podTemplate=template,
            scheduling={"gang": "coscheduling"})
    pg = b.pod_group(j)
    assert pg is not None
    assert pg["spec"]["minResources"] == {"cpu": "6", "hugepages-2Mi": "10240Mi", "memory": "64000Mi",
                                          "nvidia.com/gpu": "16", "vpc.amazonaws.com/efa": "64"}


def test_a_worker_without_requests_gives_no_min_resources_and_volcano_takes_the_queue() -> None:
    pg = b.pod_group(job(workers=3, scheduling={"gang": "volcano", "queue": "team-a"}))
    assert pg is not None and pg["spec"] == {"minMember": 3, "queue": "team-a"}
    pg = b.pod_group(job(workers=3, scheduling={"gang": "coscheduling", "queue": "team-a"}))
    assert pg is not None and pg["spec"] == {"minMember": 3}  # the coscheduling PodGroup has no queue
    assert b.pod_group(job(workers=3)) is None


@pytest.mark.parametrize(("quantity", "factor", "want"), [
    ("500m", 4, "2000m"), ("1.5Gi", 2, "3Gi"), ("16", 3, "48"), ("0.5", 2, "1"), ("1e3", 2, "2000"),
    ("100M", 10, "1000M"),
])
def test_quantities_scale_exactly_in_their_own_unit(quantity: str, factor: int, want: str) -> None:
    assert b.scale_quantity(quantity, factor) == want


def test_requests_of_a_native_sidecar_add_up_across_units() -> None:
    sidecar = {"name": "proxy", "image": "p", "restartPolicy": "Always",
               "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}}}
    j = job(resources={"cpu": "1", "memory": "1Gi"}, podTemplate={"spec": {"initContainers": [sidecar]}})
    assert b.worker_requests(j) == {"cpu": "1250m", "memory": "1610612736"}


@pytest.mark.parametrize(("scheduling", "settings", "want"), [
    ({"gang": "volcano"}, b.WorkerSettings(), "volcano"),
    ({"gang": "coscheduling"}, b.WorkerSettings(), "scheduler-plugins-scheduler"),
    ({"gang": "coscheduling"}, b.WorkerSettings(coscheduling_scheduler="gang-scheduler"), "gang-scheduler"),
    ({"gang": "coscheduling", "schedulerName": "mine"}, b.WorkerSettings(), "mine"),
    ({"gang": "volcano", "schedulerName": "mine"}, b.WorkerSettings(), "mine"),
    ({}, b.WorkerSettings(), None),
])
def test_gang_pods_go_to_the_gang_scheduler_unless_the_job_names_one(
        scheduling: dict[str, Any], settings: b.WorkerSettings, want: str | None) -> None:
    pod = b.worker_pod(job(workers=2, scheduling=scheduling), 1, 0, settings, OWNER)
    assert pod["spec"].get("schedulerName") == want


@pytest.mark.parametrize("gang", ["volcano", "coscheduling"])
def test_gang_pods_carry_both_group_markers_and_none_without_a_gang(gang: str) -> None:
    pod = b.worker_pod(job(workers=2, scheduling={"gang": gang}), 1, 0, b.WorkerSettings())
    assert pod["metadata"]["labels"][contract.GANG_GROUP_LABEL] == "llm"
    assert pod["metadata"]["annotations"][contract.GANG_GROUP_ANNOTATION] == "llm"
    plain = b.worker_pod(job(workers=2), 1, 0, b.WorkerSettings())
    assert contract.GANG_GROUP_LABEL not in plain["metadata"]["labels"]
    assert contract.GANG_GROUP_ANNOTATION not in plain["metadata"]["annotations"]


def test_the_coscheduling_scheduler_name_comes_from_the_operators_environment() -> None:
    assert parse_settings([], {}).builders.coscheduling_scheduler == COSCHEDULING_SCHEDULER
    env = {"KUBETRAIN_COSCHEDULING_SCHEDULER": "sp-scheduler"}
    assert parse_settings([], env).builders.coscheduling_scheduler == "sp-scheduler"


def test_every_new_generation_creates_the_pod_group_again_which_finds_it_kept() -> None:
    first = plan(Observation(body(scheduling={"gang": "coscheduling"}), [], {}, NOW), b.WorkerSettings())
    assert [o["kind"] for o in first.create].count("PodGroup") == 1
    restarted = body(scheduling={"gang": "coscheduling"})
    restarted["status"] = {"phase": "Restarting", "restartGeneration": 1, "restartCount": 1,
                           "lastFailureTime": "2026-11-23T11:00:00Z"}
    again = plan(Observation(restarted, [], {}, NOW), b.WorkerSettings())
    pods = [o for o in again.create if o["kind"] == "Pod"]
    assert [o["kind"] for o in again.create].count("PodGroup") == 1 and len(pods) == 2
    assert all(p["metadata"]["labels"][contract.LABEL_GENERATION] == "1" for p in pods)
    assert all(p["spec"]["schedulerName"] == COSCHEDULING_SCHEDULER for p in pods)


def test_a_kept_pod_group_gets_the_resized_gangs_spec_and_keeps_the_schedulers_fields() -> None:
    existing = {"spec": {"minMember": 4, "minResources": {"cpu": "4", "nvidia.com/gpu": "32"}, "queue": "default"}}
    assert pod_group_spec(existing, {"spec": {"minMember": 2, "minResources": {"cpu": "2"}}}) == {
        "minMember": 2, "minResources": {"cpu": "2"}, "queue": "default"}
    assert pod_group_spec(existing, {"spec": {"minMember": 2}}) == {"minMember": 2, "queue": "default"}
    assert pod_group_spec(existing, {"spec": {"minMember": 4, "minResources": {"cpu": "4", "nvidia.com/gpu": "32"}}}) \
        is None


def test_the_kube_schedulers_gang_gets_a_pod_group_per_generation_that_its_pods_name() -> None:
    j = job(workers=3, resources={"gpusPerWorker": 8}, scheduling={"gang": "kubernetes", "queue": "q"})
    pg = b.pod_group(j, OWNER, 2)
    assert pg == {"apiVersion": "scheduling.k8s.io/v1alpha2", "kind": "PodGroup",
                  "metadata": {"name": "llm-2", "namespace": "team", "ownerReferences": [OWNER],
                               "labels": {contract.LABEL_JOB: "llm", contract.LABEL_MANAGED_BY: "kubetrain"}},
                  "spec": {"schedulingPolicy": {"gang": {"minCount": 3}}}}
    pod = b.worker_pod(j, 1, 2, b.WorkerSettings(), OWNER)
    assert pod["spec"]["schedulingGroup"] == {"podGroupName": "llm-2"}
    assert "schedulerName" not in pod["spec"]  # the cluster's own scheduler
    assert contract.GANG_GROUP_LABEL not in pod["metadata"]["labels"]
    assert contract.GANG_GROUP_ANNOTATION not in pod["metadata"]["annotations"]
    assert "schedulingGroup" not in b.worker_pod(job(workers=3, scheduling={"gang": "volcano"}), 1, 2,
                                                 b.WorkerSettings())["spec"]
    assert b.pod_group_name(job(scheduling={"gang": "volcano"}), 2) == "llm"


def test_the_plan_of_each_generation_makes_its_own_kubernetes_pod_group() -> None:
    restarted = body(scheduling={"gang": "kubernetes"})
    restarted["status"] = {"phase": "Restarting", "restartGeneration": 4, "restartCount": 4,
                           "lastFailureTime": "2026-11-23T11:00:00Z"}
    created = plan(Observation(restarted, [], {}, NOW), b.WorkerSettings()).create
    assert [o["metadata"]["name"] for o in created if o["kind"] == "PodGroup"] == ["llm-4"]
    assert {o["spec"]["schedulingGroup"]["podGroupName"] for o in created if o["kind"] == "Pod"} == {"llm-4"}


def test_an_existing_kubernetes_pod_group_is_never_updated_its_spec_is_immutable() -> None:
    fake = fake_api()
    calls, custom = fake.calls, fake.custom
    conflict = ApiException(status=409, reason="Conflict")
    custom.fail["create_namespaced_custom_object"] = conflict
    group = {"apiVersion": "scheduling.k8s.io/v1alpha2", "kind": "PodGroup",
             "metadata": {"name": "llm-0", "namespace": "team", "ownerReferences": [{**OWNER, "uid": "u-1"}]},
             "spec": {"schedulingPolicy": {"gang": {"minCount": 5}}, "disruptionMode": "Pod"}}
    custom.get_namespaced_custom_object = lambda *_: group  # type: ignore[method-assign]
    cache = WatchCache()
    job_body = body(scheduling={"gang": "kubernetes"})
    cache.job_event("ADDED", job_body)
    applier = Applier(apis(fake), cache, 4, lambda: NOW)
    try:
        asyncio.run(applier.execute(("team", "llm"), job_body,
                                    Plan(create=plan(Observation(job_body, [], {}, NOW), b.WorkerSettings()).create)))
    finally:
        applier.close()
    assert not [c for c in calls if c[0] == "replace_namespaced_custom_object"]
    assert len([c for c in calls if c[0] == "create_namespaced_pod"]) == 2


# --------------------------------------------------------------------------- topology


def test_a_topology_key_keeps_the_generations_workers_in_one_domain() -> None:
    user = {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {"app": "cache"}}, "topologyKey": "kubernetes.io/hostname"}]},
        "nodeAffinity": {"x": 1}}
    j = job(workers=2, scheduling={"topologyKey": "example.com/rack", "affinity": user})
    affinity = b.worker_pod(j, 1, 3, b.WorkerSettings())["spec"]["affinity"]
    terms = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms[0] == user["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert terms[1] == {"topologyKey": "example.com/rack", "labelSelector": {"matchLabels": {
        contract.LABEL_JOB: "llm", contract.LABEL_ROLE: "worker", contract.LABEL_GENERATION: "3"}}}
    assert affinity["nodeAffinity"] == {"x": 1}
    assert len(user["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]) == 1  # not mutated
    pod = b.worker_pod(j, 1, 3, b.WorkerSettings())
    assert all(pod["metadata"]["labels"][k] == v for k, v in terms[1]["labelSelector"]["matchLabels"].items())


def test_without_a_topology_key_the_affinity_is_the_users() -> None:
    assert "affinity" not in b.worker_pod(job(), 0, 0, b.WorkerSettings())["spec"]
    assert b.worker_pod(job(scheduling={"affinity": {"a": 1}}), 0, 0, b.WorkerSettings())["spec"]["affinity"] == {"a": 1}


@pytest.mark.parametrize("key", ["topology.kubernetes.io/zone", "cloud.google.com/gce-topology-block", "rack"])
def test_topology_keys_are_label_keys(key: str) -> None:
    assert job(scheduling={"topologyKey": key}).spec.scheduling.topology_key == key


@pytest.mark.parametrize("key", ["", "a b", "/rack", "Example.com/rack", "x/" + "r" * 64])
def test_a_topology_key_that_is_no_label_key_is_refused(key: str) -> None:
    with pytest.raises(ValueError):
        job(scheduling={"topologyKey": key})


# --------------------------------------------------------------------------- a missing CRD


def test_a_missing_crd_is_a_workers_blocked_condition_naming_the_crd_and_the_fix() -> None:
    want = refused(gang_missing("scheduling.x-k8s.io/v1alpha1"), None)
    assert want is not None and (want.type, want.value) == (api.WORKERS_BLOCKED, True)
    assert want.reason == api.ConditionReason.GANG_SCHEDULER_MISSING
    assert "podgroups.scheduling.x-k8s.io" in want.message and "gang: none" in want.message
    assert "podgroups.scheduling.volcano.sh" in gang_missing("scheduling.volcano.sh/v1beta1")
    in_tree = gang_missing("scheduling.k8s.io/v1alpha2")
    assert "GenericWorkload" in in_tree and "GangScheduling" in in_tree and "scheduling.k8s.io/v1alpha2=true" in in_tree
    refused_pod = refused("pods is forbidden: exceeded quota", None)
    assert refused_pod is not None and refused_pod.reason == api.ConditionReason.CREATE_REJECTED


def test_the_plan_of_a_job_whose_crd_is_missing_says_so_without_a_second_event() -> None:
    message = gang_missing("scheduling.volcano.sh/v1beta1")
    p = plan(Observation(body(scheduling={"gang": "volcano"}), [], {}, NOW, create_refused=message), b.WorkerSettings())
    assert p.status is not None
    blocked = next(c for c in p.status["conditions"] if c["type"] == api.WORKERS_BLOCKED)
    assert (blocked["status"], blocked["reason"], blocked["message"]) == ("True", "GangSchedulerMissing", message)
    assert not [e for e in p.events if e[0] == "Warning"]  # the applier records it, once


def not_served() -> ApiException:
    exc = ApiException(status=404, reason="Not Found")
    exc.body = json.dumps({"message": "the server could not find the requested resource", "reason": "NotFound"})
    return exc


def test_without_the_crd_no_pod_is_created_and_one_event_is_recorded_until_it_is_installed() -> None:
    fake = fake_api()
    calls, custom = fake.calls, fake.custom
    custom.fail["create_namespaced_custom_object"] = not_served()
    cache = WatchCache()
    job_body = body(scheduling={"gang": "coscheduling"})
    cache.job_event("ADDED", job_body)
    children = plan(Observation(job_body, [], {}, NOW), b.WorkerSettings()).create
    applier = Applier(apis(fake), cache, 4, lambda: NOW)

    def execute() -> None:
        asyncio.run(applier.execute(("team", "llm"), job_body, Plan(create=children)))

    try:
        execute()
        execute()  # the retry meets the same refusal
        assert not [c for c in calls if c[0] == "create_namespaced_pod"]
        events = [c for c in calls if c[0] == "create_namespaced_event"]
        assert len(events) == 1
        assert cache.create_refused(("team", "llm")) == gang_missing("scheduling.x-k8s.io/v1alpha1")
        custom.fail.clear()  # the CRD is installed
        execute()
    finally:
        applier.close()
    assert named(calls, "create_namespaced_pod") == ["llm-worker-0", "llm-worker-1"]
    assert cache.create_refused(("team", "llm")) is None


def test_the_event_of_a_missing_crd_has_its_own_reason() -> None:
    fake = fake_api()
    core, custom = fake.core, fake.custom
    custom.fail["create_namespaced_custom_object"] = not_served()
    recorded: list[str] = []
    def record(ns: str, event: Any, **_: Any) -> SimpleNamespace:
        recorded.append(event["reason"])
        return SimpleNamespace(data=b"{}")
    core.create_namespaced_event = record  # type: ignore[method-assign]
    cache = WatchCache()
    job_body = body(scheduling={"gang": "volcano"})
    cache.job_event("ADDED", job_body)
    applier = Applier(apis(fake), cache, 4, lambda: NOW)
    try:
        asyncio.run(applier.execute(("team", "llm"), job_body,
                                    Plan(create=plan(Observation(job_body, [], {}, NOW), b.WorkerSettings()).create)))
    finally:
        applier.close()
    assert recorded == ["GangSchedulerMissing"]
