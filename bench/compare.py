"""kubetrain vs Kubeflow Training Operator v1 (PyTorchJob, with its defaults and tuned) vs Kubeflow Trainer v2
(TrainJob on JobSet): operator scale and recovery on one cluster.

    .venv/bin/python bench/compare.py            # full: 128 kwok nodes x 8 GPUs, four scenarios (~1-2 h on 2 cores)
    .venv/bin/python bench/compare.py --quick    # smoke: 16 nodes, small scenarios (several minutes)
    .venv/bin/python bench/compare.py --quick --operators kubeflow-tuned,trainer-v2   # a subset

Starts a PRIVATE control plane with hack/cluster-up.sh (own state dir and ports, kube-apiserver
audit log on), creates the kwok GPU nodes, lets the minimal creator make the first scenario's pods
once, unmeasured (a cold cluster is slowest for whoever runs first; --no-warm-up skips it), then for
every scenario runs each configuration of --operators in turn: kubetrain's operator; Kubeflow v1 (hack/kubeflow/build.sh) as its manifests run
it and again with a higher client rate limit (--kubeflow-tuned-args); Kubeflow Trainer v2 with the
JobSet controller it runs on (hack/trainer-v2/build.sh; kube-controller-manager's Job controller
creates the pods); the minimal creator (bench/min_creator.py: kubetrain's pods and Services, no
controller; not for recovery scenarios). Each is a real process (Trainer v2: two) under its own
ServiceAccount token, one configuration at a time, in a fresh namespace that is deleted afterwards.
Measures: time from apply to all pods created / all Running (one watch, no polling of the API
server), recovery from a failed worker, operator CPU seconds and peak RSS (/proc), API requests per
operator identity (audit log), reconcile errors (the operators' own metrics). Prints a markdown
table; --json writes every number. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import shlex
import shutil
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import compare_lib as cl
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException
from support import helm_tool  # bench/support: a link to tests/support
from support.cluster import cache_dir, cluster_running, kubeconfig_path, new_admin_client, pinned_kubernetes_version
from support.helm_rbac import RBAC_KINDS
from support.identities import token_for, token_kubeconfig
from support.jobs import TrainingJobs
from support.kubectl import kubectl
from support.kueue import make_certs
from support.kwok import fail_pod, static_claim
from support.paths import HACK_DIR as HACK
from support.paths import REPO_ROOT as REPO
from support.ports import free_port
from support.processes import stop_process
from support.resources import apply, apply_crds, wait_default_service_account, wait_established
from support.waiting import wait_for

FIELD_MANAGER = "kubetrain-bench"
KUBETRAIN_NS = "kubetrain-system"
KUBETRAIN_SA = "kubetrain"
KUBEFLOW_NS = "kubeflow"  # manifests/overlays/standalone
KUBEFLOW_SA = "training-operator"
KUBEFLOW_CERT_DIR = Path("/tmp/k8s-webhook-server/serving-certs")  # hard-coded in pkg/cert (the Secret's volume mount)
KUBEFLOW_KEYS = (cl.KUBEFLOW, cl.KUBEFLOW_TUNED)
"""Both run the same binary under the same identity (one at a time)."""
TRAINER_NS = "kubeflow-system"  # manifests/overlays/manager
TRAINER_SA = "kubeflow-trainer-controller-manager"
JOBSET_NS = "jobset-system"  # config/default: namespace and namePrefix
JOBSET_PREFIX = "jobset-"
JOBSET_SA = f"{JOBSET_PREFIX}controller-manager"
JOB_CONTROLLER = "system:serviceaccount:kube-system:job-controller"
"""kube-controller-manager's Job controller (--use-service-account-credentials): it creates the pods of
JobSet's Jobs."""
CREATOR_NS = "kubetrain-bench-creator"
CREATOR_SA = "min-creator"


def _sa(namespace: str, name: str) -> str:
    return f"system:serviceaccount:{namespace}:{name}"


USERS: dict[str, tuple[str, ...]] = {
    cl.KUBETRAIN: (_sa(KUBETRAIN_NS, KUBETRAIN_SA),),
    cl.KUBEFLOW: (_sa(KUBEFLOW_NS, KUBEFLOW_SA),),
    cl.KUBEFLOW_TUNED: (_sa(KUBEFLOW_NS, KUBEFLOW_SA),),
    cl.TRAINER_V2: (_sa(TRAINER_NS, TRAINER_SA), _sa(JOBSET_NS, JOBSET_SA)),
    cl.CREATOR: (_sa(CREATOR_NS, CREATOR_SA),)}
"""The identities whose requests are an operator's: API requests, and the end of its measurement."""
HELPERS: dict[str, tuple[str, ...]] = {cl.TRAINER_V2: (JOB_CONTROLLER,)}
"""Identities that work for an operator (counted apart; the measurement also waits for them to be quiet)."""
GARBAGE_COLLECTOR = "system:serviceaccount:kube-system:generic-garbage-collector"
"""Audited too (not counted): it deletes the pods of the Jobs JobSet deletes on a restart, and
cl.unrequested_deletes must see those DELETE requests."""
QUIET_S = 5.0
"""The measurement of a run ends once the operator has sent no request for this long."""
DEFAULT_CLUSTER = {"KUBETRAIN_CLUSTER_DIR": str(cache_dir() / "cluster"), "KUBETRAIN_APISERVER_PORT": "16443",
                   "KUBETRAIN_ETCD_PORT": "23790"}


def status(msg: str) -> None:
    """One status line, rewritten in place."""
    print(f"\r\033[K{msg}", end="", file=sys.stderr, flush=True)


def say(msg: str) -> None:
    print(f"\r\033[K[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- cluster


def use_private_cluster(args: argparse.Namespace) -> None:
    """Point every hack/ script and k8s_cluster helper at the benchmark's own cluster."""
    env = {"KUBETRAIN_CLUSTER_DIR": str(Path(args.cluster_dir).expanduser()),
           "KUBETRAIN_APISERVER_PORT": str(args.apiserver_port), "KUBETRAIN_ETCD_PORT": str(args.etcd_port),
           # kwok nodes only: the real node belongs to the test cluster, and one machine has one.
           "KUBETRAIN_REAL_NODE": "0"}
    for key, default in DEFAULT_CLUSTER.items():
        if Path(env[key]).expanduser() == Path(default).expanduser() or env[key] == default:
            sys.exit(f"refusing to use the default test cluster's {key}={default}: the benchmark needs its own")
    os.environ.update(env)


def run_hack(script: str, *args: str, extra_env: dict[str, str] | None = None, check: bool = True
             ) -> subprocess.CompletedProcess[str]:
    assert os.environ["KUBETRAIN_CLUSTER_DIR"] != DEFAULT_CLUSTER["KUBETRAIN_CLUSTER_DIR"]
    return subprocess.run(["bash", str(HACK / script), *args], env={**os.environ, **(extra_env or {})},
                          stdout=subprocess.PIPE, text=True, check=check)


def start_cluster(nodes: int) -> None:
    cdir = Path(os.environ["KUBETRAIN_CLUSTER_DIR"])
    cdir.mkdir(parents=True, exist_ok=True)
    policy = cdir / "audit-policy.yaml"
    users = sorted({u for group in (*USERS.values(), *HELPERS.values(), (GARBAGE_COLLECTOR,)) for u in group})
    policy.write_text(yaml.safe_dump(cl.audit_policy(users)))
    say(f"private cluster in {cdir} (kube-apiserver :{os.environ['KUBETRAIN_APISERVER_PORT']}, "
        f"etcd :{os.environ['KUBETRAIN_ETCD_PORT']}), {nodes} kwok nodes; stopping a leftover one first")
    run_hack("cluster-down.sh", check=False)
    run_hack("cluster-up.sh", extra_env={"KUBETRAIN_NODES": str(nodes), "KUBETRAIN_AUDIT_POLICY": str(policy)})


def audit_log() -> Path:
    return Path(os.environ["KUBETRAIN_CLUSTER_DIR"]) / "logs" / "audit.log"


def ensure_namespace(core: client.CoreV1Api, name: str) -> None:
    with contextlib.suppress(ApiException):
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    wait_default_service_account(core, name, timeout=60)


def sa_kubeconfig(admin: client.ApiClient, namespace: str, sa: str, path: Path) -> Path:
    """A kubeconfig with a TokenRequest token of the ServiceAccount that outlasts a full run (6 hours)."""
    return token_kubeconfig(kubeconfig_path(), token_for(admin, namespace, sa, 6 * 3600), path)


def install_kubetrain(admin: client.ApiClient, core: client.CoreV1Api) -> Path:
    """The chart's CRD and RBAC (helm template, default values), and a token for its ServiceAccount."""
    ensure_namespace(core, KUBETRAIN_NS)
    docs = helm_tool.render(set_values={"fullnameOverride": KUBETRAIN_SA}, namespace=KUBETRAIN_NS)
    apply_crds(admin, docs, FIELD_MANAGER, timeout=60)
    for d in docs:
        if d["kind"] in RBAC_KINDS:
            apply(admin, d, FIELD_MANAGER)
    sa = helm_tool.find(docs, "ServiceAccount")["metadata"]["name"]
    assert sa == KUBETRAIN_SA, sa
    return sa_kubeconfig(admin, KUBETRAIN_NS, sa, Path(os.environ["KUBETRAIN_CLUSTER_DIR"]) / "kubetrain.kubeconfig")


@dataclass(frozen=True)
class GoBuild:
    """A peer built by one of the hack/*/build.sh scripts (hack/lib.sh go_tool)."""

    binary: Path
    moddir: Path
    """The module's source in GOMODCACHE: its manifests are what gets applied."""
    version: str


def go_build(script: str, *args: str) -> GoBuild:
    """Run hack/<script> (builds the binary once per pin) and ask it for the module's directory."""
    def out(*extra: str) -> str:
        proc = subprocess.run([str(HACK / script), *args, *extra], check=True, stdout=subprocess.PIPE, text=True)
        return proc.stdout.strip().splitlines()[-1]

    binary = Path(out())
    moddir = Path(out("--module-dir"))
    return GoBuild(binary, moddir, moddir.name.split("@", 1)[1])


def install_kubeflow(admin: client.ApiClient, core: client.CoreV1Api, moddir: Path) -> Path:
    """What manifests/overlays/standalone installs, minus the Deployment, Service and webhook
    configuration: all six CRDs, the ClusterRole/Binding and ServiceAccount in namespace kubeflow,
    and the (empty) webhook-cert Secret that the operator fills in."""
    ensure_namespace(core, KUBEFLOW_NS)
    crd_names = kubectl_apply(sorted((moddir / "manifests" / "base" / "crds").glob("kubeflow.org_*.yaml")))
    for f in sorted((moddir / "manifests" / "base" / "rbac").glob("*.yaml")):
        for doc in yaml.safe_load_all(f.read_text()):
            if not doc:
                continue
            if doc["kind"] == "ServiceAccount":
                doc["metadata"]["namespace"] = KUBEFLOW_NS
            for s in doc.get("subjects") or []:
                s.setdefault("namespace", KUBEFLOW_NS)
            apply(admin, doc, FIELD_MANAGER)
    with contextlib.suppress(ApiException):
        core.create_namespaced_secret(KUBEFLOW_NS, client.V1Secret(
            metadata=client.V1ObjectMeta(name="training-operator-webhook-cert")))
    wait_established(admin, crd_names, timeout=60)
    return sa_kubeconfig(admin, KUBEFLOW_NS, KUBEFLOW_SA, Path(os.environ["KUBETRAIN_CLUSTER_DIR"]) / "kubeflow.kubeconfig")


def install_creator(admin: client.ApiClient, core: client.CoreV1Api) -> Path:
    """A ServiceAccount for bench/min_creator.py that may create pods and Services, nothing else."""
    ensure_namespace(core, CREATOR_NS)
    ref = {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "kubetrain-bench-min-creator"}
    meta = {"name": ref["name"]}
    for doc in ({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": CREATOR_SA, "namespace": CREATOR_NS}},
                {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": meta,
                 "rules": [{"apiGroups": [""], "resources": ["pods", "services"], "verbs": ["create"]}]},
                {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": meta,
                 "roleRef": ref, "subjects": [{"kind": "ServiceAccount", "name": CREATOR_SA, "namespace": CREATOR_NS}]}):
        apply(admin, doc, FIELD_MANAGER)
    return sa_kubeconfig(admin, CREATOR_NS, CREATOR_SA, Path(os.environ["KUBETRAIN_CLUSTER_DIR"]) / "creator.kubeconfig")


def yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kustomization_files(directory: Path) -> list[Path]:
    """The files a kustomization.yaml lists under ``resources`` (local files only)."""
    resources = yaml.safe_load((directory / "kustomization.yaml").read_text()).get("resources") or []
    return [directory / r for r in resources if (directory / r).is_file()]


def patched_webhooks(directory: Path, prefix: str = "") -> list[dict[str, Any]]:
    """The webhook configurations of a kustomize webhook directory with its JSON patches applied (a patch
    targets a kind, and a name where it says one) and ``prefix`` on their names (namePrefix)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    out = []
    for path in kustomization_files(directory):
        for doc in yaml_docs(path):
            if not doc["kind"].endswith("WebhookConfiguration"):
                continue  # the Service: nothing calls it here
            for patch in kustomization.get("patches") or []:
                target = patch.get("target") or {}
                if target.get("kind") == doc["kind"] and target.get("name", doc["metadata"]["name"]) \
                        == doc["metadata"]["name"]:
                    doc = cl.json_patch(doc, yaml.safe_load((directory / patch["path"]).read_text()))
            out.append(cl.kustomize(doc, "", prefix))
    return out


def kubectl_apply(files: list[Path]) -> list[str]:
    """Server-side apply of CRD files with kubectl (one request each: they are large); their names."""
    for f in files:
        kubectl("apply", "--server-side", "--force-conflicts", f"--field-manager={FIELD_MANAGER}", "-f", str(f),
                timeout=300)
    return [yaml.safe_load(f.read_text())["metadata"]["name"] for f in files]


def install_jobset(admin: client.ApiClient, core: client.CoreV1Api, moddir: Path, port: int, ca: bytes) -> Path:
    """What JobSet's config/default installs, minus the Deployment, Services, the cert Secret and the CRD's
    conversion webhook (one served version: never called): the CRD, the RBAC (kustomized: namespace
    jobset-system, prefix jobset-) and the webhook configurations, calling 127.0.0.1:``port``."""
    ensure_namespace(core, JOBSET_NS)
    comp = moddir / "config" / "components"
    names = kubectl_apply(sorted((comp / "crd" / "bases").glob("*.yaml")))
    for f in kustomization_files(comp / "rbac"):
        for doc in yaml_docs(f):
            apply(admin, cl.kustomize(doc, JOBSET_NS, JOBSET_PREFIX), FIELD_MANAGER)
    for doc in patched_webhooks(comp / "webhook", JOBSET_PREFIX):
        apply(admin, cl.webhooks_to_url(doc, port, ca), FIELD_MANAGER)
    wait_established(admin, names, timeout=60)
    return sa_kubeconfig(admin, JOBSET_NS, JOBSET_SA, Path(os.environ["KUBETRAIN_CLUSTER_DIR"]) / "jobset.kubeconfig")


def install_trainer(admin: client.ApiClient, core: client.CoreV1Api, moddir: Path, port: int, ca: bytes) -> Path:
    """What Trainer v2's manifests/overlays/manager installs from manifests/base, minus the Deployment,
    Service, cert Secret and the SDK's public ConfigMap: the three CRDs, the RBAC (namespace
    kubeflow-system) and the webhook configurations, calling 127.0.0.1:``port``. (JobSet: above.)"""
    ensure_namespace(core, TRAINER_NS)
    base = moddir / "manifests" / "base"
    names = kubectl_apply(kustomization_files(base / "crds"))
    for f in kustomization_files(base / "rbac"):
        for doc in yaml_docs(f):
            apply(admin, cl.kustomize(doc, TRAINER_NS), FIELD_MANAGER)
    for doc in patched_webhooks(base / "webhook"):
        apply(admin, cl.webhooks_to_url(doc, port, ca), FIELD_MANAGER)
    wait_established(admin, names, timeout=60)
    return sa_kubeconfig(admin, TRAINER_NS, TRAINER_SA, Path(os.environ["KUBETRAIN_CLUSTER_DIR"]) / "trainer.kubeconfig")


def install_trainer_v2(admin: client.ApiClient, core: client.CoreV1Api, trainer: GoBuild, jobset: GoBuild
                       ) -> TrainerV2:
    """Both controllers' manifests, a throwaway CA and serving certificate for 127.0.0.1 (their webhooks;
    JobSet's metrics too), and the operator that runs both."""
    work = Path(os.environ["KUBETRAIN_CLUSTER_DIR"]) / "trainer-v2"
    certs = work / "certs"
    certs.mkdir(parents=True, exist_ok=True)
    ca = make_certs(certs)
    # Trainer's webhook server has no certDir setting: controller-runtime's default is
    # $TMPDIR/k8s-webhook-server/serving-certs, so the process gets TMPDIR=<work>/tmp.
    served = work / "tmp" / "k8s-webhook-server" / "serving-certs"
    served.mkdir(parents=True, exist_ok=True)
    for name in ("tls.crt", "tls.key"):
        shutil.copy(certs / name, served / name)
    ports = {"jobset": free_port(), "trainer": free_port()}
    jobset_kc = install_jobset(admin, core, jobset.moddir, ports["jobset"], ca)
    trainer_kc = install_trainer(admin, core, trainer.moddir, ports["trainer"], ca)
    base = trainer.moddir / "manifests" / "base"
    return TrainerV2(
        cl.TRAINER_V2, trainer_kc, binary=trainer.binary, work=work, webhook_ports=ports, jobset_binary=jobset.binary,
        jobset_kubeconfig=jobset_kc, jobset_token=token_for(admin, JOBSET_NS, JOBSET_SA, 6 * 3600),
        trainer_config=yaml.safe_load((base / "manager" / "controller_manager_config.yaml").read_text()),
        jobset_config=yaml.safe_load((jobset.moddir / "config" / "components" / "manager" /
                                      "controller_manager_config.yaml").read_text()),
        runtimes=cl.training_runtimes(yaml.safe_load((base / "runtimes" / "torch_distributed.yaml").read_text())))


# --------------------------------------------------------------------------- pod watch


class PodWatch(threading.Thread):
    """One watch on the namespace's pods (admin identity); milestones are stamped as events arrive."""

    def __init__(self, admin: client.ApiClient, namespace: str):
        super().__init__(daemon=True, name=f"watch-{namespace}")
        self.core = client.CoreV1Api(admin)
        self.ns = namespace
        self.lock = threading.Lock()
        self.uid_of: dict[str, str] = {}
        self.name_of: dict[str, str] = {}
        self.phase_of: dict[str, str] = {}
        self.running: set[str] = set()
        self.seen: set[str] = set()
        self.deleted: set[str] = set()
        self.checks: dict[str, Callable[[PodWatch], bool]] = {}
        self.milestones: dict[str, float] = {}
        self.events = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._resp: Any = None

    # -- milestones
    def expect(self, name: str, predicate: Callable[[PodWatch], bool]) -> None:
        with self.lock:
            self.checks[name] = predicate
            self._check()

    def _check(self) -> None:
        now = time.monotonic()
        for name, pred in self.checks.items():
            if name not in self.milestones and pred(self):
                self.milestones[name] = now

    def wait(self, name: str, timeout: float, progress: Callable[[], str]) -> float | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if name in self.milestones:
                    return self.milestones[name]
            if self.error is not None:
                raise RuntimeError(f"pod watch failed: {self.error!r}")
            status(progress())
            time.sleep(0.25)
        return None

    # -- events
    def _apply(self, kind: str, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        name, uid = meta["name"], meta["uid"]
        phase = (pod.get("status") or {}).get("phase") or "Pending"
        if kind == "DELETED":
            if self.uid_of.get(name) == uid:
                del self.uid_of[name]
            self.running.discard(uid)
            self.deleted.add(uid)
            self.phase_of[uid] = "Deleted"
        else:
            self.uid_of[name] = uid
            self.name_of[uid] = name
            self.phase_of[uid] = phase
            self.seen.add(uid)
            if phase == "Running":
                self.running.add(uid)
            else:
                self.running.discard(uid)
        self.events += 1

    def _list(self) -> str:
        resp = self.core.list_namespaced_pod(self.ns, _preload_content=False)
        body = json.loads(resp.data)
        with self.lock:
            current = {p["metadata"]["uid"] for p in body["items"]}
            for uid in list(self.uid_of.values()):
                if uid not in current:
                    self._apply("DELETED", {"metadata": {"name": self.name_of[uid], "uid": uid}})
            for p in body["items"]:
                self._apply("ADDED", p)
            self._check()
        return body["metadata"]["resourceVersion"]

    def run(self) -> None:
        try:
            rv = self._list()
            while not self._stop.is_set():
                self._resp = self.core.list_namespaced_pod(
                    self.ns, watch=True, resource_version=rv, allow_watch_bookmarks=True, timeout_seconds=300,
                    _preload_content=False, _request_timeout=(10, 330))
                buf = b""
                for chunk in self._resp.stream(1 << 16):
                    buf += chunk
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        ev = json.loads(line)
                        obj = ev["object"]
                        if ev["type"] == "ERROR":
                            rv = self._list() if obj.get("code") == 410 else rv
                            break
                        rv = obj["metadata"].get("resourceVersion", rv)
                        if ev["type"] == "BOOKMARK":
                            continue
                        with self.lock:
                            self._apply(ev["type"], obj)
                            self._check()
                    if self._stop.is_set():
                        return
        except Exception as exc:  # noqa: BLE001 - reported by wait()
            if not self._stop.is_set():
                self.error = exc

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(Exception):
            self._resp.shutdown()  # urllib3 2.3+: unblocks the reading thread (close() would wait for it)


# --------------------------------------------------------------------------- operators


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def http_text(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.read().decode()
    except OSError:
        return ""


def proc_stats(pid: int) -> cl.ProcStats:
    return cl.parse_proc(Path(f"/proc/{pid}/stat").read_text(), Path(f"/proc/{pid}/status").read_text(),
                         os.sysconf("SC_CLK_TCK"))


@dataclass
class Operator:
    key: str
    kubeconfig: Path
    binary: Path | None = None
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    metrics_url: str = ""
    ready_url: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    """Appended to the operator's command line (--kubeflow-args, --kubeflow-tuned-args)."""

    def start(self, log: Path, core: client.CoreV1Api, sc: cl.Scenario, ns: str) -> None:
        self.log = log
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        mport, hport = free_port(), free_port()
        self.metrics_url = f"http://127.0.0.1:{mport}/metrics"
        if self.key == cl.KUBETRAIN:
            # The chart's Deployment: --liveness, KUBETRAIN_METRICS_PORT, KUBETRAIN_TRAINER_IMAGE,
            # KUBETRAIN_CREATE_PARALLELISM (default 32); standalone (1 replica, no leader election).
            cmd = [sys.executable, "-m", "kubetrain.operator", "--liveness", f"http://127.0.0.1:{hport}/healthz"]
            env.update(KUBETRAIN_METRICS_PORT=str(mport), KUBETRAIN_TRAINER_IMAGE=cl.TRAINER_IMAGE,
                       KUBETRAIN_CREATE_PARALLELISM="32", POD_NAMESPACE=KUBETRAIN_NS)
            self.ready_url = f"http://127.0.0.1:{hport}/healthz"
        else:
            # The Deployment in manifests/base runs /manager with no arguments: every default
            # (all schemes, --controller-threads=1, no leader election, zap development logging).
            # Only the listen addresses move to free loopback ports (a pod has its own network namespace).
            assert self.binary is not None
            cmd = [str(self.binary), f"--metrics-bind-address=127.0.0.1:{mport}",
                   f"--health-probe-bind-address=127.0.0.1:{hport}", f"--webhook-server-port={free_port()}",
                   *self.extra_args]
            env.update(MY_POD_NAMESPACE=KUBEFLOW_NS, MY_POD_NAME="training-operator-bench")
            self.ready_url = f"http://127.0.0.1:{hport}/readyz"
            if KUBEFLOW_CERT_DIR.exists():
                for f in KUBEFLOW_CERT_DIR.iterdir():
                    f.unlink()
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        if self.key in KUBEFLOW_KEYS:
            self._mount_webhook_secret(core)
        wait_for(lambda: self._alive() and http_ok(self.ready_url), 180, interval=0.2,
                 what=f"{self.key} operator ready ({self.ready_url}); log {log}")
        if self.key in KUBEFLOW_KEYS:  # controllers start after the certificates (cmd/training-operator.v1)
            wait_for(lambda: self._alive() and "Starting workers" in log.read_text(errors="replace")
                     and "pytorchjob" in log.read_text(errors="replace"), 60, interval=0.2,
                     what=f"kubeflow pytorchjob-controller workers; log {log}")
        time.sleep(2.0)  # let both finish their initial LIST/WATCH

    def _alive(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.key} operator exited with {self.proc.returncode}; log {self.log}")
        return True

    def pids(self) -> dict[str, int]:
        """The operator's processes by name: what its CPU and RSS are measured on."""
        assert self.proc is not None
        return {self.key: self.proc.pid}

    def _mount_webhook_secret(self, core: client.CoreV1Api) -> None:
        """What the kubelet does for the Deployment's `cert` volume: the Secret's keys as files in the cert dir.

        The operator's cert rotator fills the Secret, then waits for the files before it starts the
        controllers (pkg/cert, cert-controller's ensureCertsMounted)."""

        def filled() -> dict[str, str]:
            self._alive()
            data = core.read_namespaced_secret("training-operator-webhook-cert", KUBEFLOW_NS).data or {}
            return data if "tls.crt" in data and "tls.key" in data else {}

        data = wait_for(filled, 120, interval=0.2, what="training-operator webhook Secret filled")
        KUBEFLOW_CERT_DIR.mkdir(parents=True, exist_ok=True)
        for key, value in data.items():
            (KUBEFLOW_CERT_DIR / key).write_bytes(base64.b64decode(value))

    def reconcile_counts(self) -> tuple[float | None, float | None]:
        """(reconciles, reconcile errors) from the operator's /metrics."""
        text = http_text(self.metrics_url)
        if self.key == cl.KUBETRAIN:
            total = cl.metric_sum(text, "kubetrain_operator_reconcile_duration_seconds_count")
            errors = cl.metric_sum(text, "kubetrain_operator_reconcile_errors_total")
            if errors is None and text:
                errors = 0.0  # a labelled counter with no sample yet: no error
            return total, errors
        total = cl.metric_sum(text, "controller_runtime_reconcile_total")  # every controller, every result
        return total, cl.metric_sum(text, "controller_runtime_reconcile_errors_total")

    def apply(self, admin: client.ApiClient, sc: cl.Scenario, ns: str) -> None:
        """What starts the clock's work: the scenario's jobs, created as the admin."""
        create_jobs(admin, self.key, sc, ns)

    def summary(self) -> str:
        return ""

    def stop(self) -> None:
        stop_process(self.proc, 20)


@dataclass
class Creator(Operator):
    """bench/min_creator.py as one more operator: started per scenario (it builds that scenario's
    objects and opens its connections first), told "go" instead of being given jobs."""

    def start(self, log: Path, core: client.CoreV1Api, sc: cl.Scenario, ns: str) -> None:
        self.log = log
        cmd = [sys.executable, str(REPO / "bench" / "min_creator.py"), "--kubeconfig", str(self.kubeconfig),
               "--namespace", ns, "--jobs", str(sc.jobs), "--workers", str(sc.workers), "--gpus", str(sc.gpus),
               *self.extra_args]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        wait_for(lambda: self._alive() and "ready:" in log.read_text(errors="replace"), 180, interval=0.1,
                 what=f"minimal creator ready; log {log}")
        time.sleep(2.0)  # as for the operators

    def apply(self, admin: client.ApiClient, sc: cl.Scenario, ns: str) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()

    def reconcile_counts(self) -> tuple[float | None, float | None]:
        return None, None

    def summary(self) -> str:
        """Its own "done: ..." line: objects, seconds, HTTP status counts, retries."""
        lines = [] if self.log is None else self.log.read_text(errors="replace").splitlines()
        return next((line for line in reversed(lines) if line.startswith("done:")), "no 'done:' line")

    def stop(self) -> None:
        if self.proc is not None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # it exits at the end of its stdin
        stop_process(self.proc, 20)


@dataclass
class TrainerV2(Operator):
    """Kubeflow Trainer v2's controller manager (``proc``, ``kubeconfig``) and JobSet's (``jobset_proc``), each
    with its manifests' flags (--config=<its controller_manager_config.yaml> --zap-log-level=2) and that
    config as shipped but for loopback ports, provided certificates and the Lease namespace
    (compare_lib.trainer_config, jobset_config). Both elect a leader, as shipped: a start waits for the
    previous process's Lease to expire. The torch runtimes are applied once the trainer's webhook answers."""

    work: Path = Path()
    webhook_ports: dict[str, int] = field(default_factory=dict)
    jobset_binary: Path = Path()
    jobset_kubeconfig: Path = Path()
    jobset_token: str = ""
    trainer_config: dict[str, Any] = field(default_factory=dict)
    jobset_config: dict[str, Any] = field(default_factory=dict)
    runtimes: list[dict[str, Any]] = field(default_factory=list)
    jobset_proc: subprocess.Popen[bytes] | None = None
    jobset_log: Path | None = None
    jobset_metrics_url: str = ""

    def start(self, log: Path, core: client.CoreV1Api, sc: cl.Scenario, ns: str) -> None:
        self.log, self.jobset_log = log, log.with_name(f"{log.stem}-jobset.log")
        self.proc = self.jobset_proc = None  # the previous scenario's, stopped
        health, metrics = free_port(), free_port()
        self.jobset_metrics_url = f"https://127.0.0.1:{metrics}/metrics"
        cfg = cl.jobset_config(self.jobset_config, health=health, metrics=metrics, webhook=self.webhook_ports["jobset"],
                               namespace=JOBSET_NS, cert_dir=str(self.work / "certs"))
        self.jobset_proc = self._launch(self.jobset_binary, self.jobset_kubeconfig, "jobset-config.yaml", cfg,
                                        self.jobset_log)
        self._ready(self.jobset_log, health, "JobSet", '"controllerKind": "JobSet"')
        health, metrics = free_port(), free_port()
        self.metrics_url = f"https://127.0.0.1:{metrics}/metrics"
        cfg = cl.trainer_config(self.trainer_config, health=health, metrics=metrics,
                                webhook=self.webhook_ports["trainer"], namespace=TRAINER_NS)
        self.proc = self._launch(self.binary, self.kubeconfig, "trainer-config.yaml", cfg, log)
        self._ready(log, health, "TrainJob", '"controller":"trainjob_controller"')
        admin = core.api_client
        for runtime in self.runtimes:  # validated by the trainer's webhook: retried until it answers
            wait_for(partial(self._apply_runtime, admin, runtime), 60, interval=0.5,
                     what=f"ClusterTrainingRuntime {runtime['metadata']['name']} applied; log {log}")
        time.sleep(2.0)  # as for the others

    def _launch(self, binary: Path | None, kubeconfig: Path, config_name: str, cfg: dict[str, Any], log: Path
                ) -> subprocess.Popen[bytes]:
        config = self.work / config_name
        config.write_text(yaml.safe_dump(cfg))
        # TMPDIR: where the trainer's webhook server finds its certificate (install_trainer_v2).
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "TMPDIR": str(self.work / "tmp")}
        with open(log, "wb") as out:
            return subprocess.Popen([str(binary), f"--config={config}", "--zap-log-level=2"], env=env, stdout=out,
                                    stderr=subprocess.STDOUT, cwd=REPO)

    def _ready(self, log: Path, health: int, kind: str, marker: str) -> None:
        """Ready (certificates read, webhook server listening) and the ``kind`` controller's workers started
        (after it won the leader election): a "Starting workers" log line with ``marker``."""
        wait_for(lambda: self._alive() and http_ok(f"http://127.0.0.1:{health}/readyz"), 180, interval=0.2,
                 what=f"{kind} controller manager ready; log {log}")

        def started() -> bool:
            self._alive()
            return any("Starting workers" in line and marker in line
                       for line in log.read_text(errors="replace").splitlines())

        wait_for(started, 120, interval=0.2, what=f"{kind} controller workers (leader election); log {log}")

    def _apply_runtime(self, admin: client.ApiClient, runtime: dict[str, Any]) -> bool:
        return self._alive() and _applied(admin, runtime)

    def _alive(self) -> bool:
        for name, proc, log in (("trainer", self.proc, self.log), ("jobset", self.jobset_proc, self.jobset_log)):
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{name} controller manager exited with {proc.returncode}; log {log}")
        return True

    def pids(self) -> dict[str, int]:
        assert self.proc is not None and self.jobset_proc is not None
        return {"trainer": self.proc.pid, "jobset": self.jobset_proc.pid}

    def reconcile_counts(self) -> tuple[float | None, float | None]:
        """Both managers' controller-runtime counters. Trainer's metrics are HTTPS without authentication
        (its own certificate); JobSet's authenticate the caller: its own token (TokenReview and
        SubjectAccessReview requests by its identity, after the measurement window)."""
        texts = [https_text(self.metrics_url), https_text(self.jobset_metrics_url, self.jobset_token)]

        def both(name: str) -> float | None:
            values = [cl.metric_sum(t, name) for t in texts]
            return None if any(v is None for v in values) else sum(v or 0.0 for v in values)

        return both("controller_runtime_reconcile_total"), both("controller_runtime_reconcile_errors_total")

    def stop(self) -> None:
        stop_process(self.proc, 20)
        stop_process(self.jobset_proc, 20)


def _applied(admin: client.ApiClient, body: dict[str, Any]) -> bool:
    try:
        apply(admin, body, FIELD_MANAGER)
    except ApiException as exc:
        if exc.status is not None and exc.status >= 500:  # webhook not answering yet
            return False
        raise
    return True


def https_text(url: str, token: str = "") -> str:
    """GET over HTTPS from a local process with its own certificate (not verified: loopback)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5, context=ctx) as r:
            return r.read().decode()
    except OSError:
        return ""


# --------------------------------------------------------------------------- one run


def create_jobs(admin: client.ApiClient, operator: str, sc: cl.Scenario, ns: str) -> None:
    custom = client.CustomObjectsApi(admin)
    group, version, plural = cl.JOB_RESOURCES[operator]

    def create(i: int) -> None:
        custom.create_namespaced_custom_object(group, version, ns, plural, cl.job_manifest(operator, sc, ns, i))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(create, range(sc.jobs)))


def delete_namespace(admin: client.ApiClient, ns: str, timeout: float = 600) -> None:
    core = client.CoreV1Api(admin)
    with contextlib.suppress(ApiException):
        core.delete_namespace(ns)
    deadline = time.monotonic() + timeout
    stripped = False
    while time.monotonic() < deadline:
        try:
            core.read_namespace(ns)
        except ApiException as exc:
            if exc.status == 404:
                status("")
                return
            raise
        page = core.list_namespaced_pod(ns, limit=1)
        left = len(page.items) + (page.metadata.remaining_item_count or 0)
        status(f"  deleting namespace {ns}: {left} pods left")
        if not stripped and time.monotonic() > deadline - timeout / 2:
            strip_finalizers(admin, ns)  # neither operator should leave any; say so if one did
            stripped = True
        time.sleep(1.0)
    raise RuntimeError(f"namespace {ns} not deleted after {timeout:.0f}s")


def strip_finalizers(admin: client.ApiClient, ns: str) -> None:
    custom = client.CustomObjectsApi(admin)
    for group, version, plural in sorted({*cl.JOB_RESOURCES.values(), ("jobset.x-k8s.io", "v1alpha2", "jobsets")}):
        try:
            items = custom.list_namespaced_custom_object(group, version, ns, plural).get("items", [])
        except ApiException:  # that operator is not installed
            continue
        for item in items:
            if item["metadata"].get("finalizers"):
                say(f"removing finalizers {item['metadata']['finalizers']} from {plural}/{item['metadata']['name']}")
                custom.patch_namespaced_custom_object(group, version, ns, plural, item["metadata"]["name"],
                                                      {"metadata": {"finalizers": None}})


def read_audit(offset: int) -> Iterator[bytes]:
    with open(audit_log(), "rb") as f:
        f.seek(offset)
        yield from f


def wait_quiet(users: Sequence[str], offset: int, since: float, progress: Callable[[], str], quiet: float = QUIET_S,
               limit: float = 300.0) -> float | None:
    """Wait until ``users`` have sent no API request for ``quiet`` seconds (audit log); return the
    epoch time of their last request after ``since`` (None if they sent none). Leader-election Lease
    requests do not count here (Trainer v2 and JobSet renew theirs every 2 s, as shipped: never quiet)."""
    last: float | None = None
    needles = [json.dumps(u).encode() for u in users]
    deadline = time.monotonic() + limit
    with open(audit_log(), "rb") as f:
        f.seek(offset)
        buf = b""
        while time.monotonic() < deadline:
            buf += f.read()
            lines, _, buf = buf.rpartition(b"\n")
            for line in lines.split(b"\n"):
                if any(n in line for n in needles):
                    with contextlib.suppress(ValueError, KeyError):
                        ev = json.loads(line)
                        if (ev.get("objectRef") or {}).get("resource") == "leases":
                            continue
                        t = cl.parse_time(ev["requestReceivedTimestamp"])
                        if t >= since and (last is None or t > last):
                            last = t
            if time.time() - max(last or since, since) >= quiet:
                return last
            status(progress())
            time.sleep(0.5)
    return last


def run_one(admin: client.ApiClient, op: Operator, sc: cl.Scenario, timeout: float) -> cl.RunResult:
    core = client.CoreV1Api(admin)
    ns = f"{sc.name}-{op.key}"
    res = cl.RunResult(operator=op.key, scenario=sc.name, pods=sc.pods)
    ensure_namespace(core, ns)
    audit_offset = audit_log().stat().st_size
    log = Path(os.environ["KUBETRAIN_CLUSTER_DIR"]) / "logs" / f"bench-{ns}.log"
    watch = PodWatch(admin, ns)
    users, helpers = USERS[op.key], HELPERS.get(op.key, ())
    volume = static_claim(core, ns, cl.CHECKPOINT_CLAIM) if op.key == cl.KUBETRAIN and sc.fail_one else None
    try:
        op.start(log, core, sc, ns)
        watch.start()
        n = sc.pods
        watch.expect("created", lambda w: len(w.uid_of) >= n)
        watch.expect("running", lambda w: len(w.running) >= n)
        res.load_before = os.getloadavg()
        before = {name: proc_stats(pid) for name, pid in op.pids().items()}
        wall0, t0 = time.time(), time.monotonic()
        progress = progress_line(watch, op, sc, lambda: time.monotonic() - t0)
        op.apply(admin, sc, ns)
        res.apply_s = time.monotonic() - t0
        t_created = watch.wait("created", timeout, progress("creating"))
        t_running = watch.wait("running", max(1.0, t0 + timeout - time.monotonic()), progress("starting"))
        res.pods_created_s = None if t_created is None else t_created - t0
        res.all_running_s = None if t_running is None else t_running - t0
        if sc.fail_one and t_running is not None:
            recover(core, watch, op, sc, ns, res, timeout)
        # The operator may still be working (Services, status, Events): measure until it is quiet.
        last = wait_quiet((*users, *helpers), audit_offset, wall0, progress("settling"))
        res.last_request_s = None if last is None else last - wall0
        after = {name: proc_stats(pid) for name, pid in op.pids().items()}
        wall1 = time.time()
        res.load_after = os.getloadavg()
        record_stats(res, before, after)
        res.reconciles, res.reconcile_errors = op.reconcile_counts()
    finally:
        watch.stop()
        op.stop()
    if op.summary():
        res.notes.append(op.summary())
    window = count_audit(res, users, helpers, audit_offset, wall0, wall1)
    status("")
    say(f"{sc.name} / {op.key}: created {cl.fmt(res.pods_created_s, 1)}s, Running {cl.fmt(res.all_running_s, 1)}s"
        + (f", recovery {cl.fmt(res.recovery_s, 1)}s ({res.pods_replaced} pods created, {res.restarts} restarts)"
           if sc.fail_one else "")
        + f", CPU {res.cpu_s:.1f}s, peak RSS {res.peak_rss_mb:.0f} MB, {res.api_requests} requests "
        f"({window.summary(4)}), reconcile errors {cl.fmt(res.reconcile_errors, 0)}; log {log}")
    delete_namespace(admin, ns)
    if volume is not None:
        core.delete_persistent_volume(volume)
    return res


def progress_line(watch: PodWatch, op: Operator, sc: cl.Scenario, elapsed: Callable[[], float]
                  ) -> Callable[[str], Callable[[], str]]:
    def for_phase(phase: str) -> Callable[[], str]:
        def line() -> str:
            with watch.lock:
                created, running = len(watch.uid_of), len(watch.running)
            return (f"  {sc.name} / {op.key}: {phase} {elapsed():6.1f}s  pods {created}/{sc.pods} "
                    f"Running {running}/{sc.pods}  load {os.getloadavg()[0]:.1f}")
        return line
    return for_phase


def record_stats(res: cl.RunResult, before: dict[str, cl.ProcStats], after: dict[str, cl.ProcStats]) -> None:
    """CPU and peak RSS into ``res``: summed over the operator's processes, and each one's where it has several."""
    res.cpu_s = sum(after[name].cpu_s - before[name].cpu_s for name in after)
    res.cpu_total_s = sum(a.cpu_s for a in after.values())
    res.peak_rss_mb = sum(a.peak_rss_bytes for a in after.values()) / 2**20
    if len(after) > 1:
        res.processes = {name: {"cpu_s": round(a.cpu_s - before[name].cpu_s, 2), "cpu_total_s": a.cpu_s,
                                "peak_rss_mb": round(a.peak_rss_bytes / 2**20, 1)} for name, a in after.items()}
        res.notes.append("processes: " + ", ".join(
            f"{name} CPU {p['cpu_s']:.1f}s, peak RSS {p['peak_rss_mb']:.0f} MB" for name, p in res.processes.items()))


def count_audit(res: cl.RunResult, users: Sequence[str], helpers: Sequence[str], offset: int, wall0: float,
                wall1: float) -> cl.RequestCount:
    """The operator's API requests (all its ``users``) into ``res``: in the measurement window [wall0, wall1],
    and in all; its ``helpers``' requests in the window apart."""
    window = cl.count_requests(read_audit(offset), [*users, *helpers], since=wall0, until=wall1)
    total = cl.count_requests(read_audit(offset), list(users))
    mine = cl.RequestCount()
    for u in dict.fromkeys(users):
        mine.total += window[u].total
        mine.by_verb.update(window[u].by_verb)
    res.api_requests, res.api_by_verb = mine.total, dict(mine.by_verb)
    res.api_requests_total = sum(total[u].total for u in dict.fromkeys(users))
    if helpers:
        res.helper_api_requests = sum(window[u].total for u in dict.fromkeys(helpers))
        res.notes.append("Job controller requests: " + ", ".join(window[u].summary(4) for u in dict.fromkeys(helpers)))
    return mine


def recover(core: client.CoreV1Api, watch: PodWatch, op: Operator, sc: cl.Scenario, ns: str,
            res: cl.RunResult, timeout: float) -> None:
    """Fail one worker; time until the set of pods the operator must replace is Running again.

    kubetrain restarts the whole gang in place (the failed pod is re-created, the others run generation
    1 in their pods); Trainer v2 through JobSet's failurePolicy re-creates every pod (the failed pod
    fails its Job, backoffLimit 0, and JobSet re-creates every Job); Kubeflow v1 deletes and re-creates
    only the failed pod (restartPolicy ExitCode, exit 137)."""
    with watch.lock:
        victim = cl.find_victim(op.key, sc, watch.uid_of)
        before = set(watch.uid_of.values())
    if victim is None:
        res.notes.append(f"no victim pod found for worker {cl.victim_index(sc)}")
        return
    victim_uid = watch.uid_of[victim]
    replaced = before if op.key in cl.GANG_RESTART else {victim_uid}
    n = sc.pods
    watch.expect("failed", lambda w: w.phase_of.get(victim_uid) in ("Failed", "Deleted"))
    watch.expect("recovered", lambda w: "failed" in w.milestones and len(w.running - replaced) >= n)
    t_inject = time.monotonic()
    fail_pod(core, ns, victim, exit_code=cl.FAIL_EXIT_CODE, reason="Error", message="failed by bench/compare.py")

    def line(phase: str) -> Callable[[], str]:
        def f() -> str:
            with watch.lock:
                fresh = len(watch.running - replaced)
            return (f"  {sc.name} / {op.key}: {phase} {time.monotonic() - t_inject:6.1f}s  "
                    f"new pods Running {fresh}/{n}  load {os.getloadavg()[0]:.1f}")
        return f

    t_failed = watch.wait("failed", 120, line("failing"))
    if t_failed is None:
        res.notes.append("the injected failure was not seen")
        return
    t_rec = watch.wait("recovered", timeout, line("recovering"))
    with watch.lock:
        gone = len(before & watch.deleted) + sum(
            1 for uid in before if watch.phase_of.get(uid) == "Failed" and uid not in watch.deleted)
        res.pods_replaced = len(watch.seen - before)
        deleted = len(before & watch.deleted)
    res.restarts = restart_count(core.api_client, op.key, sc, ns, deleted)
    if t_rec is not None:
        res.recovery_s = t_rec - t_failed
        res.recovery_from_injection_s = t_rec - t_inject
    res.notes.append(f"recovery: {gone} old pods gone or failed, {res.pods_replaced} new pods created, "
                     f"{res.restarts} restart(s)")
    if op.key in cl.UNIQUE_POD_NAMES:
        res.notes.append("kwok's duplicate deletes by name not counted: no pod name is reused")
    else:
        note_kwok_deletes(res, ns)


def restart_count(admin: client.ApiClient, operator: str, sc: cl.Scenario, ns: str, deleted: int) -> int | None:
    """kubetrain: the TrainingJob's status.restartCount; Trainer v2: the JobSet's status.restarts;
    Kubeflow v1: the old pods it deleted (to re-create them)."""
    if operator == cl.KUBETRAIN:
        return TrainingJobs(admin, ns).status(cl.job_name(sc, 0)).get("restartCount")
    if operator == cl.TRAINER_V2:
        jobset = client.CustomObjectsApi(admin).get_namespaced_custom_object(
            "jobset.x-k8s.io", "v1alpha2", ns, "jobsets", cl.job_name(sc, 0))
        return (jobset.get("status") or {}).get("restarts", 0)
    return deleted


def note_kwok_deletes(res: cl.RunResult, ns: str) -> None:
    kwok_log = Path(os.environ["KUBETRAIN_CLUSTER_DIR"]) / "logs" / "kwok.log"
    with open(audit_log(), "rb") as a:
        audit = a.readlines()
    with open(kwok_log, errors="replace") as f:
        res.kwok_duplicate_deletes = cl.unrequested_deletes(
            f, ns, cl.pod_requests(audit, ns), cl.pod_requests(audit, ns, verb="create"))
    if res.kwok_duplicate_deletes:
        res.notes.append(f"kwok deleted {res.kwok_duplicate_deletes} pod(s) nobody asked to delete: re-created "
                         "workers (its pod-delete stage deletes by name, after the old pod was gone)")


# --------------------------------------------------------------------------- main


def machine() -> str:
    mem = next((line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")), "0")
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    return f"{os.cpu_count()} cores ({cpu}), {int(mem) / 2**20:.0f} GiB"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"{cl.QUICK_NODES} nodes and small scenarios (smoke test)")
    p.add_argument("--scenarios", help="comma-separated subset of scenario names")
    p.add_argument("--operators", default=",".join(cl.OPERATORS),
                   help=f"comma-separated, run in this order ({cl.KUBEFLOW_TUNED}: Kubeflow v1 with "
                        f"--kubeflow-tuned-args; {cl.TRAINER_V2}: Kubeflow Trainer v2 on JobSet; "
                        f"{cl.CREATOR}: bench/min_creator.py)")
    p.add_argument("--timeout", type=float, default=1200, help="per milestone, seconds")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every scenario this many times, the configurations' order rotated each round; "
                        "the table shows each configuration's median run, and a summary every round's figure")
    p.add_argument("--keep-cluster", action="store_true", help="leave the private cluster running")
    p.add_argument("--json", type=Path, help="write all results here")
    p.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                   help="measure from a cold cluster (default: the minimal creator first runs the first "
                        "scenario once, unmeasured)")
    p.add_argument("--kubeflow-args", default="",
                   help=f"extra flags for Kubeflow's manager in the '{cl.KUBEFLOW}' configuration "
                        "(default: none, as its manifests run it)")
    p.add_argument("--kubeflow-tuned-args", default=cl.KUBEFLOW_TUNED_ARGS,
                   help=f"extra flags for Kubeflow's manager in the '{cl.KUBEFLOW_TUNED}' configuration "
                        "(default: %(default)s)")
    p.add_argument("--creator-args", default="",
                   help="extra flags for bench/min_creator.py, e.g. '--client aiohttp --concurrency 16'")
    p.add_argument("--cluster-dir", default=os.environ.get("KUBETRAIN_BENCH_CLUSTER_DIR",
                                                           str(cache_dir() / "bench-cluster")))
    p.add_argument("--apiserver-port", type=int, default=int(os.environ.get("KUBETRAIN_BENCH_APISERVER_PORT", 26443)))
    p.add_argument("--etcd-port", type=int, default=int(os.environ.get("KUBETRAIN_BENCH_ETCD_PORT", 33790)))
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds: at least 1, not {args.rounds}")
    return args


@dataclass(frozen=True)
class Builds:
    """The peers built from their Go modules (None: not among --operators)."""

    kubeflow: GoBuild | None = None
    trainer: GoBuild | None = None
    jobset: GoBuild | None = None

    @classmethod
    def needed(cls, operators: list[str]) -> Builds:
        """Only what the chosen configurations run: the Go builds happen here, never in CI's tests."""
        trainer = cl.TRAINER_V2 in operators
        return cls(kubeflow=go_build("kubeflow/build.sh") if set(KUBEFLOW_KEYS) & set(operators) else None,
                   trainer=go_build("trainer-v2/build.sh") if trainer else None,
                   jobset=go_build("trainer-v2/build.sh", "--jobset") if trainer else None)


def install_operators(admin: client.ApiClient, args: argparse.Namespace, operators: list[str], builds: Builds
                      ) -> dict[str, Operator]:
    """Each operator's CRDs and RBAC, and the identity (kubeconfig) it runs as."""
    core = client.CoreV1Api(admin)
    ops: dict[str, Operator] = {}
    if cl.KUBETRAIN in operators:
        ops[cl.KUBETRAIN] = Operator(cl.KUBETRAIN, install_kubetrain(admin, core))
    if builds.kubeflow is not None:
        kubeconfig = install_kubeflow(admin, core, builds.kubeflow.moddir)
        for key, extra in ((cl.KUBEFLOW, args.kubeflow_args), (cl.KUBEFLOW_TUNED, args.kubeflow_tuned_args)):
            ops[key] = Operator(key, kubeconfig, binary=builds.kubeflow.binary, extra_args=shlex.split(extra))
    if builds.trainer is not None and builds.jobset is not None:
        ops[cl.TRAINER_V2] = install_trainer_v2(admin, core, builds.trainer, builds.jobset)
    if cl.CREATOR in operators or args.warm_up:
        ops[cl.CREATOR] = Creator(cl.CREATOR, install_creator(admin, core), extra_args=shlex.split(args.creator_args))
    return ops


def run_all(args: argparse.Namespace, scenarios: list[cl.Scenario], operators: list[str], nodes: int,
            builds: Builds) -> list[cl.RunResult]:
    """Every scenario with every operator on a private cluster, stopped at the end (unless --keep-cluster)."""
    start_cluster(nodes)
    results: list[cl.RunResult] = []
    try:
        admin = new_admin_client()
        ops = install_operators(admin, args, operators, builds)
        if args.warm_up:
            warm_up(admin, ops[cl.CREATOR], scenarios[0], args.timeout)
        for sc in scenarios:
            say(f"scenario {sc.name}: {sc.describe()} on {nodes} nodes x 8 GPUs")
            for index in range(args.rounds):
                if args.rounds > 1:
                    say(f"{sc.name}: round {index + 1} of {args.rounds}")
                results.extend(replace(r, round_index=index)
                               for r in run_round(admin, ops, sc, cl.round_order(operators, index), args.timeout))
    finally:
        if not args.keep_cluster and cluster_running():
            say("stopping the private cluster")
            run_hack("cluster-down.sh", check=False)
    return results


def run_round(admin: client.ApiClient, ops: dict[str, Operator], sc: cl.Scenario, order: list[str],
              timeout: float) -> list[cl.RunResult]:
    """One round of a scenario: every configuration once, in the round's order."""
    out = []
    for key in order:
        if key == cl.CREATOR and sc.fail_one:  # nothing of its own would replace the failed pod
            out.append(cl.RunResult(cl.CREATOR, sc.name, sc.pods, skipped=cl.NO_CONTROLLER))
            continue
        out.append(run_one(admin, ops[key], sc, timeout))
    return out


def warm_up(admin: client.ApiClient, creator: Operator, sc: cl.Scenario, timeout: float) -> None:
    """The first burst of pods on a private cluster that just came up is the slowest (kwok took 40.6 s
    to report 1024 pods Running for the first operator of one run, 22.5 s for the creator after it):
    the minimal creator makes the first scenario's pods once, unmeasured, so that the operator that
    runs first does not pay for it."""
    say(f"warm-up: the minimal creator runs {sc.name} once, not measured")
    r = run_one(admin, creator, replace(sc, fail_one=False), timeout)
    say(f"warm-up done: created {cl.fmt(r.pods_created_s, 1)}s, Running {cl.fmt(r.all_running_s, 1)}s")


def report(title: str, scenarios: list[cl.Scenario], results: list[cl.RunResult]) -> None:
    print(f"\n{title}\n")
    print(cl.table(scenarios, cl.median_runs(scenarios, results)))
    print()
    rounds = any(r.round_index for r in results)
    for line in cl.rounds_summary(scenarios, results) if rounds else []:
        print(f"- {line}")
    for r in results:
        run = f"{r.scenario} / {r.operator}" + (f" / round {r.round_index + 1}" if rounds else "")
        if r.skipped:
            print(f"- {run}: {r.skipped}")
            continue
        verbs = ", ".join(f"{k} {v}" for k, v in sorted(r.api_by_verb.items(), key=lambda kv: -kv[1])[:8])
        notes = "; ".join(r.notes)
        print(f"- {run}: load {cl.load_str(r.load_before)} -> {cl.load_str(r.load_after)}; "
              f"jobs applied in {cl.fmt(r.apply_s, 1)}s; CPU incl. start {cl.fmt(r.cpu_total_s, 1)}s; "
              f"requests incl. start {r.api_requests_total}; {verbs}" + (f"; {notes}" if notes else ""))


def main() -> int:
    args = parse_args()
    scenarios = list(cl.QUICK if args.quick else cl.FULL)
    if args.scenarios:
        wanted = args.scenarios.split(",")
        scenarios = [s for s in cl.QUICK + cl.FULL if s.name in wanted]
    operators = args.operators.split(",")
    nodes = cl.QUICK_NODES if args.quick else cl.FULL_NODES
    use_private_cluster(args)
    cl.configurations(operators)  # an unknown name fails before anything is built or started
    builds = Builds.needed(operators)
    configs = cl.configurations(
        operators, kubeflow_version=builds.kubeflow.version if builds.kubeflow else "?",
        kubeflow_args=args.kubeflow_args, tuned_args=args.kubeflow_tuned_args, creator_args=args.creator_args,
        trainer_version=builds.trainer.version if builds.trainer else "?",
        jobset_version=builds.jobset.version if builds.jobset else "?")
    cl.OPERATOR_TITLES.update({key: c["title"] for key, c in configs.items()})
    say(f"machine: {machine()}; load average {cl.load_str(os.getloadavg())}")
    results = run_all(args, scenarios, operators, nodes, builds)
    peers = "; ".join(c["describe"] for key, c in configs.items() if key != cl.KUBETRAIN)
    who = f"kubetrain {git_rev()} vs {peers}" if cl.KUBETRAIN in configs else f"{peers} (kubetrain {git_rev()}'s bench)"
    rounds = f"; median of {args.rounds} rounds, order rotated" if args.rounds > 1 else ""
    title = (f"{who}{rounds}; Kubernetes {pinned_kubernetes_version()} (hack/), {nodes} kwok nodes x 8 nvidia.com/gpu; "
             f"{machine()}" + ("" if args.warm_up else "; no warm-up"))
    report(title, scenarios, results)
    if args.json:
        args.json.write_text(json.dumps({"title": title, "configurations": configs,
                                         "results": [r.to_json() for r in results]}, indent=1))
    return 0


def git_rev() -> str:
    out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "?"


if __name__ == "__main__":
    sys.exit(main())
