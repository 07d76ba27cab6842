"""The sweep controller: wires the sweep cache, a work queue of its own and the sweep applier around
sweeps.plan(), beside the job controller (which owns it and shares its applier's thread pool).

Sweep events (handlers.py) and events of trial TrainingJobs (forwarded by the job controller, mapped
to their sweep by the kubetrain.io/sweep-name label) update the SweepCache and queue the sweep.
A worker plans from the cache (pure; a live LIST first when a trial the status counts as unfinished
has no job in the cache) and the SweepApplier carries the plan out. A running sweep is looked at
again after the policy's requeue_after, or every RECHECK_SECONDS; a finished one only on events
(its trials must stay stopped). Its queue hands keys out only while the job controller's does
(leader election). Deleting a sweep forgets it and removes its metrics.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

from kubetrain.core.api import TrialState
from kubetrain.operator.jobs.apply import Applier
from kubetrain.operator.runtime import metrics
from kubetrain.operator.runtime.objects import DELETED, Key, namespace_of
from kubetrain.operator.runtime.workqueue import WorkQueue
from kubetrain.operator.sweeps import plan as sw
from kubetrain.operator.sweeps.apply import Outcome, SweepApplier
from kubetrain.operator.sweeps.cache import SweepCache

__all__ = ["RECHECK_SECONDS", "SweepController", "export_metrics", "remove_metrics"]

RECHECK_SECONDS = 5.0
"""A running sweep is stepped at least this often, when the policy names no time of its own."""


class SweepController:
    def __init__(self, applier: Applier, workers: int, clock: Callable[[], datetime]):
        self.cache = SweepCache()
        self.queue: WorkQueue[Key] = WorkQueue(fair_by=namespace_of)
        self.io = SweepApplier(applier, self.cache)
        self.applier = applier
        self.workers = workers
        self.clock = clock

    # ------------------------------------------------------------------ watch events

    def sweep_event(self, kind: str | None, body: dict[str, Any]) -> None:
        key = self.cache.sweep_event(kind, body)
        if kind == DELETED:
            self.forget(key)
        else:
            self.queue.add(key)

    def job_event(self, kind: str | None, body: dict[str, Any]) -> None:
        """Any TrainingJob's event: a trial's queues its sweep, others are ignored."""
        key = self.cache.job_event(kind, body)
        if key is not None and self.cache.sweep(key) is not None:
            self.queue.add(key)

    def forget(self, key: Key) -> None:
        self.cache.forget(key)
        self.queue.forget(key)
        remove_metrics(key)

    # ------------------------------------------------------------------ lifecycle (driven by the job controller)

    async def fill(self, scopes: Iterable[str | None], watches: Callable[[str], bool] = lambda _: True) -> None:
        """LIST the sweeps in each scope (a namespace; None: every namespace), keeping those in the namespaces it
        `watches`; their trial jobs come with the job controller's LISTs of TrainingJobs."""
        for scope in scopes:
            for sweep in await self.applier.io(self.io.list_sweeps, scope):
                if watches(sweep["metadata"]["namespace"]):
                    self.sweep_event(None, sweep)

    async def serve(self) -> None:
        await self.queue.serve(self.workers, self.reconcile)

    def set_leading(self, leading: bool) -> None:
        self.queue.set_leading(leading)

    # ------------------------------------------------------------------ reconcile

    async def reconcile(self, key: Key) -> float | None:
        """One sweep: plan from the cache, carry the plan out. Returns when to look again."""
        body = self.cache.sweep(key)
        if body is None:
            return None
        try:
            if sw.needs_live_look(body, self.cache.jobs(key)):
                await self.io.refresh(key)
            p = sw.plan(body, self.cache.jobs(key), self.clock(), self.cache.reported(key).refused)
            outcome = await self.io.execute(key, body, p)
        except Exception as exc:
            metrics.RECONCILE_ERRORS.labels(type(exc).__name__).inc()
            raise  # the work queue logs it and retries with backoff
        if not outcome.written:
            return 0.0  # the sweep changed since it was read: plan again, at once, from the fresh copy
        fresh = self.cache.sweep(key)
        if fresh is not None:
            export_metrics(key, fresh.get("status") or {})
        return self._requeue_after(key, p, outcome)

    def _requeue_after(self, key: Key, p: sw.SweepPlan, outcome: Outcome) -> float | None:
        """Backoff (2 s doubling to 60 s) while a trial job cannot be created: no event says when a quota is
        raised or a foreign job goes; else the policy's time, a recheck while running, nothing once finished."""
        if outcome.blocked:
            return self.queue.backoff(key)
        self.queue.reset(key)
        if p.finished:
            return None
        return p.requeue_after if p.requeue_after is not None else RECHECK_SECONDS


# --------------------------------------------------------------------------- metrics


def export_metrics(key: Key, status: dict[str, Any]) -> None:
    """The sweep's trials by state and its best value, from its status (set by the replica that reconciles)."""
    counts = Counter(str(t.get("state") or TrialState.PENDING) for t in status.get("trials") or [])
    for state in TrialState:
        metrics.SWEEP_TRIALS.labels(key[0], key[1], state).set(counts.get(state, 0))
    best = status.get("bestValue")
    if isinstance(best, int | float) and not isinstance(best, bool):
        metrics.SWEEP_BEST_VALUE.labels(key[0], key[1]).set(float(best))
    else:
        with contextlib.suppress(KeyError):
            metrics.SWEEP_BEST_VALUE.remove(key[0], key[1])


def remove_metrics(key: Key) -> None:
    """A deleted sweep leaves no series behind."""
    for state in TrialState:
        with contextlib.suppress(KeyError):
            metrics.SWEEP_TRIALS.remove(key[0], key[1], state)
    with contextlib.suppress(KeyError):
        metrics.SWEEP_BEST_VALUE.remove(key[0], key[1])
