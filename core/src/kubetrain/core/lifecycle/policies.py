"""One function per policy. Each looks at the job and answers with a Decision, or None to pass it on.

`decide` asks them in a fixed order (POLICIES): suspend, deadline, old generation, success, failure
(permanent exit code, backoff limit, restart with backoff, node loss and no progress included), start,
and finally wait. None of them reads a clock or does I/O: `now` comes in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from kubetrain.core import contract
from kubetrain.core.api import Phase, TrainingJobSpec
from kubetrain.core.lifecycle.model import Action, Decision, FailureKind, Reason, WorkerPhase, WorkerState


@dataclass(frozen=True)
class JobView:
    """The job as the policies see it: its remembered facts and the current generation's workers,
    every index present (missing ones filled in)."""

    generation: int
    workers: tuple[WorkerState, ...]
    stale_workers: int = 0
    restart_count: int = 0
    start_time: datetime | None = None
    last_restart_time: datetime | None = None
    running_since: datetime | None = None
    """When every worker of this generation was first seen Running."""
    last_progress_time: datetime | None = None
    """When rank 0 last reported a new step."""
    last_checkpoint: int | None = None
    """Step of the newest complete checkpoint (None: none yet)."""
    checkpoints_durable: bool = True


Policy = Callable[[TrainingJobSpec, JobView, datetime], Decision | None]


def backoff_seconds(spec: TrainingJobSpec, restart_count: int) -> float:
    """Delay before restart number restart_count + 1: base * 2^restart_count, capped."""
    policy = spec.restart_policy
    return min(policy.backoff_seconds * (2**restart_count), policy.max_backoff_seconds)


def restart_origin(job: JobView) -> str:
    """Where the next generation starts, as every restart message says it (both backends)."""
    if not job.checkpoints_durable:
        return "from step 0: checkpoints are ephemeral (spec.checkpoint.ephemeral)"
    if not job.last_checkpoint:
        return "from step 0: no complete checkpoint yet"
    return f"from the checkpoint at step {job.last_checkpoint}"


def suspend(spec: TrainingJobSpec, job: JobView, now: datetime) -> Decision | None:
    if not spec.suspend:
        return None
    if job.stale_workers or any(w.phase != WorkerPhase.MISSING for w in job.workers):
        return Decision(Action.SUSPEND, Phase.SUSPENDED, Reason.SUSPENDED, "job suspended: deleting workers",
                        job.generation)
    return Decision(Action.WAIT, Phase.SUSPENDED, Reason.SUSPENDED, "job is suspended", job.generation)


def deadline(spec: TrainingJobSpec, job: JobView, now: datetime) -> Decision | None:
    limit = spec.active_deadline_seconds
    if limit is None or job.start_time is None or now - job.start_time < timedelta(seconds=limit):
        return None
    return Decision(Action.FAIL, Phase.FAILED, Reason.DEADLINE_EXCEEDED,
                    f"job was active longer than activeDeadlineSeconds={limit}", job.generation)


def old_generation(spec: TrainingJobSpec, job: JobView, now: datetime) -> Decision | None:
    if not job.stale_workers:
        return None
    return Decision(Action.DELETE_STALE, Phase.RESTARTING, Reason.DELETING_OLD_GENERATION,
                    f"waiting for {job.stale_workers} worker(s) of an older generation to go", job.generation,
                    requeue_after=1.0)


def success(spec: TrainingJobSpec, job: JobView, now: datetime) -> Decision | None:
    # Rank 0 exits 0 only after the final checkpoint: training is done whatever the others do now.
    if job.workers and job.workers[0].phase == WorkerPhase.SUCCEEDED:
        return Decision(Action.SUCCEED, Phase.SUCCEEDED, Reason.SUCCEEDED, "worker 0 finished training",
                        job.generation)
    return None


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


def describe(w: WorkerState, kind: FailureKind) -> str:
    if kind in (FailureKind.EXIT_CODE, FailureKind.PERMANENT_EXIT_CODE):
        if w.exit_code is None:
            return f"worker {w.index} failed ({w.reason or 'no exit code reported'})"
        if w.exit_code == contract.PEER_LOST_EXIT_CODE and kind == FailureKind.EXIT_CODE:
            return f"worker {w.index} exited with code {w.exit_code} (it lost a peer rank mid-collective)"
        return f"worker {w.index} exited with code {w.exit_code}"
    if kind == FailureKind.NODE_LOST:
        return f"worker {w.index}'s node is NotReady"
    return f"worker {w.index} {kind.value.lower()}"


def no_progress(spec: TrainingJobSpec, job: JobView, now: datetime) -> bool:
    limit = spec.restart_policy.progress_deadline_seconds
    if limit is None or job.running_since is None:
        return False
    last = max(t for t in (job.last_progress_time, job.running_since) if t is not None)
    return now - last >= timedelta(seconds=limit)


def _failures(spec: TrainingJobSpec, job: JobView, now: datetime) -> tuple[list[tuple[WorkerState, FailureKind]], str]:
    """Every failed worker with its kind, and what to call the worst; a hang counts as worker 0's failure."""
    failures = [(w, k) for w in job.workers if (k := classify(spec, w, now)) is not None]
    if not failures and no_progress(spec, job, now):
        limit = spec.restart_policy.progress_deadline_seconds
        return [(job.workers[0], FailureKind.NO_PROGRESS)], f"no progress for {limit}s (progressDeadlineSeconds)"
    if not failures:
        return [], ""
    # A permanent code first; a peer-lost exit is a consequence of another failure, so it comes last.
    w, kind = next((f for f in failures if f[1] == FailureKind.PERMANENT_EXIT_CODE),
                   next((f for f in failures if f[0].exit_code != contract.PEER_LOST_EXIT_CODE), failures[0]))
    failures.remove((w, kind))
    return [(w, kind), *failures], describe(w, kind)


def failure(spec: TrainingJobSpec, job: JobView, now: datetime) -> Decision | None:
    """Permanent exit code -> Failed; backoff limit reached -> Failed; otherwise restart the whole gang."""
    failures, what = _failures(spec, job, now)
    if not failures:
        return None
    kind, failed = failures[0][1], tuple(sorted(w.index for w, _ in failures))
    policy = spec.restart_policy
    if kind == FailureKind.PERMANENT_EXIT_CODE:
        return Decision(Action.FAIL, Phase.FAILED, Reason.PERMANENT_ERROR,
                        f"{what}, listed in restartPolicy.permanentExitCodes: not restarting", job.generation,
                        failure_kind=kind, failed_workers=failed)
    if job.restart_count >= policy.backoff_limit:
        return Decision(Action.FAIL, Phase.FAILED, Reason.BACKOFF_LIMIT_EXCEEDED,
                        f"{what}; the gang already restarted {job.restart_count} time(s) "
                        f"(restartPolicy.backoffLimit={policy.backoff_limit})", job.generation,
                        failure_kind=kind, failed_workers=failed)
    delay = backoff_seconds(spec, job.restart_count)
    return Decision(Action.RESTART_GANG, Phase.RESTARTING, kind.value,
                    f"{what}: restarting the whole gang {restart_origin(job)} "
                    f"(restart {job.restart_count + 1} of at most {policy.backoff_limit}, in {delay:g}s)",
                    job.generation + 1, requeue_after=delay, failure_kind=kind, failed_workers=failed)


def start(spec: TrainingJobSpec, job: JobView, now: datetime) -> Decision | None:
    """Create the missing workers of this generation, once a restart's backoff has passed."""
    missing = [w.index for w in job.workers if w.phase == WorkerPhase.MISSING]
    if not missing:
        return None
    gen = job.generation
    if gen > 0 and job.last_restart_time is not None:
        ready_at = job.last_restart_time + timedelta(seconds=backoff_seconds(spec, job.restart_count - 1))
        if now < ready_at:
            wait = (ready_at - now).total_seconds()
            return Decision(Action.WAIT, Phase.RESTARTING, Reason.BACKOFF_WAIT,
                            f"starting generation {gen} {restart_origin(job)} in {wait:.1f}s", gen,
                            requeue_after=wait)
    origin = f" {restart_origin(job)}" if gen > 0 else ""
    return Decision(Action.CREATE_WORKERS, Phase.CREATED if gen == 0 else Phase.RESTARTING,
                    Reason.CREATING_WORKERS,
                    f"creating {len(missing)} of {spec.workers} worker(s) of generation {gen}{origin}", gen)


def wait(spec: TrainingJobSpec, job: JobView, now: datetime) -> Decision:
    if all(w.phase in (WorkerPhase.RUNNING, WorkerPhase.SUCCEEDED) for w in job.workers):
        return Decision(Action.WAIT, Phase.RUNNING, Reason.ALL_WORKERS_RUNNING, f"{spec.workers} worker(s) running",
                        job.generation, 30.0)
    pending = sum(w.phase == WorkerPhase.PENDING for w in job.workers)
    return Decision(Action.WAIT, Phase.CREATED if job.generation == 0 else Phase.RESTARTING,
                    Reason.WAITING_FOR_WORKERS, f"{pending} of {spec.workers} worker(s) pending", job.generation, 5.0)


POLICIES: tuple[Policy, ...] = (suspend, deadline, old_generation, success, failure, start, wait)


def decide(spec: TrainingJobSpec, job: JobView, now: datetime) -> Decision:
    """The next action for a job that has not finished yet: the first policy that has one."""
    for policy in POLICIES:
        if (d := policy(spec, job, now)) is not None:
            return d
    raise AssertionError("wait() always decides")  # pragma: no cover
