"""The TrainingJob controller: wires the watch cache, the work queue and the applier around plan().

kopf delivers the watch events of jobs, nodes and Workloads (kubetrain.operator.handlers), the PodWatch
those of worker pods (jobs/pod_watch.py); they update the WatchCache and queue the job's key.
The WorkQueue hands keys to a few workers (never the same key to two at once); a worker plans
from the cache (pure) and the Applier carries the plan out. Deleting a job forgets it everywhere.
TrainingSweeps are reconciled beside the jobs, under the same leadership, by the Controller that
extends this one (kubetrain.operator.controller): jobs know nothing of sweeps.

A plan reads every pod of its job, and a starting gang's pods send an event each as they are
scheduled, start and turn ready: a 1024-worker gang was planned after nearly every one of them.
An event that only moves a worker on towards running is paced (`pace`): its job is looked at again
after a pause in proportion to what planning that job last cost. Any other event (a worker that
failed, finished or went missing, a pod deleted) is looked at at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from kubernetes import client

from kubetrain.core import api, contract
from kubetrain.core.lifecycle import Action, FailureKind, WorkerPhase, gpu_hours_now
from kubetrain.operator.jobs import runtimes, storage
from kubetrain.operator.jobs.apply import Apis, Applier
from kubetrain.operator.jobs.cache import WatchCache
from kubetrain.operator.jobs.plan import (
    SILENT_FORGET_SECONDS,
    Observation,
    Plan,
    claim_to_check,
    deletion_overdue,
    forgotten,
    plan,
    settles_in,
    silence_checks,
    silent_for,
    unanswering_nodes,
)
from kubetrain.operator.jobs.pod_facts import facts
from kubetrain.operator.jobs.pod_patches import overlay
from kubetrain.operator.jobs.pod_watch import Event, PodList, PodWatch
from kubetrain.operator.jobs.runtimes import RuntimeLookup
from kubetrain.operator.kueue.io import KueueIO
from kubetrain.operator.kueue.plan import QueueView
from kubetrain.operator.runtime import metrics
from kubetrain.operator.runtime.objects import DELETED, Key, namespace_of, resource_version, retry_after, uid_of
from kubetrain.operator.runtime.ratelimit import TokenBucket
from kubetrain.operator.runtime.settings import OperatorSettings
from kubetrain.operator.runtime.workqueue import RetryLater, WorkQueue

__all__ = ["CONFIRM_LIVE", "JobController"]

log = logging.getLogger("kubetrain.operator")

# Failures judged from what the caches LACK (a pod, a progress update, a Ready node): confirmed by
# a live read before a gang is restarted over them. A cache can lag: the watch of an operator that
# just started, took the Lease over, or reconnected has not replayed everything yet. Pods the cache
# still holds well past their deletion are read live too (reconcile.deletion_overdue).
CONFIRM_LIVE = frozenset({FailureKind.DELETED, FailureKind.NO_PROGRESS, FailureKind.NODE_LOST})
GANG_GOING = frozenset({Action.RESTART_GANG, Action.SUSPEND, Action.FAIL, Action.SUCCEED})
"""Decisions that take the gang away: what its creates met (a refusal, a foreign object) no longer holds."""
GAUGE_PERIOD = 5.0
"""Seconds between two refreshes of the jobs-by-phase gauge."""
LEASE_READ_SECONDS = 1.0
"""How long a node's Lease, once read, serves every job that asks (a silent node is read by each reconcile)."""
PACE_FACTOR = 20.0
"""A paced pod event waits this many times the last plan of its job: planning takes at most about
1/20 of the operator's time while a gang starts (a 2-worker job's pause is a few milliseconds)."""
PACE_MAX = 1.0
"""Seconds: the longest pause of a paced pod event, however large the job."""
STARTING = frozenset({WorkerPhase.PENDING, WorkerPhase.RUNNING})


def pace(plan_seconds: float) -> float:
    """How long a pod event that only moves a worker on towards running waits, given what the last
    plan of its job cost."""
    return min(PACE_MAX, PACE_FACTOR * plan_seconds)


def paced(kind: str | None, pod: dict[str, Any]) -> bool:
    """The event only moves a worker on towards running (created, scheduled, started, ready)."""
    return kind != DELETED and facts(pod).phase in STARTING


def _known_version(cached: dict[str, Any] | None, body: dict[str, Any]) -> bool:
    """The cache holds this version of the job, or a newer one: the watch's echo of the operator's own
    status write (whose response the applier cached), which would only plan the same again."""
    return cached is not None and uid_of(cached) == uid_of(body) and \
        resource_version(cached) >= resource_version(body) > 0


class JobController:
    def __init__(self, api_client: client.ApiClient, settings: OperatorSettings,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC)):
        self.api_client = api_client
        self.settings = settings
        self.clock = clock
        self.cache = WatchCache(settings.termination_taints)
        self.queue: WorkQueue[Key] = WorkQueue(fair_by=namespace_of)
        self.applier = Applier(Apis.of(api_client), self.cache, settings.create_parallelism, clock,
                               patch_failed=self.queue.add,  # planned again from the pod as it is
                               limit=TokenBucket(settings.api_qps, settings.api_burst, time.monotonic()))
        self.kueue = KueueIO(self.applier.io, self.applier.apis.custom, self.cache)
        self.first_running: set[Key] = set()
        """Jobs whose first time Running was observed (kubetrain_operator_time_to_running_seconds)."""
        self.first_step: set[Key] = set()
        """Jobs whose first step was observed (kubetrain_operator_time_to_first_step_seconds)."""
        self.paces: dict[Key, float] = {}
        """Per job, the pause of its paced pod events (`pace` of its last plan)."""
        self._leases: dict[str, tuple[float, datetime | None]] = {}
        """Node -> (when read, monotonic; its kubelet's last Lease renewal): _heard_at's."""
        self.tasks: list[asyncio.Task[None]] = []
        self.pod_watches = [PodWatch(api_client, scope, self.pod_events, self.pods_listed)
                            for scope in settings.scopes()]

    # ------------------------------------------------------------------ watch events

    def job_event(self, kind: str | None, body: dict[str, Any]) -> None:
        known = self.cache.job((body["metadata"]["namespace"], body["metadata"]["name"]))
        key = self.cache.job_event(kind, body)
        if kind == DELETED:
            self.forget(key)
        elif not _known_version(known, body):
            self.queue.add(key)

    def pod_event(self, kind: str | None, body: dict[str, Any]) -> None:
        key = self.cache.pod_event(kind, body)
        if key is None:
            return
        if paced(kind, body):
            self.queue.add_after(key, self.paces.get(key, 0.0))
        else:
            self.queue.add(key)

    def pod_events(self, events: list[Event]) -> None:
        for kind, body in events:
            self.pod_event(kind, body)

    def pods_listed(self, listed: PodList) -> None:
        """A LIST of the worker pods (in one watched namespace, or all): each pod as it is, and each cached pod
        there the list lacks (one no newer than the list) as deleted: its DELETED event fell in a gap of the
        watch."""
        for gone in self.cache.missing_from(listed.pods, listed.resource_version, listed.scope):
            self.pod_event(DELETED, gone)
        for pod in listed.pods:
            self.pod_event(None, pod)

    def workload_event(self, kind: str | None, body: dict[str, Any]) -> None:
        """A Kueue Workload of a job (admitted, evicted, ...): its job is planned again."""
        key = self.cache.workload_event(kind, body)
        if key is not None:
            self.queue.add(key)

    def node_event(self, kind: str | None, body: dict[str, Any]) -> None:
        for key in self.cache.node_event(kind, body, self.clock()):
            self.queue.add(key)

    def forget(self, key: Key) -> None:
        """A deleted job: nothing kept for it anywhere."""
        self.cache.forget(key)
        self.queue.forget(key)
        self.applier.patches.forget(key)
        self.first_running.discard(key)
        self.first_step.discard(key)
        self.paces.pop(key, None)
        metrics.forget_job(*key)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Fill the caches and start the workers; they reconcile at once without leader election,
        else only after start_leading()."""
        listed = await self._fill_cache()
        for watch, pods in zip(self.pod_watches, listed, strict=True):
            watch.start(asyncio.get_running_loop(), pods.resource_version)
        self.tasks = [asyncio.create_task(self.queue.serve(self.settings.reconcile_workers, self.reconcile)),
                      asyncio.create_task(self._gauges())]
        if self.settings.leader_election is None:
            self._lead(True)

    async def start_leading(self) -> None:
        """This replica got the Lease: re-read everything (a standby's caches may lag), then act."""
        await self._fill_cache()
        self._lead(True)

    def stop_leading(self) -> None:
        self._lead(False)

    async def stop(self) -> None:
        for watch in self.pod_watches:
            watch.stop()
        for t in self.tasks:
            t.cancel()
        for t in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self.applier.close()

    def _lead(self, leading: bool) -> None:
        self.queue.set_leading(leading)
        metrics.LEADER.set(int(leading))

    async def _fill_cache(self) -> list[PodList]:
        """LIST jobs, pods, nodes and Workloads (in each watched namespace, or the cluster), so that no decision
        is taken on a half-filled cache (a pod not yet seen would look deleted); watch events keep them fresh
        after. Jobs first: the cache keeps pods only under a job it knows. The pods' lists, one per pod watch
        (each watch starts from its own list's version)."""
        snapshot = await self.applier.io(self.applier.list_all, self.settings.scopes())
        for jobs in snapshot.jobs:
            ours = [job for job in jobs.jobs if self.settings.watches(job["metadata"]["namespace"])]
            for key in self.cache.jobs_missing_from(ours, jobs.version, jobs.scope):
                self.forget(key)  # deleted while no watch told: nothing is kept (nor reconciled) for it
            for job in ours:
                self.job_event(None, job)
        listed = [await self.applier.io(watch.list) for watch in self.pod_watches]
        for pods in listed:
            self.pods_listed(pods)
        for name in self.cache.nodes_missing_from(snapshot.nodes):
            self.cache.nodes.pop(name, None)
            self.cache.terminating.pop(name, None)
        for node in snapshot.nodes:
            self.node_event(None, node)
        for scope in self.settings.scopes():
            for wl in await self.applier.io(self.kueue.list_workloads, scope):
                self.workload_event(None, wl)
        return listed

    async def _gauges(self) -> None:
        while True:
            self.count_phases()
            await asyncio.sleep(GAUGE_PERIOD)

    # ------------------------------------------------------------------ reconcile

    async def reconcile(self, key: Key) -> float | None:
        """One job: plan from the caches, confirm a failure seen as an absence, carry the plan out.
        Returns when to look again (None: on its next event)."""
        body = self.cache.job(key)
        if body is None:
            return None
        t0 = time.perf_counter()
        try:
            claim_phase = await self._claim_phase(key, body)
            queue = await self.kueue.view(key, body)
            silence = await self._check_silence(key)
            runtime = await self._read_runtime(key, body)
            classes = await self.applier.storage_classes() if storage.to_read(body) else None
            p = self._plan(key, body, claim_phase, queue, runtime, classes)
            confirm = (p.decision is not None and p.decision.failure_kind in CONFIRM_LIVE) or \
                deletion_overdue(self.cache.pods(key), self.clock(), self.cache.read_live(key))
            if confirm and await self.applier.refresh(key):
                p = self._plan(key, body, claim_phase, queue, runtime, classes)
            carried_out = await self.applier.execute(key, body, p)
            if carried_out:
                await self.kueue.carry_out(key, body, p.queue)
        except Exception as exc:
            metrics.RECONCILE_ERRORS.labels(type(exc).__name__).inc()
            if (after := retry_after(exc)) is not None:
                status = getattr(exc, "status", None)
                raise RetryLater(after, f"the API server answered {status} (Retry-After {after:.0f}s)") from exc
            raise  # the work queue logs it and retries with backoff
        if not carried_out:
            return 0.0  # the job changed since it was read: plan again, at once, from the fresh copy
        self._observe(key, body, p)
        metrics.RECONCILE_SECONDS.observe(time.perf_counter() - t0)
        after = self._requeue_after(key, p)
        return silence if after is None or (silence is not None and silence < after) else after

    def _plan(self, key: Key, body: dict[str, Any], claim_phase: str | None, queue: QueueView,
              runtime: RuntimeLookup | None = None, classes: list[dict[str, Any]] | None = None) -> Plan:
        cache, now = self.cache, self.clock()
        t0 = time.perf_counter()
        progress = cache.progress(key)
        seen = Observation(
            body, overlay(cache.pods(key), self.applier.patches.pending(key)), {**cache.silent, **cache.nodes}, now,
            progress=progress, progress_seen=cache.progress_seen(key, progress, now),
            status_written=cache.status_written(key), claim_phase=claim_phase,
            gone=cache.disrupted(key), silent=frozenset(cache.silent),
            progress_refused=cache.progress_refused(key), create_refused=cache.create_refused(key),
            foreign=cache.foreign(key), queue=queue, node_count=len(cache.node_names), terminating=cache.terminating,
            runtime=runtime, storage_classes=classes)
        p = plan(seen, self.settings.builders)
        self.paces[key] = pace(time.perf_counter() - t0)
        return p

    async def _read_runtime(self, key: Key, body: dict[str, Any]) -> RuntimeLookup | None:
        """The job's runtime as stored now, while the job has not started with one (runtimes.to_read)."""
        ref = runtimes.to_read(body)
        if ref is None:
            return None
        return await self.applier.read_runtime(key[0], ref)

    async def _check_silence(self, key: Key) -> float | None:
        """Read the Leases of the job's nodes that plan.silence_checks names, and of those whose worker did not
        answer a peer (plan.unanswering_nodes): a silent one joins cache.silent (NotReady to the lifecycle), one
        that spoke again leaves it. Seconds until one could turn silent (the reconcile's next look), or None."""
        cache = self.cache
        for node in forgotten(cache.silent, self.clock()):
            del cache.silent[node]
            cache.unanswering.pop(node, None)
        body = cache.job(key) or {}
        named = unanswering_nodes(cache.pods(key), self.clock(), (body.get("status") or {}).get("lastHang"))
        for node, at in named.items():
            if at > cache.unanswering.get(node, at) + timedelta(seconds=SILENT_FORGET_SECONDS):
                del cache.unanswering[node]  # an incident long past: this report is a new one
            cache.unanswering.setdefault(node, at)
        # Every silent node is read again, not only this job's: one that spoke again must not stay off the
        # pods of every job until forgotten().
        checks = silence_checks(cache.pods(key), cache.nodes, cache.silent) | set(cache.silent) | \
            (set(named) - set(cache.nodes))
        soonest = settles_in(cache.pods(key), self.clock())
        for node in sorted(checks):
            heard = await self._heard_at(node)
            if heard is None and node in cache.silent:
                continue  # not known is not "spoke again": the mark stays until forgotten()
            if self._unanswering(node, heard):
                continue
            left = silent_for(heard, self.clock())
            if heard is not None and left == 0.0:
                if node not in self.cache.silent:
                    log.warning("node %s: its kubelet last renewed its Lease at %s and a job on it lost peers: "
                                "lost to its jobs before it is NotReady", node, contract.format_time(heard))
                self.cache.silent[node] = heard
                continue
            self.cache.silent.pop(node, None)
            if left is not None:
                soonest = left if soonest is None else min(soonest, left)
        return None if soonest is None else max(1.0, soonest)

    async def _heard_at(self, node: str) -> datetime | None:
        """The node's Lease renewal, read at most once a LEASE_READ_SECONDS for all the jobs reconciled meanwhile."""
        now = time.monotonic()
        read = self._leases.get(node)
        if read is None or now - read[0] >= LEASE_READ_SECONDS:
            read = self._leases[node] = (now, await self.applier.node_heard_at(node))
        return read[1]

    def _unanswering(self, node: str, heard: datetime | None) -> bool:
        """Whether the node's worker did not answer a peer and its kubelet has not renewed its Lease since: the
        kubelet and the worker fell silent together, so the node is lost to its jobs now (cache.silent), many
        seconds before its Lease is old enough to say so alone."""
        at = self.cache.unanswering.get(node)
        if at is None:
            return False
        if heard is not None and heard > at:
            del self.cache.unanswering[node]  # its kubelet spoke after: the worker alone failed
            return False
        if node not in self.cache.silent:
            log.warning("node %s: its worker fell silent at %s (it did not answer a peer, or stayed Ready after a "
                        "peer lost it), and its kubelet last renewed its Lease at %s: lost to its jobs before it is "
                        "NotReady", node, contract.format_time(at), contract.format_time(heard) if heard else "never")
        self.cache.silent[node] = heard or at
        return True

    def _requeue_after(self, key: Key, p: Plan) -> float | None:
        """The plan's time to look again; with a pod create refused or a child's name taken, the backoff's
        instead (2 s doubling to 60 s; the plan's own, a recheck of the pods just created, would retry the
        create every 2 s): no event the operator watches says when a quota is raised or a namespace
        relabelled. The backoff starts over once the job's creates succeed, or once its gang goes away
        (a restart, a suspension, the end): what the creates met then no longer holds."""
        d = p.decision
        if d is None or d.action in GANG_GOING or d.phase in (api.Phase.SUSPENDED, *api.FINISHED_PHASES):
            self.cache.set_create_refused(key, None)
            self.cache.set_foreign(key, None)
        if self.cache.create_refused(key) is None and self.cache.foreign(key) is None:
            self.queue.reset(key)
            return p.requeue_after
        return self.queue.backoff(key)

    async def _claim_phase(self, key: Key, body: dict[str, Any]) -> str | None:
        """The checkpoint claim's phase, read live only while the scheduler says the job's pods wait
        for a volume (claims are not watched: one GET per such reconcile)."""
        name = claim_to_check(body, self.cache.pods(key), self.clock())
        return None if name is None else await self.applier.claim_phase(key[0], name)

    def _observe(self, key: Key, body: dict[str, Any], p: Plan) -> None:
        """Metrics of the transition the plan's status makes."""
        d, new = p.decision, p.status
        if d is None or new is None:
            return
        old = body.get("status") or {}
        now = self.clock()
        if d.action == Action.RESTART_GANG:
            metrics.GANG_RESTARTS.labels(*key, d.reason).inc()
        if d.hang is not None and d.action in (Action.RESTART_GANG, Action.FAIL):
            metrics.HANGS.labels(str(bool(d.hang.suspects)).lower()).inc()
        phase, was = new.get("phase"), old.get("phase")
        if phase == api.Phase.RUNNING and was != api.Phase.RUNNING:
            created = contract.parse_time(body["metadata"].get("creationTimestamp"))
            failed = contract.parse_time(old.get("lastFailureTime"))
            if failed is not None:
                metrics.RECOVERY_SECONDS.observe((now - failed).total_seconds())
            elif created is not None and key not in self.first_running:
                self.first_running.add(key)
                metrics.TIME_TO_RUNNING.observe((now - created).total_seconds())
        if phase in api.FINISHED_PHASES and was != phase:
            metrics.JOBS_FINISHED.labels(*key, phase, new.get("reason", "")).inc()
        self._observe_goodput(key, body, new, now)

    def _observe_goodput(self, key: Key, body: dict[str, Any], new: dict[str, Any], now: datetime) -> None:
        """Time to the first step (once per job) and the job's goodput gauges."""
        created = contract.parse_time(body["metadata"].get("creationTimestamp"))
        if new.get("currentStep") and key not in self.first_step and created is not None:
            self.first_step.add(key)
            if not (body.get("status") or {}).get("currentStep"):  # not an operator restart mid-job
                metrics.TIME_TO_FIRST_STEP.observe((now - created).total_seconds())
        g = new.get("goodput") or {}
        metrics.JOB_GOODPUT_SECONDS.labels(*key, "productive").set(g.get("productiveSeconds", 0.0))
        metrics.JOB_GOODPUT_SECONDS.labels(*key, "lost").set(g.get("lostSeconds", 0.0))
        metrics.JOB_STEPS_LOST.labels(*key).set(g.get("stepsLost", 0))
        if g.get("gpusHeld") or new.get("gpuHours"):
            counted = api.Goodput.model_validate(g)
            metrics.JOB_GPU_HOURS.labels(*key, "allocated").set(gpu_hours_now(new.get("gpuHours", 0.0), counted, now))
            metrics.JOB_GPU_HOURS.labels(*key, "lost").set(counted.lost_gpu_hours)

    def count_phases(self) -> None:
        """Refresh the jobs-by-phase gauge (periodically, not per reconcile; 0 on a standby
        replica, so that sums over replicas count each job once)."""
        jobs = self.cache.jobs() if self.queue.leading else iter(())
        counts = Counter((body.get("status") or {}).get("phase", api.Phase.PENDING) for body in jobs)
        for phase in api.Phase:
            metrics.JOBS.labels(phase).set(counts.get(phase, 0))
