"""Pure builders: a TrainingJob in, the desired child objects (plain dicts) out.

No API calls and no clock here. Children are named deterministically so that a
create is idempotent (409 means it is already there):
  Service       <job>             headless, rendezvous DNS <job>-worker-<i>.<job>.<ns>.svc
  ConfigMap     <job>-config      config.json: the spec the trainer reads; launcher.py + contract.py for custom commands
  Pod           <job>-worker-<i>  one per worker, labelled with its restart generation; passes Pod Security
                                  `restricted` unless its fabric adds capabilities (FabricProfile.pod_security);
                                  with model.hfUri or data.tokenizerUri its init container `fetch` fills the
                                  cache emptyDir before the trainer starts
  PVC           <job>-checkpoints unless checkpoint.claimName, checkpoint.ephemeral or checkpoint.uri is set
  Role          <job>-progress    get/patch of the pod <job>-worker-0 only (progressReporting)
  RoleBinding   <job>-progress    that Role for the workers' ServiceAccount
  NetworkPolicy <job>-workers     with the operator's workerNetworkPolicy: ingress to the workers from the
                                  gang's own pods, and to their metrics ports from metricsFrom
  PodGroup      <job>             for the gang scheduler of scheduling.gang (volcano, coscheduling), kept
                                  across restart generations; <job>-<generation> for gang kubernetes
"""

from __future__ import annotations

import copy
import json
import textwrap
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from typing import Any

from kubetrain.core import contract, hangs, launcher, pod_template, workdir
from kubetrain.core.api import GPU_RESOURCE, TrainingJob, TrainingJobSpec
from kubetrain.core.contract import (  # also read as builders.LABEL_JOB etc. by the operator's other modules
    CONTAINER,
    LABEL_GENERATION,
    LABEL_INDEX,
    LABEL_JOB,
    LABEL_ROLE,
)
from kubetrain.core.pod_template import merge
from kubetrain.core.quantity import add_quantities, quantity_value, scale_quantity
from kubetrain.operator.jobs import fabrics

# Re-exported: tests, docs and other modules read them as builders.FABRICS etc.
from kubetrain.operator.jobs.fabrics import ADDABLE_CAPABILITIES as ADDABLE_CAPABILITIES
from kubetrain.operator.jobs.fabrics import FABRICS as FABRICS
from kubetrain.operator.jobs.fabrics import POD_SECURITY_LEVELS as POD_SECURITY_LEVELS
from kubetrain.operator.jobs.fabrics import FabricProfile
from kubetrain.operator.jobs.fabrics import pod_security_level as pod_security_level
from kubetrain.operator.runtime.settings import WorkerNetworkPolicy, WorkerSettings

CHECKPOINT_MOUNT = contract.CHECKPOINT_MOUNT
CONFIG_MOUNT = contract.CONFIG_MOUNT
OUTPUT_MOUNT = contract.OUTPUT_MOUNT
GENERATION_MOUNT = contract.GENERATION_MOUNT
"""A pod that restarts in place: the Downward API volume with its generation annotation, file `generation`."""
RAN_FILE = f"{OUTPUT_MOUNT}/ran-generation"
"""contract.RAN_FILE in a pod: in kubetrain's own emptyDir, which outlives a restarted container and which,
unlike /dev/shm, no podTemplate replaces with a host directory that other pods on the node share."""
TRAINER_GID = 1000
"""The trainer image's group (trainer-image/Dockerfile: USER 1000:1000): fsGroup of the checkpoint claim."""
HOSTNAME_LABEL = "kubernetes.io/hostname"
"""The node label restartPolicy.avoidDegradedNodes keeps worker pods off (its value: the node's name, as a rule)."""
VOLCANO_SCHEDULER = "volcano"
"""The scheduler name Volcano's scheduler serves (its chart's default)."""


@dataclass(frozen=True)
class Gang:
    """What one value of scheduling.gang asks of the cluster."""

    api_version: str
    """The PodGroup's apiVersion."""
    needs: str
    """What must serve that kind: a CustomResourceDefinition, or a built-in API."""
    fix: str
    """How to make the cluster serve it."""
    per_generation: bool = False
    """One PodGroup per restart generation (`<job>-<generation>`; its spec is immutable), else one `<job>`
    kept for the job's life."""


GANGS: dict[str, Gang] = {
    "volcano": Gang("scheduling.volcano.sh/v1beta1", "the CustomResourceDefinition podgroups.scheduling.volcano.sh",
                    "install Volcano (volcano.sh; its chart installs the CRDs and the scheduler `volcano`)"),
    "coscheduling": Gang("scheduling.x-k8s.io/v1alpha1", "the CustomResourceDefinition podgroups.scheduling.x-k8s.io",
                         "install scheduler-plugins (sigs.k8s.io/scheduler-plugins: manifests/coscheduling/crd.yaml, "
                         "and a scheduler running the Coscheduling plugin)"),
    "kubernetes": Gang("scheduling.k8s.io/v1alpha2", "the built-in API scheduling.k8s.io/v1alpha2 (Kubernetes 1.36)",
                       "enable the feature gates GenericWorkload and GangScheduling on kube-apiserver and "
                       "kube-scheduler, and --runtime-config=scheduling.k8s.io/v1alpha2=true on kube-apiserver",
                       per_generation=True),
}
"""scheduling.gang values other than none, by name."""


def worker_name(job: str, index: int) -> str:
    return f"{job}-worker-{index}"


def service_name(job: str) -> str:
    return job


def worker_host(job: str, namespace: str, index: int) -> str:
    """A worker's name in the cluster's DNS, under the job's headless Service."""
    return f"{worker_name(job, index)}.{service_name(job)}.{namespace}.svc"


def config_name(job: str) -> str:
    return f"{job}-config"


def default_claim_name(job: str) -> str:
    return f"{job}-checkpoints"


def claim_name(job: TrainingJob) -> str | None:
    """The claim every worker mounts at /checkpoints: the user's, else the operator's; None when ephemeral or in
    object storage (checkpoint.uri: each pod stages its part in its own emptyDir)."""
    ck = job.spec.checkpoint
    if ck.claim_name:
        return ck.claim_name
    return None if ck.ephemeral or ck.uri else default_claim_name(job.metadata.name)


def claim_access_mode(spec: TrainingJobSpec) -> str:
    """checkpoint.accessMode, else ReadWriteOnce for one worker and ReadWriteMany for a gang that shares it."""
    return spec.checkpoint.access_mode or ("ReadWriteOnce" if spec.workers == 1 else "ReadWriteMany")


def checkpoint_mount(spec: TrainingJobSpec) -> str:
    """Where pods mount the checkpoint volume: checkpoint.dir when set, so that it always lies on the claim."""
    return spec.checkpoint.dir or CHECKPOINT_MOUNT


def progress_rbac_name(job: str) -> str:
    return f"{job}-progress"


def own_service_account_name(job: str) -> str:
    return f"{job}-worker"


def _named_service_account(job: TrainingJob) -> str | None:
    """podTemplate.spec.serviceAccountName (or its old name), where the operator's PodPolicy let the job set one."""
    template = job.spec.pod_template or {}
    key = pod_template.service_account_key(template)
    return None if key is None else str(template["spec"][key])


def worker_service_account(job: TrainingJob) -> str:
    """The ServiceAccount the worker pods run as: the podTemplate's, else the job's own `<job>-worker`, which
    only this job's pods hold (the progress Role is bound to it: no other pod may patch this job's worker 0)."""
    return _named_service_account(job) or own_service_account_name(job.metadata.name)


def service_account(job: TrainingJob, owner: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The job's own ServiceAccount, unless its podTemplate names another. It holds no token unless rank 0
    reports progress (the only API call a worker makes)."""
    if _named_service_account(job) is not None:
        return None
    return {"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": _meta(job, own_service_account_name(job.metadata.name), owner),
            "automountServiceAccountToken": job.spec.progress_reporting}


def _meta(job: TrainingJob, name: str, owner: dict[str, Any] | None, **labels: str) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": job.metadata.namespace,
        "labels": {LABEL_JOB: job.metadata.name, contract.LABEL_MANAGED_BY: "kubetrain", **labels},
    }
    if owner is not None:
        meta["ownerReferences"] = [owner]
    return meta


def headless_service(job: TrainingJob, owner: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(job, service_name(job.metadata.name), owner),
        "spec": {
            "clusterIP": "None",
            "selector": {LABEL_JOB: job.metadata.name},
            "publishNotReadyAddresses": True,  # rendezvous must resolve before readiness
            "ports": [{"name": "rendezvous", "port": contract.DEFAULT_MASTER_PORT, "protocol": "TCP"}],
        },
    }


@cache
def launcher_files() -> dict[str, str]:
    """The per-worker launcher's source files (kubetrain.core, stdlib only), run in pods from the ConfigMap."""
    return {name: files("kubetrain.core").joinpath(name).read_text() for name in launcher.FILES}


def config_map(job: TrainingJob, owner: dict[str, Any] | None = None) -> dict[str, Any]:
    config = job.spec.dump_changed()
    config.pop("runtimeRef", None)  # merged in already (kubetrain.core.runtimes); an older trainer image knows no such field
    data = {"config.json": json.dumps(config, indent=1, sort_keys=True)}
    if job.spec.command and job.spec.runs_launcher:  # see worker_command
        data.update(launcher_files())
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(job, config_name(job.metadata.name), owner),
        "data": data,
    }


def worker_command(spec: TrainingJobSpec) -> tuple[list[str] | None, list[str] | None]:
    """The container's command and args. None: the image's entrypoint (the built-in trainer, which runs its
    own launcher). With procsPerWorker 1 the user's command is the rank itself; with more (or
    restartPolicy.inPlace true), the launcher from the ConfigMap starts it once per rank, so the user's
    image needs python3 but not kubetrain."""
    if not spec.command:
        return None, None
    args = list(spec.args) if spec.args else None
    if not spec.runs_launcher:
        return list(spec.command), args
    return ["python3", f"{CONFIG_MOUNT}/{launcher.SCRIPT}", "--", *spec.command], args


def checkpoint_claim(job: TrainingJob, owner: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The claim `<job>-checkpoints` (owned by the job: deleted with it), unless claimName, ephemeral or uri is set."""
    ck = job.spec.checkpoint
    if ck.claim_name or ck.ephemeral or ck.uri:
        return None
    spec: dict[str, Any] = {
        "accessModes": [claim_access_mode(job.spec)],
        "resources": {"requests": {"storage": ck.storage_size}},
    }
    if ck.storage_class_name:  # unset: the cluster's default StorageClass
        spec["storageClassName"] = ck.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta(job, default_claim_name(job.metadata.name), owner),
        "spec": spec,
    }


def progress_role(job: TrainingJob, owner: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Rank 0 may read and patch its own pod (the `kubetrain.io/progress` annotation), nothing else.

    Only worker 0 reports, so the rule names that one pod. The operator must hold get/patch on
    pods itself: the API server refuses to create a Role granting more than its creator has.
    """
    if not job.spec.progress_reporting:
        return None
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(job, progress_rbac_name(job.metadata.name), owner),
        "rules": [{
            "apiGroups": [""],
            "resources": ["pods"],
            "resourceNames": [worker_name(job.metadata.name, 0)],
            "verbs": ["get", "patch"],
        }],
    }


def progress_role_binding(job: TrainingJob, owner: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """progress_role() for the workers' ServiceAccount."""
    if not job.spec.progress_reporting:
        return None
    name = progress_rbac_name(job.metadata.name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(job, name, owner),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": worker_service_account(job),
                      "namespace": job.metadata.namespace or "default"}],
    }


def network_policy_name(job: str) -> str:
    return f"{job}-workers"


def metrics_ports(spec: TrainingJobSpec) -> dict[str, Any]:
    """The workers' metrics ports as a NetworkPolicyPort: metricsPort, and with several processes per worker
    one port per local rank after it (the launcher gives rank i metricsPort + i)."""
    ports: dict[str, Any] = {"protocol": "TCP", "port": spec.metrics_port}
    if spec.procs > 1:
        ports["endPort"] = spec.metrics_port + spec.procs - 1
    return ports


def worker_network_policy(job: TrainingJob, policy: WorkerNetworkPolicy | None,
                          owner: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Ingress to the job's pods only from the gang's own pods, on any port (rendezvous, and NCCL's and gloo's
    ports, which are dynamic), and to their metrics ports from `policy.metrics_from` (empty: any source).
    Egress is left open: rank 0 reports progress to the API server, checkpoints may go to object storage,
    and every pod needs DNS. None when the operator's setting is off."""
    if policy is None:
        return None
    gang = {"matchLabels": {LABEL_JOB: job.metadata.name}}  # as the headless Service selects the workers
    metrics: dict[str, Any] = {"ports": [metrics_ports(job.spec)]}
    if policy.metrics_from:
        metrics["from"] = copy.deepcopy(list(policy.metrics_from))
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(job, network_policy_name(job.metadata.name), owner),
        "spec": {"podSelector": gang, "policyTypes": ["Ingress"],
                 "ingress": [{"from": [{"podSelector": copy.deepcopy(gang)}]}, metrics]},
    }


# --------------------------------------------------------------------------- Pod Security Standards


def _pod_security_context(claim: str | None) -> dict[str, Any]:
    """Pod level: what `restricted` asks of every pod; fsGroup where a claim is mounted."""
    context: dict[str, Any] = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    if claim:
        # A fresh volume is root-owned: the group lets the non-root trainer write it; OnRootMismatch spares
        # a recursive chown of every checkpoint at each gang restart.
        context.update(fsGroup=TRAINER_GID, fsGroupChangePolicy="OnRootMismatch")
    return context


def _container_security_context(added_capabilities: tuple[str, ...]) -> dict[str, Any]:
    """Container level: every capability dropped, then the fabric's added back (see pod_security_level)."""
    capabilities: dict[str, list[str]] = {"drop": ["ALL"]}
    if added_capabilities:
        capabilities["add"] = list(added_capabilities)
    return {"allowPrivilegeEscalation": False, "capabilities": capabilities}


def _resources(spec: TrainingJobSpec, fabric: FabricProfile) -> dict[str, Any]:
    amounts: dict[str, str] = dict(fabric.resources)
    if spec.resources.gpus_per_worker:
        amounts[GPU_RESOURCE] = str(spec.resources.gpus_per_worker)
    if spec.resources.cpu:
        amounts["cpu"] = spec.resources.cpu
    memory = spec.resources.memory or fabric.default_memory
    if memory:
        amounts["memory"] = memory
    amounts.update(spec.resources.extra or {})  # the user's own win over the profile's
    if not amounts:
        return {}
    limits = dict(amounts)
    requests = dict(amounts)
    return {"requests": requests, "limits": limits}


def worker_env(job: TrainingJob, index: int, generation: int) -> list[dict[str, Any]]:
    """The contract env of one worker pod, then the fabric's, then the user's (theirs win, none dropped)."""
    spec, name, ns = job.spec, job.metadata.name, job.metadata.namespace or "default"
    master = worker_host(name, ns, 0)
    placement = contract.WorkerPlacement.worker(index, spec.procs, spec.workers)
    values = {
        **contract.torch_env(placement, master, contract.DEFAULT_MASTER_PORT),
        **contract.kubetrain_env(
            job=name,
            namespace=ns,
            config_path=f"{CONFIG_MOUNT}/config.json",
            checkpoint_dir=checkpoint_mount(spec),
            output_dir=OUTPUT_MOUNT,
            restart_generation=generation,
            metrics_port=spec.metrics_port,
            run_id=job.metadata.uid or "",
            hang=hangs.setting(spec.hang_limits),
            memory_tier=memory_tier(spec),
        ),
    }
    values[contract.CACHE_DIR] = contract.POD_CACHE_DIR
    values.update(contract.memory_env(None, int(quantity_value(shm_size_limit(spec))), spec.procs))  # budget.py
    cores = contract.cpu_cores(spec.resources.cpu) if spec.resources.cpu else None
    values.update(contract.thread_env(cores, spec.procs))  # the worker's CPU request, shared by its processes
    values.update(fabrics.profile(spec).env)
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in values.items()]
    if spec.restarts_in_place:
        env += [{"name": contract.GENERATION_FILE, "value": f"{GENERATION_MOUNT}/generation"},
                {"name": contract.MASTER_FILE, "value": f"{GENERATION_MOUNT}/master"},
                {"name": contract.IN_PLACE_WAIT, "value": f"{in_place_wait_seconds(spec):g}"},
                {"name": contract.RAN_FILE, "value": RAN_FILE}]
    if gang_probe(spec):
        env.append({"name": contract.GANG_PROBE_PORT, "value": str(contract.DEFAULT_GANG_PROBE_PORT)})
        if spec.workers > 1:  # the peers this worker's launcher asks while its ranks are quiet (hangs.PeerWatch)
            hosts = contract.peer_hosts(index, spec.workers, lambda i: worker_host(name, ns, i))
            env.append({"name": contract.PEER_HOSTS, "value": hosts})
    if spec.progress_reporting:  # the pod's own identity, for rank 0's progress annotation (Downward API)
        env += [
            {"name": contract.POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": contract.POD_NAMESPACE, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        ]
    env.append({"name": contract.NODE_NAME, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}})  # preflight
    env.append({"name": contract.MEMORY_LIMIT,  # the container's memory limit (else the node's allocatable), bytes
                "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1"}}})
    env += object_store_env(spec)
    user = {e["name"]: e for e in spec.env or [] if "name" in e}
    return [e for e in env if e["name"] not in user] + list(user.values())


S3_SECRET_KEYS = (("AWS_ACCESS_KEY_ID", False), ("AWS_SECRET_ACCESS_KEY", False), ("AWS_SESSION_TOKEN", True))
"""The keys of s3.credentialsSecret that become the trainer's environment (name, optional)."""


def object_store_env(spec: TrainingJobSpec) -> list[dict[str, Any]]:
    """The job's s3:// URIs: the Secret's keys (secretKeyRef, so a missing key keeps the pod from starting with
    the kubelet's CreateContainerConfigError instead of failing later) and, for custom scripts and any AWS SDK in
    the image, checkpoint.uri, the endpoint and the region. The built-in trainer reads all of it from the spec;
    none without an s3:// URI."""
    if not spec.object_store_uris():
        return []
    env: list[dict[str, Any]] = []
    if spec.checkpoint.uri:
        env.append({"name": contract.CHECKPOINT_URI, "value": spec.checkpoint.uri})
    s3 = spec.s3
    if s3 is None:
        return env
    if s3.endpoint:
        env.append({"name": "AWS_ENDPOINT_URL_S3", "value": s3.endpoint})
    if s3.region:
        env.append({"name": "AWS_REGION", "value": s3.region})
    if s3.credentials_secret:
        env += [{"name": key, "valueFrom": {"secretKeyRef": {"name": s3.credentials_secret, "key": key,
                                                               **({"optional": True} if optional else {})}}}
                for key, optional in S3_SECRET_KEYS]
    return env


def memory_tier(spec: TrainingJobSpec) -> contract.MemoryTier | None:
    """checkpoint.memory in a pod: /dev/shm (its memory emptyDir `dshm`), a budget per process out of the
    pod's memory limit (else /dev/shm's size). Only for pods that restart in place, the one restart that
    keeps a pod's memory, and where the podTemplate leaves `dshm` the memory emptyDir kubetrain makes (a
    volume another pod could share, or a later pod find, would offer another lineage's state)."""
    tier = spec.checkpoint.memory
    if not tier.enabled or not spec.restarts_in_place or _template_replaces_dshm(spec):
        return None
    memory = pod_memory_limit(spec) or spec.resources.shm_size
    return contract.MemoryTier(contract.POD_MEMORY_CKPT_DIR, tier.every_steps,
                               tier.budget_bytes(int(quantity_value(memory)), spec.procs))


def pod_memory_limit(spec: TrainingJobSpec) -> str | None:
    """A worker pod's memory limit: resources.memory, else its fabric profile's default; None: none."""
    return spec.resources.memory or fabrics.profile(spec).default_memory


def shm_size_limit(spec: TrainingJobSpec) -> str:
    """The sizeLimit of a worker pod's /dev/shm (`dshm`): resources.shmSize and, where the pod keeps the memory
    tier and has a memory limit, the tier's share of that limit beside it (memoryShare: the tier's files live
    there). Its pages count against the memory limit as any other, so the room costs nothing until used."""
    tier = memory_tier(spec)
    if tier is None or pod_memory_limit(spec) is None:
        return spec.resources.shm_size
    return add_quantities(spec.resources.shm_size, str(tier.budget_bytes * spec.procs))


def _template_volume(spec: TrainingJobSpec, name: str) -> dict[str, Any] | None:
    """The podTemplate's volume of this name, which the merge lays over kubetrain's."""
    volumes = ((spec.pod_template or {}).get("spec") or {}).get("volumes") or []
    return next((v for v in volumes if isinstance(v, dict) and v.get("name") == name), None)


def _template_replaces_dshm(spec: TrainingJobSpec) -> bool:
    mine = _template_volume(spec, "dshm")
    return mine is not None and set(mine) != {"name", "emptyDir"}


GANG_PROBE = {"tcpSocket": {"port": contract.DEFAULT_GANG_PROBE_PORT}, "periodSeconds": 1, "timeoutSeconds": 1,
              "successThreshold": 1, "failureThreshold": 1}
"""A worker that restarts in place is Ready while its launcher listens (contract.GANG_PROBE_PORT): not Ready
within about a second of its processes losing their peers, while it waits for the next generation."""


def gang_probe(spec: TrainingJobSpec) -> bool:
    """Whether the trainer container gets GANG_PROBE: restarting in place, and its port free. Not with the host's
    network (another pod's launcher on the node could answer for this one), a metricsPort range over the port,
    or a readinessProbe of the user's own on the trainer container (theirs is kept whole: two handlers in one
    probe are refused). Without it, a node lost under the gang waits for nodeNotReadyGraceSeconds."""
    if not spec.restarts_in_place:
        return False
    user_spec = (spec.pod_template or {}).get("spec") or {}
    port = contract.DEFAULT_GANG_PROBE_PORT
    return not (user_spec.get("hostNetwork") or "readinessProbe" in _user_container(user_spec)
                or spec.metrics_port <= port <= spec.metrics_port + spec.procs - 1)


def in_place_wait_seconds(spec: TrainingJobSpec) -> float:
    """How long a kept worker's launcher waits for the next generation: the longest restart backoff, and
    a margin for the failure to reach the operator."""
    return spec.restart_policy.max_backoff_seconds + contract.IN_PLACE_WAIT_MARGIN_SECONDS


def restart_policy(spec: TrainingJobSpec) -> str:
    """kubetrain restarts the whole gang. In place, the kubelet starts a failed worker's container again in
    its pod, where the launcher waits for the gang's next generation (the operator sees the failure in
    the container's status); otherwise a failed worker's pod ends and is recreated."""
    return "OnFailure" if spec.restarts_in_place else "Never"


def worker_pod(
    job: TrainingJob, index: int, generation: int, settings: WorkerSettings, owner: dict[str, Any] | None = None
) -> dict[str, Any]:
    spec, name = job.spec, job.metadata.name
    labels = {LABEL_INDEX: str(index), LABEL_GENERATION: str(generation), LABEL_ROLE: "worker"}
    claim = claim_name(job)
    fabric = fabrics.profile(spec)
    pod_spec: dict[str, Any] = {
        "restartPolicy": restart_policy(spec),
        "hostname": worker_name(name, index),
        "subdomain": service_name(name),
        "terminationGracePeriodSeconds": settings.termination_grace_seconds,
        "serviceAccountName": worker_service_account(job),
        "containers": [_worker_container(job, index, generation, settings, fabric)],
        "volumes": _worker_volumes(job, claim) + [dict(v) for v in fabric.volumes],
        # glibc sends a name's A and AAAA queries at once from one socket; where conntrack drops one of
        # the pair, every rendezvous lookup waits out 5 s resolver timeouts (measured: a rank 0 kept
        # by an in-place restart took 48 s from the failure to its first step, 7.7 s with this option).
        "dnsConfig": {"options": [{"name": "single-request-reopen"}]},
    }
    if fabric.sidecars:
        pod_spec["initContainers"] = [dict(c) for c in fabric.sidecars]
    sched = spec.scheduling
    optional = {
        "nodeSelector": {**fabric.node_selector, **(sched.node_selector or {})},  # the user's keys win
        "tolerations": sched.tolerations,
        "affinity": worker_affinity(job, generation),
        "priorityClassName": sched.priority_class_name,
        "schedulerName": scheduler_name(spec, settings),
    }
    pod_spec.update({k: v for k, v in optional.items() if v})
    if sched.gang == "kubernetes":  # the kube-scheduler's own gang: the pod names its group
        pod_spec["schedulingGroup"] = {"podGroupName": pod_group_name(job, generation)}
    user_spec = (spec.pod_template or {}).get("spec") or {}
    # A user's securityContext (the pod's, or the trainer container's) replaces ours whole: merged, a
    # `privileged: true` of theirs would meet our allowPrivilegeEscalation: false, which the API server refuses.
    if "securityContext" not in user_spec:
        pod_spec["securityContext"] = _pod_security_context(claim)
    if "securityContext" in _user_container(user_spec):
        del pod_spec["containers"][0]["securityContext"]
    pod: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod",
                           "metadata": _worker_meta(job, index, generation, labels, owner), "spec": pod_spec}
    if spec.pod_template:
        pod = merge(pod, {k: v for k, v in spec.pod_template.items() if k in ("metadata", "spec")})
        pod["metadata"]["labels"].update({k: v for k, v in labels.items()} | {LABEL_JOB: name})
        pod["metadata"]["name"] = worker_name(name, index)
    if spec.fetched_uris():
        _add_fetch(pod["spec"])
    if spec.workdir is not None:
        _add_workdir(pod["spec"], spec.workdir.config_map)
    return pod


FETCH_MODULE = contract.FETCH_MODULE
FETCH_IMAGE_ERROR = (f"{contract.CONFIG_ERROR_PREFIX}spec.image: the worker's image cannot run {FETCH_MODULE}, "
                     "which fetches model.hfUri, data.tokenizerUri or a chat/instruction data.uri in the init "
                     "container `fetch`: build the image FROM the trainer image, or pip install "
                     "'kubetrain-trainer[s3]' in it")
"""Why the fetch failed in an image without kubetrain's trainer package (a custom spec.image)."""


def _fetch_source() -> str:
    """`python3 -c` source of the fetch: runs FETCH_MODULE, or, where the image cannot import it, says so in the
    termination message and exits CONFIG_ERROR_EXIT_CODE: the job fails at once, naming spec.image, instead of
    restarting its gang on exit 1 up to backoffLimit. Standard library only."""
    return textwrap.dedent(f"""\
        import importlib.util, os, runpy, sys
        try:
            found, why = importlib.util.find_spec({FETCH_MODULE!r}) is not None, "not installed"
        except ImportError as exc:
            found, why = False, str(exc)
        if not found:
            said = {FETCH_IMAGE_ERROR!r} + " (" + why + ")"
            print(said, file=sys.stderr)
            if os.path.exists({contract.TERMINATION_LOG!r}):  # the kubelet's file: never made outside a pod
                with open({contract.TERMINATION_LOG!r}, "w") as f:
                    f.write(said)
            sys.exit({contract.CONFIG_ERROR_EXIT_CODE})
        runpy.run_module({FETCH_MODULE!r}, run_name="__main__", alter_sys=True)
        """)


FETCH_COMMAND = ["python3", "-c", _fetch_source()]
"""The init container contract.FETCH_CONTAINER's command, whatever the trainer container runs."""
_FETCH_SHARES = ("image", "imagePullPolicy", "env", "envFrom", "volumeMounts", "resources", "securityContext")
"""What the fetch takes from the trainer container as the podTemplate left it: it reads the same spec and
Secret, writes the cache the trainer reads, and passes the same Pod Security level."""


def fetch_container(trainer: dict[str, Any]) -> dict[str, Any]:
    """The init container that fetches model.hfUri and data.tokenizerUri into the cache (kubetrain.trainer.data.fetch),
    with the trainer container's image, environment, mounts, resources and securityContext."""
    shared = {k: copy.deepcopy(trainer[k]) for k in _FETCH_SHARES if k in trainer}
    return {"name": contract.FETCH_CONTAINER, **shared, "command": list(FETCH_COMMAND)}


def _add_fetch(pod_spec: dict[str, Any]) -> None:
    """The fetch before every init container that may need the model (the podTemplate's), after the native
    sidecars (restartPolicy Always: the fabric's daemons, a service mesh's proxy), which run beside it. A
    podTemplate init container named `fetch` is merged into it."""
    trainer = next(c for c in pod_spec["containers"] if c.get("name") == CONTAINER)
    fetch = fetch_container(trainer)
    inits = [c for c in pod_spec.get("initContainers") or [] if isinstance(c, dict)]
    theirs = next((c for c in inits if c.get("name") == contract.FETCH_CONTAINER), None)
    if theirs is not None:
        inits.remove(theirs)
        fetch = merge(fetch, theirs)
    at = next((i for i, c in enumerate(inits) if c.get("restartPolicy") != "Always"), len(inits))
    pod_spec["initContainers"] = [*inits[:at], fetch, *inits[at:]]


_WORKDIR_ARCHIVE_VOLUME = f"{contract.WORKDIR_CONTAINER}-archive"
_WORKDIR_SHARES = ("image", "imagePullPolicy", "resources", "securityContext")


def _add_workdir(pod_spec: dict[str, Any], config_map: str) -> None:
    """spec.workdir: the ConfigMap's archive unpacked by the first init container (kubetrain.core.workdir) into an
    emptyDir that the trainer container mounts and works in. It runs the trainer container's image (any image
    with a python3) under the same securityContext and resources."""
    trainer = next(c for c in pod_spec["containers"] if c.get("name") == CONTAINER)
    mounts = [{"name": contract.WORKDIR_CONTAINER, "mountPath": contract.WORKDIR_MOUNT}]
    unpack = {"name": contract.WORKDIR_CONTAINER, **{k: copy.deepcopy(trainer[k]) for k in _WORKDIR_SHARES if k in trainer},
              "command": ["python3", "-c", workdir.UNPACK_SOURCE],
              "volumeMounts": [*mounts, {"name": _WORKDIR_ARCHIVE_VOLUME, "mountPath": contract.WORKDIR_ARCHIVE_MOUNT,
                                         "readOnly": True}]}
    pod_spec["initContainers"] = [unpack, *(pod_spec.get("initContainers") or [])]
    pod_spec.setdefault("volumes", []).extend([
        {"name": contract.WORKDIR_CONTAINER, "emptyDir": {}},
        {"name": _WORKDIR_ARCHIVE_VOLUME, "configMap": {"name": config_map}},
    ])
    trainer.setdefault("volumeMounts", []).extend(mounts)
    trainer["workingDir"] = contract.WORKDIR_MOUNT


def scheduler_name(spec: TrainingJobSpec, settings: WorkerSettings) -> str | None:
    """scheduling.schedulerName, else the gang scheduler's name, else None (the default scheduler)."""
    sched = spec.scheduling
    if sched.scheduler_name:
        return sched.scheduler_name
    return {"volcano": VOLCANO_SCHEDULER, "coscheduling": settings.coscheduling_scheduler}.get(sched.gang)


def worker_affinity(job: TrainingJob, generation: int) -> dict[str, Any] | None:
    """scheduling.affinity, plus with scheduling.topologyKey a required pod affinity to the job's workers
    of this generation on that key: the scheduler places the first worker anywhere that fits (a pod
    matching its own term is allowed where no match exists yet), and every later one in its domain."""
    sched = job.spec.scheduling
    avoided = job.status.avoided_nodes if job.status and job.spec.restart_policy.avoid_degraded_nodes else []
    if not sched.topology_key:
        return avoid_nodes(sched.affinity, avoided)
    affinity = copy.deepcopy(avoid_nodes(sched.affinity, avoided) or {})
    term = {
        "labelSelector": {"matchLabels": {LABEL_JOB: job.metadata.name, LABEL_ROLE: "worker",
                                          LABEL_GENERATION: str(generation)}},
        "topologyKey": sched.topology_key,
    }
    pod_affinity = affinity.setdefault("podAffinity", {})
    pod_affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(term)
    return affinity


def avoid_nodes(affinity: dict[str, Any] | None, nodes: list[str]) -> dict[str, Any] | None:
    """`affinity` (left as it is) with a required node affinity off `nodes` (kubernetes.io/hostname NotIn), added
    to every nodeSelectorTerm the user requires (terms are ORed, so each must exclude them), or as the only one."""
    if not nodes:
        return affinity
    out = copy.deepcopy(affinity or {})
    avoid = {"key": HOSTNAME_LABEL, "operator": "NotIn", "values": sorted(set(nodes))}
    required = out.setdefault("nodeAffinity", {}).setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.setdefault("nodeSelectorTerms", [])
    for term in terms:
        term.setdefault("matchExpressions", []).append(dict(avoid))
    if not terms:
        terms.append({"matchExpressions": [avoid]})
    return out


def _worker_meta(job: TrainingJob, index: int, generation: int, labels: dict[str, str],
                 owner: dict[str, Any] | None) -> dict[str, Any]:
    name = job.metadata.name
    meta = _meta(job, worker_name(name, index), owner, **labels)
    meta["annotations"] = {
        contract.GENERATION_ANNOTATION: str(generation),
        **fabrics.profile(job.spec).annotations,
    }
    if job.spec.restarts_in_place:
        meta["annotations"][contract.IN_PLACE_ANNOTATION] = "true"
    if job.spec.scheduling.gang in ("volcano", "coscheduling"):  # either scheduler reads its own marker
        meta["annotations"][contract.GANG_GROUP_ANNOTATION] = name
        meta["labels"][contract.GANG_GROUP_LABEL] = name
    return meta


def _worker_volumes(job: TrainingJob, claim: str | None) -> list[dict[str, Any]]:
    volumes = [
        {"name": "config", "configMap": {"name": config_name(job.metadata.name)}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size_limit(job.spec)}},
        {"name": "checkpoints", **({"persistentVolumeClaim": {"claimName": claim}} if claim else {"emptyDir": {}})},
        {"name": "output", "emptyDir": {}},
    ]
    if _template_volume(job.spec, contract.CACHE_VOLUME) is None:  # theirs (a bigger or ephemeral one) replaces it
        volumes.append({"name": contract.CACHE_VOLUME, "emptyDir": {}})
    if job.spec.restarts_in_place:  # the kubelet rewrites the file when the annotation changes
        volumes.append({"name": "generation", "downwardAPI": {"items": [  # one volume: both files change at once
            {"path": "generation", "fieldRef": {"fieldPath": f"metadata.annotations['{contract.GENERATION_ANNOTATION}']"}},
            {"path": "master", "fieldRef": {"fieldPath": f"metadata.annotations['{contract.MASTER_ANNOTATION}']"}},
        ]}})
    return volumes


def _worker_container(job: TrainingJob, index: int, generation: int, settings: WorkerSettings,
                      fabric: FabricProfile) -> dict[str, Any]:
    spec = job.spec
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.image or settings.trainer_image,
        "imagePullPolicy": settings.image_pull_policy,
        "env": worker_env(job, index, generation),
        "ports": [
            {"name": "rendezvous", "containerPort": contract.DEFAULT_MASTER_PORT},
            {"name": "metrics", "containerPort": spec.metrics_port},
        ],
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "checkpoints", "mountPath": checkpoint_mount(spec)},
            {"name": "output", "mountPath": OUTPUT_MOUNT},
            {"name": contract.CACHE_VOLUME, "mountPath": contract.POD_CACHE_DIR},
            *([{"name": "generation", "mountPath": GENERATION_MOUNT, "readOnly": True}]
              if spec.restarts_in_place else []),
            *(dict(m) for m in fabric.mounts),
        ],
        "resources": _resources(spec, fabric),
    }
    if gang_probe(spec):
        container["readinessProbe"] = dict(GANG_PROBE)
    command, args = worker_command(spec)
    if command:
        container["command"] = command
    if args:
        container["args"] = args
    container["securityContext"] = _container_security_context(fabric.capabilities)
    return container


def _user_container(user_spec: dict[str, Any]) -> dict[str, Any]:
    """podTemplate.spec's entry for the trainer container (merged into ours by name), else {}."""
    containers = user_spec.get("containers")
    mine = [c for c in containers if isinstance(c, dict) and c.get("name") == CONTAINER] \
        if isinstance(containers, list) else []
    return mine[0] if mine else {}


def worker_requests(job: TrainingJob) -> dict[str, str]:
    """What one worker pod requests of a node: its containers' and native sidecars' requests (limits where
    a request is unset, as the API server defaults them), podTemplate included."""
    spec = worker_pod(job, 0, 0, WorkerSettings())["spec"]
    sidecars = [c for c in spec.get("initContainers") or [] if c.get("restartPolicy") == "Always"]
    total: dict[str, str] = {}
    for container in [*spec["containers"], *sidecars]:
        resources = container.get("resources") or {}
        for name, amount in {**(resources.get("limits") or {}), **(resources.get("requests") or {})}.items():
            total[name] = add_quantities(total[name], str(amount)) if name in total else str(amount)
    return total


def pod_group_name(job: TrainingJob, generation: int) -> str:
    """`<job>`, or `<job>-<generation>` for a gang whose PodGroup is made per generation."""
    gang = GANGS.get(job.spec.scheduling.gang)
    return f"{job.metadata.name}-{generation}" if gang is not None and gang.per_generation else job.metadata.name


def pod_group(job: TrainingJob, owner: dict[str, Any] | None = None, generation: int = 0) -> dict[str, Any] | None:
    """A PodGroup for the gang scheduler named in scheduling.gang, so all workers are placed at once or none,
    owned by the job. Volcano's and the Coscheduling plugin's have minMember (the workers) and minResources
    (what they request together); the kube-scheduler's has a gang policy of minCount workers."""
    gang = GANGS.get(job.spec.scheduling.gang)
    if gang is None:
        return None
    spec: dict[str, Any]
    if job.spec.scheduling.gang == "kubernetes":
        spec = {"schedulingPolicy": {"gang": {"minCount": job.spec.workers}}}
    else:
        spec = {"minMember": job.spec.workers}
        requests = worker_requests(job)
        if requests:
            spec["minResources"] = {k: scale_quantity(v, job.spec.workers) for k, v in sorted(requests.items())}
    if job.spec.scheduling.gang == "volcano" and job.spec.scheduling.queue:
        spec["queue"] = job.spec.scheduling.queue
    return {"apiVersion": gang.api_version, "kind": "PodGroup",
            "metadata": _meta(job, pod_group_name(job, generation), owner), "spec": spec}
