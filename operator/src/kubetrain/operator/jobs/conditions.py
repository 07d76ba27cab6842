"""The conditions beside the phase, as pure functions: CheckpointsDurable and WorkersBlocked.

CheckpointsDurable says before a job runs whether its checkpoints survive a gang
restart. WorkersBlocked says why a worker pod of the current generation cannot
start, from what the kubelet (container `waiting` reasons) and the scheduler
(`PodScheduled=False`, reason `Unschedulable`) wrote into the pod's status; the
job waits, it does not fail over it. Each returns the condition the job should
have (`Want`); `announce` tells whether that is news worth one Warning Event.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from kubetrain.core import api
from kubetrain.core.api import (
    CHECKPOINTS_DURABLE,
    NODES_NOT_READY,
    OPERATOR_OUTDATED,
    WORKERS_BLOCKED,
    ConditionReason,
    TrainingJob,
)
from kubetrain.core.contract import format_time
from kubetrain.core.lifecycle import progressing_despite
from kubetrain.operator.jobs import builders as b
from kubetrain.operator.jobs.pod_facts import facts

R = ConditionReason

WAITING_REASONS: dict[str, ConditionReason] = {
    "ErrImagePull": R.IMAGE_PULL_FAILED,
    "ImagePullBackOff": R.IMAGE_PULL_FAILED,
    "InvalidImageName": R.INVALID_IMAGE_NAME,
    "CreateContainerConfigError": R.CONTAINER_CONFIG_ERROR,
    "CreateContainerError": R.CONTAINER_CREATE_ERROR,
}
"""Kubelet container waiting reasons that never clear on their own (ContainerCreating does)."""
UNSCHEDULABLE_GRACE = timedelta(seconds=10)
"""How long a pod may be unschedulable before it counts as blocked: a claim that is still being
provisioned, or a node that is still joining, makes the first scheduling attempts fail for a moment."""

_WHAT = {
    R.IMAGE_PULL_FAILED: "cannot pull its image",
    R.INVALID_IMAGE_NAME: "has an invalid image name",
    R.CONTAINER_CONFIG_ERROR: "cannot configure its container",
    R.CONTAINER_CREATE_ERROR: "cannot create its container",
    R.UNSCHEDULABLE: "cannot be scheduled",
}


@dataclass(frozen=True)
class Want:
    """The condition a job should have now."""

    type: str
    value: bool
    reason: str
    message: str
    bad_value: bool
    """The status that deserves a Warning Event (False for CheckpointsDurable, True for WorkersBlocked)."""


@dataclass(frozen=True)
class BlockedPod:
    pod: str
    reason: ConditionReason
    source: str
    """The kubelet's waiting reason (ErrImagePull, ...) or the scheduler's (Unschedulable)."""
    message: str
    """The kubelet's or the scheduler's own message."""


def checkpoints_durable(job: TrainingJob, store: api.CheckpointStore | None = None) -> Want:
    ck, name = job.spec.checkpoint, job.metadata.name
    if store is not None:
        return Want(CHECKPOINTS_DURABLE, True, R.OPERATOR_STORE,
                    f"checkpoints are kept in object storage at {store.uri} (status.checkpointStore), the operator's "
                    f"checkpoint store: {job.spec.workers} workers cannot share a claim of the job's StorageClass, "
                    "which offers ReadWriteOnce only; each worker stages its part in its own emptyDir and uploads it",
                    bad_value=False)
    if ck.ephemeral:
        return Want(
            CHECKPOINTS_DURABLE, False, R.EPHEMERAL_CHECKPOINTS,
            "checkpoints are kept in each worker pod's emptyDir (spec.checkpoint.ephemeral): they are lost "
            "whenever the worker pods are deleted, so every gang restart starts over from step 0. To keep them, "
            "set spec.checkpoint.claimName to a claim every worker can mount, or drop spec.checkpoint.ephemeral "
            f"and the operator creates the claim {b.default_claim_name(name)}", bad_value=False,
        )
    if ck.uri:
        return Want(CHECKPOINTS_DURABLE, True, R.OBJECT_STORE,
                    f"checkpoints are kept in object storage at {ck.uri} (spec.checkpoint.uri); each worker stages "
                    "its part in its own emptyDir and uploads it", bad_value=False)
    if ck.claim_name:
        return Want(CHECKPOINTS_DURABLE, True, R.USER_CLAIM,
                    f"checkpoints are kept on the PersistentVolumeClaim {ck.claim_name} (spec.checkpoint.claimName)",
                    bad_value=False)
    return Want(
        CHECKPOINTS_DURABLE, True, R.DEFAULT_CLAIM,
        f"checkpoints are kept on the PersistentVolumeClaim {b.default_claim_name(name)} "
        f"({ck.storage_size}, {b.claim_access_mode(job.spec)}), created for this job and deleted with it",
        bad_value=False,
    )


def blocked_pod(pod: dict[str, Any], now: datetime) -> BlockedPod | None:
    """Why a Pending pod cannot start, or None (running, finished, deleting, or just slow)."""
    if not facts(pod).pending:
        return None
    status = pod.get("status") or {}
    name = pod["metadata"]["name"]
    for cs in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        waiting = (cs.get("state") or {}).get("waiting") or {}
        reason = WAITING_REASONS.get(waiting.get("reason") or "")
        if reason is not None:
            detail = f"container {cs.get('name')}: {waiting.get('message') or waiting['reason']}"
            return BlockedPod(name, reason, waiting["reason"], detail)
    since = facts(pod).unschedulable_since
    if since is not None and now - since >= UNSCHEDULABLE_GRACE:
        cond = next(c for c in status["conditions"] if c.get("type") == "PodScheduled")
        return BlockedPod(name, R.UNSCHEDULABLE, "Unschedulable", cond.get("message") or "no node fits")
    return None


def blocked_pods(pods: list[dict[str, Any]], now: datetime) -> list[BlockedPod]:
    """Every blocked pod, in worker order (so the condition's reason does not flap between reconciles)."""
    pending = [p for p in pods if facts(p).pending]  # most pods of a big gang run: no sort, no look
    found = (blocked_pod(p, now) for p in sorted(pending, key=lambda p: facts(p).index))
    return [x for x in found if x is not None]


def recheck_after(pods: list[dict[str, Any]], now: datetime) -> float | None:
    """Seconds until the first unschedulable pod's grace ends (nothing else wakes the operator then)."""
    ends = [since + UNSCHEDULABLE_GRACE for p in pods
            if (f := facts(p)).pending and (since := f.unschedulable_since) is not None]
    later = [(e - now).total_seconds() for e in ends if e > now]
    return min(later) + 0.5 if later else None


def waits_for_volume(blocked: list[BlockedPod]) -> bool:
    """The scheduler names a claim or volume as (part of) the reason no node fits."""
    return any(x.reason == R.UNSCHEDULABLE and ("persistentvolumeclaim" in x.message.lower()
               or "persistent volume" in x.message.lower()) for x in blocked)


def _claim_note(name: str, phase: str) -> str:
    if phase == "Missing":
        return f"the checkpoint claim {name} does not exist"
    return (f"the checkpoint claim {name} is {phase}, not bound to a volume: its StorageClass must provision it "
            f"(`kubectl describe pvc {name}` says why); or set spec.checkpoint.claimName to a bound claim")


def operator_outdated(unknown: Sequence[str], started: bool) -> Want:
    """OperatorOutdated: the spec fields this operator does not know, and what it does about them."""
    if not unknown:
        return Want(OPERATOR_OUTDATED, False, R.UNKNOWN_FIELDS, "the operator knows every field of the spec",
                    bad_value=True)
    what = ", ".join(unknown)
    then = ("the job goes on without them until the operator is upgraded" if started else
            "the job waits for an operator that knows them (upgrade the operator to the CRD's version)")
    return Want(OPERATOR_OUTDATED, True, R.UNKNOWN_FIELDS,
                f"{what}: not known to this operator (the TrainingJob CRD is newer than the operator); {then}",
                bad_value=True)


def workers_blocked(job: TrainingJob, blocked: list[BlockedPod], claim_phase: str | None = None) -> Want:
    """WorkersBlocked from the blocked pods: the first one's reason; the message covers every distinct reason.

    `claim_phase` is the phase of the checkpoint claim (or "Missing") when the caller looked it up;
    a claim not Bound while pods wait for a volume makes the reason CheckpointClaimPending.
    """
    if not blocked:
        return Want(WORKERS_BLOCKED, False, R.WORKERS_STARTING, "no worker pod is blocked", bad_value=True)
    parts: list[str] = []
    for kind in dict.fromkeys(x.reason for x in blocked):
        pods = [x for x in blocked if x.reason == kind]
        more = f" (and {len(pods) - 1} more pod(s) alike)" if len(pods) > 1 else ""
        parts.append(f"{pods[0].pod} {_WHAT[kind]}: {pods[0].message}{more}")
    reason: str = blocked[0].reason
    claim = b.claim_name(job)
    if claim and claim_phase not in (None, "Bound") and waits_for_volume(blocked):
        reason = R.CHECKPOINT_CLAIM_PENDING
        parts.insert(0, _claim_note(claim, claim_phase))
    message = "worker pods cannot start; the job waits: " + "; ".join(parts)
    return Want(WORKERS_BLOCKED, True, reason, message, bad_value=True)


GANG_MISSING_MARK = "spec.scheduling.gang: "
"""How a refusal that is a missing PodGroup CRD begins (gang_missing): the I/O layer keeps one refusal
message per job, and this tells its condition and Event reason apart from a refused pod's."""


def gang_missing(api_version: str) -> str:
    """The refusal message when the API server does not serve the PodGroup kind (404 on its create)."""
    name, gang = next((name, g) for name, g in b.GANGS.items() if g.api_version == api_version)
    return (f"{GANG_MISSING_MARK}{name} needs {gang.needs} ({api_version} PodGroup), which this cluster does "
            f"not serve: {gang.fix}; or set spec.scheduling.gang: none. No worker pod is created until it is "
            "served (it would bypass the gang); the job starts by itself then")


def is_gang_missing(create_refused: str | None) -> bool:
    return bool(create_refused and create_refused.startswith(GANG_MISSING_MARK))


def refused(create_refused: str | None, foreign: str | None) -> Want | None:
    """WorkersBlocked when the API server refused a child, or a stranger holds a child's name: the
    operator retries with backoff and says why (its Event is recorded when the refusal happens)."""
    if foreign:
        return Want(WORKERS_BLOCKED, True, R.FOREIGN_OBJECT,
                    f"{foreign} exists and is not owned by this TrainingJob: it is not adopted; delete or rename it",
                    bad_value=True)
    if create_refused is not None and is_gang_missing(create_refused):
        return Want(WORKERS_BLOCKED, True, R.GANG_SCHEDULER_MISSING, create_refused, bad_value=True)
    if create_refused:
        return Want(WORKERS_BLOCKED, True, R.CREATE_REJECTED,
                    f"the API server refused a worker pod or an object it needs first (its ServiceAccount, "
                    f"NetworkPolicy); the operator retries with backoff: {create_refused}",
                    bad_value=True)
    return None


def announce(conditions: list[dict[str, Any]], want: Want) -> bool:
    """One Warning Event per distinct bad state: True when the condition turns bad or its reason changes."""
    if want.value != want.bad_value:
        return False
    status = "True" if want.value else "False"
    return not any(c.get("type") == want.type and c.get("status") == status and c.get("reason") == want.reason
                   for c in conditions)


def nodes_not_ready(job: TrainingJob, current: list[dict[str, Any]], nodes: Mapping[str, datetime | None],
                    last_progress: datetime | None, now: datetime, disruption: str | None = None) -> Want:
    """NodesNotReady: the NotReady nodes of the current generation's workers, and whether the job still makes
    progress despite them (then the gang is kept: its ranks there still train); `nodes`: NotReady since;
    `disruption`: why the cluster looks disrupted (then the gang waits, whatever its progress)."""
    down = {node: since for p in current
            if (since := nodes.get(node := (p.get("spec") or {}).get("nodeName") or "")) is not None}
    if not down:
        return Want(NODES_NOT_READY, False, R.NODES_READY, "every worker's node is Ready", bad_value=True)
    since, names = min(down.values()), ", ".join(sorted(down))
    grace = job.spec.restart_policy.node_not_ready_grace_seconds
    if disruption is not None:
        return Want(NODES_NOT_READY, True, R.CLUSTER_DISRUPTION,
                    f"node {names} NotReady since {format_time(since)}; {disruption}: the gang is not restarted "
                    "for it while the disruption lasts", bad_value=True)
    if progressing_despite(since, last_progress, now, timedelta(seconds=grace)):
        then = "the job still makes progress, so its workers there still train: the gang is not restarted"
    else:
        then = (f"the gang restarts if the job makes no progress for {grace}s "
                "(restartPolicy.nodeNotReadyGraceSeconds)")
    return Want(NODES_NOT_READY, True, R.NODE_NOT_READY,
                f"node {names} NotReady since {format_time(since)}; {then}", bad_value=True)
