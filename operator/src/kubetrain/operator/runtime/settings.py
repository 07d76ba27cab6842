"""The operator's settings: one frozen object, built once by `python -m kubetrain.operator`.

It comes from the command line and the environment the chart sets
(charts/kubetrain/templates/deployment.yaml), and reaches the kopf handlers through kopf's
`memo` (handlers.OperatorMemo): no handler reads os.environ, and every default is written here,
once, as a field default.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import socket
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import ValidationError

from kubetrain.core.api import CheckpointStore
from kubetrain.core.pod_template import PodPolicy

# The operator's own environment (the chart's Deployment sets these; workers never see them).
ENV_TRAINER_IMAGE = "KUBETRAIN_TRAINER_IMAGE"
ENV_NAMESPACE = "KUBETRAIN_NAMESPACE"
"""Comma-separated namespaces the operator watches (as --namespace); unset: every namespace."""
ENV_METRICS_PORT = "KUBETRAIN_METRICS_PORT"
ENV_CREATE_PARALLELISM = "KUBETRAIN_CREATE_PARALLELISM"
ENV_RECONCILE_WORKERS = "KUBETRAIN_RECONCILE_WORKERS"
ENV_API_QPS = "KUBETRAIN_API_QPS"
ENV_API_BURST = "KUBETRAIN_API_BURST"
ENV_LIVENESS = "KUBETRAIN_LIVENESS"
ENV_LEADER_ID = "KUBETRAIN_LEADER_ID"
ENV_COSCHEDULING_SCHEDULER = "KUBETRAIN_COSCHEDULING_SCHEDULER"
"""The schedulerName of `gang: coscheduling` pods (COSCHEDULING_SCHEDULER by default)."""
ENV_POD_POLICY = "KUBETRAIN_POD_POLICY"
"""JSON: the chart's podPolicy values (allowPrivileged, allowHostPath, allowHostNamespaces, allowedCapabilities,
allowServiceAccount), kubetrain.core.pod_template.PodPolicy."""
POD_POLICY_KEYS = {"allowPrivileged": "allow_privileged", "allowHostPath": "allow_host_path",
                   "allowHostNamespaces": "allow_host_namespaces", "allowServiceAccount": "allow_service_account"}
ENV_QUEUE_REQUIRED_IN = "KUBETRAIN_QUEUE_REQUIRED_IN"
"""Comma-separated namespaces whose TrainingJobs must set spec.scheduling.queue (the chart's queues.requiredIn)."""
ENV_WORKER_NETWORK_POLICY = "KUBETRAIN_WORKER_NETWORK_POLICY"
"""JSON: the chart's workerNetworkPolicy values ({"enabled": bool, "metricsFrom": [NetworkPolicyPeer, ...]})."""
NETWORK_POLICY_PEER_KEYS = ("podSelector", "namespaceSelector", "ipBlock")
"""The fields of a networking.k8s.io/v1 NetworkPolicyPeer."""
ENV_CHECKPOINT_STORE = "KUBETRAIN_CHECKPOINT_STORE"
"""JSON: the chart's checkpointStore ({"uri": "s3://bucket/prefix", "s3": {...spec.s3}}), api.CheckpointStore: where
jobs with several workers keep their checkpoints when their StorageClass offers ReadWriteOnce only."""
ENV_TERMINATION_TAINTS = "KUBETRAIN_TERMINATION_TAINTS"
"""Comma-separated taint keys that announce a node's end (the chart's nodeTermination.taints); empty: none."""
TERMINATION_TAINTS = (
    "aws-node-termination-handler/spot-itn",
    "aws-node-termination-handler/asg-lifecycle-termination",
    "aws-node-termination-handler/scheduled-maintenance",
    "cloud.google.com/impending-node-termination",
    "karpenter.sh/disrupted",
    "ToBeDeletedByClusterAutoscaler",
)
"""Taints that termination handlers and autoscalers put on a node about to go (AWS Node Termination Handler,
GKE, Karpenter, Cluster Autoscaler): a gang with a worker there restarts elsewhere at once, after a checkpoint."""
ENV_POD_NAMESPACE = "POD_NAMESPACE"
"""The operator pod's own namespace (Downward API): where its Lease lives by default."""
NAMESPACE_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
"""A namespace's name (an RFC 1123 label)."""
NAMESPACE_PATTERN = re.compile(r"(?=.*[*?])[-a-z0-9*?]{1,63}")
"""A shell-style pattern over namespaces' names (`team-*`, `ci-??-*`): kopf serves the namespaces that match as
they come and go; the operator's own LISTs and watches then span the cluster and keep only what matches. `!`
(kopf's exclusion) is refused: as separate --namespace entries its meaning would be a union, not a filter."""


SIGTERM_CHECKPOINT_GRACE = 300
"""Seconds a worker pod gets to write its checkpoint after SIGTERM (terminationGracePeriodSeconds)."""
COSCHEDULING_SCHEDULER = "scheduler-plugins-scheduler"
"""The scheduler name of scheduler-plugins installed as a second scheduler (its as-a-second-scheduler chart's
default), the one that runs the Coscheduling plugin."""


@dataclass(frozen=True)
class WorkerNetworkPolicy:
    """A NetworkPolicy `<job>-workers` per job (the chart's workerNetworkPolicy): only the gang's own pods reach
    its workers, on any port, and `metrics_from` their metrics ports."""

    metrics_from: tuple[dict[str, Any], ...] = ()
    """NetworkPolicyPeers allowed to scrape the workers' metrics ports; empty: any source."""


@dataclass(frozen=True)
class WorkerSettings:
    """What the operator puts into every worker pod, and what it admits of a job's (from the Deployment's env /
    Helm values)."""

    trainer_image: str = "ghcr.io/kubetrain/trainer:0.1.0"
    image_pull_policy: str = "IfNotPresent"
    termination_grace_seconds: int = SIGTERM_CHECKPOINT_GRACE
    coscheduling_scheduler: str = COSCHEDULING_SCHEDULER
    """The schedulerName of `gang: coscheduling` pods: the scheduler that runs the Coscheduling plugin."""
    pod_policy: PodPolicy = field(default_factory=PodPolicy)
    """The host-level fields a job's podTemplate may set (KUBETRAIN_POD_POLICY); none by default."""
    queue_required_in: frozenset[str] = frozenset()
    """Namespaces whose jobs must name a Kueue queue (KUBETRAIN_QUEUE_REQUIRED_IN, comma-separated)."""
    network_policy: WorkerNetworkPolicy | None = None
    """Each job's NetworkPolicy (KUBETRAIN_WORKER_NETWORK_POLICY); None: the operator makes none."""
    checkpoint_store: CheckpointStore | None = None
    """The object store for jobs whose claim cannot be shared (KUBETRAIN_CHECKPOINT_STORE); None: such jobs wait."""



@dataclass(frozen=True)
class LeaderElection:
    """The Lease that decides which replica reconciles (kubetrain.operator.runtime.leader)."""

    namespace: str = "default"
    lease: str = "kubetrain-operator"
    identity: str = ""
    """This replica's name in the Lease; unique per process (hostname and a random suffix by default)."""
    duration: int = 15
    """Seconds without a change after which a standby takes the Lease over."""
    renew_deadline: float = 10.0
    """Seconds the holder may fail to renew before it stops acting."""
    retry: float = 2.0
    """Seconds between two rounds (renewals, or a standby's looks)."""

    def __post_init__(self) -> None:
        if not self.identity:
            raise ValueError("leader election needs an identity")
        if not 0 < self.renew_deadline < self.duration:
            raise ValueError(f"renew_deadline must lie in (0, duration={self.duration}): {self.renew_deadline}")
        if not 0 < self.retry < self.renew_deadline:
            raise ValueError(f"retry must lie in (0, renew_deadline={self.renew_deadline}): {self.retry}")


@dataclass(frozen=True)
class OperatorSettings:
    builders: WorkerSettings = field(default_factory=WorkerSettings)
    """What goes into the children (the default trainer image, from KUBETRAIN_TRAINER_IMAGE)."""
    namespaces: tuple[str, ...] = ()
    """Watch these namespaces only (--namespace, KUBETRAIN_NAMESPACE; comma-separated names or patterns such as
    `team-*`); empty: every namespace."""
    metrics_port: int = 8080
    """Prometheus endpoint (KUBETRAIN_METRICS_PORT); 0 turns it off."""
    create_parallelism: int = 32
    """API calls in flight at once (KUBETRAIN_CREATE_PARALLELISM): the applier's thread pool."""
    reconcile_workers: int = 16
    """Jobs reconciled at once (KUBETRAIN_RECONCILE_WORKERS); their API calls share create_parallelism."""
    api_qps: float = 500.0
    """API calls a second the reconciles may make on average (KUBETRAIN_API_QPS; 0: no limit), beyond the
    watches and the Lease: a bound on a runaway, above what 1000 jobs starting at once made (about 310 a
    second in bench/compare.py's jobs-1000x2), so that the API server's other clients keep their share."""
    api_burst: int = 1000
    """API calls the reconciles may make at once above api_qps (KUBETRAIN_API_BURST): a gang of 1024 pods is
    created without waiting."""
    termination_taints: tuple[str, ...] = TERMINATION_TAINTS
    """Taint keys that announce a node's end (KUBETRAIN_TERMINATION_TAINTS, comma-separated)."""
    liveness: str = "http://0.0.0.0:8081/healthz"
    """kopf's health endpoint (--liveness, KUBETRAIN_LIVENESS)."""
    leader_election: LeaderElection | None = None
    """None: this replica reconciles alone (no --leader-elect)."""
    verbose: bool = False

    def __post_init__(self) -> None:
        if bad := [n for n in self.namespaces if not (NAMESPACE_NAME.fullmatch(n) or NAMESPACE_PATTERN.fullmatch(n))]:
            raise ValueError(f"not a namespace's name nor a pattern of names (a-z, 0-9, '-', '*', '?'): "
                             f"{', '.join(map(repr, bad))}")
        if len(set(self.namespaces)) != len(self.namespaces):
            raise ValueError(f"a namespace is named twice: {', '.join(self.namespaces)}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics port out of range: {self.metrics_port}")
        if self.create_parallelism < 1 or self.reconcile_workers < 1:
            raise ValueError(f"create_parallelism ({self.create_parallelism}) and reconcile_workers "
                             f"({self.reconcile_workers}) must be at least 1")
        if self.api_qps < 0 or self.api_burst < 1:
            raise ValueError(f"{ENV_API_QPS} ({self.api_qps}) must be at least 0 and {ENV_API_BURST} "
                             f"({self.api_burst}) at least 1")

    def scopes(self) -> tuple[str | None, ...]:
        """Where each of the operator's own LISTs and watches goes: one per watched namespace, or one over the
        whole cluster (None) when it watches every namespace or namespaces by pattern (then filtered by
        `watches`)."""
        if not self.namespaces or self.patterns():
            return (None,)
        return self.namespaces

    def patterns(self) -> tuple[str, ...]:
        """The watched namespaces given as patterns (`team-*`)."""
        return tuple(n for n in self.namespaces if not NAMESPACE_NAME.fullmatch(n))

    def watches(self, namespace: str) -> bool:
        """Whether a namespace's objects are this operator's: every namespace's when none is named."""
        return not self.namespaces or any(fnmatch.fnmatchcase(namespace, n) for n in self.namespaces)


DEFAULTS = OperatorSettings()


def _parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kubetrain-operator")
    # Repeatable and comma-separated; argparse's append would add to a default, so the environment is
    # read in parse_settings, only where no flag is given.
    p.add_argument("--namespace", action="append", metavar="NS[,NS...]",
                   help=f"watch these namespaces only, by name or pattern (team-*) (repeatable; default: ${ENV_NAMESPACE}, "
                        "else every namespace)")
    p.add_argument("--leader-elect", action="store_true",
                   help="several replicas: only the holder of a coordination.k8s.io Lease reconciles, the others "
                        "keep warm caches and take over when it goes")
    p.add_argument("--leader-elect-lease", default=LeaderElection.lease, help="the Lease's name")
    p.add_argument("--leader-elect-namespace", default=None,
                   help="the Lease's namespace (default: $POD_NAMESPACE, else the first watched namespace, else "
                        f"{LeaderElection.namespace})")
    p.add_argument("--liveness", default=env.get(ENV_LIVENESS) or DEFAULTS.liveness, help="kopf's health endpoint")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


Number = TypeVar("Number", int, float)


def _env_number(p: argparse.ArgumentParser, env: Mapping[str, str], name: str, default: Number) -> Number:
    """`name` from the environment as the type of its `default` (unset or empty: the default); a value that
    is no such number ends the operator's start with a usage error naming the variable."""
    raw = env.get(name)
    if not raw:
        return default
    try:
        return type(default)(raw)
    except ValueError:
        p.error(f"{name} must be {'an integer' if isinstance(default, int) else 'a number'}, not {raw!r}")


def pod_policy(raw: str | None) -> PodPolicy:
    """KUBETRAIN_POD_POLICY as a PodPolicy; ValueError naming the key that is wrong."""
    if not raw:
        return PodPolicy()
    try:
        given = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{ENV_POD_POLICY} is not JSON: {exc}") from None
    if not isinstance(given, dict):
        raise ValueError(f"{ENV_POD_POLICY} must be a JSON object")
    flags, caps = {}, given.get("allowedCapabilities") or []
    for key, value in given.items():
        if key in POD_POLICY_KEYS and isinstance(value, bool):
            flags[POD_POLICY_KEYS[key]] = value
        elif key != "allowedCapabilities":
            raise ValueError(f"{ENV_POD_POLICY}: {key!r} is not a boolean podPolicy setting "
                             f"({', '.join([*POD_POLICY_KEYS, 'allowedCapabilities'])})")
    if not isinstance(caps, list) or not all(isinstance(c, str) and c for c in caps):
        raise ValueError(f"{ENV_POD_POLICY}: allowedCapabilities must be a list of capability names")
    return PodPolicy(**flags, allowed_capabilities=frozenset(c.upper().removeprefix("CAP_") for c in caps))


def checkpoint_store(raw: str | None) -> CheckpointStore | None:
    """KUBETRAIN_CHECKPOINT_STORE as a CheckpointStore (None when unset or its uri is empty); ValueError naming
    the field that is wrong."""
    given = _json(raw, ENV_CHECKPOINT_STORE)
    if not isinstance(given, dict) or not given.get("uri"):
        return None
    try:
        return CheckpointStore.model_validate(given)
    except ValidationError as exc:
        bad = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"{ENV_CHECKPOINT_STORE} (chart value checkpointStore): {bad}") from None


def worker_network_policy(raw: str | None) -> WorkerNetworkPolicy | None:
    """KUBETRAIN_WORKER_NETWORK_POLICY as a WorkerNetworkPolicy (None when unset or not enabled); ValueError
    naming what is wrong."""
    given = _json(raw, ENV_WORKER_NETWORK_POLICY)
    if given is None:
        return None
    if not isinstance(given, dict) or set(given) - {"enabled", "metricsFrom"}:
        raise ValueError(f"{ENV_WORKER_NETWORK_POLICY} must be a JSON object with the keys enabled and metricsFrom, "
                         f"not {raw!r}")
    if not isinstance(given.get("enabled", False), bool):
        raise ValueError(f"{ENV_WORKER_NETWORK_POLICY}: enabled must be true or false, not {given['enabled']!r}")
    peers = given.get("metricsFrom") or []
    if not isinstance(peers, list) or not all(
            isinstance(p, dict) and p and set(p) <= set(NETWORK_POLICY_PEER_KEYS) for p in peers):
        raise ValueError(f"{ENV_WORKER_NETWORK_POLICY}: metricsFrom must be a list of NetworkPolicyPeers "
                         f"(objects of {', '.join(NETWORK_POLICY_PEER_KEYS)}), not {peers!r}")
    return WorkerNetworkPolicy(metrics_from=tuple(peers)) if given.get("enabled") else None


def _json(raw: str | None, name: str) -> Any:
    """An environment variable's JSON value (None when unset or empty); ValueError naming the variable."""
    if not raw:
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name} is not JSON: {exc}") from None


def names(lists: Iterable[str]) -> tuple[str, ...]:
    """Comma-separated lists of names as one tuple, in order, each once (blanks skipped)."""
    return tuple(dict.fromkeys(n.strip() for raw in lists for n in raw.split(",") if n.strip()))


def _leader_election(args: argparse.Namespace, env: Mapping[str, str],
                     namespaces: tuple[str, ...]) -> LeaderElection | None:
    if not args.leader_elect:
        return None
    named = (n for n in namespaces if NAMESPACE_NAME.fullmatch(n))
    namespace = (args.leader_elect_namespace or env.get(ENV_POD_NAMESPACE) or next(named, None)
                 or LeaderElection.namespace)
    identity = env.get(ENV_LEADER_ID) or f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"
    return LeaderElection(namespace=namespace, lease=args.leader_elect_lease, identity=identity)


def parse_settings(argv: Sequence[str] | None, env: Mapping[str, str]) -> OperatorSettings:
    """The settings from a command line (None: sys.argv) and an environment; exits on a bad value."""
    p = _parser(env)
    args = p.parse_args(argv)
    namespaces = names(args.namespace if args.namespace is not None else [env.get(ENV_NAMESPACE) or ""])
    try:
        return OperatorSettings(
            builders=WorkerSettings(
                trainer_image=env.get(ENV_TRAINER_IMAGE) or DEFAULTS.builders.trainer_image,
                coscheduling_scheduler=env.get(ENV_COSCHEDULING_SCHEDULER) or DEFAULTS.builders.coscheduling_scheduler,
                pod_policy=pod_policy(env.get(ENV_POD_POLICY)),
                queue_required_in=frozenset(names([env.get(ENV_QUEUE_REQUIRED_IN) or ""])),
                network_policy=worker_network_policy(env.get(ENV_WORKER_NETWORK_POLICY)),
                checkpoint_store=checkpoint_store(env.get(ENV_CHECKPOINT_STORE)),
            ),
            namespaces=namespaces,
            metrics_port=_env_number(p, env, ENV_METRICS_PORT, DEFAULTS.metrics_port),
            create_parallelism=_env_number(p, env, ENV_CREATE_PARALLELISM, DEFAULTS.create_parallelism),
            reconcile_workers=_env_number(p, env, ENV_RECONCILE_WORKERS, DEFAULTS.reconcile_workers),
            api_qps=_env_number(p, env, ENV_API_QPS, DEFAULTS.api_qps),
            api_burst=_env_number(p, env, ENV_API_BURST, DEFAULTS.api_burst),
            termination_taints=(names([env[ENV_TERMINATION_TAINTS]]) if ENV_TERMINATION_TAINTS in env
                                else DEFAULTS.termination_taints),
            liveness=args.liveness,
            leader_election=_leader_election(args, env, namespaces),
            verbose=args.verbose,
        )
    except ValueError as exc:
        p.error(str(exc))
