"""The text of `kubetrain status` and `kubetrain describe` (pure: values in, lines out).

`describe` adds to status the workers of the newest generation, goodput, recent Events and,
when the job is blocked or ended badly, one line saying what to do next.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from kubetrain.core.api import (
    ADMITTED,
    WORKERS_BLOCKED,
    ConditionReason,
    Goodput,
    LastHang,
    Phase,
    TrainingJob,
    TrainingJobStatus,
)
from kubetrain.core.client.model import Event, Worker
from kubetrain.core.contract import parse_time
from kubetrain.core.lifecycle.status import gpu_hours_now

RECENT_EVENTS = 10

BLOCKED_NEXT = {
    ConditionReason.IMAGE_PULL_FAILED: "check spec.image (name, tag) and that the nodes may pull it "
    "(imagePullSecrets); `kubectl describe pod {pod}` shows the kubelet's error",
    ConditionReason.INVALID_IMAGE_NAME: "fix spec.image: it is not a valid image reference",
    ConditionReason.CONTAINER_CONFIG_ERROR: "create the Secret or ConfigMap the workers refer to (spec.env, "
    "spec.volumes), or fix the key named above",
    ConditionReason.CONTAINER_CREATE_ERROR: "the container runtime refused the container: see the message above",
    ConditionReason.UNSCHEDULABLE: "no node fits a worker: lower spec.resources or spec.workers, or check node "
    "selectors and taints; `kubectl describe pod {pod}` says what is short",
    ConditionReason.CHECKPOINT_CLAIM_PENDING: "the checkpoint claim is not bound: check its StorageClass "
    "(`kubectl get pvc`), or set spec.checkpoint.claimName to a bound claim",
    ConditionReason.CREATE_REJECTED: "the API server refused a worker pod (a ResourceQuota, Pod Security): "
    "see the message above",
    ConditionReason.FOREIGN_OBJECT: "delete or rename the object named above, which this job does not own",
    ConditionReason.GANG_SCHEDULER_MISSING: "install the gang scheduler's PodGroup CRD, or remove "
    "spec.scheduling.gang",
}
ADMISSION_NEXT = {
    ConditionReason.QUEUED: "waiting for quota in Kueue's ClusterQueue (`kubectl get workloads`); it starts when "
    "admitted",
    ConditionReason.KUEUE_MISSING: "install Kueue, or remove spec.scheduling.queue",
    ConditionReason.PRIORITY_CLASS_MISSING: "create the WorkloadPriorityClass named by kueue.x-k8s.io/priority-class",
}


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("   ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def age(ts: str | None, now: datetime) -> str:
    then = parse_time(ts)
    if then is None:
        return "-"
    seconds = int((now - then).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def hang_lines(hang: LastHang | None) -> list[str]:
    """status.lastHang: the verdict, when and where the stacks are."""
    if hang is None:
        return []
    return [f"Last hang:   {hang.time} generation {hang.generation} step {hang.step}: {hang.message}",
            f"             silent {hang.silent_seconds:g}s (limit {hang.limit_seconds:g}s); stacks in "
            f"{hang.dumps or '-'} (the checkpoint volume) and the workers' previous logs"]


def _progress_line(st: TrainingJobStatus) -> str:
    return (f"Step:        {st.current_step}" + (f"/{st.max_steps}" if st.max_steps else "")
            + (f"  loss {st.loss}" if st.loss else "") + (f"  eval loss {st.eval_loss}" if st.eval_loss else "")
            + (f"  ({st.percent_complete}, ETA {st.eta or '-'})" if st.percent_complete else ""))


def status_lines(name: str, namespace: str, st: TrainingJobStatus) -> list[str]:
    """`kubetrain status`: phase, workers, progress, restarts, checkpoint, hang and conditions."""
    lines = [f"Name:        {name}", f"Namespace:   {namespace}",
             f"Phase:       {st.phase}" + (f" ({st.reason})" if st.reason else ""),
             f"Workers:     {st.workers_summary or '-'}", _progress_line(st),
             f"Restarts:    {st.restart_count} (generation {st.restart_generation})"]
    if st.tokens_per_second:
        lines.append(f"Throughput:  {st.tokens_per_second:,} tokens/s" + (f", MFU {st.mfu}" if st.mfu else ""))
    if st.failures:
        lines.append("Failures:    " + ", ".join(f"{k}={v}" for k, v in sorted(st.failures.items())))
    if st.last_checkpoint is not None:
        ck = st.last_checkpoint
        lines.append(f"Checkpoint:  step {ck.step} at {ck.path} ({ck.time or ''})")
    if st.export:
        lines.append(f"Export:      {st.export}")
    if st.resumed_from_step or st.resumed_from:
        tier = f" ({st.resumed_from} tier)" if st.resumed_from else ""
        lines.append(f"Resumed:     from step {st.resumed_from_step}{tier}")
    if st.message:
        lines.append(f"Message:     {st.message}")
    lines += hang_lines(st.last_hang)
    if st.conditions:
        rows = [["TYPE", "STATUS", "REASON", "LAST TRANSITION", "MESSAGE"]] + [
            [c.type, c.status, c.reason, c.last_transition_time or "", c.message] for c in st.conditions]
        lines += ["Conditions:"] + ["  " + line for line in table(rows).splitlines()]
    return lines


def gpu_line(st: TrainingJobStatus, now: datetime) -> str | None:
    """GPU-hours allocated up to `now`, what restarts cost of them, and the GPUs held now."""
    total = gpu_hours_now(st.gpu_hours, st.goodput, now)
    if total <= 0 and not st.goodput.gpus_held:
        return None
    return (f"GPU-hours:   {total:.2f} allocated, {st.goodput.lost_gpu_hours:.2f} lost to restarts "
            f"({st.goodput.gpus_held} GPU(s) held now)")


def goodput_line(g: Goodput) -> str | None:
    total = g.productive_seconds + g.lost_seconds
    if total <= 0:
        return None
    return (f"Goodput:     {100 * g.productive_seconds / total:.1f}% (productive {g.productive_seconds:.1f}s, "
            f"lost {g.lost_seconds:.1f}s, {g.steps_lost} step(s) redone)")


def next_step(name: str, st: TrainingJobStatus, workers: Sequence[Worker]) -> str | None:
    """What to do next when the job is blocked, suspended or failed; None when it is on its way."""
    stuck = next((w for w in workers if w.state and w.phase != "Running"), None)
    pod = stuck.name if stuck else f"{name}-worker-0"
    for c in st.conditions:
        if c.type == WORKERS_BLOCKED and c.status == "True" and c.reason in BLOCKED_NEXT:
            return BLOCKED_NEXT[ConditionReason(c.reason)].format(pod=pod)
        if c.type == ADMITTED and c.status == "False" and c.reason in ADMISSION_NEXT:
            return ADMISSION_NEXT[ConditionReason(c.reason)]
    if stuck is not None and stuck.state in ("ErrImagePull", "ImagePullBackOff"):
        return BLOCKED_NEXT[ConditionReason.IMAGE_PULL_FAILED].format(pod=pod)
    if stuck is not None and stuck.state == "Unschedulable":
        return BLOCKED_NEXT[ConditionReason.UNSCHEDULABLE].format(pod=pod)
    if st.phase == Phase.SUSPENDED:
        return f"`kubetrain resume {name}` starts it again from its newest checkpoint"
    if st.phase == Phase.FAILED:
        failed = next((w for w in workers if w.phase == "Failed"), None)
        rank = f" --rank {failed.index}" if failed else ""
        return f"read the failed worker's log (`kubetrain logs {name}{rank}`), fix the cause and submit again"
    return None


def _worker_rows(workers: Sequence[Worker]) -> list[str]:
    rows = [["WORKER", "GEN", "PHASE", "STATE", "EXIT", "RESTARTS", "NODE", "POD", "MESSAGE"]] + [
        [str(w.index), str(w.generation), w.phase, w.state or "-", "-" if w.exit_code is None else str(w.exit_code),
         str(w.restarts), w.node or "-", w.name, w.message[:120]] for w in workers]
    return ["Per worker:"] + ["  " + line for line in table(rows).splitlines()]


def _event_rows(events: Sequence[Event], now: datetime) -> list[str]:
    recent = list(events)[-RECENT_EVENTS:]
    rows = [["AGE", "TYPE", "REASON", "MESSAGE"]] + [
        [age(e.time, now), e.type, e.reason + (f" (x{e.count})" if e.count > 1 else ""), e.message] for e in recent]
    return [f"Events (last {len(recent)} of {len(events)}):"] + ["  " + line for line in table(rows).splitlines()]


def describe_text(job: TrainingJob, events: Sequence[Event], workers: Sequence[Worker], now: datetime) -> str:
    """`kubetrain describe`: status, goodput, per-worker state, recent Events, and what to do next."""
    st = job.status or TrainingJobStatus()
    meta = job.metadata
    lines = status_lines(meta.name, meta.namespace or "-", st)
    lines.insert(2, f"Created:     {getattr(meta, 'creationTimestamp', None) or '-'}"
                    f"  (strategy {job.spec.strategy}, {job.spec.workers} worker(s) x {job.spec.procs} process(es))")
    if (g := goodput_line(st.goodput)) is not None:
        lines.append(g)
    if (gpu := gpu_line(st, now)) is not None:
        lines.append(gpu)
    lines += _worker_rows(workers) if workers else ["Per worker:  none (yet)"]
    lines += _event_rows(events, now) if events else ["Events:      none"]
    if (hint := next_step(meta.name, st, workers)) is not None:
        lines.append(f"Next:        {hint}")
    return "\n".join(lines)
