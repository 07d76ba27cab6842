"""Pure parts of bench/compare.py: scenarios, job manifests, /proc and audit-log parsing, the table.

Nothing here talks to a cluster or reads a clock, so tests/unit/test_bench_compare.py can cover it.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

KUBETRAIN = "kubetrain"
KUBEFLOW = "kubeflow"
CREATOR = "creator"
"""bench/min_creator.py: no controller, only kubetrain's pods and Services created as fast as it can."""
OPERATOR_TITLES = {KUBETRAIN: "kubetrain", KUBEFLOW: "Kubeflow v1", CREATOR: "minimal creator"}
NO_CONTROLLER = "n/a: no controller"
"""What the creator's column says for a recovery scenario: nothing would replace the failed pod."""

TRAINER_IMAGE = "kubetrain/trainer:bench"
"""Never pulled: kwok runs no containers. The same image name goes into both operators' pods."""
FAIL_EXIT_CODE = 137
"""The injected failure: SIGKILL-like. kubetrain restarts the gang for it; Kubeflow's ExitCode policy retries it."""


# --------------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class Scenario:
    name: str
    jobs: int
    workers: int
    """Pods per job (Kubeflow: 1 Master + workers-1 Worker replicas)."""
    gpus: int
    """nvidia.com/gpu per pod."""
    fail_one: bool = False
    """Recovery scenario: once all pods run, one worker fails (exit 137)."""

    @property
    def pods(self) -> int:
        return self.jobs * self.workers

    def describe(self) -> str:
        what = f"{self.jobs} job{'s' if self.jobs > 1 else ''} x {self.workers} workers"
        gpu = f"{self.gpus} GPU/worker" if self.gpus else "no GPU"
        return f"{what}, {gpu}" + (", one worker fails" if self.fail_one else "")


FULL_NODES = 128
QUICK_NODES = 16
FULL: tuple[Scenario, ...] = (
    Scenario("gang-1024", 1, 1024, 1),
    Scenario("jobs-200x8", 200, 8, 0),
    Scenario("jobs-1000x2", 1000, 2, 0),
    Scenario("recovery-128", 1, 128, 8, fail_one=True),
)
QUICK: tuple[Scenario, ...] = (
    Scenario("gang-128", 1, 128, 1),
    Scenario("jobs-20x8", 20, 8, 0),
    Scenario("jobs-50x2", 50, 2, 0),
    Scenario("recovery-16", 1, 16, 8, fail_one=True),
)


def job_name(scenario: Scenario, i: int) -> str:
    return "gang" if scenario.jobs == 1 else f"job-{i:04d}"


# --------------------------------------------------------------------------- manifests


def trainingjob(name: str, namespace: str, workers: int, gpus: int, *, fast_restart: bool = False) -> dict[str, Any]:
    """A kubetrain TrainingJob with ``workers`` pods of ``gpus`` GPUs each."""
    # kwok pods have no storage: a checkpoint claim would stay Pending and keep them from being scheduled.
    spec: dict[str, Any] = {"workers": workers, "image": TRAINER_IMAGE, "checkpoint": {"ephemeral": True}}
    if gpus:
        spec["resources"] = {"gpusPerWorker": gpus}
    if fast_restart:
        spec["restartPolicy"] = {"backoffSeconds": 0}
    return {"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}


def pytorchjob(name: str, namespace: str, workers: int, gpus: int, *, restart_policy: str | None = None
               ) -> dict[str, Any]:
    """A Kubeflow v1 PyTorchJob with ``workers`` pods in all: 1 Master and workers-1 Worker replicas.

    ``restart_policy`` None keeps the PyTorchJob default (OnFailure)."""

    def replica(replicas: int) -> dict[str, Any]:
        container: dict[str, Any] = {"name": "pytorch", "image": TRAINER_IMAGE}  # Kubeflow's default container name
        if gpus:
            container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
        spec: dict[str, Any] = {"replicas": replicas, "template": {"spec": {"containers": [container]}}}
        if restart_policy:
            spec["restartPolicy"] = restart_policy
        return spec

    replicas = {"Master": replica(1)}
    if workers > 1:
        replicas["Worker"] = replica(workers - 1)
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": name, "namespace": namespace}, "spec": {"pytorchReplicaSpecs": replicas}}


def job_manifest(operator: str, scenario: Scenario, namespace: str, i: int) -> dict[str, Any]:
    name = job_name(scenario, i)
    if operator == KUBETRAIN:
        return trainingjob(name, namespace, scenario.workers, scenario.gpus, fast_restart=scenario.fail_one)
    return pytorchjob(name, namespace, scenario.workers, scenario.gpus,
                      restart_policy="ExitCode" if scenario.fail_one else None)


def victim_pod(scenario: Scenario) -> str:
    """The worker the recovery scenario fails: the same pod name under both operators."""
    return f"{job_name(scenario, 0)}-worker-{min(5, scenario.workers - 2)}"


# --------------------------------------------------------------------------- /proc


CLK_TCK = 100


@dataclass(frozen=True)
class ProcStats:
    cpu_s: float
    """utime + stime of the process and its waited-for children."""
    peak_rss_bytes: int
    """VmHWM: the resident set's high-water mark."""
    rss_bytes: int


def parse_proc(stat: str, status: str, clk_tck: int = CLK_TCK) -> ProcStats:
    """/proc/<pid>/stat and /proc/<pid>/status text -> ProcStats."""
    # Fields after "(comm)" start at field 3 (state); utime, stime, cutime, cstime are fields 14-17.
    rest = stat.rsplit(")", 1)[1].split()
    ticks = sum(int(rest[i]) for i in (11, 12, 13, 14))
    kb = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            kb[key] = int(value.split()[0])
    return ProcStats(ticks / clk_tck, kb.get("VmHWM", 0) * 1024, kb.get("VmRSS", 0) * 1024)


# --------------------------------------------------------------------------- audit log


@dataclass
class RequestCount:
    total: int = 0
    by_verb: Counter[str] = field(default_factory=Counter)

    def summary(self, top: int = 6) -> str:
        return ", ".join(f"{verb} {n}" for verb, n in self.by_verb.most_common(top))


def parse_time(value: str) -> float:
    """RFC 3339 with microseconds (the audit log's timestamps) -> epoch seconds."""
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def count_requests(lines: Iterable[str | bytes], users: Sequence[str], since: float | None = None,
                   until: float | None = None) -> dict[str, RequestCount]:
    """API requests per user in a kube-apiserver JSON audit log.

    One request can log several stages (ResponseStarted and ResponseComplete for a watch):
    it counts once, by auditID. ``since``/``until`` (epoch seconds) filter on
    requestReceivedTimestamp. A watch counts as one request however long it ran.
    """
    out = {u: RequestCount() for u in users}
    seen: set[str] = set()
    for raw in lines:
        line = raw.decode() if isinstance(raw, bytes) else raw
        if not line.strip():
            continue
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short while the API server was writing it
        user = (ev.get("user") or {}).get("username")
        if user not in out or ev.get("auditID") in seen:
            continue
        t = parse_time(ev["requestReceivedTimestamp"])
        if (since is not None and t < since) or (until is not None and t > until):
            continue
        seen.add(ev["auditID"])
        verb = ev.get("verb", "?")
        res = (ev.get("objectRef") or {}).get("resource")
        sub = (ev.get("objectRef") or {}).get("subresource")
        key = f"{verb} {res}/{sub}" if sub else f"{verb} {res}" if res else verb
        out[user].total += 1
        out[user].by_verb[key] += 1
    return out


def audit_policy(users: Sequence[str]) -> dict[str, Any]:
    """Log only the operators' requests, at Metadata level, once per stage after the request was read."""
    return {
        "apiVersion": "audit.k8s.io/v1",
        "kind": "Policy",
        "omitStages": ["RequestReceived"],
        "rules": [{"level": "Metadata", "users": list(users)}, {"level": "None"}],
    }


# --------------------------------------------------------------------------- kwok log


def delete_requests(audit_lines: Iterable[str | bytes], namespace: str) -> dict[str, list[float]]:
    """Pod name -> times of DELETE requests for it in ``namespace`` (any user the audit policy logs)."""
    out: dict[str, list[float]] = {}
    for raw in audit_lines:
        line = raw.decode() if isinstance(raw, bytes) else raw
        if '"delete"' not in line or namespace not in line:
            continue
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue
        ref = ev.get("objectRef") or {}
        if ev.get("verb") == "delete" and ref.get("resource") == "pods" and ref.get("namespace") == namespace \
                and not ref.get("subresource"):
            out.setdefault(ref.get("name", ""), []).append(parse_time(ev["requestReceivedTimestamp"]))
    return {name: sorted(set(ts)) for name, ts in out.items()}


def unrequested_deletes(kwok_lines: Iterable[str], namespace: str, requested: dict[str, list[float]]) -> int:
    """Pods kwok deleted that nobody asked to delete.

    kwok's pod-delete stage deletes by name, with no UID precondition (kwok v0.8.0,
    PodController.deleteResource), and can fire twice for one terminating pod: the first DELETE
    (grace 0) removes it, a second one that succeeds removes whatever pod has taken the name
    since, i.e. a worker just re-created under the same name. (A real kubelet deletes with the
    pod's UID as precondition.) Counts successful "Delete pod" lines in kwok's JSON log with no
    DELETE request for that pod (``requested``, from the audit log) since kwok's previous delete
    of the name. kwok logs a failed delete as an ERROR, not as "Delete pod"."""
    prefix = f"{namespace}/"
    last: dict[str, float] = {}
    count = 0
    for line in kwok_lines:
        if '"Delete pod"' not in line or prefix not in line:
            continue
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue
        pod = ev.get("pod", "")
        if not pod.startswith(prefix) or ev.get("msg") != "Delete pod":
            continue
        name, t = pod[len(prefix):], parse_time(ev["time"])
        since = last.get(name, float("-inf"))
        if not any(since < r <= t for r in requested.get(name, [])):
            count += 1
        last[name] = t
    return count


# --------------------------------------------------------------------------- Prometheus text


def metric_sum(text: str, name: str) -> float | None:
    """Sum of all samples of ``name`` (any labels) in Prometheus text format; None when absent."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        metric, _, value = line.rpartition(" ")
        if metric.split("{", 1)[0] != name:
            continue
        total += float(value)
        found = True
    return total if found else None


# --------------------------------------------------------------------------- results and table


@dataclass
class RunResult:
    operator: str
    scenario: str
    pods: int
    pods_created_s: float | None = None
    all_running_s: float | None = None
    recovery_s: float | None = None
    """From the failed pod's Failed phase (as the watch saw it) to every pod of the new set Running."""
    recovery_from_injection_s: float | None = None
    last_request_s: float | None = None
    """From apply to the operator's last API request before it went quiet (Services, status, Events included)."""
    pods_replaced: int | None = None
    """Recovery: pods the operator created after the failure (kubetrain: the whole gang; Kubeflow: the failed pod)."""
    restarts: int | None = None
    """Recovery: kubetrain's status.restartCount (gang restarts); Kubeflow: pods it deleted to re-create."""
    kwok_duplicate_deletes: int | None = None
    """Recovery: pods that kwok deleted with nobody asking (see unrequested_deletes)."""
    cpu_s: float | None = None
    """Operator CPU seconds from apply to the end of the measurement (the operator quiet for 5 s)."""
    cpu_total_s: float | None = None
    """... including its start (listing, cache sync)."""
    peak_rss_mb: float | None = None
    api_requests: int | None = None
    """Requests the operator's identity sent from apply to the end of the measurement (audit log)."""
    api_requests_total: int | None = None
    api_by_verb: dict[str, int] = field(default_factory=dict)
    reconcile_errors: float | None = None
    reconciles: float | None = None
    """Reconcile calls from the operator's own metrics, over its whole run."""
    load_before: tuple[float, float, float] | None = None
    load_after: tuple[float, float, float] | None = None
    apply_s: float | None = None
    notes: list[str] = field(default_factory=list)
    skipped: str | None = None
    """Why this operator did not run the scenario (the creator's NO_CONTROLLER); every value is None."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Row:
    title: str
    attr: str
    digits: int
    ratio: bool = True
    """Lower is better: the ratio column is Kubeflow / kubetrain."""


ROWS = (
    Row("all pods created (s)", "pods_created_s", 1),
    Row("all pods Running (s)", "all_running_s", 1),
    Row("recovery: failed -> all Running (s)", "recovery_s", 1),
    Row("operator's last API request (s)", "last_request_s", 1),
    Row("pods created on recovery", "pods_replaced", 0, ratio=False),
    Row("restarts (kubetrain: gang, Kubeflow: pod)", "restarts", 0, ratio=False),
    Row("pods kwok deleted unasked (by name)", "kwok_duplicate_deletes", 0, ratio=False),
    Row("operator CPU (s)", "cpu_s", 1),
    Row("operator peak RSS (MB)", "peak_rss_mb", 0),
    Row("API requests", "api_requests", 0),
    Row("reconciles (operator metrics)", "reconciles", 0),
    Row("reconcile errors", "reconcile_errors", 0, ratio=False),
)


def fmt(value: float | int | None, digits: int) -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and math.isnan(value):
        return "—"
    return f"{value:,.{digits}f}"


def ratio(baseline: float | int | None, ours: float | int | None) -> str:
    """baseline / ours, e.g. ``2.31x`` (above 1: ours is lower, i.e. better for times and costs)."""
    if baseline is None or ours is None:
        return "—"
    if ours == 0:
        return "—" if baseline == 0 else "∞"
    return f"{baseline / ours:.2f}x"


def load_str(load: tuple[float, float, float] | None) -> str:
    return "—" if load is None else " / ".join(f"{x:.1f}" for x in load)


def table(scenarios: Sequence[Scenario], results: Sequence[RunResult], *, ours: str = KUBETRAIN,
          baseline: str = KUBEFLOW, reference: str = CREATOR) -> str:
    """The markdown table: one block of rows per scenario, both operators side by side and the ratio;
    with results of ``reference`` (the minimal creator) also its column, and a row with each one's
    time to all pods created as a multiple of the creator's."""
    by = {(r.scenario, r.operator): r for r in results}
    with_ref = any(r.operator == reference for r in results)
    title_o, title_b = OPERATOR_TITLES.get(ours, ours), OPERATOR_TITLES.get(baseline, baseline)
    lines = [f"| scenario | metric | {title_o} | {title_b} | {title_b} / {title_o} |",
             "|---|---|---:|---:|---:|"]
    if with_ref:
        lines = [lines[0] + f" {OPERATOR_TITLES.get(reference, reference)} |", lines[1] + "---:|"]
    for sc in scenarios:
        a, b, c = by.get((sc.name, ours)), by.get((sc.name, baseline)), by.get((sc.name, reference))
        if a is None and b is None and c is None:
            continue
        lines.extend(_block(sc, a, b, c if with_ref else None, with_ref))
    return "\n".join(lines)


RECOVERY_ATTRS = ("recovery_s", "pods_replaced", "restarts", "kwok_duplicate_deletes")


def _block(sc: Scenario, a: RunResult | None, b: RunResult | None, c: RunResult | None, with_ref: bool
           ) -> list[str]:
    """One scenario's rows. ``c``: the reference (creator) run, shown in a last column when ``with_ref``."""
    lines: list[str] = []

    def add(title: str, cells: Sequence[str]) -> None:
        label = f"**{sc.name}** ({sc.describe()})" if not lines else ""
        lines.append(f"| {label} | {title} | " + " | ".join(cells if with_ref else cells[:3]) + " |")

    def ref_cell(text: str) -> str:
        """The creator's cell: ``text``, or why it did not run (said in full in the block's first row)."""
        if c is not None and c.skipped:
            return c.skipped if not lines else "n/a"
        return text

    for row in ROWS:
        va, vb, vc = (getattr(r, row.attr) if r else None for r in (a, b, c))
        if va is None and vb is None and vc is None and row.attr in RECOVERY_ATTRS:
            continue
        add(row.title, [fmt(va, row.digits), fmt(vb, row.digits), ratio(vb, va) if row.ratio else "",
                        ref_cell(fmt(vc, row.digits))])
        if row.attr == "pods_created_s" and with_ref:
            add("all pods created, × creator's time", [ratio(va, vc), ratio(vb, vc), "", ref_cell(ratio(vc, vc))])
    la, lb, lc = (load_str(r.load_before if r else None) for r in (a, b, c))
    add("load average at start (1/5/15 min)", [la, lb, "", ref_cell(lc)])
    return lines
