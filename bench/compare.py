"""kubetrain vs Kubeflow Training Operator v1 (PyTorchJob): operator scale and recovery on one cluster.

    .venv/bin/python bench/compare.py            # full: 128 kwok nodes x 8 GPUs, four scenarios (~30-60 min on 2 cores)
    .venv/bin/python bench/compare.py --quick    # smoke: 16 nodes, small scenarios (a few minutes)

Starts a PRIVATE control plane with hack/cluster-up.sh (own state dir and ports, kube-apiserver
audit log on), creates the kwok GPU nodes, then for every scenario runs kubetrain's operator and
then Kubeflow's (built by hack/kubeflow/build.sh), then the minimal creator (bench/min_creator.py:
kubetrain's pods and Services, no controller; not for recovery scenarios), each as a real process
under its own ServiceAccount token, one at a time, in a fresh namespace that is deleted afterwards. Measures:
time from apply to all pods created / all Running (one watch, no polling of the API server),
recovery from a failed worker, operator CPU seconds and peak RSS (/proc), API requests per
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
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
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
from support.kwok import fail_pod
from support.paths import HACK_DIR as HACK
from support.paths import REPO_ROOT as REPO
from support.ports import free_port
from support.processes import stop_process
from support.resources import apply, apply_crds, wait_default_service_account, wait_established
from support.waiting import wait_for

from kubetrain.core import api

FIELD_MANAGER = "kubetrain-bench"
KUBETRAIN_NS = "kubetrain-system"
KUBETRAIN_SA = "kubetrain"
KUBEFLOW_NS = "kubeflow"  # manifests/overlays/standalone
KUBEFLOW_SA = "training-operator"
KUBEFLOW_CERT_DIR = Path("/tmp/k8s-webhook-server/serving-certs")  # hard-coded in pkg/cert (the Secret's volume mount)
CREATOR_NS = "kubetrain-bench-creator"
CREATOR_SA = "min-creator"
USERS = {cl.KUBETRAIN: f"system:serviceaccount:{KUBETRAIN_NS}:{KUBETRAIN_SA}",
         cl.KUBEFLOW: f"system:serviceaccount:{KUBEFLOW_NS}:{KUBEFLOW_SA}",
         cl.CREATOR: f"system:serviceaccount:{CREATOR_NS}:{CREATOR_SA}"}
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
    policy.write_text(yaml.safe_dump(cl.audit_policy(list(USERS.values()))))
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


def kubeflow_binary() -> tuple[Path, Path, str]:
    """(binary, module dir in GOMODCACHE, version); builds the binary when missing."""
    build = HACK / "kubeflow" / "build.sh"
    binary = Path(subprocess.run([str(build)], check=True, stdout=subprocess.PIPE, text=True).stdout.strip())
    moddir = Path(subprocess.run([str(build), "--module-dir"], check=True, stdout=subprocess.PIPE,
                                 text=True).stdout.strip())
    return binary, moddir, moddir.name.split("@", 1)[1]


def install_kubeflow(admin: client.ApiClient, core: client.CoreV1Api, moddir: Path) -> Path:
    """What manifests/overlays/standalone installs, minus the Deployment, Service and webhook
    configuration: all six CRDs, the ClusterRole/Binding and ServiceAccount in namespace kubeflow,
    and the (empty) webhook-cert Secret that the operator fills in."""
    ensure_namespace(core, KUBEFLOW_NS)
    crd_files = sorted((moddir / "manifests" / "base" / "crds").glob("kubeflow.org_*.yaml"))
    for f in crd_files:  # kubectl: one request per CRD, these are large
        kubectl("apply", "--server-side", "--force-conflicts", f"--field-manager={FIELD_MANAGER}", "-f", str(f),
                timeout=300)
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
    wait_established(admin, [yaml.safe_load(f.read_text())["metadata"]["name"] for f in crd_files], timeout=60)
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
    """Appended to the operator's command line (--kubeflow-args): a tuned run next to the defaults."""

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
        if self.key == cl.KUBEFLOW:
            self._mount_webhook_secret(core)
        wait_for(lambda: self._alive() and http_ok(self.ready_url), 180, interval=0.2,
                 what=f"{self.key} operator ready ({self.ready_url}); log {log}")
        if self.key == cl.KUBEFLOW:  # controllers start after the certificates (cmd/training-operator.v1)
            wait_for(lambda: self._alive() and "Starting workers" in log.read_text(errors="replace")
                     and "pytorchjob" in log.read_text(errors="replace"), 60, interval=0.2,
                     what=f"kubeflow pytorchjob-controller workers; log {log}")
        time.sleep(2.0)  # let both finish their initial LIST/WATCH

    def _alive(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.key} operator exited with {self.proc.returncode}; log {self.log}")
        return True

    def _mount_webhook_secret(self, core: client.CoreV1Api) -> None:
        """What the kubelet does for the Deployment's `cert` volume: the Secret's keys as files in the cert dir.

        The operator's cert rotator fills the Secret, then waits for the files before it starts the
        controllers (pkg/cert, cert-controller's ensureCertsMounted)."""

        def filled() -> dict[str, str] | None:
            self._alive()
            data = core.read_namespaced_secret("training-operator-webhook-cert", KUBEFLOW_NS).data or {}
            return data if "tls.crt" in data and "tls.key" in data else None

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


# --------------------------------------------------------------------------- one run


def create_jobs(admin: client.ApiClient, operator: str, sc: cl.Scenario, ns: str) -> None:
    custom = client.CustomObjectsApi(admin)
    group, version, plural = ((api.GROUP, api.VERSION, api.PLURAL) if operator == cl.KUBETRAIN
                              else ("kubeflow.org", "v1", "pytorchjobs"))

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
    for group, version, plural in ((api.GROUP, api.VERSION, api.PLURAL), ("kubeflow.org", "v1", "pytorchjobs")):
        for item in custom.list_namespaced_custom_object(group, version, ns, plural).get("items", []):
            if item["metadata"].get("finalizers"):
                say(f"removing finalizers {item['metadata']['finalizers']} from {plural}/{item['metadata']['name']}")
                custom.patch_namespaced_custom_object(group, version, ns, plural, item["metadata"]["name"],
                                                      {"metadata": {"finalizers": None}})


def read_audit(offset: int) -> Iterator[bytes]:
    with open(audit_log(), "rb") as f:
        f.seek(offset)
        yield from f


def wait_quiet(user: str, offset: int, since: float, progress: Callable[[], str], quiet: float = QUIET_S,
               limit: float = 300.0) -> float | None:
    """Wait until ``user`` has sent no API request for ``quiet`` seconds (audit log); return the
    epoch time of its last request after ``since`` (None if it sent none)."""
    last: float | None = None
    needle = json.dumps(user).encode()
    deadline = time.monotonic() + limit
    with open(audit_log(), "rb") as f:
        f.seek(offset)
        buf = b""
        while time.monotonic() < deadline:
            buf += f.read()
            lines, _, buf = buf.rpartition(b"\n")
            for line in lines.split(b"\n"):
                if needle in line:
                    with contextlib.suppress(ValueError, KeyError):
                        t = cl.parse_time(json.loads(line)["requestReceivedTimestamp"])
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
    try:
        op.start(log, core, sc, ns)
        assert op.proc is not None
        pid = op.proc.pid
        watch.start()
        n = sc.pods
        watch.expect("created", lambda w: len(w.uid_of) >= n)
        watch.expect("running", lambda w: len(w.running) >= n)

        def progress(phase: str) -> Callable[[], str]:
            def line() -> str:
                with watch.lock:
                    created, running = len(watch.uid_of), len(watch.running)
                la = os.getloadavg()[0]
                return (f"  {sc.name} / {op.key}: {phase} {time.monotonic() - t0:6.1f}s  pods {created}/{n} "
                        f"Running {running}/{n}  load {la:.1f}")
            return line

        res.load_before = os.getloadavg()
        before = proc_stats(pid)
        wall0, t0 = time.time(), time.monotonic()
        op.apply(admin, sc, ns)
        res.apply_s = time.monotonic() - t0
        t_created = watch.wait("created", timeout, progress("creating"))
        t_running = watch.wait("running", max(1.0, t0 + timeout - time.monotonic()), progress("starting"))
        res.pods_created_s = None if t_created is None else t_created - t0
        res.all_running_s = None if t_running is None else t_running - t0
        if sc.fail_one and t_running is not None:
            recover(core, watch, op, sc, ns, res, timeout)
        # The operator may still be working (Services, status, Events): measure until it is quiet.
        last = wait_quiet(USERS[op.key], audit_offset, wall0, progress("settling"))
        res.last_request_s = None if last is None else last - wall0
        after = proc_stats(pid)
        wall1 = time.time()
        res.load_after = os.getloadavg()
        res.cpu_s = after.cpu_s - before.cpu_s
        res.cpu_total_s = after.cpu_s
        res.peak_rss_mb = after.peak_rss_bytes / 2**20
        res.reconciles, res.reconcile_errors = op.reconcile_counts()
    finally:
        watch.stop()
        op.stop()
    if op.summary():
        res.notes.append(op.summary())
    window = count_audit(res, USERS[op.key], audit_offset, wall0, wall1)
    status("")
    say(f"{sc.name} / {op.key}: created {cl.fmt(res.pods_created_s, 1)}s, Running {cl.fmt(res.all_running_s, 1)}s"
        + (f", recovery {cl.fmt(res.recovery_s, 1)}s ({res.pods_replaced} pods created, {res.restarts} restarts)"
           if sc.fail_one else "")
        + f", CPU {res.cpu_s:.1f}s, peak RSS {res.peak_rss_mb:.0f} MB, {res.api_requests} requests "
        f"({window.summary(4)}), reconcile errors {cl.fmt(res.reconcile_errors, 0)}; log {log}")
    delete_namespace(admin, ns)
    return res


def count_audit(res: cl.RunResult, user: str, offset: int, wall0: float, wall1: float) -> cl.RequestCount:
    """The user's API requests into ``res``: in the measurement window [wall0, wall1], and in all."""
    window = cl.count_requests(read_audit(offset), [user], since=wall0, until=wall1)[user]
    total = cl.count_requests(read_audit(offset), [user])[user]
    res.api_requests, res.api_requests_total, res.api_by_verb = window.total, total.total, dict(window.by_verb)
    return window


def recover(core: client.CoreV1Api, watch: PodWatch, op: Operator, sc: cl.Scenario, ns: str,
            res: cl.RunResult, timeout: float) -> None:
    """Fail one worker; time until the set of pods the operator must replace is Running again.

    kubetrain restarts the whole gang (every pod of generation 0 is replaced by generation 1);
    Kubeflow v1 deletes and re-creates only the failed pod (restartPolicy ExitCode, exit 137)."""
    victim = cl.victim_pod(sc)
    with watch.lock:
        victim_uid = watch.uid_of[victim]
        before = set(watch.uid_of.values())
    replaced = before if op.key == cl.KUBETRAIN else {victim_uid}
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
    if t_rec is not None:
        res.recovery_s = t_rec - t_failed
        res.recovery_from_injection_s = t_rec - t_inject
    if op.key == cl.KUBETRAIN:
        res.restarts = TrainingJobs(core.api_client, ns).status(cl.job_name(sc, 0)).get("restartCount")
    else:
        res.restarts = len(before & watch.deleted)
    kwok_log = Path(os.environ["KUBETRAIN_CLUSTER_DIR"]) / "logs" / "kwok.log"
    with open(kwok_log, errors="replace") as f, open(audit_log(), "rb") as a:
        res.kwok_duplicate_deletes = cl.unrequested_deletes(f, ns, cl.delete_requests(a, ns))
    res.notes.append(f"recovery: {gone} old pods gone or failed, {res.pods_replaced} new pods created, "
                     f"{res.restarts} restart(s)")
    if res.kwok_duplicate_deletes:
        res.notes.append(f"kwok deleted {res.kwok_duplicate_deletes} pod(s) nobody asked to delete: re-created "
                         "workers (its pod-delete stage fired twice for the old pod and deletes by name)")


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
    p.add_argument("--operators", default=f"{cl.KUBETRAIN},{cl.KUBEFLOW},{cl.CREATOR}",
                   help=f"comma-separated, run in this order ({cl.CREATOR}: bench/min_creator.py)")
    p.add_argument("--timeout", type=float, default=1200, help="per milestone, seconds")
    p.add_argument("--keep-cluster", action="store_true", help="leave the private cluster running")
    p.add_argument("--json", type=Path, help="write all results here")
    p.add_argument("--kubeflow-args", default="",
                   help="extra flags for Kubeflow's manager, e.g. '--kube-api-qps=500 --kube-api-burst=1000' "
                        "(default: none, as its manifests run it)")
    p.add_argument("--creator-args", default="",
                   help="extra flags for bench/min_creator.py, e.g. '--client aiohttp --concurrency 16'")
    p.add_argument("--cluster-dir", default=os.environ.get("KUBETRAIN_BENCH_CLUSTER_DIR",
                                                           str(cache_dir() / "bench-cluster")))
    p.add_argument("--apiserver-port", type=int, default=int(os.environ.get("KUBETRAIN_BENCH_APISERVER_PORT", 26443)))
    p.add_argument("--etcd-port", type=int, default=int(os.environ.get("KUBETRAIN_BENCH_ETCD_PORT", 33790)))
    return p.parse_args()


def install_operators(admin: client.ApiClient, args: argparse.Namespace, operators: list[str],
                      kubeflow: tuple[Path, Path, str] | None) -> dict[str, Operator]:
    """Each operator's CRDs and RBAC, and the identity (kubeconfig) it runs as."""
    core = client.CoreV1Api(admin)
    ops: dict[str, Operator] = {}
    if cl.KUBETRAIN in operators:
        ops[cl.KUBETRAIN] = Operator(cl.KUBETRAIN, install_kubetrain(admin, core))
    if kubeflow is not None:
        binary, moddir, _ = kubeflow
        ops[cl.KUBEFLOW] = Operator(cl.KUBEFLOW, install_kubeflow(admin, core, moddir), binary=binary,
                                    extra_args=shlex.split(args.kubeflow_args))
    if cl.CREATOR in operators:
        ops[cl.CREATOR] = Creator(cl.CREATOR, install_creator(admin, core), extra_args=shlex.split(args.creator_args))
    return ops


def run_all(args: argparse.Namespace, scenarios: list[cl.Scenario], operators: list[str], nodes: int,
            kubeflow: tuple[Path, Path, str] | None) -> list[cl.RunResult]:
    """Every scenario with every operator on a private cluster, stopped at the end (unless --keep-cluster)."""
    start_cluster(nodes)
    results: list[cl.RunResult] = []
    try:
        admin = new_admin_client()
        ops = install_operators(admin, args, operators, kubeflow)
        for sc in scenarios:
            say(f"scenario {sc.name}: {sc.describe()} on {nodes} nodes x 8 GPUs")
            for key in operators:
                if key == cl.CREATOR and sc.fail_one:  # nothing of its own would replace the failed pod
                    results.append(cl.RunResult(cl.CREATOR, sc.name, sc.pods, skipped=cl.NO_CONTROLLER))
                    continue
                results.append(run_one(admin, ops[key], sc, args.timeout))
    finally:
        if not args.keep_cluster and cluster_running():
            say("stopping the private cluster")
            run_hack("cluster-down.sh", check=False)
    return results


def report(title: str, scenarios: list[cl.Scenario], results: list[cl.RunResult]) -> None:
    print(f"\n{title}\n")
    print(cl.table(scenarios, results))
    print()
    for r in results:
        if r.skipped:
            print(f"- {r.scenario} / {r.operator}: {r.skipped}")
            continue
        verbs = ", ".join(f"{k} {v}" for k, v in sorted(r.api_by_verb.items(), key=lambda kv: -kv[1])[:8])
        notes = "; ".join(r.notes)
        print(f"- {r.scenario} / {r.operator}: load {cl.load_str(r.load_before)} -> {cl.load_str(r.load_after)}; "
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

    kubeflow = kubeflow_binary() if cl.KUBEFLOW in operators else None
    kf_version = "-" if kubeflow is None else kubeflow[2]
    if kubeflow is not None:
        cl.OPERATOR_TITLES[cl.KUBEFLOW] = f"Kubeflow {kf_version}"
        if args.kubeflow_args:
            kf_version += f" ({args.kubeflow_args})"
    say(f"machine: {machine()}; load average {cl.load_str(os.getloadavg())}")
    results = run_all(args, scenarios, operators, nodes, kubeflow)
    creator = f" and the minimal creator ({args.creator_args or 'defaults'})" if cl.CREATOR in operators else ""
    title = (f"kubetrain {git_rev()} vs Kubeflow Training Operator {kf_version}{creator}; Kubernetes "
             f"{pinned_kubernetes_version()} (hack/), {nodes} kwok nodes x 8 nvidia.com/gpu; {machine()}")
    report(title, scenarios, results)
    if args.json:
        args.json.write_text(json.dumps({"title": title, "results": [r.to_json() for r in results]}, indent=1))
    return 0


def git_rev() -> str:
    out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "?"


if __name__ == "__main__":
    sys.exit(main())
