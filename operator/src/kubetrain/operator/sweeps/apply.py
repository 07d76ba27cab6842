"""The sweep applier: carries a sweeps.SweepPlan out against the API server.

Order matters: the sweep's status is written FIRST (one merge patch, on the resourceVersion the plan
was made from), and only then are trial jobs created, so that a crash between the two leaves a
recorded trial whose deterministic job the next reconcile creates, never a second job. A status
write that meets a conflict (409) does nothing else: the fresh sweep is cached and planned again.
Then the creates (409 of a job the sweep owns: already made; someone else's: a ForeignObject
Warning; a refusal such as a quota or an invalid field: a CreateRejected Warning, retried with
backoff), the suspends (spec.suspend=true: the pods go, the job and its checkpoint claim stay),
and the Events.

It shares the job applier's thread pool (the API calls in flight stay bounded for both) and its
Event recording; what it learns from its own writes goes into the SweepCache at once.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from kubernetes.client.rest import ApiException

from kubetrain.core import api, contract
from kubetrain.operator.jobs.apply import Applier, api_message, create_refused, namespace_terminating
from kubetrain.operator.runtime.objects import Key, merge_patch, owned_by, resource_version, uid_of
from kubetrain.operator.sweeps.cache import SweepCache
from kubetrain.operator.sweeps.plan import CREATE_REJECTED_REASON, FOREIGN_REASON, SweepPlan, foreign_message

log = logging.getLogger("kubetrain.operator")

SUSPEND_PATCH = {"spec": {"suspend": True}}
CreateWarning = tuple[str, str]
"""(reason, message) of a Warning Event about a trial job the sweep could not create."""


@dataclass(frozen=True)
class Outcome:
    """What carrying a plan out met."""

    written: bool
    """False: the status write met a conflict (or the sweep is gone); nothing else was done."""
    blocked: bool = False
    """A trial job create was refused, or its name is held by a job the sweep does not own."""


class SweepApplier:
    def __init__(self, applier: Applier, cache: SweepCache):
        self.applier = applier
        self.custom = applier.apis.custom
        self.cache = cache

    # ------------------------------------------------------------------ reads

    def list_sweeps(self, namespace: str | None) -> list[dict[str, Any]]:
        """LIST the sweeps (blocking; run it with io()); none while their CRD is not installed."""
        try:
            if namespace:
                found = self.custom.list_namespaced_custom_object(api.GROUP, api.VERSION, namespace, api.SWEEP_PLURAL)
            else:
                found = self.custom.list_cluster_custom_object(api.GROUP, api.VERSION, api.SWEEP_PLURAL)
        except ApiException as exc:
            if exc.status != 404:
                raise
            log.warning("no %s API (is its CRD installed?): sweeps are not served", api.SWEEP_PLURAL)
            return []
        items = list(found.get("items", []))
        for sweep in items:  # a LIST's items carry neither
            sweep.setdefault("apiVersion", api.API_VERSION)
            sweep.setdefault("kind", api.SWEEP_KIND)
        return items

    async def refresh(self, key: Key) -> None:
        """Replace the cached trial jobs of one sweep with a live LIST."""
        found = await self.applier.io(self.custom.list_namespaced_custom_object, api.GROUP, api.VERSION, key[0],
                                      api.PLURAL, label_selector=f"{contract.LABEL_SWEEP}={key[1]}")
        items = list(found.get("items", []))
        for job in items:
            job.setdefault("apiVersion", api.API_VERSION)
            job.setdefault("kind", api.KIND)
        self.cache.replace_jobs(key, items)

    # ------------------------------------------------------------------ carrying out a plan

    async def execute(self, key: Key, body: dict[str, Any], plan: SweepPlan) -> Outcome:
        if plan.status is not None and not await self.write_status(key, body, plan.status):
            return Outcome(written=False)
        await self._report_foreign(key, body, plan.foreign)
        refusals = await asyncio.gather(*(self.create(key, body, job) for job in plan.create))
        await asyncio.gather(*(self.suspend(key, name) for name in plan.suspend))
        for type_, reason, message in plan.events:
            await self.applier.io(self.applier.record_event, body, type_, reason, message)
        refused = next((r for r in refusals if r is not None), None)
        await self._report_refused(key, body, refused)
        return Outcome(written=True, blocked=any(r is not None for r in refusals))

    async def write_status(self, key: Key, body: dict[str, Any], status: dict[str, Any]) -> bool:
        """Replace the status in one merge patch (fields no longer there set to null), on the condition that
        the sweep is still the `body` it was planned from (its resourceVersion: 409 otherwise). False on a
        conflict (the fresh sweep is cached) or when the sweep is gone."""
        old = body.get("status") or {}
        patch: dict[str, Any] = {"status": merge_patch(old, status)}
        if rv := (body.get("metadata") or {}).get("resourceVersion"):
            patch["metadata"] = {"resourceVersion": rv}
        try:
            new = await self.applier.io(self.custom.patch_namespaced_custom_object_status, api.GROUP, api.VERSION,
                                        key[0], api.SWEEP_PLURAL, key[1], patch)
        except ApiException as exc:
            if exc.status == 404:  # deleted; its DELETED event follows
                self.cache.forget(key)
                return False
            if exc.status != 409:
                raise
            log.info("%s/%s: the sweep changed since it was read; planning again", *key)
            await self._reread(key)
            return False
        self._cache_sweep(key, new)
        return True

    async def _reread(self, key: Key) -> None:
        try:
            fresh = await self.applier.io(self.custom.get_namespaced_custom_object, api.GROUP, api.VERSION, key[0],
                                          api.SWEEP_PLURAL, key[1])
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.cache.forget(key)
            return
        self._cache_sweep(key, fresh)

    def _cache_sweep(self, key: Key, sweep: dict[str, Any]) -> None:
        cached = self.cache.sweep(key)  # None: deleted meanwhile, and not to be brought back
        if cached is not None and uid_of(cached) == uid_of(sweep) and resource_version(sweep) >= resource_version(cached):
            self.cache.sweep_event("MODIFIED", sweep)

    async def create(self, key: Key, sweep: dict[str, Any], job: dict[str, Any]) -> CreateWarning | None:
        """Create one trial job; None when it exists now as the sweep's, else the Warning to report."""
        name = job["metadata"]["name"]
        try:
            created = await self.applier.io(self.custom.create_namespaced_custom_object, api.GROUP, api.VERSION,
                                            key[0], api.PLURAL, job)
        except ApiException as exc:
            if exc.status == 409:  # AlreadyExists: made before a crash or a conflict, or someone else's
                return await self._owned(key, sweep, name)
            if namespace_terminating(exc):
                return None
            if create_refused(exc):
                return CREATE_REJECTED_REASON, f"TrainingJob {name} was refused: {api_message(exc)}"
            raise
        self.cache.job_event("ADDED", dict(created))
        return None

    async def _owned(self, key: Key, sweep: dict[str, Any], name: str) -> CreateWarning | None:
        try:
            existing = dict(await self.applier.io(self.custom.get_namespaced_custom_object, api.GROUP, api.VERSION,
                                                  key[0], api.PLURAL, name))
        except ApiException as exc:
            if exc.status == 404:  # deleted meanwhile: the next reconcile creates it
                return None
            raise
        if owned_by(existing, uid_of(sweep)):
            self.cache.job_event("MODIFIED", existing)
            return None
        why = "waiting until it is deleted" if existing["metadata"].get("deletionTimestamp") else "delete or rename it"
        return FOREIGN_REASON, f"TrainingJob {name} exists and is not owned by this TrainingSweep: not adopting it; {why}"

    async def suspend(self, key: Key, name: str) -> None:
        """Stop a trial: spec.suspend=true (its pods go, its job and checkpoint claim stay)."""
        try:
            job = await self.applier.io(self.custom.patch_namespaced_custom_object, api.GROUP, api.VERSION, key[0],
                                        api.PLURAL, name, SUSPEND_PATCH)
        except ApiException as exc:
            if exc.status == 404:  # already gone: nothing runs
                return
            raise
        self.cache.job_event("MODIFIED", dict(job))

    # ------------------------------------------------------------------ Warnings, once per change

    async def _report_foreign(self, key: Key, sweep: dict[str, Any], names: list[str]) -> None:
        reported = self.cache.reported(key)
        if names and tuple(names) != reported.foreign:
            await self.applier.io(self.applier.record_event, sweep, "Warning", FOREIGN_REASON, foreign_message(names))
        reported.foreign = tuple(names)

    async def _report_refused(self, key: Key, sweep: dict[str, Any], refused: CreateWarning | None) -> None:
        reported = self.cache.reported(key)
        if refused is not None and refused != reported.refused:
            await self.applier.io(self.applier.record_event, sweep, "Warning", refused[0], refused[1])
        reported.refused = refused
