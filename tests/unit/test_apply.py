"""The applier (kubetrain.operator.jobs.apply) against a fake API that records its calls.

The integration tier runs it against a real API server; here the rules: which call creates
each kind, what order, which refusals are survived, what goes back into the cache.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from prometheus_client import REGISTRY
from pydantic import ValidationError
from support.fake_api import apis, fake_api

from kubetrain.core import api, contract
from kubetrain.operator.controller import Controller
from kubetrain.operator.jobs.apply import (
    CLAIM_MISSING,
    CREATE,
    READ,
    Apis,
    Applier,
    created_pod,
    namespace_terminating,
)
from kubetrain.operator.jobs.cache import WatchCache
from kubetrain.operator.jobs.plan import Plan
from kubetrain.operator.runtime.objects import merge_patch
from kubetrain.operator.runtime.settings import OperatorSettings, WorkerNetworkPolicy, WorkerSettings

NOW = datetime(2026, 11, 22, 12, 0, 0, tzinfo=UTC)
NS = "team"
KEY = (NS, "a")


def api_error(status: int, body: dict[str, Any] | None = None) -> ApiException:
    exc = ApiException(status=status, reason=f"HTTP {status}")
    exc.body = json.dumps(body or {"message": f"refused ({status})"})
    return exc


TERMINATING = api_error(403, {"message": "namespace team is being terminated",
                              "details": {"causes": [{"reason": "NamespaceTerminating"}]}})


OWNED = [{"apiVersion": api.API_VERSION, "kind": api.KIND, "name": "a", "uid": "u-1", "controller": True}]
"""The ownerReferences of the job's children (job_body's uid)."""


def existing(name: str, ns: str, owners: list[dict[str, Any]] = OWNED) -> dict[str, Any]:
    """The object a read answers, as a 409 found it (owned by the job unless told otherwise)."""
    return {"metadata": {"name": name, "namespace": ns, "ownerReferences": owners}}


@pytest.fixture
def fake() -> SimpleNamespace:
    fake = fake_api()
    for api_ in (fake.core, fake.rbac):
        for method in ("read_namespaced_pod", "read_namespaced_service", "read_namespaced_role"):
            api_.reply[method] = existing
    return fake


def job_body(rv: int = 1, **status: Any) -> dict[str, Any]:
    return {"apiVersion": api.API_VERSION, "kind": api.KIND, "status": status,
            "metadata": {"namespace": NS, "name": "a", "uid": "u-1", "resourceVersion": str(rv)}}


def child(kind: str, name: str, api_version: str = "v1") -> dict[str, Any]:
    labels = {contract.LABEL_JOB: "a"}
    return {"apiVersion": api_version, "kind": kind,
            "metadata": {"name": name, "namespace": NS, "labels": labels, "ownerReferences": OWNED}}


def run(fake: SimpleNamespace, plan: Plan, cache: WatchCache | None = None) -> WatchCache:
    cache = cache or WatchCache()
    if cache.job(KEY) is None:
        cache.job_event("ADDED", job_body())
    applier = Applier(apis(fake), cache, 4, lambda: NOW)

    async def carried_out() -> None:
        await applier.execute(KEY, job_body(), plan)
        await applier.patches.settled()  # the pods' patches land behind the reconcile
    try:
        asyncio.run(carried_out())
    finally:
        applier.close()
    return cache


def methods(fake: SimpleNamespace) -> list[str]:
    return [m for m, _ in fake.calls]


def test_each_kind_is_created_by_its_own_call() -> None:
    assert set(CREATE) == {"Pod", "Service", "ConfigMap", "PersistentVolumeClaim", "PodGroup", "Role", "RoleBinding",
                           "ServiceAccount", "NetworkPolicy"}


def test_a_plan_creates_every_child_with_the_call_for_its_kind(fake: SimpleNamespace) -> None:
    objs = [child("Service", "a"), child("ConfigMap", "a-config"), child("PersistentVolumeClaim", "a-checkpoints"),
            child("PodGroup", "a", "scheduling.x-k8s.io/v1alpha1"), child("Role", "a-progress", "rbac/v1"),
            child("RoleBinding", "a-progress", "rbac/v1"), child("Pod", "a-worker-0")]
    run(fake, Plan(create=objs))
    assert sorted(methods(fake)) == sorted([
        "create_namespaced_service", "create_namespaced_config_map", "create_namespaced_persistent_volume_claim",
        "create_namespaced_custom_object", "create_namespaced_role", "create_namespaced_role_binding",
        "create_namespaced_pod"])
    group = next(args for m, args in fake.calls if m == "create_namespaced_custom_object")
    assert group[:4] == ("scheduling.x-k8s.io", "v1alpha1", NS, "podgroups")
    assert methods(fake).index("create_namespaced_role") < methods(fake).index("create_namespaced_role_binding")


def test_an_unknown_kind_is_an_error_not_a_silent_skip(fake: SimpleNamespace) -> None:
    with pytest.raises(ValueError, match="Deployment"):
        run(fake, Plan(create=[child("Deployment", "a")]))


def test_a_created_pod_goes_into_the_cache_and_is_counted(fake: SimpleNamespace) -> None:
    before = REGISTRY.get_sample_value("kubetrain_operator_pods_created_total") or 0.0
    cache = run(fake, Plan(create=[child("Pod", "a-worker-0"), child("Pod", "a-worker-1")]))
    assert sorted(p["metadata"]["name"] for p in cache.pods(KEY)) == ["a-worker-0", "a-worker-1"]
    assert REGISTRY.get_sample_value("kubetrain_operator_pods_created_total") == before + 2


def test_a_pod_created_is_cached_pending_under_its_new_version_from_a_metadata_only_answer(
        fake: SimpleNamespace) -> None:
    pod = {**child("Pod", "a-worker-0"), "spec": {"restartPolicy": "OnFailure", "containers": [{"name": "c"}]}}
    cache = run(fake, Plan(create=[pod]))
    (cached,) = cache.pods(KEY)
    assert cached["metadata"]["resourceVersion"] == "5" and cached["status"] == {"phase": "Pending"}
    assert cached["spec"] == {"restartPolicy": "OnFailure"}  # what the cache keeps of the spec it sent
    sent = json.loads(json.dumps(pod))
    assert next(args[1] for m, args in fake.calls if m == "create_namespaced_pod") == sent


def test_a_whole_pod_answered_to_a_create_is_cached_as_it_is() -> None:
    whole = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "resourceVersion": "7"},
             "spec": {"nodeName": "n"}, "status": {"phase": "Running"}}
    assert created_pod({"spec": {}}, whole) is whole


def test_already_there_counts_as_created(fake: SimpleNamespace) -> None:
    fake.core.fail["create_namespaced_pod"] = api_error(409)
    fake.rbac.fail["create_namespaced_role"] = api_error(409)
    run(fake, Plan(create=[child("Pod", "a-worker-0"), child("Role", "r"), child("RoleBinding", "r")]))
    assert "create_namespaced_role_binding" in methods(fake)


def test_forbidden_progress_rbac_is_an_event_and_the_binding_is_not_tried(fake: SimpleNamespace) -> None:
    fake.rbac.fail["create_namespaced_role"] = api_error(403, {"message": "roles is forbidden"})
    run(fake, Plan(create=[child("RoleBinding", "r"), child("Role", "r"), child("Service", "a")]))
    assert "create_namespaced_role_binding" not in methods(fake)
    assert "create_namespaced_service" in methods(fake)
    event = next(args[1] for m, args in fake.calls if m == "create_namespaced_event")
    assert event["reason"] == "ProgressReportingForbidden" and "roles is forbidden" in event["message"]


def test_a_terminating_namespace_is_neither_retried_nor_reported(fake: SimpleNamespace) -> None:
    assert namespace_terminating(TERMINATING) and not namespace_terminating(api_error(403))
    fake.core.fail["create_namespaced_pod"] = TERMINATING
    run(fake, Plan(create=[child("Pod", "a-worker-0")]))
    assert "create_namespaced_event" not in methods(fake)


def test_any_other_refusal_fails_the_reconcile(fake: SimpleNamespace) -> None:
    fake.core.fail["create_namespaced_service"] = api_error(500)
    with pytest.raises(ApiException):
        run(fake, Plan(create=[child("Service", "a")]))
    fake.core.fail["create_namespaced_service"] = api_error(403)
    with pytest.raises(ApiException):
        run(fake, Plan(create=[child("Service", "a")]))


def test_a_deleted_pod_turns_terminating_and_one_already_gone_leaves_the_cache(fake: SimpleNamespace) -> None:
    cache = WatchCache()
    cache.job_event("ADDED", job_body())
    cache.pod_event("ADDED", child("Pod", "a-worker-0"))
    cache.pod_event("ADDED", child("Pod", "a-worker-1"))  # its DELETED event was missed
    fake.core.fail["delete_namespaced_pod"] = lambda name, ns: api_error(404) if name == "a-worker-1" else None
    run(fake, Plan(delete_pods=["a-worker-0", "a-worker-1"]), cache)
    assert sorted(args for m, args in fake.calls) == [("a-worker-0", NS), ("a-worker-1", NS)]
    assert cache.pod(KEY, "a-worker-0")["metadata"]["deletionTimestamp"] == "2026-11-22T12:00:00Z"
    assert cache.pod(KEY, "a-worker-1") is None
    fake.core.fail["delete_namespaced_pod"] = api_error(500)
    with pytest.raises(ApiException):
        run(fake, Plan(delete_pods=["a-worker-0"]), cache)


def test_a_failed_worker_is_deleted_before_the_kept_workers_are_patched(fake: SimpleNamespace) -> None:
    """Its successor waits for the name; a large gang's patches would hold the restart back."""
    cache = WatchCache()
    cache.job_event("ADDED", job_body())
    for i in range(3):
        cache.pod_event("ADDED", child("Pod", f"a-worker-{i}"))

    def patched(name: str, ns: str, patch: dict[str, Any]) -> SimpleNamespace:
        pod = child("Pod", name)
        pod["metadata"]["labels"].update(patch["metadata"]["labels"])
        return SimpleNamespace(data=json.dumps(pod).encode())

    fake.core.reply["patch_namespaced_pod"] = patched
    kept = {"labels": {"kubetrain.io/generation": "1"}}
    run(fake, Plan(delete_pods=["a-worker-2"], patch_pods={"a-worker-0": kept, "a-worker-1": kept}), cache)
    assert [(m, args[0]) for m, args in fake.calls][:1] == [("delete_namespaced_pod", "a-worker-2")]
    assert sorted(args[0] for m, args in fake.calls if m == "patch_namespaced_pod") == ["a-worker-0", "a-worker-1"]
    assert cache.pod(KEY, "a-worker-1")["metadata"]["labels"]["kubetrain.io/generation"] == "1"


def _deletes(fake: SimpleNamespace) -> list[tuple[str, int | None, str | None]]:
    """(pod, grace, precondition UID) of each delete made."""
    names = [args[0] for m, args in fake.calls if m == "delete_namespaced_pod"]
    bodies = [kw["body"] for m, kw in fake.core.options if m == "delete_namespaced_pod"]
    return sorted((n, b.grace_period_seconds, b.preconditions and b.preconditions.uid)
                  for n, b in zip(names, bodies, strict=True))


def test_a_pod_on_a_lost_node_is_deleted_with_grace_0(fake: SimpleNamespace) -> None:
    run(fake, Plan(delete_pods=["a-worker-0"], force_delete_pods=["a-worker-1"]))
    assert _deletes(fake) == [("a-worker-0", None, None), ("a-worker-1", 0, None)]


def test_a_pod_is_deleted_only_if_it_is_still_the_one_planned_for(fake: SimpleNamespace) -> None:
    """Worker names repeat across generations: a late delete must never take the newer namesake (409)."""
    cache = WatchCache()
    cache.job_event("ADDED", job_body())
    newer = child("Pod", "a-worker-1")
    newer["metadata"]["uid"] = "uid-new"
    cache.pod_event("ADDED", newer)
    fake.core.fail["delete_namespaced_pod"] = lambda name, ns: api_error(409) if name == "a-worker-1" else None
    run(fake, Plan(delete_pods=["a-worker-0", "a-worker-1"], pod_uids={"a-worker-0": "u0", "a-worker-1": "uid-old"}),
        cache)
    assert _deletes(fake) == [("a-worker-0", None, "u0"), ("a-worker-1", None, "uid-old")]
    assert cache.pod(KEY, "a-worker-1")["metadata"]["uid"] == "uid-new"  # kept: not the pod the delete was for
    assert "deletionTimestamp" not in cache.pod(KEY, "a-worker-1")["metadata"]


def test_a_field_dropped_inside_an_object_is_nulled_too() -> None:
    old = {"phase": "Running", "goodput": {"restartedAt": "t", "lostSeconds": 1.0}, "conditions": [{"type": "A"}]}
    new = {"phase": "Running", "goodput": {"lostSeconds": 2.0}, "conditions": []}
    assert merge_patch(old, new) == {"phase": "Running", "goodput": {"restartedAt": None, "lostSeconds": 2.0},
                                     "conditions": []}


def test_the_status_is_written_once_with_dropped_fields_nulled_and_cached(fake: SimpleNamespace) -> None:
    fake.custom.reply["patch_namespaced_custom_object_status"] = lambda *args: job_body(rv=2, phase="Running")
    cache = WatchCache()
    cache.job_event("ADDED", job_body(phase="Pending", reason="Waiting"))
    applier = Applier(apis(fake), cache, 2, lambda: NOW)
    try:
        asyncio.run(applier.execute(KEY, job_body(phase="Pending", reason="Waiting"),
                                    Plan(status={"phase": "Running"})))
    finally:
        applier.close()
    [(method, args)] = fake.calls
    assert method == "patch_namespaced_custom_object_status"
    assert args == (api.GROUP, api.VERSION, NS, api.PLURAL, "a", {"status": {"reason": None, "phase": "Running"},
                                                                   "metadata": {"resourceVersion": "1"}})
    assert cache.job(KEY)["status"] == {"phase": "Running"}


def test_a_status_write_to_a_deleted_job_forgets_it_and_does_not_bring_it_back(fake: SimpleNamespace) -> None:
    fake.custom.fail["patch_namespaced_custom_object_status"] = api_error(404)
    assert run(fake, Plan(status={"phase": "Running"})).job(KEY) is None
    fake.custom.fail.clear()
    cache = WatchCache()

    def deleted_meanwhile(*_: Any) -> dict[str, Any]:
        cache.forget(KEY)  # its DELETED event came while the patch was in flight
        return job_body(rv=2)

    fake.custom.reply["patch_namespaced_custom_object_status"] = deleted_meanwhile
    assert run(fake, Plan(status={"phase": "Running"}), cache).job(KEY) is None


def test_events_are_recorded_on_the_job_and_a_failed_one_is_only_logged(fake: SimpleNamespace) -> None:
    run(fake, Plan(events=[("Warning", "WorkerFailed", "x" * 2000), ("Normal", "Created", "ok")]))
    # Recorded together on the applier's thread pool: in either order.
    events = sorted((args[1] for m, args in fake.calls if m == "create_namespaced_event"), key=lambda e: e["type"])
    assert [(e["type"], e["reason"]) for e in events] == [("Normal", "Created"), ("Warning", "WorkerFailed")]
    assert len(events[1]["message"]) == 1024
    assert events[1]["involvedObject"]["kind"] == api.KIND and events[1]["involvedObject"]["uid"] == "u-1"
    fake.core.fail["create_namespaced_event"] = api_error(403)
    run(fake, Plan(events=[("Normal", "Created", "ok")]))


def test_deleting_the_job_tolerates_it_being_gone(fake: SimpleNamespace) -> None:
    fake.custom.fail["delete_namespaced_custom_object"] = api_error(404)
    run(fake, Plan(delete_job=True))
    assert fake.calls == [("delete_namespaced_custom_object", (api.GROUP, api.VERSION, NS, api.PLURAL, "a"))]


def test_the_claim_phase_is_missing_unknown_or_as_reported(fake: SimpleNamespace) -> None:
    def phase() -> str | None:
        applier = Applier(apis(fake), WatchCache(), 1, lambda: NOW)
        try:
            return asyncio.run(applier.claim_phase(NS, "a-checkpoints"))
        finally:
            applier.close()

    fake.core.reply["read_namespaced_persistent_volume_claim"] = lambda *_: SimpleNamespace(
        status=SimpleNamespace(phase="Bound"))
    assert phase() == "Bound"
    fake.core.reply["read_namespaced_persistent_volume_claim"] = lambda *_: SimpleNamespace(status=None)
    assert phase() == "Pending"
    fake.core.fail["read_namespaced_persistent_volume_claim"] = api_error(404)
    assert phase() == CLAIM_MISSING
    fake.core.fail["read_namespaced_persistent_volume_claim"] = api_error(403)
    assert phase() is None


def test_a_live_read_replaces_the_cached_pods_and_their_nodes(fake: SimpleNamespace) -> None:
    owner = client.V1OwnerReference(api_version=api.API_VERSION, kind=api.KIND, name="a", uid="u-1")
    live_pod = client.V1Pod(metadata=client.V1ObjectMeta(name="a-worker-0", namespace=NS, resource_version="3",
                                                         owner_references=[owner]),
                            spec=client.V1PodSpec(node_name="n1", containers=[]))
    fake.core.reply["list_namespaced_pod"] = lambda *_: client.V1PodList(items=[live_pod])
    fake.core.reply["read_node"] = lambda *_: {"status": {"conditions": [
        {"type": "Ready", "status": "False", "lastTransitionTime": "2026-11-22T11:00:00Z"}]}}
    cache = WatchCache()
    cache.job_event("ADDED", job_body())
    cache.pod_event("ADDED", child("Pod", "a-worker-1"))
    sanitize = client.ApiClient().sanitize_for_serialization
    applier = Applier(apis(fake, sanitize), cache, 2, lambda: NOW)
    try:
        assert asyncio.run(applier.refresh(KEY)) is True
        assert [p["metadata"]["name"] for p in cache.pods(KEY)] == ["a-worker-0"]
        assert cache.nodes == {"n1": datetime(2026, 11, 22, 11, 0, tzinfo=UTC)}
        assert asyncio.run(applier.refresh(KEY)) is False
    finally:
        applier.close()
    assert ("list_namespaced_pod", (NS,)) in fake.calls


QUOTA = api_error(403, {"message": 'pods "a-worker-1" is forbidden: exceeded quota: q, requested: pods=1'})


def events(fake: SimpleNamespace) -> list[tuple[str, str, str]]:
    recorded = [args[1] for m, args in fake.calls if m == "create_namespaced_event"]
    return [(e["type"], e["reason"], e["message"]) for e in recorded]


def test_a_refused_pod_create_is_kept_for_the_status_with_one_event_until_it_changes(fake: SimpleNamespace) -> None:
    fake.core.fail["create_namespaced_pod"] = lambda ns, obj, **_: QUOTA if obj["metadata"]["name"] != "a-worker-0" \
        else None
    pods = [child("Pod", "a-worker-0"), child("Pod", "a-worker-1")]
    cache = run(fake, Plan(create=pods))
    message = 'pods "a-worker-1" is forbidden: exceeded quota: q, requested: pods=1'
    assert cache.create_refused(KEY) == message
    assert [p["metadata"]["name"] for p in cache.pods(KEY)] == ["a-worker-0"]
    assert events(fake) == [("Warning", "CreateRejected", message)]
    run(fake, Plan(create=pods[1:]), cache)  # the retry meets the same refusal: no second Event
    assert len(events(fake)) == 1 and cache.create_refused(KEY) == message
    fake.core.fail["create_namespaced_pod"] = api_error(422, {"message": 'Pod "a-worker-1" is invalid: spec'})
    run(fake, Plan(create=pods[1:]), cache)
    assert cache.create_refused(KEY) == 'Pod "a-worker-1" is invalid: spec' and len(events(fake)) == 2
    fake.core.fail.clear()
    run(fake, Plan(create=pods[1:]), cache)
    assert cache.create_refused(KEY) is None and len(events(fake)) == 2


def test_of_several_refusals_the_first_in_plan_order_is_kept(fake: SimpleNamespace) -> None:
    def refuse(ns: str, obj: dict[str, Any], **_: Any) -> ApiException:
        return api_error(403, {"message": f'pods "{obj["metadata"]["name"]}" is forbidden: violates PodSecurity'})

    fake.core.fail["create_namespaced_pod"] = refuse
    cache = run(fake, Plan(create=[child("Pod", f"a-worker-{i}") for i in range(8)]))
    assert cache.create_refused(KEY) == 'pods "a-worker-0" is forbidden: violates PodSecurity'
    assert [r for _, r, _ in events(fake)] == ["CreateRejected"]


def _pod_creates(fake: SimpleNamespace) -> list[str]:
    return [args[1]["metadata"]["name"] for m, args in fake.calls if m == "create_namespaced_pod"]


def test_pods_are_created_in_batches_of_1_2_4_and_stop_at_the_first_refusal(fake: SimpleNamespace) -> None:
    """The Job controller's slow start: a quota that refuses the 4th pod is not sent the 96 after it."""
    refused = {"a-worker-3"}
    fake.core.fail["create_namespaced_pod"] = lambda ns, obj, **_: QUOTA if obj["metadata"]["name"] in refused \
        else None
    pods = [child("Pod", f"a-worker-{i}") for i in range(100)]
    cache = run(fake, Plan(create=pods))
    assert sorted(_pod_creates(fake)) == [f"a-worker-{i}" for i in range(7)]  # batches 1, 2, 4: the last refused
    assert cache.create_refused(KEY) is not None
    fake.calls.clear()
    refused.clear()
    run(fake, Plan(create=pods), cache)
    assert len(_pod_creates(fake)) == 100  # 1 + 2 + 4 + ... + 32 + the 37 left


@pytest.mark.parametrize("status", [429, 500, 503])
def test_throttling_and_server_errors_are_not_refusals_they_fail_the_reconcile(fake: SimpleNamespace,
                                                                                status: int) -> None:
    fake.core.fail["create_namespaced_pod"] = api_error(status)
    cache = WatchCache()
    with pytest.raises(ApiException):
        run(fake, Plan(create=[child("Pod", "a-worker-0")]), cache)
    assert cache.create_refused(KEY) is None and events(fake) == []


def test_a_terminating_namespace_is_no_refusal_to_report(fake: SimpleNamespace) -> None:
    fake.core.fail["create_namespaced_pod"] = TERMINATING
    assert run(fake, Plan(create=[child("Pod", "a-worker-0")])).create_refused(KEY) is None


def foreign_pod(name: str, ns: str) -> dict[str, Any]:
    return existing(name, ns, owners=[])


def test_a_name_taken_by_an_object_the_job_does_not_own_is_not_adopted(fake: SimpleNamespace) -> None:
    fake.core.fail["create_namespaced_pod"] = lambda ns, obj, **_: api_error(409) \
        if obj["metadata"]["name"] == "a-worker-1" else None
    fake.core.reply["read_namespaced_pod"] = lambda name, ns: foreign_pod(name, ns) if name == "a-worker-1" \
        else existing(name, ns)
    pods = [child("Pod", "a-worker-0"), child("Pod", "a-worker-1")]
    cache = run(fake, Plan(create=pods))
    assert cache.foreign(KEY) == "Pod a-worker-1"
    assert [p["metadata"]["name"] for p in cache.pods(KEY)] == ["a-worker-0"]  # not counted as created
    assert events(fake) == [("Warning", "ForeignObject", "Pod a-worker-1 exists and is not owned by this "
                             "TrainingJob: not adopting it; delete or rename it")]
    assert "delete_namespaced_pod" not in methods(fake)
    run(fake, Plan(create=pods[1:]), cache)  # still there on the retry: no second Event
    assert len(events(fake)) == 1
    fake.core.reply["read_namespaced_pod"] = existing  # the stranger deleted, and ours made by an earlier try
    run(fake, Plan(create=pods[1:]), cache)
    assert cache.foreign(KEY) is None and len(events(fake)) == 1


def test_an_earlier_jobs_child_being_deleted_is_waited_for(fake: SimpleNamespace) -> None:
    old = [{"apiVersion": api.API_VERSION, "kind": api.KIND, "name": "a", "uid": "u-0"}]
    fake.core.fail["create_namespaced_service"] = api_error(409)
    fake.core.reply["read_namespaced_service"] = lambda name, ns: {
        "metadata": {"name": name, "ownerReferences": old, "deletionTimestamp": "2026-11-22T11:59:59Z"}}
    cache = run(fake, Plan(create=[child("Service", "a")]))
    assert cache.foreign(KEY) == "Service a"
    assert events(fake)[0][2].endswith("not adopting it; waiting until it is deleted")


def test_a_foreign_role_stops_the_binding_to_it(fake: SimpleNamespace) -> None:
    fake.rbac.fail["create_namespaced_role"] = api_error(409)
    fake.rbac.reply["read_namespaced_role"] = foreign_pod
    cache = run(fake, Plan(create=[child("Role", "a-progress", "rbac/v1"), child("RoleBinding", "a-progress")]))
    assert "create_namespaced_role_binding" not in methods(fake) and cache.foreign(KEY) == "Role a-progress"


def test_an_owner_that_cannot_be_read_is_taken_as_ours_and_one_gone_meanwhile_is_retried(
        fake: SimpleNamespace) -> None:
    fake.core.fail["create_namespaced_pod"] = api_error(409)
    fake.core.fail["read_namespaced_pod"] = api_error(403)
    assert run(fake, Plan(create=[child("Pod", "a-worker-0")])).foreign(KEY) is None
    fake.core.fail["read_namespaced_pod"] = api_error(404)
    with pytest.raises(ApiException):
        run(fake, Plan(create=[child("Pod", "a-worker-0")]))


def test_every_child_kind_can_be_read_back_to_check_its_owner() -> None:
    assert set(READ) == set(CREATE)


def test_a_status_write_carries_the_read_resource_version_and_a_conflict_rereads_the_job(
        fake: SimpleNamespace) -> None:
    fake.custom.fail["patch_namespaced_custom_object_status"] = api_error(409)
    fake.custom.reply["get_namespaced_custom_object"] = lambda *_: job_body(rv=7, phase="Running", reason="Other")
    cache = WatchCache()
    cache.job_event("ADDED", job_body(rv=3))
    applier = Applier(apis(fake), cache, 2, lambda: NOW)
    stale = Plan(status={"phase": "Failed"}, events=[("Warning", "X", "y")], delete_job=True)
    try:
        assert asyncio.run(applier.execute(KEY, job_body(rv=3), stale)) is False
    finally:
        applier.close()
    patch = next(args for m, args in fake.calls if m == "patch_namespaced_custom_object_status")[-1]
    assert patch == {"metadata": {"resourceVersion": "3"}, "status": {"phase": "Failed"}}
    assert ("get_namespaced_custom_object", (api.GROUP, api.VERSION, NS, api.PLURAL, "a")) in fake.calls
    assert cache.job(KEY)["status"] == {"phase": "Running", "reason": "Other"}  # the fresh copy, for the next plan
    assert methods(fake) == ["patch_namespaced_custom_object_status", "get_namespaced_custom_object"]


def test_a_conflict_on_a_job_deleted_meanwhile_forgets_it(fake: SimpleNamespace) -> None:
    fake.custom.fail["patch_namespaced_custom_object_status"] = api_error(409)
    fake.custom.fail["get_namespaced_custom_object"] = api_error(404)
    assert run(fake, Plan(status={"phase": "Running"})).job(KEY) is None


def kwok_spec_job(rv: int = 1, status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {**job_body(rv), "spec": {"workers": 2, "checkpoint": {"ephemeral": True}}, "status": status or {}}


def controller(fake: SimpleNamespace, settings: OperatorSettings | None = None) -> Controller:
    """A controller whose applier calls the fake API; the job's status writes answer as the API server would."""
    ctl = Controller(client.ApiClient(), settings or OperatorSettings(), clock=lambda: NOW)
    ctl.applier.close()
    ctl.applier = Applier(apis(fake), ctl.cache, 4, lambda: NOW)

    def patched(*args: Any) -> dict[str, Any]:
        current = ctl.cache.job(KEY) or {}
        return kwok_spec_job(int(current["metadata"]["resourceVersion"]) + 1, args[-1]["status"])

    fake.custom.reply["patch_namespaced_custom_object_status"] = patched
    fake.core.reply["list_namespaced_pod"] = lambda *_, **__: SimpleNamespace(items=[
        LivePod(p) for p in ctl.cache.pods(KEY)])  # a live read finds what the cache holds
    ctl.applier.sanitize = lambda o: o.body if isinstance(o, LivePod) else o
    return ctl


class LivePod:
    """A pod as the client's LIST returns it: a model with attributes (sanitized back to its dict)."""

    def __init__(self, body: dict[str, Any]):
        self.body = body
        self.metadata = SimpleNamespace(name=body["metadata"]["name"])


def reconcile(ctl: Controller) -> float | None:
    return asyncio.run(ctl.reconcile(KEY))


def test_the_controller_shows_a_refused_create_and_retries_it_with_backoff(fake: SimpleNamespace) -> None:
    fake.core.fail["create_namespaced_pod"] = lambda ns, obj, **_: QUOTA if obj["metadata"]["name"] == "a-worker-1" \
        else None
    ctl = controller(fake)
    try:
        ctl.job_event("ADDED", kwok_spec_job())
        delays = [reconcile(ctl) for _ in range(7)]
        assert delays == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
        cond = next(c for c in ctl.cache.job(KEY)["status"]["conditions"] if c["type"] == "WorkersBlocked")
        assert (cond["status"], cond["reason"]) == ("True", "CreateRejected") and "exceeded quota" in cond["message"]
        assert [r for _, r, _ in events(fake)].count("CreateRejected") == 1
        fake.core.fail.clear()  # the quota was raised
        reconcile(ctl)
        assert ctl.cache.create_refused(KEY) is None and ctl.queue.backoff(KEY) == 2.0  # started over
    finally:
        ctl.applier.close()


def test_the_controller_shows_a_foreign_pod_and_looks_again_with_backoff(fake: SimpleNamespace) -> None:
    fake.core.fail["create_namespaced_pod"] = lambda ns, obj, **_: api_error(409) \
        if obj["metadata"]["name"] == "a-worker-1" else None
    fake.core.reply["read_namespaced_pod"] = foreign_pod
    ctl = controller(fake)
    try:
        ctl.job_event("ADDED", kwok_spec_job())
        assert [reconcile(ctl), reconcile(ctl)] == [2.0, 4.0]
        cond = next(c for c in ctl.cache.job(KEY)["status"]["conditions"] if c["type"] == "WorkersBlocked")
        assert (cond["status"], cond["reason"]) == ("True", "ForeignObject") and "a-worker-1" in cond["message"]
        assert [r for _, r, _ in events(fake)].count("ForeignObject") == 1
    finally:
        ctl.applier.close()


def test_the_controller_plans_again_at_once_from_the_job_a_conflict_reread(fake: SimpleNamespace) -> None:
    ctl = controller(fake)
    fake.custom.fail["patch_namespaced_custom_object_status"] = api_error(409)
    fake.custom.reply["get_namespaced_custom_object"] = lambda *_: kwok_spec_job(9, {"phase": "Created"})
    try:
        ctl.job_event("ADDED", kwok_spec_job(3))
        assert reconcile(ctl) == 0.0
        assert ctl.cache.job(KEY)["metadata"]["resourceVersion"] == "9"
        fake.custom.fail.clear()
        reconcile(ctl)
        patch = [args[-1] for m, args in fake.calls if m == "patch_namespaced_custom_object_status"][-1]
        assert patch["metadata"] == {"resourceVersion": "9"}
    finally:
        ctl.applier.close()


def test_a_gang_going_away_drops_what_its_creates_met(fake: SimpleNamespace) -> None:
    fake.core.fail["create_namespaced_pod"] = QUOTA
    ctl = controller(fake)
    try:
        ctl.job_event("ADDED", kwok_spec_job())
        assert reconcile(ctl) == 2.0 and ctl.cache.create_refused(KEY) is not None
        suspended = kwok_spec_job(int(ctl.cache.job(KEY)["metadata"]["resourceVersion"]) + 1,
                                  ctl.cache.job(KEY)["status"])
        suspended["spec"]["suspend"] = True
        ctl.job_event("MODIFIED", suspended)
        reconcile(ctl)
        assert ctl.cache.job(KEY)["status"]["phase"] == "Suspended"
        assert ctl.cache.create_refused(KEY) is None and ctl.queue.backoff(KEY) == 2.0
    finally:
        ctl.applier.close()


def test_a_gang_is_written_created_only_once_every_create_succeeded(fake: SimpleNamespace) -> None:
    fake.core.fail["create_namespaced_pod"] = QUOTA
    fake.custom.reply["patch_namespaced_custom_object_status"] = lambda *args: job_body(rv=2)
    plan = Plan(create=[child("Pod", "a-worker-0")], status={"phase": "Created", "gangCreated": True})
    run(fake, plan)
    patches = [args[-1]["status"] for m, args in fake.calls if m == "patch_namespaced_custom_object_status"]
    assert patches == [{"phase": "Created", "gangCreated": False}]  # a missing worker then is not a deleted one
    fake.core.fail.clear()
    run(fake, plan)
    patches = [args[-1]["status"] for m, args in fake.calls if m == "patch_namespaced_custom_object_status"]
    assert patches[-1] == {"phase": "Created", "gangCreated": True}


def old_worker(index: int, deleted_seconds_ago: float) -> dict[str, Any]:
    """A generation-0 worker being deleted since that long, as the cache holds it."""
    pod = child("Pod", f"a-worker-{index}")
    pod["metadata"]["labels"].update({contract.LABEL_INDEX: str(index), contract.LABEL_GENERATION: "0"})
    pod["metadata"].update(resourceVersion="4", deletionTimestamp=contract.format_time(
        NOW - timedelta(seconds=deleted_seconds_ago)))
    pod["status"] = {"phase": "Running"}
    return pod


def pod_lists(fake: SimpleNamespace) -> int:
    return sum(1 for m, _ in fake.calls if m == "list_namespaced_pod")


@pytest.mark.parametrize("late", [False, True])
def test_old_workers_past_their_deletion_are_confirmed_live(fake: SimpleNamespace, late: bool) -> None:
    """A watch that reconnected does not replay the deletions it missed (the fault is made here by
    never sending the DELETED events): a job must not wait for ever for pods the API no longer has."""
    ctl = controller(fake)
    fake.core.reply["list_namespaced_pod"] = lambda *_, **__: SimpleNamespace(items=[])  # the API has none left
    try:
        ctl.job_event("ADDED", kwok_spec_job(status={"phase": "Restarting", "restartGeneration": 1}))
        for i in (0, 1):
            ctl.pod_event("MODIFIED", old_worker(i, 20.0 if late else 5.0))
        reconcile(ctl)
        created = [args[1]["metadata"]["name"] for m, args in fake.calls if m == "create_namespaced_pod"]
        if not late:  # within the kubelet's time to end them: the cache is believed, no read
            assert (pod_lists(fake), created) == (0, [])
            assert ctl.cache.job(KEY)["status"]["reason"] == "DeletingOldGeneration"
            return
        assert pod_lists(fake) == 1 and ctl.cache.pods(KEY) != [] and ctl.cache.read_live(KEY) == NOW
        assert sorted(created) == ["a-worker-0", "a-worker-1"]  # the next generation, at once
    finally:
        ctl.applier.close()


def test_an_old_worker_really_stuck_is_read_live_at_most_once_per_period(fake: SimpleNamespace) -> None:
    ctl = controller(fake)  # a live read finds what the cache holds: the pods are still there
    try:
        ctl.job_event("ADDED", kwok_spec_job(status={"phase": "Restarting", "restartGeneration": 1}))
        ctl.pod_event("MODIFIED", old_worker(0, 60.0))
        reconcile(ctl)
        reconcile(ctl)
        assert pod_lists(fake) == 1
        assert ctl.cache.job(KEY)["status"]["reason"] == "DeletingOldGeneration"
        ctl.clock = lambda: NOW + timedelta(seconds=10)
        reconcile(ctl)
        assert pod_lists(fake) == 2
    finally:
        ctl.applier.close()


def test_the_operators_calls_skip_the_clients_argument_checks_and_send_the_same_request() -> None:
    cfg = client.Configuration(host="https://127.0.0.1:1", api_key={"authorization": "Bearer t"})
    api_client = client.ApiClient(cfg)
    sent: list[tuple[str, str, Any]] = []

    def request(method: str, url: str, body: str | None = None, **_: Any) -> Any:  # urllib3's, under the client
        sent.append((method, url, json.loads(body or "null")))
        status = 409 if sent[-1][2]["metadata"]["name"] == "taken" else 201
        return SimpleNamespace(status=status, reason="", data=b'{"kind": "Pod"}', headers={}, getheaders=dict)

    api_client.rest_client.pool_manager.request = request
    apis = Apis.of(api_client)
    pod = child("Pod", "a-worker-0")
    assert apis.core.create_namespaced_pod(NS, pod, _preload_content=False).data == b'{"kind": "Pod"}'
    assert sent == [("POST", "https://127.0.0.1:1/api/v1/namespaces/team/pods", pod)]
    with pytest.raises(ApiException) as refused:
        apis.core.create_namespaced_pod(NS, child("Pod", "taken"), _preload_content=False)
    assert refused.value.status == 409
    plain = client.CoreV1Api(api_client).create_namespaced_pod
    if hasattr(plain, "raw_function"):  # clients from 37 on check each call's arguments (pydantic validate_call)
        with pytest.raises(ValidationError):  # what the client checks per call, and the operator's calls do not
            plain(NS.encode(), pod, _preload_content=False)
    apis.core.create_namespaced_pod(NS.encode(), pod, _preload_content=False)


def test_a_resize_that_met_the_first_status_write_restarts_the_gang_at_its_new_size(
        fake: SimpleNamespace) -> None:
    """The spec changed between the gang's creation and its status write (409): the status of the gang
    created at the old size is written all the same, so the next plan restarts it instead of topping it
    up with a worker planned for another world size."""
    ctl = controller(fake)
    resized = kwok_spec_job(9)
    resized["spec"]["workers"] = 3
    writes: list[dict[str, Any]] = []

    def patched(*args: Any) -> dict[str, Any]:
        writes.append(args[-1])
        if len(writes) == 1:
            raise api_error(409)
        return {**resized, "metadata": {**resized["metadata"], "resourceVersion": str(9 + len(writes))},
                "status": args[-1]["status"]}

    fake.custom.reply["patch_namespaced_custom_object_status"] = patched
    fake.custom.reply["get_namespaced_custom_object"] = lambda *_: resized
    try:
        ctl.job_event("ADDED", kwok_spec_job(3))
        assert reconcile(ctl) == 0.0
        assert writes[1]["metadata"] == {"resourceVersion": "9"}
        assert (writes[1]["status"]["gangCreated"], writes[1]["status"]["workersTotal"]) == (True, 2)
        reconcile(ctl)
        created = [args[1]["metadata"] for m, args in fake.calls if m == "create_namespaced_pod"]
        assert [(c["name"], c["labels"][contract.LABEL_GENERATION]) for c in created] == [
            ("a-worker-0", "0"), ("a-worker-1", "0")]
        assert ctl.cache.job(KEY)["status"]["restartGeneration"] == 1
    finally:
        ctl.applier.close()


def test_the_jobs_service_account_exists_before_any_pod_and_a_refused_one_holds_the_pods(fake: SimpleNamespace) -> None:
    """A pod naming a ServiceAccount that does not exist yet is refused by the API server's admission."""
    plan = Plan(create=[child("Pod", "a-worker-0"), child("ServiceAccount", "a-worker"), child("Service", "a")])
    run(fake, plan)
    creates = [m for m in methods(fake) if m.startswith("create_")]
    assert creates.index("create_namespaced_service_account") < creates.index("create_namespaced_pod")
    fake.calls.clear()
    fake.core.fail["create_namespaced_service_account"] = api_error(403, {"message": "serviceaccounts is forbidden"})
    cache = run(fake, plan)  # an operator whose RBAC predates the job's ServiceAccount: said, not crashed on
    assert "create_namespaced_pod" not in methods(fake) and "create_namespaced_service" in methods(fake)
    assert cache.create_refused(KEY) == "serviceaccounts is forbidden"


def creates(fake: SimpleNamespace) -> list[str]:
    return [m for m in methods(fake) if m.startswith("create_") and m != "create_namespaced_event"]


@pytest.mark.parametrize("on", [True, False])
def test_the_jobs_network_policy_exists_before_any_pod_when_the_operator_makes_them(
        fake: SimpleNamespace, on: bool) -> None:
    policy = WorkerNetworkPolicy() if on else None
    ctl = controller(fake, OperatorSettings(builders=WorkerSettings(network_policy=policy)))
    try:
        ctl.job_event("ADDED", kwok_spec_job())
        reconcile(ctl)
    finally:
        ctl.applier.close()
    made = creates(fake)
    assert made.count("create_namespaced_pod") == 2
    if not on:
        assert "create_namespaced_network_policy" not in made
        return
    assert made.index("create_namespaced_network_policy") < made.index("create_namespaced_pod")
    sent = next(args[1] for m, args in fake.calls if m == "create_namespaced_network_policy")
    assert sent["metadata"]["name"] == "a-workers" and sent["metadata"]["ownerReferences"][0]["uid"] == "u-1"


def test_a_refused_network_policy_holds_the_pods_and_is_shown_not_crashed_on(fake: SimpleNamespace) -> None:
    """An operator set to make NetworkPolicies without the RBAC for them (rbac.create off, a trimmed Role)."""
    forbidden = 'networkpolicies.networking.k8s.io is forbidden: User "op" cannot create resource "networkpolicies"'
    fake.networking.fail["create_namespaced_network_policy"] = api_error(403, {"message": forbidden})
    plan = Plan(create=[child("Pod", "a-worker-0"), child("NetworkPolicy", "a-workers", "networking.k8s.io/v1"),
                        child("Service", "a")])
    cache = run(fake, plan)
    assert "create_namespaced_pod" not in methods(fake) and "create_namespaced_service" in methods(fake)
    assert cache.create_refused(KEY) == forbidden
    assert events(fake) == [("Warning", "CreateRejected", forbidden)]
    ctl = controller(fake, OperatorSettings(builders=WorkerSettings(network_policy=WorkerNetworkPolicy())))
    try:
        ctl.job_event("ADDED", kwok_spec_job())
        assert [reconcile(ctl) for _ in range(2)] == [2.0, 4.0]  # retried with backoff
        cond = next(c for c in ctl.cache.job(KEY)["status"]["conditions"] if c["type"] == "WorkersBlocked")
        assert (cond["status"], cond["reason"]) == ("True", "CreateRejected") and forbidden in cond["message"]
    finally:
        ctl.applier.close()


def test_a_network_policy_found_there_is_read_back_to_check_its_owner(fake: SimpleNamespace) -> None:
    fake.networking.fail["create_namespaced_network_policy"] = api_error(409)
    fake.custom.reply["get_namespaced_custom_object"] = lambda group, version, ns, plural, name: existing(name, ns)
    cache = run(fake, Plan(create=[child("NetworkPolicy", "a-workers", "networking.k8s.io/v1"),
                                   child("Pod", "a-worker-0")]))
    read = next(args for m, args in fake.calls if m == "get_namespaced_custom_object")
    assert read == ("networking.k8s.io", "v1", NS, "networkpolicies", "a-workers")
    assert cache.foreign(KEY) is None and "create_namespaced_pod" in methods(fake)
