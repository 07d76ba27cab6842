"""The pod watch (kubetrain.operator.jobs.pod_watch): reading its stream, and starting over after 410 Gone and
errors; tests/integration/test_pod_watch.py runs it against a real API server."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from prometheus_client import REGISTRY

from kubetrain.operator.jobs.pod_watch import Event, Expired, PodList, PodWatch, _lines, events_of


def line(kind: str, obj: dict[str, Any]) -> bytes:
    return json.dumps({"type": kind, "object": obj}).encode()


def pod(name: str, rv: str) -> dict[str, Any]:
    return {"kind": "Pod", "metadata": {"name": name, "resourceVersion": rv}}


def test_events_come_out_in_order_and_a_bookmark_only_moves_the_version_on() -> None:
    events, version = events_of([line("ADDED", pod("a", "3")), b"", line("MODIFIED", pod("a", "4")),
                                 line("DELETED", pod("b", "5")), line("BOOKMARK", pod("", "9"))])
    assert [(kind, obj["metadata"]["name"]) for kind, obj in events] == [("ADDED", "a"), ("MODIFIED", "a"),
                                                                         ("DELETED", "b")]
    assert version == "9"
    assert events_of([]) == ([], None)


def test_410_means_list_again_and_any_other_error_event_is_an_error() -> None:
    gone = {"kind": "Status", "code": 410, "message": "too old resource version: 1 (2000)"}
    with pytest.raises(Expired, match="too old"):
        events_of([line("ADDED", pod("a", "3")), line("ERROR", gone)])
    with pytest.raises(RuntimeError, match="watch error 500: etcd"):
        events_of([line("ERROR", {"kind": "Status", "code": 500, "message": "etcd"})])


def test_a_line_split_over_chunks_comes_out_whole_with_the_chunk_that_ends_it() -> None:
    first, second = line("ADDED", pod("a", "3")), line("ADDED", pod("b", "4"))
    chunks = [first[:10], first[10:] + b"\n" + second[:5], second[5:] + b"\n"]
    assert list(_lines(iter(chunks))) == [[first], [second]]
    assert list(_lines(iter([first]))) == []  # no newline yet: nothing complete


class Answer:
    """One scripted answer of the API server: a LIST's body, or a watch's stream of chunks."""

    def __init__(self, *chunks: bytes, data: bytes = b"") -> None:
        self.chunks, self.data = chunks, data

    def stream(self, _amount: int) -> Any:
        return iter(self.chunks)

    def release_conn(self) -> None: ...

    def close(self) -> None: ...

    def shutdown(self) -> None: ...


class Scripted(PodWatch):
    """A PodWatch whose API server is a script. A fake, because a 410 Gone cannot be caused on the test
    cluster: a young API server's watch cache still holds every version."""

    def __init__(self, *answers: Answer | ApiException) -> None:
        self.seen: list[tuple[str | None, str]] = []
        self.lists: list[list[str]] = []
        self.requests: list[str] = []
        self.answers = list(answers)
        super().__init__(client.ApiClient(), "team", self.on_events, self.on_list)

    def on_events(self, events: list[Event]) -> None:
        self.seen += [(kind, obj["metadata"]["name"]) for kind, obj in events]

    def on_list(self, listed: PodList) -> None:
        self.lists.append([p["metadata"]["name"] for p in listed.pods])

    def _request(self, **kwargs: Any) -> Any:
        self.requests.append(kwargs["resource_version"] if kwargs.get("watch") else "LIST")
        answer = self.answers.pop(0) if self.answers else None
        if answer is None:
            self.stop()
            raise RuntimeError("end of the script")
        if isinstance(answer, ApiException):
            raise answer
        return answer


def restarts(reason: str) -> float:
    return REGISTRY.get_sample_value("kubetrain_operator_pod_watch_restarts_total", {"reason": reason}) or 0.0


def test_the_watch_lists_again_after_410_carries_on_from_the_last_version_and_outlives_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("kubetrain.operator.jobs.pod_watch.BACKOFF", (0.01, 0.02))
    gone = {"kind": "Status", "code": 410, "message": "too old resource version: 5 (90)"}
    listing = json.dumps({"metadata": {"resourceVersion": "20"}, "items": [pod("b", "19")]}).encode()
    watch = Scripted(
        Answer(line("ADDED", pod("a", "6")) + b"\n" + line("ERROR", gone) + b"\n"),
        Answer(data=listing),
        Answer(line("ADDED", pod("c", "21")) + b"\n", line("BOOKMARK", pod("", "30")) + b"\n"),  # ends: timed out
        ApiException(status=500, reason="Internal Server Error"),
        ApiException(status=410, reason="Gone"),
        Answer(data=listing),
    )
    before = {reason: restarts(reason) for reason in ("expired", "error")}

    async def run() -> None:
        watch.start(asyncio.get_running_loop(), "5")
        async with asyncio.timeout(10):
            while watch.running():
                await asyncio.sleep(0.01)
        await asyncio.sleep(0)  # what the thread handed over last
    asyncio.run(run())
    assert watch.requests == ["5", "LIST", "20", "30", "30", "LIST", "20"]
    assert watch.seen == [("ADDED", "c")]  # a's event came with the 410: the new LIST tells of every pod
    assert watch.lists == [["b"], ["b"]]
    assert (restarts("expired"), restarts("error")) == (before["expired"] + 2, before["error"] + 1)


class CountingLoop:
    """Records the watch's wake-ups of the event loop."""

    def __init__(self) -> None:
        self.wakeups: list[Any] = []

    def call_soon_threadsafe(self, callback: Any) -> None:
        self.wakeups.append(callback)


def test_batches_handed_over_before_the_loop_drains_wake_it_once_and_arrive_in_order() -> None:
    watch = Scripted()
    loop = CountingLoop()
    watch._loop = loop  # the one method of the loop the watch calls
    watch._hand_over(watch.on_events, [("ADDED", pod("a", "1"))])
    watch._hand_over(watch.on_list, PodList([pod("a", "2")], "2"))
    watch._hand_over(watch.on_events, [("MODIFIED", pod("a", "3")), ("DELETED", pod("a", "4"))])
    assert len(loop.wakeups) == 1
    loop.wakeups[0]()
    assert watch.seen == [("ADDED", "a"), ("MODIFIED", "a"), ("DELETED", "a")] and watch.lists == [["a"]]
    watch._hand_over(watch.on_events, [("ADDED", pod("b", "5"))])
    assert len(loop.wakeups) == 2  # drained: the next batch wakes the loop again
    loop.wakeups[1]()
    assert watch.seen[-1] == ("ADDED", "b")
