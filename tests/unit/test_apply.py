"""The applier (kubetrain.operator.apply) against a fake API that records its calls.

The integration tier runs it against a real API server; here the rules: which call creates
each kind, what order, which refusals are survived, what goes back into the cache.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException
from prometheus_client import REGISTRY

from kubetrain.core import api, contract
from kubetrain.operator.apply import CLAIM_MISSING, CREATE, Apis, Applier, namespace_terminating
from kubetrain.operator.reconcile import Plan
from kubetrain.operator.watch_cache import WatchCache

NOW = datetime(2026, 11, 22, 12, 0, 0, tzinfo=UTC)
NS = "team"
KEY = (NS, "a")


def api_error(status: int, body: dict[str, Any] | None = None) -> ApiException:
    exc = ApiException(status=status, reason=f"HTTP {status}")
    exc.body = json.dumps(body or {"message": f"refused ({status})"})
    return exc


TERMINATING = api_error(403, {"message": "namespace team is being terminated",
                              "details": {"causes": [{"reason": "NamespaceTerminating"}]}})


class FakeApi:
    """Any method call is recorded as (method, args); `fail[method]` raises, `reply[method]` answers."""

    def __init__(self, calls: list[tuple[str, tuple[Any, ...]]]):
        self.calls = calls
        self.fail: dict[str, ApiException | Callable[..., ApiException | None]] = {}
        self.reply: dict[str, Callable[..., Any]] = {}

    def __getattr__(self, method: str) -> Callable[..., Any]:
        def call(*args: Any, **_: Any) -> Any:
            self.calls.append((method, args))
            failure = self.fail.get(method)
            exc = failure(*args) if callable(failure) else failure
            if exc is not None:
                raise exc
            return self.reply.get(method, lambda *_: None)(*args)
        return call


def created_pod(ns: str, obj: dict[str, Any]) -> SimpleNamespace:
    return SimpleNamespace(data=json.dumps({**obj, "metadata": {**obj["metadata"], "resourceVersion": "5"}}))


@pytest.fixture
def fake() -> SimpleNamespace:
    calls: list[tuple[str, tuple[Any, ...]]] = []
    core, custom, rbac = FakeApi(calls), FakeApi(calls), FakeApi(calls)
    core.reply["create_namespaced_pod"] = created_pod
    return SimpleNamespace(calls=calls, core=core, custom=custom, rbac=rbac)


def job_body(rv: int = 1, **status: Any) -> dict[str, Any]:
    return {"apiVersion": api.API_VERSION, "kind": api.KIND, "status": status,
            "metadata": {"namespace": NS, "name": "a", "uid": "u-1", "resourceVersion": str(rv)}}


def child(kind: str, name: str, api_version: str = "v1") -> dict[str, Any]:
    labels = {contract.LABEL_JOB: "a"}
    return {"apiVersion": api_version, "kind": kind, "metadata": {"name": name, "namespace": NS, "labels": labels}}


def run(fake: SimpleNamespace, plan: Plan, cache: WatchCache | None = None) -> WatchCache:
    cache = cache or WatchCache()
    if cache.job(KEY) is None:
        cache.job_event("ADDED", job_body())
    applier = Applier(Apis(fake.core, fake.custom, fake.rbac, lambda o: o), cache, 4, lambda: NOW)
    try:
        asyncio.run(applier.execute(KEY, job_body(), plan))
    finally:
        applier.close()
    return cache


def methods(fake: SimpleNamespace) -> list[str]:
    return [m for m, _ in fake.calls]


def test_each_kind_is_created_by_its_own_call() -> None:
    assert set(CREATE) == {"Pod", "Service", "ConfigMap", "PersistentVolumeClaim", "PodGroup", "Role", "RoleBinding"}


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
    assert event.reason == "ProgressReportingForbidden" and "roles is forbidden" in event.message


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


def test_deleting_a_pod_already_gone_is_fine_and_the_cached_one_turns_terminating(fake: SimpleNamespace) -> None:
    cache = WatchCache()
    cache.job_event("ADDED", job_body())
    cache.pod_event("ADDED", child("Pod", "a-worker-0"))
    fake.core.fail["delete_namespaced_pod"] = lambda name, ns: api_error(404) if name == "a-worker-1" else None
    run(fake, Plan(delete_pods=["a-worker-0", "a-worker-1"]), cache)
    assert sorted(args for m, args in fake.calls) == [("a-worker-0", NS), ("a-worker-1", NS)]
    assert cache.pod(KEY, "a-worker-0")["metadata"]["deletionTimestamp"] == "2026-11-22T12:00:00Z"
    fake.core.fail["delete_namespaced_pod"] = api_error(500)
    with pytest.raises(ApiException):
        run(fake, Plan(delete_pods=["a-worker-0"]), cache)


def test_the_status_is_written_once_with_dropped_fields_nulled_and_cached(fake: SimpleNamespace) -> None:
    fake.custom.reply["patch_namespaced_custom_object_status"] = lambda *args: job_body(rv=2, phase="Running")
    cache = WatchCache()
    cache.job_event("ADDED", job_body(phase="Pending", reason="Waiting"))
    applier = Applier(Apis(fake.core, fake.custom, fake.rbac, lambda o: o), cache, 2, lambda: NOW)
    try:
        asyncio.run(applier.execute(KEY, job_body(phase="Pending", reason="Waiting"),
                                    Plan(status={"phase": "Running"})))
    finally:
        applier.close()
    [(method, args)] = fake.calls
    assert method == "patch_namespaced_custom_object_status"
    assert args == (api.GROUP, api.VERSION, NS, api.PLURAL, "a", {"status": {"reason": None, "phase": "Running"}})
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
    events = [args[1] for m, args in fake.calls if m == "create_namespaced_event"]
    assert [(e.type, e.reason) for e in events] == [("Warning", "WorkerFailed"), ("Normal", "Created")]
    assert len(events[0].message) == 1024
    assert events[0].involved_object.kind == api.KIND and events[0].involved_object.uid == "u-1"
    fake.core.fail["create_namespaced_event"] = api_error(403)
    run(fake, Plan(events=[("Normal", "Created", "ok")]))


def test_deleting_the_job_tolerates_it_being_gone(fake: SimpleNamespace) -> None:
    fake.custom.fail["delete_namespaced_custom_object"] = api_error(404)
    run(fake, Plan(delete_job=True))
    assert fake.calls == [("delete_namespaced_custom_object", (api.GROUP, api.VERSION, NS, api.PLURAL, "a"))]


def test_the_claim_phase_is_missing_unknown_or_as_reported(fake: SimpleNamespace) -> None:
    def phase() -> str | None:
        applier = Applier(Apis(fake.core, fake.custom, fake.rbac, lambda o: o), WatchCache(), 1, lambda: NOW)
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
    live_pod = client.V1Pod(metadata=client.V1ObjectMeta(name="a-worker-0", namespace=NS, resource_version="3"),
                            spec=client.V1PodSpec(node_name="n1", containers=[]))
    fake.core.reply["list_namespaced_pod"] = lambda *_: client.V1PodList(items=[live_pod])
    fake.core.reply["read_node"] = lambda *_: {"status": {"conditions": [
        {"type": "Ready", "status": "False", "lastTransitionTime": "2026-11-22T11:00:00Z"}]}}
    cache = WatchCache()
    cache.job_event("ADDED", job_body())
    cache.pod_event("ADDED", child("Pod", "a-worker-1"))
    sanitize = client.ApiClient().sanitize_for_serialization
    applier = Applier(Apis(fake.core, fake.custom, fake.rbac, sanitize), cache, 2, lambda: NOW)
    try:
        assert asyncio.run(applier.refresh(KEY)) is True
        assert [p["metadata"]["name"] for p in cache.pods(KEY)] == ["a-worker-0"]
        assert cache.nodes == {"n1": datetime(2026, 11, 22, 11, 0, tzinfo=UTC)}
        assert asyncio.run(applier.refresh(KEY)) is False
    finally:
        applier.close()
    assert ("list_namespaced_pod", (NS,)) in fake.calls
