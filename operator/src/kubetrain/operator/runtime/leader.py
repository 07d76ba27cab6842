"""Leader election on a coordination.k8s.io/v1 Lease, the way controller-runtime's --leader-elect works.

Every replica watches and keeps its caches warm; only the holder of the Lease reconciles. The
holder renews the Lease every `retry` seconds. A standby takes the Lease over when its record has
not changed for `duration` seconds by the standby's own clock (no clock sync between replicas is
assumed), or at once when the holder released it on a clean shutdown. A holder that cannot renew
within `renew_deadline` seconds stops acting, so two replicas never reconcile together, and stands by
again: a stalled API server (every replica cut off alike) costs no replica a restart.

`next_step` is the pure decision; `LeaderElector` does the I/O.

Why not `kubernetes.leaderelection` (the Python client's port of client-go's elector):
- It blocks: its `LeaderElection.run()` loops with `time.sleep` and runs `onstarted_leading` in a
  thread of its own, while the operator is one asyncio loop (kopf, the work queue); every callback
  would have to hop threads. Here the loop is a task and only the two Lease calls use a thread (their
  own, each call bounded by half the renew deadline); the takeover (the caches filled again) runs
  beside the renewals and is retried when it fails.
- It cannot release: `run()` has no stop and nothing gives the Lease back, so after a rollout or a
  drain the standby waits a whole `leaseDuration`. `LeaderElector.release()` empties the holder on
  SIGTERM and the standby takes over on its next round (tests/integration/test_rbac_chart.py).
- Its `LeaseLock` calls `client.CoordinationV1Api()` on the default configuration, not on the
  operator's ApiClient (its kubeconfig, its connection pool).
- It measures expiry with `time.time()` (a wall-clock step moves it) and writes `acquireTime` and
  `renewTime` from a local, naive `datetime.fromtimestamp`; it never counts `leaseTransitions`.
- Its decision is interleaved with the reads and writes in `try_acquire_or_renew`, so it can only
  be tested against an API server; `next_step` and `lease_body` are tested as pure functions
  (tests/unit/test_leader.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from kubetrain.core import contract
from kubetrain.operator.runtime.settings import LeaderElection

log = logging.getLogger("kubetrain.operator")


class Action(enum.StrEnum):
    CREATE = "Create"
    """No Lease yet: create it with us as holder."""
    ACQUIRE = "Acquire"
    """The Lease is free (released) or expired: take it over (leaseTransitions + 1)."""
    RENEW = "Renew"
    """We hold it: renew."""
    WAIT = "Wait"
    """Someone else holds a live Lease."""


@dataclass(frozen=True)
class Observation:
    """The Lease as last read, and when (monotonic seconds, local clock) its content last changed."""

    holder: str
    version: str
    """The record's identity: resourceVersion (any write, renewals included, changes it)."""
    changed_at: float


def next_step(lease: dict[str, Any] | None, seen: Observation | None, identity: str, now: float,
              duration: float) -> tuple[Action, Observation | None]:
    """What to do with the Lease as read now, given what was seen before."""
    if lease is None:
        return Action.CREATE, None
    spec = lease.get("spec") or {}
    holder = spec.get("holderIdentity") or ""
    version = str((lease.get("metadata") or {}).get("resourceVersion") or "")
    obs = seen if seen is not None and seen.version == version else Observation(holder, version, now)
    if holder == identity:
        return Action.RENEW, obs
    if not holder:
        return Action.ACQUIRE, obs
    if now - obs.changed_at >= max(float(spec.get("leaseDurationSeconds") or duration), duration):
        return Action.ACQUIRE, obs
    return Action.WAIT, obs


def lease_body(lease: dict[str, Any] | None, action: Action, identity: str, duration: int,
               now: datetime) -> dict[str, Any]:
    """The Lease to write for CREATE, ACQUIRE or RENEW (metadata.resourceVersion kept: a racing writer gets 409)."""
    ts = contract.format_time(now, micros=True)
    spec = dict((lease or {}).get("spec") or {})
    if action in (Action.CREATE, Action.ACQUIRE):
        spec["acquireTime"] = ts
        spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + (action == Action.ACQUIRE)
    spec.update(holderIdentity=identity, leaseDurationSeconds=duration, renewTime=ts)
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": dict((lease or {}).get("metadata") or {}), "spec": spec}


def once(configuration: client.Configuration) -> client.Configuration:
    """`configuration` (server, credentials) for calls that are tried once: their caller decides about retries."""
    own = copy.copy(configuration)
    own.retries = False
    return own


class LeaderElector:
    """Keeps trying to hold the Lease `namespace/name`; calls `on_start` when it got it and
    `on_stop` when it lost it (not called on release at shutdown)."""

    def __init__(self, api_client: client.ApiClient, election: LeaderElection,
                 on_start: Callable[[], Awaitable[None]], on_stop: Callable[[], None]):
        self.api = client.CoordinationV1Api(client.ApiClient(once(api_client.configuration)))
        """On a connection pool of its own that never retries: a retried read would take the bound below
        four times over (urllib3 retries a read that timed out three times by default)."""
        self.sanitize = api_client.sanitize_for_serialization
        self.namespace, self.name, self.identity = election.namespace, election.lease, election.identity
        self.on_start, self.on_stop = on_start, on_stop
        self.duration, self.renew_deadline, self.retry = election.duration, election.renew_deadline, election.retry
        self.leading = False
        self.seen: Observation | None = None
        self.renewed_at = 0.0
        self.task: asyncio.Task[None] | None = None
        self.takeover: asyncio.Task[None] | None = None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lease")
        """The Lease calls' own thread: never queued behind the controller's API calls."""
        self.timeout = max(0.5, self.renew_deadline / 2)
        """Seconds each Lease call may take: a round (a read, a write) ends within the renew deadline, even on a
        connection that went half-open, so the deadline is checked in time."""

    def _read(self) -> dict[str, Any] | None:
        try:
            return self.sanitize(self.api.read_namespaced_lease(self.name, self.namespace,
                                                                _request_timeout=self.timeout))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _write(self, lease: dict[str, Any] | None, body: dict[str, Any]) -> None:
        if lease is None:
            body["metadata"] = {"name": self.name, "namespace": self.namespace}
            self.api.create_namespaced_lease(self.namespace, body, _request_timeout=self.timeout)
        else:
            self.api.replace_namespaced_lease(self.name, self.namespace, body, _request_timeout=self.timeout)

    def try_once(self) -> bool:
        """One read-decide-write round (blocking I/O). True when we hold the Lease afterwards."""
        lease = self._read()
        action, self.seen = next_step(lease, self.seen, self.identity, time.monotonic(), self.duration)
        if action == Action.WAIT:
            return False
        try:
            self._write(lease, lease_body(lease, action, self.identity, self.duration, datetime.now(UTC)))
        except ApiException as exc:
            if exc.status in (409, 422):  # another replica wrote first
                return False
            raise
        if action != Action.RENEW:
            log.info("acquired the leader lease %s/%s as %s", self.namespace, self.name, self.identity)
        return True

    async def run(self) -> None:
        log.info("leader election on lease %s/%s as %s", self.namespace, self.name, self.identity)
        while True:
            held = await self._round()
            now = time.monotonic()
            if held:
                self.renewed_at = now
                if not self.leading:
                    if self.takeover is not None:  # it had led before and lost the Lease
                        log.info("leading again on lease %s/%s as %s", self.namespace, self.name, self.identity)
                    self.leading = True
                    self.takeover = asyncio.create_task(self._take_over())  # renewals go on beside it
            elif self.leading and now - self.renewed_at > self.renew_deadline:
                self._lose(now)  # and go on as a candidate
            await asyncio.sleep(self.retry)

    async def _round(self) -> bool:
        """One try_once on the Lease thread. A leader whose renew deadline passes while the round still waits
        for the API server (a half-open connection) stops at the deadline, not when the round gives up."""
        fut = asyncio.get_running_loop().run_in_executor(self.executor, self.try_once)
        if self.leading:
            await asyncio.wait({fut}, timeout=max(0.0, self.renewed_at + self.renew_deadline - time.monotonic()))
            if not fut.done():
                self._lose(time.monotonic())
        try:
            return await fut
        except Exception as exc:  # noqa: BLE001 - the API server may be briefly unreachable
            log.warning("leader lease %s/%s: %s", self.namespace, self.name, exc)
            return False

    async def _take_over(self) -> None:
        """on_start (the caches filled again: several LISTs) until it succeeds; one that failed is tried again
        after a backoff (the retry, doubling to 30 s), never the end of the election."""
        delay = self.retry
        while self.leading:
            try:
                await self.on_start()
                return
            except Exception as exc:  # noqa: BLE001 - a LIST that failed or timed out: the next try may not
                log.warning("taking over as leader: %s; trying again in %.0fs", exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)

    def _lose(self, now: float) -> None:
        """The Lease was not renewed within the deadline: the controller stops first (no new work), then the
        takeover still under way, if any, is cancelled. The replica stands by: it leads again (a takeover,
        the caches filled anew) once it holds the Lease."""
        self.leading = False
        log.error("lost the leader lease %s/%s (not renewed for %.0fs)", self.namespace, self.name,
                  now - self.renewed_at)
        self.on_stop()
        if self.takeover is not None:
            self.takeover.cancel()

    def start(self) -> None:
        self.task = asyncio.create_task(self.run())

    async def release(self) -> None:
        """On a clean shutdown: stop renewing and hand the Lease over at once."""
        for task in (self.task, self.takeover):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if not self.leading:
            return
        self.leading = False

        def free() -> None:
            lease = self._read()
            if lease and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                lease["spec"].update(holderIdentity="", leaseDurationSeconds=1)
                self.api.replace_namespaced_lease(self.name, self.namespace, lease, _request_timeout=self.timeout)

        with contextlib.suppress(Exception):
            await asyncio.get_running_loop().run_in_executor(self.executor, free)
            log.info("released the leader lease %s/%s", self.namespace, self.name)
