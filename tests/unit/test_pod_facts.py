"""Per-pod facts (kubetrain.operator.pod_facts): read once per version of a pod, never stale."""

from __future__ import annotations

from typing import Any

import pytest

from kubetrain.core import contract
from kubetrain.core.lifecycle import WorkerPhase
from kubetrain.operator import builders as b
from kubetrain.operator import pod_facts
from kubetrain.operator.pod_facts import facts


def pod(rv: str | None, phase: str = "Running", index: int = 3) -> dict[str, Any]:
    meta: dict[str, Any] = {"namespace": "team", "name": f"j-worker-{index}",
                            "labels": {contract.LABEL_JOB: "j", b.LABEL_INDEX: str(index), b.LABEL_GENERATION: "2"}}
    if rv is not None:
        meta["resourceVersion"] = rv
    return {"metadata": meta, "spec": {"nodeName": "n1"}, "status": {"phase": phase}}


def test_a_pod_version_is_read_once_and_a_new_version_afresh() -> None:
    first = facts(pod("11"))
    assert (first.index, first.generation, first.phase, first.node, first.running) == (
        3, 2, WorkerPhase.RUNNING, "n1", True)
    assert facts(pod("11")) is first
    failed = pod("12", "Failed")
    failed["status"]["containerStatuses"] = [
        {"name": b.CONTAINER, "state": {"terminated": {"exitCode": 137, "reason": "Error"}}}]
    later = facts(failed)
    assert (later.phase, later.exit_code, later.running) == (WorkerPhase.FAILED, 137, False)


def test_a_pod_marked_deleting_under_the_same_version_is_read_again() -> None:
    """The operator marks a pod it deleted as terminating before the watch says so."""
    p = pod("21")
    assert facts(p).phase == WorkerPhase.RUNNING
    p["metadata"]["deletionTimestamp"] = "2026-11-22T12:00:00Z"
    assert (facts(p).phase, facts(p).reason) == (WorkerPhase.MISSING, "Deleted")


def test_a_pod_without_a_version_is_read_every_time() -> None:
    p = pod(None, "Pending")
    assert facts(p).pending
    p["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    assert (facts(p).pending, facts(p).ready) == (False, True)


def test_the_memo_forgets_everything_when_full(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pod_facts, "MEMO_LIMIT", 2)
    monkeypatch.setattr(pod_facts, "_memo", {})
    kept = facts(pod("31"))
    facts(pod("32"))
    facts(pod("33"))
    assert len(pod_facts._memo) == 1 and facts(pod("31")) is not kept and facts(pod("31")) == kept
