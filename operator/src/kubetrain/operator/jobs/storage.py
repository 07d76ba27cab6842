"""Checkpoint storage for a gang of several workers on a StorageClass that offers ReadWriteOnce only. Pure.

Several workers share the job's checkpoint claim, which needs ReadWriteMany; the clouds' default classes (EBS,
Persistent Disk, Azure Disk) offer ReadWriteOnce only, and such a claim would never bind. Before the job starts,
the operator reads its StorageClass (the job's storageClassName, else the cluster's default) and, where it offers
ReadWriteOnce only, keeps the checkpoints in the operator's object store (the chart's checkpointStore) under a
prefix of the job's own, recorded in status.checkpointStore and kept for the job's life; without a store the job
waits Pending, saying what would let it run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kubetrain.core import api
from kubetrain.core.api import TrainingJob, TrainingJobStatus
from kubetrain.operator.jobs.conditions import Want

DEFAULT_CLASS_ANNOTATIONS = ("storageclass.kubernetes.io/is-default-class",
                             "storageclass.beta.kubernetes.io/is-default-class")
LOOK_AGAIN_SECONDS = 30.0
"""A job waiting for shared storage looks again this often (StorageClasses and the chart's values are not watched)."""


@dataclass(frozen=True)
class ClassFacts:
    """What the live read of StorageClasses found for a job's claim."""

    name: str | None
    """The class the claim would get: the job's storageClassName, else the cluster's default (None: no default)."""
    provisioner: str | None = None
    read_write_many: bool | None = None
    """Whether its volumes can be shared by pods on several nodes; None: not known (then it is assumed)."""


def facts_of(classes: Sequence[dict[str, Any]], wanted: str | None) -> ClassFacts:
    """The facts of the class named `wanted` (None: the cluster's default), from a LIST of StorageClasses."""
    if wanted is None:
        defaults = [c for c in classes if any(((c.get("metadata") or {}).get("annotations") or {}).get(a) == "true"
                                              for a in DEFAULT_CLASS_ANNOTATIONS)]
        found = defaults[0] if len(defaults) == 1 else None
    else:
        found = next((c for c in classes if (c.get("metadata") or {}).get("name") == wanted), None)
    if found is None:
        return ClassFacts(wanted)
    meta, provisioner = found.get("metadata") or {}, found.get("provisioner")
    declared = ((meta.get("annotations") or {}).get(api.ACCESS_MODES_ANNOTATION) or "").replace(" ", "")
    if declared:
        shared: bool | None = "ReadWriteMany" in declared.split(",")
    else:
        shared = False if provisioner in api.RWO_ONLY_PROVISIONERS else None
    return ClassFacts(meta.get("name"), provisioner, shared)


def needs_shared_claim(spec: api.TrainingJobSpec) -> bool:
    """Several workers on the claim the operator creates, with the access mode left to it (ReadWriteMany)."""
    ck = spec.checkpoint
    return (spec.workers > 1 and not (ck.claim_name or ck.ephemeral or ck.uri) and ck.access_mode is None)


def to_read(body: dict[str, Any]) -> bool:
    """Whether this reconcile reads the StorageClasses: a job with several workers, not started, with no store
    recorded. Its runtime may still set the storage, so this looks at the stored spec loosely; place() decides."""
    spec, status = body.get("spec") or {}, body.get("status") or {}
    started = status.get("startTime") or status.get("restartCount") or status.get("checkpointStore")
    return not started and int(spec.get("workers") or 1) > 1


@dataclass(frozen=True)
class Placed:
    """The job with its checkpoint storage settled, or the condition it waits Pending with."""

    job: TrainingJob
    status: TrainingJobStatus
    waiting: Want | None = None


def place(job: TrainingJob, status: TrainingJobStatus, classes: Sequence[dict[str, Any]] | None,
          store: api.CheckpointStore | None) -> Placed:
    """The recorded store, else the operator's store where the job's class cannot share its claim. `classes`: the
    StorageClasses listed for this reconcile (None: not read)."""
    chosen = status.checkpoint_store
    started = bool(status.start_time or status.restart_count)
    found = facts_of(classes, job.spec.checkpoint.storage_class_name) if classes is not None else None
    if chosen is None and not started and found is not None and found.read_write_many is False \
            and needs_shared_claim(job.spec):
        if store is None or job.spec.s3 is not None:
            return Placed(job, status, no_shared_storage(job, found, store))
        chosen = store.for_job(job.metadata)
        status = status.model_copy(update={"checkpoint_store": chosen})
    if chosen is None:
        return Placed(job, status)
    spec = job.spec
    ck = spec.checkpoint.model_copy(update={"uri": chosen.uri})
    spec = spec.model_copy(update={"checkpoint": ck, "s3": spec.s3 or chosen.s3})
    return Placed(job.model_copy(update={"spec": spec}), status)


def no_shared_storage(job: TrainingJob, found: ClassFacts, store: api.CheckpointStore | None) -> Want:
    cls = f"StorageClass {found.name} ({found.provisioner})"
    ways = ("set spec.checkpoint.uri (object storage), spec.checkpoint.storageClassName to a ReadWriteMany class, "
            f"or the annotation {api.ACCESS_MODES_ANNOTATION} on {found.name} if it does offer ReadWriteMany")
    if store is None:
        why = f"and the operator has no checkpoint store (chart value checkpointStore): {ways}"
    else:
        why = (f"and the job's own spec.s3 would serve the operator's checkpoint store ({store.uri}) too: "
               f"set spec.checkpoint.uri in the job's own store, or {ways.split(', ', 1)[1]}")
    return Want(api.CHECKPOINTS_DURABLE, False, api.ConditionReason.NO_SHARED_STORAGE,
                f"{job.spec.workers} workers share one checkpoint claim, which needs ReadWriteMany; {cls} offers "
                f"ReadWriteOnce only, {why}; the job waits", bad_value=False)
