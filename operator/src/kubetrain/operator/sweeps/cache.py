"""What the operator knows of its TrainingSweeps and their trial TrainingJobs.

Fed by watch events (sweeps; TrainingJobs through the job controller's handler), by one LIST before
reconciling, and by the sweep applier's own writes. In memory and synchronous, called from the
event loop's thread only; each method returns the sweep worth reconciling and leaves the queueing
to the caller.

Trial jobs are kept by the sweep their label names (kubetrain.io/sweep-name), whether or not that
sweep is known yet or owns them: ownership is judged by the pure plan (sweeps.owned_jobs) against
the sweep's uid, so a job labelled by someone else is seen, reported and never adopted. Jobs leave
on their own DELETED events (a deleted sweep's jobs are garbage-collected after it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kubetrain.operator.runtime.objects import DELETED, Key, resource_version, uid_of
from kubetrain.operator.sweeps.plan import trial_key


@dataclass
class Reported:
    """What the last Warning Events of a sweep said, so that each is recorded once per change, not per reconcile."""

    refused: tuple[str, str] | None = None
    """(reason, message) of the last trial job create refused or found its name taken; None once one succeeded."""
    foreign: tuple[str, ...] = ()
    """Labelled jobs the sweep does not own."""


class SweepCache:
    def __init__(self) -> None:
        self._sweeps: dict[Key, dict[str, Any]] = {}
        self._jobs: dict[Key, dict[str, dict[str, Any]]] = {}
        self._sweep_of: dict[tuple[str, str], Key] = {}
        """(namespace, job name) -> the sweep it is kept under: a job whose label is removed leaves it."""
        self._reported: dict[Key, Reported] = {}

    # ------------------------------------------------------------------ reads

    def keys(self) -> list[Key]:
        return list(self._sweeps)

    def sweep(self, key: Key) -> dict[str, Any] | None:
        return self._sweeps.get(key)

    def jobs(self, key: Key) -> list[dict[str, Any]]:
        """The TrainingJobs labelled as the sweep's trials (owned or not)."""
        return list(self._jobs.get(key, {}).values())

    def reported(self, key: Key) -> Reported:
        return self._reported.setdefault(key, Reported())

    def size(self) -> int:
        """Entries kept (what a leak would grow)."""
        return len(self._sweeps) + len(self._reported) + len(self._sweep_of) + sum(len(j) for j in self._jobs.values())

    # ------------------------------------------------------------------ events

    def sweep_event(self, kind: str | None, body: dict[str, Any]) -> Key:
        """Keep the newer copy of a sweep (or forget it on DELETED); the sweep's key."""
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        if kind == DELETED:
            self.forget(key)
            return key
        cached = self._sweeps.get(key)
        if cached is None or uid_of(cached) != uid_of(body):
            self._sweeps[key] = body
            self._reported.pop(key, None)  # a new sweep under a known name: nothing carries over
        elif resource_version(body) >= resource_version(cached):
            self._sweeps[key] = body
        return key

    def forget(self, key: Key) -> None:
        """A deleted sweep; its jobs stay until their own DELETED events (the garbage collector's)."""
        self._sweeps.pop(key, None)
        self._reported.pop(key, None)

    def job_event(self, kind: str | None, body: dict[str, Any]) -> Key | None:
        """Keep a trial job under the sweep its label names; that sweep's key (also the one a job whose
        label was removed leaves), or None for any other job."""
        meta = body["metadata"]
        where = (meta.get("namespace") or "", meta["name"])
        key = None if kind == DELETED else trial_key(body)
        before = self._sweep_of.get(where)
        if before is not None and (before != key or kind == DELETED):
            self._drop(before, body)
        if key is None:
            return before
        jobs = self._jobs.setdefault(key, {})
        cached = jobs.get(meta["name"])
        if cached is None or uid_of(cached) != uid_of(body) or resource_version(body) >= resource_version(cached):
            jobs[meta["name"]] = body
        self._sweep_of[where] = key
        return key

    def _drop(self, key: Key, body: dict[str, Any]) -> None:
        """Remove the cached copy of `body`'s job from under `key`, unless a newer object took its name."""
        jobs = self._jobs.get(key, {})
        cached = jobs.get(body["metadata"]["name"])
        if cached is not None and uid_of(cached) == uid_of(body):
            del jobs[body["metadata"]["name"]]
            self._sweep_of.pop((key[0], body["metadata"]["name"]), None)
        if not jobs:
            self._jobs.pop(key, None)

    def replace_jobs(self, key: Key, live: Iterable[dict[str, Any]]) -> None:
        """A sweep's trial jobs as a live LIST found them. A cached copy newer than the LIST's (a watch event
        that arrived while the LIST ran) is kept: the LIST must not take a finished job back to Running."""
        listed = list(live)
        names = {job["metadata"]["name"] for job in listed}
        for name, cached in list(self._jobs.get(key, {}).items()):
            if name not in names:
                self._drop(key, cached)
        for job in listed:
            self.job_event(None, job)
