"""One function per policy. Each looks at the job and answers with a Decision, or None to pass it on.

`decide` asks them in a fixed order (POLICIES): suspend, deadline, old generation, success, resize, failure
(permanent exit code, backoff limit, restart with backoff, node loss and no progress included), start,
and finally wait. None of them reads a clock or does I/O: `now` comes in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from kubetrain.core import contract, hangs
from kubetrain.core.api import FailureAction, Fetch, HangSuspect, LastHang, Phase, TrainingJobSpec
from kubetrain.core.lifecycle.model import (
    DISRUPTIONS,
    Action,
    Decision,
    FailureKind,
    Reason,
    WorkerPhase,
    WorkerState,
)


@dataclass(frozen=True)
class JobView:
    """The job as the policies see it: its remembered facts and the current generation's workers,
    every index present (missing ones filled in)."""

    generation: int
    workers: tuple[WorkerState, ...]
    stale_workers: int = 0
    restart_count: int = 0
    ignored_restarts: int = 0
    """Restarts not counted against backoffLimit."""
    start_time: datetime | None = None
    last_restart_time: datetime | None = None
    running_since: datetime | None = None
    """When every worker of this generation was first seen Running."""
    last_progress_time: datetime | None = None
    """When rank 0 last reported a new step."""
    last_checkpoint: int | None = None
    """Step of the newest complete checkpoint (None: none yet)."""
    checkpoints_durable: bool = True
    progress_unknown: str | None = None
    """Why rank 0 cannot report progress (then no-progress never fires); None when it can."""
    gang_created_time: datetime | None = None
    """When the current gang's workers were created (None: not yet)."""
    gang_size: int | None = None
    """How many workers the current gang was created with, when it differs from spec.workers."""
    resuming: bool = False
    """The job was suspended and is not any more: its deadline restarts with the new gang."""
    fetch: Fetch | None = None
    """Worker 0's fetch into its cache as it last reported it (status.fetch)."""
    disruption: str | None = None
    """Why the cluster looks disrupted (cluster_disruption); then a NotReady node restarts no gang."""

    @property
    def counted_restarts(self) -> int:
        return self.restart_count - self.ignored_restarts


Policy = Callable[[TrainingJobSpec, JobView, datetime], Decision | None]


def backoff_seconds(spec: TrainingJobSpec, restart_count: int) -> float:
    """Delay before restart number restart_count + 1: base * 2^restart_count, capped."""
    policy = spec.restart_policy
    return min(policy.backoff_seconds * 2.0 ** min(restart_count, 64), policy.max_backoff_seconds)


def restart_origin(spec: TrainingJobSpec, job: JobView) -> str:
    """Where the next generation starts, as every restart message says it (both backends). With
    checkpoint.memory the ranks pick a newer step they all hold in memory where they can (a worker whose
    pod was recreated holds none): only they know, and status.resumedFrom says which they loaded."""
    memory = spec.checkpoint.memory.enabled
    if not job.checkpoints_durable:
        return f"from step 0{' (or a checkpoint in memory)' if memory else ''}: checkpoints are ephemeral " \
            "(spec.checkpoint.ephemeral)"
    if not job.last_checkpoint:
        return f"from step 0{' (or a checkpoint in memory)' if memory else ''}: no complete checkpoint yet"
    return f"from the checkpoint at step {job.last_checkpoint}{' (or a newer one in memory)' if memory else ''}"


def suspend(spec: TrainingJobSpec, job: JobView, now: datetime) -> Decision | None:
    if not spec.suspend:
        return None
    if job.stale_workers or any(w.phase != WorkerPhase.MISSING for w in job.workers):
        return Decision(Action.SUSPEND, Phase.SUSPENDED, Reason.SUSPENDED, "job suspended: deleting workers",
                        job.generation)
    return Decision(Action.WAIT, Phase.SUSPENDED, Reason.SUSPENDED, "job is suspended", job.generation)


def deadline(spec: TrainingJobSpec, job: JobView, now: datetime) -> Decision | None:
    """activeDeadlineSeconds from the start, or from the last resume (suspended time does not count)."""
    limit = spec.active_deadline_seconds
    if limit is None or job.start_time is None or job.resuming or now - job.start_time < timedelta(seconds=limit):
        return None
    return Decision(Action.FAIL, Phase.FAILED, Reason.DEADLINE_EXCEEDED,
                    f"job was active longer than activeDeadlineSeconds={limit}", job.generation)


def old_generation(spec: TrainingJobSpec, job: JobView, now: datetime) -> Decision | None:
    if not job.stale_workers:
        return None
    return Decision(Action.DELETE_STALE, Phase.RESTARTING, Reason.DELETING_OLD_GENERATION,
                    f"waiting for {job.stale_workers} worker(s) of an older generation to go", job.generation,
                    requeue_after=1.0)


def resize(spec: TrainingJobSpec, job: JobView, now: datetime) -> Decision | None:
    """spec.workers changed under a running gang: a planned restart with the new size from the latest
    checkpoint; neither a failure nor counted against backoffLimit."""
    if job.gang_size is None:
        return None
    delay = max(IGNORED_RESTART_FLOOR, backoff_seconds(spec, max(0, job.counted_restarts - 1)))
    return Decision(Action.RESTART_GANG, Phase.RESTARTING, Reason.RESIZED,
                    f"spec.workers changed from {job.gang_size} to {spec.workers}: restarting the whole gang "
                    f"{restart_origin(spec, job)} (a planned restart, not counted against backoffLimit, in {delay:g}s)",
                    job.generation + 1, requeue_after=delay, ignored=True)


def success(spec: TrainingJobSpec, job: JobView, now: datetime) -> Decision | None:
    # Rank 0 exits 0 only after the final checkpoint: training is done whatever the others do now.
    if job.workers and job.workers[0].phase == WorkerPhase.SUCCEEDED:
        return Decision(Action.SUCCEED, Phase.SUCCEEDED, Reason.SUCCEEDED, "worker 0 finished training",
                        job.generation)
    return None


def progressing_despite(since: datetime, last_progress: datetime | None, now: datetime, grace: timedelta) -> bool:
    """The job advanced after `since` (a node went NotReady) and within the last `grace`: its ranks, those on
    that node included, still meet in their collectives (a kubelet that lost the API server, a PLEG flap)."""
    return last_progress is not None and last_progress > since and now - last_progress < grace


DISRUPTION_SHARE = 0.55
"""The share of the cluster's nodes NotReady at once from which a node going NotReady is taken for the cluster's
fault (a control-plane or network partition), not the node's: kube-controller-manager's --unhealthy-zone-threshold
default, at which its node lifecycle controller stops evicting pods too."""
DISRUPTION_MIN_NODES = 3
"""As the node lifecycle controller: a partial disruption needs more than 2 nodes NotReady (every node NotReady
is a full one)."""


def cluster_disruption(not_ready: int, total: int) -> str | None:
    """Why a NotReady node is no reason to restart a gang now, or None: every node of the cluster NotReady, or
    at least DISRUPTION_SHARE of them and DISRUPTION_MIN_NODES or more. Moving the gang would not help then
    (there is nowhere healthy to go, or the nodes are fine and it is the API server that cannot hear them),
    while deleting pods would throw away training that may well still run."""
    if total <= 0 or not_ready <= 0:
        return None
    if not_ready >= total or (not_ready >= DISRUPTION_MIN_NODES and not_ready / total >= DISRUPTION_SHARE):
        return (f"{not_ready} of the cluster's {total} nodes are NotReady at once (at least "
                f"{DISRUPTION_SHARE:.0%}, or all): a disruption of the cluster, not of this job's nodes")
    return None


def node_lost(spec: TrainingJobSpec, w: WorkerState, now: datetime, last_progress: datetime | None,
              broken: bool = False) -> bool:
    """The worker's node is NotReady and the job made no progress for nodeNotReadyGraceSeconds: counted from its
    last progress, which a node that died stopped (the node lifecycle controller says NotReady only ~50 s
    later); `last_progress` None (rank 0 cannot report it): the node NotReady for the grace alone. `broken`:
    another worker lost its peers (peers_lost_since), so the gang cannot progress: no grace to wait for."""
    if w.node_not_ready_since is None or w.phase not in (WorkerPhase.RUNNING, WorkerPhase.PENDING):
        return False
    if broken and w.peers_lost_since is None:
        return True
    grace = timedelta(seconds=spec.restart_policy.node_not_ready_grace_seconds)
    return now - (w.node_not_ready_since if last_progress is None else last_progress) >= grace


def classify(spec: TrainingJobSpec, w: WorkerState, now: datetime, last_progress: datetime | None = None,
             disrupted: bool = False, broken: bool = False) -> FailureKind | None:
    """Why this worker counts as failed, or None when it does not; `last_progress`: when the job last advanced,
    None when that is unknown; `disrupted`: the cluster is (cluster_disruption), its NotReady nodes are no loss;
    `broken`: a worker of the gang lost its peers (node_lost)."""
    if w.reason == "Disrupted" and w.phase in (WorkerPhase.FAILED, WorkerPhase.MISSING):
        return FailureKind.DISRUPTED
    if w.phase == WorkerPhase.FAILED:
        if w.hang is not None:
            return FailureKind.NO_PROGRESS
        if w.reason == "Evicted":
            return FailureKind.EVICTED
        if w.reason == "OOMKilled":
            return FailureKind.OOM_KILLED
        if w.exit_code is not None and w.exit_code in spec.restart_policy.permanent_exit_codes:
            return FailureKind.PERMANENT_EXIT_CODE
        return FailureKind.EXIT_CODE
    if w.phase == WorkerPhase.MISSING and w.created:
        return FailureKind.DELETED
    if w.phase == WorkerPhase.SUCCEEDED and w.ended_before:
        return FailureKind.DISRUPTED  # kept in place after it had finished: it would never join this generation
    if w.phase == WorkerPhase.RUNNING and w.node_terminating is not None:
        return FailureKind.DISRUPTED  # restarted elsewhere now, with a checkpoint, before the node goes
    if not disrupted and node_lost(spec, w, now, last_progress, broken):
        return FailureKind.NODE_LOST
    return None


def describe(w: WorkerState, kind: FailureKind) -> str:
    if kind in (FailureKind.EXIT_CODE, FailureKind.PERMANENT_EXIT_CODE):
        who = f"worker {w.index}'s {w.failed_in}" if w.failed_in else f"worker {w.index}"  # an init container's exit
        if w.exit_code is None:
            return f"{who} failed ({w.reason or 'no exit code reported'})"
        if w.exit_code == contract.PEER_LOST_EXIT_CODE and kind == FailureKind.EXIT_CODE:
            return f"{who} exited with code {w.exit_code} (it lost a peer rank mid-collective)"
        if w.exit_code == contract.IN_PLACE_GAVE_UP_EXIT_CODE and kind == FailureKind.EXIT_CODE:
            return (f"{who} exited with code {w.exit_code} (its launcher was told no new generation "
                    "in time to restart in place)")
        return f"{who} exited with code {w.exit_code}" + (f" ({w.said})" if w.said else "")
    if kind == FailureKind.NODE_LOST:
        return f"worker {w.index}'s node is NotReady or its kubelet silent"
    if kind == FailureKind.DISRUPTED and w.ended_before:
        return f"worker {w.index} had finished before this generation began (it was kept in place as it ended)"
    if kind == FailureKind.DISRUPTED and w.node_terminating is not None:
        return f"worker {w.index}'s node {w.node} is about to go (taint {w.node_terminating})"
    if kind == FailureKind.NO_PROGRESS and w.hang is not None:
        return f"worker {w.index} hung"
    return f"worker {w.index} {kind.value.lower()}"


def at_work(w: WorkerState) -> bool:
    """Running, or fetching into its cache before it runs: started, as startTimeoutSeconds counts it (a big
    model's fetch is the job's own work, not a gang that cannot start)."""
    return w.phase == WorkerPhase.RUNNING or w.fetching


def start_pending(spec: TrainingJobSpec, job: JobView) -> bool:
    """startTimeoutSeconds applies now: set, the gang created and some worker of it not at work yet."""
    return (spec.restart_policy.start_timeout_seconds is not None and job.gang_created_time is not None
            and job.running_since is None and not all(at_work(w) for w in job.workers))


def start_timed_out(spec: TrainingJobSpec, job: JobView, now: datetime) -> bool:
    limit = spec.restart_policy.start_timeout_seconds
    if limit is None or job.gang_created_time is None or not start_pending(spec, job):
        return False
    return now - job.gang_created_time >= timedelta(seconds=limit)


def no_progress(spec: TrainingJobSpec, job: JobView, now: datetime) -> bool:
    limit = spec.restart_policy.progress_deadline_seconds
    if limit is None or job.running_since is None or job.progress_unknown:
        return False
    last = max(t for t in (job.last_progress_time, job.running_since) if t is not None)
    return now - last >= timedelta(seconds=limit)


IGNORED_RESTART_FLOOR = 1.0
"""Seconds at least between two restarts that do not count against backoffLimit."""
SEVERITY: dict[str, int] = {"FailJob": 0, "RestartGang": 1, "RestartGangAndIgnore": 2}


@dataclass(frozen=True)
class Failure:
    worker: WorkerState
    kind: FailureKind
    action: FailureAction
    why: str
    """What chose the action: a rule, restartPolicy.permanentExitCodes, or the defaults."""


def action_for(spec: TrainingJobSpec, w: WorkerState, kind: FailureKind) -> tuple[FailureAction, str]:
    """The first restartPolicy rule that matches this failure, else the defaults."""
    plain = FailureKind.EXIT_CODE if kind == FailureKind.PERMANENT_EXIT_CODE else kind
    for i, rule in enumerate(spec.restart_policy.rules or []):
        by_code = rule.on_exit_codes and w.phase == WorkerPhase.FAILED and w.exit_code in rule.on_exit_codes
        by_kind = rule.on_failures and plain.value in rule.on_failures
        if by_code or by_kind:
            return rule.action, f"restartPolicy.rules[{i}]"
    if kind == FailureKind.PERMANENT_EXIT_CODE:
        return "FailJob", "restartPolicy.permanentExitCodes"
    if kind in DISRUPTIONS:
        return "RestartGangAndIgnore", "a disruption"
    return "RestartGang", ""


def _failure(spec: TrainingJobSpec, w: WorkerState, kind: FailureKind) -> Failure:
    action, why = action_for(spec, w, kind)
    if kind == FailureKind.PERMANENT_EXIT_CODE and action != "FailJob":
        kind = FailureKind.EXIT_CODE  # a rule took the code over: it is an ordinary failure now
    return Failure(w, kind, action, why)


PEERS_LOST_SETTLE_SECONDS = 10.0
"""A kept worker not Ready this soon after it was told to run the generation may still be waiting after the
restart that began it (its launcher reads the Downward API file within seconds): no sign of a new loss."""
PEERS_LOST_MIN_SECONDS = 3.0
"""Not Ready for less than this is no sign: a restarted kubelet reports its pods not Ready until their probe
(every second) answers again."""


def lost_peers_this_generation(w: WorkerState, told_at: datetime | None, now: datetime) -> bool:
    """The worker lost its peers while running this generation, for at least PEERS_LOST_MIN_SECONDS: `told_at`
    is when the kept workers were told to run it (generation_told_at; None: the first generation)."""
    since = w.peers_lost_since
    if since is None or w.held or now < peers_lost_counts_at(since):
        return False
    return told_at is None or since > told_at + timedelta(seconds=PEERS_LOST_SETTLE_SECONDS)


def peers_lost_counts_at(since: datetime) -> datetime:
    """When a worker not Ready since `since` has been so for PEERS_LOST_MIN_SECONDS (lastTransitionTime is cut
    to the second: one more)."""
    return since + timedelta(seconds=PEERS_LOST_MIN_SECONDS + 1)


def generation_told_at(spec: TrainingJobSpec, job: JobView) -> datetime | None:
    """When this generation's kept workers were told to run it: the last restart and the backoff it announced
    (a counted restart's own, an ignored one's that of the last counted); None for the first generation."""
    if job.generation == 0 or job.last_restart_time is None:
        return None
    wait_s = backoff_seconds(spec, max(0, job.counted_restarts - 1))
    if job.ignored_restarts:  # the last restart may have been one (a floor of a second at most)
        wait_s = max(IGNORED_RESTART_FLOOR, wait_s)
    return job.last_restart_time + timedelta(seconds=wait_s)


def _failures(spec: TrainingJobSpec, job: JobView, now: datetime) -> tuple[list[Failure], str]:
    """Every failed worker, the worst first, and what to call it; a hang counts as worker 0's failure."""
    last_progress = None if job.progress_unknown else job.last_progress_time
    told_at = generation_told_at(spec, job)
    broken = any(lost_peers_this_generation(w, told_at, now) for w in job.workers)
    kinds = [(w, k) for w in job.workers
             if (k := classify(spec, w, now, last_progress, job.disruption is not None, broken)) is not None]
    what = ""
    if not kinds and no_progress(spec, job, now):
        kinds = [(job.workers[0], FailureKind.NO_PROGRESS)]
        what = f"no progress for {spec.restart_policy.progress_deadline_seconds}s (progressDeadlineSeconds)"
    elif not kinds and start_timed_out(spec, job, now):
        waiting = next((w for w in job.workers if not at_work(w)), job.workers[0])
        kinds = [(waiting, FailureKind.START_TIMEOUT)]
        what = (f"the gang did not run within {spec.restart_policy.start_timeout_seconds}s "
                f"(startTimeoutSeconds; worker {waiting.index} is {waiting.phase.value.lower()})")
    failures = [_failure(spec, w, k) for w, k in kinds]
    # The harshest action first; an abort (NCCL's watchdog) and a peer-lost exit mostly echo another failure,
    # so they come after it (contract.blame_order).
    failures.sort(key=lambda f: (SEVERITY[f.action], contract.blame_order(f.worker.exit_code)))
    if failures and not what:
        what = describe(failures[0].worker, failures[0].kind)
    return failures, what


def failure(spec: TrainingJobSpec, job: JobView, now: datetime) -> Decision | None:
    """FailJob -> Failed; backoff limit reached -> Failed; otherwise restart the whole gang."""
    failures, what = _failures(spec, job, now)
    if not failures:
        return None
    hang = None
    if failures[0].worker.hang is not None:
        if (gathering := gather_hang_reports(job, now)) is not None:
            return gathering
        hang = hang_verdict(spec, job, now)
        what = f"hung: {hang.message}"
    worst, failed = failures[0], tuple(sorted(f.worker.index for f in failures))
    kind, limit, counted = worst.kind, spec.restart_policy.backoff_limit, job.counted_restarts
    if worst.action == "FailJob":
        return Decision(Action.FAIL, Phase.FAILED, Reason.PERMANENT_ERROR,
                        f"{what}, listed in {worst.why}: not restarting", job.generation,
                        failure_kind=kind, failed_workers=failed, hang=hang)
    ignored = worst.action == "RestartGangAndIgnore"
    if not ignored and counted >= limit:
        return Decision(Action.FAIL, Phase.FAILED, Reason.BACKOFF_LIMIT_EXCEEDED,
                        f"{what}; the gang already restarted {counted} time(s) "
                        f"(restartPolicy.backoffLimit={limit})", job.generation,
                        failure_kind=kind, failed_workers=failed, hang=hang)
    # Restarts that are not counted have no limit: at least IGNORED_RESTART_FLOOR apart, never a storm.
    delay = max(IGNORED_RESTART_FLOOR, backoff_seconds(spec, max(0, counted - 1))) if ignored \
        else backoff_seconds(spec, counted)
    count = (f"not counted against backoffLimit: {worst.why}" if ignored
             else f"restart {counted + 1} of at most {limit}")
    keep = kept_in_place(spec, job, failures)
    how = f" in place, keeping {len(keep)} of {spec.workers} workers" if keep else ""
    return Decision(Action.RESTART_GANG, Phase.RESTARTING, kind.value,
                    f"{what}: restarting the whole gang {restart_origin(spec, job)}{how} ({count}, in {delay:g}s)",
                    job.generation + 1, requeue_after=delay, failure_kind=kind, failed_workers=failed,
                    ignored=ignored, keep=keep, hang=hang)


HANG_GATHER_SECONDS = 15.0
"""How long a hang verdict waits for the reports of the gang's other workers, which find the gang silent at
about the same moment but end a few seconds apart."""


def gather_hang_reports(job: JobView, now: datetime) -> Decision | None:
    """Wait while a worker of the gang still runs and the first hang report is younger than HANG_GATHER_SECONDS,
    unless a report names the culprit, a stopped rank or a worker that does not answer (_culprit_named): that
    worker ended without waiting out its silence limit, and the others are not past theirs."""
    reports = [w.hang for w in job.workers if w.hang is not None]
    running = [w.index for w in job.workers if w.phase == WorkerPhase.RUNNING]
    first = min(r.at for r in reports) if reports else 0.0
    left = HANG_GATHER_SECONDS - (now.timestamp() - first)
    if not running or not first or left <= 0 or _culprit_named(job):
        return None
    return Decision(Action.WAIT, Phase.RUNNING, Reason.HANG_FOUND,
                    f"worker(s) {', '.join(str(w.index) for w in job.workers if w.hang)} hung; waiting up to "
                    f"{left:.0f}s for the reports of worker(s) {', '.join(map(str, running))}", job.generation,
                    requeue_after=min(left, 2.0))


def hang_verdict(spec: TrainingJobSpec, job: JobView, now: datetime) -> LastHang:
    """status.lastHang from every hung worker's report: the odd ranks named with their pods and nodes."""
    hung = [w for w in job.workers if w.hang is not None]
    worker_of = {r.rank: w for w in hung for r in w.hang.ranks}
    reports = [r for w in hung for r in w.hang.ranks]
    names = {rank: _worker_name(w) for rank, w in worker_of.items()}
    silent = [w for w in job.workers if w.index in {i for h in hung for i in h.hang.unanswered}]
    unanswered = [_worker_name(w) for w in silent]
    by_rank = {r.rank: r for r in reports}
    suspects = [HangSuspect(rank=r, worker=w.index, pod=w.pod, node=w.node, where=hangs.NOT_ANSWERING)
                for w in silent for r in range(w.index * spec.procs, (w.index + 1) * spec.procs)]
    suspects += [HangSuspect(rank=r, worker=worker_of[r].index, pod=worker_of[r].pod, node=worker_of[r].node,
                             where=by_rank[r].where) for r in ([] if silent else hangs.suspects(reports))]
    steps = [r.step for r in reports if r.step is not None]
    first = min((w.hang for w in hung), key=lambda h: h.at)
    dumps = sorted({w.hang.dumps for w in hung if w.hang.dumps})
    return LastHang(time=contract.format_time(now), generation=job.generation, step=max(steps) if steps else None,
                    silent_seconds=round(first.silent_seconds, 1), limit_seconds=round(first.limit_seconds, 1),
                    suspects=suspects[:64], message=hangs.verdict(reports, range(spec.world_size), names, unanswered),
                    dumps="; ".join(dumps))


def _worker_name(w: WorkerState) -> str:
    where = ", ".join(x for x in (f"pod {w.pod}" if w.pod else "", f"node {w.node}" if w.node else "") if x)
    return f"worker {w.index}" + (f" ({where})" if where else "")


def kept_in_place(spec: TrainingJobSpec, job: JobView, failures: list[Failure]) -> tuple[int, ...]:
    """The workers an in-place restart keeps: on a Ready node, able to restart in place, and running and not
    failed themselves, or failed where they are started again at once (restartable). None when the gang
    never ran (StartTimeout) or a kept worker's launcher did not answer the last in-place restart: then
    every worker is recreated."""
    if not spec.restarts_in_place:
        return ()
    if any(f.kind == FailureKind.START_TIMEOUT or f.worker.exit_code == contract.IN_PLACE_GAVE_UP_EXIT_CODE
           for f in failures):
        return ()
    failed = {f.worker.index for f in failures if f.kind != FailureKind.NO_PROGRESS}  # a hang is the gang's
    unheard = _unheard_in_hang(job, failures)
    return tuple(w.index for w in job.workers if w.in_place and w.node_not_ready_since is None
                 and w.index not in unheard
                 and (w.restartable or (w.phase == WorkerPhase.RUNNING and w.index not in failed)))


def _unheard_in_hang(job: JobView, failures: list[Failure]) -> set[int]:
    """In a hang judged from the launchers' reports, the running workers that sent none while the verdict
    waited for them (gather_hang_reports): every launcher of a hung gang finds its ranks silent within
    moments of the others, so one that did not report does not answer (its node frozen, cut off or gone)
    and would not answer an in-place restart either. A report that names its culprit decides without
    waiting: the workers a report says do not answer are those; with a stopped rank, none (the others are
    not past their limits yet, and are kept)."""
    if not failures or failures[0].worker.hang is None:
        return set()
    unanswered = {i for w in job.workers if w.hang is not None for i in w.hang.unanswered}
    if unanswered or _culprit_named(job):
        return {w.index for w in job.workers if w.index in unanswered and w.hang is None}
    return {w.index for w in job.workers if w.hang is None and w.phase == WorkerPhase.RUNNING}


def _culprit_named(job: JobView) -> bool:
    """Whether a hang report names its culprit: a stopped rank, or a worker that does not answer."""
    reports = [w.hang for w in job.workers if w.hang is not None]
    return any(h.unanswered or any(r.state == hangs.STOPPED for r in h.ranks) for h in reports)


def start(spec: TrainingJobSpec, job: JobView, now: datetime) -> Decision | None:
    """Create the missing workers of this generation and start the kept ones in it, once a restart's
    backoff has passed."""
    missing = [w.index for w in job.workers if w.phase == WorkerPhase.MISSING]
    held = sum(w.held for w in job.workers)
    if not missing and not held:
        return None
    gen = job.generation
    ready_at = generation_told_at(spec, job)
    if ready_at is not None and now < ready_at:
        wait = (ready_at - now).total_seconds()
        return Decision(Action.WAIT, Phase.RESTARTING, Reason.BACKOFF_WAIT,
                        f"starting generation {gen} {restart_origin(spec, job)} in {wait:.1f}s", gen,
                        requeue_after=wait)
    origin = f" {restart_origin(spec, job)}" if gen > 0 else ""
    kept = f" and restarting {held} in place" if held else ""
    return Decision(Action.CREATE_WORKERS, Phase.CREATED if gen == 0 else Phase.RESTARTING,
                    Reason.CREATING_WORKERS,
                    f"creating {len(missing)} of {spec.workers} worker(s) of generation {gen}{kept}{origin}", gen)


def next_deadline(spec: TrainingJobSpec, job: JobView, now: datetime, default: float) -> float:
    """Seconds until the next deadline could pass (progress, start, active), at most `default`: a hang or
    a stuck start is seen when its deadline passes, not at the next periodic look."""
    policy, at = spec.restart_policy, []
    if policy.progress_deadline_seconds is not None and job.running_since and not job.progress_unknown:
        last = max(t for t in (job.last_progress_time, job.running_since) if t is not None)
        at.append(last + timedelta(seconds=policy.progress_deadline_seconds))
    if policy.start_timeout_seconds is not None and job.gang_created_time and start_pending(spec, job):
        at.append(job.gang_created_time + timedelta(seconds=policy.start_timeout_seconds))
    if spec.active_deadline_seconds is not None and job.start_time is not None:
        at.append(job.start_time + timedelta(seconds=spec.active_deadline_seconds))
    last_progress = None if job.progress_unknown else job.last_progress_time
    for w in job.workers:  # when a NotReady node's grace could run out (node_lost), or its gang count broken
        if w.node_not_ready_since is not None and job.disruption is None:
            since = w.node_not_ready_since if last_progress is None else last_progress
            at.append(since + timedelta(seconds=policy.node_not_ready_grace_seconds))
        if w.peers_lost_since is not None and not w.held and peers_lost_counts_at(w.peers_lost_since) > now:
            at.append(peers_lost_counts_at(w.peers_lost_since))
    return max(0.5, min([default, *((t - now).total_seconds() for t in at)]))


def wait(spec: TrainingJobSpec, job: JobView, now: datetime) -> Decision:
    if all(w.phase in (WorkerPhase.RUNNING, WorkerPhase.SUCCEEDED) for w in job.workers):
        return Decision(Action.WAIT, Phase.RUNNING, Reason.ALL_WORKERS_RUNNING, f"{spec.workers} worker(s) running",
                        job.generation, next_deadline(spec, job, now, 30.0))
    pending = sum(w.phase == WorkerPhase.PENDING for w in job.workers)
    message = f"{pending} of {spec.workers} worker(s) pending"
    if fetching := sum(w.fetching for w in job.workers):
        message += f": {fetching} fetching {fetch_text(spec, job.fetch)}"
    return Decision(Action.WAIT, Phase.CREATED if job.generation == 0 else Phase.RESTARTING,
                    Reason.WAITING_FOR_WORKERS, message, job.generation, next_deadline(spec, job, now, 5.0))


def fetch_text(spec: TrainingJobSpec, fetch: Fetch | None) -> str:
    """What the workers fetch: as worker 0 reports it, with its bytes so far of the total, else as the spec
    names it (before its first report, or after its own fetch ended while others still run)."""
    if fetch is not None and not fetch.done:
        size = f" ({byte_size(fetch.bytes)} of {byte_size(fetch.total_bytes)})" if fetch.total_bytes else ""
        return f"{fetch.field} {fetch.uri}{size}"
    return ", ".join(f"{field} {uri}" for field, uri in spec.fetched_uris().items())


def byte_size(n: int) -> str:
    """Bytes for people: `1.2 GiB`."""
    for unit, scale in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


POLICIES: tuple[Policy, ...] = (suspend, deadline, old_generation, success, resize, failure, start, wait)


def decide(spec: TrainingJobSpec, job: JobView, now: datetime) -> Decision:
    """The next action for a job that has not finished yet: the first policy that has one."""
    for policy in POLICIES:
        if (d := policy(spec, job, now)) is not None:
            return d
    raise AssertionError("wait() always decides")  # pragma: no cover
