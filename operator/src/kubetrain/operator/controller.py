"""The controller: watch caches, a work queue, and the only code that talks to the API server.

kopf delivers watch events (handlers.py); they update the caches here and
enqueue the job's key. A few workers take keys off the queue (never the same key
twice at once) and reconcile: plan() computes everything from the caches, then
this module creates children concurrently (bounded, 409 = already there),
deletes pods, writes the status ONCE, and records Events.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from kubetrain.core import api, contract
from kubetrain.core.lifecycle import FailureKind
from kubetrain.core.progress import Progress
from kubetrain.operator import builders as b
from kubetrain.operator import metrics
from kubetrain.operator.reconcile import Plan, claim_to_check, parse_ts, plan

log = logging.getLogger("kubetrain.operator")

# Failures judged from what the caches LACK (a pod, a progress update, a Ready node): confirmed by
# a live read before a gang is restarted over them. A cache can lag: the watch of an operator that
# just started, resumed after a kopf peering pause, or reconnected has not replayed everything yet.
CONFIRM_LIVE = frozenset({FailureKind.DELETED, FailureKind.NO_PROGRESS, FailureKind.NODE_LOST})
Key = tuple[str, str]
PROGRESS_ANNOTATION = contract.PROGRESS_ANNOTATION


def _rv(obj: dict[str, Any]) -> int:
    try:
        return int(obj.get("metadata", {}).get("resourceVersion") or 0)
    except ValueError:
        return 0


def _api_message(exc: ApiException) -> str:
    """The API server's own message (the Status body), else the HTTP reason."""
    try:
        return str(json.loads(exc.body)["message"])
    except (TypeError, ValueError, KeyError):
        return str(exc.reason)


def namespace_terminating(exc: ApiException) -> bool:
    """403 NamespaceTerminating: nothing new can be created in a namespace being deleted (its jobs go too)."""
    if exc.status != 403:
        return False
    try:
        causes = (json.loads(exc.body).get("details") or {}).get("causes") or []
    except (TypeError, ValueError, AttributeError):
        return False
    return any(c.get("reason") == "NamespaceTerminating" for c in causes)


def node_not_ready_since(node: dict[str, Any]) -> datetime | None:
    for c in (node.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            return None if c.get("status") == "True" else parse_ts(c.get("lastTransitionTime")) or datetime.now(UTC)
    return None


class Controller:
    def __init__(
        self,
        api_client: client.ApiClient,
        settings: b.Settings | None = None,
        *,
        create_parallelism: int = 32,
        workers: int = 16,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ):
        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.rbac = client.RbacAuthorizationV1Api(api_client)
        self.settings = settings or b.Settings()
        self.clock = clock
        self.jobs: dict[Key, dict[str, Any]] = {}
        self.pods: dict[Key, dict[str, dict[str, Any]]] = {}
        self.tombstones: dict[tuple[str, str], int] = {}
        """(namespace, pod) -> resourceVersion of its DELETED event: an older copy (a late create
        response, a stale watch event) must not bring a deleted pod back into the cache."""
        self.nodes: dict[str, datetime | None] = {}
        self.pool = ThreadPoolExecutor(max_workers=create_parallelism, thread_name_prefix="kubetrain-io")
        self.n_workers = workers
        self.queue: asyncio.Queue[Key] | None = None
        self.queued: set[Key] = set()
        self.active: set[Key] = set()
        self.dirty: set[Key] = set()
        self.timers: dict[Key, asyncio.TimerHandle] = {}
        self.tasks: list[asyncio.Task[None]] = []
        self.first_running: set[Key] = set()
        self.leading = asyncio.Event()
        """Set while this replica may reconcile: always without leader election, else while it holds the Lease."""
        self.namespace: str | None = None

    # ------------------------------------------------------------------ caches (called from kopf handlers)

    def job_event(self, kind: str | None, body: dict[str, Any]) -> None:
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        if kind == "DELETED":
            self.jobs.pop(key, None)
            self.pods.pop(key, None)
            self.tombstones = {t: rv for t, rv in self.tombstones.items() if t[0] != key[0] or not
                               t[1].startswith(f"{key[1]}-worker-")}
            return
        if _rv(body) >= _rv(self.jobs.get(key, {})):
            self.jobs[key] = body
        self.enqueue(key)

    def pod_event(self, kind: str | None, body: dict[str, Any]) -> None:
        meta = body["metadata"]
        job = (meta.get("labels") or {}).get(b.LABEL_JOB)
        if not job:
            return
        key = (meta["namespace"], job)
        pods = self.pods.setdefault(key, {})
        tomb = (meta["namespace"], meta["name"])
        if kind == "DELETED":
            pods.pop(meta["name"], None)
            self.tombstones[tomb] = max(_rv(body), self.tombstones.get(tomb, 0))
        elif _rv(body) > self.tombstones.get(tomb, -1) and _rv(body) >= _rv(pods.get(meta["name"], {})):
            pods[meta["name"]] = body
            self.tombstones.pop(tomb, None)
        self.enqueue(key)

    def node_event(self, kind: str | None, body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        before = self.nodes.get(name)
        self.nodes[name] = None if kind == "DELETED" else node_not_ready_since(body)
        if before != self.nodes[name]:
            for key, pods in self.pods.items():
                if any((p.get("spec") or {}).get("nodeName") == name for p in pods.values()):
                    self.enqueue(key)

    # ------------------------------------------------------------------ queue

    def enqueue(self, key: Key, delay: float = 0.0) -> None:
        if self.queue is None:
            return
        if delay > 0:
            old = self.timers.pop(key, None)
            if old is not None:
                old.cancel()
            self.timers[key] = asyncio.get_running_loop().call_later(delay, self.enqueue, key)
            return
        if key in self.active:
            self.dirty.add(key)
        elif key not in self.queued:
            self.queued.add(key)
            self.queue.put_nowait(key)

    def sync_caches(self, namespace: str | None = None) -> None:
        """LIST jobs, pods and nodes once before reconciling, so that no decision is taken on a
        half-filled cache (a pod not yet seen would look deleted). Watch events then keep them fresh."""
        sanitize = self.api_client.sanitize_for_serialization
        selector = b.LABEL_JOB
        if namespace:
            pods = self.core.list_namespaced_pod(namespace, label_selector=selector).items
            jobs = self.custom.list_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.PLURAL)
        else:
            pods = self.core.list_pod_for_all_namespaces(label_selector=selector).items
            jobs = self.custom.list_cluster_custom_object(api.GROUP, api.VERSION, api.PLURAL)
        for pod in pods:
            self.pod_event(None, sanitize(pod))
        for node in self.core.list_node().items:
            self.node_event(None, sanitize(node))
        for job in jobs.get("items", []):
            job.setdefault("apiVersion", api.API_VERSION)
            job.setdefault("kind", api.KIND)
            self.job_event(None, job)

    async def start(self, namespace: str | None = None, leader_election: bool = False) -> None:
        """Fill the caches and start the workers; they reconcile at once, or (leader_election) only
        after start_leading()."""
        self.namespace = namespace
        await asyncio.get_running_loop().run_in_executor(self.pool, self.sync_caches, namespace)
        self.queue = asyncio.Queue()
        self.tasks = [asyncio.create_task(self._worker()) for _ in range(self.n_workers)]
        self.tasks.append(asyncio.create_task(self._gauges()))
        for key in list(self.jobs):
            self.enqueue(key)
        if not leader_election:
            metrics.LEADER.set(1)
            self.leading.set()

    async def start_leading(self) -> None:
        """This replica got the Lease: re-read everything (the standby's caches may lag), then act."""
        await asyncio.get_running_loop().run_in_executor(self.pool, self.sync_caches, self.namespace)
        metrics.LEADER.set(1)
        self.leading.set()

    def stop_leading(self) -> None:
        self.leading.clear()
        metrics.LEADER.set(0)

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        for t in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def _gauges(self) -> None:
        while True:
            self.count_phases()
            await asyncio.sleep(5.0)

    async def _worker(self) -> None:
        assert self.queue is not None
        while True:
            await self.leading.wait()
            key = await self.queue.get()
            if not self.leading.is_set():  # lost the Lease while waiting: keep the key for the next leader
                self.queue.put_nowait(key)
                continue
            self.queued.discard(key)
            self.active.add(key)
            try:
                requeue = await self.reconcile(key)
            except Exception as exc:  # noqa: BLE001 - one job's error must not stop the others
                reason = type(exc).__name__
                metrics.RECONCILE_ERRORS.labels(reason).inc()
                log.exception("reconcile of %s/%s failed; retrying", *key)
                requeue = 2.0
            finally:
                self.active.discard(key)
            if key in self.dirty:
                self.dirty.discard(key)
                self.enqueue(key)
            elif requeue is not None and key in self.jobs:
                self.enqueue(key, requeue)

    # ------------------------------------------------------------------ reconcile

    def progress_of(self, key: Key, body: dict[str, Any]) -> Progress | None:
        """Rank 0's progress, from the annotation on worker 0 of the current generation."""
        gen = str(((body.get("status") or {}).get("restartGeneration")) or 0)
        pod = self.pods.get(key, {}).get(b.worker_name(key[1], 0))
        if pod is None or (pod["metadata"].get("labels") or {}).get(b.LABEL_GENERATION) != gen:
            return None
        raw = (pod["metadata"].get("annotations") or {}).get(PROGRESS_ANNOTATION)
        if not raw:
            return None
        try:
            return Progress.model_validate_json(raw)
        except ValueError:
            return None

    async def reconcile(self, key: Key) -> float | None:
        body = self.jobs.get(key)
        if body is None:
            return None
        t0 = time.perf_counter()
        claim_phase = await self._claim_phase(key, body)
        p = self._plan(key, body, claim_phase)
        confirm = p.decision is not None and p.decision.failure_kind in CONFIRM_LIVE
        if confirm and await self._io(self.refresh_from_api, key):
            p = self._plan(key, body, claim_phase)
        await self.execute(key, body, p)
        metrics.RECONCILE_SECONDS.observe(time.perf_counter() - t0)
        return p.requeue_after

    def _plan(self, key: Key, body: dict[str, Any], claim_phase: str | None = None) -> Plan:
        pods = list(self.pods.get(key, {}).values())
        return plan(body, pods, self.nodes, self.clock(), self.settings, self.progress_of(key, body), claim_phase)

    async def _claim_phase(self, key: Key, body: dict[str, Any]) -> str | None:
        """The checkpoint claim's phase ("Missing" when absent), read live only while the scheduler says
        the job's pods wait for a volume (claims are not watched: one GET per such reconcile)."""
        name = claim_to_check(body, list(self.pods.get(key, {}).values()), self.clock())
        if name is None:
            return None
        try:
            claim = await self._io(self.core.read_namespaced_persistent_volume_claim, name, key[0])
        except ApiException as exc:
            if exc.status == 404:
                return "Missing"
            if exc.status == 403:  # no get on claims (a trimmed Role): say what the scheduler says, no more
                return None
            raise
        return (claim.status.phase if claim.status else None) or "Pending"

    def refresh_from_api(self, key: Key) -> bool:
        """Replace the cached pods of one job (and their nodes) with a live read; True if anything changed."""
        ns, name = key
        sanitize = self.api_client.sanitize_for_serialization
        live = {p.metadata.name: sanitize(p) for p in
                self.core.list_namespaced_pod(ns, label_selector=f"{b.LABEL_JOB}={name}").items}
        cached = self.pods.setdefault(key, {})
        changed = set(cached) != set(live) or any(_rv(live[n]) != _rv(cached[n]) for n in live)
        self.pods[key] = live
        for pod_name in live:
            self.tombstones.pop((ns, pod_name), None)
        for node_name in {(p.get("spec") or {}).get("nodeName") for p in live.values()} - {None}:
            try:
                ready = node_not_ready_since(sanitize(self.core.read_node(node_name)))
            except ApiException as exc:
                if exc.status != 404:
                    raise
                ready = None
            changed |= self.nodes.get(node_name) != ready
            self.nodes[node_name] = ready
        if changed:
            log.info("%s/%s: the cache lagged the API server; re-planned from a live read", ns, name)
        return changed

    async def _io(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, lambda: fn(*args, **kwargs))

    async def execute(self, key: Key, body: dict[str, Any], p: Plan) -> None:
        ns, name = key
        if p.create:
            # A RoleBinding is refused (404) while its Role does not exist: those two in order, the rest at once.
            rbac = [o for o in p.create if o["kind"] in ("Role", "RoleBinding")]
            rest = [self._create(ns, o, body) for o in p.create if o["kind"] not in ("Role", "RoleBinding")]
            await asyncio.gather(self._create_in_order(ns, rbac, body), *rest)
        if p.delete_pods:
            await asyncio.gather(*(self._delete_pod(key, pod) for pod in p.delete_pods))
        if p.status is not None:
            await self._write_status(key, body, p.status)
            self._observe_transitions(key, body, p)
        for type_, reason, message in p.events:
            await self._io(self._event, body, type_, reason, message)
        if p.delete_job:
            with contextlib.suppress(ApiException):
                await self._io(self.custom.delete_namespaced_custom_object, api.GROUP, api.VERSION, ns, api.PLURAL, name)

    async def _create_in_order(self, ns: str, objs: list[dict[str, Any]], job: dict[str, Any]) -> None:
        """Roles before RoleBindings; stops at the first object not created."""
        for obj in sorted(objs, key=lambda o: o["kind"] != "Role"):
            if not await self._create(ns, obj, job):
                return

    async def _create(self, ns: str, obj: dict[str, Any], job: dict[str, Any] | None = None) -> bool:
        """Create one child; True when it exists now (created, or 409: already there)."""
        kind = obj["kind"]
        try:
            if kind == "Pod":
                # The response as a plain dict, straight from its JSON: no V1Pod model to build and
                # then serialize back (a fifth of the operator's CPU when creating a 1024-pod gang).
                created = await self._io(self._create_pod_raw, ns, obj)
                metrics.PODS_CREATED.inc()
                self.pod_event("ADDED", created)
            elif kind == "Service":
                await self._io(self.core.create_namespaced_service, ns, obj)
            elif kind == "ConfigMap":
                await self._io(self.core.create_namespaced_config_map, ns, obj)
            elif kind == "PersistentVolumeClaim":
                await self._io(self.core.create_namespaced_persistent_volume_claim, ns, obj)
            elif kind == "PodGroup":
                group, version = obj["apiVersion"].split("/")
                await self._io(self.custom.create_namespaced_custom_object, group, version, ns, "podgroups", obj)
            elif kind == "Role":
                await self._io(self.rbac.create_namespaced_role, ns, obj)
            elif kind == "RoleBinding":
                await self._io(self.rbac.create_namespaced_role_binding, ns, obj)
        except ApiException as exc:
            if namespace_terminating(exc):
                # The namespace is being deleted with the job in it: no Event, no retry, nothing to fix.
                log.debug("%s/%s: not created, namespace %s is terminating", ns, obj["metadata"]["name"], ns)
                return False
            if exc.status == 403 and kind in ("Role", "RoleBinding") and job is not None:
                # The progress RBAC is not worth failing the job over: it trains, its status shows
                # no progress. (The operator lacks roles/rolebindings create or get/patch on pods.)
                await self._io(self._event, job, "Warning", "ProgressReportingForbidden",
                               f"could not create {kind} {obj['metadata']['name']}: {_api_message(exc)}; "
                               "rank 0 cannot report progress (status and progressDeadlineSeconds)")
                return False
            if exc.status != 409:  # AlreadyExists: an earlier reconcile (or operator) made it
                raise
        return True

    def _create_pod_raw(self, ns: str, obj: dict[str, Any]) -> dict[str, Any]:
        resp = self.core.create_namespaced_pod(ns, obj, _preload_content=False)
        return json.loads(resp.data)

    async def _delete_pod(self, key: Key, pod: str) -> None:
        try:
            await self._io(self.core.delete_namespaced_pod, pod, key[0])
        except ApiException as exc:
            if exc.status != 404:
                raise
        cached = self.pods.get(key, {}).get(pod)
        if cached is not None:  # keep it (as terminating) until the watch says it is gone
            cached["metadata"].setdefault("deletionTimestamp", self.clock().strftime("%Y-%m-%dT%H:%M:%SZ"))

    async def _write_status(self, key: Key, body: dict[str, Any], status: dict[str, Any]) -> None:
        old = body.get("status") or {}
        patch = {"status": {**{k: None for k in old if k not in status}, **status}}
        try:
            new = await self._io(
                self.custom.patch_namespaced_custom_object_status, api.GROUP, api.VERSION, key[0], api.PLURAL, key[1], patch
            )
        except ApiException as exc:
            if exc.status == 404:
                self.jobs.pop(key, None)
                return
            raise
        if _rv(new) >= _rv(self.jobs.get(key, {})):
            self.jobs[key] = new

    def _event(self, body: dict[str, Any], type_: str, reason: str, message: str) -> None:
        meta = body["metadata"]
        log.log(logging.WARNING if type_ == "Warning" else logging.INFO,
                "%s/%s: %s: %s", meta["namespace"], meta["name"], reason, message)
        now = self.clock()
        event = client.CoreV1Event(
            metadata=client.V1ObjectMeta(generate_name=f"{meta['name']}.", namespace=meta["namespace"]),
            involved_object=client.V1ObjectReference(
                api_version=api.API_VERSION, kind=api.KIND, name=meta["name"], namespace=meta["namespace"],
                uid=meta.get("uid"), resource_version=meta.get("resourceVersion"),
            ),
            type=type_, reason=reason, message=message[:1024],
            first_timestamp=now, last_timestamp=now, count=1,
            source=client.V1EventSource(component="kubetrain-operator"),
            reporting_component="kubetrain.io/operator", reporting_instance="kubetrain-operator",
        )
        try:
            self.core.create_namespaced_event(meta["namespace"], event)
        except ApiException as exc:  # an Event is best effort; never fail a reconcile over it
            log.warning("could not record event %s on %s: %s", reason, meta["name"], exc.reason)

    def _observe_transitions(self, key: Key, body: dict[str, Any], p: Plan) -> None:
        d = p.decision
        if d is None or p.status is None:
            return
        old = body.get("status") or {}
        now = self.clock()
        if d.action.value == "RestartGang":
            metrics.GANG_RESTARTS.labels(d.reason).inc()
        if p.status.get("phase") == "Running" and old.get("phase") != "Running":
            created = parse_ts(body["metadata"].get("creationTimestamp"))
            failed = parse_ts(old.get("lastFailureTime"))
            if failed is not None:
                metrics.RECOVERY_SECONDS.observe((now - failed).total_seconds())
            elif created is not None and key not in self.first_running:
                self.first_running.add(key)
                metrics.TIME_TO_RUNNING.observe((now - created).total_seconds())
        if p.status.get("phase") in ("Succeeded", "Failed") and old.get("phase") != p.status.get("phase"):
            metrics.JOBS_FINISHED.labels(p.status["phase"], p.status.get("reason", "")).inc()

    def count_phases(self) -> None:
        """Refresh the jobs-by-phase gauge (called periodically, not per reconcile; 0 on a standby
        replica, so that sums over replicas count each job once)."""
        counts: dict[str, int] = {}
        for body in self.jobs.values() if self.leading.is_set() else ():
            phase = (body.get("status") or {}).get("phase", "Pending")
            counts[phase] = counts.get(phase, 0) + 1
        for phase in ("Pending", "Created", "Running", "Restarting", "Suspended", "Succeeded", "Failed"):
            metrics.JOBS.labels(phase).set(counts.get(phase, 0))
