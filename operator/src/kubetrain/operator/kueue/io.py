"""Kueue's side of a reconcile, against the API server: what a queued job's plan needs to know (the
ResourceFlavors of its admission, the value of its priority class) and carrying out its QueuePlan
(the Workload created, replaced, updated, deactivated or activated).

Flavors and priority classes are cluster-scoped and rarely change: each is read at most once per
LOOKUP_TTL seconds. Workloads themselves come from the watch (handlers.py) into the WatchCache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from kubernetes.client.rest import ApiException

from kubetrain.core import contract
from kubetrain.core.api import TrainingJob
from kubetrain.core.validate import stored_object
from kubetrain.operator.kueue import plan as kueue
from kubetrain.operator.runtime.objects import Key, foreign_message, owned_by, uid_of

log = logging.getLogger("kubetrain.operator")

LOOKUP_TTL = 30.0
"""Seconds a ResourceFlavor's spec or a priority class's value is reused before it is read again."""
K = (contract.KUEUE_GROUP, contract.KUEUE_VERSION)
Io = Callable[..., Awaitable[Any]]
"""Runs a blocking API call on the operator's API pool: `await io(fn, *args)`."""


class WorkloadCache(Protocol):
    """What Kueue's side keeps per job in the job controller's watch cache."""

    def workload(self, key: Key) -> dict[str, Any] | None: ...
    def kueue_missing(self, key: Key) -> bool: ...
    def set_kueue_missing(self, key: Key, missing: bool) -> None: ...
    def workload_foreign(self, key: Key) -> str | None: ...
    def set_workload_foreign(self, key: Key, message: str | None) -> None: ...
    def workload_event(self, kind: str | None, body: dict[str, Any]) -> Key | None: ...


class KueueIO:
    def __init__(self, io: Io, custom: Any, cache: WorkloadCache):
        """`custom`: the CustomObjectsApi."""
        self.io, self.custom, self.cache = io, custom, cache
        self._lookups: dict[tuple[str, str], tuple[float, Any]] = {}

    # ------------------------------------------------------------------ reads

    async def view(self, key: Key, body: dict[str, Any]) -> kueue.QueueView:
        """What plan() needs of Kueue for this job (an empty view for a job without a LocalQueue)."""
        cache = self.cache
        if not (((body.get("spec") or {}).get("scheduling") or {}).get("queue")):
            return kueue.QueueView()  # most jobs: not parsed twice
        job, _, _ = stored_object(TrainingJob, body)
        if job is None:  # a spec this operator refuses: the job fails, and its Workload is finished
            return kueue.QueueView(cache.workload(key))
        if kueue.kueue_queue(job) is None:
            return kueue.QueueView()
        wl = cache.workload(key)
        priority, missing = (None, None) if wl is not None else await self._priority(body, job)
        flavors = {n: (await self._lookup("resourceflavors", n) or {}).get("spec") or {} for n in kueue.flavor_names(wl)}
        return kueue.QueueView(wl, flavors, priority, missing, cache.kueue_missing(key), cache.workload_foreign(key))

    async def _priority(self, body: dict[str, Any], job: TrainingJob) -> tuple[tuple[str, str, int] | None, str | None]:
        """The Workload's priority: the job's Kueue WorkloadPriorityClass label, else its pods' PriorityClass."""
        name = ((body.get("metadata") or {}).get("labels") or {}).get(contract.KUEUE_PRIORITY_CLASS_LABEL)
        if name:
            wpc = await self._lookup("workloadpriorityclasses", name)
            if wpc is None:
                return None, (f"WorkloadPriorityClass {name} (label {contract.KUEUE_PRIORITY_CLASS_LABEL}) "
                              "does not exist")
            return (kueue.WORKLOAD_PRIORITY_SOURCE, name, int(wpc.get("value") or 0)), None
        if (pc := job.spec.scheduling.priority_class_name) is not None:
            pclass = await self._lookup("priorityclasses", pc)
            if pclass is None:
                return None, f"PriorityClass {pc} (spec.scheduling.priorityClassName) does not exist"
            return (kueue.POD_PRIORITY_SOURCE, pc, int(pclass.get("value") or 0)), None
        return None, None

    async def _lookup(self, plural: str, name: str) -> dict[str, Any] | None:
        """A cluster-scoped object (ResourceFlavor, WorkloadPriorityClass, PriorityClass); None when it does not exist."""
        now = time.monotonic()
        hit = self._lookups.get((plural, name))
        if hit is not None and now - hit[0] < LOOKUP_TTL:
            return hit[1]
        custom = self.custom
        try:
            if plural == "priorityclasses":
                obj = await self.io(custom.get_cluster_custom_object, "scheduling.k8s.io", "v1", plural, name)
            else:
                obj = await self.io(custom.get_cluster_custom_object, *K, plural, name)
        except ApiException as exc:
            if exc.status != 404:
                raise
            obj = None
        self._lookups[(plural, name)] = (now, obj)
        return obj

    def list_workloads(self, namespace: str | None) -> list[dict[str, Any]]:
        """LIST the jobs' Workloads (blocking; [] where Kueue is not installed)."""
        custom = self.custom
        try:
            if namespace:
                out = custom.list_namespaced_custom_object(*K, namespace, contract.WORKLOAD_PLURAL,
                                                           label_selector=contract.LABEL_JOB)
            else:
                out = custom.list_cluster_custom_object(*K, contract.WORKLOAD_PLURAL, label_selector=contract.LABEL_JOB)
        except ApiException as exc:
            if exc.status not in (403, 404):
                raise
            return []
        return list(out.get("items", []))

    # ------------------------------------------------------------------ writes

    async def carry_out(self, key: Key, body: dict[str, Any], q: kueue.QueuePlan) -> None:
        """The Workload's create, delete, status or spec.active (its watch event re-plans the job)."""
        if q.create is not None:
            await self._create(key, body, q.create)
        if q.delete is not None:
            await self._delete(key, q.delete)
        wl = self.cache.workload(key)
        if q.workload_status is not None and wl is not None:
            await self._write_status(key, wl, q.workload_status)
        if q.active is not None and wl is not None:
            await self._activate(key, wl, q.active)

    async def _create(self, key: Key, body: dict[str, Any], obj: dict[str, Any]) -> None:
        custom, cache = self.custom, self.cache
        try:
            created = await self.io(custom.create_namespaced_custom_object, *K, key[0],
                                            contract.WORKLOAD_PLURAL, obj)
        except ApiException as exc:
            if exc.status == 404:  # the API server does not serve Workloads
                cache.set_kueue_missing(key, True)
                return
            if exc.status != 409:
                raise
            created = await self.io(custom.get_namespaced_custom_object, *K, key[0],
                                            contract.WORKLOAD_PLURAL, obj["metadata"]["name"])
            if not owned_by(created, uid_of(body)):  # never adopted; said on the job, looked at again
                cache.set_workload_foreign(key, foreign_message("Workload", obj["metadata"]["name"], created))
                return
        cache.workload_event("ADDED", created)

    async def _delete(self, key: Key, name: str) -> None:
        try:
            await self.io(self.custom.delete_namespaced_custom_object, *K, key[0],
                                  contract.WORKLOAD_PLURAL, name)
        except ApiException as exc:
            if exc.status != 404:
                raise

    async def _write_status(self, key: Key, wl: dict[str, Any], status: dict[str, Any]) -> None:
        """On the Workload's resourceVersion: a 409 means Kueue wrote it meanwhile; its event re-plans."""
        patch = {"metadata": {"resourceVersion": wl["metadata"]["resourceVersion"]}, "status": status}
        try:
            new = await self.io(self.custom.patch_namespaced_custom_object_status, *K, key[0],
                                        contract.WORKLOAD_PLURAL, wl["metadata"]["name"], patch)
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise
            return
        self.cache.workload_event("MODIFIED", new)

    async def _activate(self, key: Key, wl: dict[str, Any], active: bool) -> None:
        """spec.active on the Workload: false stops it (Kueue evicts it and queues it no more), true queues it."""
        try:
            patch = {"metadata": {"annotations": {contract.WORKLOAD_SUSPENDED_ANNOTATION: None if active else "true"}},
                     "spec": {"active": active}}
            new = await self.io(self.custom.patch_namespaced_custom_object, *K, key[0], contract.WORKLOAD_PLURAL,
                                wl["metadata"]["name"], patch)
        except ApiException as exc:
            if exc.status != 404:
                raise
            return
        log.info("%s/%s: Workload %s %s", key[0], key[1], wl["metadata"]["name"],
                 "activated" if active else "deactivated (the job is suspended)")
        self.cache.workload_event("MODIFIED", new)
