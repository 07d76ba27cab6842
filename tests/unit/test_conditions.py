"""CheckpointsDurable and WorkersBlocked, from pod statuses shaped exactly as the kubelet and the scheduler
write them (containerd's and kube-scheduler's own messages)."""

from datetime import UTC, datetime, timedelta

import pytest

from kubetrain.core.api import TrainingJob
from kubetrain.operator.jobs import builders as b
from kubetrain.operator.jobs import conditions as c

UNSCHEDULABLE_AT = datetime(2026, 3, 1, 12, 0, 1, tzinfo=UTC)
NOW = UNSCHEDULABLE_AT + timedelta(seconds=30)
SCHEDULED = {"type": "PodScheduled", "status": "True", "lastProbeTime": None,
             "lastTransitionTime": "2026-03-01T12:00:01Z"}
NOT_READY = [
    {"type": "PodReadyToStartContainers", "status": "True", "lastProbeTime": None,
     "lastTransitionTime": "2026-03-01T12:00:03Z"},
    {"type": "Initialized", "status": "True", "lastProbeTime": None, "lastTransitionTime": "2026-03-01T12:00:01Z"},
    {"type": "Ready", "status": "False", "lastProbeTime": None, "lastTransitionTime": "2026-03-01T12:00:01Z",
     "reason": "ContainersNotReady", "message": "containers with unready status: [trainer]"},
    {"type": "ContainersReady", "status": "False", "lastProbeTime": None,
     "lastTransitionTime": "2026-03-01T12:00:01Z", "reason": "ContainersNotReady",
     "message": "containers with unready status: [trainer]"},
    SCHEDULED,
]
PULL = ('failed to pull and unpack image "ghcr.io/acme/trainer:v9": failed to resolve reference '
        '"ghcr.io/acme/trainer:v9": ghcr.io/acme/trainer:v9: not found')
NO_NODE_SELECTOR = ("0/4 nodes are available: 4 node(s) didn't match Pod's node affinity/selector. preemption: 0/4 "
                    "nodes are available: 4 Preemption is not helpful for scheduling.")
NO_GPU = ("0/4 nodes are available: 4 Insufficient nvidia.com/gpu. preemption: 0/4 nodes are available: "
          "4 No preemption victims found for incoming pod.")
UNBOUND = ("0/4 nodes are available: pod has unbound immediate PersistentVolumeClaims. preemption: 0/4 nodes are "
           "available: 4 Preemption is not helpful for scheduling.")


def job(**spec) -> TrainingJob:
    return TrainingJob.model_validate({"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                                       "metadata": {"name": "j", "namespace": "ns"}, "spec": {"workers": 2, **spec}})


def kubelet_waiting(reason: str, message: str | None, init: bool = False) -> dict:
    """A pod on a node whose container the kubelet keeps waiting (phase stays Pending)."""
    waiting = {"reason": reason} if message is None else {"reason": reason, "message": message}
    cs = {"name": "trainer", "state": {"waiting": waiting}, "lastState": {}, "ready": False, "restartCount": 0,
          "image": "ghcr.io/acme/trainer:v9", "imageID": "", "started": False}
    status = {"phase": "Pending", "conditions": NOT_READY, "hostIP": "10.0.0.5", "hostIPs": [{"ip": "10.0.0.5"}],
              "podIP": "10.88.0.12", "podIPs": [{"ip": "10.88.0.12"}], "startTime": "2026-03-01T12:00:01Z",
              "containerStatuses": [cs], "qosClass": "BestEffort"}
    if init:
        status["initContainerStatuses"] = [{**cs, "name": "fetch-data"}]
        status["containerStatuses"] = [{**cs, "state": {"waiting": {"reason": "PodInitializing"}}}]
    return status


def scheduler_unschedulable(message: str) -> dict:
    """What kube-scheduler writes on a pod it cannot place."""
    return {"phase": "Pending", "qosClass": "BestEffort", "conditions": [
        {"type": "PodScheduled", "status": "False", "lastProbeTime": None,
         "lastTransitionTime": "2026-03-01T12:00:01Z", "reason": "Unschedulable", "message": message}]}


def pod(i: int, status: dict, deleting: bool = False) -> dict:
    p = b.worker_pod(job(), i, 0, b.WorkerSettings())
    p["status"] = status
    if deleting:
        p["metadata"]["deletionTimestamp"] = "2026-03-01T12:00:09Z"
    return p


@pytest.mark.parametrize(
    ("status", "reason", "source", "message"),
    [
        (kubelet_waiting("ErrImagePull", PULL), "ImagePullFailed", "ErrImagePull", f"container trainer: {PULL}"),
        (kubelet_waiting("ImagePullBackOff", 'Back-off pulling image "ghcr.io/acme/trainer:v9"'),
         "ImagePullFailed", "ImagePullBackOff", 'container trainer: Back-off pulling image "ghcr.io/acme/trainer:v9"'),
        (kubelet_waiting("InvalidImageName", 'Failed to apply default image tag "ghcr.io/Acme/t": couldn\'t parse '
                         'image name "ghcr.io/Acme/t": invalid reference format: repository name must be lowercase'),
         "InvalidImageName", "InvalidImageName", "container trainer: Failed to apply default image tag"),
        (kubelet_waiting("CreateContainerConfigError", 'secret "hf-token" not found'),
         "ContainerConfigError", "CreateContainerConfigError", 'container trainer: secret "hf-token" not found'),
        (kubelet_waiting("CreateContainerError", "context deadline exceeded"),
         "ContainerCreateError", "CreateContainerError", "container trainer: context deadline exceeded"),
        (kubelet_waiting("ErrImagePull", None, init=True), "ImagePullFailed", "ErrImagePull",
         "container fetch-data: ErrImagePull"),
        (scheduler_unschedulable(NO_NODE_SELECTOR), "Unschedulable", "Unschedulable", NO_NODE_SELECTOR),
        (scheduler_unschedulable(UNBOUND), "Unschedulable", "Unschedulable", UNBOUND),
    ],
)
def test_blocked_pod_reads_kubelet_and_scheduler_status(status, reason, source, message):
    got = c.blocked_pod(pod(1, status), NOW)
    assert (got.pod, got.reason, got.source) == ("j-worker-1", reason, source)
    assert got.message.startswith(message)


@pytest.mark.parametrize(
    "status",
    [
        kubelet_waiting("ContainerCreating", None),  # slow, not stuck
        {"phase": "Pending"},  # not looked at by the scheduler yet
        {"phase": "Pending", "conditions": [{**SCHEDULED, "status": "False", "reason": "SchedulingGated"}]},
        {"phase": "Running", "conditions": [SCHEDULED]},
        {**kubelet_waiting("ErrImagePull", PULL), "phase": "Failed"},
    ],
)
def test_pods_that_are_starting_or_past_it_are_not_blocked(status):
    assert c.blocked_pod(pod(0, status), NOW) is None


def test_a_pod_being_deleted_is_not_blocked():
    assert c.blocked_pod(pod(0, scheduler_unschedulable(NO_GPU), deleting=True), NOW) is None


def test_condition_names_each_reason_with_its_first_pod_in_worker_order():
    pods = [pod(i, scheduler_unschedulable(NO_GPU)) for i in (3, 2)] + [pod(1, kubelet_waiting("ErrImagePull", PULL))]
    want = c.workers_blocked(job(workers=4), c.blocked_pods(pods, NOW))
    assert (want.type, want.value, want.reason) == ("WorkersBlocked", True, "ImagePullFailed")
    assert want.message == (
        f"worker pods cannot start; the job waits: j-worker-1 cannot pull its image: container trainer: {PULL}; "
        f"j-worker-2 cannot be scheduled: {NO_GPU} (and 1 more pod(s) alike)")


def test_nothing_blocked_clears_the_condition():
    want = c.workers_blocked(job(), c.blocked_pods([pod(0, {"phase": "Running"})], NOW))
    assert (want.value, want.reason) == (False, "WorkersStarting")


@pytest.mark.parametrize(
    ("spec", "message", "claim_phase", "reason", "note"),
    [
        ({}, UNBOUND, "Pending", "CheckpointClaimPending", "the checkpoint claim j-checkpoints is Pending, not bound"),
        ({}, UNBOUND, "Missing", "CheckpointClaimPending", "the checkpoint claim j-checkpoints does not exist"),
        ({"checkpoint": {"claimName": "team"}}, UNBOUND, "Pending", "CheckpointClaimPending",
         "the checkpoint claim team is Pending"),
        ({}, UNBOUND, "Bound", "Unschedulable", None),
        ({}, UNBOUND, None, "Unschedulable", None),  # not looked up
        # WaitForFirstConsumer: the claim waits for the pod, not the other way round; the GPUs are the problem
        ({}, NO_GPU, "Pending", "Unschedulable", None),
        ({"checkpoint": {"ephemeral": True}}, UNBOUND, "Pending", "Unschedulable", None),
    ],
)
def test_a_pending_claim_is_named_when_pods_wait_for_it(spec, message, claim_phase, reason, note):
    blocked = c.blocked_pods([pod(0, scheduler_unschedulable(message))], NOW)
    want = c.workers_blocked(job(**spec), blocked, claim_phase)
    assert want.reason == reason
    assert want.message.startswith(f"worker pods cannot start; the job waits: {note}" if note else
                                   "worker pods cannot start; the job waits: j-worker-0 cannot be scheduled: ")
    assert message in want.message


def test_claim_lookup_only_while_pods_wait_for_a_volume():
    assert c.waits_for_volume(c.blocked_pods([pod(0, scheduler_unschedulable(UNBOUND))], NOW))
    assert not c.waits_for_volume(c.blocked_pods([pod(0, scheduler_unschedulable(NO_GPU))], NOW))
    assert not c.waits_for_volume(c.blocked_pods([pod(0, kubelet_waiting("ErrImagePull", PULL))], NOW))


def test_checkpoints_durable_says_where_checkpoints_live():
    default = c.checkpoints_durable(job())
    assert (default.value, default.reason) == (True, "DefaultClaim")
    assert "j-checkpoints (10Gi, ReadWriteMany)" in default.message
    user = c.checkpoints_durable(job(checkpoint={"claimName": "team"}))
    assert (user.value, user.reason) == (True, "UserClaim") and "team" in user.message
    bucket = c.checkpoints_durable(job(checkpoint={"uri": "s3://bkt/runs"}))
    assert (bucket.value, bucket.reason) == (True, "ObjectStore") and "s3://bkt/runs" in bucket.message
    eph = c.checkpoints_durable(job(checkpoint={"ephemeral": True}))
    assert (eph.type, eph.value, eph.reason) == ("CheckpointsDurable", False, "EphemeralCheckpoints")
    assert "lost" in eph.message and "every gang restart starts over from step 0" in eph.message
    assert "spec.checkpoint.claimName" in eph.message and "drop spec.checkpoint.ephemeral" in eph.message


def test_announce_once_per_distinct_bad_state():
    blocked = c.Want("WorkersBlocked", True, "Unschedulable", "m", bad_value=True)
    assert c.announce([], blocked)
    same = [{"type": "WorkersBlocked", "status": "True", "reason": "Unschedulable", "message": "other pod"}]
    assert not c.announce(same, blocked)
    assert c.announce(same, c.Want("WorkersBlocked", True, "ImagePullFailed", "m", bad_value=True))
    cleared = [{**same[0], "status": "False"}]
    assert c.announce(cleared, blocked)  # blocked again after it had cleared
    assert not c.announce(same, c.Want("WorkersBlocked", False, "WorkersStarting", "m", bad_value=True))
    eph = c.checkpoints_durable(job(checkpoint={"ephemeral": True}))
    assert c.announce([], eph)
    assert not c.announce([{"type": "CheckpointsDurable", "status": "False", "reason": eph.reason}], eph)
    assert not c.announce([], c.checkpoints_durable(job()))  # durable is no warning


def test_unschedulable_counts_only_after_a_grace_while_claims_and_nodes_settle():
    """A claim being provisioned makes the scheduler fail a pod for a few seconds: not news yet."""
    unbound = pod(0, scheduler_unschedulable(UNBOUND))
    assert c.blocked_pod(unbound, UNSCHEDULABLE_AT + timedelta(seconds=3)) is None
    assert c.recheck_after([unbound], UNSCHEDULABLE_AT + timedelta(seconds=3)) == pytest.approx(7.5)
    assert c.blocked_pod(unbound, UNSCHEDULABLE_AT + c.UNSCHEDULABLE_GRACE).reason == "Unschedulable"
    assert c.recheck_after([unbound], NOW) is None
    pulling = pod(0, kubelet_waiting("ErrImagePull", PULL))  # the kubelet's verdicts count at once
    assert c.blocked_pod(pulling, UNSCHEDULABLE_AT).reason == "ImagePullFailed"
