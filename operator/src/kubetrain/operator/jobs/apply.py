"""The applier: the operator's one module that talks to the API server.

It carries out a reconcile.Plan: creates the children (all at once, bounded; a Role before its
RoleBinding; 409 means already there, and it counts as created only when the job owns it), deletes
pods, starts the pods' patches (they land behind the reconcile: pod_patches.py), writes the status
ONCE (on the resourceVersion the plan was made from), records Events and deletes a job whose time
is up. A pod create the API server refuses (quota, Pod Security, an
invalid field) and a child's name taken by a foreign object are kept in the WatchCache for the
next plan's status, with one Warning Event each time they change. A gang's PodGroup is created before
its pods, which wait while it is not (a 404: the cluster does not serve the gang scheduler's kind). It also makes the few reads the
controller needs: the LIST that fills the caches, a live look at one job's pods and nodes, a
checkpoint claim's phase.

The kubernetes client blocks, so every call runs on a thread pool as wide as the API calls
allowed in flight. What the applier learns from its own writes (a created pod, a new status)
goes into the WatchCache at once, on the event loop's thread, so that the next plan does not
wait for the watch to report it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar, cast

import pydantic_core
import urllib3
from kubernetes import client
from kubernetes.client import rest
from kubernetes.client.rest import ApiException

from kubetrain.core import api, contract
from kubetrain.core.api import TrainingJobStatus
from kubetrain.operator.jobs.builders import GANGS
from kubetrain.operator.jobs.cache import WatchCache, node_not_ready_since
from kubetrain.operator.jobs.conditions import gang_missing, is_gang_missing
from kubetrain.operator.jobs.pod_patches import PodPatches
from kubetrain.operator.jobs.runtimes import RuntimeLookup
from kubetrain.operator.runtime import metrics
from kubetrain.operator.runtime.objects import (
    DELETED,
    Key,
    foreign_message,
    list_pages,
    merge_patch,
    owned_by,
    resource_version,
    uid_of,
)
from kubetrain.operator.runtime.ratelimit import TokenBucket

if TYPE_CHECKING:
    from kubetrain.operator.jobs.plan import Plan

log = logging.getLogger("kubetrain.operator")
T = TypeVar("T")

CLAIM_MISSING = "Missing"
"""The phase claim_phase() reports for a checkpoint claim that does not exist."""
CLAIM_PENDING = "Pending"
"""A claim without a status yet, as the API server would report it."""
ORDERED = ("Role", "RoleBinding")
"""Kinds created one after the other: a RoleBinding is refused (404) while its Role does not exist."""
BEFORE_PODS = ("PodGroup", "ServiceAccount", "NetworkPolicy")
"""Kinds the pods need first: pods made without their PodGroup would be scheduled one by one, bypassing the
gang; a pod whose ServiceAccount does not exist yet is refused; a pod started before its NetworkPolicy would
take connections from anyone until it exists."""
REFUSABLE = ("Pod", "ServiceAccount", "NetworkPolicy")
"""Kinds whose refused create (a 4xx) the job shows (status, one Event) and retries with backoff."""


API_TIMEOUT = (10.0, 60.0)
"""Seconds to connect and to wait for an answer, on every call the reconciles make: generous for a page of a
LIST or a create under load, and an end to a call on a connection that went half-open."""


NODE_LEASES = "kube-node-lease"
"""Where each kubelet renews its node's Lease (every 10 s by default, kubelet's nodeLeaseDurationSeconds / 4)."""


@dataclass(frozen=True)
class Apis:
    """The API groups the operator calls, on one ApiClient."""

    core: client.CoreV1Api
    custom: client.CustomObjectsApi
    rbac: client.RbacAuthorizationV1Api
    sanitize: Callable[[Any], Any]
    """A client model as the plain dict its JSON would be."""
    post: Callable[[str, dict[str, str], bytes, str], bytes]
    """POST (path template, its parameters, a JSON body already serialized, Accept): the answer's body."""

    @classmethod
    def of(cls, api_client: client.ApiClient) -> Apis:
        return cls(cast(client.CoreV1Api, Unvalidated(client.CoreV1Api(api_client))),
                   cast(client.CustomObjectsApi, Unvalidated(client.CustomObjectsApi(api_client))),
                   cast(client.RbacAuthorizationV1Api, Unvalidated(client.RbacAuthorizationV1Api(api_client))),
                   api_client.sanitize_for_serialization, RawPost(api_client))


class Unvalidated:
    """An API group whose calls skip the client's per-call argument validation (pydantic validate_call):
    the operator passes plain dicts it built itself, and validating a pod's body was three quarters of
    the client-side cost of creating it (about 400 of 500 us)."""

    def __init__(self, api: Any) -> None:
        self._api = api
        self._bound: dict[str, Callable[..., Any]] = {}

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if (bound := self._bound.get(name)) is None:
            method = getattr(type(self._api), name)
            raw = getattr(method, "raw_function", method).__get__(self._api)
            # A deadline on every call (a caller's own _request_timeout wins): a half-open connection to an API
            # server that went away must not hold a reconcile, and its job, for ever.
            call = functools.partial(raw, _request_timeout=API_TIMEOUT)
            bound = self._bound[name] = _counted(name, call) if name.startswith(metrics.WRITE_VERBS) else call
        return bound


def _counted(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        metrics.count_write(name)
        return call(*args, **kwargs)
    return counted


class RawPost:
    """A POST on the client's own connections and credentials, of a body its caller serialized: the
    kubernetes client would walk the body to sanitize it, then serialize it, and only sends what is
    JSON to it as JSON."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self._client = api_client

    def __call__(self, path: str, params: dict[str, str], body: bytes, accept: str) -> bytes:
        metrics.count_write(f"create_{path.rsplit('/', 1)[-1]}")
        _, url, headers, _, _ = self._client.param_serialize(
            "POST", path, path_params=params, header_params={"Content-Type": "application/json", "Accept": accept},
            auth_settings=["BearerToken"])
        try:
            answer = rest.RESTResponse(self._client.rest_client.pool_manager.request(
                "POST", url, body=body, headers=headers, preload_content=False,
                timeout=urllib3.Timeout(connect=API_TIMEOUT[0], read=API_TIMEOUT[1])))
        except urllib3.exceptions.SSLError as exc:  # as the client's own calls report it
            raise ApiException(status=0, reason=f"{type(exc).__name__}\n{exc}") from exc
        data: bytes = answer.read()
        if not 200 <= answer.status <= 299:
            raise ApiException.from_response(http_resp=answer, body=None, data=None)
        return data


PATHS = {
    "Pod": "/api/v1/namespaces/{namespace}/pods",
    "Service": "/api/v1/namespaces/{namespace}/services",
    "ConfigMap": "/api/v1/namespaces/{namespace}/configmaps",
    "ServiceAccount": "/api/v1/namespaces/{namespace}/serviceaccounts",
    "PersistentVolumeClaim": "/api/v1/namespaces/{namespace}/persistentvolumeclaims",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings",
    "NetworkPolicy": "/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies",
    "Event": "/api/v1/namespaces/{namespace}/events",
}
"""Where the kinds the operator creates with Apis.post are created (all namespaced)."""
METADATA_ONLY = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1, application/json"
"""The Accept of a create: the API server answers with the new object's metadata alone (a whole pod, with
its field managers, was a third of the client's CPU per pod), or the whole object where it cannot."""


def _post(apis: Apis, ns: str, obj: dict[str, Any]) -> bytes:
    """Create `obj` in `ns`: the answer's body, unparsed. The body is serialized here, once."""
    return apis.post(PATHS[obj["kind"]], {"namespace": ns}, json.dumps(obj).encode(), METADATA_ONLY)


def _create_pod(apis: Apis, ns: str, obj: dict[str, Any]) -> dict[str, Any]:
    return created_pod(obj, pydantic_core.from_json(_post(apis, ns, obj)))


def created_pod(sent: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    """The pod a create made, as the cache keeps it: the answer's metadata (uid, resourceVersion) on the
    spec that was sent, Pending as every new pod is, until the watch says more."""
    if answer.get("kind") == "Pod":
        return answer
    return {"apiVersion": "v1", "kind": "Pod", "metadata": answer["metadata"], "spec": sent.get("spec") or {},
            "status": {"phase": "Pending"}}


def _patch_pod(apis: Apis, ns: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
    # The answer as a plain dict, straight from its JSON: no V1Pod model to build and serialize back.
    return json.loads(apis.core.patch_namespaced_pod(name, ns, patch, _preload_content=False).data)


def _delete_pod(apis: Apis, ns: str, name: str, force: bool, uid: str | None = None) -> None:
    # The answer (the pod, Terminating) read but not parsed: a V1Pod model per pod cost milliseconds each
    # when a whole gang of a thousand is deleted; the watch brings what changed. Read, so that the
    # connection goes back to the pool. `uid`: the delete holds for that pod only (409 for a newer namesake).
    options = client.V1DeleteOptions(grace_period_seconds=0 if force else None,
                                     preconditions=client.V1Preconditions(uid=uid) if uid else None)
    apis.core.delete_namespaced_pod(name, ns, body=options, _preload_content=False).read()


def _create_pod_group(apis: Apis, ns: str, obj: dict[str, Any]) -> Any:
    group, version = obj["apiVersion"].split("/")
    return apis.custom.create_namespaced_custom_object(group, version, ns, "podgroups", obj)


CREATE: dict[str, Callable[[Apis, str, dict[str, Any]], Any]] = {
    **{kind: _post for kind in PATHS if kind != "Event"},
    "Pod": _create_pod,
    "PodGroup": _create_pod_group,
}
"""The API call that creates each kind of child a plan may hold."""


def _read_pod_group(apis: Apis, ns: str, obj: dict[str, Any]) -> Any:
    group, version = obj["apiVersion"].split("/")
    return apis.custom.get_namespaced_custom_object(group, version, ns, "podgroups", obj["metadata"]["name"])


READ: dict[str, Callable[[Apis, str, dict[str, Any]], Any]] = {
    "Pod": lambda apis, ns, obj: apis.core.read_namespaced_pod(obj["metadata"]["name"], ns),
    "Service": lambda apis, ns, obj: apis.core.read_namespaced_service(obj["metadata"]["name"], ns),
    "ConfigMap": lambda apis, ns, obj: apis.core.read_namespaced_config_map(obj["metadata"]["name"], ns),
    "ServiceAccount": lambda apis, ns, obj: apis.core.read_namespaced_service_account(obj["metadata"]["name"], ns),
    "PersistentVolumeClaim": lambda apis, ns, obj: apis.core.read_namespaced_persistent_volume_claim(
        obj["metadata"]["name"], ns),
    "PodGroup": _read_pod_group,
    "Role": lambda apis, ns, obj: apis.rbac.read_namespaced_role(obj["metadata"]["name"], ns),
    "RoleBinding": lambda apis, ns, obj: apis.rbac.read_namespaced_role_binding(obj["metadata"]["name"], ns),
    # The generic read (GET /apis/{group}/{version}/...) serves built-in groups too: no API group just for it.
    "NetworkPolicy": lambda apis, ns, obj: apis.custom.get_namespaced_custom_object(
        "networking.k8s.io", "v1", ns, "networkpolicies", obj["metadata"]["name"]),
}
"""The API call that reads the object whose name a create found taken (409), to see who owns it."""
NOT_REFUSALS = frozenset({408, 409, 429})
"""4xx answers that say nothing against the object: a timeout, a conflict, throttling (retried as errors)."""


def api_message(exc: ApiException) -> str:
    """The API server's own message (the Status body), else the HTTP reason."""
    try:
        return str(json.loads(exc.body)["message"])
    except (TypeError, ValueError, KeyError):
        return str(exc.reason)


def create_refused(exc: ApiException) -> bool:
    """The API server will not create this object as it is (quota, admission, validation): a 4xx."""
    return exc.status is not None and 400 <= exc.status < 500 and exc.status not in NOT_REFUSALS


def gang_not_created(job: dict[str, Any], status: dict[str, Any] | None) -> dict[str, Any] | None:
    """The status to write for a plan some of whose creates were refused or found their name taken.
    The lifecycle marks the gang created (every worker of the generation made, so a missing one was
    deleted) when it plans the creates, on the word that the operator writes that status only once
    they all succeeded; the job keeps its previous gangCreated instead, so that a worker never
    created is created again at the next reconcile, not counted as a deleted one."""
    field_name = TrainingJobStatus.model_fields["gang_created"].alias or "gang_created"
    if status is None or not status.get(field_name):
        return status
    return {**status, field_name: bool((job.get("status") or {}).get(field_name))}


POD_GROUP_MANAGED = ("minMember", "minResources")
"""PodGroup spec fields the operator keeps as the job says; the schedulers may default others (queue)."""


def pod_group_spec(existing: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any] | None:
    """The spec an existing PodGroup of the job needs now, or None when it has it: the desired fields over
    the existing ones, managed fields the desired spec lacks removed."""
    have = dict(existing.get("spec") or {})
    want = dict(desired.get("spec") or {})
    spec = {k: v for k, v in have.items() if k not in POD_GROUP_MANAGED} | want
    return None if spec == have else spec


def per_generation(pod_group: dict[str, Any]) -> bool:
    """A PodGroup made anew for each generation, whose spec is immutable (gang kubernetes)."""
    return any(g.per_generation and g.api_version == pod_group["apiVersion"] for g in GANGS.values())


def namespace_terminating(exc: ApiException) -> bool:
    """403 NamespaceTerminating: nothing new can be created in a namespace being deleted (its jobs go too)."""
    if exc.status != 403:
        return False
    try:
        causes = (json.loads(exc.body).get("details") or {}).get("causes") or []
    except (TypeError, ValueError, AttributeError):
        return False
    return any(c.get("reason") == "NamespaceTerminating" for c in causes)


def event_body(job: dict[str, Any], type_: str, reason: str, message: str, now: datetime) -> dict[str, Any]:
    """A core/v1 Event about a TrainingJob, or a TrainingSweep (its `kind`); the API server keeps at most
    1024 characters of message."""
    meta = job["metadata"]
    at = contract.format_time(now)
    involved = {"apiVersion": api.API_VERSION, "kind": job.get("kind") or api.KIND, "name": meta["name"],
                "namespace": meta["namespace"], "uid": meta.get("uid"), "resourceVersion": meta.get("resourceVersion")}
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {k: v for k, v in involved.items() if v is not None},
        "type": type_, "reason": reason, "message": message[:1024],
        "firstTimestamp": at, "lastTimestamp": at, "count": 1,
        "source": {"component": "kubetrain-operator"},
        "reportingComponent": "kubetrain.io/operator", "reportingInstance": "kubetrain-operator",
    }


@dataclass
class Creation:
    """What the creates of one plan met, by (kind, name): refusals (the API server's message) and
    names taken by objects the job does not own ("<Kind> <name>", the Event's message)."""

    refused: dict[tuple[str, str], str] = field(default_factory=dict)
    foreign: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)

    def first(self, objs: list[dict[str, Any]]) -> tuple[str | None, tuple[str, str] | None]:
        """The refusal and the foreign object met first in plan order (stable across retries)."""
        order = [(o["kind"], o["metadata"]["name"]) for o in objs]
        return (next((self.refused[k] for k in order if k in self.refused), None),
                next((self.foreign[k] for k in order if k in self.foreign), None))


@dataclass(frozen=True)
class JobList:
    """The jobs one LIST returned (plain dicts) and the version of its snapshot."""

    jobs: list[dict[str, Any]]
    version: str = "0"
    scope: str | None = None
    """The namespace listed (None: every namespace): a job cached elsewhere is not missing from it."""


@dataclass(frozen=True)
class Snapshot:
    """Jobs (one LIST per watched namespace, or one over the cluster) and nodes, as plain dicts (the pods are
    the pod watches'), with the versions of their snapshots."""

    jobs: list[JobList]
    nodes: list[dict[str, Any]]
    nodes_version: str = "0"


class Applier:
    def __init__(self, apis: Apis, cache: WatchCache, parallelism: int, clock: Callable[[], datetime],
                 patch_failed: Callable[[Key], None] = lambda key: None, limit: TokenBucket | None = None):
        self.apis = apis
        self.limit = limit or TokenBucket(0, 1)
        """The client-side rate limit of the calls made through io() (none by default)."""
        self.sanitize = apis.sanitize
        self.cache = cache
        self.clock = clock
        self.pool = ThreadPoolExecutor(max_workers=parallelism, thread_name_prefix="kubetrain-io")
        self.patches = PodPatches(self.patch_pod, patch_failed, in_flight=max(1, parallelism // 2))
        """Pod patches behind their reconcile, on at most half the pool (a create always finds a thread);
        `patch_failed(job)` when one fails."""

    async def io(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """One blocking API call on the pool, once the rate limit lets it go."""
        if (wait := self.limit.reserve(time.monotonic())) > 0:
            await asyncio.sleep(wait)
        return await asyncio.get_running_loop().run_in_executor(self.pool, lambda: fn(*args, **kwargs))

    def close(self) -> None:
        self.patches.cancel()
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ reads

    def list_all(self, scopes: Iterable[str | None]) -> Snapshot:
        """LIST the jobs in each scope (a namespace; None: every namespace) and the nodes, page by page
        (blocking; run it with io())."""
        jobs = [self._list_jobs(scope) for scope in scopes]
        nodes, nodes_version = list_pages(self.apis.core.list_node, sanitize=self.sanitize)
        return Snapshot(jobs, nodes, nodes_version)

    def _list_jobs(self, namespace: str | None) -> JobList:
        custom = self.apis.custom
        if namespace:
            items, version = list_pages(custom.list_namespaced_custom_object, api.GROUP, api.VERSION, namespace,
                                        api.PLURAL)
        else:
            items, version = list_pages(custom.list_cluster_custom_object, api.GROUP, api.VERSION, api.PLURAL)
        for job in items:  # a LIST's items carry neither
            job.setdefault("apiVersion", api.API_VERSION)
            job.setdefault("kind", api.KIND)
        return JobList(items, version, namespace)

    def _node_heard_at(self, name: str) -> datetime | None:
        """When the node's kubelet last renewed its Lease (None: no Lease, the operator may not read it, or the
        read failed: a hint that never holds a reconcile back, whose restart may be decided on other grounds)."""
        try:
            lease = self.apis.custom.get_namespaced_custom_object("coordination.k8s.io", "v1", NODE_LEASES,
                                                                  "leases", name)
        except Exception as exc:  # noqa: BLE001 - any failure reads as "not known"
            if not isinstance(exc, ApiException) or exc.status not in (403, 404):
                log.info("node %s: its Lease could not be read: %s", name, exc)
            return None
        return contract.parse_time((lease.get("spec") or {}).get("renewTime"))

    async def node_heard_at(self, name: str) -> datetime | None:
        return await self.io(self._node_heard_at, name)

    def _node_not_ready_since(self, name: str, now: datetime) -> datetime | None:
        try:
            return node_not_ready_since(self.sanitize(self.apis.core.read_node(name)), now)
        except ApiException as exc:
            if exc.status != 404:
                raise
            return None

    async def read_runtime(self, ns: str, ref: api.RuntimeRef) -> RuntimeLookup:
        """A job's runtime as the API server stores it, or why there is none (not found, not readable)."""
        custom = self.apis.custom
        try:
            if ref.kind == api.CLUSTER_RUNTIME_KIND:
                found = await self.io(custom.get_cluster_custom_object, api.GROUP, api.VERSION,
                                      api.CLUSTER_RUNTIME_PLURAL, ref.name)
            else:
                found = await self.io(custom.get_namespaced_custom_object, api.GROUP, api.VERSION, ns,
                                      api.RUNTIME_PLURAL, ref.name)
        except ApiException as exc:
            if exc.status == 404:
                return RuntimeLookup(missing="not found")
            if exc.status == 403:
                return RuntimeLookup(missing="the operator may not read it (403): its ClusterRole lacks "
                                     "the runtimes (upgrade the chart)")
            raise
        return RuntimeLookup(body=dict(found))

    async def refresh(self, key: Key) -> bool:
        """Replace one job's cached pods (and their nodes' readiness) with a live read; True when
        the cache had lagged. Failures judged from what the cache lacks are confirmed this way."""
        ns, name = key
        pods = await self.io(self.apis.core.list_namespaced_pod, ns, label_selector=f"{contract.LABEL_JOB}={name}")
        live = {p.metadata.name: self.sanitize(p) for p in pods.items}
        now = self.clock()
        changed = self.cache.replace_pods(key, live, now)
        for node in sorted(self.cache.nodes_of(key)):
            changed |= self.cache.set_node(node, await self.io(self._node_not_ready_since, node, now))
        if changed:
            log.info("%s/%s: the cache lagged the API server; re-planned from a live read", ns, name)
        return changed

    async def storage_classes(self) -> list[dict[str, Any]] | None:
        """The cluster's StorageClasses (storage.place reads their names, default annotations and provisioners);
        None when the operator may not list them (a trimmed ClusterRole: claims are then made as before)."""
        try:
            found = await self.io(self.apis.custom.list_cluster_custom_object, "storage.k8s.io", "v1", "storageclasses")
        except ApiException as exc:
            if exc.status == 403:
                return None
            raise
        return [{"metadata": c.get("metadata") or {}, "provisioner": c.get("provisioner")}
                for c in (found or {}).get("items") or []]

    async def claim_phase(self, ns: str, name: str) -> str | None:
        """A claim's phase (CLAIM_MISSING when absent); None when the operator may not read claims."""
        try:
            claim = await self.io(self.apis.core.read_namespaced_persistent_volume_claim, name, ns)
        except ApiException as exc:
            if exc.status == 404:
                return CLAIM_MISSING
            if exc.status == 403:  # no get on claims (a trimmed Role): say what the scheduler says, no more
                return None
            raise
        return (claim.status.phase if claim.status else None) or CLAIM_PENDING

    # ------------------------------------------------------------------ carrying out a plan

    async def execute(self, key: Key, body: dict[str, Any], plan: Plan) -> bool:
        """Carry the plan out; False when the job changed since `body` was read (the status write met
        409): the fresh job is cached, and neither its Events nor a job deletion are made on stale data."""
        status = plan.status
        if plan.create and not await self.create_all(key, body, plan.create):
            status = gang_not_created(body, status)
        # Deletes before patches, and patches behind the reconcile: a failed worker's successor waits
        # for its name to be free, not for the kept pods' patches (one per pod of a large gang).
        if plan.delete_pods or plan.force_delete_pods:
            await asyncio.gather(*(self.delete_pod(key, pod, uid=plan.pod_uids.get(pod)) for pod in plan.delete_pods),
                                 *(self.delete_pod(key, pod, force=True, uid=plan.pod_uids.get(pod))
                                   for pod in plan.force_delete_pods))
        if plan.patch_pods:
            self.patches.start(key, plan.patch_pods)
        if status is not None and not await self.write_status(key, body, status):
            return False
        # Together, not one after the other: a job's first reconcile records two or three, and with a
        # thousand jobs starting, each round trip held a reconcile worker that the next job waited for.
        await asyncio.gather(*(self.io(self.record_event, body, type_, reason, message)
                               for type_, reason, message in plan.events))
        if plan.delete_job:
            await self.delete_job(key)
        return True

    async def create_all(self, key: Key, body: dict[str, Any], objs: list[dict[str, Any]]) -> bool:
        """Create the plan's children; False when one was refused or its name is taken. What they met
        goes into the cache, replacing the last plan's, with one Warning Event each time it changes
        (not one per retry)."""
        seen = Creation()
        first = [o for o in objs if o["kind"] in BEFORE_PODS]
        if first and not all(await asyncio.gather(*(self.create(key[0], o, body, seen) for o in first))):
            objs = [o for o in objs if o["kind"] != "Pod"]
        ordered = [o for o in objs if o["kind"] in ORDERED]
        pods = [o for o in objs if o["kind"] == "Pod"]
        rest = [self.create(key[0], o, body, seen) for o in objs if o["kind"] not in (*ORDERED, *BEFORE_PODS, "Pod")]
        await asyncio.gather(self._create_in_order(key[0], ordered, body, seen),
                             self._slow_start(key[0], pods, body, seen), *rest)
        refused, foreign = seen.first(objs)
        if refused is not None and refused != self.cache.create_refused(key):
            reason = api.ConditionReason.GANG_SCHEDULER_MISSING if is_gang_missing(refused) \
                else api.ConditionReason.CREATE_REJECTED
            await self.io(self.record_event, body, "Warning", reason, refused)
        if foreign is not None and foreign[0] != self.cache.foreign(key):
            await self.io(self.record_event, body, "Warning", api.ConditionReason.FOREIGN_OBJECT, foreign[1])
        self.cache.set_create_refused(key, refused)
        self.cache.set_foreign(key, None if foreign is None else foreign[0])
        return refused is None and foreign is None

    async def _create_in_order(self, ns: str, objs: list[dict[str, Any]], job: dict[str, Any],
                               seen: Creation) -> None:
        """In ORDERED's order; stops at the first object not created."""
        for obj in sorted(objs, key=lambda o: ORDERED.index(o["kind"])):
            if not await self.create(ns, obj, job, seen):
                return
        self.cache.set_progress_refused((ns, job["metadata"]["name"]), False)

    async def _slow_start(self, ns: str, pods: list[dict[str, Any]], job: dict[str, Any], seen: Creation) -> None:
        """Pods in batches of 1, 2, 4, ... (the Job controller's slow start), each batch at once; stops after a
        batch with a pod not created: a quota or an admission webhook that refuses the first is not sent the
        hundreds after it (nor again on every retry)."""
        start, size = 0, 1
        while start < len(pods):
            batch = pods[start:start + size]
            if not all(await asyncio.gather(*(self.create(ns, o, job, seen) for o in batch))):
                return
            start, size = start + size, size * 2

    async def create(self, ns: str, obj: dict[str, Any], job: dict[str, Any], seen: Creation) -> bool:
        """Create one child of `job`; True when it exists now (created, or 409 and the job owns it)."""
        kind = obj["kind"]
        if kind not in CREATE:
            raise ValueError(f"no API call creates a {kind}")
        try:
            created = await self.io(CREATE[kind], self.apis, ns, obj)
        except ApiException as exc:
            if exc.status == 409:  # AlreadyExists: an earlier reconcile (or operator) made it, or not
                return await self._owned(ns, obj, job, seen)
            return await self._refused(ns, obj, job, exc, seen)
        if kind == "Pod":
            metrics.PODS_CREATED.inc()
            self.cache.pod_event("ADDED", created)
        return True

    async def _owned(self, ns: str, obj: dict[str, Any], job: dict[str, Any], seen: Creation) -> bool:
        """Whether the object already there under `obj`'s name is the job's own (its ownerReferences
        name the job's uid). Someone else's, or an earlier job's of the same name, is never adopted."""
        kind, name = obj["kind"], obj["metadata"]["name"]
        try:
            existing = self.sanitize(await self.io(READ[kind], self.apis, ns, obj))
        except ApiException as exc:
            if exc.status != 403:  # 404: deleted meanwhile; the retry creates it
                raise
            log.debug("%s/%s: may not read %s to check its owner; taking it as ours", ns, name, kind)
            return True
        if owned_by(existing, uid_of(job)):
            if kind == "ConfigMap" and existing.get("data") != obj.get("data"):
                # The spec changed (workers, say): the new gang must read the new config.json.
                await self.io(self.apis.core.patch_namespaced_config_map, name, ns, {"data": obj.get("data")})
            if kind == "PodGroup" and not per_generation(obj) and (spec := pod_group_spec(existing, obj)) is not None:
                # Kept across generations; a resized gang (spec.workers) needs the new minMember and minResources.
                await self.io(self._replace_pod_group, ns, {**existing, "spec": spec})
            return True
        seen.foreign[(kind, name)] = (f"{kind} {name}", foreign_message(kind, name, existing))
        return False

    def _replace_pod_group(self, ns: str, obj: dict[str, Any]) -> None:
        group, version = obj["apiVersion"].split("/")
        try:
            self.apis.custom.replace_namespaced_custom_object(group, version, ns, "podgroups",
                                                              obj["metadata"]["name"], obj)
        except ApiException as exc:
            if exc.status != 403:
                raise
            # A Role without update on podgroups: the gang still starts where the old spec allows it.
            log.warning("%s/%s: may not update the PodGroup's spec to %s (grant update on podgroups): %s", ns,
                        obj["metadata"]["name"], obj["spec"], api_message(exc))

    async def _refused(self, ns: str, obj: dict[str, Any], job: dict[str, Any], exc: ApiException,
                       seen: Creation) -> bool:
        """A create refused for a reason a retry alone does not fix: False; anything else raises."""
        kind, name = obj["kind"], obj["metadata"]["name"]
        if namespace_terminating(exc):
            # The namespace is being deleted with the job in it: no Event, no retry, nothing to fix.
            log.debug("%s/%s: not created, namespace %s is terminating", ns, name, ns)
            return False
        if exc.status == 403 and kind in ORDERED:
            # The progress RBAC is not worth failing the job over: it trains, its status shows
            # no progress. (The operator lacks roles/rolebindings create or get/patch on pods.)
            self.cache.set_progress_refused((ns, job["metadata"]["name"]), True)
            await self.io(self.record_event, job, "Warning", api.ConditionReason.PROGRESS_REPORTING_FORBIDDEN,
                          f"could not create {kind} {name}: {api_message(exc)}; "
                          "rank 0 cannot report progress (status and progressDeadlineSeconds)")
            return False
        if kind == "PodGroup" and exc.status == 404:  # the API server does not serve the gang scheduler's kind
            seen.refused[(kind, name)] = gang_missing(obj["apiVersion"])
            return False
        if kind in REFUSABLE and create_refused(exc):
            # Quota, Pod Security, an invalid field, an operator whose RBAC predates the job's ServiceAccount
            # or lacks networkpolicies create (workerNetworkPolicy on, rbac.create off):
            # the job says so (status, one Event) and is retried with backoff, since a raised quota or a
            # relabelled namespace admits the pod unchanged.
            metrics.CREATES_REFUSED.labels(str(exc.status)).inc()
            seen.refused[(kind, name)] = api_message(exc)
            return False
        raise exc

    async def patch_pod(self, key: Key, pod: str, meta: dict[str, dict[str, str]]) -> None:
        """Merge labels and annotations into a worker pod (Plan.patch_pods); gone already: nothing to do."""
        try:
            new = await self.io(_patch_pod, self.apis, key[0], pod, {"metadata": meta})
        except ApiException as exc:
            if exc.status != 404:
                raise
            return
        self.cache.pod_event("MODIFIED", new)

    async def delete_pod(self, key: Key, pod: str, force: bool = False, uid: str | None = None) -> None:
        """Delete a worker pod; `force`: grace 0, for a pod on a lost node whose kubelet cannot confirm; `uid`:
        only that pod (a 409 says the name is a newer pod's now: the one planned for is gone)."""
        try:
            await self.io(_delete_pod, self.apis, key[0], pod, force, uid)
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise
            cached = self.cache.pod(key, pod)  # gone already: its DELETED may never come
            if cached is not None and uid in (None, cached["metadata"].get("uid")):
                self.cache.pod_event(DELETED, cached)
            return
        self.cache.mark_deleting(key, pod, self.clock())

    async def write_status(self, key: Key, body: dict[str, Any], status: dict[str, Any]) -> bool:
        """Replace the status in one merge patch (fields no longer there set to null), on the condition
        that the job is still the `body` the status was planned from: its resourceVersion in the patch
        makes the API server answer 409 if anyone wrote the job since. False then: the fresh job is
        cached for the next plan, and nothing is written over what another writer wrote. When only the
        spec or metadata changed (the status is still `body`'s), the status is written onto the fresh
        job all the same: it records what this plan has already done (a gang created at the old size,
        which a resize must then restart, not top up)."""
        try:
            await self._patch_status(key, body, status)
            return True
        except ApiException as exc:
            if exc.status == 404:  # the job is gone; its DELETED event follows
                self.cache.forget(key)
                return True
            if exc.status != 409:
                raise
        metrics.STATUS_CONFLICTS.inc()
        fresh = await self._reread_job(key)
        if fresh is not None and uid_of(fresh) == uid_of(body) and fresh.get("status") == body.get("status"):
            with contextlib.suppress(ApiException):  # a second conflict: the next plan starts from it
                await self._patch_status(key, fresh, status)
        return False

    async def _patch_status(self, key: Key, body: dict[str, Any], status: dict[str, Any]) -> None:
        old = body.get("status") or {}
        patch: dict[str, Any] = {"status": merge_patch(old, status)}
        if rv := (body.get("metadata") or {}).get("resourceVersion"):
            patch["metadata"] = {"resourceVersion": rv}
        new = await self.io(self.apis.custom.patch_namespaced_custom_object_status,
                            api.GROUP, api.VERSION, key[0], api.PLURAL, key[1], patch)
        self.cache_job(key, new)
        self.cache.set_status_written(key, self.clock())

    async def _reread_job(self, key: Key) -> dict[str, Any] | None:
        try:
            fresh = await self.io(self.apis.custom.get_namespaced_custom_object,
                                  api.GROUP, api.VERSION, key[0], api.PLURAL, key[1])
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.cache.forget(key)
            return None
        self.cache_job(key, fresh)
        return cast(dict[str, Any], fresh)

    def cache_job(self, key: Key, job: dict[str, Any]) -> None:
        cached = self.cache.job(key)  # None: deleted meanwhile, and not to be brought back
        if cached is not None and resource_version(job) >= resource_version(cached):
            self.cache.job_event("MODIFIED", job)

    def record_event(self, job: dict[str, Any], type_: str, reason: str, message: str) -> None:
        """Log and record an Event (blocking; best effort: a reconcile never fails over one)."""
        meta = job["metadata"]
        log.log(logging.WARNING if type_ == "Warning" else logging.INFO,
                "%s/%s: %s: %s", meta["namespace"], meta["name"], reason, message)
        try:
            _post(self.apis, meta["namespace"], event_body(job, type_, reason, message, self.clock()))
        except ApiException as exc:
            log.warning("could not record event %s on %s: %s", reason, meta["name"], exc.reason)

    async def delete_job(self, key: Key) -> None:
        try:
            await self.io(self.apis.custom.delete_namespaced_custom_object,
                          api.GROUP, api.VERSION, key[0], api.PLURAL, key[1])
        except ApiException as exc:
            if exc.status != 404:
                raise
