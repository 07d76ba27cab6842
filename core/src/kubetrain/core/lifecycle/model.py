"""The lifecycle's vocabulary: what a backend observes, what the policies decide, what a backend carries out."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime

from kubetrain.core.api import CheckpointRef, LastHang, Phase, TrainingJobStatus
from kubetrain.core.hangs import HangReport
from kubetrain.core.progress import Progress

__all__ = [
    "DISRUPTIONS", "Action", "CreateWorkers", "Decision", "DeleteJob", "DeleteWorkers", "Effect", "FailureKind",
    "KeepWorkers", "Observed", "Reason", "RecordEvent", "Scope", "Transition", "WorkerPhase", "WorkerState",
]


class WorkerPhase(enum.StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    MISSING = "Missing"
    """Not present: never created in this generation, or deleted."""


class FailureKind(enum.StrEnum):
    EXIT_CODE = "ExitCode"
    PERMANENT_EXIT_CODE = "PermanentExitCode"
    DELETED = "Deleted"
    EVICTED = "Evicted"
    OOM_KILLED = "OOMKilled"
    NODE_LOST = "NodeLost"
    NO_PROGRESS = "NoProgress"
    DISRUPTED = "Disrupted"
    """Preempted, evicted through the API or drained: the pod's DisruptionTarget condition."""
    START_TIMEOUT = "StartTimeout"
    """The gang did not run within restartPolicy.startTimeoutSeconds of its creation."""


DISRUPTIONS = frozenset({FailureKind.DISRUPTED, FailureKind.EVICTED})
"""Failures that are not the job's fault: by default they restart the gang without counting."""


class Reason(enum.StrEnum):
    """status.reason and Event reasons. A gang restart's reason is its FailureKind."""

    SUSPENDED = "Suspended"
    INTERRUPTED = "Interrupted"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    DELETING_OLD_GENERATION = "DeletingOldGeneration"
    SUCCEEDED = "Succeeded"
    PERMANENT_ERROR = "PermanentError"
    BACKOFF_LIMIT_EXCEEDED = "BackoffLimitExceeded"
    BACKOFF_WAIT = "BackoffWait"
    CREATING_WORKERS = "CreatingWorkers"
    ALL_WORKERS_RUNNING = "AllWorkersRunning"
    WAITING_FOR_WORKERS = "WaitingForWorkers"
    GANG_CREATED = "GangCreated"
    TTL_EXPIRED = "TTLExpired"
    INVALID_SPEC = "InvalidSpec"
    PROGRESS_REPORTING_OFF = "ProgressReportingOff"
    PROGRESS_REPORTING_FORBIDDEN = "ProgressReportingForbidden"
    PROGRESS_REPORTED = "ProgressReported"
    RESIZED = "Resized"
    HANG_FOUND = "HangFound"


@dataclass(frozen=True)
class WorkerState:
    """One worker (pod or local process group) of the current generation."""

    index: int
    phase: WorkerPhase
    exit_code: int | None = None
    reason: str | None = None
    """Backend reason: Evicted, OOMKilled, Deleted, ... (None for a plain exit)."""
    created: bool = True
    """False when this worker was never created in this generation."""
    node_not_ready_since: datetime | None = None
    in_place: bool = False
    """The worker can restart in place: its launcher runs whatever generation the backend tells it."""
    held: bool = False
    """Kept by an in-place restart and not yet told to run this generation (its restart's backoff)."""
    restartable: bool = False
    """Failed, but the backend starts it again where it ran (the kubelet, in its pod) and it waits for
    the next generation there: an in-place restart keeps it like a running worker."""
    hang: HangReport | None = None
    """Failed hung (contract.HUNG_EXIT_CODE): its ranks' report (kubetrain.core.hangs)."""
    said: str | None = None
    """Failed on a configuration error (contract.CONFIG_ERROR_EXIT_CODE): the trainer's message naming the field."""
    failed_in: str | None = None
    """The init container whose failure is the worker's, such as contract.FETCH_CONTAINER (exit_code, reason
    and said are then its); None: the trainer's own."""
    fetching: bool = False
    """Pending while it fetches model.hfUri / data.tokenizerUri into its cache (contract.FETCH_CONTAINER):
    placed and at work, so neither slow to start nor blocked."""
    pod: str | None = None
    node: str | None = None
    node_terminating: str | None = None
    """The termination taint on its node (a spot reclaim, a scale-down): the node is about to go."""
    ended_before: bool = False
    """Succeeded before its generation began: a worker kept in place that had already finished (it will never
    run this generation)."""
    peers_lost_since: datetime | None = None
    """Running, and waiting for the next generation since then because its processes lost their peers (kept in
    place, its launcher stops answering its readiness probe): the gang broke elsewhere, even where nothing
    else can say so (the worker that broke it went with its node)."""


@dataclass(frozen=True)
class Observed:
    """What a backend sees now. `workers` lists the workers of the current generation (status.restartGeneration)
    that exist; the lifecycle counts every other index as missing."""

    workers: tuple[WorkerState, ...] = ()
    stale_workers: int = 0
    """Workers of older generations still present (being deleted)."""
    progress: Progress | None = None
    """Rank 0's newest progress record, if any."""
    progress_seen: datetime | None = None
    """When the backend first saw that record's step (lastProgressTime); None: now. A backend that writes its
    status less often than rank 0 reports keeps the time it saw the step, not the time it wrote it."""
    checkpoint: CheckpointRef | None = None
    """The newest complete checkpoint the backend finds itself (the local backend reads the directory)."""
    checkpoints_durable: bool = True
    """Checkpoints survive the workers (False: they die with the pods, spec.checkpoint.ephemeral)."""
    progress_unknown: str | None = None
    """Why rank 0's progress cannot reach this backend (a Reason: reporting off, its RBAC refused); None: it can."""
    disruption: str | None = None
    """Why the cluster looks disrupted (cluster_disruption: many nodes NotReady at once); None: it does not."""


class Action(enum.StrEnum):
    CREATE_WORKERS = "CreateWorkers"
    """Create the missing workers of `generation`."""
    WAIT = "Wait"
    """Nothing to do; look again after `requeue_after` seconds at the latest."""
    RESTART_GANG = "RestartGang"
    """Delete every worker; the next generation is `generation`, started after `requeue_after`."""
    DELETE_STALE = "DeleteStale"
    """Old-generation workers still exist: delete them and wait before creating new ones."""
    SUSPEND = "Suspend"
    """Delete every worker and report Suspended."""
    SUCCEED = "Succeed"
    FAIL = "Fail"


@dataclass(frozen=True)
class Decision:
    """One policy's verdict."""

    action: Action
    phase: Phase
    reason: str
    message: str = ""
    generation: int = 0
    requeue_after: float | None = None
    failure_kind: FailureKind | None = None
    failed_workers: tuple[int, ...] = field(default_factory=tuple)
    ignored: bool = False
    """A restart not counted against backoffLimit."""
    keep: tuple[int, ...] = ()
    """A restart in place: the workers that stay (the others are recreated)."""
    hang: LastHang | None = None
    """A restart for a hang: the verdict (status.lastHang)."""


class Scope(enum.StrEnum):
    """Which workers a DeleteWorkers removes."""

    ALL = "All"
    STALE = "Stale"
    """Those of older generations."""
    UNFINISHED = "Unfinished"
    """Those still pending or running (cleanPodPolicy Running)."""
    RESTARTING = "Restarting"
    """Those still running that their backend would start again for ever once the job is over: pods whose
    kubelet restarts a failed worker in place (cleanPodPolicy None). A local run has none."""


@dataclass(frozen=True)
class CreateWorkers:
    generation: int
    indices: tuple[int, ...]
    resume: tuple[int, ...] = ()
    """Workers kept by an in-place restart: tell their launchers to run `generation` now."""


@dataclass(frozen=True)
class KeepWorkers:
    """An in-place restart: these workers of the old generation belong to `generation` from now on."""

    generation: int
    indices: tuple[int, ...]


@dataclass(frozen=True)
class DeleteWorkers:
    scope: Scope
    keep: tuple[int, ...] = ()
    """Workers of the current generation that stay (an in-place restart keeps them)."""


@dataclass(frozen=True)
class RecordEvent:
    type: str
    """Normal or Warning."""
    reason: str
    message: str


@dataclass(frozen=True)
class DeleteJob:
    """The finished job's TTL expired."""


Effect = CreateWorkers | KeepWorkers | DeleteWorkers | RecordEvent | DeleteJob


@dataclass(frozen=True)
class Transition:
    """step()'s answer: the new status, what to carry out (in order), when to look again."""

    status: TrainingJobStatus
    effects: tuple[Effect, ...] = ()
    requeue_after: float | None = None
    decision: Decision | None = None
    """The policy's verdict (None for a finished job)."""

