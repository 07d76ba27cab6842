"""What every controller of the operator reads or writes on any API object: keys, versions,
owners, and the one message for a child whose name another object holds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kubetrain.core.api import API_VERSION, KIND

Key = tuple[str, str]
"""(namespace, name) of an object: a TrainingJob, a TrainingSweep."""

DELETED = "DELETED"
"""The watch event type of a deletion (other types, and None for a LIST, all mean "as it is now")."""


def namespace_of(key: Key) -> str:
    """The namespace of a key: what the work queues share their workers fairly between."""
    return key[0]


def in_scope(namespace: str, scope: str | None) -> bool:
    """Whether an object in `namespace` is one a LIST or watch over `scope` (a namespace; None: the cluster)
    shows."""
    return scope is None or namespace == scope


def version_number(version: str | None) -> int:
    """A resourceVersion as a number (0 when absent or not one): which of two is newer."""
    try:
        return int(version or 0)
    except ValueError:
        return 0


def resource_version(obj: dict[str, Any]) -> int:
    """metadata.resourceVersion as a number (0 when absent): which of two copies is newer."""
    return version_number(obj.get("metadata", {}).get("resourceVersion"))


def slim(obj: dict[str, Any]) -> dict[str, Any]:
    """The object without metadata.managedFields, which the operator never reads: with a thousand jobs'
    pods, the field managers' bookkeeping was a good part of the operator's memory. In place: the
    cache owns what it is given."""
    (obj.get("metadata") or {}).pop("managedFields", None)
    return obj


def uid_of(obj: dict[str, Any]) -> str | None:
    return (obj.get("metadata") or {}).get("uid")


def owned_by(obj: dict[str, Any], uid: str | None) -> bool:
    """Whether `obj`'s ownerReferences name the owner with that uid (True when the uid is unknown)."""
    if not uid:
        return True
    return any(ref.get("uid") == uid for ref in (obj.get("metadata") or {}).get("ownerReferences") or [])


def owner_reference(obj: dict[str, Any]) -> dict[str, Any]:
    """The controller reference of a TrainingJob's children (pods, Service, claim, Workload) to it."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": obj["metadata"]["name"],
        "uid": obj["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def foreign_message(kind: str, name: str, existing: dict[str, Any]) -> str:
    why = "waiting until it is deleted" if (existing.get("metadata") or {}).get("deletionTimestamp") \
        else "delete or rename it"
    return f"{kind} {name} exists and is not owned by this TrainingJob: not adopting it; {why}"


MAX_RETRY_AFTER = 300.0
"""The longest Retry-After honoured (seconds): a larger one is read as this."""


def retry_after(exc: Exception) -> float | None:
    """Seconds the API server asked to wait before the next try (a 429 or 503 with Retry-After: API Priority
    and Fairness, a server shutting down); None when it did not say."""
    if getattr(exc, "status", None) not in (429, 503):
        return None
    value = (getattr(exc, "headers", None) or {}).get("Retry-After")
    try:
        return min(max(float(value), 0.0), MAX_RETRY_AFTER) if value is not None else None
    except ValueError:  # an HTTP date: rare from an API server; the backoff applies
        return None


LIST_PAGE = 500
"""Objects per page of a LIST (`limit`): the API server answers a big cluster's in bounded pieces."""


def list_pages(call: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[list[dict[str, Any]], str]:
    """Every item of a paginated LIST (`call` answers a plain dict, or a model turned into one by `sanitize=`),
    and the version of the snapshot its pages come from."""
    sanitize: Callable[[Any], dict[str, Any]] = kwargs.pop("sanitize", lambda x: x)
    items: list[dict[str, Any]] = []
    token: str | None = None
    while True:
        page = sanitize(call(*args, limit=LIST_PAGE, **({"_continue": token} if token else {}), **kwargs))
        items.extend(page.get("items") or [])
        meta = page.get("metadata") or {}
        token = meta.get("continue")
        if not token:
            return items, str(meta.get("resourceVersion") or "0")


def merge_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns `old` into `new`: a key `new` lacks is set to null, in nested
    objects too (goodput.restartedAt once the new generation stepped), where a merge would keep the old one."""
    out: dict[str, Any] = {k: None for k in old if k not in new}
    for k, v in new.items():
        was = old.get(k)
        out[k] = merge_patch(was, v) if isinstance(v, dict) and isinstance(was, dict) else v
    return out
