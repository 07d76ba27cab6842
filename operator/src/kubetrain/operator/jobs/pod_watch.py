"""The operator's own watch of its worker pods (kopf watches the jobs, sweeps, nodes and Workloads).

A pod event through kopf went through its per-event machinery (a Body, handler matching, patch and
logging contexts) and a generic JSON decode of its own, a quarter of the operator's CPU while a
1024-worker gang started; and kopf watches every pod of the cluster and filters by label itself. This
watch asks the API server for worker pods only (by label), decodes each line with pydantic_core's JSON
parser (1.6x json.loads on a pod), and hands the events to the event loop in batches, one per chunk read.

The protocol is client-go's reflector's: LIST, then WATCH from the list's resourceVersion with
bookmarks. When a watch ends (the server closes it after WATCH_SECONDS) the next one starts from the
last version seen. On 410 Gone (that version fell out of the API server's window) it LISTs again and
hands the list over whole: the caller reports the pods it lacks as deleted. Any other error is logged
and the watch tries again after a backoff, so a job never waits on a watch that silently stopped.

The requests run on a thread of their own (the kubernetes client blocks); the events reach the loop
through an outbox that the loop drains, woken (`call_soon_threadsafe`) only when no drain is pending:
each wake-up is a write to the loop's self-pipe and a wait for the GIL (py-spy found a tenth of the busy
samples there while a 1024-pod gang was created, mostly waiting). Everything that reads the events stays
on the loop's thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from pydantic_core import from_json

from kubetrain.core import contract
from kubetrain.operator.runtime import metrics
from kubetrain.operator.runtime.objects import list_pages

__all__ = ["WATCH_SECONDS", "Expired", "PodList", "PodWatch", "events_of"]

log = logging.getLogger("kubetrain.operator")

WATCH_SECONDS = 300
"""How long the API server keeps one watch open (a new one follows from the last version seen)."""
READ_TIMEOUT = WATCH_SECONDS + 30
"""Seconds without a byte after which the connection counts as dead (bookmarks arrive well within it)."""
CONNECT_TIMEOUT = 10
BACKOFF = (1.0, 30.0)
"""First and longest pause before watching again after an error (doubling)."""
CHUNK = 1 << 16

Event = tuple[str | None, dict[str, Any]]
"""A watch event's type (ADDED, MODIFIED, DELETED) and object."""


class Expired(Exception):
    """410 Gone: the version the watch started from is older than the API server keeps."""


@dataclass(frozen=True)
class PodList:
    pods: list[dict[str, Any]]
    resource_version: str
    """The list's own version: the state it shows; a watch from it misses nothing after."""
    scope: str | None = None
    """The namespace listed (None: every namespace): a pod cached elsewhere is not missing from it."""


def events_of(lines: list[bytes]) -> tuple[list[Event], str | None]:
    """The pod events among watch lines, and the last resourceVersion they carry (bookmarks included).

    Raises Expired on a 410 ERROR event (the events before it are dropped: the LIST that follows shows
    their pods as they are now), RuntimeError on any other ERROR event."""
    events: list[Event] = []
    version = None
    for line in lines:
        if not line.strip():
            continue
        event = from_json(line)
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Expired(obj.get("message", "410 Gone"))
            raise RuntimeError(f"watch error {obj.get('code')}: {obj.get('message')}")
        version = (obj.get("metadata") or {}).get("resourceVersion") or version
        if kind != "BOOKMARK":
            events.append((kind, obj))
    return events, version


def _lines(chunks: Iterator[bytes]) -> Iterator[list[bytes]]:
    """The complete lines of each chunk (a line split over chunks comes out with the chunk that ends it)."""
    rest = b""
    for chunk in chunks:
        *lines, rest = (rest + chunk).split(b"\n")
        if lines:
            yield lines


class PodWatch:
    """LIST and WATCH of the worker pods in one namespace (or all), on a thread of its own; an operator that
    watches several namespaces runs one per namespace (a namespaced Role allows no cluster-wide LIST).

    `on_events` receives each batch of events and `on_list` each re-LIST, both on the event loop."""

    def __init__(self, api_client: client.ApiClient, namespace: str | None,
                 on_events: Callable[[list[Event]], None], on_list: Callable[[PodList], None]) -> None:
        self.core = client.CoreV1Api(api_client)
        self.namespace = namespace
        self.on_events, self.on_list = on_events, on_list
        self._stopped = threading.Event()
        self._response: Any = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: deque[tuple[Callable[[Any], None], Any]] = deque()
        self._lock = threading.Lock()
        self._wake_pending = False

    def _request(self, **kwargs: Any) -> Any:
        """The raw response of a LIST or WATCH of worker pods (no model objects: they were slower than the
        request)."""
        kwargs.update(label_selector=contract.LABEL_JOB, _preload_content=False)
        if self.namespace:
            return self.core.list_namespaced_pod(self.namespace, **kwargs)
        return self.core.list_pod_for_all_namespaces(**kwargs)

    def list(self) -> PodList:
        """Every worker pod as it is now (blocking), page by page."""
        pods, version = list_pages(lambda **kw: from_json(self._request(**kw).data),
                                   _request_timeout=(CONNECT_TIMEOUT, READ_TIMEOUT))
        for pod in pods:  # a LIST's items carry neither
            pod.setdefault("apiVersion", "v1")
            pod.setdefault("kind", "Pod")
        return PodList(pods, version, self.namespace)

    def start(self, loop: asyncio.AbstractEventLoop, resource_version: str) -> None:
        """Watch from `resource_version` (a LIST's) on, until stop()."""
        self._loop = loop
        self._thread = threading.Thread(target=self._run, args=(resource_version,),
                                        name=f"pod-watch-{self.namespace or 'all'}", daemon=True)
        self._thread.start()

    def _hand_over(self, receiver: Callable[[Any], None], what: Any) -> None:
        """Queue `receiver(what)` for the loop (from the watch's thread), in order; wake the loop only when
        no drain is pending already."""
        assert self._loop is not None
        with self._lock:
            self._outbox.append((receiver, what))
            if self._wake_pending:
                return
            self._wake_pending = True
        self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        """On the loop: everything the watch handed over since the last drain."""
        with self._lock:
            self._wake_pending = False
            batch = list(self._outbox)
            self._outbox.clear()
        for receiver, what in batch:
            receiver(what)

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        self._stopped.set()
        response = self._response
        if response is not None:
            response.shutdown()  # unblocks the thread's read

    def _run(self, version: str | None) -> None:
        pause = BACKOFF[0]
        while not self._stopped.is_set():
            try:
                if version is None:
                    listed = self.list()
                    self._hand_over(self.on_list, listed)
                    version = listed.resource_version
                version = self._watch(version)
                pause = BACKOFF[0]
            except Expired as exc:
                metrics.POD_WATCH_RESTARTS.labels("expired").inc()
                log.info("pod watch: %s; listing the pods again", exc)
                version = None
            except Exception as exc:  # noqa: BLE001 - a watch that stops on an error would hang every job
                if self._stopped.is_set():
                    return
                metrics.POD_WATCH_RESTARTS.labels("error").inc()
                log.warning("pod watch failed (%s: %s); watching again in %.0f s", type(exc).__name__, exc, pause)
                self._stopped.wait(pause)
                pause = min(BACKOFF[1], 2 * pause)

    def _watch(self, version: str) -> str:
        """One WATCH from `version` until the server ends it; the last version seen."""
        try:
            self._response = response = self._request(
                watch=True, resource_version=version, allow_watch_bookmarks=True, timeout_seconds=WATCH_SECONDS,
                _request_timeout=(CONNECT_TIMEOUT, READ_TIMEOUT))
        except ApiException as exc:
            if exc.status == 410:  # said as the answer's status rather than as an ERROR event
                raise Expired(str(exc.reason)) from exc
            raise
        if self._stopped.is_set():  # stop() came while the request was on its way
            response.shutdown()
        try:
            for lines in _lines(response.stream(CHUNK)):
                events, seen = events_of(lines)
                version = seen or version
                if events:
                    self._hand_over(self.on_events, events)
        except BaseException:
            response.close()  # a connection left mid-stream is not one to use again
            raise
        else:
            response.release_conn()
        finally:
            self._response = None
        return version
