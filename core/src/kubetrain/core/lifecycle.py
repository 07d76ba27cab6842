"""The lifecycle policy: one pure function that both backends call.

`decide(spec, observed, history, now)` looks at what the backend observed about
the current gang (worker states, progress) and the job's history (restarts,
start time, phase) and returns the next action. It never reads a clock or does
I/O; the Kubernetes operator and the local process backend only translate its
decisions into API calls or process signals.

Rules (the same everywhere):
- Any worker failure -- non-zero exit, deletion, eviction, a node NotReady past
  its grace, no progress for progressDeadlineSeconds -- restarts the WHOLE gang
  from the latest complete checkpoint, once per failure: every old worker is
  gone before the next generation starts. The messages name that checkpoint's
  step, or why there is none (restart_origin).
- An exit code listed in restartPolicy.permanentExitCodes fails the job at once.
- Restarts back off exponentially; restartPolicy.backoffLimit caps their count.
- activeDeadlineSeconds fails a job that has been active too long.
- Success: worker 0 (rank 0) exited 0 (it does so only after the final checkpoint).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from kubetrain.core import contract
from kubetrain.core.api import TrainingJobSpec


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


@dataclass(frozen=True)
class Observed:
    """What the backend sees now."""

    generation: int
    workers: tuple[WorkerState, ...]
    stale_workers: int = 0
    """Workers of older generations still present (being deleted)."""
    last_progress_time: datetime | None = None
    """When rank 0 last reported a new step in this generation."""
    running_since: datetime | None = None
    """When every worker of this generation was first seen Running."""
    last_checkpoint: int | None = None
    """Step of the newest complete checkpoint known (None: none yet)."""
    checkpoints_durable: bool = True
    """Checkpoints survive the workers (False: they die with the pods, spec.checkpoint.ephemeral)."""


@dataclass(frozen=True)
class History:
    """What the job remembers across reconciles (kept in status or by the local supervisor)."""

    restart_count: int = 0
    start_time: datetime | None = None
    last_restart_time: datetime | None = None
    finished: bool = False
    suspended: bool = False


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
    action: Action
    phase: str
    reason: str
    message: str = ""
    generation: int = 0
    requeue_after: float | None = None
    failure_kind: FailureKind | None = None
    failed_workers: tuple[int, ...] = field(default_factory=tuple)


def backoff_seconds(spec: TrainingJobSpec, restart_count: int) -> float:
    """Delay before restart number restart_count + 1: base * 2^restart_count, capped."""
    policy = spec.restart_policy
    return min(policy.backoff_seconds * (2**restart_count), policy.max_backoff_seconds)


def classify(spec: TrainingJobSpec, w: WorkerState, now: datetime) -> FailureKind | None:
    """Why this worker counts as failed, or None when it does not."""
    if w.phase == WorkerPhase.FAILED:
        if w.reason == "Evicted":
            return FailureKind.EVICTED
        if w.reason == "OOMKilled":
            return FailureKind.OOM_KILLED
        if w.exit_code is not None and w.exit_code in spec.restart_policy.permanent_exit_codes:
            return FailureKind.PERMANENT_EXIT_CODE
        return FailureKind.EXIT_CODE
    if w.phase == WorkerPhase.MISSING and w.created:
        return FailureKind.DELETED
    if w.node_not_ready_since is not None and w.phase in (WorkerPhase.RUNNING, WorkerPhase.PENDING):
        grace = timedelta(seconds=spec.restart_policy.node_not_ready_grace_seconds)
        if now - w.node_not_ready_since >= grace:
            return FailureKind.NODE_LOST
    return None


def _describe(w: WorkerState, kind: FailureKind) -> str:
    if kind in (FailureKind.EXIT_CODE, FailureKind.PERMANENT_EXIT_CODE):
        if w.exit_code is None:
            return f"worker {w.index} failed ({w.reason or 'no exit code reported'})"
        if w.exit_code == contract.PEER_LOST_EXIT_CODE and kind == FailureKind.EXIT_CODE:
            return f"worker {w.index} exited with code {w.exit_code} (it lost a peer rank mid-collective)"
        return f"worker {w.index} exited with code {w.exit_code}"
    if kind == FailureKind.NODE_LOST:
        return f"worker {w.index}'s node is NotReady"
    return f"worker {w.index} {kind.value.lower()}"


def restart_origin(observed: Observed) -> str:
    """Where the next generation starts, as every restart message says it (both backends)."""
    if not observed.checkpoints_durable:
        return "from step 0: checkpoints are ephemeral (spec.checkpoint.ephemeral)"
    if not observed.last_checkpoint:
        return "from step 0: no complete checkpoint yet"
    return f"from the checkpoint at step {observed.last_checkpoint}"


def _no_progress(spec: TrainingJobSpec, observed: Observed, now: datetime) -> bool:
    deadline = spec.restart_policy.progress_deadline_seconds
    if deadline is None or observed.running_since is None:
        return False
    last = max(t for t in (observed.last_progress_time, observed.running_since) if t is not None)
    return now - last >= timedelta(seconds=deadline)


def decide(spec: TrainingJobSpec, observed: Observed, history: History, now: datetime) -> Decision:
    """The next action for a job that has not finished yet."""
    gen = observed.generation
    present = [w for w in observed.workers if w.phase != WorkerPhase.MISSING]

    if spec.suspend:
        if present or observed.stale_workers:
            return Decision(Action.SUSPEND, "Suspended", "Suspended", "job suspended: deleting workers", gen)
        return Decision(Action.WAIT, "Suspended", "Suspended", "job is suspended", gen)

    deadline = spec.active_deadline_seconds
    if deadline is not None and history.start_time is not None and now - history.start_time >= timedelta(seconds=deadline):
        return Decision(
                Action.FAIL, "Failed", "DeadlineExceeded",
                f"job was active longer than activeDeadlineSeconds={spec.active_deadline_seconds}", gen,
            )

    if observed.stale_workers:
        return Decision(
            Action.DELETE_STALE, "Restarting", "DeletingOldGeneration",
            f"waiting for {observed.stale_workers} worker(s) of an older generation to go", gen, requeue_after=1.0,
        )

    # Rank 0 exits 0 only after the final checkpoint: training is done whatever the others do now.
    by_index = {w.index: w for w in observed.workers}
    rank0 = by_index.get(0)
    if rank0 is not None and rank0.phase == WorkerPhase.SUCCEEDED:
        return Decision(Action.SUCCEED, "Succeeded", "Succeeded", "worker 0 finished training", gen)

    failures = [(w, k) for w in observed.workers if (k := classify(spec, w, now)) is not None]
    if not failures and _no_progress(spec, observed, now):
        deadline = spec.restart_policy.progress_deadline_seconds
        failures = [(observed.workers[0], FailureKind.NO_PROGRESS)]
        no_progress_msg = f"no progress for {deadline}s (progressDeadlineSeconds)"
    else:
        no_progress_msg = ""

    if failures:
        worst = next(
            (f for f in failures if f[1] == FailureKind.PERMANENT_EXIT_CODE),
            next((f for f in failures if f[0].exit_code != contract.PEER_LOST_EXIT_CODE), failures[0]),
        )
        w, kind = worst
        what = no_progress_msg or _describe(w, kind)
        failed = tuple(x.index for x, _ in failures)
        if kind == FailureKind.PERMANENT_EXIT_CODE:
            return Decision(
                Action.FAIL, "Failed", "PermanentError",
                f"{what}, listed in restartPolicy.permanentExitCodes: not restarting", gen,
                failure_kind=kind, failed_workers=failed,
            )
        if history.restart_count >= spec.restart_policy.backoff_limit:
            return Decision(
                Action.FAIL, "Failed", "BackoffLimitExceeded",
                f"{what}; the gang already restarted {history.restart_count} time(s) "
                f"(restartPolicy.backoffLimit={spec.restart_policy.backoff_limit})", gen,
                failure_kind=kind, failed_workers=failed,
            )
        delay = backoff_seconds(spec, history.restart_count)
        return Decision(
            Action.RESTART_GANG, "Restarting", kind.value,
            f"{what}: restarting the whole gang {restart_origin(observed)} "
            f"(restart {history.restart_count + 1} of at most {spec.restart_policy.backoff_limit}, in {delay:g}s)",
            gen + 1, requeue_after=delay, failure_kind=kind, failed_workers=failed,
        )

    missing = [i for i in range(spec.workers) if i not in by_index or by_index[i].phase == WorkerPhase.MISSING]
    if missing:
        if gen > 0 and history.last_restart_time is not None:
            ready_at = history.last_restart_time + timedelta(seconds=backoff_seconds(spec, history.restart_count - 1))
            if now < ready_at:
                wait = (ready_at - now).total_seconds()
                return Decision(
                    Action.WAIT, "Restarting", "BackoffWait",
                    f"starting generation {gen} {restart_origin(observed)} in {wait:.1f}s", gen,
                    requeue_after=wait,
                )
        origin = f" {restart_origin(observed)}" if gen > 0 else ""
        return Decision(
            Action.CREATE_WORKERS, "Created" if gen == 0 else "Restarting", "CreatingWorkers",
            f"creating {len(missing)} of {spec.workers} worker(s) of generation {gen}{origin}", gen,
        )

    if all(w.phase in (WorkerPhase.RUNNING, WorkerPhase.SUCCEEDED) for w in observed.workers):
        return Decision(Action.WAIT, "Running", "AllWorkersRunning", f"{spec.workers} worker(s) running", gen, 30.0)
    pending = sum(w.phase == WorkerPhase.PENDING for w in observed.workers)
    return Decision(
        Action.WAIT, "Created" if gen == 0 else "Restarting", "WaitingForWorkers",
        f"{pending} of {spec.workers} worker(s) pending", gen, 5.0,
    )
