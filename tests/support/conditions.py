"""Reading Kubernetes-style conditions out of an object's status."""

from __future__ import annotations

from typing import Any


def conditions_of(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A status's conditions by type."""
    return {c["type"]: c for c in status.get("conditions") or []}


def condition(status: dict[str, Any], type_: str) -> dict[str, Any] | None:
    """The condition of this type in a status, or None."""
    return conditions_of(status).get(type_)
