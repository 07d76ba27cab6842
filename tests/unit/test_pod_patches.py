"""kubetrain.operator.jobs.pod_patches: pod patches behind the reconcile, and the pods as plans see them meanwhile."""

from __future__ import annotations

import asyncio

from kubernetes.client.exceptions import ApiException

from kubetrain.core import contract
from kubetrain.operator.jobs.pod_facts import facts
from kubetrain.operator.jobs.pod_patches import Meta, PodPatches, overlay
from kubetrain.operator.runtime import metrics

KEY = ("ns", "j")
GEN = contract.LABEL_GENERATION
MOVED: Meta = {"labels": {GEN: "1"}}


def pod(name: str, gen: str = "0") -> dict:
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}", "resourceVersion": "7",
                         "labels": {GEN: gen, contract.LABEL_INDEX: name[-1]},
                         "annotations": {"a": "b"}},
            "spec": {}, "status": {"phase": "Running"}}


def test_the_overlay_shows_the_pending_values_on_a_copy_read_afresh():
    pods = [pod("j-worker-0"), pod("j-worker-1")]
    assert facts(pods[0]).generation == 0  # memoized under resourceVersion 7
    seen = overlay(pods, {"j-worker-0": {**MOVED, "annotations": {"c": "d"}}})
    assert seen[1] is pods[1] and overlay(pods, {}) is pods
    meta = seen[0]["metadata"]
    assert meta["labels"][GEN] == "1" and meta["annotations"] == {"a": "b", "c": "d"}
    assert "resourceVersion" not in meta and facts(seen[0]).generation == 1  # not the memo of version 7
    assert pods[0]["metadata"]["labels"][GEN] == "0"  # the cached pod untouched


def test_patches_are_pending_until_they_land_and_go_out_a_few_at_a_time():
    sent: list[str] = []
    busy, most = 0, 0

    async def send(key: tuple[str, str], name: str, meta: Meta) -> None:
        nonlocal busy, most
        busy += 1
        most = max(most, busy)
        await asyncio.sleep(0.01)
        busy -= 1
        sent.append(name)

    async def main() -> None:
        patches = PodPatches(send, lambda key: None, in_flight=2)
        patches.start(KEY, {f"j-worker-{i}": MOVED for i in range(5)})
        assert sorted(patches.pending(KEY)) == [f"j-worker-{i}" for i in range(5)] and not sent
        await patches.settled()
        assert patches.pending(KEY) == {}

    asyncio.run(main())
    assert sorted(sent) == [f"j-worker-{i}" for i in range(5)] and most == 2


def test_a_value_a_later_patch_changed_stays_pending_when_the_earlier_lands():
    gates: dict[str, asyncio.Event] = {}

    async def send(key: tuple[str, str], name: str, meta: Meta) -> None:
        await gates[meta["labels"][GEN]].wait()

    async def main() -> None:
        gates.update({"1": asyncio.Event(), "2": asyncio.Event()})
        patches = PodPatches(send, lambda key: None, 4)
        patches.start(KEY, {"j-worker-0": {**MOVED, "annotations": {"x": "y"}}})
        patches.start(KEY, {"j-worker-0": {"labels": {GEN: "2"}}})
        gates["1"].set()
        await asyncio.sleep(0.01)
        assert patches.pending(KEY) == {"j-worker-0": {"labels": {GEN: "2"}}}
        gates["2"].set()
        await patches.settled()
        assert patches.pending(KEY) == {}

    asyncio.run(main())


def test_a_failed_patch_is_counted_its_overlay_dropped_and_the_job_planned_again():
    again: list[tuple[str, str]] = []

    async def send(key: tuple[str, str], name: str, meta: Meta) -> None:
        raise ApiException(status=500, reason="etcdserver: request timed out")

    async def main() -> None:
        patches = PodPatches(send, again.append, 4)
        patches.start(KEY, {"j-worker-0": MOVED})
        await patches.settled()
        assert patches.pending(KEY) == {}

    before = metrics.RECONCILE_ERRORS.labels("ApiException")._value.get()
    asyncio.run(main())
    assert again == [KEY]
    assert metrics.RECONCILE_ERRORS.labels("ApiException")._value.get() == before + 1


def test_a_forgotten_job_has_nothing_pending():
    async def send(key: tuple[str, str], name: str, meta: Meta) -> None:
        await asyncio.sleep(0.01)

    async def main() -> None:
        patches = PodPatches(send, lambda key: None, 4)
        patches.start(KEY, {"j-worker-0": MOVED})
        patches.forget(KEY)
        assert patches.pending(KEY) == {}
        await patches.settled()

    asyncio.run(main())
