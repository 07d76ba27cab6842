"""The worker contract, defined once for both backends: what the operator, the local
backend, the in-pod launcher and the trainer must agree on.

Every worker process (built-in trainer or a user's own script) gets the variables below
from the operator (pod env) or the local backend (process env), built by torch_env() and
kubetrain_env() only. torchrun's `PET_*` names are set too so that `torchrun` inside a pod
needs no flags. Also here: the worker pods' labels and annotations, the exit codes with a
meaning, and the timestamp format.

This file is shipped in a job's ConfigMap beside launcher.py and runs in a user's image:
standard library only, Python 3.8+ (hence timezone.utc, not datetime.UTC).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

# torch.distributed's own
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
WORLD_SIZE = "WORLD_SIZE"
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
NODE_RANK = "NODE_RANK"
# torchrun (elastic launcher) equivalents
PET_NNODES = "PET_NNODES"
PET_NPROC_PER_NODE = "PET_NPROC_PER_NODE"
PET_NODE_RANK = "PET_NODE_RANK"
PET_MASTER_ADDR = "PET_MASTER_ADDR"
PET_MASTER_PORT = "PET_MASTER_PORT"
# kubetrain's own
JOB = "KUBETRAIN_JOB"
NAMESPACE = "KUBETRAIN_NAMESPACE"
CONFIG = "KUBETRAIN_CONFIG"
"""Path of the rendered trainer config (JSON: the TrainingJob spec in wire form)."""
CHECKPOINT_DIR = "KUBETRAIN_CHECKPOINT_DIR"
CHECKPOINT_URI = "KUBETRAIN_CHECKPOINT_URI"
"""spec.checkpoint.uri (s3://bucket/prefix) where set, for custom scripts: the durable checkpoints' home, while
CHECKPOINT_DIR is then each worker's own staging directory."""
OUTPUT_DIR = "KUBETRAIN_OUTPUT_DIR"
"""Where rank 0 writes progress.json and logs."""
CACHE_DIR = "KUBETRAIN_CACHE_DIR"
"""A worker's cache: the fetch step puts model.hfUri into MODEL_CACHE, data.tokenizerUri into
TOKENIZER_CACHE and a chat or instruction data.uri into SAMPLES_CACHE under it (custom scripts find them there
too), and data.uri's text or token shards pass through DATA_CACHE. In pods the emptyDir CACHE_VOLUME at
POD_CACHE_DIR; local runs: `<output dir>/cache`."""
POD_CACHE_DIR = "/cache"
CACHE_VOLUME = "cache"
MODEL_CACHE = "model"
TOKENIZER_CACHE = "tokenizer"
SAMPLES_CACHE = "samples"
"""Where the fetch step puts data.uri's JSONL objects when data.format is chat or instruction (read whole at start,
not streamed through DATA_CACHE)."""
DATA_CACHE = "data"
FETCH_CONTAINER = "fetch"
"""The init container of worker pods whose job fetches anything (TrainingJobSpec.fetched_uris): `python -m
kubetrain.trainer.data.fetch` in the trainer's image, with its environment and mounts. Exit codes as the trainer's
(CONFIG_ERROR_EXIT_CODE for a wrong bucket, refused credentials, ...; 1 for a transient failure)."""
FETCH_MODULE = "kubetrain.trainer.data.fetch"
"""The fetch step's module, run with `python -m` by the init container and by the local backend."""
EXPORT_MODULE = "kubetrain.trainer.export"
"""`python -m` of `kubetrain export`: a committed checkpoint as a Hugging Face model directory (the trainer's image or
package: torch and transformers)."""
RESTART_GENERATION = "KUBETRAIN_RESTART_GENERATION"
RUN_ID = "KUBETRAIN_RUN_ID"
"""Which run of the job this is: the TrainingJob's uid in a pod, a fresh id per `kubetrain run`. With
RESTART_GENERATION it names the gang that owns the checkpoints (the trainer's generation fence): a gang of an
older generation of the same run, or of another run, never commits beside the newest."""
METRICS_PORT = "KUBETRAIN_METRICS_PORT"
METRICS_ADDR = "KUBETRAIN_METRICS_ADDR"
"""The address a worker's metrics endpoint binds: unset in a pod (every interface, for Prometheus), loopback in
a local run (nothing on the network sees a laptop's training)."""
FAIL_AT = "KUBETRAIN_FAIL_AT"
"""`RANK:STEP`: that rank exits with FAIL_AT_EXIT_CODE on reaching STEP in the first generation
(KUBETRAIN_RESTART_GENERATION 0) only, so a drill set in a pod's env fails the gang once (failure drills)."""
DIST_TIMEOUT = "KUBETRAIN_DIST_TIMEOUT_SECONDS"
POD_NAME = "KUBETRAIN_POD_NAME"
"""This worker's pod (Downward API `metadata.name`); only in pods, never in local runs."""
POD_NAMESPACE = "KUBETRAIN_POD_NAMESPACE"
"""This worker's namespace (Downward API `metadata.namespace`); only in pods."""
NODE_NAME = "KUBETRAIN_NODE_NAME"
"""This worker's node (Downward API `spec.nodeName`), named in the preflight's report; only in pods (a local
run's ranks report the hostname)."""

GENERATION_FILE = "KUBETRAIN_GENERATION_FILE"
"""In a pod that restarts in place: the file (Downward API, the pod's GENERATION_ANNOTATION) whose
number the launcher runs; a higher number stops its processes and starts them again in that generation."""
MASTER_FILE = "KUBETRAIN_MASTER_FILE"
"""In a pod that restarts in place: the file (Downward API, the pod's MASTER_ANNOTATION) that says where worker
0 of a generation serves the rendezvous, by address (rendezvous.master_address)."""
IN_PLACE_WAIT = "KUBETRAIN_IN_PLACE_WAIT_SECONDS"
"""How long a launcher whose processes lost their peers waits for a new generation before it exits
IN_PLACE_GAVE_UP_EXIT_CODE (restartPolicy.maxBackoffSeconds + IN_PLACE_WAIT_MARGIN_SECONDS)."""
IN_PLACE_WAIT_MARGIN_SECONDS = 60
GANG_PROBE_PORT = "KUBETRAIN_GANG_PROBE_PORT"
"""In a pod that restarts in place: the TCP port of the container's readiness probe. Its launcher listens there
except while it waits for the next generation after its processes lost their peers, so the worker shows not
Ready, and the operator learns the gang broke even when the worker that broke it cannot say so (its node
died). The port is DEFAULT_GANG_PROBE_PORT."""
DEFAULT_GANG_PROBE_PORT = 29499
"""Beside MASTER_PORT's default (29500), below the kernel's ephemeral range (gloo's and NCCL's connections)."""
PEER_HOSTS = "KUBETRAIN_PEER_HOSTS"
"""In a pod with the gang probe, of a gang of several workers: `INDEX=HOST,...`, the workers whose launchers this
one asks whether they answer on GANG_PROBE_PORT while its own ranks are quiet (hangs.PeerWatch): the next
PEERS_WATCHED workers round the ring, so every worker is watched by that many others whatever the gang's size."""
PEERS_WATCHED = 2
STANDBY = "KUBETRAIN_STANDBY"
"""Set on a rank of kubetrain's trainer that its launcher starts while it waits for the next generation:
the rank imports what training needs, then reads the generation to run from one line on its stdin (end
of file: it exits 0 without training). The imports are then off a restart's critical path."""
RAN_FILE = "KUBETRAIN_RAN_GENERATION_FILE"
"""In a pod that restarts in place: a file on a volume that outlives the container (the pod's /dev/shm)
where the launcher notes each generation it starts. The kubelet restarts a failed worker's container in
its pod (restartPolicy OnFailure); the new launcher finds its generation there and waits for the next
one instead of running the failed one again."""

MEMORY_CKPT_DIR = "KUBETRAIN_MEMORY_CKPT_DIR"
"""checkpoint.memory's directory (unset: the tier is off): memory that outlives a rank's process but not its
pod. Rank R keeps `rank-<R>/step-NNNNNNNN/` there, complete once its `COMMITTED` file exists (written last,
atomically), and deletes its older steps once a newer one is complete; a generation may resume from the
newest step every rank holds complete, when it is at least as new as the durable tier's newest checkpoint,
and then deletes its steps after the one it resumed from. MEMORY_CKPT_EVERY and MEMORY_CKPT_BYTES carry the
tier's period in optimizer steps and this process's budget in bytes, for the two copies it holds while it
writes a new one. Set for kubetrain's trainer and custom commands alike (MemoryTier)."""
MEMORY_CKPT_EVERY = "KUBETRAIN_MEMORY_CKPT_EVERY_STEPS"
MEMORY_CKPT_BYTES = "KUBETRAIN_MEMORY_CKPT_BYTES"
POD_MEMORY_CKPT_DIR = "/dev/shm/kubetrain-ckpt"
"""MEMORY_CKPT_DIR in a pod: on its /dev/shm volume (a memory emptyDir), which container restarts keep and a
recreated pod starts without."""
MEMORY_LIMIT = "KUBETRAIN_MEMORY_LIMIT_BYTES"
"""The memory a worker's processes share, in bytes: in a pod its container's memory limit (Downward API
`resourceFieldRef` `limits.memory`; without a limit the kubelet gives the node's allocatable memory); locally the
machine's (its cgroup's limit, else MemTotal). The trainer sizes its checkpoint copies against it (budget.py)."""
SHM_BYTES = "KUBETRAIN_SHM_BYTES"
"""The size of /dev/shm in bytes: in a pod its memory emptyDir's sizeLimit; locally /dev/shm's size."""
MEMORY_PROCS = "KUBETRAIN_MEMORY_PROCS"
"""How many processes share MEMORY_LIMIT and SHM_BYTES: a pod's procsPerWorker; locally every rank of the run."""

HEARTBEAT_DIR = "KUBETRAIN_HEARTBEAT_DIR"
"""Where each rank writes its heartbeat (`rank-<RANK>.beat`) and registers its stack dump (`<pid>.stack`):
set by whoever supervises the ranks (a pod's launcher, the local backend), fresh for every generation."""
HANG = "KUBETRAIN_HANG"
"""restartPolicy.hangDetection for the supervisor: `off`, or kubetrain.core.hangs.Limits.encode()."""
HANG_DIR = "KUBETRAIN_HANG_DIR"
"""Where a hung worker saves its ranks' stacks (`gen-<G>/rank-<R>.txt`); unset: `<checkpoint dir>/hangs`."""
TERMINATION_LOG = "/dev/termination-log"
"""A pod's termination message: a hung worker's report (hangs.HangReport) reaches the operator there."""

DEFAULT_MASTER_PORT = 29500

# Worker pods: labels, annotations and the container, as the operator writes them and the CLI reads them.
LABEL_JOB = "kubetrain.io/job-name"
LABEL_INDEX = "kubetrain.io/replica-index"
LABEL_GENERATION = "kubetrain.io/restart-generation"
LABEL_ROLE = "kubetrain.io/role"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
"""Kueue's LocalQueue label, on the job's Workload (scheduling.queue)."""

# Kueue: the Workload the operator keeps for a job with scheduling.queue (see kubetrain.operator.kueue).
KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSION = "v1beta1"
WORKLOAD_PLURAL = "workloads"
WORKLOAD_POD_SET = "workers"
"""The Workload's one pod set: the gang."""
KUEUE_PRIORITY_CLASS_LABEL = "kueue.x-k8s.io/priority-class"
"""On a TrainingJob: the Kueue WorkloadPriorityClass of its Workload."""
KUEUE_REQUIRED_TOPOLOGY = "kueue.x-k8s.io/podset-required-topology"
KUEUE_PREFERRED_TOPOLOGY = "kueue.x-k8s.io/podset-preferred-topology"
"""On a TrainingJob: the topology level (a node label) Kueue's topology-aware scheduling keeps the gang in."""
KUEUE_POD_SET_LABEL = "kueue.x-k8s.io/podset"
KUEUE_WORKLOAD_ANNOTATION = "kueue.x-k8s.io/workload"
WORKLOAD_SUSPENDED_ANNOTATION = "kubetrain.io/deactivated-for-suspend"
"""On a job's Workload that the operator deactivated because the job is suspended: only such a Workload is
activated again on resume (one that Kueue or an admin deactivated stays as they left it)."""
KUEUE_TAS_LABEL = "kueue.x-k8s.io/tas"
KUEUE_TOPOLOGY_GATE = "kueue.x-k8s.io/topology"
"""On worker pods of a gang Kueue placed by topology: its topology ungater assigns their nodes."""
MANAGED_BY_OPERATOR = "kubetrain.io/trainingjob-controller"
"""spec.managedBy's value (or none) for the jobs this operator runs; any other leaves them to that controller."""
GANG_GROUP_LABEL = "scheduling.x-k8s.io/pod-group"
"""The coscheduling plugin's pod-group label (scheduling.gang)."""
GANG_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
"""Volcano's pod-group annotation (scheduling.gang)."""
GENERATION_ANNOTATION = "kubetrain.io/restart-generation"
"""On worker pods: the generation the pod's launcher is to run (its label says which generation the pod
belongs to; the two differ while a kept pod waits for its restart's backoff)."""
MASTER_ANNOTATION = "kubetrain.io/master-address"
"""On a worker pod kept by an in-place restart: `GENERATION ADDRESS`, worker 0's pod IP in that generation, or
`GENERATION` alone while worker 0's new pod has none yet. A kept worker reaches the rendezvous by that address,
not by worker 0's name: a recreated worker 0's name resolves only once its new pod is published, and a lookup
made before that is cached as missing by the cluster's DNS (CoreDNS: its `ttl`, 30 s in kubeadm's Corefile)."""
IN_PLACE_ANNOTATION = "kubetrain.io/in-place"
"""On worker pods that can restart in place ("true"): their launcher reads GENERATION_FILE."""
FAILURES_HANDLED_ANNOTATION = "kubetrain.io/failures-handled"
"""On a worker pod that restarts in place: how many of its trainer container's failures the operator has
already acted on (absent: none). A failure the kubelet restarted in the pod counts once, not again on
every status the pod reports after it."""
LABEL_SWEEP = "kubetrain.io/sweep-name"
"""On a sweep's trial TrainingJobs: the TrainingSweep that created them."""
LABEL_TRIAL = "kubetrain.io/trial-index"
"""On a sweep's trial TrainingJobs: the trial's index in the sweep's status.trials."""
CONTAINER = "trainer"
"""The worker container's name (its logs, its exit code)."""

CONFIG_ERROR_EXIT_CODE = 2
"""A bad job config or environment (the trainer's ConfigError): permanent by default (restartPolicy)."""
CONFIG_ERROR_PREFIX = "configuration error: "
"""How such a worker's message starts (its termination message in a pod, its last words in the log): the field,
then why."""
SIGTERM_EXIT_CODE = 143
"""A worker stopped by SIGTERM after writing its checkpoint (128 + 15, as a container runtime reports it)."""
FAIL_AT_EXIT_CODE = 137
"""Exit code of an injected failure: the same as a SIGKILLed container, so it is retryable."""
PEER_LOST_EXIT_CODE = 3
"""Exit code of a rank whose collective failed because another rank went away (connection
reset, closed, timed out): the consequence of another failure, rarely its cause. Retryable;
launchers and the lifecycle policy report any other failure before this one."""
ABORTED_EXIT_CODE = 134
"""A process that called abort() (SIGABRT, 128 + 6). NCCL's watchdog ends a rank this way when one of its
collectives failed or timed out (TORCH_NCCL_ASYNC_ERROR_HANDLING=3), usually because another rank failed first;
the trainer exits PEER_LOST_EXIT_CODE before that abort when it sees the error (kubetrain.trainer.observe.
nccl_watch), a custom script does not. Launchers and the lifecycle policy report it after any other failure and
before a lost peer (blame_order)."""
IN_PLACE_GAVE_UP_EXIT_CODE = 75
"""A launcher that waited IN_PLACE_WAIT seconds for a new generation and got none (EX_TEMPFAIL): its pod
is recreated, and the restart it causes recreates every pod (the in-place path did not answer)."""
HUNG_EXIT_CODE = 124
"""A worker whose ranks stopped advancing (kubetrain.core.hangs): its supervisor saved their stacks and ended them."""
COMMAND_NOT_FOUND_EXIT_CODE = 127
"""A worker command that is not there (as a shell exits): permanent by default (restartPolicy)."""
COMMAND_NOT_EXECUTABLE_EXIT_CODE = 126
"""A worker command that is there but cannot be executed (as a shell exits): permanent by default."""

PROGRESS_FILE = "progress.json"
"""Rank 0's progress record in KUBETRAIN_OUTPUT_DIR (see kubetrain.core.progress)."""
PROGRESS_ANNOTATION = "kubetrain.io/progress"
"""The same record (JSON) as an annotation on worker 0's pod: rank 0 patches its own pod
(kubetrain.trainer.observe.progress) and the operator reads it for status and hang detection."""
PROFILE_ANNOTATION = "kubetrain.io/profile"
"""On a TrainingJob (the operator copies it to worker 0's pod) or that pod: `N` or `N:<any tag>` asks rank 0
to profile its next N steps; each new value is one request."""
PROFILE_REQUEST_FILE = "profile-request"
"""In a local run's output directory: the same request (`kubetrain profile`)."""
PROFILES_DIR = "profiles"
"""Under the checkpoint directory: torch.profiler traces (`*.pt.trace.json`, for TensorBoard and Perfetto)."""

TRANSPORT_IB = "IB"
"""Network transports rank 0 reports (Progress.networkTransport, status.networkTransport): NCCL's
InfiniBand/RoCE verbs transport (`Using network IB`)."""
TRANSPORT_SOCKET = "Socket"
"""NCCL over TCP sockets (`Using network Socket`): what NCCL falls back to, silently, without a fabric."""
TRANSPORT_OFI = "OFI"
"""NCCL through the aws-ofi-nccl plugin, libfabric (EFA) (`Using network Libfabric`)."""
TRANSPORT_TCPX = "GPUDirectTCPX"
"""NCCL through GKE's GPUDirect-TCPX plugin (`Using network GPUDirectTCPX_v7`)."""
TRANSPORT_TCPXO = "FasTrak"
"""NCCL through GKE's GPUDirect-TCPXO plugin (`Using network FasTrak`)."""
TRANSPORT_LOCAL = "P2P/SHM"
"""NCCL on one node: every connection of rank 0 goes through NVLink/PCIe or shared memory, no network."""
TRANSPORT_GLOO = "gloo"
"""torch.distributed's gloo backend (CPU): TCP, no NCCL."""


def format_time(t: datetime, micros: bool = False) -> str:
    """A UTC timestamp as Kubernetes writes it (RFC 3339, `Z`); `micros` for a Lease's MicroTime."""
    t = t.astimezone(timezone.utc) if t.tzinfo else t  # noqa: UP017 - Python 3.8+ (see above)
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micros else "%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: str | None) -> datetime | None:
    """The inverse of format_time (any RFC 3339 form); None for an empty value."""
    return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


def exit_code(returncode: int) -> int:
    """Popen's -N for a signal becomes 128+N, as a container runtime reports it."""
    return 128 - returncode if returncode < 0 else returncode


def blame_order(code: int | None) -> int:
    """How surely an exit code is a failure of its own rather than the echo of another's, lowest first: 0 any
    failure of its own, 1 an abort (ABORTED_EXIT_CODE: NCCL's watchdog, mostly after a peer's failure), 2 a lost
    peer (PEER_LOST_EXIT_CODE)."""
    return {ABORTED_EXIT_CODE: 1, PEER_LOST_EXIT_CODE: 2}.get(code, 0) if code is not None else 0


def root_cause(codes: Sequence[int]) -> int | None:
    """The exit code to report for a group of failed processes, in the order they were seen
    to fail: the first of the lowest blame_order (any other failure before an abort before a lost peer;
    None if empty)."""
    return min(codes, key=blame_order) if codes else None  # min keeps the first of equals


@dataclass(frozen=True)
class WorkerPlacement:
    """Where one process, or one whole worker (local_rank None), sits in the gang."""

    node_rank: int
    local_rank: int | None
    """None: the worker as a whole, as its pod's env sees it; its launcher gives each process its own."""
    procs_per_worker: int
    workers: int

    @classmethod
    def worker(cls, node_rank: int, procs_per_worker: int, workers: int) -> WorkerPlacement:
        """A whole worker: a single process is itself the rank (local rank 0); several get theirs from the launcher."""
        return cls(node_rank, 0 if procs_per_worker == 1 else None, procs_per_worker, workers)

    @property
    def rank(self) -> int | None:
        """The global rank; None for a whole worker of several processes."""
        return None if self.local_rank is None else self.node_rank * self.procs_per_worker + self.local_rank

    @property
    def world_size(self) -> int:
        return self.workers * self.procs_per_worker


TENSORBOARD_DIR = "tensorboard"
"""Under the checkpoint directory (durable: the job's claim in a cluster): rank 0's TensorBoard event files."""


OWNED_DIR_MARKER = ".kubetrain-owned"
"""In every local directory kubetrain created or adopted empty (output, checkpoints, a sweep's): the mark
that lets a fresh start clear its contents. kubetrain never deletes in a directory without it."""

# Where worker pods mount their volumes. spec.checkpoint.dir moves the checkpoint mount and may not
# lie over the others (kubetrain.core.api refuses system directories, which hold all of them).
CHECKPOINT_MOUNT = "/checkpoints"
CONFIG_MOUNT = "/etc/kubetrain"
OUTPUT_MOUNT = "/var/run/kubetrain"
GENERATION_MOUNT = "/etc/kubetrain-generation"
WORKDIR_MOUNT = "/var/run/kubetrain-workdir"
"""spec.workdir: the trainer container's working directory, an emptyDir the init container WORKDIR_CONTAINER
fills from the ConfigMap's archive (kubetrain.core.workdir)."""
WORKDIR_ARCHIVE_MOUNT = "/etc/kubetrain-workdir"
WORKDIR_ARCHIVE = "workdir.tar.gz"
"""The archive's key in the ConfigMap spec.workdir.configMap names."""
WORKDIR_CONTAINER = "kubetrain-workdir"
"""The init container, and the emptyDir, of spec.workdir (kubetrain's names: a podTemplate's `workdir` is its own)."""


THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""OpenMP and MKL (torch's CPU kernels) thread counts, set for every worker process unless the job's env sets them."""


def threads_per_process(cores: float, processes: int) -> int:
    """The CPU threads each of `processes` processes gets when they share `cores`: at least 1, never more
    threads in all than cores (oversubscribed cores make every collective wait on the slowest thread)."""
    return max(1, int(cores // max(1, processes)))


def thread_env(cores: float | None, processes: int) -> dict[str, str]:
    """THREAD_VARIABLES for processes sharing `cores`; none where the cores are unknown (a pod without a CPU
    request may use the whole node: torch's own default, one thread per core, is then the better guess)."""
    if cores is None:
        return {}
    return dict.fromkeys(THREAD_VARIABLES, str(threads_per_process(cores, processes)))


def cpu_cores(quantity: str) -> float:
    """A Kubernetes CPU quantity in cores: `500m` -> 0.5, `2` -> 2.0."""
    q = quantity.strip()
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def format_duration(seconds: float) -> str:
    """`42.0s`, `3m05s`, `1h02m`: a duration as status, tables and summaries show it."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    return f"{minutes // 60}h{minutes % 60:02d}m"


def env_value(env: Mapping[str, str], *names: str) -> str | None:
    """The first of these variables that is set and not empty (a contract name, then torchrun's PET_ one)."""
    return next((env[n] for n in names if env.get(n)), None)


def env_int(env: Mapping[str, str], *names: str, default: int) -> int:
    """:func:`env_value` as an integer, `default` where none is set; a value that is not one is named."""
    value = env_value(env, *names)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{'/'.join(names)}={value!r}: not an integer") from None


def torch_env(placement: WorkerPlacement, master_addr: str, master_port: int) -> dict[str, str]:
    """torch.distributed and torchrun variables: the one place they are built, for a pod (a whole worker),
    a local worker, and each process the launcher starts. RANK and LOCAL_RANK only when the placement
    has a local rank: a worker of several processes leaves them to its launcher."""
    env = {
        MASTER_ADDR: master_addr,
        MASTER_PORT: str(master_port),
        WORLD_SIZE: str(placement.world_size),
        NODE_RANK: str(placement.node_rank),
        LOCAL_WORLD_SIZE: str(placement.procs_per_worker),
        PET_NNODES: str(placement.workers),
        PET_NPROC_PER_NODE: str(placement.procs_per_worker),
        PET_NODE_RANK: str(placement.node_rank),
        PET_MASTER_ADDR: master_addr,
        PET_MASTER_PORT: str(master_port),
        "PYTHONUNBUFFERED": "1",
    }
    if placement.local_rank is not None:
        env[RANK] = str(placement.rank)
        env[LOCAL_RANK] = str(placement.local_rank)
    return env


@dataclass(frozen=True)
class MemoryTier:
    """checkpoint.memory as a worker's processes get it (MEMORY_CKPT_DIR, MEMORY_CKPT_EVERY, MEMORY_CKPT_BYTES)."""

    directory: str
    every_steps: int
    budget_bytes: int
    """Per process."""

    def env(self) -> dict[str, str]:
        return {MEMORY_CKPT_DIR: self.directory, MEMORY_CKPT_EVERY: str(self.every_steps),
                MEMORY_CKPT_BYTES: str(self.budget_bytes)}


def memory_env(limit_bytes: int | None, shm_bytes: int | None, procs: int) -> dict[str, str]:
    """MEMORY_LIMIT, SHM_BYTES and MEMORY_PROCS where known (a pod's memory limit comes from the Downward API)."""
    env = {MEMORY_PROCS: str(procs)}
    if limit_bytes is not None:
        env[MEMORY_LIMIT] = str(limit_bytes)
    if shm_bytes is not None:
        env[SHM_BYTES] = str(shm_bytes)
    return env


def kubetrain_env(
    *,
    job: str,
    namespace: str,
    config_path: str,
    checkpoint_dir: str,
    output_dir: str,
    restart_generation: int,
    metrics_port: int,
    run_id: str = "",
    hang: str = "off",
    memory_tier: MemoryTier | None = None,
    cache_dir: str | None = None,
) -> dict[str, str]:
    """kubetrain's own variables, the same for every process of a generation. `hang`: HANG's value;
    `memory_tier`: checkpoint.memory where the backend keeps it (None: its variables stay unset, the tier off);
    `cache_dir`: CACHE_DIR (POD_CACHE_DIR in pods, `<output dir>/cache` in local runs; None: unset); `run_id`:
    RUN_ID (empty: unset, the checkpoints not fenced)."""
    env = {
        HANG: hang,
        JOB: job,
        NAMESPACE: namespace,
        CONFIG: config_path,
        CHECKPOINT_DIR: checkpoint_dir,
        OUTPUT_DIR: output_dir,
        RESTART_GENERATION: str(restart_generation),
        METRICS_PORT: str(metrics_port),
    }
    if memory_tier is not None:
        env.update(memory_tier.env())
    if cache_dir is not None:
        env[CACHE_DIR] = cache_dir
    if run_id:
        env[RUN_ID] = run_id
    return env


def peer_hosts(index: int, workers: int, host: Callable[[int], str]) -> str:
    """PEER_HOSTS's value for worker `index` of `workers`; `host`: a worker's index -> its name."""
    peers = sorted({(index + k) % workers for k in range(1, min(PEERS_WATCHED, workers - 1) + 1)})
    return ",".join(f"{i}={host(i)}" for i in peers)


def parse_peer_hosts(text: str | None) -> dict[int, str]:
    """PEER_HOSTS's value read back (index -> host); a malformed entry is left out."""
    out = {}
    for item in (text or "").split(","):
        index, _, host = item.partition("=")
        if index.strip().isdigit() and host.strip():
            out[int(index)] = host.strip()
    return out
