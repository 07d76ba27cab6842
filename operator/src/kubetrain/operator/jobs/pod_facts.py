"""What the operator reads from a worker pod, worked out once per version of the pod.

A reconcile looks at every pod of its job, and a gang being created is reconciled after nearly every
pod event: with 1024 workers, reading the same unchanged pods again and again was a third of the
operator's CPU. A pod's facts depend on the pod alone, so they are kept per (namespace, name,
uid, resourceVersion, being deleted): the operator marks a pod it deleted as terminating before the
watch says so, under the same resourceVersion. A pod without a resourceVersion (built, not read from the API
server) is read afresh each time.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kubetrain.core import contract
from kubetrain.core.contract import parse_time
from kubetrain.core.hangs import HangReport
from kubetrain.core.lifecycle import WorkerPhase
from kubetrain.operator.jobs import builders as b

MEMO_LIMIT = 16384
"""Pod versions remembered; all are forgotten at once when full (older versions are never asked again)."""


@dataclass(frozen=True, slots=True)
class PodFacts:
    index: int
    """The worker index label (-1 without one)."""
    generation: int
    """The restart generation label (-1 without one)."""
    phase: WorkerPhase
    """The worker as the lifecycle sees it: judged by the trainer container, not the pod phase."""
    exit_code: int | None
    reason: str | None
    node: str | None
    in_place: bool
    """The pod's launcher runs whatever generation the operator tells it (kubetrain.io/in-place)."""
    held: bool
    """Told a generation other than its label's: a kept pod waiting for its restart's backoff."""
    restarts_here: bool
    """The kubelet starts a failed trainer container again in this pod (restartPolicy OnFailure)."""
    failures: int
    """How many times the kubelet saw the trainer container fail in this pod (restartPolicy OnFailure)."""
    restartable: bool
    """Failed, and the kubelet starts its container again in this pod at once (its first failure here, or one
    after the container ran KUBELET_BACKOFF_RESET_SECONDS: no crash-loop back-off): an in-place restart can keep
    the worker, whose launcher waits for the next generation."""
    running: bool
    """Pending, or a container still runs (see still_running)."""
    ready: bool
    pending: bool
    """Pending and not being deleted: a pod that may be blocked."""
    unschedulable_since: datetime | None
    """When the scheduler last said it found no node for the pod (None: it did not)."""
    hang: HangReport | None = None
    """A hung worker's report: its launcher's termination message (exit code contract.HUNG_EXIT_CODE)."""
    ended_at: datetime | None = None
    """When the trainer container of a Succeeded worker ended."""
    said: str | None = None
    """The configuration error of the container that failed (exit contract.CONFIG_ERROR_EXIT_CODE), from its
    termination message: the trainer's, or the fetch's (failed_in)."""
    failed_in: str | None = None
    """The init container whose failure is the worker's (its exit code, reason and message are the worker's),
    such as contract.FETCH_CONTAINER; None: the trainer container's own."""
    fetching: bool = False
    """The init container contract.FETCH_CONTAINER runs: the pod is Pending while it fills the cache."""
    peers_lost_since: datetime | None = None
    """Restarting in place, its trainer container running and not Ready since then, after it was: its launcher
    closed the readiness probe's port (builders.GANG_PROBE) to wait for the next generation, its processes
    having lost their peers."""


_memo: dict[tuple[str, str, str, str, bool], PodFacts] = {}


def facts(pod: dict[str, Any]) -> PodFacts:
    meta = pod["metadata"]
    rv = meta.get("resourceVersion")
    if not rv:
        return _read(pod)
    key = (meta.get("namespace") or "", meta["name"], meta.get("uid") or "", rv, "deletionTimestamp" in meta)
    found = _memo.get(key)
    if found is None:
        if len(_memo) >= MEMO_LIMIT:
            _memo.clear()
        found = _memo[key] = _read(pod)
    return found


def _read(pod: dict[str, Any]) -> PodFacts:
    meta, status = pod["metadata"], pod.get("status") or {}
    labels, notes = meta.get("labels") or {}, meta.get("annotations") or {}
    generation = int(labels.get(b.LABEL_GENERATION, "-1"))
    restarts_here = (pod.get("spec") or {}).get("restartPolicy") == "OnFailure"
    failures, last = _failures(pod) if restarts_here else (0, None)
    handled = int(notes.get(contract.FAILURES_HANDLED_ANNOTATION) or 0)
    phase, exit_code, reason = (restarts_here and _restarted(pod, failures, handled, last, generation)) or _worker(pod)
    told = notes.get(contract.GENERATION_ANNOTATION)  # lags the label while a kept pod waits for its backoff
    pending = status.get("phase", "Pending") == "Pending" and not meta.get("deletionTimestamp")
    restartable = phase == WorkerPhase.FAILED and last is not None and (failures == 1 or _backoff_reset(last))
    ended = last if restarts_here and last else _trainer_terminated(status)
    init = _failed_init(status) if reason == INIT_FAILED else None
    if init is not None:
        ended = init[1]
    hang = _hang(ended) if phase == WorkerPhase.FAILED and exit_code == contract.HUNG_EXIT_CODE else None
    said = _said(ended) if phase == WorkerPhase.FAILED and exit_code == contract.CONFIG_ERROR_EXIT_CODE else None
    return PodFacts(
        index=int(labels.get(b.LABEL_INDEX, "-1")), generation=generation, phase=phase, exit_code=exit_code,
        reason=reason, node=(pod.get("spec") or {}).get("nodeName") or None,
        in_place=notes.get(contract.IN_PLACE_ANNOTATION) == "true", held=told is not None and told != str(generation),
        restarts_here=restarts_here, failures=failures, restartable=restartable,
        running=failures > 0 or _still_running(status), ready=_ready(status), pending=pending,
        unschedulable_since=_unschedulable_since(status), hang=hang, said=said,
        failed_in=init[0] if init is not None else None, fetching=pending and _fetching(status),
        ended_at=contract.parse_time((ended or {}).get("finishedAt")) if phase == WorkerPhase.SUCCEEDED else None,
        peers_lost_since=_peers_lost_since(status) if phase == WorkerPhase.RUNNING and _gang_probed(pod) else None,
    )


KUBELET_BACKOFF_RESET_SECONDS = 600 + 5
"""The kubelet restarts a container that failed again at once only where it ran for more than twice the
crash-loop back-off's 300 s cap since its last restart (k8s.io/client-go flowcontrol.Backoff: an entry that old has
expired); otherwise it waits 10 s, doubling. 5 s more for the timestamps' whole seconds."""


def _backoff_reset(terminated: dict[str, Any]) -> bool:
    """The failed container ran long enough that the kubelet's back-off for it has expired."""
    started, finished = parse_time(terminated.get("startedAt")), parse_time(terminated.get("finishedAt"))
    return started is not None and finished is not None and \
        (finished - started).total_seconds() > KUBELET_BACKOFF_RESET_SECONDS


def _hang(terminated: dict[str, Any] | None) -> HangReport | None:
    return HangReport.decode((terminated or {}).get("message"))


SAID_LIMIT = 400
"""Characters of a configuration error kept for status and Events (the kubelet keeps up to 4096)."""


def _said(terminated: dict[str, Any] | None) -> str | None:
    lines = ((terminated or {}).get("message") or "").strip().splitlines()
    return lines[-1][:SAID_LIMIT] if lines else None


def _fetching(status: dict[str, Any]) -> bool:
    return any(cs.get("name") == contract.FETCH_CONTAINER and (cs.get("state") or {}).get("running") is not None
               for cs in status.get("initContainerStatuses") or [])


def _worker(pod: dict[str, Any]) -> tuple[WorkerPhase, int | None, str | None]:
    """A sidecar (native or not) keeps a pod Running after the trainer has exited; a pod whose init container
    failed ends before the trainer starts, and that container's exit is the worker's."""
    status = pod.get("status") or {}
    phase = status.get("phase", "Pending")
    term = _trainer_terminated(status)
    ended = term is not None or phase in ("Succeeded", "Failed")
    if pod["metadata"].get("deletionTimestamp") and not ended:
        return WorkerPhase.MISSING, None, "Disrupted" if disrupted(pod) else "Deleted"
    if phase == "Succeeded" or (term is not None and term.get("exitCode") == 0 and term.get("reason") != "StartError"):
        return WorkerPhase.SUCCEEDED, 0, None
    if ended:
        reason = "Disrupted" if disrupted(pod) else status.get("reason")
        if term is None and reason is None and (init := _failed_init(status)) is not None:
            return WorkerPhase.FAILED, container_exit_code(init[1]), INIT_FAILED
        if term is not None and term.get("reason") == "OOMKilled":
            reason = "OOMKilled"
        return WorkerPhase.FAILED, container_exit_code(term or {}), reason
    return (WorkerPhase.RUNNING if phase == "Running" else WorkerPhase.PENDING), None, None


def _failures(pod: dict[str, Any]) -> tuple[int, dict[str, Any] | None]:
    """In a pod whose kubelet restarts a failed trainer container (restarts_here) and which is not ending:
    how many times that container failed, and the newest failure's terminated state."""
    meta, status = pod["metadata"], pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") not in ("Pending", "Running"):
        return 0, None
    cs: dict[str, Any] = next((c for c in status.get("containerStatuses") or [] if c.get("name") == b.CONTAINER), {})
    count = int(cs.get("restartCount") or 0)
    term = (cs.get("state") or {}).get("terminated")
    if term:  # a failure the kubelet has not restarted yet, or the worker's end
        return (count + 1, dict(term)) if term.get("exitCode") != 0 else (0, None)
    last = (cs.get("lastState") or {}).get("terminated")
    return (count, dict(last)) if count and last else (0, None)


def _restarted(pod: dict[str, Any], failures: int, handled: int, last: dict[str, Any] | None,
               generation: int) -> tuple[WorkerPhase, int | None, str | None] | None:
    """A worker in a pod that restarts it (restarts_here), as the lifecycle sees it: a failure the operator has not acted on
    yet, or running again (a failure it has, or one of a generation before the pod's: the gang had already
    restarted when it came); None where the pod tells it alone (_worker)."""
    if failures > handled and last is not None and not _older_generation(last, generation):
        return WorkerPhase.FAILED, container_exit_code(last), "OOMKilled" if last.get("reason") == "OOMKilled" else None
    if failures:
        return WorkerPhase.RUNNING, None, None  # the kubelet starts the container again at once
    if (init := _init_failed(pod)) is not None:
        return WorkerPhase.FAILED, container_exit_code(init[1]), INIT_FAILED
    return None


def _older_generation(terminated: dict[str, Any], generation: int) -> bool:
    """The container ended running a generation before `generation`, as its hang report says (the other
    workers' reports restart the gang while this one still saves its stacks)."""
    if container_exit_code(terminated) != contract.HUNG_EXIT_CODE:
        return False
    report = _hang(terminated)
    return report is not None and report.generation is not None and report.generation < generation


INIT_FAILED = "InitContainerFailed"
"""The worker's reason when an init container failed it (PodFacts.failed_in names which)."""


def _init_failed(pod: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """An init container that failed in a pending pod the kubelet would retry for ever (restarts_here): the
    worker failed, as it does with restartPolicy Never."""
    status = pod.get("status") or {}
    if status.get("phase") != "Pending" or pod["metadata"].get("deletionTimestamp"):
        return None
    return _failed_init(status)


def _failed_init(status: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The first init container that failed: its name and terminated state (while the kubelet backs off
    restarting it, the one it keeps as its last)."""
    for cs in status.get("initContainerStatuses") or []:
        state = cs.get("state") or {}
        term = state.get("terminated") or {}
        crashing = (state.get("waiting") or {}).get("reason") == "CrashLoopBackOff"
        if term.get("exitCode") or crashing:
            return str(cs.get("name") or ""), dict(term or (cs.get("lastState") or {}).get("terminated") or {})
    return None


def disrupted(pod: dict[str, Any]) -> bool:
    """The pod carries DisruptionTarget=True: preempted, evicted through the API, drained, or taint-evicted."""
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "DisruptionTarget" and c.get("status") == "True" for c in conds)


def _trainer_terminated(status: dict[str, Any]) -> dict[str, Any] | None:
    """The trainer container's terminated state, if it ended (sidecars may keep the pod Running)."""
    for cs in status.get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if cs.get("name") == b.CONTAINER and term:
            return dict(term)
    return None


def container_exit_code(terminated: dict[str, Any]) -> int | None:
    """The container's exit code, as a shell would give it for a command the runtime could not start:
    runc reports such a container as StartError with 128, and 128 alone would count as retryable."""
    if terminated.get("reason") == "StartError":
        message = terminated.get("message") or ""
        exec_failed = 'exec: "' in message  # runc could not exec the command (not a mount or workingDir)
        if exec_failed and ("executable file not found" in message or "no such file or directory" in message):
            return contract.COMMAND_NOT_FOUND_EXIT_CODE
        if exec_failed and "permission denied" in message:
            return contract.COMMAND_NOT_EXECUTABLE_EXIT_CODE
    code = terminated.get("exitCode")
    return int(code) if code is not None else None


def _still_running(status: dict[str, Any]) -> bool:
    """A pod whose containers all ended is finished even while its phase still says Running: the kubelet
    updates the phase a moment later, and deleting that pod would lose rank 0's log."""
    if status.get("phase") not in ("Pending", "Running", None):
        return False
    statuses = [*(status.get("containerStatuses") or []), *(status.get("initContainerStatuses") or [])]
    return status.get("phase") != "Running" or not statuses or \
        any(not (cs.get("state") or {}).get("terminated") for cs in statuses)


def _ready(status: dict[str, Any]) -> bool:
    return status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def _gang_probed(pod: dict[str, Any]) -> bool:
    """The trainer container has the gang probe (builders.gang_probe, which sets contract.GANG_PROBE_PORT with
    it): its readiness says whether its processes lost their peers, and nothing else does."""
    spec = pod.get("spec") or {}
    c: dict[str, Any] = next((c for c in spec.get("containers") or [] if c.get("name") == b.CONTAINER), {})
    return spec.get("restartPolicy") == "OnFailure" and \
        any(e.get("name") == contract.GANG_PROBE_PORT for e in c.get("env") or [])


def _peers_lost_since(status: dict[str, Any]) -> datetime | None:
    """When the pod stopped being Ready, where that came after its trainer container started (not Ready as it
    starts, before its first probe, is no sign; a container the kubelet started again is a new one)."""
    cs: dict[str, Any] = next((c for c in status.get("containerStatuses") or [] if c.get("name") == b.CONTAINER), {})
    started = parse_time(((cs.get("state") or {}).get("running") or {}).get("startedAt"))
    ready: dict[str, Any] = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
    since = parse_time(ready.get("lastTransitionTime"))
    if started is None or since is None or cs.get("ready") or ready.get("status") != "False":
        return None
    return since if since > started else None


def _unschedulable_since(status: dict[str, Any]) -> datetime | None:
    for c in status.get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
            return parse_time(c.get("lastTransitionTime")) or datetime.min.replace(tzinfo=UTC)
    return None
