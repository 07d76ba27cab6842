"""What the operator knows of the cluster: TrainingJobs, their worker pods, and the nodes' readiness.

Fed by watch events (the kopf handlers), by one LIST before reconciling, and by the applier's
own writes (so a plan does not wait for the watch to report them). In memory and synchronous,
called from the event loop's thread only; each method returns the jobs worth reconciling and
leaves the queueing to the caller.

Everything kept for a job hangs off its entry: forgetting the job drops its pods and tombstones
with it, and a pod event for a job the cache does not know is ignored, so deleted jobs (whose
pods are deleted after them) leave nothing behind. A pod is kept under a job only when the job
(by uid) owns it: a job deleted and created again under the same name must not take the old
job's pods, which the garbage collector is deleting, nor a pod someone else made with its labels.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kubetrain.core import contract
from kubetrain.core.progress import Progress
from kubetrain.operator.jobs import builders as b
from kubetrain.operator.jobs.pod_facts import disrupted
from kubetrain.operator.runtime.objects import (
    DELETED,
    Key,
    in_scope,
    owned_by,
    resource_version,
    slim,
    uid_of,
    version_number,
)


def node_not_ready_since(node: dict[str, Any], now: datetime) -> datetime | None:
    """When a node stopped being Ready (`now` if it does not say); None while Ready or never reported."""
    for c in (node.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            return None if c.get("status") == "True" else contract.parse_time(c.get("lastTransitionTime")) or now
    return None


def termination_taint(node: dict[str, Any], keys: Iterable[str]) -> str | None:
    """The first of `keys` among the node's taints (it is about to go), or None."""
    present = {t.get("key") for t in (node.get("spec") or {}).get("taints") or []}
    return next((k for k in keys if k in present), None)


def _node_of(pod: dict[str, Any]) -> str | None:
    return (pod.get("spec") or {}).get("nodeName")


def slim_pod(pod: dict[str, Any]) -> dict[str, Any]:
    """A pod as the operator reads it: metadata, status, its node, restart policy, tolerations and the gang probe's
    variable (pod_facts: the pod's readiness then says whether its processes lost their peers). The containers,
    volumes and scheduling of the spec the operator wrote itself were most of each cached pod's memory.
    In place."""
    spec = pod.get("spec") or {}
    probed = [{"name": c.get("name"), "env": [e for e in c.get("env") or [] if e.get("name") == contract.GANG_PROBE_PORT]}
              for c in spec.get("containers") or [] if c.get("name") == b.CONTAINER]
    pod["spec"] = {k: spec[k] for k in ("nodeName", "restartPolicy", "tolerations") if spec.get(k)}
    if probed and probed[0]["env"]:  # pod_facts reads from it whether the pod's readiness is the gang probe's
        pod["spec"]["containers"] = probed
    return slim(pod)


@dataclass
class _Job:
    body: dict[str, Any]
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    tombstones: dict[str, int] = field(default_factory=dict)
    """pod name -> resourceVersion of its DELETED event: an older copy (a late create response, a
    stale watch event) must not bring a deleted pod back. Worker names repeat across generations,
    so there are at most as many as the job has workers."""
    disrupted: dict[str, dict[str, Any]] = field(default_factory=dict)
    """pod name -> its last copy, for deleted pods that carried DisruptionTarget (preempted, evicted):
    the pod may be gone before the job is reconciled, and a disruption is not counted as a failure."""
    read_live: datetime | None = None
    """When the job's pods were last replaced by a live read (Applier.refresh)."""
    progress_refused: bool = False
    """The API refused this job's progress Role or RoleBinding (rank 0 cannot report progress)."""
    create_refused: str | None = None
    """The API server's message refusing the job's last refused pod create (quota, Pod Security,
    an invalid field); None once every create of a plan succeeded."""
    foreign: str | None = None
    """"<Kind> <name>" of a child the job needs whose name is taken by an object it does not own."""
    workload: dict[str, Any] | None = None
    """The job's Kueue Workload (jobs with scheduling.queue), as last seen."""
    kueue_missing: bool = False
    """The API server answered 404 to the job's Workload create: Kueue is not installed."""
    workload_foreign: str | None = None
    """Why the job's Workload could not be created: its name is held by a Workload the job does not own."""
    progress_mark: tuple[int, int, datetime] | None = None
    """(generation, step, when first seen) of rank 0's newest progress record."""
    status_written: datetime | None = None
    """When this operator last wrote the job's status (None: not since it started or took over)."""


class WatchCache:
    def __init__(self, termination_taints: Iterable[str] = ()) -> None:
        self._jobs: dict[Key, _Job] = {}
        self.nodes: dict[str, datetime | None] = {}
        """Node name -> since when it is not Ready (None: Ready); only nodes that reported."""
        self.termination_taints = tuple(termination_taints)
        self.terminating: dict[str, str] = {}
        """Node name -> the termination taint it carries (one of termination_taints): it is about to go."""
        self.node_names: set[str] = set()
        """Every node the watch or a LIST told of: the cluster's size, for lifecycle.cluster_disruption."""
        self.silent: dict[str, datetime] = {}
        """Node name -> when its kubelet last renewed its Lease, for nodes found silent for NODE_SILENT_SECONDS
        while a job on them had lost peers (Controller.check_silent): NotReady to the lifecycle until the
        node lifecycle controller says so or the Lease is renewed."""
        self.unanswering: dict[str, datetime] = {}
        """Node name -> when a peer's launcher found the job's worker there not answering (plan.unanswering_nodes):
        silent from then until its kubelet renews its Lease after it (Controller._check_silence)."""

    # ------------------------------------------------------------------ reads

    def keys(self) -> list[Key]:
        return list(self._jobs)

    def jobs(self) -> Iterator[dict[str, Any]]:
        return (j.body for j in self._jobs.values())

    def job(self, key: Key) -> dict[str, Any] | None:
        entry = self._jobs.get(key)
        return entry.body if entry else None

    def pods(self, key: Key) -> list[dict[str, Any]]:
        entry = self._jobs.get(key)
        return list(entry.pods.values()) if entry else []

    def pod(self, key: Key, name: str) -> dict[str, Any] | None:
        entry = self._jobs.get(key)
        return entry.pods.get(name) if entry else None

    def size(self) -> int:
        """Entries kept: jobs, their pods and tombstones, and nodes (what a leak would grow)."""
        return len(self.nodes) + sum(1 + len(j.pods) + len(j.tombstones) + len(j.disrupted)
                                     for j in self._jobs.values())

    def disrupted(self, key: Key) -> list[dict[str, Any]]:
        """The last copies of the job's deleted pods that were disrupted."""
        entry = self._jobs.get(key)
        return list(entry.disrupted.values()) if entry else []

    def progress_refused(self, key: Key) -> bool:
        entry = self._jobs.get(key)
        return entry is not None and entry.progress_refused

    def set_progress_refused(self, key: Key, refused: bool) -> None:
        if (entry := self._jobs.get(key)) is not None:
            entry.progress_refused = refused

    def create_refused(self, key: Key) -> str | None:
        entry = self._jobs.get(key)
        return entry.create_refused if entry else None

    def set_create_refused(self, key: Key, message: str | None) -> None:
        if (entry := self._jobs.get(key)) is not None:
            entry.create_refused = message

    def foreign(self, key: Key) -> str | None:
        entry = self._jobs.get(key)
        return entry.foreign if entry else None

    def set_foreign(self, key: Key, what: str | None) -> None:
        if (entry := self._jobs.get(key)) is not None:
            entry.foreign = what

    def workload(self, key: Key) -> dict[str, Any] | None:
        entry = self._jobs.get(key)
        return entry.workload if entry else None

    def kueue_missing(self, key: Key) -> bool:
        entry = self._jobs.get(key)
        return entry is not None and entry.kueue_missing

    def set_kueue_missing(self, key: Key, missing: bool) -> None:
        if (entry := self._jobs.get(key)) is not None:
            entry.kueue_missing = missing

    def workload_foreign(self, key: Key) -> str | None:
        entry = self._jobs.get(key)
        return entry.workload_foreign if entry else None

    def set_workload_foreign(self, key: Key, message: str | None) -> None:
        if (entry := self._jobs.get(key)) is not None:
            entry.workload_foreign = message

    def workload_event(self, kind: str | None, body: dict[str, Any]) -> Key | None:
        """Keep the newer copy of a job's Workload (the job must own it); the job's key, or None."""
        meta = body["metadata"]
        job = (meta.get("labels") or {}).get(contract.LABEL_JOB)
        entry = self._jobs.get((meta["namespace"], job)) if job else None
        if entry is None or not owned_by(body, uid_of(entry.body)):
            return None
        if kind == DELETED:
            if entry.workload is not None and entry.workload["metadata"]["name"] == meta["name"]:
                entry.workload = None
        elif entry.workload is None or resource_version(body) >= resource_version(entry.workload):
            entry.workload = body
            entry.kueue_missing, entry.workload_foreign = False, None
        return (meta["namespace"], str(job))

    def progress(self, key: Key) -> Progress | None:
        """Rank 0's progress: the annotation on worker 0 of the job's current generation."""
        body = self.job(key)
        pod = self.pod(key, b.worker_name(key[1], 0))
        if body is None or pod is None:
            return None
        generation = str((body.get("status") or {}).get("restartGeneration") or 0)
        if (pod["metadata"].get("labels") or {}).get(contract.LABEL_GENERATION) != generation:
            return None
        raw = (pod["metadata"].get("annotations") or {}).get(contract.PROGRESS_ANNOTATION)
        if not raw:
            return None
        try:
            return Progress.model_validate_json(raw)
        except ValueError:
            return None

    def status_written(self, key: Key) -> datetime | None:
        entry = self._jobs.get(key)
        return entry.status_written if entry else None

    def set_status_written(self, key: Key, now: datetime) -> None:
        if (entry := self._jobs.get(key)) is not None:
            entry.status_written = now

    def progress_seen(self, key: Key, progress: Progress | None, now: datetime) -> datetime | None:
        """When this reconcile's progress record (its generation and step) was first seen: `now` for a new
        one. The status may take a step later than it came (progress-only writes are spaced out), and its
        lastProgressTime must still say when the job got there."""
        entry = self._jobs.get(key)
        if entry is None or progress is None:
            return None
        mark = entry.progress_mark
        if mark is None or mark[:2] != (progress.generation, progress.step):
            mark = entry.progress_mark = (progress.generation, progress.step, now)
        return mark[2]

    # ------------------------------------------------------------------ watch events

    def job_event(self, kind: str | None, body: dict[str, Any]) -> Key:
        """Keep the newer copy of a job (or forget it on DELETED); the job's key."""
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        if kind == DELETED:
            self.forget(key)
            return key
        entry = self._jobs.get(key)
        body = slim(body)
        if entry is None:
            self._jobs[key] = _Job(body)
        elif resource_version(body) >= resource_version(entry.body):
            if uid_of(body) == uid_of(entry.body):
                entry.body = body
            else:  # a new job under a known name (its predecessor's DELETED missed): nothing carries over
                self._jobs[key] = _Job(body)
        return key

    def forget(self, key: Key) -> None:
        """Drop a job and everything kept for it."""
        self._jobs.pop(key, None)

    def pod_event(self, kind: str | None, body: dict[str, Any]) -> Key | None:
        """Keep a worker pod under its job; the job's key, or None when no known job owns it. A pod with
        the job's label that the job does not own is never kept; while a name the job needs is taken
        by such an object, its events still return the job's key (its going frees the name)."""
        meta = body["metadata"]
        job = (meta.get("labels") or {}).get(contract.LABEL_JOB)
        key = (meta["namespace"], job) if job else None
        entry = self._jobs.get(key) if key else None
        if key is None or entry is None:
            return None
        if not owned_by(body, uid_of(entry.body)):
            return key if entry.foreign is not None else None
        name = meta["name"]
        rv = resource_version(body)
        if kind == DELETED:
            entry.pods.pop(name, None)
            entry.tombstones[name] = max(rv, entry.tombstones.get(name, 0))
            if disrupted(body):
                entry.disrupted[name] = slim_pod(body)
        elif rv > entry.tombstones.get(name, -1) and rv >= resource_version(entry.pods.get(name, {})):
            entry.pods[name] = slim_pod(body)
            entry.tombstones.pop(name, None)
        return key

    def node_event(self, kind: str | None, body: dict[str, Any], now: datetime) -> list[Key]:
        """Record a node's readiness and termination taint; the jobs with a pod on it when either changed."""
        name = body["metadata"]["name"]
        if kind == DELETED:
            self.node_names.discard(name)
        else:
            self.node_names.add(name)
        since = None if kind == DELETED else node_not_ready_since(body, now)
        taint = None if kind == DELETED else termination_taint(body, self.termination_taints)
        ready_changed, taint_changed = self.set_node(name, since), self.terminating.get(name) != taint
        if taint is None:
            self.terminating.pop(name, None)
        else:
            self.terminating[name] = taint
        return self.jobs_on(name) if ready_changed or taint_changed else []

    # ------------------------------------------------------------------ live reads and own writes

    def set_node(self, name: str, not_ready_since: datetime | None) -> bool:
        """Record a node's readiness (None: Ready or gone); True when that changed."""
        before = self.nodes.get(name)
        if not_ready_since is not None or before is not None:  # NotReady says more; back from NotReady: heard
            self.silent.pop(name, None)
            self.unanswering.pop(name, None)
        if not_ready_since is None:
            self.nodes.pop(name, None)  # a Ready node and an unknown one read the same: keep neither
        else:
            self.nodes[name] = not_ready_since
        return before != not_ready_since

    def jobs_on(self, node: str) -> list[Key]:
        return [key for key, j in self._jobs.items() if any(_node_of(p) == node for p in j.pods.values())]

    def nodes_of(self, key: Key) -> set[str]:
        """The nodes the job's cached pods run on."""
        return {n for p in self.pods(key) if (n := _node_of(p)) is not None}

    def read_live(self, key: Key) -> datetime | None:
        entry = self._jobs.get(key)
        return entry.read_live if entry else None

    def replace_pods(self, key: Key, live: dict[str, dict[str, Any]], now: datetime) -> bool:
        """A job's pods as a live read at `now` found them; True when the cache had them otherwise."""
        entry = self._jobs.get(key)
        if entry is None:
            return False
        entry.read_live = now
        live = {n: p for n, p in live.items() if owned_by(p, uid_of(entry.body))}
        cached = entry.pods
        changed = set(cached) != set(live) or any(
            resource_version(live[n]) != resource_version(cached[n]) for n in live)
        entry.pods = {n: slim_pod(p) for n, p in live.items()}
        for name in live:
            entry.tombstones.pop(name, None)
        return changed

    def jobs_missing_from(self, listed: list[dict[str, Any]], version: str, scope: str | None = None) -> list[Key]:
        """The cached jobs a LIST at `version` lacks though they are no newer than it: deleted while no watch
        told (a relist after a gap, a standby's takeover). Only those in the LIST's `scope` (its namespace;
        None: the cluster): another namespace's jobs are not in it."""
        names = {(j["metadata"].get("namespace") or "", j["metadata"]["name"]) for j in listed}
        at = version_number(version)
        return [key for key, entry in self._jobs.items()
                if in_scope(key[0], scope) and key not in names and resource_version(entry.body) <= at]

    def nodes_missing_from(self, listed: list[dict[str, Any]]) -> list[str]:
        """The NotReady or terminating nodes kept that a LIST of nodes lacks: deleted since (and forgotten from
        node_names)."""
        names = {n["metadata"]["name"] for n in listed}
        self.node_names &= names
        return sorted({*self.nodes, *self.terminating} - names)

    def missing_from(self, listed: list[dict[str, Any]], version: str, scope: str | None = None) -> list[dict[str, Any]]:
        """The cached pods a LIST at `version` lacks though they are no newer than it: deleted since they
        were cached. (A pod cached from the response to a create after the LIST is newer and stays.) Only
        those in the LIST's `scope`, as jobs_missing_from."""
        names = {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in listed}
        at = version_number(version)
        return [pod for (ns, _), entry in self._jobs.items() if in_scope(ns, scope) for name, pod in entry.pods.items()
                if (ns, name) not in names and resource_version(pod) <= at]

    def mark_deleting(self, key: Key, pod: str, now: datetime) -> None:
        """A pod we asked to delete stays (as terminating) until the watch says it is gone."""
        cached = self.pod(key, pod)
        if cached is not None:
            cached["metadata"].setdefault("deletionTimestamp", contract.format_time(now))
