"""Pure parts of bench/compare.py: scenarios, job manifests, /proc and audit-log parsing, the table.

Nothing here talks to a cluster or reads a clock, so tests/unit/test_bench_compare.py can cover it.
"""

from __future__ import annotations

import base64
import copy
import json
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

KUBETRAIN = "kubetrain"
KUBEFLOW = "kubeflow"
KUBEFLOW_TUNED = "kubeflow-tuned"
"""Kubeflow v1 again, with a higher client rate limit (KUBEFLOW_TUNED_ARGS)."""
TRAINER_V2 = "trainer-v2"
"""Kubeflow Trainer v2: its controller manager (TrainJob -> JobSet) and JobSet's (JobSet -> Jobs);
kube-controller-manager's Job controller creates the pods."""
CREATOR = "creator"
"""bench/min_creator.py: no controller, only kubetrain's pods and Services created as fast as it can."""
OPERATORS = (KUBETRAIN, KUBEFLOW, KUBEFLOW_TUNED, TRAINER_V2, CREATOR)
"""Every configuration compare.py knows, in the order it runs them (and the table's columns)."""
OPERATOR_TITLES = {KUBETRAIN: "kubetrain", KUBEFLOW: "Kubeflow v1", KUBEFLOW_TUNED: "Kubeflow v1 tuned",
                   TRAINER_V2: "Trainer v2", CREATOR: "minimal creator"}
KUBEFLOW_TUNED_ARGS = "--kube-api-qps=500 --kube-api-burst=1000"
"""Its client's defaults are 20 QPS / burst 30 (cmd/training-operator.v1 flags)."""
GANG_RESTART = frozenset({TRAINER_V2})
"""Recover by replacing every pod (Trainer v2: JobSet failurePolicy, Recreate); the others re-create only
the failed pod (kubetrain restarts the gang in place: the other pods run the next generation)."""
UNIQUE_POD_NAMES = frozenset({TRAINER_V2})
"""Operators whose pods never reuse a name (the Job controller adds a random suffix): kwok's duplicate
deletes by name (unrequested_deletes) can only hit the pod they already deleted, so they are not counted."""
JOB_RESOURCES = {KUBETRAIN: ("kubetrain.io", "v1alpha1", "trainingjobs"),
                 KUBEFLOW: ("kubeflow.org", "v1", "pytorchjobs"),
                 KUBEFLOW_TUNED: ("kubeflow.org", "v1", "pytorchjobs"),
                 TRAINER_V2: ("trainer.kubeflow.org", "v1alpha1", "trainjobs")}
"""(group, version, plural) of the job object each operator is given."""
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


CHECKPOINT_CLAIM = "checkpoints"
"""Recovery scenarios: kubetrain's claim, bound to a static volume (support.kwok.static_claim) so that its
checkpoints are durable and the gang can restart in place (restartPolicy.inPlace)."""


def trainingjob(name: str, namespace: str, workers: int, gpus: int, *, fast_restart: bool = False) -> dict[str, Any]:
    """A kubetrain TrainingJob with ``workers`` pods of ``gpus`` GPUs each; ``fast_restart``: a recovery
    scenario's (no backoff, checkpoints on CHECKPOINT_CLAIM)."""
    # kwok pods have no storage: a claim of a provisioner would stay Pending and keep them from being scheduled.
    spec: dict[str, Any] = {"workers": workers, "image": TRAINER_IMAGE, "checkpoint": {"ephemeral": True}}
    if gpus:
        spec["resources"] = {"gpusPerWorker": gpus}
    if fast_restart:
        spec["restartPolicy"] = {"backoffSeconds": 0, "inPlace": True}
        spec["checkpoint"] = {"claimName": CHECKPOINT_CLAIM}
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


TORCH_RUNTIME = "torch-distributed"
"""Trainer v2's ClusterTrainingRuntime for torch (manifests/base/runtimes/torch_distributed.yaml)."""
TORCH_RESTART_RUNTIME = "torch-distributed-restart"
"""The same, plus JobSet's failurePolicy: what the recovery scenarios' TrainJobs run on."""
JOBSET_MAX_RESTARTS = 3
TRAINER_NODE = "node"
"""The upstream runtime's replicated job and container name (constants.Node: the trainer's node)."""


def trainjob(name: str, namespace: str, workers: int, gpus: int, runtime: str = TORCH_RUNTIME) -> dict[str, Any]:
    """A Kubeflow Trainer v2 TrainJob: ``workers`` nodes of ``gpus`` GPUs each (resourcesPerNode limits)."""
    trainer: dict[str, Any] = {"numNodes": workers}
    if gpus:
        trainer["resourcesPerNode"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                    "name": runtime},
                     "trainer": trainer}}


def training_runtimes(upstream: dict[str, Any]) -> list[dict[str, Any]]:
    """The upstream torch-distributed ClusterTrainingRuntime with the bench's image, and a copy for
    recovery: JobSet restarts every Job (failurePolicy, restartStrategy Recreate by default) when one
    fails, and a Job fails on its first failed pod (backoffLimit 0; the Job default, 6, would have
    kube-controller-manager re-create only the failed pod, JobSet never seeing a failure)."""
    plain = copy.deepcopy(upstream)
    plain["metadata"] = {k: v for k, v in plain["metadata"].items() if k in ("name", "labels")}
    for rjob in plain["spec"]["template"]["spec"]["replicatedJobs"]:
        for container in rjob["template"]["spec"]["template"]["spec"]["containers"]:
            if container["name"] == TRAINER_NODE:
                container["image"] = TRAINER_IMAGE
    restart = copy.deepcopy(plain)
    restart["metadata"]["name"] = TORCH_RESTART_RUNTIME
    jobset = restart["spec"]["template"]["spec"]
    jobset["failurePolicy"] = {"maxRestarts": JOBSET_MAX_RESTARTS}
    for rjob in jobset["replicatedJobs"]:
        rjob["template"]["spec"]["backoffLimit"] = 0
    return [plain, restart]


def job_manifest(operator: str, scenario: Scenario, namespace: str, i: int) -> dict[str, Any]:
    name = job_name(scenario, i)
    if operator == KUBETRAIN:
        return trainingjob(name, namespace, scenario.workers, scenario.gpus, fast_restart=scenario.fail_one)
    if operator == TRAINER_V2:
        return trainjob(name, namespace, scenario.workers, scenario.gpus,
                        TORCH_RESTART_RUNTIME if scenario.fail_one else TORCH_RUNTIME)
    return pytorchjob(name, namespace, scenario.workers, scenario.gpus,
                      restart_policy="ExitCode" if scenario.fail_one else None)


def victim_index(scenario: Scenario) -> int:
    """The index of the worker the recovery scenario fails (kubetrain's worker-N, Kubeflow's Worker
    replica N, Trainer v2's completion index N)."""
    return min(5, scenario.workers - 2)


def victim_pod(scenario: Scenario) -> str:
    """The victim's pod name under kubetrain and Kubeflow v1: the same name under both."""
    return f"{job_name(scenario, 0)}-worker-{victim_index(scenario)}"


def find_victim(operator: str, scenario: Scenario, names: Iterable[str]) -> str | None:
    """The victim among the current pod ``names``. Trainer v2's pods are named by kube-controller-manager's
    Job controller: <JobSet>-<replicated job>-<job index>-<completion index>-<random suffix>."""
    if operator != TRAINER_V2:
        name = victim_pod(scenario)
        return name if name in names else None
    prefix = f"{job_name(scenario, 0)}-{TRAINER_NODE}-0-{victim_index(scenario)}-"
    return next((n for n in sorted(names) if n.startswith(prefix) and "-" not in n[len(prefix):]), None)


# --------------------------------------------------------------------------- Trainer v2 and JobSet installs

CLUSTER_SCOPED = frozenset({"ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "Namespace",
                            "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"})


def kustomize(doc: dict[str, Any], namespace: str, prefix: str = "") -> dict[str, Any]:
    """What a kustomization's ``namespace:`` and ``namePrefix:`` do to one of its resources: the
    namespace on namespaced objects and on ServiceAccount subjects, the prefix on every name and on
    the names that refer to the kustomization's own RBAC objects and ServiceAccounts."""
    out = copy.deepcopy(doc)
    meta = out["metadata"]
    if out["kind"] != "CustomResourceDefinition":
        meta["name"] = prefix + meta["name"]
    if out["kind"] not in CLUSTER_SCOPED:
        meta["namespace"] = namespace
    if "roleRef" in out and out["roleRef"]["kind"] in ("Role", "ClusterRole"):
        out["roleRef"]["name"] = prefix + out["roleRef"]["name"]
    for subject in out.get("subjects") or []:
        if subject["kind"] == "ServiceAccount":
            subject["name"] = prefix + subject["name"]
            subject["namespace"] = namespace
    return out


def json_patch(doc: dict[str, Any], ops: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 ``add`` and ``replace`` (all that the upstream webhook patches use) on a copy of ``doc``."""
    out = copy.deepcopy(doc)
    for op in ops:
        if op["op"] not in ("add", "replace"):
            raise ValueError(f"unsupported patch op: {op}")
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
        node: Any = out
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            if op["op"] == "add" and last == "-":
                node.append(op["value"])
            elif op["op"] == "add":
                node.insert(int(last), op["value"])
            else:
                node[int(last)] = op["value"]
        else:
            node[last] = op["value"]
    return out


def webhooks_to_url(doc: dict[str, Any], port: int, ca_pem: bytes) -> dict[str, Any]:
    """A webhook configuration whose webhooks call ``https://127.0.0.1:<port><path>`` (a local process,
    no Service), trusting ``ca_pem``, instead of the Service the manifests name."""
    out = copy.deepcopy(doc)
    ca = base64.b64encode(ca_pem).decode()
    for hook in out["webhooks"]:
        path = hook["clientConfig"]["service"].get("path", "/")
        hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca}
    return out


def trainer_config(upstream: dict[str, Any], *, health: int, metrics: int, webhook: int, namespace: str
                   ) -> dict[str, Any]:
    """Trainer v2's controller_manager_config.yaml as its Deployment mounts it, but for a local process:
    listen on loopback ports, its webhook certificate provided (certManagement off: the rotator would
    issue one for the Service's DNS name), the leader-election Lease in its namespace (in a pod
    controller-runtime reads that from the ServiceAccount mount). Everything else as shipped."""
    cfg = copy.deepcopy(upstream)
    cfg["health"]["healthProbeBindAddress"] = f"127.0.0.1:{health}"
    cfg["metrics"]["bindAddress"] = f"127.0.0.1:{metrics}"
    cfg["webhook"] = {**cfg.get("webhook", {}), "port": webhook, "host": "127.0.0.1"}
    cfg["certManagement"] = {**cfg.get("certManagement", {}), "enable": False}
    cfg["leaderElection"] = {**cfg.get("leaderElection", {}), "resourceNamespace": namespace}
    return cfg


def jobset_config(upstream: dict[str, Any], *, health: int, metrics: int, webhook: int, namespace: str,
                  cert_dir: str) -> dict[str, Any]:
    """JobSet's controller_manager_config.yaml the same way (internalCertManagement off; the webhook and
    the metrics server read tls.crt/tls.key from ``cert_dir``)."""
    cfg = copy.deepcopy(upstream)
    cfg["health"] = {**cfg.get("health", {}), "healthProbeBindAddress": f"127.0.0.1:{health}"}
    cfg["metrics"] = {**cfg.get("metrics", {}), "bindAddress": f"127.0.0.1:{metrics}", "certDir": cert_dir}
    cfg["webhook"] = {**cfg.get("webhook", {}), "port": webhook, "host": "127.0.0.1", "certDir": cert_dir}
    cfg["internalCertManagement"] = {**cfg.get("internalCertManagement", {}), "enable": False}
    cfg["leaderElection"] = {**cfg.get("leaderElection", {}), "resourceNamespace": namespace}
    return cfg


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


def pod_requests(audit_lines: Iterable[str | bytes], namespace: str, verb: str = "delete") -> dict[str, list[float]]:
    """Pod name -> times of DELETE requests (or of another verb's) for it in ``namespace`` (any user the
    audit policy logs)."""
    out: dict[str, list[float]] = {}
    for raw in audit_lines:
        line = raw.decode() if isinstance(raw, bytes) else raw
        if f'"{verb}"' not in line or namespace not in line:
            continue
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            continue
        ref = ev.get("objectRef") or {}
        if ev.get("verb") == verb and ref.get("resource") == "pods" and ref.get("namespace") == namespace \
                and not ref.get("subresource") and ref.get("name"):
            out.setdefault(ref["name"], []).append(parse_time(ev["requestReceivedTimestamp"]))
    return {name: sorted(set(ts)) for name, ts in out.items()}


def unrequested_deletes(kwok_lines: Iterable[str], namespace: str, requested: dict[str, list[float]],
                        created: dict[str, list[float]] | None = None) -> int:
    """Pods kwok deleted that nobody asked to delete.

    kwok's pod-delete stage deletes by name, with no UID precondition (kwok v0.8.0,
    PodController.deleteResource), and can fire twice for one terminating pod: the first DELETE
    (grace 0) removes it, a second one that succeeds removes whatever pod has taken the name
    since, i.e. a worker just re-created under the same name. (A real kubelet deletes with the
    pod's UID as precondition.) Counts successful "Delete pod" lines in kwok's JSON log with no
    DELETE request for that pod (``requested``, from the audit log) since kwok's previous delete
    of the name, nor any create of the name (``created``) after that request: kwok also deletes by
    name a pod the API server had already removed (a Failed pod goes at once), and then hits its
    successor. kwok logs a failed delete as an ERROR, not as "Delete pod"."""
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
        made = (created or {}).get(name, [])
        if not any(since < r <= t and not any(r < c <= t for c in made) for r in requested.get(name, [])):
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


# --------------------------------------------------------------------------- configurations


def configurations(operators: Sequence[str], *, kubeflow_version: str = "?", kubeflow_args: str = "",
                   tuned_args: str = KUBEFLOW_TUNED_ARGS, trainer_version: str = "?", jobset_version: str = "?",
                   creator_args: str = "") -> dict[str, dict[str, str]]:
    """What each configuration in ``operators`` is: its column title, a description for the table's
    title line and the JSON, and the extra flags it runs with."""
    out: dict[str, dict[str, str]] = {}
    for op in operators:
        if op == KUBETRAIN:
            out[op] = {"title": "kubetrain", "describe": "kubetrain (the chart's defaults)", "args": ""}
        elif op == KUBEFLOW:
            out[op] = {"title": f"Kubeflow {kubeflow_version}", "args": kubeflow_args,
                       "describe": f"Kubeflow Training Operator {kubeflow_version} ({kubeflow_args or 'defaults'})"}
        elif op == KUBEFLOW_TUNED:
            out[op] = {"title": f"Kubeflow {kubeflow_version} tuned", "args": tuned_args,
                       "describe": f"Kubeflow Training Operator {kubeflow_version} tuned ({tuned_args})"}
        elif op == TRAINER_V2:
            out[op] = {"title": f"Trainer {trainer_version}", "args": "",
                       "describe": f"Kubeflow Trainer {trainer_version} on JobSet {jobset_version} (defaults)"}
        elif op == CREATOR:
            out[op] = {"title": OPERATOR_TITLES[CREATOR], "args": creator_args,
                       "describe": f"the minimal creator ({creator_args or 'defaults'})"}
        else:
            raise ValueError(f"unknown operator {op!r}: one of {', '.join(OPERATORS)}")
    return out


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
    helper_api_requests: int | None = None
    """Trainer v2: requests of kube-controller-manager's Job controller in the same window. It creates
    the pods of JobSet's Jobs; they are not in ``api_requests`` (not the operator's identity)."""
    processes: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per process (Trainer v2 runs two: trainer and jobset): cpu_s, peak_rss_mb. The operator's
    CPU is their sum, its peak RSS the sum of their peaks."""
    reconcile_errors: float | None = None
    reconciles: float | None = None
    """Reconcile calls from the operator's own metrics, over its whole run."""
    load_before: tuple[float, float, float] | None = None
    load_after: tuple[float, float, float] | None = None
    apply_s: float | None = None
    notes: list[str] = field(default_factory=list)
    skipped: str | None = None
    """Why this operator did not run the scenario (the creator's NO_CONTROLLER); every value is None."""
    round_index: int = 0
    """Which of the scenario's rounds (compare.py --rounds) this run was, from 0."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Row:
    title: str
    attr: str
    digits: int
    ratio: bool = True
    """Lower is better: a ratio column per peer, peer / kubetrain."""


ROWS = (
    Row("all pods created (s)", "pods_created_s", 1),
    Row("all pods Running (s)", "all_running_s", 1),
    Row("recovery: failed -> all Running (s)", "recovery_s", 1),
    Row("operator's last API request (s)", "last_request_s", 1),
    Row("pods created on recovery", "pods_replaced", 0, ratio=False),
    Row("restarts (kubetrain, Trainer v2: gang; Kubeflow: pod)", "restarts", 0, ratio=False),
    Row("pods kwok deleted unasked (by name)", "kwok_duplicate_deletes", 0, ratio=False),
    Row("operator CPU (s)", "cpu_s", 1),
    Row("operator peak RSS (MB)", "peak_rss_mb", 0),
    Row("API requests", "api_requests", 0),
    Row("API requests of the Job controller (kube-controller-manager)", "helper_api_requests", 0, ratio=False),
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
          reference: str = CREATOR) -> str:
    """The markdown table: one block of rows per scenario, one column per configuration that has results
    (in OPERATORS order), each peer's followed by its ratio to ``ours`` (when ``ours`` ran); with results
    of ``reference`` (the minimal creator) also its column, and a row with each one's time to all pods
    created as a multiple of the creator's."""
    present = {r.operator for r in results}
    order = [o for o in OPERATORS if o in present] + sorted(present - set(OPERATORS))
    cols = Columns(ours if ours in present else None, [o for o in order if o not in (ours, reference)],
                   reference if reference in present else None)
    by = {(r.scenario, r.operator): r for r in results}
    lines = ["| scenario | metric | " + " | ".join(cols.titles()) + " |",
             "|---|---|" + "---:|" * len(cols.titles())]
    for sc in scenarios:
        runs = {o: by.get((sc.name, o)) for o in order}
        if any(runs.values()):
            lines.extend(_block(sc, runs, cols))
    return "\n".join(lines)


@dataclass(frozen=True)
class Columns:
    ours: str | None
    peers: list[str]
    reference: str | None

    def titles(self) -> list[str]:
        t = OPERATOR_TITLES.get
        out = [t(self.ours, self.ours)] if self.ours else []
        for peer in self.peers:
            out.append(t(peer, peer))
            if self.ours:
                out.append(f"{t(peer, peer)} / {t(self.ours, self.ours)}")
        return out + ([t(self.reference, self.reference)] if self.reference else [])

    def cells(self, value: Callable[[str], str], ratio_cell: Callable[[str], str]) -> list[str]:
        """``value(operator)`` for each column's operator, ``ratio_cell(peer)`` in the ratio columns."""
        out = [value(self.ours)] if self.ours else []
        for peer in self.peers:
            out.append(value(peer))
            if self.ours:
                out.append(ratio_cell(peer))
        return out + ([value(self.reference)] if self.reference else [])


RECOVERY_ATTRS = ("recovery_s", "pods_replaced", "restarts", "kwok_duplicate_deletes")
OPTIONAL_ATTRS = (*RECOVERY_ATTRS, "helper_api_requests")
"""Rows left out of a scenario's block where no configuration has a value."""


def _block(sc: Scenario, runs: dict[str, RunResult | None], cols: Columns) -> list[str]:
    """One scenario's rows. A skipped run (the creator's NO_CONTROLLER) says why in the block's first
    row and "n/a" below."""
    lines: list[str] = []

    def add(title: str, cells: Sequence[str]) -> None:
        label = f"**{sc.name}** ({sc.describe()})" if not lines else ""
        lines.append(f"| {label} | {title} | " + " | ".join(cells) + " |")

    def cell(op: str, text: str) -> str:
        r = runs.get(op)
        if r is not None and r.skipped:
            return r.skipped if not lines else "n/a"
        return text

    def get(op: str | None, attr: str) -> Any:
        r = runs.get(op) if op else None
        return getattr(r, attr) if r else None

    def value(row: Row) -> Callable[[str], str]:
        return lambda op: cell(op, fmt(get(op, row.attr), row.digits))

    def versus_ours(row: Row) -> Callable[[str], str]:
        return lambda peer: ratio(get(peer, row.attr), get(cols.ours, row.attr)) if row.ratio else ""

    for row in ROWS:
        if row.attr in OPTIONAL_ATTRS and all(get(o, row.attr) is None for o in runs):
            continue
        add(row.title, cols.cells(value(row), versus_ours(row)))
        if row.attr == "pods_created_s" and cols.reference:
            add("all pods created, × creator's time",
                cols.cells(lambda o: cell(o, ratio(get(o, "pods_created_s"), get(cols.reference, "pods_created_s"))),
                           lambda p: ""))
    add("load average at start (1/5/15 min)",
        cols.cells(lambda o: cell(o, load_str(get(o, "load_before"))), lambda p: ""))
    return lines


# --------------------------------------------------------------------------- rounds


def round_order(operators: Sequence[str], index: int) -> list[str]:
    """The configurations' order in round ``index``: rotated by one each round, so that over as many
    rounds as there are configurations each runs once in every position (the first of a scenario runs
    on a cluster still deleting the warm-up's or the last scenario's pods)."""
    k = index % len(operators) if operators else 0
    return [*operators[k:], *operators[:k]]


def key_metric(scenario: Scenario) -> str:
    """The figure a scenario's target is about: time to all pods created, or the recovery time."""
    return "recovery_s" if scenario.fail_one else "pods_created_s"


def median_runs(scenarios: Sequence[Scenario], results: Sequence[RunResult]) -> list[RunResult]:
    """Per scenario and configuration, the one run whose key metric is the median of its rounds (the
    lower middle one of an even count; a run without the value counts as slowest): each row of the
    table then comes from one real run, its CPU and requests matching its time."""
    out: list[RunResult] = []
    for sc in scenarios:
        attr = key_metric(sc)
        runs: dict[str, list[RunResult]] = {}
        for r in results:
            if r.scenario == sc.name:
                runs.setdefault(r.operator, []).append(r)
        for group in runs.values():
            ranked = sorted(group, key=lambda r: (getattr(r, attr) is None, getattr(r, attr) or 0.0))
            out.append(ranked[(len(ranked) - 1) // 2])
    return out


def rounds_summary(scenarios: Sequence[Scenario], results: Sequence[RunResult], *, ours: str = KUBETRAIN,
                   reference: str = CREATOR) -> list[str]:
    """Per scenario, each configuration's key metric round by round, and in how many of the rounds
    ``ours`` was ahead of each peer that ran in the same round (and its multiple of ``reference``)."""
    lines = []
    for sc in scenarios:
        attr = key_metric(sc)
        by = {(r.operator, r.round_index): getattr(r, attr) for r in results if r.scenario == sc.name and not r.skipped}
        ops = [o for o in OPERATORS if any(k[0] == o for k in by)]
        if not ops:
            continue
        rounds = sorted({k[1] for k in by})
        figures = [f"{OPERATOR_TITLES.get(o, o)} " + ", ".join(fmt(by.get((o, i)), 1) for i in rounds)
                   for o in ops]
        parts = [f"{sc.name}, {attr} by round: " + "; ".join(figures)]
        for peer in (o for o in ops if o not in (ours, reference) and ours in ops):
            pairs = [(by.get((ours, i)), by.get((peer, i))) for i in rounds]
            both = [(a, b) for a, b in pairs if a is not None and b is not None]
            ahead = sum(1 for a, b in both if a < b)
            parts.append(f"{OPERATOR_TITLES.get(ours, ours)} ahead of {OPERATOR_TITLES.get(peer, peer)} "
                         f"in {ahead} of {len(both)} rounds")
        if ours in ops and reference in ops:
            multiples = [ratio(by.get((ours, i)), by.get((reference, i))) for i in rounds]
            parts.append(f"{OPERATOR_TITLES.get(ours, ours)} as a multiple of the "
                         f"{OPERATOR_TITLES.get(reference, reference)}: " + ", ".join(multiples))
        lines.append("; ".join(parts))
    return lines
