"""Goodput under a fault campaign on real pods: kubetrain vs Kubeflow Trainer v2 on JobSet, same image, same
trainer, same faults.

    .venv/bin/python bench/goodput.py --json bench/results/goodput-$(date +%F).json       # both, 10 min each
    .venv/bin/python bench/goodput.py --system kubetrain --minutes 3 --every 40             # a short run
    .venv/bin/python bench/goodput.py --system trainer-v2 --max-steps 600 --faults kill,oom # no calibration

One job of the trainer image (2 workers, the quickstart: examples/quickstart.yaml) on the hack/ test cluster's real
nodes, with maxSteps sized so that undisturbed training lasts --minutes (a short kubetrain calibration run measures
the time per step, checkpoints included; --max-steps skips it), checkpoints every 20 steps as the quickstart has,
on a claim of the cluster's default StorageClass. A seeded schedule (--seed) applies one fault of each kind
(--faults) about every --every seconds after the job's creation, in a seeded order, each on a seeded worker at a
seeded step between two checkpoints, and only while the job trains: rank 0 stepping in a process started after the
previous fault (a fault that comes due while the job restarts waits, the delay is recorded; faults overdue after a
long recovery then come one after another, each once training is back): a container killed (SIGKILL of its main process from the host: exit 137), a pod deleted
(grace 0), a rank hung (SIGSTOP of one rank's python process from the host), an OOM kill (the container's memory
cgroup limit lowered from the host until the kernel OOM-kills in it: the pod shows OOMKilled), a preemption
(Eviction API: SIGTERM, the trainer checkpoints at the next step and exits 143), and two node faults on the second
real node, whichever worker runs there (hack/chaos.sh: `freeze-node`, its kubelet, containerd and pods' processes
SIGSTOPped; `kill-node`, all of them SIGKILLed), each undone NODE_DOWN_S (90 s) later, as a node back from a
reboot. Both systems place one worker per real node (a preferred pod anti-affinity, the second node's taint
tolerated), so a lost node's worker may join the other node; the schedule puts a fault that recreates a pod
(delete, evict) between the two node faults, applied once the second node is Ready again, which puts a worker
back there. --undisturbed first runs kubetrain's job with no faults, the same maxSteps, as a results entry of
its own.

Goodput = kept step time / wall time, from the trainer's own records (bench/goodput_lib.py): rank 0's TensorBoard
event per step on the claim, read from the host. Kept step time sums the durations of the final lineage's steps
(per step number, its last execution); wall time runs from the job's creation to its success as the bench's
status poll sees it. Also: restarts, steps redone, and per fault the recovery time (the fault to the first step of
the rank-0 process that trained on after it) and the steps it cost, with the job's own accounts as a cross-check
(kubetrain's status.goodput, JobSet's status.restarts). `--faults ''` runs the same job undisturbed (the baseline).
Every pod's container logs are copied as they grow into /tmp/kubetrain-bench-goodput/<namespace>/, the
controllers' logs beside them; --report FILE prints the table again from a --json file's raw step records.

kubetrain: this checkout's operator (one namespace), restartPolicy backoffLimit 20, backoffSeconds --backoff-seconds
(0: JobSet restarts without a delay too), everything else the quickstart's and the defaults (in-place restarts,
hang detection, the memory checkpoint tier). Trainer v2: the controllers that bench/compare.py builds and runs (hack/trainer-v2/build.sh,
--jobset), a namespaced TrainingRuntime made from the upstream torch-distributed one (JobSet failurePolicy
maxRestarts 20 restarting the whole gang, backoffLimit 0, pods restartPolicy Never, the same volumes: the trainer
config as a ConfigMap, the claim, /dev/shm), and a TrainJob of 2 nodes x 1 process running `python -m torch.distributed.run -m
kubetrain.trainer` (torchrun: the PET_* variables Trainer v2 sets are its arguments), collective timeout
--peer-collective-timeout (600 s, PyTorch's default: Trainer v2 has no hang detection, so a hung rank costs it).
See docs/benchmarks.md, "Goodput under a fault campaign".
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import date
from functools import partial
from pathlib import Path
from typing import Any

import compare
import compare_lib as cl
import goodput_lib as gl
import yaml
from in_place import apply_crd
from kubernetes import client, config
from support.cluster import cluster_dir, cluster_running, cluster_up, kubeconfig_path  # bench/support: tests/support
from support.operator_process import OperatorProcess
from support.real_pods import (
    EXTRA_NODE,
    TRAINER_IMAGE,
    RealJobs,
    across_nodes,
    build_images,
    chaos,
    claim_dir,
    cmdline,
    node_healthy,
    one_per_real_node,
    parent_pid,
    pod_cgroup,
    quickstart,
    real_node_missing,
    trainer_ranks,
)
from support.resources import delete, wait_default_service_account
from support.waiting import wait_for

from kubetrain.core import contract

WORKERS = 2
JOB = "goodput"
CLAIM = "checkpoints"
"""Trainer v2's claim (kubetrain's is the operator's default claim, `<job>-checkpoints`)."""
CONFIG_MAP = "goodput-trainer-config"
RUNTIME = "kubetrain-goodput"
MAX_RESTARTS = 20
"""kubetrain's backoffLimit and JobSet's failurePolicy.maxRestarts: far more than the campaign's faults."""
TORCHRUN = ["python", "-m", "torch.distributed.run", "-m", "kubetrain.trainer"]
"""The image's venv python: the base image's `torchrun` script would start the system python, which lacks kubetrain."""
LOG_DIR = Path("/tmp/kubetrain-bench-goodput")
STATUS_EVERY_S = 0.5
PROGRESS_EVERY_S = 30.0
FRESH_S = 3.0
"""The job trains when rank 0's newest step is at most this old."""
RECOVERY_WAIT_S = 60.0
"""A fault is applied once rank 0 trains in a process started after the previous fault, or this long after it."""
OUTCOME_WATCH_S = {gl.HANG: 120.0, gl.FREEZE_NODE: 150.0, gl.KILL_NODE: 150.0}
"""How long the pod is watched after a fault for what it shows (default 45 s)."""
NODE_DOWN_S = 90.0
"""A node fault is undone this long after it (a node back from a reboot), the node then Ready again."""
UNDO = {gl.FREEZE_NODE: "thaw-node", gl.KILL_NODE: "restore-node"}


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the trainer's records on the claim


class Records:
    """Rank 0's TensorBoard event files under a claim's `tensorboard/`, read from the host as they grow."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory / contract.TENSORBOARD_DIR
        self.offsets: dict[str, int] = {}
        self.events: dict[str, list[gl.Event]] = {}
        self.latest: gl.Event | None = None
        self.latest_file = ""

    def poll(self) -> None:
        for path in sorted(self.dir.glob("events.out.tfevents.*")) if self.dir.is_dir() else []:
            offset = self.offsets.get(path.name, 0)
            with path.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
            datas, used = gl.records(chunk)
            self.offsets[path.name] = offset + used
            for data in datas:
                ev = gl.parse_event(data)
                self.events.setdefault(path.name, []).append(ev)
                if ev.file_version is None and (self.latest is None or ev.wall >= self.latest.wall):
                    self.latest, self.latest_file = ev, path.name

    def started(self, name: str) -> float:
        """When the process that writes this file opened it (its first record)."""
        return self.events[name][0].wall

    def steps_in(self, name: str) -> int:
        return sum(1 for e in self.events.get(name, []) if e.file_version is None)


class PodLogs:
    """Copies of the kubelet's container logs of a namespace's pods (<podLogsDir>/<ns>_<pod>_<uid>/: every
    container start of a pod), refreshed as they grow, into LOG_DIR/<ns>/: the kubelet deletes them with the pod.
    Node 1's kubelet writes them under /var/log/pods, node k's (hack/real-node.sh) under its own root."""

    def __init__(self, ns: str) -> None:
        self.ns, self.out = ns, LOG_DIR / ns
        self.sizes: dict[Path, int] = {}
        base = Path(os.environ.get("KUBETRAIN_NODE_ROOT", "/var/lib/kubetrain-node"))
        self.roots = (Path("/var/log/pods"), *sorted(base.parent.glob(f"{base.name}-*/pod-logs")))

    def copy(self) -> None:
        for root in self.roots:
            self._copy(root)

    def _copy(self, root: Path) -> None:
        for path in root.glob(f"{self.ns}_*/*/*.log"):
            with contextlib.suppress(OSError):
                size = path.stat().st_size
                if self.sizes.get(path) != size:
                    target = self.out / path.relative_to(root)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(path.read_bytes())
                    self.sizes[path] = size


# --------------------------------------------------------------------------- the two systems


@dataclass
class System:
    """One job of one system in its namespace: create it, its phase, its worker pods, its restarts."""

    key: str
    admin: client.ApiClient
    ns: str
    core: client.CoreV1Api = field(init=False)
    custom: client.CustomObjectsApi = field(init=False)

    def __post_init__(self) -> None:
        self.core, self.custom = client.CoreV1Api(self.admin), client.CustomObjectsApi(self.admin)

    def create(self, spec: dict[str, Any]) -> None:
        raise NotImplementedError

    def phase(self) -> tuple[str, str]:
        """(Running | Succeeded | Failed | ..., why)."""
        raise NotImplementedError

    def worker_pods(self) -> dict[int, client.V1Pod]:
        """The live (not deleting) worker pods by index."""
        raise NotImplementedError

    def restarts(self) -> int | None:
        raise NotImplementedError

    def cross_check(self, wall: float) -> dict[str, Any]:
        return {}

    def _pods(self, selector: str, index_label: str) -> dict[int, client.V1Pod]:
        out = {}
        for p in self.core.list_namespaced_pod(self.ns, label_selector=selector).items:
            index = (p.metadata.labels or {}).get(index_label)
            if index is not None and not p.metadata.deletion_timestamp:
                out[int(index)] = p
        return out


class Kubetrain(System):
    def create(self, spec: dict[str, Any]) -> None:
        RealJobs(self.admin, self.ns).create({**quickstart(), "spec": spec}, name=JOB)

    def status(self) -> dict[str, Any]:
        return RealJobs(self.admin, self.ns).status(JOB)

    def phase(self) -> tuple[str, str]:
        st = self.status()
        return st.get("phase") or "Pending", f"{st.get('reason', '')}: {st.get('message', '')}"

    def worker_pods(self) -> dict[int, client.V1Pod]:
        return self._pods(f"{contract.LABEL_JOB}={JOB}", contract.LABEL_INDEX)

    def restarts(self) -> int | None:
        return self.status().get("restartCount", 0)

    def cross_check(self, wall: float) -> dict[str, Any]:
        """The job's own account: status.goodput (productive = between consecutive steps of one generation, less
        the steps redone after restarts: what this bench counts as kept step intervals), the failures it counted,
        the resume point."""
        st = self.status()
        g = st.get("goodput") or {}
        productive = g.get("productiveSeconds", 0.0)
        return {"status.goodput": g, "status.failures": st.get("failures"), "status.restartCount": st.get("restartCount"),
                "status.lastHang": (st.get("lastHang") or {}).get("message"),
                "productive_share_of_wall": round(productive / wall, 4) if wall > 0 else None}


class TrainerV2(System):
    JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"
    INDEX_LABEL = "batch.kubernetes.io/job-completion-index"

    def create(self, spec: dict[str, Any]) -> None:
        self.core.create_namespaced_config_map(self.ns, client.V1ConfigMap(
            metadata=client.V1ObjectMeta(name=CONFIG_MAP), data={"config.json": json.dumps(spec, indent=1)}))
        self.custom.create_namespaced_custom_object("trainer.kubeflow.org", "v1alpha1", self.ns, "trainjobs",
                                                    trainjob(self.ns, spec))

    def phase(self) -> tuple[str, str]:
        tj = self.custom.get_namespaced_custom_object("trainer.kubeflow.org", "v1alpha1", self.ns, "trainjobs", JOB)
        for c in (tj.get("status") or {}).get("conditions") or []:
            if c.get("status") == "True" and c.get("type") in ("Complete", "Failed"):
                return ("Succeeded" if c["type"] == "Complete" else "Failed"), f"{c.get('reason')}: {c.get('message')}"
        return "Running", ""

    def worker_pods(self) -> dict[int, client.V1Pod]:
        return self._pods(f"{self.JOBSET_LABEL}={JOB}", self.INDEX_LABEL)

    def jobset(self) -> dict[str, Any]:
        """The TrainJob's JobSet ({} until the Trainer has made it)."""
        try:
            return dict(self.custom.get_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", self.ns, "jobsets", JOB))
        except client.ApiException as exc:
            if exc.status == 404:
                return {}
            raise

    def restarts(self) -> int | None:
        return (self.jobset().get("status") or {}).get("restarts", 0)

    def cross_check(self, wall: float) -> dict[str, Any]:
        st = self.jobset().get("status") or {}
        return {"jobset.status.restarts": st.get("restarts"), "jobset.status.conditions":
                [(c.get("type"), c.get("status"), c.get("reason")) for c in st.get("conditions") or []]}


def trainer_env(ns: str, collective_timeout: float) -> list[dict[str, str]]:
    """kubetrain's trainer's own variables (contract.kubetrain_env's, less the operator's): where its config,
    claim and output are, and the collective timeout. torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT."""
    return [{"name": k, "value": v} for k, v in {
        contract.CONFIG: f"{contract.CONFIG_MOUNT}/config.json", contract.CHECKPOINT_DIR: contract.CHECKPOINT_MOUNT,
        contract.OUTPUT_DIR: contract.OUTPUT_MOUNT, contract.JOB: JOB, contract.NAMESPACE: ns,
        contract.HANG: "off", contract.DIST_TIMEOUT: f"{collective_timeout:g}"}.items()]


PEER_TIMEOUT = {"seconds": 600.0}
"""--peer-collective-timeout, set once in main()."""


def trainjob(ns: str, spec: dict[str, Any]) -> dict[str, Any]:
    body = cl.trainjob(JOB, ns, spec["workers"], 0, RUNTIME)
    body["spec"]["runtimeRef"]["kind"] = "TrainingRuntime"
    body["spec"]["trainer"].update(numProcPerNode=1, env=trainer_env(ns, PEER_TIMEOUT["seconds"]))
    return body


def training_runtime(upstream: dict[str, Any], ns: str) -> dict[str, Any]:
    """The upstream torch-distributed runtime's restart copy (compare_lib.training_runtimes: JobSet failurePolicy,
    backoffLimit 0) as a TrainingRuntime in the namespace, with the trainer image run by torchrun, maxRestarts
    MAX_RESTARTS and the volumes kubetrain's worker pods have (config, claim, /dev/shm, output) at the same paths;
    the pod's security context and DNS option as kubetrain's (the node's resolver needs single-request-reopen).

    The pods' restartPolicy is Never (JobSet defaults an unset one to OnFailure): with OnFailure the kubelet first
    restarts a failed container in its pod, the gang trains on, and the Job controller fails the Job (backoffLimit
    0 counts the restart) some 25 s later, when JobSet recreates a gang that was training (seen in a validation
    run: a second interruption per fault). With Never the failed pod fails its Job at once."""
    restart = cl.training_runtimes(upstream)[1]
    jobset = restart["spec"]["template"]["spec"]
    jobset["failurePolicy"]["maxRestarts"] = MAX_RESTARTS
    for rjob in jobset["replicatedJobs"]:
        pod = rjob["template"]["spec"]["template"]["spec"]
        pod["volumes"] = [{"name": "config", "configMap": {"name": CONFIG_MAP}},
                          {"name": "checkpoints", "persistentVolumeClaim": {"claimName": CLAIM}},
                          {"name": "dshm", "emptyDir": {"medium": "Memory"}}, {"name": "output", "emptyDir": {}}]
        pod["securityContext"] = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"},
                                  "fsGroup": 1000, "fsGroupChangePolicy": "OnRootMismatch"}
        pod["dnsConfig"] = {"options": [{"name": "single-request-reopen"}]}
        pod.update(one_per_real_node({TrainerV2.JOBSET_LABEL: JOB}, required=False))  # as across_nodes places ours
        pod["restartPolicy"] = "Never"  # see the docstring
        for c in pod["containers"]:
            if c["name"] == cl.TRAINER_NODE:
                c.update(image=TRAINER_IMAGE, imagePullPolicy="IfNotPresent", command=TORCHRUN,
                         securityContext={"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                         volumeMounts=[{"name": "config", "mountPath": contract.CONFIG_MOUNT, "readOnly": True},
                                       {"name": "checkpoints", "mountPath": contract.CHECKPOINT_MOUNT},
                                       {"name": "dshm", "mountPath": "/dev/shm"},
                                       {"name": "output", "mountPath": contract.OUTPUT_MOUNT}])
    return {"apiVersion": restart["apiVersion"], "kind": "TrainingRuntime",
            "metadata": {"name": RUNTIME, "namespace": ns, "labels": restart["metadata"].get("labels", {})},
            "spec": restart["spec"]}


# --------------------------------------------------------------------------- faults, from the host


def container_main(rank: int) -> int:
    """The container's first process above a rank: its launcher (kubetrain) or torchrun (Trainer v2)."""
    pid = rank
    while "kubetrain.trainer" in cmdline(parent := parent_pid(pid)):
        pid = parent
    return pid


def memory_cgroup(uid: str, container_id: str) -> Path | None:
    """The container's memory cgroup on whichever real node runs it (cgroupfs driver; support.real_pods.POD_CGROUPS:
    node 1's kubepods, or node K's own root): v1's memory hierarchy, or v2's."""
    pod = pod_cgroup(uid, "memory")
    cg = pod / container_id.split("://", 1)[-1] if pod is not None else None
    return cg if cg is not None and cg.is_dir() else None


def oom_kills(cg: Path) -> int:
    """The cgroup's OOM kill count (v1 memory.oom_control, v2 memory.events); -1 once the cgroup is gone."""
    try:
        text = (cg / ("memory.oom_control" if (cg / "memory.oom_control").exists() else "memory.events")).read_text()
    except OSError:
        return -1
    return next((int(line.split()[1]) for line in text.splitlines() if line.startswith("oom_kill ")), 0)


def oom_kill(core: client.CoreV1Api, pod: client.V1Pod, timeout: float = 60.0) -> tuple[str, float]:
    """Lower the trainer container's memory limit from the host until the kernel OOM-kills a process in it: first
    to its usage, then 8 MiB lower every 0.1 s (cgroup v1 refuses a limit it cannot reclaim down to: the limit
    stays at the lowest it took, and the next allocations over it are OOM kills). What was done, and when the kill
    was seen (the fault's time: training goes on until then); put back if no kill came in time."""
    status = pod.status.container_statuses[0]
    cg = memory_cgroup(pod.metadata.uid, status.container_id or "")
    if cg is None:
        raise FaultNotReady(f"no memory cgroup for {pod.metadata.name}'s container")
    v1 = (cg / "memory.limit_in_bytes").exists()
    limit_file, usage_file = (cg / "memory.limit_in_bytes", cg / "memory.usage_in_bytes") if v1 else \
        (cg / "memory.max", cg / "memory.current")
    usage = int(usage_file.read_text())
    before, limit, refused = oom_kills(cg), None, 0
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        kills = oom_kills(cg)
        if kills < 0 and limit is not None and oom_killed(core, pod, status.container_id or ""):
            return (f"memory limit lowered from {usage >> 20} MiB usage to {limit >> 20} MiB, OOM kill "
                    f"{time.monotonic() - started:.1f}s after the first write (the container ended before its cgroup's "
                    "counter was read; its status says OOMKilled)"), time.time()
        if kills < 0:
            raise FaultNotReady(f"{pod.metadata.name}'s container ended before an OOM kill was seen")
        if kills != before:
            return (f"memory limit lowered from {usage >> 20} MiB usage to {(limit or usage) >> 20} MiB, OOM kill "
                    f"{time.monotonic() - started:.1f}s after the first write"), time.time()
        with contextlib.suppress(OSError):  # gone meanwhile: the next round says so
            target = (limit - (8 << 20) if limit else int(usage_file.read_text()) + 4095) // 4096 * 4096
            try:
                limit_file.write_text(f"{target}\n")
                limit = target
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise
                refused += 1
        time.sleep(0.05)
    with contextlib.suppress(OSError):
        limit_file.write_text("-1\n" if v1 else "max\n")
    raise FaultNotReady(f"no OOM kill within {timeout:g}s (limit down to {(limit or usage) >> 20} MiB from "
                        f"{usage >> 20} MiB usage, {refused} writes refused); limit put back")


def oom_killed(core: client.CoreV1Api, pod: client.V1Pod, container_id: str, within: float = 10.0) -> bool:
    """Whether the pod's status says the container ``container_id`` ended OOMKilled (asked for ``within`` seconds:
    the kubelet reports it a moment after the exit)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with contextlib.suppress(client.ApiException):
            p = core.read_namespaced_pod(pod.metadata.name, pod.metadata.namespace)
            if p.metadata.uid != pod.metadata.uid:
                return False
            for cs in p.status.container_statuses or []:
                for term in (cs.state and cs.state.terminated, cs.last_state and cs.last_state.terminated):
                    if term is not None and term.container_id == container_id:
                        return term.reason == "OOMKilled"
        time.sleep(0.2)
    return False


class FaultNotReady(Exception):
    """The fault's target is not there yet (no trainer process, no cgroup): try again shortly."""


def apply_fault(kind: str, core: client.CoreV1Api, ns: str, pod: client.V1Pod) -> tuple[str, float]:
    """Apply one fault to ``pod``: what was done, and when (epoch seconds)."""
    name = pod.metadata.name
    ranks = trainer_ranks(pod.metadata.uid)
    if kind in (gl.KILL, gl.HANG, gl.OOM) and len(ranks) != 1:
        raise FaultNotReady(f"{len(ranks)} trainer ranks in {name}")
    if kind == gl.OOM:
        return oom_kill(core, pod)
    now = time.time()
    if kind == gl.KILL:
        main = container_main(ranks[0])
        what = cmdline(main)
        os.kill(main, signal.SIGKILL)
        return f"SIGKILL to pid {main} ({what[:60]})", now
    if kind == gl.HANG:
        os.kill(ranks[0], signal.SIGSTOP)
        return f"SIGSTOP to rank pid {ranks[0]}", now
    if kind == gl.DELETE:
        core.delete_namespaced_pod(name, ns, grace_period_seconds=0)
        return "deleted, grace 0", now
    core.create_namespaced_pod_eviction(name, ns, client.V1Eviction(
        metadata=client.V1ObjectMeta(name=name, namespace=ns)))
    return f"evicted (grace {pod.spec.termination_grace_period_seconds}s)", now


class NodeFaults:
    """The node faults applied and not yet undone: each undone NODE_DOWN_S after it, in a thread, or at the end of
    the campaign whatever happens (the test cluster is shared)."""

    def __init__(self) -> None:
        self.down: dict[str, str] = {}
        self.lock = threading.Lock()

    def apply(self, kind: str, node: str) -> str:
        chaos(kind, node)
        with self.lock:
            self.down[node] = kind
        timer = threading.Timer(NODE_DOWN_S, self.undo, args=(node,))
        timer.daemon = True
        timer.start()
        return f"hack/chaos.sh {kind} {node} (undone after {NODE_DOWN_S:g}s)"

    def undo(self, node: str) -> None:
        with self.lock:
            kind = self.down.pop(node, None)
        if kind is None:
            return
        chaos(UNDO[kind], node)
        wait_for(lambda: node_healthy(client.CoreV1Api(), node), 180, interval=1,
                 what=f"{node} Ready and untainted again")
        say(f"{node}: {UNDO[kind]} done, Ready and untainted")

    def undo_all(self) -> None:
        for node in list(self.down):
            self.undo(node)


def on_extra_node(pods: dict[int, client.V1Pod]) -> tuple[int, client.V1Pod]:
    """The worker on the node a fault tool can fault (the host's own node it cannot)."""
    for index, pod in sorted(pods.items()):
        if pod.spec.node_name == EXTRA_NODE and pod.status.phase == "Running" and not pod.metadata.deletion_timestamp:
            return index, pod
    raise FaultNotReady(f"no worker Running on {EXTRA_NODE} ({ {i: p.spec.node_name for i, p in pods.items()} })")


def watch_outcome(core: client.CoreV1Api, ns: str, pod: client.V1Pod, fault: gl.AppliedFault,
                  applied: list[gl.AppliedFault]) -> None:
    """What the pod shows after the fault (its container's termination, its deletion), into fault.outcome, until
    the next fault is applied."""
    seen: list[str] = []
    deadline = time.monotonic() + OUTCOME_WATCH_S.get(fault.kind, 45.0)
    while time.monotonic() < deadline and applied[-1] is fault:
        try:
            p = core.read_namespaced_pod(pod.metadata.name, ns)
        except client.ApiException as exc:
            if exc.status != 404:
                raise
            seen.append("pod gone")
            break
        if p.metadata.uid != pod.metadata.uid:
            seen.append("pod gone (recreated)")
            break
        for cs in p.status.container_statuses or []:
            for term in (cs.state and cs.state.terminated, cs.last_state and cs.last_state.terminated):
                if term is not None and term.finished_at and term.finished_at.timestamp() >= (fault.applied or 0) - 1:
                    what = f"{term.reason} exit {term.exit_code}"
                    if what not in seen:
                        seen.append(what)
        disrupted = [c.reason for c in p.status.conditions or [] if c.type == "DisruptionTarget" and c.status == "True"]
        if disrupted and f"DisruptionTarget {disrupted[0]}" not in seen:
            seen.append(f"DisruptionTarget {disrupted[0]}")
        time.sleep(0.2)
    fault.outcome = "; ".join(seen) or "no container exit seen (watched until the next fault or for "\
        f"{OUTCOME_WATCH_S.get(fault.kind, 45.0):g}s)"


# --------------------------------------------------------------------------- one campaign


@dataclass
class Campaign:
    system: System
    spec: dict[str, Any]
    faults: list[gl.Fault]
    timeout: float
    records: Records | None = None
    applied: list[gl.AppliedFault] = field(default_factory=list)
    created: float = 0.0
    notes: list[str] = field(default_factory=list)
    logs: PodLogs = field(init=False)
    nodes: NodeFaults = field(default_factory=NodeFaults)

    def run(self) -> gl.Goodput:
        self.logs = PodLogs(self.system.ns)
        if any(f.kind in gl.NODE_FAULTS for f in self.faults):  # one worker per node needs both Ready
            wait_for(lambda: node_healthy(self.system.core, EXTRA_NODE), 300, interval=1,
                     what=f"{EXTRA_NODE} Ready and untainted")
        self.created = time.time()
        self.system.create(self.spec)
        say(f"{self.system.key}: job created in {self.system.ns}; {len(self.faults)} faults planned")
        try:
            finished = self._until_done()
        finally:
            self.nodes.undo_all()
        self.logs.copy()
        if self.records is not None:
            self.records.poll()
        files = self.records.events if self.records else {}
        execs = gl.executions(files, tokens_per_step(self.spec))
        restarts = self.system.restarts()
        end = finished or time.time()
        result = gl.goodput(self.system.key, execs, self.created, end, self.spec["maxSteps"], self.applied, restarts)
        result.cross_check = self.system.cross_check(end - self.created)
        productive = (result.cross_check.get("status.goodput") or {}).get("productiveSeconds")
        if productive is not None and result.kept_interval_s:  # the job's own account against this bench's
            result.cross_check["productive_over_kept_intervals"] = round(productive / result.kept_interval_s, 4)
        result.notes = self.notes
        result.raw = gl.raw(execs, self.created, end, self.applied)
        return result

    def _until_done(self) -> float | None:
        """Polls the job, applies the faults as they come due; when it Succeeded (None: failed, or timed out)."""
        pending = list(self.faults)
        last_progress = last_status = 0.0
        while time.time() - self.created < self.timeout:
            now = time.time()
            self._find_records()
            if self.records is not None:
                self.records.poll()
            if now - last_status >= STATUS_EVERY_S:
                last_status = now
                self.logs.copy()
                phase, why = self.system.phase()
                if phase in ("Succeeded", "Failed"):
                    return self._ended(phase, why, now, pending)
            if pending and now - self.created >= pending[0].at_s and self._try(pending[0]):
                pending.pop(0)
            if now - last_progress >= PROGRESS_EVERY_S:
                last_progress = now
                self._progress()
            time.sleep(0.05 if pending and now - self.created >= pending[0].at_s else 0.25)
        self.notes.append(f"timed out after {self.timeout:.0f}s")
        say(f"{self.system.key}: timed out after {self.timeout:.0f}s")
        return None

    def _ended(self, phase: str, why: str, now: float, pending: list[gl.Fault]) -> float | None:
        for f in pending:
            self.applied.append(gl.AppliedFault(f.kind, f.worker, f.at_s, self.created + f.at_s,
                                                skipped="the job had finished" if phase == "Succeeded" else phase))
        say(f"{self.system.key}: {phase} after {now - self.created:.1f}s {why if phase == 'Failed' else ''}")
        if phase == "Failed":
            self.notes.append(f"Failed: {why}")
            return None
        return now

    def _find_records(self) -> None:
        if self.records is not None:
            return
        for pod in self.system.worker_pods().values():
            claims = [v.persistent_volume_claim.claim_name for v in pod.spec.volumes or [] if v.persistent_volume_claim]
            with contextlib.suppress(client.ApiException, AttributeError, TypeError, ValueError, IndexError):
                self.records = Records(claim_dir(self.system.core, self.system.ns, claims[0]))
                say(f"{self.system.key}: rank 0's step records in {self.records.dir}")
                return

    def _training(self, fault: gl.Fault) -> bool:
        """Rank 0 recorded a step in the last FRESH_S seconds, in a process started after the previous fault (or
        RECOVERY_WAIT_S after it, should that fault have stopped nothing) that has made 3 steps, and the step is where
        the fault goes between two checkpoints."""
        latest = self.records.latest if self.records else None
        if latest is None or time.time() - latest.wall > FRESH_S:
            return False
        assert self.records is not None
        name = self.records.latest_file
        last = self.applied[-1].applied if self.applied else None
        if last is not None and self.records.started(name) < last and time.time() - last < RECOVERY_WAIT_S:
            return False
        return self.records.steps_in(name) >= 3 and gl.in_phase(latest.step, fault, self.spec["checkpoint"]["everySteps"])

    def _try(self, fault: gl.Fault) -> bool:
        """Apply ``fault`` if the job trains now; True once applied."""
        if not self._training(fault):
            return False
        assert self.records is not None and self.records.latest is not None
        try:
            if fault.kind in gl.NODE_FAULTS:
                if EXTRA_NODE in self.nodes.down or not node_healthy(self.system.core, EXTRA_NODE):
                    raise FaultNotReady(f"{EXTRA_NODE} is not back yet")
                worker, pod = on_extra_node(self.system.worker_pods())
                applied = time.time()
                how = self.nodes.apply(fault.kind, EXTRA_NODE)
            else:
                if (fault.kind in gl.MOVES_A_POD and self._node_fault_to_come()
                        and not node_healthy(self.system.core, EXTRA_NODE)):
                    raise FaultNotReady(f"{EXTRA_NODE} is not back yet: the recreated pod would not go there")
                worker, found = fault.worker, self.system.worker_pods().get(fault.worker)
                if found is None or found.status.phase != "Running":
                    return False
                pod = found
                how, applied = apply_fault(fault.kind, self.system.core, self.system.ns, pod)
        except FaultNotReady as exc:
            if fault.kind == gl.OOM:  # a minute spent: say so
                say(f"{self.system.key}: {fault.kind} not applied yet: {exc}")
                self.notes.append(f"{fault.kind}: {exc}")
            return False
        self.records.poll()
        step = self.records.latest.step
        done = gl.AppliedFault(fault.kind, worker, fault.at_s, self.created + fault.at_s, applied, step,
                               pod.metadata.name, how)
        self.applied.append(done)
        threading.Thread(target=watch_outcome, args=(self.system.core, self.system.ns, pod, done, self.applied),
                         daemon=True).start()
        say(f"{self.system.key}: {fault.kind} at {applied - self.created:.1f}s (due {fault.at_s:g}s), step {step}, "
            f"{pod.metadata.name}: {how}")
        return True

    def _node_fault_to_come(self) -> bool:
        """A node fault is planned and not applied yet: it needs a worker back on the second node."""
        return sum(f.kind in gl.NODE_FAULTS for f in self.faults) > sum(f.kind in gl.NODE_FAULTS for f in self.applied)

    def _progress(self) -> None:
        latest = self.records.latest if self.records else None
        say(f"{self.system.key}: {time.time() - self.created:5.0f}s step {latest.step if latest else '-'}"
            f"/{self.spec['maxSteps']}, restarts {self.system.restarts()}, faults {len(self.applied)}/{len(self.faults)}")


def tokens_per_step(spec: dict[str, Any]) -> int:
    """Samples per optimizer step over all data-parallel replicas times the sequence length
    (kubetrain.trainer.loop.global_batch): every process is one, but tensor-parallel peers share theirs."""
    replicas = spec["workers"] * spec.get("procsPerWorker", 1) // (spec.get("parallelism") or {}).get("tensor", 1)
    return spec["microBatchSize"] * spec["gradientAccumulationSteps"] * replicas * spec["model"]["seqLen"]


# --------------------------------------------------------------------------- namespaces, controllers, calibration


@contextlib.contextmanager
def namespace(admin: client.ApiClient, system: str) -> Iterator[str]:
    core = client.CoreV1Api(admin)
    ns = f"bench-goodput-{system}-{uuid.uuid4().hex[:5]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
    wait_default_service_account(core, ns, timeout=60)
    try:
        yield ns
    finally:
        say(f"deleting namespace {ns}")
        compare.delete_namespace(admin, ns)


@dataclass
class Peer:
    """Trainer v2 and JobSet as bench/compare.py builds, installs and runs them."""

    trainer: compare.GoBuild
    jobset: compare.GoBuild
    op: compare.TrainerV2

    @classmethod
    def install(cls, admin: client.ApiClient) -> Peer:
        os.environ["KUBETRAIN_CLUSTER_DIR"] = str(cluster_dir())  # where compare's installs keep their files
        trainer = compare.go_build("trainer-v2/build.sh")
        jobset = compare.go_build("trainer-v2/build.sh", "--jobset")
        op = compare.install_trainer_v2(admin, client.CoreV1Api(admin), trainer, jobset)
        op.runtimes = []  # the namespaced TrainingRuntime below instead of the ClusterTrainingRuntimes
        return cls(trainer, jobset, op)

    def upstream_runtime(self) -> dict[str, Any]:
        path = self.trainer.moddir / "manifests" / "base" / "runtimes" / "torch_distributed.yaml"
        return dict(yaml.safe_load(path.read_text()))

    def webhooks(self) -> list[dict[str, Any]]:
        return [*compare.patched_webhooks(self.jobset.moddir / "config" / "components" / "webhook", compare.JOBSET_PREFIX),
                *compare.patched_webhooks(self.trainer.moddir / "manifests" / "base" / "webhook")]

    def uninstall_webhooks(self, admin: client.ApiClient) -> None:
        """The webhook configurations call processes that are gone now: leave none on the shared test cluster."""
        for doc in self.webhooks():
            delete(admin, doc)


def run_system(key: str, admin: client.ApiClient, spec: dict[str, Any], faults: list[gl.Fault], timeout: float,
               peer: Peer | None) -> gl.Goodput:
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    with namespace(admin, key) as ns:
        log = LOG_DIR / f"{ns}.log"
        say(f"{key}: controller log {log}, pods' logs in {LOG_DIR / ns}/")
        if key == gl.KUBETRAIN:
            with OperatorProcess(kubeconfig_path(), log, "--namespace", ns, trainer_image=TRAINER_IMAGE):
                return Campaign(Kubetrain(key, admin, ns), spec, faults, timeout).run()
        assert peer is not None
        client.CoreV1Api(admin).create_namespaced_persistent_volume_claim(ns, client.V1PersistentVolumeClaim(
            metadata=client.V1ObjectMeta(name=CLAIM), spec=client.V1PersistentVolumeClaimSpec(
                access_modes=["ReadWriteOnce"], resources=client.V1VolumeResourceRequirements(
                    requests={"storage": "1Gi"}))))
        peer.op.start(log, client.CoreV1Api(admin), None, ns)
        try:
            runtime = training_runtime(peer.upstream_runtime(), ns)
            wait_for(partial(compare._applied, admin, runtime), 60, interval=0.5, what=f"TrainingRuntime {RUNTIME}")
            return Campaign(TrainerV2(key, admin, ns), spec, faults, timeout).run()
        finally:
            peer.op.stop()


def calibrate(admin: client.ApiClient, spec: dict[str, Any], steps: int, minutes: float) -> dict[str, Any]:
    """A short undisturbed kubetrain run: the time per step with checkpoints (rank 0's step records, its first 3
    steps left out), and maxSteps for --minutes of training, a multiple of checkpoint.everySteps."""
    short = {**spec, "maxSteps": steps}
    say(f"calibration: {steps} steps under kubetrain, no faults")
    result = run_system(gl.KUBETRAIN, admin, short, [], 900, None)
    per_step = result.mean_interval_s
    if not per_step or result.missing_steps:
        raise RuntimeError(f"calibration run incomplete: {result}")
    every = spec["checkpoint"]["everySteps"]
    max_steps = max(every, round(minutes * 60 / per_step / every) * every)
    out = {"steps": steps, "seconds_per_step": round(per_step, 4), "mean_step_s": result.mean_step_s,
           "wall_s": result.wall_s, "goodput": result.goodput, "max_steps": max_steps}
    say(f"calibration: {per_step:.3f}s per step with checkpoints ({result.mean_step_s:.3f}s in the step itself); "
        f"maxSteps {max_steps} for {minutes:g} min")
    return out


# --------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--system", choices=("kubetrain", "trainer-v2", "both"), default="both")
    p.add_argument("--minutes", type=float, default=10.0, help="undisturbed training time (sizes maxSteps)")
    p.add_argument("--every", type=float, default=100.0, help="seconds between faults")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--faults", default=",".join(gl.FAULT_KINDS), help=f"kinds, from {','.join(gl.FAULT_KINDS)}")
    p.add_argument("--max-steps", type=int, help="skip the calibration (give the same N to compare separate runs)")
    p.add_argument("--calibration-steps", type=int, default=100)
    p.add_argument("--backoff-seconds", type=float, default=0.0, help="kubetrain's restartPolicy.backoffSeconds")
    p.add_argument("--peer-collective-timeout", type=float, default=600.0,
                   help="Trainer v2's trainer: collective timeout in seconds (PyTorch's default 600)")
    p.add_argument("--timeout", type=float, help="per system run (default: 3 x --minutes + 15 min + 2 min a fault)")
    p.add_argument("--undisturbed", action="store_true",
                   help="first run kubetrain's job with no faults (the same maxSteps): a results entry of its own")
    p.add_argument("--no-build", action="store_true", help="skip hack/images.sh (the node's images as they are)")
    p.add_argument("--json", type=Path)
    p.add_argument("--report", type=Path, help="print the table again from a --json file's records; run nothing")
    return p.parse_args()


def base_spec(args: argparse.Namespace) -> dict[str, Any]:
    """The quickstart's spec with the campaign's restart policy (and maxSteps set later)."""
    body = quickstart(restartPolicy={"backoffLimit": MAX_RESTARTS, "backoffSeconds": args.backoff_seconds})
    body["metadata"]["name"] = JOB
    spec = across_nodes(body, required=False)["spec"]  # one worker per real node; a lost node's may join the other
    assert spec["workers"] == WORKERS, spec["workers"]
    return dict(spec)


def prepare(args: argparse.Namespace) -> client.ApiClient:
    if not cluster_running():
        cluster_up()
    os.environ["KUBECONFIG"] = str(kubeconfig_path())
    config.load_kube_config(str(kubeconfig_path()))
    admin = client.ApiClient()
    missing = real_node_missing(client.CoreV1Api(admin))
    if missing:
        sys.exit(f"goodput needs the real node: {missing}")
    apply_crd()
    if not args.no_build:
        say("hack/images.sh (builds what changed, loads it into the node)")
        build_images()
    return admin


def recompute(path: Path) -> int:
    """--report: the table again from a --json file's raw records (with this checkout's goodput_lib)."""
    out = json.loads(path.read_text())
    for r in out["results"]:
        again = gl.from_raw(r["system"], r["raw"], out["spec"]["maxSteps"], r["restarts"])
        again.cross_check, again.notes, again.raw = r["cross_check"], r["notes"], {}
        r.update(again.to_json())
    report(out)
    return 0


def main() -> int:
    args = parse_args()
    if args.report:
        return recompute(args.report)
    # Stopped early (SIGTERM, or Ctrl-C where a shell started it in the background with SIGINT ignored): the
    # finally blocks still delete the namespace, stop the controllers and remove Trainer v2's webhooks.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    PEER_TIMEOUT["seconds"] = args.peer_collective_timeout
    systems = [gl.KUBETRAIN, gl.TRAINER_V2] if args.system == "both" else [args.system]
    kinds = [k for k in args.faults.split(",") if k]
    spec = base_spec(args)
    admin = prepare(args)
    peer = Peer.install(admin) if gl.TRAINER_V2 in systems else None
    out: dict[str, Any] = {"date": date.today().isoformat(), "git": compare.git_rev(), "machine": compare.machine(),
                           "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                           "image": TRAINER_IMAGE, "results": []}
    try:
        if args.max_steps:
            spec["maxSteps"] = args.max_steps
        else:
            out["calibration"] = calibrate(admin, spec, args.calibration_steps, args.minutes)
            spec["maxSteps"] = out["calibration"]["max_steps"]
        faults = gl.schedule(args.seed, args.every, kinds, WORKERS, spec["checkpoint"]["everySteps"])
        out.update(spec=spec, schedule=[asdict(f) for f in faults])
        say("schedule: " + "; ".join(f"{f.kind} at {f.at_s:g}s on worker {f.worker}, step phase {f.phase}" for f in faults))
        if peer is not None:
            out["peer"] = {"trainer": peer.trainer.version, "jobset": peer.jobset.version,
                           "collective_timeout_s": args.peer_collective_timeout, "command": TORCHRUN}
        timeout = args.timeout or 3 * args.minutes * 60 + 900 + 120 * len(faults)
        for key in ([gl.UNDISTURBED] if args.undisturbed else []) + systems:
            planned = [] if key == gl.UNDISTURBED else faults
            say(f"=== {gl.SYSTEM_TITLES[key]}: {spec['maxSteps']} steps, {len(planned)} faults")
            t0 = time.monotonic()
            result = run_system(gl.KUBETRAIN if key == gl.UNDISTURBED else key, admin, spec, planned, timeout, peer)
            result.system = key
            out["results"].append({**result.to_json(), "bench_s": round(time.monotonic() - t0, 1)})
            report(out)
    finally:
        if peer is not None:
            peer.uninstall_webhooks(admin)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0 if all(r["missing_steps"] == 0 and r["steps"] for r in out["results"]) else 1


def report(out: dict[str, Any]) -> None:
    results = [gl.Goodput(**{**r, "faults": [gl.FaultResult(**f) for f in r["faults"]]})
               for r in ({k: v for k, v in r.items() if k != "bench_s"} for r in out["results"])]
    print(gl.table(results), flush=True)
    print("\n".join(gl.summary(results)), flush=True)
    print(f"(maxSteps {out['spec']['maxSteps']}, faults every {out['args']['every']:g}s, seed {out['args']['seed']}; "
          f"{out['machine']}; kubetrain {out['git']})", flush=True)
    for r in out["results"]:
        print(f"- {r['system']}: {r['steps']} steps kept of {r['step_executions']} run, mean step {r['mean_step_s']}s, "
              f"{r['executions']} executions of rank 0, bench took {r['bench_s']}s; cross-check {r['cross_check']}"
              + (f"; notes {r['notes']}" if r["notes"] else ""), flush=True)
        for f in r["faults"]:
            starts = f" (rank 0 started {f['executions']} times in the recovery)" if (f.get("executions") or 0) > 1 else ""
            print(f"  - {f['kind']} on {f['pod'] or '-'}: {f['how'] or f['skipped']} -> {f['outcome']}{starts}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
