"""Several real nodes: a gang trains across two kubelets, and a node's faults, caused for real by
hack/chaos.sh (its kubelet and pods stopped; its processes killed), move its worker to a healthy node.

The second node runs in a network namespace of its own (hack/real-node.sh), so its pods reach the first
node's pods, DNS and the API server through routes, as across machines.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from support.cluster import kubeconfig_path, process_stopped
from support.operator_process import OperatorProcess
from support.real_pods import (
    EXTRA_NODE,
    EXTRA_NODE_TOLERATION,
    NODE_NAME,
    TRAINER_IMAGE,
    RealJobs,
    across_nodes,
    chaos,
    claim_dir,
    cluster_bucket,
    cluster_object_store,
    elapsed,
    kubelet_pid,
    node_healthy,
    node_ready,
    object_store,
    pod_logs_dir,
    progress_step,
    quickstart,
    trainer_ranks,
    wait_step,
)
from support.waiting import wait_for

from kubetrain.operator.runtime.settings import ENV_CHECKPOINT_STORE
from kubetrain.trainer.checkpoint.fence import FENCE_FILE, Fence, parse

pytestmark = pytest.mark.integration

UNDO = {"freeze-node": "thaw-node", "kill-node": "restore-node", "partition-node": "heal-node"}


@pytest.fixture(scope="module")
def store(real_node: None) -> Iterator[tuple[str, Any, str]]:
    """A bucket of the cluster's object store for the operator's checkpointStore: endpoint, client, bucket."""
    endpoint, fs = object_store()
    with cluster_bucket(fs, "operator-store") as bucket:
        yield endpoint, fs, bucket


@pytest.fixture(scope="module")
def operator(crd: None, real_node: None, store: tuple[str, Any, str],
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    """The operator, cluster-wide, with the chart value checkpointStore on the cluster's object store."""
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    endpoint, _, bucket = store
    checkpoint_store = {"uri": f"s3://{bucket}/jobs", "s3": {"endpoint": endpoint, "credentialsSecret": "kubetrain-s3"}}
    with OperatorProcess(kubeconfig_path(), log, trainer_image=TRAINER_IMAGE,
                         env={ENV_CHECKPOINT_STORE: json.dumps(checkpoint_store)}) as op:
        yield op


@pytest.fixture
def jobs(admin_api: client.ApiClient, real_namespace: str, operator: OperatorProcess) -> RealJobs:
    return RealJobs(admin_api, real_namespace)


def test_the_cluster_has_two_real_nodes_and_a_gang_trains_across_them(jobs: RealJobs) -> None:
    nodes = {n.metadata.name: n for n in jobs.core.list_node(label_selector="kubetrain.io/node=real").items}
    assert sorted(nodes) == [NODE_NAME, EXTRA_NODE]
    assert all(node_ready(jobs.core, n) for n in nodes)
    assert [(t.key, t.value, t.effect) for t in nodes[EXTRA_NODE].spec.taints or []] == [
        ("kubetrain.io/node-pool", "extra", "NoSchedule")]
    start = time.monotonic()
    body = quickstart()
    body["metadata"]["name"] = "across"
    name = jobs.create(across_nodes(body))
    placed = wait_for(lambda: _nodes_of(jobs, name) if len(_nodes_of(jobs, name)) == 2 else None, 300,
                      what="both workers placed")
    st = jobs.wait_phase(name, "Succeeded", timeout=600)
    print(f"a gang across {placed}: Succeeded in {elapsed(start)} s at step {st['currentStep']}, loss {st.get('loss')}")
    assert placed == {0: NODE_NAME, 1: EXTRA_NODE} or placed == {0: EXTRA_NODE, 1: NODE_NAME}
    assert st["currentStep"] == 60 and not st.get("restartCount"), jobs.describe(name)


def test_two_workers_on_read_write_once_storage_resume_from_the_operators_store_after_a_kill(
        jobs: RealJobs, store: tuple[str, Any, str]) -> None:
    """The class local-rwo provisions ReadWriteOnce only (a directory per node, as a cloud's block storage; a
    ReadWriteMany claim of it fails to provision). A 2-worker job on it, one worker per real node, keeps its
    checkpoints in the operator's checkpoint store under a prefix of its own, and no claim is made. Worker 1's
    rank is SIGKILLed from the host after a committed checkpoint: the gang resumes from the store and Succeeds."""
    _, fs, bucket = store
    cluster_object_store(jobs.ns)  # the store's keys, as the Secret that checkpointStore.s3 names
    body = quickstart(precision="fp32", maxSteps=120, checkpoint={"everySteps": 10, "keep": 3,
                      "storageClassName": "local-rwo", "memory": {"enabled": False}},
                      restartPolicy={"backoffLimit": 3, "backoffSeconds": 1})
    body["metadata"]["name"] = "rwo-only"
    start = time.monotonic()
    name = jobs.create(across_nodes(body))
    st = wait_step(jobs, name, 20)
    placed = _nodes_of(jobs, name)
    assert sorted(placed.values()) == sorted([NODE_NAME, EXTRA_NODE]), f"not one worker per node: {placed}"
    prefix = st["checkpointStore"]["uri"]
    assert prefix == f"s3://{bucket}/jobs/{jobs.ns}/{name}-{jobs.get(name)['metadata']['uid']}", prefix
    victim = jobs.core.read_namespaced_pod(f"{name}-worker-1", jobs.ns)
    t0, at = time.monotonic(), progress_step(jobs.core, jobs.ns, name)
    os.kill(_rank_of(victim), signal.SIGKILL)
    resumed = jobs.wait(name, lambda st: st.get("restartCount") == 1 and st.get("resumedFrom"), 300,
                        "the gang resumed after the kill")
    recovery = elapsed(t0)
    done = jobs.wait_phase(name, "Succeeded", timeout=600)
    durable = next(c for c in done["conditions"] if c["type"] == "CheckpointsDurable")
    keys = fs.find(prefix.removeprefix("s3://"), refresh=True)
    committed = sorted(k.split("/")[-2] for k in keys if k.endswith("/COMMITTED"))
    writes = sorted(float(x) for x in re.findall(r"committed: write took ([0-9.]+) s", jobs.log(f"{name}-worker-0")))
    print(f"background writes and uploads of rank 0 until committed: median {writes[len(writes) // 2]} s of "
          f"{len(writes)}")
    print(f"RWO-only, 2 workers on {sorted(placed.values())}: killed at step {at}, resumed from step "
          f"{resumed.get('resumedFromStep')} ({resumed.get('resumedFrom')}) {recovery} s after the kill; "
          f"Succeeded in {elapsed(start)} s with {done.get('restartCount')} restart(s); {durable['reason']}: "
          f"{durable['message']}; committed in the store: {committed}")
    assert done["currentStep"] == 120 and done.get("restartCount") == 1, jobs.describe(name)
    assert done.get("resumedFrom") == "durable" and done["resumedFromStep"] >= 20, jobs.describe(name)
    assert durable["reason"] == "OperatorStore" and prefix in durable["message"]
    assert not jobs.core.list_namespaced_persistent_volume_claim(jobs.ns).items  # no claim at all
    assert committed == ["step-00000100", "step-00000110", "step-00000120"], keys


def _rank_of(pod: client.V1Pod) -> int:
    """The host PID of the pod's trainer rank (one process per worker), on either real node."""
    return wait_for(lambda: next(iter(trainer_ranks(pod.metadata.uid)), None), 30, what="the worker's trainer rank")


FAULTS = ["partition-node", "kill-node"] + (["freeze-node"] if os.environ.get("KUBETRAIN_NODE_FAULTS") == "all" else [])
"""A cut-off node (found by the hang verdict) and a dead one (by NotReady) in CI; a frozen node takes the hang
verdict's path too (KUBETRAIN_NODE_FAULTS=all adds it): docs/testing.md has its figures."""


@pytest.mark.parametrize("fault", FAULTS)
def test_a_lost_node_s_worker_is_placed_on_a_healthy_node_and_the_job_succeeds(
    jobs: RealJobs, fault: str
) -> None:
    """The second node frozen (kubelet, containerd and the pods' processes stopped), cut off (its traffic
    dropped) or killed (all of them SIGKILLed) under one worker of a 2-worker gang: that worker is recreated on
    the other node, the other worker keeps its pod, and the job Succeeds with one restart. Frozen or cut off, its launcher sends no hang report,
    so the hang verdict recreates it; killed, the job stops progressing and the node goes NotReady. Either way
    the operator deletes its pod with grace 0 once the node is NotReady, since its kubelet cannot confirm."""
    body = quickstart(precision="fp32", maxSteps=240, checkpoint={"everySteps": 10, "keep": 3},
                      restartPolicy={"backoffLimit": 3, "backoffSeconds": 1}, resources={"cpu": "500m"})
    body["metadata"]["name"] = fault.removesuffix("-node")
    name = jobs.create(across_nodes(body, required=False))
    wait_for(lambda: progress_step(jobs.core, jobs.ns, name) >= 15, 300, what="rank 0 at step >= 15")
    placed, victim = _nodes_of(jobs, name), EXTRA_NODE  # the node a fault tool can partition (not the host's)
    assert sorted(placed.values()) == sorted([NODE_NAME, EXTRA_NODE]), f"not one worker per node: {placed}"
    index = next(i for i, node in placed.items() if node == victim)
    t0, step = time.monotonic(), progress_step(jobs.core, jobs.ns, name)
    lost = jobs.core.read_namespaced_pod(f"{name}-worker-{index}", jobs.ns).metadata.uid
    healthy = jobs.core.read_namespaced_pod(f"{name}-worker-{1 - index}", jobs.ns).metadata.uid
    chaos(fault, victim)
    try:
        timeline = _recovery(jobs, name, t0, step, f"{name}-worker-{index}", lost)
        # Read while the gang trains: once rank 0 succeeds, cleanPodPolicy Running deletes the other pod.
        kept = _pod(jobs.core, jobs.ns, f"{name}-worker-{1 - index}")
        done = jobs.wait_phase(name, "Succeeded", timeout=600)
    finally:
        chaos(UNDO[fault], victim)
        wait_for(lambda: node_healthy(jobs.core, victim), 180, interval=1, what=f"{victim} Ready and untainted again")
    print(f"{fault} {victim} at step {step}: "
          + ", ".join(f"{k} {v} s" if isinstance(v, float) else f"{k}: {v}" for k, v in timeline.items())
          + f"; Succeeded after {elapsed(t0)} s with {done.get('restartCount')} restart(s)")
    assert timeline["moved to"] == NODE_NAME
    assert kept is not None and kept.metadata.uid == healthy, "the worker on the healthy node was not kept in place"
    assert done["currentStep"] == 240 and done.get("restartCount") == 1, jobs.describe(name)


KUBELET_AWAY_GRACE = 15
KUBELET_AWAY_MAX_STEPS = 320
"""With a quarter of a CPU per worker (resources.cpu 250m: the pace set by the quota more than by the machine),
enough to train through the stop and end soon after it (measured on the first node: 2 steps/s, step 36 -> 331
during a 150 s stop). The node stays NotReady for the grace and 20 s more, so a gang restarted at the grace would
show."""


def test_a_node_whose_kubelet_stops_keeps_its_training_gang_and_the_job_succeeds(jobs: RealJobs) -> None:
    """The second node's kubelet frozen (SIGSTOP) under a 2-worker job placed there until the node was NotReady
    (no status from its kubelet) for longer than the job's nodeNotReadyGraceSeconds, while its containers keep
    training and rank 0 keeps reporting through the API server. The gang is kept (restartCount 0), a Warning
    names the node, and the job Succeeds. On the second node, whose taint keeps every other lane's pods off it,
    so the test runs beside them."""
    restart = {"backoffLimit": 3, "backoffSeconds": 1, "nodeNotReadyGraceSeconds": KUBELET_AWAY_GRACE}
    body = quickstart(precision="fp32", maxSteps=KUBELET_AWAY_MAX_STEPS, resources={"cpu": "250m"},
                      checkpoint={"everySteps": 1000, "keep": 1}, restartPolicy=restart,
                      scheduling={"nodeSelector": {"kubernetes.io/hostname": EXTRA_NODE},
                                  "tolerations": [EXTRA_NODE_TOLERATION]})
    body["metadata"]["name"] = "kubelet-away"
    name = jobs.create(body)
    wait_for(lambda: progress_step(jobs.core, jobs.ns, name) >= 5, 300, what="rank 0 at step >= 5")
    assert set(_nodes_of(jobs, name).values()) == {EXTRA_NODE}, _nodes_of(jobs, name)
    core, t0 = jobs.core, time.monotonic()
    first = progress_step(core, jobs.ns, name)
    try:
        with process_stopped(kubelet_pid(EXTRA_NODE)):
            wait_for(lambda: not node_ready(core, EXTRA_NODE), 120, interval=2, what="the node NotReady")
            not_ready_after = elapsed(t0)
            time.sleep(KUBELET_AWAY_GRACE + 20)
            during = progress_step(core, jobs.ns, name)
            st = jobs.status(name)
    finally:
        wait_for(lambda: node_healthy(core, EXTRA_NODE), 180, interval=1, what=f"{EXTRA_NODE} Ready and untainted")
    print(f"kubelet stopped {elapsed(t0)} s: node NotReady after {not_ready_after} s; rank 0 at step {first} -> "
          f"{during} meanwhile")
    assert first < during < KUBELET_AWAY_MAX_STEPS, "the gang must train all through the stop"
    assert st["phase"] == "Running" and not st.get("restartCount"), jobs.describe(name)
    cond = next(c for c in st["conditions"] if c["type"] == "NodesNotReady")
    assert (cond["status"], cond["reason"]) == ("True", "NodeNotReady") and EXTRA_NODE in cond["message"], cond
    assert "still makes progress" in cond["message"], cond
    assert [e for e in jobs.events(name) if e.type == "Warning" and e.reason == "NodeNotReady"
            and EXTRA_NODE in (e.message or "")]
    done = jobs.wait_phase(name, "Succeeded", 600)
    print(f"Succeeded {elapsed(t0)} s after the kubelet was stopped")
    assert not done.get("restartCount") and done["currentStep"] == KUBELET_AWAY_MAX_STEPS, done


STALE = "a stale worker stops here"
"""How a stale worker says the fence stopped it (checkpoint/fence.py)."""


@pytest.mark.skipif(os.environ.get("KUBETRAIN_NODE_FAULTS") != "all",
                    reason="about 5 minutes; KUBETRAIN_NODE_FAULTS=all runs it (docs/testing.md has its figures)")
def test_a_cut_off_node_s_stale_worker_is_fenced_off_the_checkpoints(jobs: RealJobs) -> None:
    """A 1-worker job on the second node, the node then cut off: its worker cannot be stopped (its kubelet is
    unreachable) and trains on alone beside the checkpoints it shares with the cluster, while the operator
    restarts the job on node 1. Once the new gang has claimed the checkpoints (generation 1 in the fence file),
    the stale worker commits nothing: it stops at its next save, and the job Succeeds with one restart."""
    body = quickstart(precision="fp32", workers=1, maxSteps=800, checkpoint={"everySteps": 10, "keep": 3},
                      restartPolicy={"backoffLimit": 3, "backoffSeconds": 1, "nodeNotReadyGraceSeconds": 10},
                      resources={"cpu": "500m"})
    prefer = {"weight": 100, "preference": {"matchExpressions": [
        {"key": "kubernetes.io/hostname", "operator": "In", "values": [EXTRA_NODE]}]}}
    body["spec"]["scheduling"] = {"nodeSelector": {"kubetrain.io/node": "real"}, "tolerations": [EXTRA_NODE_TOLERATION],
                                  "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [prefer]}}}
    name = jobs.create(body, name="fenced")
    wait_for(lambda: progress_step(jobs.core, jobs.ns, name) >= 15, 300, what="rank 0 at step >= 15")
    old = jobs.core.read_namespaced_pod(f"{name}-worker-0", jobs.ns)
    assert old.spec.node_name == EXTRA_NODE, old.spec.node_name
    fence = claim_dir(jobs.core, jobs.ns, f"{name}-checkpoints") / FENCE_FILE
    uid = old.metadata.owner_references[0].uid
    assert parse(fence.read_text()) == Fence(uid, 0), fence.read_text()
    logs = pod_logs_dir(EXTRA_NODE) / f"{jobs.ns}_{old.metadata.name}_{old.metadata.uid}"
    t0 = time.monotonic()
    chaos("partition-node", EXTRA_NODE)
    try:
        wait_for(lambda: parse(fence.read_text()) == Fence(uid, 1), 300, interval=0.5, what="generation 1 claimed")
        claimed, moved = datetime.fromtimestamp(fence.stat().st_mtime, UTC), elapsed(t0)
        stale = wait_for(lambda: _said(logs, STALE), 120, interval=1, what=f"{STALE!r} in {logs}")
        stopped = elapsed(t0)
    finally:
        chaos("heal-node", EXTRA_NODE)
        wait_for(lambda: node_healthy(jobs.core, EXTRA_NODE), 180, interval=1, what=f"{EXTRA_NODE} Ready and untainted")
    done = jobs.wait_phase(name, "Succeeded", timeout=600)
    new = jobs.core.read_namespaced_pod(f"{name}-worker-0", jobs.ns)
    late = [x for x in stale.splitlines() if re.search(r"step \d+ committed", x) and _stamp(x) > claimed]
    how = next(x for x in stale.splitlines() if STALE in x)
    print(f"partitioned at step >= 15: generation 1 claimed after {moved} s on {new.spec.node_name}; the stale "
          f"worker stopped after {stopped} s: {how.strip()[:300]}; its commits after the claim: {late}; "
          f"restarts {done.get('restartCount')}")
    assert new.spec.node_name == NODE_NAME and not late, late
    assert done["currentStep"] == 800 and done.get("restartCount") == 1, jobs.describe(name)


def _said(logs: Path, what: str) -> str | None:
    """A container's logs once they say `what`, read from its node's disk (the API server cannot reach a
    cut-off kubelet)."""
    text = "".join(p.read_text(errors="replace") for p in sorted(logs.glob("*/*.log")))
    return text if what in text else None


def _stamp(line: str) -> datetime:
    """The time the kubelet put before a container log line (RFC 3339, nanoseconds)."""
    return datetime.fromisoformat(line.split(" ", 1)[0][:26].rstrip("Z") + "+00:00")


def _nodes_of(jobs: RealJobs, name: str) -> dict[int, str]:
    """Worker index -> node, for the job's scheduled pods not being deleted."""
    out = {}
    for p in jobs.pods(name):
        if p.spec.node_name and not p.metadata.deletion_timestamp:
            out[int(p.metadata.name.rsplit("-", 1)[1])] = p.spec.node_name
    return out


def _recovery(jobs: RealJobs, name: str, t0: float, step: int, worker: str, lost: str) -> dict[str, Any]:
    """When, after the fault at `t0`, the job first said so (a Warning Event), restarted, had a new `worker` pod
    (not the pod `lost`) Running, and passed the step it had reached."""
    seen: dict[str, Any] = {}
    before = {e.metadata.uid for e in jobs.events(name)}

    def look() -> bool:
        st = jobs.status(name)
        if "first sign" not in seen:
            warned = [e for e in jobs.events(name) if e.type == "Warning" and e.metadata.uid not in before]
            if warned:
                seen["first sign"] = elapsed(t0)
                seen["sign"] = f"{warned[0].reason}: {(warned[0].message or '')[:160]}"
        if "restart" not in seen and st.get("restartCount"):
            seen["restart"] = elapsed(t0)
        if st.get("restartCount", 0) >= 2 and "second restart" not in seen:
            seen["second restart"] = elapsed(t0)
        if "restart" in seen and "moved" not in seen:
            pod = _pod(jobs.core, jobs.ns, worker)
            if (pod is not None and pod.metadata.uid != lost and pod.status.phase == "Running"
                    and not pod.metadata.deletion_timestamp):
                seen["moved"], seen["moved to"] = elapsed(t0), pod.spec.node_name
        if "moved" in seen and progress_step(jobs.core, jobs.ns, name) > step:
            seen["next step"] = elapsed(t0)
            return True
        return st.get("phase") in ("Succeeded", "Failed")

    wait_for(look, 480, interval=0.5, what="the job to recover from the node's fault")
    assert "next step" in seen, f"{seen}\n{jobs.describe(name)}"
    return seen


def _pod(core: client.CoreV1Api, ns: str, name: str) -> client.V1Pod | None:
    try:
        return core.read_namespaced_pod(name, ns)
    except client.ApiException as exc:
        if exc.status == 404:
            return None
        raise
