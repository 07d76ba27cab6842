"""The operator's watch of worker pods (kubetrain.operator.jobs.pod_watch) against the real API server: what it
sees and what it does not. (A 410 Gone cannot be caused here: a young API server's watch cache still holds
every version; tests/unit/test_pod_watch_stream.py feeds the watch one.)"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kubernetes import client
from support.waiting import wait_for

from kubetrain.core import contract
from kubetrain.operator.jobs.pod_watch import Event, PodList, PodWatch

pytestmark = pytest.mark.integration


def bare_pod(name: str, job: str | None) -> dict[str, Any]:
    labels = {contract.LABEL_JOB: job} if job else {}
    return {"metadata": {"name": name, "labels": labels},
            "spec": {"containers": [{"name": "c", "image": "none"}],
                     "nodeSelector": {"kubetrain.test/nowhere": "true"}}}  # never scheduled: nothing runs


class Seen:
    """What the watch handed the event loop."""

    def __init__(self) -> None:
        self.events: list[tuple[str | None, str]] = []
        self.lists: list[list[str]] = []

    def on_events(self, events: list[Event]) -> None:
        self.events += [(kind, obj["metadata"]["name"]) for kind, obj in events]

    def on_list(self, listed: PodList) -> None:
        self.lists.append(sorted(p["metadata"]["name"] for p in listed.pods))


async def until(condition: Any, what: str, timeout: float = 20.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.05)
    assert condition(), what


def test_the_pod_watch_sees_worker_pods_only_from_the_list_on_until_stopped(
    admin_api: client.ApiClient, core_v1: client.CoreV1Api, namespace: str
) -> None:
    core_v1.create_namespaced_pod(namespace, bare_pod("j-worker-0", "j"))
    core_v1.create_namespaced_pod(namespace, bare_pod("other", None))
    seen = Seen()
    watch = PodWatch(admin_api, namespace, seen.on_events, seen.on_list)
    listed = watch.list()
    assert [p["metadata"]["name"] for p in listed.pods] == ["j-worker-0"]
    assert listed.pods[0]["kind"] == "Pod" and int(listed.resource_version) > 1

    async def watching() -> None:
        watch.start(asyncio.get_running_loop(), listed.resource_version)
        try:
            core_v1.create_namespaced_pod(namespace, bare_pod("j-worker-1", "j"))
            core_v1.delete_namespaced_pod("j-worker-0", namespace, grace_period_seconds=0)
            await until(lambda: ("DELETED", "j-worker-0") in seen.events and ("ADDED", "j-worker-1") in seen.events,
                        "the create and the delete after the list")
        finally:
            watch.stop()
    asyncio.run(watching())
    assert all(name != "other" for _, name in seen.events), seen.events
    assert ("ADDED", "j-worker-0") not in seen.events  # watched from the list's version: nothing replayed
    assert seen.lists == []
    wait_for(lambda: not watch.running(), 10, what="the watch thread to end")
