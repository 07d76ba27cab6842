"""Helpers for tests on the test cluster's real node: real pods of the images `make images` built.

The real node (hack/real-node.sh) runs kubelet + containerd on this machine. Pods of a namespace
without the kwok routing annotations (KWOK_NAMESPACE_ANNOTATIONS) land there; the trainer and
operator images are the chart's defaults, loaded into the node's containerd by hack/images.sh.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from kubetrain.core import contract
from kubetrain.operator.jobs.builders import WorkerSettings, merge

from . import objectstore
from .cluster import cluster_dir, kubeconfig_path
from .jobs import StatusCheck, TrainingJobs
from .kubectl import kubectl_binary
from .paths import HACK_DIR, QUICKSTART
from .waiting import wait_for

NODE_NAME = "kubetrain-node"
NODE_IP = "10.88.0.1"
"""The real node's bridge address (hack/lib.sh), where pods reach the host services."""
EXTRA_NODE = "kubetrain-node-2"
"""The second real node, in a network namespace of its own (hack/real-node.sh); a pod lands there only
with EXTRA_NODE_TOLERATION."""
EXTRA_NODE_TOLERATION = {"key": "kubetrain.io/node-pool", "operator": "Equal", "value": "extra", "effect": "NoSchedule"}
TRAINER_IMAGE = WorkerSettings().trainer_image  # the chart's default, the name hack/images.sh loads
REGISTRY = subprocess.run([str(HACK_DIR / "images.sh"), "registry"], capture_output=True, text=True,
                          check=True).stdout.strip()
"""The test cluster's image registry as the node reaches it (hack/registry.sh)."""


def real_node_missing(core: client.CoreV1Api) -> str | None:
    """Why the cluster has no Ready real node, or None."""
    try:
        node = core.read_node(NODE_NAME)
    except client.ApiException as exc:
        if exc.status == 404:
            return "the test cluster has no real node (hack/real-node.sh check says why)"
        raise
    ready = [c.status for c in node.status.conditions or [] if c.type == "Ready"]
    return None if ready == ["True"] else f"node {NODE_NAME} is not Ready"


def build_images() -> None:
    """hack/images.sh: builds what changed and loads it into the node (a no-op when up to date).

    Its own lines (each step with its time, every 30 s while one runs or while it waits for hack/prebuild.sh's
    build) go to stderr as they come; buildah's and pip's output only into the failure message.
    A second try follows a failed one: a build fetches from PyPI, and its cached layers make the
    retry cheap. The failure message ends with the script's own last lines and the free disk,
    since CI logs keep only the end of a long build log.
    """
    tails = []
    for _ in range(2):
        rc, tail = _run_showing_steps(["bash", str(HACK_DIR / "images.sh")], timeout=3600)
        if rc == 0:
            return
        tails.append(tail)
    disk = subprocess.run(["df", "-h", str(HACK_DIR), "/var/lib"], stdout=subprocess.PIPE, text=True,
                          check=False).stdout
    raise AssertionError(f"hack/images.sh exited {rc} twice; first try ended:\n{tails[0]}\n"
                         f"second try ended:\n{tails[1]}\nfree disk:\n{disk}")


STEP_LINE = re.compile(r"^\[\d\d:\d\d:\d\d\] ")
"""How a hack/ script's own log lines begin (lib.sh `log`)."""


def _run_showing_steps(cmd: list[str], timeout: float) -> tuple[int, str]:
    """Run cmd; echo its lib.sh log lines to stderr as they come; its exit code and its last 4000 characters."""
    kept: collections.deque[str] = collections.deque(maxlen=400)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        watchdog = threading.Timer(timeout, proc.kill)
        watchdog.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                kept.append(line)
                if STEP_LINE.match(line):
                    sys.stderr.write(line)
                    sys.stderr.flush()
            rc = proc.wait()
        finally:
            watchdog.cancel()
    return rc, "".join(kept)[-4000:]


def quickstart(**overrides: Any) -> dict[str, Any]:
    """examples/quickstart.yaml with `overrides` deep-merged into its spec."""
    body = yaml.safe_load(QUICKSTART.read_text())
    body["spec"] = merge(body["spec"], overrides)
    return body


class RealJobs(TrainingJobs):
    """TrainingJobs in one namespace whose pods run on the real node."""

    def create(self, body: dict[str, Any], name: str | None = None) -> str:
        body = json.loads(json.dumps(body))
        if name:
            body["metadata"]["name"] = name
        self.submit(body)
        return str(body["metadata"]["name"])

    def wait(self, name: str, pred: StatusCheck, timeout: float, what: str) -> dict[str, Any]:
        """The status once ``pred`` holds; a job that Failed meanwhile fails at once (unless awaited)."""

        def check(st: dict[str, Any]) -> Any:
            if st.get("phase") == "Failed" and "Failed" not in what:
                raise AssertionError(f"{name} Failed: {st.get('reason')}: {st.get('message')}")
            return pred(st)

        return self.wait_status(name, check, timeout, f"{name}: {what}", interval=0.5)

    def wait_phase(self, name: str, phase: str, timeout: float = 600) -> dict[str, Any]:
        return self.wait(name, lambda st: st.get("phase") == phase, timeout, f"phase {phase}")

    def log(self, pod: str, tail: int | None = None, previous: bool = False) -> str:
        """The pod's container log (`previous`: of its container before the kubelet restarted it). Read again
        (up to 5 s) while it comes back empty: the kubelet once answered '' for a container that had just
        finished and had written lines."""
        for _ in range(6):
            try:
                text = str(self.core.read_namespaced_pod_log(pod, self.ns, tail_lines=tail, previous=previous))
            except client.ApiException as exc:
                return f"(no log for {pod}: {exc.status} {exc.reason})"
            if text:
                return text
            time.sleep(1)
        return text

    def explain(self, name: str) -> str:
        return self.describe(name)

    def headline(self, name: str) -> str:
        return _headline(self.status(name), self.pods(name))

    def describe(self, name: str) -> str:
        """Status, the job's Events, pods and the tail of each pod's log, and the operator's log tail, for
        assertion messages: a restart's cause is in the Events and the operator's log, since the pods of the
        generation that failed are gone."""
        st, pods = self.status(name), self.pods(name)
        lines = [_headline(st, pods), f"status: {json.dumps(st, indent=1)[:3000]}", "--- events"]
        events = sorted(self.events(name), key=lambda e: e.metadata.creation_timestamp)
        lines += [f"{e.metadata.creation_timestamp:%H:%M:%S} {e.type} {e.reason}: {e.message}" for e in events]
        for p in pods:
            lines.append(f"--- pod {p.metadata.name} phase={p.status.phase} node={p.spec.node_name}")
            lines += [_container_line(c) for c in p.status.container_statuses or []]
            lines.append(self.log(p.metadata.name, tail=25) or "(its log is empty)")
            if any(c.restart_count for c in p.status.container_statuses or []):
                lines += ["--- its container before the restart", self.log(p.metadata.name, tail=25, previous=True)]
        if self.op:
            lines += ["--- operator log", self.op.tail()]
        return "\n".join(lines)


def _headline(st: dict[str, Any], pods: list[Any]) -> str:
    """One line with what a failed real-pod test usually turns on: a CI summary shows only a message's first."""
    keys = ("phase", "restartCount", "resumedFrom", "resumedFromStep", "currentStep", "failures", "reason")
    fields = " ".join(f"{k}={json.dumps(st.get(k))}" for k in keys if st.get(k) is not None)
    workers = "; ".join(f"{p.metadata.name.rsplit('-', 1)[-1]} {p.status.phase}: "
                        + ", ".join(_container_line(c) for c in p.status.container_statuses or []) for p in pods)
    return f"{fields} | {workers} | {str(st.get('message') or '')[:300]}"


def _container_line(c: Any) -> str:
    """A container's restarts and how it ended (now, or before its last restart)."""
    ended = c.state.terminated or (c.last_state.terminated if c.last_state else None)
    at = f" at {ended.finished_at:%H:%M:%S}" if ended and ended.finished_at else ""
    how = f", exit {ended.exit_code} ({ended.reason}){at}" if ended else ""
    now = "terminated" if c.state.terminated else "running" if c.state.running else "waiting"
    return f"container {c.name}: {now}, {c.restart_count} restart(s){how}"


def one_per_real_node(labels: dict[str, str], required: bool = True) -> dict[str, Any]:
    """Pod spec fields (nodeSelector, tolerations, affinity) placing the pods with `labels` on the real nodes, one
    per node: a required anti-affinity (`required`), or a preferred one, which lets a lost node's pod move onto
    a node that runs another."""
    term = {"labelSelector": {"matchLabels": labels}, "topologyKey": "kubernetes.io/hostname"}
    anti = ({"requiredDuringSchedulingIgnoredDuringExecution": [term]} if required else
            {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": term}]})
    return {"nodeSelector": {"kubetrain.io/node": "real"}, "tolerations": [EXTRA_NODE_TOLERATION],
            "affinity": {"podAntiAffinity": anti}}


def across_nodes(body: dict[str, Any], required: bool = True) -> dict[str, Any]:
    """`body` with its workers on the real nodes, one per node (one_per_real_node on the job's label)."""
    scheduling = one_per_real_node({contract.LABEL_JOB: body["metadata"]["name"]}, required)
    return {**body, "spec": merge(body["spec"], {"scheduling": scheduling})}


def chaos(fault: str, node: str, *args: str) -> None:
    """hack/chaos.sh: a real node's fault (freeze-node, kill-node, partition-node, slow-node) or its undoing."""
    proc = subprocess.run(["bash", str(HACK_DIR / "chaos.sh"), fault, node, *args], timeout=120,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, f"hack/chaos.sh {fault} {node} exited {proc.returncode}: {proc.stderr}"


def node_suffix(node: str) -> str:
    """What hack/lib.sh's node_suffix appends to a real node's directories: "" for node 1, "-k" for node k."""
    return "" if node == NODE_NAME else f"-{node.rsplit('-', 1)[1]}"


def pod_logs_dir(node: str) -> Path:
    """Where a real node's kubelet keeps its pods' container logs (<ns>_<pod>_<uid>/<container>/N.log): node 1 in
    the default /var/log/pods, node k in its own root (hack/real-node.sh: a kubelet deletes what it does not run)."""
    if node == NODE_NAME:
        return Path("/var/log/pods")
    base = Path(os.environ.get("KUBETRAIN_NODE_ROOT", "/var/lib/kubetrain-node"))
    return base.parent / f"{base.name}{node_suffix(node)}" / "pod-logs"


def kubelet_pid(node: str = NODE_NAME) -> int:
    """A real node's kubelet (hack/real-node.sh keeps its pid beside the node's configuration: node/, node-2/...)."""
    return int((cluster_dir() / f"node{node_suffix(node)}" / "kubelet.pid").read_text())


LEASE_FRESH_SECONDS = 11.0
"""A kubelet renews its Lease every 10 s."""


def node_healthy(core: client.CoreV1Api, node: str) -> bool:
    """Ready, without the taints the node lifecycle controller put on it while it was away (they go a moment
    after Ready: a pod scheduled before would avoid the node), and its Lease renewed since it came back (a node
    frozen for less than the node lifecycle controller's grace never went NotReady, and the operator keeps the
    pods of new jobs off it until its kubelet speaks again)."""
    taints = {t.key for t in core.read_node(node).spec.taints or []}
    lease = client.CoordinationV1Api(core.api_client).read_namespaced_lease(node, "kube-node-lease")
    renewed = lease.spec.renew_time
    fresh = renewed is not None and (datetime.now(UTC) - renewed).total_seconds() < LEASE_FRESH_SECONDS
    return fresh and node_ready(core, node) and not any(t.startswith("node.kubernetes.io/") for t in taints)


def node_ready(core: client.CoreV1Api, name: str = NODE_NAME) -> bool:
    conditions = core.read_node(name).status.conditions or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


def progress_step(core: client.CoreV1Api, namespace: str, job: str) -> int:
    """The step rank 0 reported last, read from worker 0's annotation (the job's status takes progress alone at
    most every 30 s)."""
    try:
        pod = core.read_namespaced_pod(f"{job}-worker-0", namespace)
    except client.ApiException as exc:
        if exc.status == 404:  # not created yet, or between generations
            return 0
        raise
    raw = (pod.metadata.annotations or {}).get(contract.PROGRESS_ANNOTATION)
    return int(json.loads(raw)["step"]) if raw else 0


def wait_step(jobs: RealJobs, name: str, step: int, timeout: float = 300) -> dict[str, Any]:
    """Until the job's last complete checkpoint is at `step` or later."""
    return jobs.wait(name, lambda st: ((st.get("lastCheckpoint") or {}).get("step") or 0) >= step, timeout,
                     f"a checkpoint at step >= {step}")


POD_CGROUPS = tuple(f"/sys/fs/cgroup/{hierarchy}{root}kubepods/{qos}pod{{uid}}" for hierarchy in ("{controller}/", "")
                    for root in ("", "kubetrain-node-*/") for qos in ("", "*/"))
"""Where a real node's kubelet (cgroupfs driver, hack/real-node.sh) puts a pod's cgroup: v1's hierarchy of the
controller, or v2's one hierarchy; under node k's own root (kubetrain-node-K) for the nodes after the first."""


def throttle_pod_cpu(uid: str, cores: float | None, timeout: float = 60) -> Path:
    """Cap a real-node pod at `cores` CPUs (None: lift the cap) through its pod cgroup (found by the pod's UID,
    as soon as the kubelet makes it, before its containers start): cgroup v1 cpu.cfs_quota_us, or v2 cpu.max.
    Its containers' cgroups sit below it, so the cap holds for all of them. The cgroup's directory."""
    where = wait_for(lambda: pod_cgroup(uid), timeout, interval=0.05, what=f"the cgroup of pod {uid}")
    period = 100_000
    quota = int(cores * period) if cores is not None else None
    if (where / "cpu.max").exists():
        (where / "cpu.max").write_text(f"{'max' if quota is None else quota} {period}\n")
    else:
        (where / "cpu.cfs_period_us").write_text(f"{period}\n")
        (where / "cpu.cfs_quota_us").write_text(f"{-1 if quota is None else quota}\n")
    return where


def pod_cgroup(uid: str, controller: str = "cpu") -> Path | None:
    return next((Path(p) for pattern in POD_CGROUPS
                 for p in glob.glob(pattern.format(controller=controller, uid=uid))), None)


def pod_memory_peak(uid: str) -> int | None:
    """The most memory the pod's cgroup (all its containers) has held so far, in bytes: v1's
    memory.max_usage_in_bytes or v2's memory.peak (None before the cgroup exists and once it is gone)."""
    where = pod_cgroup(uid, "memory")
    for path in [where / "memory.max_usage_in_bytes", where / "memory.peak"] if where else []:
        try:
            return int(path.read_text())
        except FileNotFoundError:
            continue  # the other cgroup version's file
        except (OSError, ValueError):
            return None
    return None


def cmdline(pid: int) -> str:
    """A host process's command line, arguments joined by spaces ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def parent_pid(pid: int) -> int:
    """A host process's parent (0 once it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def trainer_ranks(uid: str) -> list[int]:
    """The host PIDs of a real-node pod's trainer ranks: the `kubetrain.trainer` processes whose parent is one
    too (the launcher), found through the pod's cgroup."""
    where = pod_cgroup(uid)
    pids = {int(x) for f in (where.rglob("cgroup.procs") if where else []) for x in f.read_text().split()}
    trainers = {p for p in pids if "kubetrain.trainer" in cmdline(p)}
    return sorted(p for p in trainers if parent_pid(p) in trainers)


def rank_beat(pid: int, rank: int) -> Path | None:
    """A real-node rank's heartbeat file, seen from the host through the process's root (None until the rank
    wrote its first). /var/run is a link to /run in the image, which the host would resolve against its own root."""
    for out in (f"/proc/{pid}/root{contract.OUTPUT_MOUNT}", f"/proc/{pid}/root/run/kubetrain"):
        beat = Path(out, "hang-watch", "beats", f"rank-{rank}.beat")
        if beat.is_file():
            return beat
    return None


def claim_dir(core: client.CoreV1Api, namespace: str, claim: str) -> Path:
    """Where a bound claim's volume lies on the real node (the local-path provisioner's hostPath)."""
    pv = core.read_persistent_volume(core.read_namespaced_persistent_volume_claim(claim, namespace).spec.volume_name)
    return Path((pv.spec.host_path or pv.spec.local).path)


def elapsed(since: float) -> float:
    return round(time.monotonic() - since, 1)


def pod_monitor_targets(pod_monitor: dict[str, Any], core: client.CoreV1Api, namespace: str) -> list[dict[str, Any]]:
    """Prometheus file_sd target groups for what the chart's PodMonitor selects, the way the Prometheus
    Operator's pod discovery does (Debian's Prometheus is built without Kubernetes discovery): running
    pods with its matchLabels, at their pod IP and the container port it names, with its relabelings
    (`__meta_kubernetes_pod_label_X` -> the pod's label X), the pod's namespace and its jobLabel."""
    spec = pod_monitor["spec"]
    endpoint = spec["podMetricsEndpoints"][0]
    selector = ",".join(f"{k}={v}" for k, v in spec["selector"]["matchLabels"].items())
    groups = []
    for pod in core.list_namespaced_pod(namespace, label_selector=selector).items:
        ports = [p.container_port for c in pod.spec.containers for p in c.ports or [] if p.name == endpoint["port"]]
        if pod.status.phase != "Running" or not pod.status.pod_ip or not ports:
            continue
        labels = {r["targetLabel"]: pod.metadata.labels[_label_key(r["sourceLabels"][0], pod.metadata.labels)]
                  for r in endpoint.get("relabelings", [])}
        labels["namespace"] = namespace
        if spec.get("jobLabel"):  # the Prometheus Operator's job label: the pod's label of that name
            labels["job"] = pod.metadata.labels[spec["jobLabel"]]
        groups.append({"targets": [f"{pod.status.pod_ip}:{ports[0]}"], "labels": labels})
    return groups


def _label_key(meta_label: str, labels: dict[str, str]) -> str:
    """The pod label a `__meta_kubernetes_pod_label_<sanitized>` source names."""
    want = meta_label.removeprefix("__meta_kubernetes_pod_label_")
    return next(k for k in labels if "".join(c if c.isalnum() else "_" for c in k) == want)


@contextlib.contextmanager
def cluster_bucket(fs: Any, prefix: str) -> Iterator[str]:
    """A new bucket on the test cluster's object store, deleted with its objects afterwards (the store is the
    cluster's, shared by every test and run)."""
    bucket = f"{prefix}-{uuid.uuid4().hex[:12]}"
    objectstore.create_bucket(fs, bucket)
    try:
        yield bucket
    finally:
        fs.rm(bucket, recursive=True)


def store_secret(namespace: str, secret: str = "kubetrain-s3") -> str:
    """The Secret manifest (YAML) with the test cluster's object store keys, endpoint and region."""
    return subprocess.run([str(HACK_DIR / "objectstore.sh"), "secret", secret, namespace], capture_output=True,
                          text=True, check=True).stdout


def store_keys(namespace: str) -> dict[str, str]:
    """The store's AWS_* variables (keys, endpoint as pods reach it, region), for a process on this machine."""
    return {k: v for k, v in yaml.safe_load(store_secret(namespace))["stringData"].items() if k.startswith("AWS_")}


def cluster_object_store(namespace: str, secret: str = "kubetrain-s3") -> tuple[str, Any]:
    """The test cluster's object store (hack/objectstore.sh, started by cluster-up): its endpoint as pods reach it,
    and an s3fs client for the test on loopback. The store's keys go into `secret` in `namespace`."""
    manifest = store_secret(namespace, secret)
    subprocess.run([str(kubectl_binary()), "--kubeconfig", str(kubeconfig_path()), "apply", "-f", "-"],
                   input=manifest, capture_output=True, text=True, check=True)
    return object_store(manifest)


def object_store(manifest: str | None = None) -> tuple[str, Any]:
    """The test cluster's object store: its endpoint as pods reach it, and an s3fs client on loopback."""
    import s3fs  # noqa: PLC0415 - only the object-store tests need it

    keys = yaml.safe_load(manifest or store_secret("default"))["stringData"]
    fs = s3fs.S3FileSystem(key=keys["AWS_ACCESS_KEY_ID"], secret=keys["AWS_SECRET_ACCESS_KEY"],
                           endpoint_url=keys["AWS_ENDPOINT_URL"].replace(NODE_IP, "127.0.0.1"),
                           client_kwargs={"region_name": keys["AWS_REGION"]}, use_listings_cache=False)
    return keys["AWS_ENDPOINT_URL"], fs
