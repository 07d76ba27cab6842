"""Pure builders: TrainingJob -> desired Pods, Service, ConfigMap, PVC, PodGroup."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from kubetrain.core import contract, launcher
from kubetrain.core.api import TrainingJob, TrainingJobSpec
from kubetrain.operator.jobs import builders as b
from kubetrain.operator.jobs import pod_facts

OWNER = {"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob", "name": "llm", "uid": "u-1",
         "controller": True, "blockOwnerDeletion": True}


RESTRICTED_POD = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def job(**spec) -> TrainingJob:
    return TrainingJob.model_validate(
        {"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
         "metadata": {"name": "llm", "namespace": "team-a"}, "spec": spec}
    )


def env_of(pod) -> dict[str, str]:
    return {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"] if "value" in e}


def env_from(pod) -> dict[str, dict]:
    """The variables that come from elsewhere (Downward API), by name."""
    return {e["name"]: e["valueFrom"] for e in pod["spec"]["containers"][0]["env"] if "valueFrom" in e}


def test_worker_pod_names_labels_contract_env():
    j = job(workers=4, resources={"gpusPerWorker": 8}, strategy="fsdp")
    pod = b.worker_pod(j, 2, 3, b.WorkerSettings(), OWNER)
    assert pod["metadata"]["name"] == "llm-worker-2"
    assert pod["metadata"]["labels"][b.LABEL_GENERATION] == "3"
    assert pod["metadata"]["labels"][b.LABEL_INDEX] == "2"
    assert pod["metadata"]["ownerReferences"] == [OWNER]
    assert (pod["spec"]["hostname"], pod["spec"]["subdomain"]) == ("llm-worker-2", "llm")
    assert pod["spec"]["restartPolicy"] == "OnFailure"  # in place by default: the kubelet restarts a failed worker
    env = env_of(pod)
    assert env["MASTER_ADDR"] == "llm-worker-0.llm.team-a.svc" == env["PET_MASTER_ADDR"]
    assert (env["WORLD_SIZE"], env["NODE_RANK"], env["PET_NPROC_PER_NODE"], env["PET_NNODES"]) == ("32", "2", "8", "4")
    assert "RANK" not in env  # 8 procs per pod: the entrypoint derives each process's rank
    assert env["KUBETRAIN_RESTART_GENERATION"] == "3"
    res = pod["spec"]["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == "8" == res["requests"]["nvidia.com/gpu"]
    shm = next(v for v in pod["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"


def test_single_process_worker_gets_its_rank():
    env = env_of(b.worker_pod(job(workers=2), 1, 0, b.WorkerSettings()))
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == ("1", "0", "2")


def test_worker_env_is_the_contracts_torch_env_of_the_whole_worker():
    for procs in (1, 4):
        env = env_of(b.worker_pod(job(workers=2, procsPerWorker=procs, command=["./train"]), 1, 0, b.WorkerSettings()))
        placement = contract.WorkerPlacement.worker(1, procs, 2)
        expected = contract.torch_env(placement, "llm-worker-0.llm.team-a.svc", contract.DEFAULT_MASTER_PORT)
        assert {k: env.get(k) for k in expected} == expected


def test_fabric_profile_adds_resources_caps_env_and_user_overrides_win():
    j = job(workers=2, fabric="efa", resources={"gpusPerWorker": 8, "extra": {"vpc.amazonaws.com/efa": "32"}},
            env=[{"name": "FI_PROVIDER", "value": "tcp"}, {"name": "MY_VAR", "value": "1"}])
    pod = b.worker_pod(j, 0, 0, b.WorkerSettings())
    c = pod["spec"]["containers"][0]
    assert c["resources"]["limits"]["vpc.amazonaws.com/efa"] == "32"  # user's amount, not the profile's 4
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"  # never dropped by the override
    assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    env = env_of(pod)
    assert env["FI_PROVIDER"] == "tcp" and env["MY_VAR"] == "1" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert [e["name"] for e in c["env"]].count("FI_PROVIDER") == 1


def test_scheduling_and_queue_pass_through():
    j = job(scheduling={"nodeSelector": {"pool": "h100"}, "tolerations": [{"key": "gpu", "operator": "Exists"}],
                        "priorityClassName": "high", "queue": "team-a", "gang": "volcano"})
    pod = b.worker_pod(j, 0, 0, b.WorkerSettings())
    assert pod["spec"]["nodeSelector"] == {"pool": "h100"}
    assert pod["spec"]["priorityClassName"] == "high"
    assert pod["spec"]["schedulerName"] == "volcano"
    assert contract.QUEUE_LABEL not in pod["metadata"]["labels"]  # Kueue admits the Workload, never a pod alone
    assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "llm"
    pg = b.pod_group(j, OWNER)
    assert pg["spec"] == {"minMember": 1, "queue": "team-a"} and pg["apiVersion"].startswith("scheduling.volcano.sh")
    assert b.pod_group(job()) is None


def checkpoint_volume(pod) -> dict:
    mount = next(m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["name"] == "checkpoints")
    assert mount["mountPath"] == "/checkpoints"
    return next(v for v in pod["spec"]["volumes"] if v["name"] == "checkpoints")


def test_checkpoints_go_to_a_claim_the_operator_creates_by_default():
    j = job(workers=4)
    pvc = b.checkpoint_claim(j, OWNER)
    assert pvc["metadata"]["name"] == "llm-checkpoints" and pvc["metadata"]["ownerReferences"] == [OWNER]
    assert pvc["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "10Gi"}}}
    assert "storageClassName" not in pvc["spec"]  # the cluster's default StorageClass
    for i in (0, 3):
        pod = b.worker_pod(j, i, 0, b.WorkerSettings(), OWNER)
        assert checkpoint_volume(pod) == {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "llm-checkpoints"}}
        # the trainer runs as 1000:1000 (trainer-image/Dockerfile): the group lets it write a fresh volume
        assert pod["spec"]["securityContext"] == {**RESTRICTED_POD, "fsGroup": 1000, "fsGroupChangePolicy": "OnRootMismatch"}


@pytest.mark.parametrize(
    ("workers", "mode", "expected"),
    [(1, None, "ReadWriteOnce"), (2, None, "ReadWriteMany"), (1, "ReadWriteOncePod", "ReadWriteOncePod"),
     (8, "ReadWriteOnce", "ReadWriteOnce"), (1, "ReadWriteMany", "ReadWriteMany")],
)
def test_claim_access_mode_follows_the_gang_unless_set(workers, mode, expected):
    ck = {"storageSize": "100Gi", "storageClassName": "fast", **({"accessMode": mode} if mode else {})}
    pvc = b.checkpoint_claim(job(workers=workers, checkpoint=ck))
    assert pvc["spec"]["accessModes"] == [expected]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "100Gi" and pvc["spec"]["storageClassName"] == "fast"


def test_existing_claim_is_mounted_and_none_created():
    j = job(workers=2, checkpoint={"claimName": "shared"})
    assert b.checkpoint_claim(j) is None and b.claim_name(j) == "shared"
    pod = b.worker_pod(j, 0, 0, b.WorkerSettings())
    assert checkpoint_volume(pod)["persistentVolumeClaim"]["claimName"] == "shared"
    assert pod["spec"]["securityContext"]["fsGroup"] == 1000


def test_ephemeral_checkpoints_stay_in_each_pod():
    j = job(workers=2, checkpoint={"ephemeral": True})
    assert b.checkpoint_claim(j) is None and b.claim_name(j) is None
    pod = b.worker_pod(j, 1, 0, b.WorkerSettings())
    assert checkpoint_volume(pod) == {"name": "checkpoints", "emptyDir": {}}
    assert pod["spec"]["securityContext"] == RESTRICTED_POD  # no fsGroup: an emptyDir is writable by everyone already


def test_object_storage_checkpoints_need_no_claim_and_take_the_secrets_keys():
    s3 = {"endpoint": "http://store:8333", "region": "us-east-1", "credentialsSecret": "ckpt-keys"}
    j = job(workers=2, checkpoint={"uri": "s3://bkt/runs/a"}, s3=s3)
    assert b.checkpoint_claim(j) is None and b.claim_name(j) is None
    pod = b.worker_pod(j, 1, 0, b.WorkerSettings())
    assert checkpoint_volume(pod) == {"name": "checkpoints", "emptyDir": {}}
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env[contract.CHECKPOINT_URI]["value"] == "s3://bkt/runs/a"
    assert env["AWS_ENDPOINT_URL_S3"]["value"] == "http://store:8333" and env["AWS_REGION"]["value"] == "us-east-1"
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "ckpt-keys", "key": "AWS_SECRET_ACCESS_KEY"}}
    assert env["AWS_SESSION_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"] is True
    identity = b.worker_pod(job(checkpoint={"uri": "s3://bkt"}), 0, 0, b.WorkerSettings())
    assert not any(e["name"].startswith("AWS_") for e in identity["spec"]["containers"][0]["env"])


MODEL_URI, TOKENIZER_URI = "s3://models/llama-1b", "s3://models/llama-1b-tok"


def _run_fetch_source(tmp_path: Path, *flags: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """The fetch container's `python3 -c` source, run by this interpreter with `flags`, its termination message in
    a file of tmp_path (made empty first, as the kubelet does): (exit code, stderr, termination message)."""
    log = tmp_path / "termination-log"
    log.write_text("")
    source = b.FETCH_COMMAND[2].replace(repr(contract.TERMINATION_LOG), repr(str(log)))
    proc = subprocess.run([sys.executable, *flags, "-c", source], capture_output=True, text=True, timeout=120,
                          check=False, env=env)
    return proc.returncode, proc.stderr, log.read_text()


def test_the_fetch_in_an_image_without_the_trainer_package_is_a_configuration_error_naming_spec_image(tmp_path):
    code, stderr, said = _run_fetch_source(tmp_path, "-S", "-I")  # no site-packages: no kubetrain, as a bare image
    assert code == contract.CONFIG_ERROR_EXIT_CODE, stderr
    assert said.startswith(f"{contract.CONFIG_ERROR_PREFIX}spec.image: ") and "No module named 'kubetrain'" in said
    assert said in stderr and len(said) <= pod_facts.SAID_LIMIT


def test_the_fetch_runs_the_fetch_module_where_the_image_has_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (contract.CONFIG, contract.CACHE_DIR)}
    code, stderr, said = _run_fetch_source(tmp_path, env=env)
    # kubetrain.trainer.data.fetch itself ran, as __main__: it found no config to read (its own configuration error).
    assert code == contract.CONFIG_ERROR_EXIT_CODE, stderr
    assert f"{contract.CONFIG_ERROR_PREFIX}{contract.CONFIG}: environment variable is not set" in stderr
    assert "spec.image" not in stderr


def test_every_worker_has_a_cache_and_only_a_job_that_fetches_has_the_fetch_init_container():
    plain = b.worker_pod(job(), 0, 0, b.WorkerSettings())
    assert {"name": contract.CACHE_VOLUME, "emptyDir": {}} in plain["spec"]["volumes"]
    trainer = plain["spec"]["containers"][0]
    assert {"name": contract.CACHE_VOLUME, "mountPath": contract.POD_CACHE_DIR} in trainer["volumeMounts"]
    assert env_of(plain)[contract.CACHE_DIR] == contract.POD_CACHE_DIR
    assert "initContainers" not in plain["spec"]
    s3 = {"endpoint": "http://store:8333", "credentialsSecret": "keys"}
    for spec in ({"model": {"hfUri": MODEL_URI}}, {"data": {"tokenizerUri": TOKENIZER_URI}}):
        pod = b.worker_pod(job(workers=2, s3=s3, resources={"gpusPerWorker": 8}, **spec), 1, 2, b.WorkerSettings())
        trainer = pod["spec"]["containers"][0]
        (fetch,) = pod["spec"]["initContainers"]
        assert fetch["name"] == contract.FETCH_CONTAINER and fetch["command"] == b.FETCH_COMMAND
        for key in ("image", "imagePullPolicy", "env", "volumeMounts", "resources", "securityContext"):
            assert fetch[key] == trainer[key], key
        env = {e["name"]: e for e in fetch["env"]}
        assert env[contract.CACHE_DIR]["value"] == contract.POD_CACHE_DIR
        assert env["AWS_ENDPOINT_URL_S3"]["value"] == "http://store:8333"
        assert env["AWS_ACCESS_KEY_ID"]["valueFrom"] == {"secretKeyRef": {"name": "keys", "key": "AWS_ACCESS_KEY_ID"}}
        assert "ports" not in fetch and "args" not in fetch


def test_the_fetch_runs_for_a_custom_command_after_the_sidecars_and_before_the_templates_init_containers():
    """A custom script finds the model in $KUBETRAIN_CACHE_DIR/model; a podTemplate init container may use it."""
    j = job(model={"hfUri": MODEL_URI}, command=["python3", "train.py"], fabric="tcpx", resources={"gpusPerWorker": 8},
            podTemplate={"spec": {
                "initContainers": [{"name": "unpack", "image": "busybox"},
                                   {"name": contract.FETCH_CONTAINER, "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}]}],
                "containers": [{"name": "trainer", "securityContext": {"runAsUser": 2000}}],
                "volumes": [{"name": contract.CACHE_VOLUME, "ephemeral": {"volumeClaimTemplate": {"spec": {}}}}]}})
    pod = b.worker_pod(j, 0, 0, b.WorkerSettings())
    trainer = pod["spec"]["containers"][0]
    assert trainer["command"][-2:] == ["python3", "train.py"]  # under the launcher: 8 processes
    assert [c["name"] for c in pod["spec"]["initContainers"]] == ["tcpx-daemon", contract.FETCH_CONTAINER, "unpack"]
    fetch = pod["spec"]["initContainers"][1]
    assert fetch["command"] == b.FETCH_COMMAND and fetch["securityContext"] == {"runAsUser": 2000}  # the trainer's
    assert {e["name"]: e.get("value") for e in fetch["env"]}["HF_HUB_OFFLINE"] == "1"  # theirs merged in
    (cache,) = [v for v in pod["spec"]["volumes"] if v["name"] == contract.CACHE_VOLUME]
    assert "emptyDir" not in cache and "ephemeral" in cache  # theirs replaces ours whole


def test_a_users_pod_security_context_is_kept_as_written():
    mine = {"runAsUser": 2000, "runAsGroup": 2000}
    pod = b.worker_pod(job(podTemplate={"spec": {"securityContext": mine}}), 0, 0, b.WorkerSettings())
    assert pod["spec"]["securityContext"] == mine
    assert checkpoint_volume(pod)["persistentVolumeClaim"]["claimName"] == "llm-checkpoints"


def test_the_default_worker_pod_meets_pod_security_restricted():
    pod = b.worker_pod(job(workers=2, checkpoint={"ephemeral": True}), 1, 0, b.WorkerSettings())
    assert pod["spec"]["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    (c,) = pod["spec"]["containers"]
    assert c["securityContext"] == RESTRICTED_CONTAINER
    assert b.FABRICS["none"].pod_security == "restricted"
    assert not any(k in pod["spec"] for k in ("hostNetwork", "hostPID", "hostIPC"))
    assert all("hostPort" not in port for port in c["ports"])
    assert {next(iter(set(v) - {"name"})) for v in pod["spec"]["volumes"]} <= {"configMap", "emptyDir"}


def test_a_users_empty_pod_security_context_wins_whole():
    pod = b.worker_pod(job(podTemplate={"spec": {"securityContext": {}}}), 0, 0, b.WorkerSettings())
    assert pod["spec"]["securityContext"] == {}  # theirs as written: no runAsNonRoot, no seccomp, no fsGroup
    assert pod["spec"]["containers"][0]["securityContext"] == RESTRICTED_CONTAINER  # the container's is another key


def test_a_users_trainer_container_security_context_wins_whole():
    """Merged, `privileged: true` would meet our allowPrivilegeEscalation: false: the API server refuses that pair."""
    mine = {"privileged": True}
    tmpl = {"spec": {"containers": [{"name": "trainer", "securityContext": mine}, {"name": "sidecar", "image": "x"}]}}
    pod = b.worker_pod(job(fabric="infiniband", podTemplate=tmpl), 0, 0, b.WorkerSettings())
    trainer, sidecar = pod["spec"]["containers"]
    assert trainer["securityContext"] == mine and "securityContext" not in sidecar
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True  # the pod's stays ours
    other = b.worker_pod(job(podTemplate={"spec": {"containers": [{"name": "sidecar", "image": "x"}]}}), 0, 0,
                         b.WorkerSettings())
    assert other["spec"]["containers"][0]["securityContext"] == RESTRICTED_CONTAINER


@pytest.mark.parametrize("fabric", ["infiniband", "roce", "efa"])
def test_a_fabric_that_adds_ipc_lock_keeps_drop_all_and_needs_privileged(fabric):
    pod = b.worker_pod(job(fabric=fabric), 0, 0, b.WorkerSettings())
    assert pod["spec"]["containers"][0]["securityContext"] == {
        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}}
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert b.FABRICS[fabric].pod_security == "privileged"  # IPC_LOCK is in neither restricted's nor baseline's list


@pytest.mark.parametrize(("added", "level"), [
    ((), "restricted"), (("NET_BIND_SERVICE",), "restricted"), (("CHOWN", "NET_BIND_SERVICE"), "baseline"),
    (("SYS_CHROOT",), "baseline"), (("IPC_LOCK",), "privileged"), (("SETUID", "SYS_ADMIN"), "privileged"),
])
def test_pod_security_level_is_the_strictest_that_admits_the_added_capabilities(added, level):
    assert b.pod_security_level(added) == level


def test_docs_name_each_fabric_profiles_pod_security_level():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "operator.md").read_text()
    for name, profile in b.FABRICS.items():
        row = next((line for line in docs.splitlines() if line.startswith(f"| `{name}` |")), None)
        assert row is not None and f"`{profile.pod_security}`" in row, (name, row)


def test_claim_rules_name_the_field():
    bad = TrainingJobSpec.model_validate({"checkpoint": {"ephemeral": True, "claimName": "x"}})
    assert [p for p, _ in bad.rule_violations()] == ["checkpoint.ephemeral"]
    both = TrainingJobSpec.model_validate({"checkpoint": {"uri": "s3://bkt/p", "claimName": "x"}})
    assert [p for p, _ in both.rule_violations()] == ["checkpoint.uri"]
    lone = TrainingJobSpec.model_validate({"s3": {"region": "eu-west-1"}})
    assert [p for p, _ in lone.rule_violations()] == ["s3"]
    with pytest.raises(ValidationError, match="uri"):
        TrainingJobSpec.model_validate({"checkpoint": {"uri": "s3://Bad_Bucket/p"}})
    rwop = TrainingJobSpec.model_validate({"workers": 2, "checkpoint": {"accessMode": "ReadWriteOncePod"}})
    assert rwop.rule_violations() == [
        ("checkpoint.accessMode", "checkpoint.accessMode ReadWriteOncePod lets one pod mount the claim: it needs workers 1")]
    assert TrainingJobSpec.model_validate({"checkpoint": {"accessMode": "ReadWriteOncePod"}}).rule_violations() == []
    with pytest.raises(ValidationError, match="storage_size|storageSize"):
        TrainingJobSpec.model_validate({"checkpoint": {"storageSize": "ten gigs"}})


def test_service_and_config_map():
    j = job(workers=3, strategy="deepspeed", deepspeed={"zeroStage": 3})
    svc = b.headless_service(j, OWNER)
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {b.LABEL_JOB: "llm"}
    cm = b.config_map(j, OWNER)
    assert json.loads(cm["data"]["config.json"])["deepspeed"]["zeroStage"] == 3


def test_the_config_names_only_what_the_job_sets_so_an_older_trainer_image_reads_it():
    j = job(workers=2, model={"dModel": 64}, checkpoint={"memory": {"everySteps": 7}})
    wire = json.loads(b.config_map(j, OWNER)["data"]["config.json"])
    # No default (parallelism, say, which an older image lacks) is written out.
    assert wire == {"workers": 2, "model": {"dModel": 64}, "checkpoint": {"memory": {"everySteps": 7}}}
    assert TrainingJobSpec.model_validate(wire) == j.spec  # the trainer's defaults fill in the rest


def test_custom_command_mode():
    c = b.worker_pod(job(command=["python", "train.py"], args=["--lr", "1e-4"]), 0, 0, b.WorkerSettings())
    c = c["spec"]["containers"][0]
    assert c["command"] == ["python", "train.py"] and c["args"] == ["--lr", "1e-4"]


def test_custom_command_with_several_procs_runs_under_the_configmap_launcher():
    j = job(workers=2, procsPerWorker=2, command=["python", "train.py"], args=["--lr", "1e-4"])
    pod = b.worker_pod(j, 1, 0, b.WorkerSettings())
    c = pod["spec"]["containers"][0]
    assert c["command"] == ["python3", "/etc/kubetrain/launcher.py", "--", "python", "train.py"]
    assert c["args"] == ["--lr", "1e-4"]
    assert {"name": "config", "mountPath": "/etc/kubetrain", "readOnly": True} in c["volumeMounts"]
    env = env_of(pod)  # the launcher sets RANK and LOCAL_RANK per process
    assert "RANK" not in env and "LOCAL_RANK" not in env
    assert (env["NODE_RANK"], env["PET_NPROC_PER_NODE"], env["WORLD_SIZE"]) == ("1", "2", "4")
    data = b.config_map(j, OWNER)["data"]
    core = Path(launcher.__file__).parent
    assert data["launcher.py"] == (core / "launcher.py").read_text()
    assert data["contract.py"] == (core / "contract.py").read_text()  # the launcher imports it from beside itself


def test_launcher_only_where_a_custom_command_has_several_procs():
    # None: the trainer image's entrypoint, which launches its own ranks; procsPerWorker 1: the command is the rank
    for spec, command in (({"procsPerWorker": 2}, None), ({"command": ["./train"], "procsPerWorker": 1}, ["./train"])):
        j = job(**spec)
        assert set(b.config_map(j)["data"]) == {"config.json"}
        assert b.worker_pod(j, 0, 0, b.WorkerSettings())["spec"]["containers"][0].get("command") == command
    assert env_of(b.worker_pod(job(command=["./train"]), 0, 0, b.WorkerSettings()))["RANK"] == "0"


def test_worker_pods_ask_for_one_dns_query_at_a_time_and_a_template_may_say_otherwise():
    pod = b.worker_pod(job(), 0, 0, b.WorkerSettings())
    assert pod["spec"]["dnsConfig"] == {"options": [{"name": "single-request-reopen"}]}
    mine = {"options": [{"name": "ndots", "value": "2"}]}
    pod = b.worker_pod(job(podTemplate={"spec": {"dnsConfig": mine}}), 0, 0, b.WorkerSettings())
    assert pod["spec"]["dnsConfig"]["options"] == [{"name": "ndots", "value": "2"}]


def test_a_pod_that_restarts_in_place_reads_its_generation_annotation_from_a_file():
    j = job(restartPolicy={"maxBackoffSeconds": 40, "inPlace": True})
    pod = b.worker_pod(j, 1, 3, b.WorkerSettings())
    assert pod["metadata"]["annotations"][contract.IN_PLACE_ANNOTATION] == "true"
    assert pod["metadata"]["annotations"][contract.GENERATION_ANNOTATION] == "3"
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "generation")
    assert volume["downwardAPI"]["items"] == [  # and where worker 0 is, once the operator knows (the same volume)
        {"path": "generation", "fieldRef": {"fieldPath": "metadata.annotations['kubetrain.io/restart-generation']"}},
        {"path": "master", "fieldRef": {"fieldPath": "metadata.annotations['kubetrain.io/master-address']"}}]
    c = pod["spec"]["containers"][0]
    assert {"name": "generation", "mountPath": b.GENERATION_MOUNT, "readOnly": True} in c["volumeMounts"]
    env = env_of(pod)
    assert env[contract.GENERATION_FILE] == f"{b.GENERATION_MOUNT}/generation"
    assert env[contract.MASTER_FILE] == f"{b.GENERATION_MOUNT}/master"
    assert env[contract.IN_PLACE_WAIT] == "100"  # maxBackoffSeconds + the margin
    # A failed worker's container restarts in its pod, and its launcher finds there what already ran.
    assert pod["spec"]["restartPolicy"] == "OnFailure"
    assert env[contract.RAN_FILE] == b.RAN_FILE and b.RAN_FILE.startswith(f"{b.OUTPUT_MOUNT}/")
    assert {"name": "output", "mountPath": b.OUTPUT_MOUNT} in c["volumeMounts"]
    assert {"name": "output", "emptyDir": {}} in pod["spec"]["volumes"]  # the pod's own, whatever the node has
    # Its launcher listens on the probe's port except while it waits after losing its peers.
    assert env[contract.GANG_PROBE_PORT] == "29499"
    assert c["readinessProbe"] == {"tcpSocket": {"port": 29499}, "periodSeconds": 1, "timeoutSeconds": 1,
                                   "successThreshold": 1, "failureThreshold": 1}


def test_each_worker_watches_the_next_two_round_the_ring_and_a_lone_worker_none():
    """contract.PEER_HOSTS: whom a worker's launcher asks while its ranks are quiet (hangs.PeerWatch)."""
    peers = [env_of(b.worker_pod(job(workers=4, restartPolicy={"inPlace": True}), i, 0, b.WorkerSettings()))
             .get(contract.PEER_HOSTS) for i in range(4)]
    assert peers[0] == "1=llm-worker-1.llm.team-a.svc,2=llm-worker-2.llm.team-a.svc"
    assert peers[3] == "0=llm-worker-0.llm.team-a.svc,1=llm-worker-1.llm.team-a.svc"
    assert contract.parse_peer_hosts(peers[3]) == {0: "llm-worker-0.llm.team-a.svc", 1: "llm-worker-1.llm.team-a.svc"}
    two = env_of(b.worker_pod(job(workers=2, restartPolicy={"inPlace": True}), 1, 0, b.WorkerSettings()))
    assert two[contract.PEER_HOSTS] == "0=llm-worker-0.llm.team-a.svc"
    alone = env_of(b.worker_pod(job(workers=1, restartPolicy={"inPlace": True}), 0, 0, b.WorkerSettings()))
    assert contract.GANG_PROBE_PORT in alone and contract.PEER_HOSTS not in alone
    assert contract.parse_peer_hosts("x=a,1=,2=b") == {2: "b"}


@pytest.mark.parametrize(("spec", "why"), [
    ({"podTemplate": {"spec": {"hostNetwork": True}}}, "another pod's launcher on the node could answer"),
    ({"podTemplate": {"spec": {"containers": [{"name": "trainer", "readinessProbe": {"exec": {"command": ["ok"]}}}]}}},
     "the user's own probe is kept whole"),
    ({"metricsPort": 29496, "procsPerWorker": 4}, "the metrics ports take 29499"),
])
def test_a_worker_restarting_in_place_has_no_gang_probe_where_its_port_is_not_its_own(spec, why):
    pod = b.worker_pod(job(restartPolicy={"inPlace": True}, **spec), 0, 0, b.WorkerSettings())
    probe = pod["spec"]["containers"][0].get("readinessProbe")
    assert probe is None or "tcpSocket" not in probe, why
    assert contract.GANG_PROBE_PORT not in env_of(pod), why
    assert contract.GENERATION_FILE in env_of(pod)  # it still restarts in place


@pytest.mark.parametrize("spec", [
    {"restartPolicy": {"inPlace": False}},
    {"checkpoint": {"ephemeral": True}},  # unset: off where it is not safe
    {"command": ["./train"]},  # a one-process command: only when asked
])
def test_a_pod_that_cannot_restart_in_place_has_no_generation_file(spec):
    pod = b.worker_pod(job(**spec), 0, 0, b.WorkerSettings())
    assert contract.IN_PLACE_ANNOTATION not in pod["metadata"]["annotations"]
    assert "generation" not in [v["name"] for v in pod["spec"]["volumes"]]
    assert contract.GENERATION_FILE not in env_of(pod)
    assert "readinessProbe" not in pod["spec"]["containers"][0]  # no launcher of generations to listen
    assert pod["spec"]["restartPolicy"] == "Never"  # a failed worker's pod ends and is recreated


def test_in_place_true_runs_a_one_process_command_under_the_launcher():
    j = job(command=["./train"], restartPolicy={"inPlace": True})
    c = b.worker_pod(j, 0, 0, b.WorkerSettings())["spec"]["containers"][0]
    assert c["command"] == ["python3", "/etc/kubetrain/launcher.py", "--", "./train"]
    assert set(b.config_map(j)["data"]) == {"config.json", *launcher.FILES}


def test_pod_template_override_merges_and_never_drops_kubetrain_pieces():
    j = job(resources={"gpusPerWorker": 8}, podTemplate={
        "metadata": {"labels": {"team": "nlp", b.LABEL_JOB: "hijack"}, "annotations": {"a": "b"}},
        "spec": {
            "runtimeClassName": "nvidia",
            "containers": [
                {"name": "trainer", "resources": {"limits": {"memory": "500Gi"}},
                 "env": [{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "WORLD_SIZE", "value": "1"}]},
                {"name": "sidecar", "image": "logger:1"},
            ],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "datasets"}}],
        },
    })
    pod = b.worker_pod(j, 0, 0, b.WorkerSettings())
    assert pod["metadata"]["labels"]["team"] == "nlp" and pod["metadata"]["labels"][b.LABEL_JOB] == "llm"
    assert pod["spec"]["runtimeClassName"] == "nvidia"
    trainer, sidecar = pod["spec"]["containers"]
    assert sidecar["name"] == "sidecar"
    assert trainer["resources"]["limits"] == {"nvidia.com/gpu": "8", "memory": "500Gi"}
    env = env_of(pod)
    assert env["NCCL_DEBUG"] == "INFO" and env["WORLD_SIZE"] == "1"  # user's value wins, documented
    assert {v["name"] for v in pod["spec"]["volumes"]} >= {"config", "dshm", "checkpoints", "data"}


def test_every_worker_knows_its_pod_through_the_downward_api():
    for i in (0, 3):
        pod = b.worker_pod(job(workers=4), i, 2, b.WorkerSettings())
        assert env_from(pod) == {
            contract.POD_NAME: {"fieldRef": {"fieldPath": "metadata.name"}},
            contract.POD_NAMESPACE: {"fieldRef": {"fieldPath": "metadata.namespace"}},
            contract.NODE_NAME: NODE_NAME_REF,
            contract.MEMORY_LIMIT: MEMORY_LIMIT_REF,
        }
    # progressReporting off: no pod identity, so the trainer does not try to annotate; the node (preflight) and
    # the memory limit (checkpoint/budget.py) stay
    assert env_from(b.worker_pod(job(progressReporting=False), 0, 0, b.WorkerSettings())) == {
        contract.NODE_NAME: NODE_NAME_REF, contract.MEMORY_LIMIT: MEMORY_LIMIT_REF}


NODE_NAME_REF = {"fieldRef": {"fieldPath": "spec.nodeName"}}
MEMORY_LIMIT_REF = {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1"}}


def test_progress_role_grants_get_patch_of_worker_0_only():
    role = b.progress_role(job(workers=4), OWNER)
    assert role["kind"] == "Role" and role["apiVersion"] == "rbac.authorization.k8s.io/v1"
    assert (role["metadata"]["name"], role["metadata"]["namespace"]) == ("llm-progress", "team-a")
    assert role["metadata"]["ownerReferences"] == [OWNER]  # garbage-collected with the job
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "resourceNames": ["llm-worker-0"],
                              "verbs": ["get", "patch"]}]
    assert b.progress_role(job(progressReporting=False)) is None


def test_progress_role_binding_names_the_jobs_own_service_account():
    """Only this job's pods run as `<job>-worker`: no other pod of the namespace may patch its worker 0."""
    rb = b.progress_role_binding(job(), OWNER)
    assert rb["kind"] == "RoleBinding" and rb["metadata"]["name"] == "llm-progress"
    assert rb["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "llm-progress"}
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": "llm-worker", "namespace": "team-a"}]
    assert rb["metadata"]["ownerReferences"] == [OWNER]
    assert b.worker_pod(job(), 0, 0, b.WorkerSettings())["spec"]["serviceAccountName"] == "llm-worker"
    sa = b.service_account(job(), OWNER)
    assert (sa["kind"], sa["metadata"]["name"], sa["automountServiceAccountToken"]) == ("ServiceAccount", "llm-worker", True)
    assert sa["metadata"]["ownerReferences"] == [OWNER]
    assert b.service_account(job(progressReporting=False))["automountServiceAccountToken"] is False  # no API call
    own = job(podTemplate={"spec": {"serviceAccountName": "trainer"}})  # where the PodPolicy allows it
    assert b.progress_role_binding(own)["subjects"][0]["name"] == "trainer"
    assert b.worker_pod(own, 0, 0, b.WorkerSettings())["spec"]["serviceAccountName"] == "trainer"
    assert b.service_account(own) is None
    assert b.progress_role_binding(job(progressReporting=False)) is None


def test_checkpoint_dir_is_where_pods_mount_the_claim():
    """A checkpoint.dir of the user's must not bypass the claim: the volume is mounted there."""
    job = TrainingJob.model_validate({"metadata": {"name": "j", "namespace": "ns"},
                                      "spec": {"workers": 2, "checkpoint": {"dir": "/ckpt/run1"}}})
    pod = b.worker_pod(job, 0, 0, b.WorkerSettings())
    c = pod["spec"]["containers"][0]
    assert {"name": "checkpoints", "mountPath": "/ckpt/run1"} in c["volumeMounts"]
    assert {"name": contract.CHECKPOINT_DIR, "value": "/ckpt/run1"} in c["env"]


@pytest.mark.parametrize(("cpu", "procs", "threads"), [("4", 2, "2"), ("500m", 1, "1"), ("8", 3, "2"), (None, 2, None)])
def test_worker_threads_share_the_pods_cpu_request(cpu, procs, threads):
    resources = {"cpu": cpu} if cpu else {}
    pod = b.worker_pod(job(resources=resources, procsPerWorker=procs), 0, 0, b.WorkerSettings())
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env.get("OMP_NUM_THREADS") == threads and env.get("MKL_NUM_THREADS") == threads


def test_the_jobs_own_thread_count_wins():
    pod = b.worker_pod(job(resources={"cpu": "8"}, env=[{"name": "OMP_NUM_THREADS", "value": "7"}]), 0, 0, b.WorkerSettings())
    env = [(e["name"], e.get("value")) for e in pod["spec"]["containers"][0]["env"]]
    assert env.count(("OMP_NUM_THREADS", "7")) == 1 and [n for n, _ in env].count("OMP_NUM_THREADS") == 1
    assert ("MKL_NUM_THREADS", "8") in env


MONITORING = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}


def test_no_network_policy_unless_the_operator_is_set_to_make_one():
    assert b.worker_network_policy(job(), None, OWNER) is None


def test_the_network_policy_admits_the_gang_and_anyone_to_the_metrics_port():
    np = b.worker_network_policy(job(workers=4), b.WorkerNetworkPolicy(), OWNER)
    assert (np["apiVersion"], np["kind"]) == ("networking.k8s.io/v1", "NetworkPolicy")
    assert np["metadata"]["name"] == "llm-workers" == b.network_policy_name("llm")
    assert np["metadata"]["namespace"] == "team-a" and np["metadata"]["ownerReferences"] == [OWNER]
    gang = {"matchLabels": {contract.LABEL_JOB: "llm"}}
    assert np["spec"]["podSelector"] == gang
    assert {"matchLabels": b.headless_service(job(), OWNER)["spec"]["selector"]} == gang  # the same pods
    assert np["spec"]["policyTypes"] == ["Ingress"]  # egress open: API server, object storage, DNS
    own, metrics = np["spec"]["ingress"]
    assert own == {"from": [{"podSelector": gang}]}  # no ports: rendezvous, NCCL and gloo alike
    assert metrics == {"ports": [{"protocol": "TCP", "port": 9400}]}  # no `from`: any source


def test_the_network_policy_admits_only_metrics_from_to_each_local_ranks_metrics_port():
    policy = b.WorkerNetworkPolicy(metrics_from=(MONITORING,))
    j = job(workers=2, procsPerWorker=2, metricsPort=9500, command=["python", "train.py"])
    np = b.worker_network_policy(j, policy)
    metrics = np["spec"]["ingress"][1]
    assert metrics == {"ports": [{"protocol": "TCP", "port": 9500, "endPort": 9501}], "from": [MONITORING]}
    assert metrics["from"][0] is not MONITORING  # the settings' peers are not shared with the object
    container = b.worker_pod(j, 0, 0, b.WorkerSettings())["spec"]["containers"][0]
    assert {"name": "metrics", "containerPort": 9500} in container["ports"]
    assert "ownerReferences" not in np["metadata"]
