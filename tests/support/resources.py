"""Kubernetes objects as the admin: server-side apply, delete, wait until gone, CRDs Established,
a namespace ready for pods."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from kubernetes import client, dynamic
from kubernetes.client.rest import ApiException

from .waiting import wait_for

FIELD_MANAGER = "kubetrain-tests"


def apply(admin: client.ApiClient, body: dict[str, Any], field_manager: str = FIELD_MANAGER) -> Any:
    """Server-side apply ``body`` (conflicts forced); the object as the API server returned it."""
    res = dynamic.DynamicClient(admin).resources.get(api_version=body["apiVersion"], kind=body["kind"])
    return res.server_side_apply(body=body, name=body["metadata"]["name"], namespace=body["metadata"].get("namespace"),
                                 field_manager=field_manager, force_conflicts=True)


@contextmanager
def not_found_ok() -> Iterator[None]:
    """Swallow a 404 Not Found from the calls inside: for deletes of what may be gone already."""
    try:
        yield
    except ApiException as exc:
        if exc.status != 404:
            raise


def delete(admin: client.ApiClient, body: dict[str, Any]) -> None:
    """Delete the object ``body`` names; one that is not there is fine."""
    res = dynamic.DynamicClient(admin).resources.get(api_version=body["apiVersion"], kind=body["kind"])
    with not_found_ok():
        res.delete(name=body["metadata"]["name"], namespace=body["metadata"].get("namespace"))


def wait_gone(read: Callable[[], object], timeout: float = 30.0, *, what: str = "") -> None:
    """Wait until ``read()`` raises 404 Not Found."""

    def gone() -> bool:
        try:
            read()
        except ApiException as exc:
            if exc.status == 404:
                return True
            raise
        return False

    wait_for(gone, timeout, what=what or "object to be deleted")


def wait_established(admin: client.ApiClient, names: Iterable[str], timeout: float = 30.0) -> None:
    """Until each named CustomResourceDefinition is Established (its API is served). An API error counts as not
    yet (the failure names the last one): under a CI run's load one wait on CRDs just applied failed early."""
    ext = client.ApiextensionsV1Api(admin)
    for name in names:
        def established(name: str = name) -> bool:
            conditions = ext.read_custom_resource_definition(name).status.conditions or []
            return any(c.type == "Established" and c.status == "True" for c in conditions)

        wait_for(established, timeout, what=f"CRD {name} Established", ignore=(ApiException,))


def apply_crds(admin: client.ApiClient, docs: Iterable[dict[str, Any]], field_manager: str = FIELD_MANAGER,
               timeout: float = 30.0) -> None:
    """Server-side apply every CustomResourceDefinition among ``docs`` and wait until each is Established."""
    crds = [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    for crd in crds:
        apply(admin, crd, field_manager)
    wait_established(admin, [crd["metadata"]["name"] for crd in crds], timeout)


def wait_default_service_account(core: client.CoreV1Api, namespace: str, timeout: float = 30.0) -> None:
    """Until the namespace's "default" ServiceAccount exists: pods are refused before it does."""
    wait_for(lambda: core.read_namespaced_service_account("default", namespace), timeout,
             what=f"ServiceAccount {namespace}/default", ignore=(ApiException,))
