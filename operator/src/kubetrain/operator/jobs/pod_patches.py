"""Pod patches that run behind the reconcile that planned them.

An in-place restart moves every kept pod into the next generation (a label each) in the reconcile that
deletes the failed worker, and tells them to start it (an annotation each) in the one that creates its
successor. Awaited there, a gang's patches held the job: the successor, created by the job's next
reconcile, waited for all of them (about 0.8 s for 127 pods on the bench's API server, seconds for a
thousand). Here they go out after the reconcile returns, on at most part of the API pool, so that a
create finds a free thread and a short line at the API server; until one lands, the plans see the pod
as it will be (`overlay`), so that no plan takes a kept pod for one of the old generation.

A patch that fails (other than 404: the pod is gone) is logged and counted, its overlay dropped, and
the job planned again from the pod as the API server has it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from kubetrain.operator.runtime import metrics
from kubetrain.operator.runtime.objects import Key

__all__ = ["Meta", "PodPatches", "overlay"]

log = logging.getLogger("kubetrain.operator")

Meta = dict[str, dict[str, str]]
"""A pod's patch: labels and annotations to merge ({"labels": {...}, "annotations": {...}})."""


class PodPatches:
    """The patches in flight, per job and pod, and the tasks that send them."""

    def __init__(self, send: Callable[[Key, str, Meta], Awaitable[None]], failed: Callable[[Key], None],
                 in_flight: int) -> None:
        """`in_flight`: patches sent at once, whichever jobs they are for; the rest wait here, not on the
        API pool."""
        self._send, self._failed = send, failed
        self._slots = asyncio.Semaphore(in_flight)
        self._pending: dict[Key, dict[str, Meta]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, key: Key, patches: dict[str, Meta]) -> None:
        """Send these patches in the background; plans see them applied from now on."""
        pending = self._pending.setdefault(key, {})
        for pod, meta in patches.items():
            merged = pending.setdefault(pod, {})
            for part, values in meta.items():
                merged.setdefault(part, {}).update(values)
            task = asyncio.get_running_loop().create_task(self._run(key, pod, meta))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def pending(self, key: Key) -> dict[str, Meta]:
        """The job's pods with a patch still on its way, and what it sets."""
        return self._pending.get(key, {})

    async def settled(self) -> None:
        """Wait until every patch sent so far has landed or failed."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def forget(self, key: Key) -> None:
        """The job is gone: what its patches were to set no longer matters to any plan."""
        self._pending.pop(key, None)

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()

    async def _run(self, key: Key, pod: str, meta: Meta) -> None:
        failed = False
        try:
            async with self._slots:
                await self._send(key, pod, meta)
        except Exception as exc:  # noqa: BLE001 - any failure: the job is planned again from the truth
            metrics.RECONCILE_ERRORS.labels(type(exc).__name__).inc()
            log.warning("%s/%s: could not patch pod %s: %s", *key, pod, exc)
            failed = True
        self._landed(key, pod, meta)
        if failed:
            self._failed(key)

    def _landed(self, key: Key, pod: str, meta: Meta) -> None:
        """Drop what this patch set from the overlay, unless a later patch set it otherwise."""
        pending = self._pending.get(key, {})
        merged = pending.get(pod, {})
        for part, values in meta.items():
            have = merged.get(part, {})
            for name, value in values.items():
                if have.get(name) == value:
                    del have[name]
            if not have:
                merged.pop(part, None)
        if not merged:
            pending.pop(pod, None)
        if not pending:
            self._pending.pop(key, None)


def overlay(pods: list[dict[str, Any]], pending: dict[str, Meta]) -> list[dict[str, Any]]:
    """The pods as they will be once the patches in flight land. A patched copy has no resourceVersion:
    its facts are read from it, not from the memo of the version it was read at."""
    if not pending:
        return pods
    return [_patched(p, pending[name]) if (name := p["metadata"]["name"]) in pending else p for p in pods]


def _patched(pod: dict[str, Any], meta: Meta) -> dict[str, Any]:
    old = pod["metadata"]
    new = {**old, **{part: {**(old.get(part) or {}), **values} for part, values in meta.items()}}
    new.pop("resourceVersion", None)
    return {**pod, "metadata": new}
