"""The API groups the applier calls (kubetrain.operator.jobs.apply.Apis), faked: every call recorded.

For the rules of the applier alone (which call creates each kind, in what order, which refusals it
survives); the integration tier runs the same applier against a real API server.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, cast

from kubernetes.client.rest import ApiException

from kubetrain.operator.jobs.apply import PATHS, Apis


class FakeApi:
    """Any method call is recorded as (method, args); `fail[method]` raises, `reply[method]` answers."""

    def __init__(self, calls: list[tuple[str, tuple[Any, ...]]]):
        self.calls = calls
        self.fail: dict[str, ApiException | Callable[..., ApiException | None]] = {}
        self.reply: dict[str, Callable[..., Any]] = {}
        self.options: list[tuple[str, dict[str, Any]]] = []
        """(method, keyword arguments) of every call."""

    def __getattr__(self, method: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((method, args))
            self.options.append((method, kwargs))
            failure = self.fail.get(method)
            exc = failure(*args) if callable(failure) else failure
            if exc is not None:
                raise exc
            unparsed = kwargs.get("_preload_content") is False  # the caller reads .data, or nothing
            return self.reply.get(method, lambda *_: Unparsed(b"{}") if unparsed else None)(*args)
        return call


class Unparsed:
    """An answer asked for with `_preload_content=False`, as urllib3 gives it: `.data` or `.read()`."""

    def __init__(self, data: bytes | str) -> None:
        self.data = data

    def read(self) -> bytes | str:
        return self.data


def metadata_answer(ns: str, obj: dict[str, Any]) -> Unparsed:
    """A pod create's answer as the API server gives it when asked for metadata only."""
    meta = {**obj["metadata"], "resourceVersion": "5"}
    return Unparsed(json.dumps({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata", "metadata": meta}))


POSTED = {"Pod": ("core", "create_namespaced_pod"), "Service": ("core", "create_namespaced_service"),
          "ConfigMap": ("core", "create_namespaced_config_map"),
          "ServiceAccount": ("core", "create_namespaced_service_account"),
          "PersistentVolumeClaim": ("core", "create_namespaced_persistent_volume_claim"),
          "Role": ("rbac", "create_namespaced_role"), "RoleBinding": ("rbac", "create_namespaced_role_binding"),
          "NetworkPolicy": ("networking", "create_namespaced_network_policy"),
          "Event": ("core", "create_namespaced_event")}
"""Apis.post's calls, by kind, as the kubernetes client's call that makes the same request."""


def posting(fake: SimpleNamespace) -> Callable[[str, dict[str, str], bytes, str], bytes]:
    """Apis.post onto the fake's call that makes the same request, recorded with the body as the API
    server reads it."""
    def post(path: str, params: dict[str, str], body: bytes, accept: str) -> bytes:
        group, method = POSTED[next(kind for kind, p in PATHS.items() if p == path)]
        assert "PartialObjectMetadata" in accept
        answer = getattr(getattr(fake, group), method)(params["namespace"], json.loads(body), _preload_content=False)
        return cast(bytes, answer.data)
    return post


def fake_api() -> SimpleNamespace:
    """core, custom, rbac and networking (POSTs only) recording into one `calls`; pod creates answered as the
    API server would."""
    calls: list[tuple[str, tuple[Any, ...]]] = []
    core, custom, rbac, networking = FakeApi(calls), FakeApi(calls), FakeApi(calls), FakeApi(calls)
    core.reply["create_namespaced_pod"] = metadata_answer
    return SimpleNamespace(calls=calls, core=core, custom=custom, rbac=rbac, networking=networking)


def apis(fake: SimpleNamespace, sanitize: Callable[[Any], Any] = lambda o: o) -> Apis:
    return Apis(fake.core, fake.custom, fake.rbac, sanitize, posting(fake))


def named(calls: list[tuple[str, tuple[Any, ...]]], method: str) -> list[str]:
    """The names of the objects `method` was given, in the order of the calls."""
    out = []
    for m, args in calls:
        if m == method:
            obj = next((a for a in args if isinstance(a, dict)), {})
            meta = obj.get("metadata") or {}
            out.append(meta.get("name") or meta.get("generateName") or "")
    return out
