"""Gang scheduling and topology on the real API server, with the PodGroup CRDs that Volcano and
scheduler-plugins ship in their Go modules (tests/support/gang.py downloads them).

Neither Volcano's scheduler nor scheduler-plugins' runs in the test cluster (each is a large build of
its own): the volcano and coscheduling tests check what the operator creates and that the API server
accepts it against the schedulers' own schemas (the PodGroup's minMember, minResources and owner; the
pods' schedulerName, group label and annotation). Those pods stay Pending, unbound, as no scheduler
serves their schedulerName; the cluster's kube-scheduler leaves them alone.

`gang: kubernetes` is the cluster's own kube-scheduler (hack/cluster-up.sh enables its alpha gang
scheduling): there the test sees the real scheduler bind all workers or none. The topology test runs
on the real kube-scheduler too, with kwok nodes of its own in two labelled domains.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from support import gang
from support.cluster import kubeconfig_path
from support.conditions import condition
from support.jobs import TrainingJobs
from support.kwok import fake_node_manifest, kwok_job
from support.operator_process import OperatorProcess
from support.resources import not_found_ok
from support.waiting import wait_for

from kubetrain.core import api, contract
from kubetrain.operator.runtime.settings import COSCHEDULING_SCHEDULER

REQUESTS = {"gpusPerWorker": 1, "cpu": "500m", "memory": "1Gi"}
GROUPS = {"volcano": ("scheduling.volcano.sh", "v1beta1"), "coscheduling": ("scheduling.x-k8s.io", "v1alpha1"),
          "kubernetes": ("scheduling.k8s.io", "v1alpha2")}


@pytest.fixture(scope="module")
def operator(crd: None, kube_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    with OperatorProcess(kubeconfig_path(), tmp_path_factory.mktemp("operator") / "operator.log") as op:
        yield op


@pytest.fixture(scope="module")
def gang_crds_available() -> None:
    if not gang.available():
        pytest.skip("no Go toolchain to download the PodGroup CRDs (go mod download) and none cached")


def pod_group(admin_api: client.ApiClient, gang_name: str, ns: str, name: str) -> dict[str, Any]:
    group, version = GROUPS[gang_name]
    return dict(client.CustomObjectsApi(admin_api).get_namespaced_custom_object(group, version, ns, "podgroups", name))


def pods_of_generation(jobs: TrainingJobs, name: str, generation: int, count: int) -> list[client.V1Pod]:
    def made() -> list[client.V1Pod] | None:
        pods = [p for p in jobs.pods(name) if p.metadata.labels.get(contract.LABEL_GENERATION) == str(generation)
                and not p.metadata.deletion_timestamp]
        return pods if len(pods) == count else None
    try:
        return wait_for(made, 90, what=f"{count} pods of {name}, generation {generation}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{jobs.explain(name)}") from exc


def assert_gang_pods(pods: list[client.V1Pod], name: str, scheduler: str) -> None:
    for pod in pods:
        assert pod.spec.scheduler_name == scheduler
        assert pod.metadata.labels[contract.GANG_GROUP_LABEL] == name
        assert pod.metadata.annotations[contract.GANG_GROUP_ANNOTATION] == name
        assert pod.spec.node_name is None and pod.status.phase == "Pending"  # nobody serves that scheduler


def test_each_gang_creates_its_pod_group_and_keeps_it_through_restarts_and_resizes(
        admin_api: client.ApiClient, core_v1: client.CoreV1Api, namespace: str, operator: OperatorProcess,
        gang_crds_available: None) -> None:
    for source in gang.SOURCES.values():
        gang.install(admin_api, source)
    jobs = TrainingJobs(admin_api, namespace, operator)
    schedulers = {"volcano": "volcano", "coscheduling": COSCHEDULING_SCHEDULER}
    for gang_name in schedulers:
        jobs.submit(kwok_job(f"g-{gang_name}", {"workers": 2, "resources": REQUESTS,
                                                "scheduling": {"gang": gang_name}}))
    for gang_name, scheduler in schedulers.items():
        name = f"g-{gang_name}"
        pods = pods_of_generation(jobs, name, 0, 2)
        group = pod_group(admin_api, gang_name, namespace, name)
        assert group["spec"]["minMember"] == 2
        assert group["spec"]["minResources"] == {"cpu": "1000m", "memory": "2Gi", "nvidia.com/gpu": "2"}
        owner = group["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["uid"]) == (api.KIND, name, jobs.get(name)["metadata"]["uid"])
        assert_gang_pods(pods, name, scheduler)

    # A new generation (a deleted worker restarts the gang; here at a new size) is gang-scheduled too,
    # by the same PodGroup, which takes the new size.
    name = "g-coscheduling"
    uid = pod_group(admin_api, "coscheduling", namespace, name)["metadata"]["uid"]
    jobs.patch_spec(name, {"workers": 3})
    pods = pods_of_generation(jobs, name, 1, 3)
    assert_gang_pods(pods, name, COSCHEDULING_SCHEDULER)
    group = pod_group(admin_api, "coscheduling", namespace, name)
    assert group["metadata"]["uid"] == uid
    assert group["spec"]["minMember"] == 3
    assert group["spec"]["minResources"] == {"cpu": "1500m", "memory": "3Gi", "nvidia.com/gpu": "3"}
    core_v1.delete_namespaced_pod(f"{name}-worker-0", namespace)
    assert_gang_pods(pods_of_generation(jobs, name, 2, 3), name, COSCHEDULING_SCHEDULER)
    assert pod_group(admin_api, "coscheduling", namespace, name)["metadata"]["uid"] == uid


def blocked(status: dict[str, Any]) -> dict[str, Any] | None:
    return condition(status, api.WORKERS_BLOCKED)


def test_without_its_crd_a_gang_job_waits_with_a_condition_and_one_event_then_starts_once_installed(
        admin_api: client.ApiClient, namespace: str, operator: OperatorProcess, gang_crds_available: None) -> None:
    gang.crd_file(gang.VOLCANO)  # downloaded before the clock of the test starts
    gang.uninstall(admin_api, gang.VOLCANO)
    jobs = TrainingJobs(admin_api, namespace, operator)
    jobs.submit(kwok_job("nocrd", {"workers": 2, "resources": REQUESTS, "scheduling": {"gang": "volcano"}}))
    status = jobs.wait_status("nocrd", lambda s: (c := blocked(s)) and c["reason"] == "GangSchedulerMissing",
                              60, what="WorkersBlocked=GangSchedulerMissing")
    condition = blocked(status)
    assert condition is not None and condition["status"] == "True"
    assert "podgroups.scheduling.volcano.sh" in condition["message"] and "gang: none" in condition["message"]
    # The operator retries with backoff (2 s, 4 s, ...): a few retries pass, with no pod and no new Event.
    _let_retries_pass(jobs, "nocrd", seconds=7)
    assert jobs.pods("nocrd") == []
    warnings = [e for e in jobs.events("nocrd") if e.reason == "GangSchedulerMissing"]
    assert len(warnings) == 1 and warnings[0].type == "Warning"
    assert "podgroups.scheduling.volcano.sh" in warnings[0].message

    gang.install(admin_api, gang.VOLCANO)
    pods = pods_of_generation(jobs, "nocrd", 0, 2)
    assert_gang_pods(pods, "nocrd", "volcano")
    assert pod_group(admin_api, "volcano", namespace, "nocrd")["spec"]["minMember"] == 2
    jobs.wait_status("nocrd", lambda s: (c := blocked(s)) is None or c["reason"] != "GangSchedulerMissing", 30,
                     what="GangSchedulerMissing cleared")


def _let_retries_pass(jobs: TrainingJobs, name: str, seconds: float) -> None:
    """Watch the job for ``seconds``: it must create no pod meanwhile."""
    try:
        wait_for(lambda: jobs.pods(name), seconds, interval=0.5, what="no pod while the CRD is missing")
    except AssertionError:
        return
    raise AssertionError(f"{name} created pods without its PodGroup: {[p.metadata.name for p in jobs.pods(name)]}")


@pytest.fixture(scope="module")
def in_tree_gang(admin_api: client.ApiClient) -> None:
    """The cluster serves scheduling.k8s.io/v1alpha2 (hack/cluster-up.sh enables it; a cluster started
    before that does not): skipped where it does not, never under CI=true."""
    groups = client.ApisApi(admin_api).get_api_versions().groups
    if any(v.group_version == "scheduling.k8s.io/v1alpha2" for g in groups for v in g.versions):
        return
    why = "the cluster does not serve scheduling.k8s.io/v1alpha2: restart it (hack/cluster-down.sh, hack/cluster-up.sh)"
    if os.environ.get("CI") == "true":
        pytest.fail(why, pytrace=False)
    pytest.skip(why)


def add_gpu_node(core_v1: client.CoreV1Api, name: str, pool: str) -> None:
    core_v1.create_node(fake_node_manifest(name, gpus=1, rdma=0, labels={POOL_LABEL: pool}))


def raw_pods(core_v1: client.CoreV1Api, ns: str, job: str) -> list[dict[str, Any]]:
    """The job's pods as the API server's JSON (the client's models lack spec.schedulingGroup)."""
    resp = core_v1.list_namespaced_pod(ns, label_selector=f"{contract.LABEL_JOB}={job}", _preload_content=False)
    return list(json.loads(resp.data)["items"])


def unschedulable(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "PodScheduled" and c["status"] == "False" for c in pod["status"].get("conditions") or [])


def test_the_kube_scheduler_binds_all_workers_of_a_kubernetes_gang_or_none(
        admin_api: client.ApiClient, core_v1: client.CoreV1Api, namespace: str, operator: OperatorProcess,
        in_tree_gang: None) -> None:
    pool = uuid.uuid4().hex[:6]
    nodes = [f"kwok-gang-{pool}-{i}" for i in range(2)]
    try:
        add_gpu_node(core_v1, nodes[0], pool)  # room for one worker of two
        jobs = TrainingJobs(admin_api, namespace, operator)
        jobs.submit(kwok_job("kgang", {"workers": 2, "resources": {"gpusPerWorker": 1},
                                       "scheduling": {"gang": "kubernetes", "nodeSelector": {POOL_LABEL: pool}}}))
        pods_of_generation(jobs, "kgang", 0, 2)
        group = pod_group(admin_api, "kubernetes", namespace, "kgang-0")
        assert group["spec"]["schedulingPolicy"] == {"gang": {"minCount": 2}}
        assert group["metadata"]["ownerReferences"][0]["uid"] == jobs.get("kgang")["metadata"]["uid"]
        pods = raw_pods(core_v1, namespace, "kgang")
        assert {p["spec"]["schedulingGroup"]["podGroupName"] for p in pods} == {"kgang-0"}
        # The scheduler has tried both (PodScheduled=False) and bound neither, though one would fit.
        wait_for(lambda: all(unschedulable(p) for p in raw_pods(core_v1, namespace, "kgang")), 60,
                 what="both workers tried by the scheduler")
        _let_retries_pass_unbound(core_v1, namespace, "kgang", seconds=5)
        add_gpu_node(core_v1, nodes[1], pool)
        bound = wait_for(lambda: (ps := raw_pods(core_v1, namespace, "kgang")) and
                         all(p["spec"].get("nodeName") for p in ps) and ps, 90, what="the whole gang bound")
        assert sorted(p["spec"]["nodeName"] for p in bound) == nodes
    finally:
        for node in nodes:
            with not_found_ok():
                core_v1.delete_node(node)


def _let_retries_pass_unbound(core_v1: client.CoreV1Api, ns: str, job: str, seconds: float) -> None:
    """Watch the job's pods for ``seconds``: none may be bound meanwhile."""
    def any_bound() -> list[str]:
        return [p["metadata"]["name"] for p in raw_pods(core_v1, ns, job) if p["spec"].get("nodeName")]
    try:
        found = wait_for(any_bound, seconds, interval=0.5, what="no worker bound")
    except AssertionError:
        return
    raise AssertionError(f"{found} bound while the gang cannot be placed whole")


BLOCK_LABEL = "kubetrain.io/test-network-block"
POOL_LABEL = "kubetrain.io/topology-test"


@pytest.fixture
def two_blocks(core_v1: client.CoreV1Api) -> Iterator[str]:
    """Four kwok nodes of one GPU each, two per network block (BLOCK_LABEL block-a and block-b), labelled
    POOL_LABEL with a value of their own so that only the test's job lands there. In each block one node
    is large and one small: the scheduler's scores (least allocated, and its default spreading of a
    Service's pods over nodes) put a second worker on the other block's large node unless the topology
    keeps it in the first worker's block."""
    pool = uuid.uuid4().hex[:6]
    shapes = {"big": {"cpu": "96", "memory": "1Ti"}, "small": {"cpu": "2", "memory": "4Gi"}}
    names = {f"kwok-topo-{pool}-{block}-{size}": (block, size) for block in "ab" for size in shapes}
    for node, (block, size) in names.items():
        labels = {POOL_LABEL: pool, BLOCK_LABEL: f"block-{block}"}
        core_v1.create_node(fake_node_manifest(node, gpus=1, rdma=0, labels=labels, **shapes[size]))
    try:
        yield pool
    finally:
        for node in names:
            with not_found_ok():
                core_v1.delete_node(node)


def test_a_topology_key_keeps_the_gang_within_one_block(
        admin_api: client.ApiClient, core_v1: client.CoreV1Api, namespace: str, operator: OperatorProcess,
        two_blocks: str) -> None:
    jobs = TrainingJobs(admin_api, namespace, operator)
    jobs.submit(kwok_job("topo", {"workers": 2, "resources": {"gpusPerWorker": 1, "cpu": "1", "memory": "1Gi"},
                                  "scheduling": {"nodeSelector": {POOL_LABEL: two_blocks},
                                                 "topologyKey": BLOCK_LABEL}}))

    def bound() -> list[client.V1Pod] | None:
        pods = jobs.pods("topo")
        return pods if len(pods) == 2 and all(p.spec.node_name for p in pods) else None

    pods = wait_for(bound, 90, what="both workers bound")
    nodes = {p.spec.node_name for p in pods}
    blocks = {core_v1.read_node(n).metadata.labels[BLOCK_LABEL] for n in nodes}
    assert len(nodes) == 2 and len(blocks) == 1, f"workers on {nodes} in {blocks}"
