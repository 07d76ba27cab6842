"""spec.runtimeRef in the operator: which runtime to read, and the job's spec over it. Pure.

The runtime is read live (JobController) until the job first starts (status.startTime): each reconcile applies
the runtime as it is then, and records it in status.runtime. From then on, status.runtime is what applies, read no more:
an admin's edit of a runtime changes no job that runs (its restarts keep the image and fabric it started with),
and deleting a runtime stops none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from kubetrain.core import api
from kubetrain.core.api import AppliedRuntime, TrainingJob, TrainingJobStatus
from kubetrain.core.runtimes import resolve
from kubetrain.operator.jobs.conditions import Want

RUNTIME_LOOK_AGAIN_SECONDS = 10.0
"""A job waiting for its runtime looks again this often (runtimes are read, not watched)."""


@dataclass(frozen=True)
class RuntimeLookup:
    """What the live read of a job's runtime found: its object, or why there is none."""

    body: dict[str, Any] | None = None
    missing: str | None = None
    """Why there is no runtime: not found, or the operator may not read it."""


@dataclass(frozen=True)
class WithRuntime:
    """A job with its runtime applied: the job to plan, and the status to start from; or why it cannot run."""

    job: TrainingJob
    status: TrainingJobStatus
    problems: list[str]
    own: api.TrainingJobSpec = field(default_factory=api.TrainingJobSpec)
    """The job's own spec, before its runtime."""
    """Refusals (a locked field set, a spec the merge makes invalid): the job fails, naming them."""
    waiting: Want | None = None
    """The runtime is not there: the job waits Pending with this condition."""
    trusted_fabric: bool = False
    """The fabric comes from a ClusterTrainingRuntime: a cluster admin chose its host-level needs."""
    own_template: dict[str, Any] | None = None
    """The podTemplate the operator's podPolicy judges: the job's own where a ClusterTrainingRuntime's lies under
    it (the cluster admin's), else the merged one (a namespace's TrainingRuntime is held to the policy too)."""
    ignored: list[str] = field(default_factory=list)
    """A started job's edits that a lock overrides (kept as the runtime has them)."""


def to_read(body: dict[str, Any]) -> api.RuntimeRef | None:
    """The runtime to read live for this reconcile of a stored job: its spec.runtimeRef, until the job has left
    Pending with that runtime recorded in status.runtime."""
    raw = (body.get("spec") or {}).get("runtimeRef")
    try:
        ref = api.RuntimeRef.model_validate(raw) if raw else None
    except ValidationError:
        return None  # plan() says what is wrong with the spec
    status = body.get("status") or {}
    recorded = status.get("runtime") or {}
    started = bool(status.get("startTime") or status.get("restartCount"))
    if ref is None or (started and (recorded.get("kind"), recorded.get("name")) == (ref.kind, ref.name)):
        return None
    return ref


def _recorded(ref: api.RuntimeRef, status: TrainingJobStatus) -> bool:
    return status.runtime is not None and (status.runtime.kind, status.runtime.name) == (ref.kind, ref.name)


def with_runtime(job: TrainingJob, status: TrainingJobStatus, lookup: RuntimeLookup | None) -> WithRuntime:
    """The job over its runtime: the recorded one when no live read was made (it started), else the one read."""
    ref = job.spec.runtime_ref
    if ref is None:
        return WithRuntime(job, status, [], job.spec, own_template=job.spec.pod_template)
    if lookup is None and _recorded(ref, status):
        assert status.runtime is not None
        applied = status.runtime
    elif lookup is None or lookup.body is None:
        why = (lookup.missing if lookup is not None else None) or "not read yet"
        return WithRuntime(job, status, [], job.spec, waiting=not_found(ref, why))
    else:
        meta = lookup.body.get("metadata") or {}
        applied = AppliedRuntime(kind=ref.kind, name=ref.name, resource_version=meta.get("resourceVersion"),
                                 spec=lookup.body.get("spec") or {})
    try:
        runtime = api.TrainingRuntimeSpec.model_validate(applied.spec)
    except ValidationError as exc:
        bad = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        return WithRuntime(job, status, [f"spec.runtimeRef: {ref.kind} {ref.name} is not valid: {bad}"], job.spec)
    started = bool(status.start_time or status.restart_count)
    resolved = resolve(job.spec, ref.kind, ref.name, runtime, enforce=not started)
    if resolved.spec is None:
        return WithRuntime(job, status, resolved.problems, job.spec)
    cluster = ref.kind == api.CLUSTER_RUNTIME_KIND
    template = job.spec.pod_template if cluster else resolved.spec.pod_template
    spec = own_prefix(job, resolved.spec)
    return WithRuntime(job.model_copy(update={"spec": spec}), status.model_copy(update={"runtime": applied}),
                       [], job.spec, trusted_fabric=resolved.fabric_from_runtime and cluster, own_template=template,
                       ignored=resolved.problems)


def own_prefix(job: TrainingJob, spec: api.TrainingJobSpec) -> api.TrainingJobSpec:
    """A runtime's checkpoint.uri is a prefix shared by its jobs: a job that sets none of its own keeps its
    checkpoints under a prefix of its own there (api.job_prefix)."""
    uri = spec.checkpoint.uri
    if uri is None or job.spec.checkpoint.uri is not None:
        return spec
    mine = api.job_prefix(uri, job.metadata)
    return spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"uri": mine})})


def not_found(ref: api.RuntimeRef, why: str) -> Want:
    where = "cluster-wide" if ref.kind == api.CLUSTER_RUNTIME_KIND else "in the job's namespace"
    return Want(api.RUNTIME_RESOLVED, False, api.ConditionReason.RUNTIME_NOT_FOUND,
                f"spec.runtimeRef: {ref.kind} {ref.name} ({where}): {why}; the job waits for it", bad_value=False)


def applied(status: TrainingJobStatus, ignored: list[str]) -> Want | None:
    """RuntimeResolved True once a runtime is applied, naming a started job's edits that its locks override."""
    if status.runtime is None:
        return None
    r = status.runtime
    note = f"; edits not applied: {'; '.join(ignored)}" if ignored else ""
    return Want(api.RUNTIME_RESOLVED, True, api.ConditionReason.RUNTIME_APPLIED,
                f"{r.kind} {r.name} applied (resourceVersion {r.resource_version}){note}", bad_value=False)
