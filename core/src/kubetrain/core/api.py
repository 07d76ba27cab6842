"""The TrainingJob API (kubetrain.io/v1alpha1): the single source of truth.

The CRD's OpenAPI schema, defaults, CEL rules and `kubectl explain` text are
generated from these models (see :mod:`kubetrain.core.crd`); the trainer reads
its configuration from the same models; `kubetrain validate` checks a manifest
against them. Field names follow the Kubeflow Training Operator / JobSet
vocabulary where one exists (`backoffLimit`, `activeDeadlineSeconds`,
`ttlSecondsAfterFinished`, `cleanPodPolicy`, `suspend`).

Python attributes are snake_case; the wire format (YAML/JSON) is camelCase.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Annotated, Any, Final, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema, field_validator
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from kubetrain.core import contract, hangs, pod_template
from kubetrain.core.quantity import quantity_value

GROUP: Final = "kubetrain.io"
VERSION: Final = "v1alpha1"
API_VERSION: Final = "kubetrain.io/v1alpha1"  # GROUP/VERSION, written out so the type is the literal
KIND: Final = "TrainingJob"
PLURAL = "trainingjobs"
SINGULAR = "trainingjob"
SHORT_NAMES = ["tj", "tjob"]

Strategy = Literal["ddp", "fsdp", "deepspeed"]
Precision = Literal["fp32", "bf16", "fp16"]


class Phase(enum.StrEnum):
    """A TrainingJob's status.phase."""

    PENDING = "Pending"
    CREATED = "Created"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


FINISHED_PHASES = (Phase.SUCCEEDED, Phase.FAILED)
AccessMode = Literal["ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod"]
ACCESS_MODES_ANNOTATION: Final = "kubetrain.io/access-modes"
"""On a StorageClass: the access modes its volumes offer, comma-separated (`ReadWriteOnce`, or
`ReadWriteOnce,ReadWriteMany`). It overrides what kubetrain knows of the class's provisioner (RWO_ONLY_PROVISIONERS)."""
RWO_ONLY_PROVISIONERS: Final = (
    "ebs.csi.aws.com", "kubernetes.io/aws-ebs",
    "pd.csi.storage.gke.io", "kubernetes.io/gce-pd",
    "disk.csi.azure.com", "kubernetes.io/azure-disk",
    "cinder.csi.openstack.org", "csi.vsphere.vmware.com", "rbd.csi.ceph.com",
)
"""Block-storage provisioners whose volumes attach to one node at a time (ReadWriteOnce): the clouds' default
classes (EKS gp2/gp3, GKE standard-rwo/pd-balanced, AKS managed-csi) and common on-premises ones."""

DEFAULT_CHECKPOINT_STORAGE = "10Gi"
"""Size of the checkpoint claim the operator creates when spec.checkpoint.storageSize is not set."""
QUANTITY_PATTERN = r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][-+]?[0-9]+)?$"
"""A Kubernetes resource quantity (`500m`, `16`, `128Gi`, `1e12`)."""
MAX_QUANTITY: Final = 64
"""The longest quantity a field takes: bounds the cost of the CEL rules that read one."""
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
JOB_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
"""A DNS-1035 label: the job's name is also its Service's name and the start of its pods' hostnames."""
JOB_NAME_START_REASON: Final = "must start with a letter (it is also the name of the job's Service, a DNS-1035 label)"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
LABEL_VALUE_PATTERN = r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
LABEL_KEY_PATTERN = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                     r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
"""A label key: an optional DNS-subdomain prefix and `/`, then a name of at most 63 characters."""
MAX_LABEL_KEY_PREFIX: Final = 253
"""A label (or annotation) key's prefix is a DNS subdomain: at most 253 characters (the pattern bounds the name only)."""
MAX_LABEL_VALUE: Final = 63
MAX_ANNOTATIONS_BYTES: Final = 262_144
"""256 KiB: the most the API server takes for all of an object's annotations, keys and values together."""
IMAGE_PATTERN = (r"^(([a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?(\.[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?)*|\[[0-9a-fA-F:.]+\])"
                 r"(:[0-9]+)?/)?"
                 r"[a-z0-9]+(([._]|__|-+)[a-z0-9]+)*(/[a-z0-9]+(([._]|__|-+)[a-z0-9]+)*)*"
                 r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@[a-z0-9]+([+._-][a-z0-9]+)*:[0-9a-fA-F]{32,})?$")
"""An image reference as the OCI distribution grammar has it, loosely: `[registry[:port]/]path[:tag][@digest]`
(`ghcr.io/kubetrain/trainer:0.1.0`, `localhost:5000/x@sha256:<hex>`). The kubelet refuses anything else
(InvalidImageName), so the job is refused before it has pods: no spaces, no shell characters, and a lowercase
repository (the registry's host name may have capitals)."""
ABSOLUTE_PATH_PATTERN = r"^/"
SYSTEM_DIRS: Final = ("bin", "boot", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "run", "sbin", "sys",
                      "usr", "var/run")
"""Directories of a container's (and a host's) system: a checkpoint volume mounted over one hides it, and a
fresh local run would clear it. kubetrain's own mounts (contract.CONFIG_MOUNT, ...) all lie under these."""
SYSTEM_DIR_PATTERN = "^/((" + "|".join(SYSTEM_DIRS) + ")(/|$)|$)"
"""`/` itself, or a path in a system directory (written for CEL's RE2 and Python's re alike)."""
DOT_SEGMENT_PATTERN = "(^|/)[.][.]?(/|$)|//"
"""A path with `.` or `..` segments or an empty one: what it names depends on where it is resolved."""
S3_URI_PATTERN = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^/\s]+)*/?$"
"""checkpoint.uri: a bucket (S3's naming rules) and an optional key prefix of non-empty segments."""
HTTP_URL_PATTERN = r"^https?://[^/\s?#]+(/[^\s?#]*)?$"
PATTERN_REASONS: Final = {
    ABSOLUTE_PATH_PATTERN: "must be an absolute path (pods mount the checkpoint volume there)",
    DNS_LABEL_PATTERN: "must be a lowercase DNS label (a-z, 0-9, '-')",
    QUANTITY_PATTERN: "must be a Kubernetes quantity (e.g. 500m, 16, 128Gi)",
    DNS_SUBDOMAIN_PATTERN: "must be a lowercase DNS subdomain (a-z, 0-9, '-', '.')",
    LABEL_VALUE_PATTERN: "must be a label value: letters, digits, '-', '_' or '.', starting and ending with a letter or digit",
    LABEL_KEY_PATTERN: "must be a label key: an optional DNS subdomain and '/', then a name of letters, digits, '-', '_' or '.'",
    IMAGE_PATTERN: "must be an image reference, [registry[:port]/]repository[:tag][@digest]: a lowercase repository, "
                   "no spaces or shell characters",
    S3_URI_PATTERN: "must be s3://bucket or s3://bucket/prefix: a lowercase bucket name (3 to 63 of a-z, 0-9, '.', "
                    "'-'), then '/'-separated prefix segments without spaces",
    HTTP_URL_PATTERN: "must be an http:// or https:// URL",
}
"""How `kubetrain validate` words a value that does not match one of these patterns."""
OWN_ERROR: Final = "kubetrain"
"""Error type of the problems our own validators raise: their message is already the reason."""

# Maxima: every count and duration has one, so that no accepted value overflows later
# (timedelta, 2**n backoff, int64 in the API server) or exceeds what a Kubernetes name can hold.
MAX_WORKERS: Final = 10_000
"""With a 50-character job name the last pod's hostname, `<job>-worker-9999`, stays within 63 characters."""
MAX_PROCS_PER_WORKER: Final = 256
MAX_STEPS: Final = 1_000_000_000
MAX_DEADLINE_SECONDS: Final = 31_536_000
"""One year: activeDeadlineSeconds, progressDeadlineSeconds, ttlSecondsAfterFinished."""
MAX_BACKOFF_SECONDS: Final = 86_400
"""One day: backoffSeconds, maxBackoffSeconds, nodeNotReadyGraceSeconds."""
ExitCode = Annotated[int, Field(ge=1, le=255)]
"""A worker's non-zero exit code (128 + N: killed by signal N)."""

# Conditions beside the phase ones (Created, Running, Restarting, Suspended, Succeeded, Failed).
CHECKPOINTS_DURABLE = "CheckpointsDurable"
"""Condition: checkpoints survive a gang restart (True: on a claim or in object storage; False: spec.checkpoint.ephemeral)."""
WORKERS_BLOCKED = "WorkersBlocked"
"""Condition: a worker pod of the current generation cannot start (image, configuration, scheduling); the job waits."""
ADMITTED = "Admitted"
"""Condition (jobs with scheduling.queue): Kueue admitted the job's Workload; False says why it waits (quota, eviction)."""
TRIALS_BLOCKED = "TrialsBlocked"
"""Condition (TrainingSweep): a trial's TrainingJob could not be created (a quota, admission, or its name held by a
job the sweep does not own); its trial waits Pending and the create is retried with backoff."""
FABRIC_DEGRADED = "FabricDegraded"
"""Condition: spec.fabric names a fabric, but NCCL on rank 0 chose another network transport (most often
TCP sockets, which NCCL falls back to without a word when the fabric is not wired into the pods)."""
OPERATOR_OUTDATED = "OperatorOutdated"
"""Condition: the stored spec has fields the operator does not know (its CRD is newer than the operator): a job
not started yet waits for an operator that knows them; a running job goes on without them."""
NODES_NOT_READY = "NodesNotReady"
"""Condition: a node running a worker of the current generation is NotReady (the message names it and says whether
the job still makes progress there, in which case the gang is not restarted)."""
RUNTIME_RESOLVED = "RuntimeResolved"
"""Condition (jobs with spec.runtimeRef): its TrainingRuntime or ClusterTrainingRuntime was found and applied; False
says why the job waits (the runtime does not exist, or the operator may not read it)."""
NODE_DEGRADED = "NodeDegraded"
"""Condition: the preflight before the current generation's first step found a rank whose compute or neighbour
exchange is below spec.preflight.degradedFraction of the gang's median (the message names rank, worker and node)."""


class ConditionReason(enum.StrEnum):
    """Reasons of the CheckpointsDurable, WorkersBlocked, NodesNotReady, FabricDegraded and Admitted conditions."""

    DEFAULT_CLAIM = "DefaultClaim"
    """CheckpointsDurable: on the claim `<job>-checkpoints` the operator created."""
    USER_CLAIM = "UserClaim"
    """CheckpointsDurable: on the claim named in spec.checkpoint.claimName."""
    EPHEMERAL_CHECKPOINTS = "EphemeralCheckpoints"
    """CheckpointsDurable False: spec.checkpoint.ephemeral keeps them in each pod."""
    OBJECT_STORE = "ObjectStore"
    """CheckpointsDurable: in the object storage of spec.checkpoint.uri."""
    IMAGE_PULL_FAILED = "ImagePullFailed"
    """WorkersBlocked: the kubelet cannot pull the image (ErrImagePull, ImagePullBackOff)."""
    INVALID_IMAGE_NAME = "InvalidImageName"
    CONTAINER_CONFIG_ERROR = "ContainerConfigError"
    """WorkersBlocked: CreateContainerConfigError (a missing Secret or ConfigMap, a bad key, ...)."""
    CONTAINER_CREATE_ERROR = "ContainerCreateError"
    """WorkersBlocked: CreateContainerError from the container runtime."""
    UNSCHEDULABLE = "Unschedulable"
    """WorkersBlocked: the scheduler finds no node (resources, selectors, taints, volumes)."""
    CHECKPOINT_CLAIM_PENDING = "CheckpointClaimPending"
    """WorkersBlocked: unschedulable because the checkpoint claim is not bound (or does not exist)."""
    WORKERS_STARTING = "WorkersStarting"
    """WorkersBlocked False: no worker pod is blocked any more."""
    CREATE_REJECTED = "CreateRejected"
    """WorkersBlocked: the API server refused a worker pod (ResourceQuota, Pod Security Admission, an invalid field)."""
    FOREIGN_OBJECT = "ForeignObject"
    """WorkersBlocked: an object with a child's name exists and is not owned by this job; it is not adopted. Admitted False: so does a Workload under the job's Workload name."""
    GANG_SCHEDULER_MISSING = "GangSchedulerMissing"
    """WorkersBlocked: the API server does not serve the PodGroup kind of spec.scheduling.gang (its CRD is not installed); no worker pod is created until it is."""
    NCCL_FALLBACK_TO_SOCKET = "NcclFallbackToSocket"
    """FabricDegraded: NCCL fell back to TCP sockets instead of the fabric's transport."""
    UNEXPECTED_TRANSPORT = "UnexpectedTransport"
    """FabricDegraded: NCCL chose a network transport that is neither the fabric's nor sockets."""
    FABRIC_IN_USE = "FabricInUse"
    """FabricDegraded False: NCCL uses the fabric's transport (again)."""
    RANK_DEGRADED = "RankDegraded"
    """NodeDegraded: the preflight found a rank below spec.preflight.degradedFraction of the gang's median."""
    PREFLIGHT_PASSED = "PreflightPassed"
    """NodeDegraded False: a later generation's preflight found no degraded rank."""
    QUOTA_RESERVED = "QuotaReserved"
    """Admitted: Kueue admitted the Workload (quota reserved in its ClusterQueue, admission checks passed)."""
    QUEUED = "Queued"
    """Admitted False: the Workload waits in its LocalQueue (the message is Kueue's: which quota is short)."""
    EVICTED = "Evicted"
    """Admitted False: Kueue evicted the Workload (preempted by a higher priority, deactivated, ...); the gang stops with a checkpoint and waits to be admitted again."""
    DEACTIVATED = "Deactivated"
    """Admitted False: the job is suspended (spec.suspend), so its Workload is deactivated (spec.active false) and holds no quota; resuming activates it and it queues again."""
    KUEUE_MISSING = "KueueMissing"
    """Admitted False: the API server does not serve Kueue's Workload kind (Kueue is not installed); no worker pod is created until it is."""
    PRIORITY_CLASS_MISSING = "PriorityClassMissing"
    """Admitted False: the WorkloadPriorityClass named by the label kueue.x-k8s.io/priority-class does not exist."""
    TRIALS_CREATED = "TrialsCreated"
    """TrialsBlocked False (TrainingSweep): the trial job create that was refused has been made."""
    NODE_NOT_READY = "NodeNotReady"
    """NodesNotReady: a worker's node is NotReady."""
    NODES_READY = "NodesReady"
    """NodesNotReady False: every worker's node is Ready (again)."""
    CLUSTER_DISRUPTION = "ClusterDisruption"
    """NodesNotReady: a worker's node is NotReady while so many of the cluster's nodes are (all, or at least 55% and 3 or more) that the cluster, not the node, is likely at fault; the gang is not restarted for it until the disruption ends."""
    OPERATOR_STORE = "OperatorStore"
    """CheckpointsDurable: in the operator's object store (status.checkpointStore), since the job's StorageClass offers ReadWriteOnce only."""
    NO_SHARED_STORAGE = "NoSharedStorage"
    """CheckpointsDurable False: several workers would share a claim of a StorageClass that offers ReadWriteOnce only, and the operator has no checkpointStore; the job waits Pending."""
    RUNTIME_APPLIED = "RuntimeApplied"
    """RuntimeResolved: the runtime of spec.runtimeRef is applied (status.runtime)."""
    RUNTIME_NOT_FOUND = "RuntimeNotFound"
    """RuntimeResolved False: the runtime of spec.runtimeRef does not exist (or the operator may not read it); the job waits Pending for it."""
    UNKNOWN_FIELDS = "UnknownFields"
    """OperatorOutdated: the spec has fields this operator does not know (the message names them)."""
    PROGRESS_REPORTING_FORBIDDEN = "ProgressReportingForbidden"
    """A Warning Event, no condition: the API server refused the job's progress Role or RoleBinding (the operator lacks RBAC for it); the job trains, its status shows no progress."""
    MEMORY_BUDGET = "MemoryBudget"
    """A Warning Event, no condition: rank 0 found that a pod's memory cannot hold the memory tier, or background saves' staging (status.memory.notices); the job trains without it."""


class _Model(BaseModel):
    """Base: camelCase on the wire, unknown fields rejected, docstrings as descriptions."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
        allow_inf_nan=False,  # JSON (and so the API server) has no infinity or NaN
    )

    def dump(self) -> dict[str, Any]:
        """The wire form: camelCase keys, unset optional fields left out."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")

    def dump_changed(self) -> dict[str, Any]:
        """The wire form of the values that differ from their defaults. A trainer image older than the
        operator reads it as long as the job sets no field the image lacks; the full form would name
        every field the operator knows, and the older image would refuse the new ones."""
        return self.model_dump(by_alias=True, exclude_defaults=True, mode="json")


# --------------------------------------------------------------------------- spec pieces


class FSDPSpec(_Model):
    """Options for strategy `fsdp` (PyTorch FSDP2 `fully_shard`, one unit per transformer block)."""

    reshard_after_forward: bool = True
    """Free each block's gathered parameters after its forward pass (ZeRO-3 like, less memory). False keeps them until backward (ZeRO-2 like, less communication)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in host memory."""
    accumulate_unsharded: bool = False
    """With gradientAccumulationSteps > 1: keep each micro-batch's gradients whole and reduce-scatter them once per step, instead of once per micro-batch. One reduce-scatter per step instead of gradientAccumulationSteps, but every process holds the whole model's gradient (4 bytes per parameter in fp32: 32 GB for an 8B model) until the step's last micro-batch. False (the default) keeps gradients sharded throughout. Pipeline stages (parallelism.pipeline > 1) accumulate whole gradients either way (torch's pipeline schedule)."""


class DeepSpeedSpec(_Model):
    """Options for strategy `deepspeed` (DeepSpeed ZeRO)."""

    zero_stage: int = Field(2, ge=0, le=3)
    """ZeRO stage: 0 (plain data parallel), 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters)."""
    offload_optimizer: bool = False
    """Offload optimizer state and step to CPU (ZeRO-Offload). Needs zeroStage >= 1."""
    offload_param: bool = False
    """Offload parameters to CPU. Needs zeroStage 3."""
    config: dict[str, Any] | None = None
    """Extra DeepSpeed config merged over the generated one (expert use; kubetrain's own keys win for batch size, precision and ZeRO stage)."""


class DDPSpec(_Model):
    """Options for strategy `ddp` (PyTorch DistributedDataParallel)."""

    gradient_compression: Literal["none", "powersgd"] = "none"
    """Gradient all-reduce: `none` (full gradients) or `powersgd` (PowerSGD low-rank compression with error feedback; helps when the network, not the GPUs, limits the step time)."""
    power_sgd_rank: int = Field(1, ge=1, le=32)
    """PowerSGD: rank of the low-rank approximation of each weight matrix's gradient (1-32). Lower compresses more; raise it (1, 2, 4, ...) when the loss lags uncompressed training."""
    power_sgd_start_step: int = Field(10, ge=2, le=MAX_STEPS)
    """PowerSGD: optimizer steps that use the plain all-reduce before compression starts (at least 2; PyTorch suggests about 10% of the steps, and no fewer than the learning-rate warm-up steps)."""


class ParallelismSpec(_Model):
    """How each model is split across processes beyond data parallelism (docs/trainer.md#tensor-parallelism, docs/trainer.md#pipeline-parallelism)."""

    tensor: int = Field(1, ge=1, le=MAX_PROCS_PER_WORKER)
    """Tensor-parallel degree T: every block's attention and MLP projections are split across T processes of one worker (their fast intra-node links), and data parallelism (strategy fsdp) runs over the world size / T groups. T must divide procsPerWorker and model.nHeads (for a model.hfPath model: its config's num_attention_heads and num_key_value_heads, which the trainer checks when it loads the model); T > 1 needs strategy fsdp, and the built-in model or a model.hfPath model of the Llama family (model_type llama, mistral, qwen2 or qwen3). 1 (the default): data parallelism only."""
    pipeline: int = Field(1, ge=1, le=1024)
    """Pipeline-parallel degree P: the model's blocks are split into P consecutive stages (the first also holds the embeddings, the last the head and the loss), each run by world size / P processes, and the step's gradientAccumulationSteps micro-batches flow through them. P × tensor must divide the world size and P be at most model.nLayers; P > 1 needs strategy fsdp, the built-in model and precision fp32 or bf16; it composes with tensor (each stage split over T processes of a worker). 1 (the default): no pipeline."""
    replicate: int = Field(1, ge=1, le=4096)
    """HSDP (strategy fsdp): the data-parallel processes form R groups; FSDP2 shards each block's parameters, gradients and optimizer state within a group and replicates the shards across the groups, so a block's all-gather and reduce-scatter stay inside a group and only one all-reduce of the sharded gradients per step crosses groups. Choose R so that a group is one worker (R = workers with tensor and pipeline 1): the sharded traffic stays on a node's fast links, the inter-node network carries one all-reduce per step. R must divide world size / (tensor × pipeline); each process then holds 1/(world size / (tensor × pipeline × R)) of the model's state. 1 (the default): FSDP over all data-parallel processes."""
    pipeline_schedule: Literal["GPipe", "1F1B", "Interleaved1F1B"] = "1F1B"
    """Order of the micro-batches' forward and backward passes on each stage: `1F1B` (the default) starts each micro-batch's backward as soon as the last stage has its loss and keeps at most P micro-batches' activations per stage (it needs gradientAccumulationSteps >= pipeline); `GPipe` runs all forwards, then all backwards (every micro-batch's activations held at once); `Interleaved1F1B` gives each process 2 smaller stages (process r runs stages r and r + P of 2P), a smaller idle bubble for twice the sends (it needs gradientAccumulationSteps a multiple of pipeline and model.nLayers >= 2 x pipeline)."""


class ModelSpec(_Model):
    """The model to train: the built-in decoder-only transformer, or a Hugging Face causal LM from a local path."""

    vocab_size: int = Field(256, ge=2, le=1_048_576)
    """Vocabulary size of the built-in transformer (256 for the byte-level tokenizer). At most 1048576."""
    d_model: int = Field(128, ge=8, le=65_536)
    """Hidden size of the built-in transformer. At most 65536."""
    n_layers: int = Field(2, ge=1, le=1024)
    """Number of transformer blocks. At most 1024."""
    n_heads: int = Field(4, ge=1, le=1024)
    """Attention heads per block; dModel must be divisible by it. At most 1024."""
    seq_len: int = Field(128, ge=8, le=1_048_576)
    """Sequence length (tokens per sample). At most 1048576."""
    hf_path: str | None = None
    """Local path (volume) of a Hugging Face causal LM to train instead of the built-in model. Never downloaded from a hub."""
    hf_uri: str | None = Field(None, max_length=1024, pattern=S3_URI_PATTERN)
    """A Hugging Face causal LM directory in object storage (`s3://bucket/prefix`: config.json, the safetensors weights, ...), trained as hfPath would be. Every worker pod fetches it once, before training starts, into its cache (in pods the init container `fetch` and an emptyDir; `kubetrain run`: `<output dir>/cache`); its progress and failure show in the job's status. How to reach the store: spec.s3."""

    def is_hf(self) -> bool:
        """A Hugging Face model (hfPath or hfUri), not the built-in transformer."""
        return self.hf_path is not None or self.hf_uri is not None


TokenDtype = Literal["uint16", "uint32"]
DataFormat = Literal["text", "chat", "instruction"]


class DataSpec(_Model):
    """Training data: text from local files, or token or text shards streamed from object storage."""

    path: str = "data"
    """A text file or a directory of text files (read in sorted order). Relative paths resolve against the manifest's directory in local runs and the working directory in pods."""
    glob: str = "*.txt"
    """File pattern when path is a directory."""
    tokenizer: str = Field("byte", min_length=1)
    """`byte` (UTF-8 bytes, vocabulary 256; ships with kubetrain), or a local Hugging Face tokenizer directory (its `tokenizer.json`, read with the `tokenizers` package; never downloaded). Its ids must fit the model's vocabulary (model.vocabSize, or the hfPath model's own)."""
    eval_path: str | None = None
    """Held-out text for evaluation (evalEverySteps): a file or a directory (same glob). Unset: the last 5% of the training text is held out instead (and not trained on)."""
    uri: str | None = Field(None, max_length=1024, pattern=S3_URI_PATTERN)
    """Training data in object storage instead of path (docs/trainer.md#data-from-object-storage): the objects under `s3://bucket/prefix` that match glob, in key order, are shards. A shard ending in `.bin` holds token ids (little-endian tokenDtype, as tokenized offline); any other is UTF-8 text read with the byte tokenizer. Each data-parallel rank streams shards of its own (a new shuffle each epoch) through a local cache, prefetching the next ones while it trains, and reads consecutive seqLen+1-token windows; the windows of step s are a function of (seed, s, the number of data-parallel ranks, the listing) only, so a resume continues at the exact sample. How to reach the store: spec.s3."""
    token_dtype: TokenDtype = "uint16"
    """Integer type of `.bin` token shards in data.uri: `uint16` (vocabularies up to 65536) or `uint32`."""
    tokenizer_uri: str | None = Field(None, max_length=1024, pattern=S3_URI_PATTERN)
    """A Hugging Face tokenizer directory in object storage (its tokenizer.json), used instead of tokenizer: every worker pod fetches it once before training, like model.hfUri."""
    format: DataFormat = "text"
    """How the files are read (docs/trainer.md#fine-tuning-data). `text` (the default): their text concatenated, and windows of seqLen+1 tokens at random offsets, every token counted. `chat`: JSONL, one conversation a line, `{"messages": [{"role": ..., "content": ...}, ...]}`, rendered with the tokenizer's own chat template (its tokenizer_config.json or chat_template.jinja; the byte tokenizer's is `<|role|>` lines); `instruction`: JSONL, `{"prompt": ..., "response": ...}`. For chat and instruction the loss counts the assistant's (response) tokens only, and each sample is one sequence, cut at seqLen+1 tokens and padded (never packed with others, so no sample attends to another's tokens); every sample is seen once an epoch, in an order drawn from the seed (resumable). data.glob defaults to `*.txt`: set `*.jsonl` for a directory of JSONL files. With data.uri the JSONL objects are fetched into the pod's cache before training, like model.hfUri."""


class LoraSpec(_Model):
    """LoRA adapters (the `peft` library): the model's own weights frozen, low-rank adapters trained beside its linear layers (docs/trainer.md#lora)."""

    rank: int = Field(16, ge=1, le=4096)
    """The adapters' rank r."""
    alpha: float = Field(32.0, gt=0, le=1_000_000)
    """Scale: each adapter's output is multiplied by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input (0: none, and the run is deterministic)."""
    target_modules: list[str] | None = Field(None, min_length=1, max_length=256)
    """Names (or name suffixes) of the linear layers that get adapters, e.g. `[q_proj, v_proj]`. Unset: every linear layer of the transformer blocks (peft's `all-linear`: not the output head)."""


class ExportSpec(_Model):
    """What the trainer writes when the job succeeds, beside its checkpoints (docs/trainer.md#exporting-the-model)."""

    hugging_face: bool = False
    """`<checkpoint dir>/export/`: the trained model as a Hugging Face directory that `from_pretrained` loads: config, safetensors weights (LoRA merged into the base; the adapter alone in `export/adapter/`), the tokenizer and its chat template. With checkpoint.uri it is uploaded to `<checkpoint.uri>/export/` too. status.export and summary.json's export_dir say where."""


class OptimizerSpec(_Model):
    """AdamW with linear warmup and cosine decay."""

    name: Literal["adamw"] = "adamw"
    """Optimizer."""
    lr: float = Field(3e-3, gt=0)
    """Peak learning rate."""
    min_lr: float = Field(3e-4, ge=0)
    """Learning rate at the end of the cosine decay."""
    weight_decay: float = Field(0.01, ge=0)
    """Decoupled weight decay."""
    beta1: float = Field(0.9, ge=0, lt=1)
    """Adam beta1."""
    beta2: float = Field(0.95, ge=0, lt=1)
    """Adam beta2."""
    warmup_steps: int = Field(10, ge=0, le=MAX_STEPS)
    """Linear warmup steps. At most 1000000000."""
    grad_clip: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this value (0 disables clipping)."""


class ProfileSpec(_Model):
    """torch.profiler over a range of steps (traces under <checkpoint dir>/profiles, docs/trainer.md#profiling)."""

    steps: str = Field(pattern=r"^[0-9]{1,10}-[0-9]{1,10}$")
    """First and last step profiled, e.g. `6-8` (the first step is 1)."""

    @property
    def first_last(self) -> tuple[int, int]:
        first, last = self.steps.split("-")
        return int(first), int(last)


ResumeTier = Literal["memory", "durable"]


class MemoryTierSpec(_Model):
    """The fast checkpoint tier: each rank keeps its own part of the newest state in memory that outlives its process but not its pod (the pod's /dev/shm; locally a directory under /dev/shm removed at the end of the run). A gang restart that kept every pod (restartPolicy.inPlace) resumes from the newest step every rank holds there, when it is newer than the durable tier's; a restart that recreated any pod resumes from the durable tier."""

    enabled: bool = True
    """False: no memory tier; every restart resumes from the durable checkpoint directory."""
    every_steps: int = Field(10, ge=1, le=MAX_STEPS)
    """Keep the state in memory every N optimizer steps: a restart in place redoes at most N steps."""
    memory_share: float = Field(0.25, gt=0, le=0.9)
    """The share of a worker pod's memory (its memory limit, else /dev/shm's size) that the tier may hold over the pod's processes; each keeps two copies of its state while it writes a new one, and the pod's /dev/shm is sized to hold the share. Where a pod cannot hold every process's two copies (this share, /dev/shm's room, or the memory limit beside what the processes use), rank 0 says so once with the numbers (its log, status.memory.notices, a Warning Event MemoryBudget) and the gang keeps no tier that generation; restarts then resume from the durable tier."""

    def budget_bytes(self, memory_bytes: int, processes: int) -> int:
        """Each of a worker's `processes` processes' budget (contract.MEMORY_CKPT_BYTES) out of the worker's
        `memory_bytes` (its pod's memory limit, else its /dev/shm size; locally /dev/shm's size over all ranks)."""
        return int(self.memory_share * memory_bytes) // max(1, processes)


S3AddressingStyle = Literal["path", "virtual"]


class WorkdirSpec(_Model):
    """A directory shipped with the job (`kubetrain submit --workdir DIR`, docs/operator.md#shipping-a-working-directory)."""

    config_map: str = Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    """A ConfigMap in the job's namespace whose binaryData `workdir.tar.gz` is the directory as a gzipped tar. Every worker pod's init container `kubetrain-workdir` unpacks it into the trainer container's working directory (/var/run/kubetrain-workdir), so a relative command or data.path resolves there. `kubetrain submit --workdir DIR` creates it (immutable, named by its content, owned by the job)."""


class S3Spec(_Model):
    """How workers reach the S3 API of the job's `s3://` URIs: checkpoint.uri, data.uri, model.hfUri, data.tokenizerUri (docs/trainer.md#object-storage). Credentials come from the environment: the Secret named here, else the pod's cloud identity (EKS IRSA or Pod Identity through the job's serviceAccountName) or the AWS SDK's default chain."""

    endpoint: str | None = Field(None, max_length=2048, pattern=HTTP_URL_PATTERN)
    """The S3 API's URL, e.g. `https://storage.googleapis.com` (GCS) or an in-cluster MinIO/SeaweedFS/Ceph gateway. Unset: AWS S3 in `region`."""
    region: str | None = Field(None, max_length=64, pattern=r"^[a-z0-9][-a-z0-9]*$")
    """The bucket's region (AWS: e.g. `eu-west-1`; GCS: `auto`). Unset: the SDK's default (AWS_REGION, ~/.aws/config)."""
    addressing_style: S3AddressingStyle | None = None
    """`virtual`: the bucket is a host name (`bucket.endpoint`); `path`: it is the URL's first path segment (`endpoint/bucket`). Unset: path with an endpoint (most self-hosted stores only serve that), virtual without (AWS)."""
    credentials_secret: str | None = Field(None, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    """A Secret in the job's namespace with the keys AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and optionally AWS_SESSION_TOKEN): they become the trainer's environment. Unset: the pod's cloud identity or the SDK's default chain. `kubetrain run` reads the same variables from your environment (or ~/.aws) instead."""

    def style(self) -> S3AddressingStyle:
        """The addressing style in effect (the default depends on the endpoint)."""
        return self.addressing_style or ("path" if self.endpoint else "virtual")


class CheckpointSpec(_Model):
    """Checkpointing: periodic, on SIGTERM, atomic, and used for every gang restart."""

    every_steps: int = Field(50, ge=1, le=MAX_STEPS)
    """Save a checkpoint every N optimizer steps (and at the last step). At most 1000000000."""
    keep: int = Field(3, ge=1, le=1000)
    """Keep the newest K complete checkpoints; older ones are deleted. At most 1000."""
    on_sigterm: bool = True
    """Save a checkpoint when a worker is asked to stop (preemption, node drain, Ctrl-C)."""
    dir: str | None = Field(None, max_length=1024, pattern=ABSOLUTE_PATH_PATTERN)
    """Checkpoint directory, an absolute path: not `/`, not in a system directory (/etc, /usr, /var/run, ...), without `.` or `..` segments. Default: `<output dir>/checkpoints` locally, `/checkpoints` in pods. In pods the checkpoint volume (the claim, or an emptyDir with ephemeral or uri) is mounted here. Locally kubetrain writes only into a directory it created or found empty, and a fresh run clears only such a directory."""
    claim_name: str | None = Field(None, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    """An existing PersistentVolumeClaim mounted at the checkpoint directory (`dir`, default /checkpoints) in every worker pod instead of the one the operator creates. With more than one worker it must be ReadWriteMany (unless every worker lands on one node)."""
    storage_size: str = Field(DEFAULT_CHECKPOINT_STORAGE, max_length=MAX_QUANTITY, pattern=QUANTITY_PATTERN)
    """Size of the claim `<job>-checkpoints` that the operator creates, owned by the job and deleted with it, when none of claimName, ephemeral and uri is set."""
    storage_class_name: str | None = Field(None, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    """StorageClass of the claim the operator creates. Unset: the cluster's default StorageClass."""
    access_mode: AccessMode | None = None
    """Access mode of the claim the operator creates. Unset: ReadWriteOnce for one worker, ReadWriteMany for more (every worker mounts the same claim, so its StorageClass must offer ReadWriteMany: NFS, EFS, Filestore, Azure Files, CephFS, ...)."""
    async_save: bool = True
    """Write durable checkpoints in the background (strategies ddp and fsdp): training stops only while the state is copied to memory. At most one write is in flight; the next due save waits for it, and a save on SIGTERM or at the last step waits for its write. A checkpoint counts (COMMITTED) only once every rank's write has finished. DeepSpeed saves synchronously."""
    memory: MemoryTierSpec = Field(default_factory=MemoryTierSpec)
    """The fast tier in each pod's memory, which restarts in place resume from."""
    uri: str | None = Field(None, max_length=1024, pattern=S3_URI_PATTERN)
    """Durable checkpoints in S3-compatible object storage, `s3://bucket/prefix`, instead of a claim: each rank writes its part to a directory of its own (in pods an emptyDir at `dir`, no claim) and uploads it in the background; rank 0 writes `COMMITTED` last, once every rank's upload finished. A resume downloads the newest committed checkpoint; `keep` prunes the bucket. How to reach the store: spec.s3."""
    ephemeral: bool = False
    """Keep checkpoints in a per-pod emptyDir, no claim: they are lost whenever the worker pods are deleted, so every gang restart starts over from step 0 (the job's CheckpointsDurable condition is False). For clusters without storage and for tests. `kubetrain run` ignores it: local checkpoints always survive restarts."""


GPU_RESOURCE: Final = "nvidia.com/gpu"
"""The extended resource resources.gpusPerWorker requests."""
OWN_RESOURCES: Final = (GPU_RESOURCE, "cpu", "memory")
"""Resources with a field of their own (gpusPerWorker, cpu, memory), which resources.extra may not set."""


class ResourcesSpec(_Model):
    """Per-worker-pod resources."""

    gpus_per_worker: int = Field(0, ge=0, le=64)
    """GPUs requested per worker pod (`nvidia.com/gpu`). Also the default procsPerWorker when that is not set. At most 64."""
    cpu: str | None = Field(None, max_length=MAX_QUANTITY, pattern=QUANTITY_PATTERN)
    """CPU request and limit per worker pod, a quantity written as a string (e.g. `"16"`, `500m`)."""
    memory: str | None = Field(None, max_length=MAX_QUANTITY, pattern=QUANTITY_PATTERN)
    """Memory request and limit per worker pod (e.g. `128Gi`)."""
    shm_size: str = Field("16Gi", max_length=MAX_QUANTITY, pattern=QUANTITY_PATTERN)
    """Size of the in-memory /dev/shm volume."""
    extra: dict[str, Annotated[str, Field(pattern=QUANTITY_PATTERN)]] | None = None
    """Extra extended resources per worker pod (e.g. `rdma/ib: "1"`). Merged over those the fabric profile adds; yours win. Not `nvidia.com/gpu`, `cpu` or `memory`: gpusPerWorker, cpu and memory set them."""


FailureAction = Literal["FailJob", "RestartGang", "RestartGangAndIgnore"]
FailureName = Literal["ExitCode", "Deleted", "Disrupted", "Evicted", "OOMKilled", "NodeLost", "NoProgress",
                      "StartTimeout"]


class FailureRule(_Model):
    """What one kind of failure does to the job. The first rule that matches wins."""

    action: FailureAction
    """FailJob: fail at once. RestartGang: restart, counted against backoffLimit. RestartGangAndIgnore: restart, not counted."""
    on_exit_codes: list[ExitCode] | None = Field(None, min_length=1, max_length=255)
    """Matches a worker that exited with one of these codes."""
    on_failures: list[FailureName] | None = Field(None, min_length=1, max_length=8)
    """Matches these failures: ExitCode (any other non-zero exit), Deleted, Disrupted (preempted, evicted through the API, drained: the pod's DisruptionTarget condition), Evicted (by the kubelet), OOMKilled, NodeLost, NoProgress, StartTimeout."""


class HangDetectionSpec(_Model):
    """Hang detection: every rank writes a heartbeat (kubetrain's trainer at every step; a custom script through `kubetrain.core.hangs.write_beat` or the same JSON file, see docs/trainer.md); the worker's launcher (or the local backend) declares the worker hung when a rank is silent past its limit, saves the Python stacks of every rank, names the odd one out in status.lastHang and an Event, and the gang restarts (failure NoProgress). A rank that never wrote a heartbeat is never judged."""

    enabled: bool = True
    """False turns hang detection off; progressDeadlineSeconds still applies."""
    min_seconds: int = Field(30, ge=5, le=MAX_DEADLINE_SECONDS)
    """The shortest silence taken for a hang between two training steps. A rank whose process is stopped (SIGSTOP) is hung after 5 s of silence in any phase."""
    step_time_factor: float = Field(10.0, ge=2, le=1000)
    """Between two steps a rank may be silent this many times the longest of its last 20 step times (at least minSeconds). restartPolicy.progressDeadlineSeconds, where set, is the limit instead."""
    phase_seconds: int = Field(300, ge=5, le=MAX_DEADLINE_SECONDS)
    """A checkpoint save or an evaluation may take this long, or three times the longest one seen before."""
    start_seconds: int = Field(900, ge=5, le=MAX_DEADLINE_SECONDS)
    """From a rank's start to the end of its first step (imports, rendezvous, loading, compilation, the first step)."""

    def limits(self, explicit: int | None) -> hangs.Limits | None:
        """The launcher's limits (None: off)."""
        if not self.enabled:
            return None
        return hangs.Limits(float(self.min_seconds), self.step_time_factor, float(self.phase_seconds),
                            float(self.start_seconds), None if explicit is None else float(explicit))


class RestartPolicySpec(_Model):
    """When and how the whole gang is restarted from the latest complete checkpoint."""

    backoff_limit: int = Field(3, ge=0, le=1000)
    """Gang restarts allowed before the job fails. At most 1000."""
    backoff_seconds: float = Field(5.0, ge=0, le=MAX_BACKOFF_SECONDS)
    """Delay before the first restart; doubles after each restart. At most 86400 (one day)."""
    max_backoff_seconds: float = Field(300.0, ge=0, le=MAX_BACKOFF_SECONDS)
    """Upper bound of the restart delay. At most 86400 (one day)."""
    permanent_exit_codes: list[ExitCode] = Field(max_length=255, default_factory=lambda: [
        contract.CONFIG_ERROR_EXIT_CODE, contract.COMMAND_NOT_EXECUTABLE_EXIT_CODE, contract.COMMAND_NOT_FOUND_EXIT_CODE])
    """Worker exit codes (1 to 255) that fail the job at once (configuration errors). Every other non-zero exit, signal, eviction or lost node restarts the gang."""
    progress_deadline_seconds: int | None = Field(None, ge=1, le=MAX_DEADLINE_SECONDS)
    """Restart the gang when rank 0 reports no new step for this long (NoProgress). It is also the hang detector's limit between two steps of any rank, instead of the adaptive one (hangDetection). Unset: only hangDetection applies. At most 31536000 (one year)."""
    node_not_ready_grace_seconds: int = Field(60, ge=0, le=MAX_BACKOFF_SECONDS)
    """How long the job may make no progress while a worker's node is NotReady before the gang is restarted, counted from the job's last progress (from the node going NotReady when none is known): a node that died stopped the job when it died, ~50 s before the node lifecycle controller says NotReady; while the job still advances (a kubelet that lost the API server leaves its containers training) the gang is kept, and the condition NodesNotReady with a Warning Event names the node. No grace when a worker kept by an in-place restart says its processes lost their peers (it is not Ready while it waits): the gang cannot advance, and a node whose kubelet has not renewed its Lease for 20 s counts as NotReady then. So does, at once, a node whose kubelet has not renewed its Lease since its worker fell silent: a peer's launcher found that worker not answering, or its pod still said Ready 5 s after another worker lost its peers. At most 86400 (one day)."""
    avoid_degraded_nodes: bool = False
    """Keep later generations off the nodes where the preflight found a degraded rank (the NodeDegraded condition): worker pods created after it get a required node affinity `kubernetes.io/hostname NotIn` those nodes (status.avoidedNodes, which remembers them for the job's life). A worker kept by an in-place restart stays where it runs. kubetrain taints no node."""
    start_timeout_seconds: int | None = Field(None, ge=1, le=31536000)
    """How long a gang may take from its creation until every worker runs (pods unschedulable, refused, pulling images). Past it the gang is released, so its scheduled pods give their GPUs back, and restarted as a counted failure (StartTimeout). Unset: the job waits, saying why in the WorkersBlocked condition."""
    rules: list[FailureRule] | None = Field(None, max_length=32)
    """Failure rules, tried in order before the defaults: permanentExitCodes fail the job; disruptions (Disrupted, Evicted) restart the gang without counting against backoffLimit; every other failure restarts it and counts."""
    hang_detection: HangDetectionSpec = Field(default_factory=HangDetectionSpec)
    """Hang detection, on by default (docs/operator.md#hangs)."""
    in_place: bool | None = None
    """Restart the gang in place: the workers still running are kept, their launcher stops their processes and starts the next generation from the latest checkpoint when the operator says so (through the pod's `kubetrain.io/restart-generation` annotation, read from a Downward API volume); only failed, deleted or lost workers' pods are recreated. A kept worker whose launcher gets no new generation within maxBackoffSeconds + 60 s exits 75 and its pod is recreated. Unset: on where it is safe, that is with durable checkpoints, without `gang: kubernetes`, and for workers that run the launcher anyway (the built-in trainer, or procsPerWorker > 1). `true` also runs a one-process command under the launcher (its image then needs python3); it needs durable checkpoints and no `gang: kubernetes`. The local backend restarts processes either way."""


class SchedulingSpec(_Model):
    """Placement of worker pods."""

    node_selector: dict[str, str] | None = None
    """Node labels every worker pod requires."""
    tolerations: list[dict[str, Any]] | None = None
    """Tolerations of worker pods (core/v1 Toleration objects)."""
    affinity: dict[str, Any] | None = None
    """Affinity of worker pods (core/v1 Affinity)."""
    priority_class_name: str | None = Field(None, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    """PriorityClass of worker pods."""
    queue: str | None = Field(None, min_length=1, max_length=63, pattern=LABEL_VALUE_PATTERN)
    """Kueue LocalQueue (a label value: at most 63 characters); with `gang: volcano`, the Volcano queue of the PodGroup instead. The operator creates the job's Kueue Workload `trainingjob-<job>-<uid>` in that queue, one pod set `workers` of count `workers` (priority: the label `kueue.x-k8s.io/priority-class` names a WorkloadPriorityClass), and holds the gang (phase Suspended) until Kueue admits the Workload: worker pods then get the assigned flavors' node labels and tolerations; eviction or preemption stops the gang (it checkpoints on SIGTERM and resumes from it once admitted again, without counting a failure). spec.suspend stays the user's: suspending deactivates the Workload, resuming activates it. The Admitted condition says where the job stands in the queue (docs/scheduling.md#kueue)."""
    gang: Literal["none", "volcano", "coscheduling", "kubernetes"] = "none"
    """Create a PodGroup so that a gang scheduler places all workers at once or none: `volcano` (scheduling.volcano.sh/v1beta1 PodGroup `<job>`, pods go to the scheduler `volcano`), `coscheduling` (scheduler-plugins, scheduling.x-k8s.io/v1alpha1 PodGroup `<job>`, pods go to the operator's coscheduling scheduler, by default `scheduler-plugins-scheduler`), both with minMember: workers and minResources: the workers' summed requests; or `kubernetes` (the kube-scheduler's own gang scheduling, alpha: scheduling.k8s.io/v1alpha2 PodGroup `<job>-<generation>` with a gang policy of minCount: workers). Where the cluster does not serve that PodGroup the job waits with WorkersBlocked=GangSchedulerMissing and no pods."""
    scheduler_name: str | None = Field(None, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    """Scheduler for worker pods; unset: the default scheduler, or the gang's (`volcano`, or the operator's coscheduling scheduler)."""
    topology_key: str | None = Field(None, max_length=317, pattern=LABEL_KEY_PATTERN)
    """Keep the gang within one topology domain: a node label key (e.g. `topology.kubernetes.io/zone`, or a rack or network-block label). Every worker gets a required pod affinity to the other workers of its generation on that key, so all land on nodes with the same value of the label."""


ENV_VAR_KEYS: Final = ("name", "value", "valueFrom")
ENV_NAME_PATTERN = r"^[ -<>-~]+$"
"""An environment variable's name as the API server takes it in a pod: printable ASCII other than '=' (Kubernetes
1.32 and later; 1.30 and 1.31 take only `[-._a-zA-Z][-._a-zA-Z0-9]*` and refuse the pod, which WorkersBlocked says)."""
MAX_ENV_VARS: Final = 1000
"""Bounds the cost of the env rule's CEL, which the API server must be able to bound; far more than any job sets."""
RESERVED_ENV: Final = (
    contract.MASTER_ADDR, contract.MASTER_PORT, contract.WORLD_SIZE, contract.RANK, contract.LOCAL_RANK,
    contract.LOCAL_WORLD_SIZE, contract.NODE_RANK, contract.PET_NNODES, contract.PET_NPROC_PER_NODE,
    contract.PET_NODE_RANK, contract.PET_MASTER_ADDR, contract.PET_MASTER_PORT, contract.JOB, contract.NAMESPACE,
    contract.CONFIG, contract.CHECKPOINT_DIR, contract.OUTPUT_DIR, contract.RESTART_GENERATION, contract.METRICS_PORT,
    contract.METRICS_ADDR, contract.POD_NAME, contract.POD_NAMESPACE, contract.GENERATION_FILE, contract.IN_PLACE_WAIT,
    contract.STANDBY, contract.RAN_FILE, contract.HEARTBEAT_DIR, contract.HANG, contract.HANG_DIR,
    contract.NODE_NAME, contract.MEMORY_CKPT_DIR, contract.MEMORY_CKPT_EVERY, contract.MEMORY_CKPT_BYTES,
)
"""The worker contract's variables that kubetrain sets for every worker (contract.torch_env, kubetrain_env, and the
in-place and progress ones): one set by spec.env would break the gang's rendezvous or kubetrain's own bookkeeping.
The knobs meant for spec.env stay open: KUBETRAIN_FAIL_AT, KUBETRAIN_DIST_TIMEOUT_SECONDS and the trainer's own."""


def _env_var(entry: dict[str, Any]) -> dict[str, Any]:
    """A core/v1 EnvVar, kept a plain dict (it is copied into pods as it is)."""
    if not isinstance(entry.get("name"), str) or not entry["name"]:
        raise PydanticCustomError(OWN_ERROR, "needs a name (a non-empty string)")
    if not re.fullmatch(ENV_NAME_PATTERN, entry["name"]):  # `A=B` would set A (to "B=...") in the process
        raise PydanticCustomError(OWN_ERROR, "name {name} is not a variable name: printable ASCII characters "
                                  "other than '='", {"name": repr(entry["name"])})
    unknown = sorted(set(entry) - set(ENV_VAR_KEYS))
    if unknown:
        raise PydanticCustomError(OWN_ERROR, "unknown field {field} (an EnvVar has name, value and valueFrom)",
                                  {"field": unknown[0]})
    if not isinstance(entry.get("value", ""), str):
        raise PydanticCustomError(OWN_ERROR, "value must be a string")
    if not isinstance(entry.get("valueFrom", {}), dict):
        raise PydanticCustomError(OWN_ERROR, "valueFrom must be a mapping")
    return entry


EnvVar = Annotated[
    dict[str, Any],
    AfterValidator(_env_var),
    WithJsonSchema({
        "type": "object",
        "description": "A core/v1 EnvVar.",
        "required": ["name"],
        "properties": {
            "name": {"type": "string", "minLength": 1, "pattern": ENV_NAME_PATTERN,
                     "description": "Name of the variable: printable ASCII characters other than '='."},
            "value": {"type": "string", "description": "Its value."},
            "valueFrom": {"type": "object", "description": "Where its value comes from (core/v1 EnvVarSource)."},
        },
    }),
]


# --------------------------------------------------------------------------- cross-field rules

MUTABLE_SPEC_FIELDS = ("workers", "suspend", "restartPolicy", "scheduling", "activeDeadlineSeconds",
                       "ttlSecondsAfterFinished", "cleanPodPolicy")
"""Spec fields a job takes edits of once it exists: `workers` restarts the gang at its new size (a planned
restart), the others apply at the next reconcile. The API server refuses an edit of any other field."""


@dataclass(frozen=True)
class Rule:
    """One cross-field rule, stated once: CEL for the API server, Python for `kubetrain validate`.

    `path` is the field the message is about (relative to spec). `check` returns True when
    the spec is valid. tests/unit/test_crd.py and the integration tests assert that both
    forms agree on the same manifests.
    """

    path: str
    cel: str | None
    """None: the API server cannot say it (CEL does not see untyped values); `kubetrain validate` and the controller do."""
    message: str
    check: Callable[[Any], bool]
    """Takes the object the rule is attached to (a TrainingJobSpec for SPEC_RULES)."""


_PROCS_CEL = ("(has(self.procsPerWorker) ? self.procsPerWorker"
              " : (self.resources.gpusPerWorker > 0 ? self.resources.gpusPerWorker : 1))")
"""TrainingJobSpec.procs in CEL: the processes per worker after defaults."""

BYTE_VOCAB: Final = 256
"""The byte tokenizer's vocabulary: one id per byte."""
MIN_POD_MEMORY: Final = "512Mi"
"""The least resources.memory a worker pod may have."""
MAX_SHM: Final = "64Ti"
"""The most resources.shmSize may be: above the memory of the largest machines sold."""
_BUILT_IN_BYTES_CEL = ("((!has(self.command) || size(self.command) == 0) && !has(self.model.hfPath) && "
                       "!has(self.model.hfUri) && self.data.tokenizer == 'byte' && !has(self.data.tokenizerUri) && "
                       "!has(self.data.uri))")
"""The built-in trainer's built-in model reading text with the byte tokenizer (no token shards, no custom command)."""


def _built_in_reads_bytes(s: Any) -> bool:
    return (not s.command and not s.model.is_hf() and s.data.tokenizer == "byte" and s.data.tokenizer_uri is None
            and s.data.uri is None)


DAEMON_IMAGE_RULE = Rule(
    "fabricOptions.daemonImage",
    "!has(self.fabricOptions) || !has(self.fabricOptions.daemonImage)",
    "fabricOptions.daemonImage runs as root with NET_ADMIN beside the workers: only an admin's runtime may name "
    "it (spec.runtimeRef; docs/runtimes.md)",
    lambda s: s.fabric_options is None or s.fabric_options.daemon_image is None,
)
"""A job never names its fabric's daemon image; a runtime may (kubetrain.core.runtimes merges it in after this rule)."""

SPEC_RULES: list[Rule] = [
    DAEMON_IMAGE_RULE,
    Rule(
        "profile.steps",
        "!has(self.profile) || (int(self.profile.steps.split('-')[0]) >= 1 && "
        "int(self.profile.steps.split('-')[0]) <= int(self.profile.steps.split('-')[1]))",
        "profile.steps must be FIRST-LAST with 1 <= FIRST <= LAST",
        lambda s: s.profile is None or 1 <= s.profile.first_last[0] <= s.profile.first_last[1],
    ),
    Rule(
        "deepspeed",
        "!has(self.deepspeed) || self.strategy == 'deepspeed'",
        "deepspeed options need strategy 'deepspeed'",
        lambda s: s.deepspeed is None or s.strategy == "deepspeed",
    ),
    Rule(
        "fsdp",
        "!has(self.fsdp) || self.strategy == 'fsdp'",
        "fsdp options need strategy 'fsdp'",
        lambda s: s.fsdp is None or s.strategy == "fsdp",
    ),
    Rule(
        "ddp",
        "!has(self.ddp) || self.strategy == 'ddp'",
        "ddp options need strategy 'ddp'",
        lambda s: s.ddp is None or s.strategy == "ddp",
    ),
    Rule(
        "ddp.gradientCompression",
        "!has(self.ddp) || self.ddp.gradientCompression != 'powersgd' || self.precision != 'fp16'",
        "ddp.gradientCompression powersgd cannot run with precision fp16 (one overflow step poisons its error"
        " feedback for good); use bf16 or fp32",
        lambda s: s.ddp is None or s.ddp.gradient_compression != "powersgd" or s.precision != "fp16",
    ),
    Rule(
        "model.nHeads",
        "self.model.dModel % self.model.nHeads == 0",
        "model.dModel must be divisible by model.nHeads",
        lambda s: s.model.d_model % s.model.n_heads == 0,
    ),
    Rule(
        "optimizer.minLr",
        "self.optimizer.minLr <= self.optimizer.lr",
        "optimizer.minLr must not exceed optimizer.lr",
        lambda s: s.optimizer.min_lr <= s.optimizer.lr,
    ),
    Rule(
        "deepspeed.offloadParam",
        "!has(self.deepspeed) || !self.deepspeed.offloadParam || self.deepspeed.zeroStage == 3",
        "deepspeed.offloadParam needs zeroStage 3",
        lambda s: s.deepspeed is None or not s.deepspeed.offload_param or s.deepspeed.zero_stage == 3,
    ),
    Rule(
        "deepspeed.offloadOptimizer",
        "!has(self.deepspeed) || !self.deepspeed.offloadOptimizer || self.deepspeed.zeroStage >= 1",
        "deepspeed.offloadOptimizer needs zeroStage >= 1",
        lambda s: s.deepspeed is None or not s.deepspeed.offload_optimizer or s.deepspeed.zero_stage >= 1,
    ),
    Rule(
        "restartPolicy.rules",
        "!has(self.restartPolicy.rules) || self.restartPolicy.rules.all(r, has(r.onExitCodes) || has(r.onFailures))",
        "every restartPolicy rule needs onExitCodes or onFailures",
        lambda s: all(r.on_exit_codes or r.on_failures for r in s.restart_policy.rules or []),
    ),
    Rule(  # an empty command runs the built-in trainer (as an empty one runs a container's entrypoint): args would be lost
        "command",
        "!has(self.args) || (has(self.command) && size(self.command) > 0)",
        "args needs a non-empty command (custom script mode; the built-in trainer takes no args)",
        lambda s: s.args is None or bool(s.command),
    ),
    Rule(  # the kubelet would start an executable named "" and the pod would fail at every restart
        "command",
        "!has(self.command) || size(self.command) == 0 || size(self.command[0]) > 0",
        "command[0], the program to run, must not be empty",
        lambda s: not s.command or s.command[0] != "",
    ),
    Rule(
        "model.vocabSize",
        f"{_BUILT_IN_BYTES_CEL} ? self.model.vocabSize >= {BYTE_VOCAB} : true",
        f"model.vocabSize must be at least {BYTE_VOCAB} for the built-in model reading text with the byte "
        "tokenizer (its ids are the bytes 0-255)",
        lambda s: not _built_in_reads_bytes(s) or s.model.vocab_size >= BYTE_VOCAB,
    ),
    Rule(
        "checkpoint.storageSize",
        "quantity(self.checkpoint.storageSize).isGreaterThan(quantity('0'))",
        "checkpoint.storageSize must be more than 0",
        lambda s: quantity_value(s.checkpoint.storage_size) > 0,
    ),
    Rule(
        "resources.memory",
        f"!has(self.resources.memory) || !quantity(self.resources.memory).isLessThan(quantity('{MIN_POD_MEMORY}'))",
        f"resources.memory must be at least {MIN_POD_MEMORY}: each of a worker's processes takes about 300 MB "
        "before it trains (Python and torch)",
        lambda s: s.resources.memory is None or quantity_value(s.resources.memory) >= quantity_value(MIN_POD_MEMORY),
    ),
    Rule(
        "resources.shmSize",
        "quantity(self.resources.shmSize).isGreaterThan(quantity('0')) && "
        f"!quantity(self.resources.shmSize).isGreaterThan(quantity('{MAX_SHM}'))",
        f"resources.shmSize must be more than 0 and at most {MAX_SHM} (more memory than any node has)",
        lambda s: 0 < quantity_value(s.resources.shm_size) <= quantity_value(MAX_SHM),
    ),
    Rule(
        "env",
        "!has(self.env) || self.env.all(e, !(e.name in [" + ", ".join(f"'{n}'" for n in RESERVED_ENV) + "]))",
        "env cannot set the variables kubetrain sets for every worker: " + ", ".join(RESERVED_ENV),
        lambda s: not any(e["name"] in RESERVED_ENV for e in s.env or []),
    ),
    Rule(
        "resources.extra",
        "!has(self.resources.extra) || " + " && ".join(f"!('{r}' in self.resources.extra)" for r in OWN_RESOURCES),
        f"resources.extra cannot set {', '.join(OWN_RESOURCES)}: use resources.gpusPerWorker (it also sets the "
        "processes per worker), resources.cpu and resources.memory",
        lambda s: not set(OWN_RESOURCES) & set(s.resources.extra or {}),
    ),
    Rule(
        "checkpoint.ephemeral",
        "!self.checkpoint.ephemeral || !has(self.checkpoint.claimName)",
        "checkpoint.ephemeral cannot be combined with checkpoint.claimName (a claim is durable storage): drop one",
        lambda s: not s.checkpoint.ephemeral or s.checkpoint.claim_name is None,
    ),
    Rule(
        "checkpoint.uri",
        "!has(self.checkpoint.uri) || (!has(self.checkpoint.claimName) && !self.checkpoint.ephemeral)",
        "checkpoint.uri keeps checkpoints in object storage: it cannot be combined with checkpoint.claimName or "
        "checkpoint.ephemeral, drop one",
        lambda s: s.checkpoint.uri is None or (s.checkpoint.claim_name is None and not s.checkpoint.ephemeral),
    ),
    Rule(
        "s3",
        "!has(self.s3) || has(self.checkpoint.uri) || has(self.data.uri) || has(self.model.hfUri) "
        "|| has(self.data.tokenizerUri)",
        "s3 says how to reach object storage: set checkpoint.uri, data.uri, model.hfUri or data.tokenizerUri "
        "(s3://bucket/prefix)",
        lambda s: s.s3 is None or bool(s.object_store_uris()),
    ),
    Rule(
        "model.hfUri",
        "!has(self.model.hfUri) || !has(self.model.hfPath)",
        "model.hfUri and model.hfPath both name the model to train: set one",
        lambda s: s.model.hf_uri is None or s.model.hf_path is None,
    ),
    Rule(
        "data.tokenizerUri",
        "!has(self.data.tokenizerUri) || self.data.tokenizer == 'byte'",
        "data.tokenizerUri and data.tokenizer both name the tokenizer: leave data.tokenizer unset (byte)",
        lambda s: s.data.tokenizer_uri is None or s.data.tokenizer == "byte",
    ),
    Rule(
        "data.evalPath",
        "!has(self.data.uri) || !has(self.evalEverySteps) || has(self.data.evalPath) || self.data.format != 'text'",
        "evalEverySteps with data.uri text or token shards reads its held-out text from data.evalPath: set it (the "
        "shards are all trained on; chat and instruction samples, fetched whole, hold out their last 5%)",
        lambda s: s.data.uri is None or s.eval_every_steps is None or s.data.eval_path is not None
        or s.data.format != "text",
    ),
    Rule(
        "restartPolicy.inPlace",
        "!has(self.restartPolicy.inPlace) || !self.restartPolicy.inPlace || !self.checkpoint.ephemeral",
        "restartPolicy.inPlace needs durable checkpoints: recreated workers would not find the kept workers' "
        "checkpoints in their own emptyDir (drop checkpoint.ephemeral or inPlace)",
        lambda s: not s.restart_policy.in_place or not s.checkpoint.ephemeral,
    ),
    Rule(
        "restartPolicy.inPlace",
        "!has(self.restartPolicy.inPlace) || !self.restartPolicy.inPlace || self.scheduling.gang != 'kubernetes'",
        "restartPolicy.inPlace cannot run with scheduling.gang kubernetes: its pods name their generation's "
        "PodGroup, which a kept pod cannot change",
        lambda s: not s.restart_policy.in_place or s.scheduling.gang != "kubernetes",
    ),
    Rule(
        "checkpoint.accessMode",
        "!has(self.checkpoint.accessMode) || self.checkpoint.accessMode != 'ReadWriteOncePod' || self.workers == 1",
        "checkpoint.accessMode ReadWriteOncePod lets one pod mount the claim: it needs workers 1",
        lambda s: s.checkpoint.access_mode != "ReadWriteOncePod" or s.workers == 1,
    ),
    Rule(
        "precision",
        "self.precision != 'fp16' || self.strategy != 'deepspeed' || self.resources.gpusPerWorker > 0",
        "precision fp16 with strategy deepspeed needs GPUs (DeepSpeed has no fp16 on CPU); use bf16",
        lambda s: s.precision != "fp16" or s.strategy != "deepspeed" or s.resources.gpus_per_worker > 0,
    ),
    Rule(
        "fabricOptions",
        "!has(self.fabricOptions) || self.fabric != 'none'",
        "fabricOptions needs a fabric: set spec.fabric (infiniband, roce, efa, tcpx, tcpxo, aks-infiniband)",
        lambda s: s.fabric_options is None or s.fabric != "none",
    ),
    Rule(
        "fabricOptions.gpuNetworks",
        "!has(self.fabricOptions) || !has(self.fabricOptions.gpuNetworks)"
        " || (self.fabric == 'tcpx' && size(self.fabricOptions.gpuNetworks) == 4)"
        " || (self.fabric == 'tcpxo' && size(self.fabricOptions.gpuNetworks) == 8)",
        "fabricOptions.gpuNetworks names one GKE network per GPU NIC: 4 for fabric tcpx (A3 High), 8 for tcpxo (A3 Mega)",
        lambda s: s.fabric_options is None or s.fabric_options.gpu_networks is None
        or len(s.fabric_options.gpu_networks) == GKE_GPU_NICS.get(s.fabric),
    ),
    Rule(
        "checkpoint.dir",
        f"!has(self.checkpoint.dir) || !self.checkpoint.dir.matches('{DOT_SEGMENT_PATTERN}')",
        "checkpoint.dir must be a normal path: no '.' or '..' segments and no '//'",
        lambda s: s.checkpoint.dir is None or not re.search(DOT_SEGMENT_PATTERN, s.checkpoint.dir),
    ),
    Rule(
        "checkpoint.dir",
        f"!has(self.checkpoint.dir) || !self.checkpoint.dir.matches('{SYSTEM_DIR_PATTERN}')",
        "checkpoint.dir must not be / or in a system directory (/" + ", /".join(SYSTEM_DIRS) + "): the checkpoint "
        "volume would hide it, and kubetrain's own mounts are there",
        lambda s: s.checkpoint.dir is None or not re.search(SYSTEM_DIR_PATTERN, s.checkpoint.dir),
    ),
    Rule(
        "parallelism.tensor",
        f"self.parallelism.tensor == 1 || {_PROCS_CEL} % self.parallelism.tensor == 0",
        "parallelism.tensor must divide the processes per worker (procsPerWorker, default resources.gpusPerWorker "
        "or 1): tensor parallelism stays inside one worker, and the world size is then a multiple of it",
        lambda s: s.procs % s.parallelism.tensor == 0,
    ),
    Rule(
        "parallelism.tensor",
        "self.parallelism.tensor == 1 || has(self.model.hfPath) || has(self.model.hfUri) "
        "|| self.model.nHeads % self.parallelism.tensor == 0",
        "parallelism.tensor must divide model.nHeads (each process computes whole attention heads)",
        # a model.hfPath model's head counts are in its config, which the trainer checks when it loads it
        lambda s: s.model.is_hf() or s.model.n_heads % s.parallelism.tensor == 0,
    ),
    Rule(
        "parallelism.tensor",
        "self.parallelism.tensor == 1 || self.strategy == 'fsdp'",
        "parallelism.tensor > 1 needs strategy fsdp: tensor parallelism composes with FSDP2 only, not yet with ddp "
        "(nor its gradientCompression) or deepspeed",
        lambda s: s.parallelism.tensor == 1 or s.strategy == "fsdp",
    ),
    Rule(
        "parallelism.pipeline",
        f"self.parallelism.pipeline == 1 || (self.workers * {_PROCS_CEL}) % (self.parallelism.tensor * self.parallelism.pipeline) == 0",
        "parallelism.pipeline times parallelism.tensor must divide the world size (workers x processes per worker): "
        "every stage runs on the same number of processes",
        lambda s: s.parallelism.pipeline == 1 or s.world_size % (s.parallelism.tensor * s.parallelism.pipeline) == 0,
    ),
    Rule(
        "parallelism.replicate",
        f"self.parallelism.replicate == 1 || (self.workers * {_PROCS_CEL}) % (self.parallelism.tensor * self.parallelism.pipeline * self.parallelism.replicate) == 0",
        "parallelism.replicate must divide the data-parallel processes: world size (workers x processes per worker) / "
        "(parallelism.tensor x parallelism.pipeline); HSDP shards within each of the R groups",
        lambda s: s.parallelism.replicate == 1
        or s.world_size % (s.parallelism.tensor * s.parallelism.pipeline * s.parallelism.replicate) == 0,
    ),
    Rule(
        "parallelism.replicate",
        "self.parallelism.replicate == 1 || self.strategy == 'fsdp'",
        "parallelism.replicate > 1 (HSDP) needs strategy fsdp: ddp replicates the whole model already, and deepspeed "
        "shards over all processes",
        lambda s: s.parallelism.replicate == 1 or s.strategy == "fsdp",
    ),
    Rule(
        "parallelism.pipeline",
        "self.parallelism.pipeline <= self.model.nLayers",
        "parallelism.pipeline must be at most model.nLayers (each stage runs at least one block)",
        lambda s: s.parallelism.pipeline <= s.model.n_layers,
    ),
    Rule(
        "parallelism.pipelineSchedule",
        "self.parallelism.pipeline == 1 || self.parallelism.pipelineSchedule != '1F1B' "
        "|| self.gradientAccumulationSteps >= self.parallelism.pipeline",
        "parallelism.pipelineSchedule 1F1B needs gradientAccumulationSteps (the micro-batches of a step) >= "
        "parallelism.pipeline: use more micro-batches, or pipelineSchedule GPipe",
        lambda s: s.parallelism.pipeline == 1 or s.parallelism.pipeline_schedule != "1F1B"
        or s.gradient_accumulation_steps >= s.parallelism.pipeline,
    ),
    Rule(
        "parallelism.pipelineSchedule",
        "self.parallelism.pipeline == 1 || self.parallelism.pipelineSchedule != 'Interleaved1F1B' "
        "|| (self.gradientAccumulationSteps % self.parallelism.pipeline == 0 "
        "&& 2 * self.parallelism.pipeline <= self.model.nLayers)",
        "parallelism.pipelineSchedule Interleaved1F1B runs 2 stages per process: it needs gradientAccumulationSteps "
        "(the micro-batches of a step) a multiple of parallelism.pipeline and model.nLayers >= 2 x "
        "parallelism.pipeline",
        lambda s: s.parallelism.pipeline == 1 or s.parallelism.pipeline_schedule != "Interleaved1F1B"
        or (s.gradient_accumulation_steps % s.parallelism.pipeline == 0
            and 2 * s.parallelism.pipeline <= s.model.n_layers),
    ),
    Rule(
        "parallelism.pipeline",
        "self.parallelism.pipeline == 1 || self.strategy == 'fsdp'",
        "parallelism.pipeline > 1 needs strategy fsdp: pipelining composes with FSDP2 only, not yet with ddp or "
        "deepspeed",
        lambda s: s.parallelism.pipeline == 1 or s.strategy == "fsdp",
    ),
    Rule(
        "parallelism.pipeline",
        "self.parallelism.pipeline == 1 || (!has(self.model.hfPath) && !has(self.model.hfUri))",
        "parallelism.pipeline > 1 runs the built-in model only: model.hfPath and hfUri models cannot be split into "
        "stages yet",
        lambda s: s.parallelism.pipeline == 1 or not s.model.is_hf(),
    ),
    Rule(
        "parallelism.pipeline",
        "self.parallelism.pipeline == 1 || self.precision != 'fp16'",
        "parallelism.pipeline > 1 needs precision fp32 or bf16: the pipeline schedule runs the backward passes "
        "itself, without fp16's loss scaling",
        lambda s: s.parallelism.pipeline == 1 or s.precision != "fp16",
    ),
    Rule(
        "lora",
        "!has(self.lora) || has(self.model.hfPath) || has(self.model.hfUri)",
        "lora trains adapters on a Hugging Face model: set model.hfPath or model.hfUri (the built-in model trains "
        "all its weights)",
        lambda s: s.lora is None or s.model.is_hf(),
    ),
    Rule(
        "lora",
        "!has(self.lora) || (self.parallelism.tensor == 1 && self.parallelism.pipeline == 1)",
        "lora runs with data parallelism (ddp, fsdp, HSDP, deepspeed): set parallelism.tensor and "
        "parallelism.pipeline to 1",
        lambda s: s.lora is None or (s.parallelism.tensor == 1 and s.parallelism.pipeline == 1),
    ),
    Rule(
        "export.huggingFace",
        "!has(self.export) || !self.export.huggingFace || has(self.model.hfPath) || has(self.model.hfUri)",
        "export.huggingFace writes a Hugging Face model: set model.hfPath or model.hfUri (the built-in model has "
        "no Hugging Face form)",
        lambda s: s.export is None or not s.export.hugging_face or s.model.is_hf(),
    ),
    Rule(
        "export.huggingFace",
        "!has(self.export) || !self.export.huggingFace || !self.checkpoint.ephemeral",
        "export.huggingFace writes the model beside the checkpoints, which checkpoint.ephemeral keeps in the pods "
        "(gone with them, and scattered over the workers): use a checkpoint volume or checkpoint.uri",
        lambda s: s.export is None or not s.export.hugging_face or not s.checkpoint.ephemeral,
    ),
    Rule(
        "command",
        "!has(self.command) || size(self.command) == 0 || (!has(self.lora) && !has(self.export) "
        "&& self.data.format == 'text')",
        "lora, export and data.format chat or instruction are the built-in trainer's: a custom command trains and "
        "reads data its own way (drop them or command)",
        lambda s: not s.command or (s.lora is None and s.export is None and s.data.format == "text"),
    ),
    Rule(
        "compile",
        "!self.compile || !has(self.command) || size(self.command) == 0",
        "compile applies to the built-in trainer: a custom command compiles its own model (drop compile or command)",
        lambda s: not s.compile or not s.command,
    ),
    Rule(
        "metricsPort",
        f"self.metricsPort + {_PROCS_CEL} - 1 <= 65535",
        "metricsPort + processes per worker - 1 must be <= 65535 (each process serves metrics on the next port)",
        lambda s: s.metrics_port + s.procs - 1 <= 65535,
    ),
    Rule(
        "metricsPort",
        f"self.metricsPort > {contract.DEFAULT_MASTER_PORT} || "
        f"self.metricsPort + {_PROCS_CEL} - 1 < {contract.DEFAULT_MASTER_PORT}",
        f"metricsPort to metricsPort + processes per worker - 1 must leave out {contract.DEFAULT_MASTER_PORT}, "
        "the port the workers meet on (MASTER_PORT)",
        lambda s: not s.metrics_port <= contract.DEFAULT_MASTER_PORT <= s.metrics_port + s.procs - 1,
    ),
]

RUNTIME_FIELDS: Final = frozenset({"image", "podTemplate", "env", "fabric", "fabricOptions", "scheduling",
                                   "resources", "checkpoint", "s3"})
"""The spec fields a runtime may set (TrainingRuntimeSpec): a job with spec.runtimeRef may leave them to it."""


def _unless_runtime(rule: Rule) -> Rule:
    """A rule that relates a field a runtime may set to another field holds for the job over its runtime, not for
    the job alone (`fabricOptions` beside the runtime's `fabric`, `parallelism.tensor` over its GPUs): with
    spec.runtimeRef the API server leaves it to the merge, which checks every rule (kubetrain.core.runtimes)."""
    fields = set(re.findall(r"self\.([A-Za-z]+)", rule.cel or ""))
    if rule.cel is None or len(fields) < 2 or not fields & RUNTIME_FIELDS:
        return rule
    check = rule.check
    return Rule(rule.path, f"has(self.runtimeRef) || ({rule.cel})", rule.message,
                lambda s: s.runtime_ref is not None or check(s))


SPEC_RULES = [_unless_runtime(r) for r in SPEC_RULES]


# --------------------------------------------------------------------------- spec and status


Fabric = Literal["none", "infiniband", "roce", "efa", "tcpx", "tcpxo", "aks-infiniband"]
"""spec.fabric: the network fabric profiles (kubetrain.operator.jobs.fabrics renders them)."""
EXTENDED_RESOURCE_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
"""A domain-prefixed extended resource name (`rdma/ib`, `rdma/shared_ib`, `nvidia.com/mlnxnics`)."""
EFA_INSTANCE_TYPES: Final[dict[str, int]] = {"p4d.24xlarge": 4, "p4de.24xlarge": 4, "p5.48xlarge": 32, "p5e.48xlarge": 32}
"""EFA devices per EC2 instance type (its network cards: AWS EC2 User Guide, "Network cards" and "EFA
configuration for P5 and P5e instances"); spec.fabricOptions.instanceType picks one."""
GKE_GPU_NICS: Final[dict[str, int]] = {"tcpx": 4, "tcpxo": 8}
"""GPU NICs of a GKE A3 High (tcpx) and A3 Mega (tcpxo) node: one GKE network each, eth1..ethN in the pod."""
FABRIC_TRANSPORTS: Final[dict[str, str]] = {
    "infiniband": contract.TRANSPORT_IB,
    "roce": contract.TRANSPORT_IB,
    "aks-infiniband": contract.TRANSPORT_IB,
    "efa": contract.TRANSPORT_OFI,
    "tcpx": contract.TRANSPORT_TCPX,
    "tcpxo": contract.TRANSPORT_TCPXO,
}
"""The NCCL network transport each spec.fabric profile is for (RoCE runs over NCCL's IB verbs transport,
EFA through aws-ofi-nccl); another one reported by rank 0 sets the FabricDegraded condition."""


class FabricOptions(_Model):
    """Node-specific settings of spec.fabric. Each applies to the profiles its text names; unset means the default the cloud's docs publish."""

    rdma_resource: str | None = Field(None, max_length=253, pattern=EXTENDED_RESOURCE_PATTERN)
    """infiniband, roce, aks-infiniband: the RDMA device plugin's extended resource (its `rdma/<resourceName>`). Default `rdma/ib` (infiniband), `rdma/roce` (roce), `rdma/shared_ib` (aks-infiniband: Azure's NicClusterPolicy for the RDMA shared device plugin)."""
    rdma_devices: int = Field(1, ge=1, le=64)
    """infiniband, roce, aks-infiniband: how many of rdmaResource each worker requests (1 for the shared device plugin, which gives the pod every HCA; the number of HCAs for the SR-IOV plugin)."""
    ib_hca: str = Field("mlx5", min_length=1, max_length=253)
    """infiniband, roce, aks-infiniband: NCCL_IB_HCA, the HCAs NCCL may use (a prefix filter: `mlx5` matches mlx5_0, mlx5_1, ...; `=mlx5_0:1,mlx5_1:1` names ports exactly)."""
    gid_index: int = Field(3, ge=0, le=255)
    """roce: NCCL_IB_GID_INDEX, the GID table entry of the RoCE v2 address (3 on a default Linux setup with IPv4; check `show_gids`)."""
    traffic_class: int | None = Field(None, ge=0, le=255)
    """roce: NCCL_IB_TC, the traffic class of NCCL's packets (must match the switches' lossless RoCE class, e.g. 106 for DSCP 26). Unset: NCCL's default (0)."""
    socket_ifname: str = Field("eth0", min_length=1, max_length=253, pattern=r"^[\^=]?[A-Za-z0-9._,=^-]+$")
    """infiniband, roce, aks-infiniband, tcpx, tcpxo: NCCL_SOCKET_IFNAME, the pod interface for NCCL's bootstrap and control traffic."""
    instance_type: Literal["p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge", "p5e.48xlarge"] | None = None
    """efa: the EC2 instance type of the GPU nodes. Requests every EFA device it has (4 on p4d/p4de, 32 on p5/p5e) and selects nodes of that type (`node.kubernetes.io/instance-type`). Unset: 32 EFA devices (p5.48xlarge, the EKS guide's example) and no node selector; other types: set `resources.extra` `vpc.amazonaws.com/efa`."""
    daemon_image: str | None = Field(None, min_length=1, max_length=1024, pattern=IMAGE_PATTERN)
    """tcpx, tcpxo: image of the receive-datapath manager sidecar (`tcpx-daemon` / `tcpxo-daemon`). Default: the image GKE's manifests publish. Its version must match the NCCL plugin the cluster's nccl-tcpx(o)-installer DaemonSet installed."""
    gpu_networks: list[Annotated[str, Field(min_length=1, max_length=63, pattern=DNS_LABEL_PATTERN)]] | None = Field(
        None, min_length=4, max_length=8)
    """tcpx, tcpxo: the GKE Network objects of the GPU NICs, attached as eth1, eth2, ... (annotation networking.gke.io/interfaces). tcpx (A3 High) needs 4, tcpxo (A3 Mega) 8. Default vpc1..vpc4 / vpc1..vpc8, as in GKE's guide."""
    topo_file: str = Field("/opt/microsoft/ndv5/topo.xml", max_length=4096, pattern=r"^(/.*)?$")
    """aks-infiniband: NCCL_TOPO_FILE, the ND-series topology file inside the image (Azure's HPC images: /opt/microsoft/ndv5/topo.xml for ND H100 v5). Empty: not set (NCCL detects the topology itself)."""


class PreflightSpec(_Model):
    """Checks every rank of the built-in trainer runs after joining the gang and before the first step of every generation (restarts too): a matmul benchmark, the gang's all-reduce bus bandwidth and a neighbour exchange (docs/trainer.md#preflight). A custom command runs none."""

    enabled: bool = True
    """Run the preflight (about a second per generation on CPU; status.preflight). False: skip it."""
    degraded_fraction: float = Field(0.5, gt=0, lt=1)
    """A rank whose compute (GFLOP/s) or neighbour exchange speed is below this fraction of the gang's median is degraded: the NodeDegraded condition and a Warning Event name it. Between 0 and 1, both excluded."""


RUNTIME_KIND: Final = "TrainingRuntime"
CLUSTER_RUNTIME_KIND: Final = "ClusterTrainingRuntime"
RuntimeKind = Literal["TrainingRuntime", "ClusterTrainingRuntime"]


class RuntimeRef(_Model):
    """The admin's runtime a job starts from (docs/runtimes.md)."""

    kind: RuntimeKind = CLUSTER_RUNTIME_KIND
    """`ClusterTrainingRuntime` (cluster-wide, the default) or `TrainingRuntime` (in the job's namespace)."""
    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    """The runtime's name."""


class TrainingJobSpec(_Model):
    """Desired state of a TrainingJob: what to train, on how many workers, and how to survive failures."""

    workers: int = Field(1, ge=1, le=MAX_WORKERS)
    """Number of worker pods (nodes). Every worker runs procsPerWorker processes. At most 10000 (so that pod hostnames `<job>-worker-<i>` fit in 63 characters)."""
    procs_per_worker: int | None = Field(None, ge=1, le=MAX_PROCS_PER_WORKER)
    """Processes per worker (one per GPU). Default: resources.gpusPerWorker, or 1 without GPUs. At most 256."""
    image: str | None = Field(None, max_length=1024, pattern=IMAGE_PATTERN)
    """Worker container image (`[registry[:port]/]repository[:tag][@digest]`). Default: the operator's trainer image."""
    runtime_ref: RuntimeRef | None = None
    """Start from an admin's TrainingRuntime or ClusterTrainingRuntime: its image, podTemplate, env, fabric, scheduling, resources and checkpoint storage are the defaults this spec's own fields override, except the fields it locks (a job that sets one otherwise is refused, naming it). Resolved until the job starts; its status keeps what it started with. Immutable."""
    command: list[str] | None = None
    """Custom script mode: run this command in every worker instead of the built-in trainer. It receives the same environment contract (MASTER_ADDR, RANK, KUBETRAIN_CHECKPOINT_DIR, ...)."""
    args: list[str] | None = None
    """Arguments for command."""
    workdir: WorkdirSpec | None = None
    """A directory shipped with the job and unpacked into every worker's working directory before the command runs (`kubetrain submit FILE --workdir DIR` sets it): scripts change without an image build."""
    env: list[EnvVar] | None = Field(None, max_length=MAX_ENV_VARS)
    """Extra environment variables for every worker container (core/v1 EnvVar objects; at most 1000). They override the fabric's and kubetrain's defaults (OMP_NUM_THREADS, NCCL_*, ...), but not the worker contract's variables (MASTER_ADDR, RANK, WORLD_SIZE, PET_*, KUBETRAIN_JOB, KUBETRAIN_CHECKPOINT_DIR, ...), which kubetrain sets itself."""
    strategy: Strategy = "ddp"
    """Parallelism strategy: `ddp` (DistributedDataParallel), `fsdp` (FSDP2 fully_shard) or `deepspeed` (ZeRO)."""
    ddp: DDPSpec | None = None
    """DDP options (strategy ddp only): gradient compression."""
    fsdp: FSDPSpec | None = None
    """FSDP options (strategy fsdp only)."""
    deepspeed: DeepSpeedSpec | None = None
    """DeepSpeed options (strategy deepspeed only)."""
    precision: Precision = "bf16"
    """Numeric precision: `fp32`, `bf16` (autocast / mixed precision) or `fp16` (with dynamic loss scaling)."""
    gradient_accumulation_steps: int = Field(1, ge=1, le=10_000)
    """Micro-batches accumulated per optimizer step. At most 10000."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of storing them."""
    compile: bool = False
    """torch.compile each transformer block (the built-in model's blocks, a model.hfPath model's decoder layers) after tensor parallelism and activation checkpointing, before FSDP2, DDP or DeepSpeed wraps the model (docs/trainer.md#compiling-the-model). Every strategy, tensor and pipeline parallelism, every precision; the built-in trainer only (not with command). Cost: the first step (and the first evaluation) compiles, which can take minutes and must fit restartPolicy.hangDetection.startSeconds and any progressDeadlineSeconds; every restarted generation compiles again. Later steps usually run faster on GPUs. Inductor needs a C++ compiler on CPU and Triton on GPUs (the trainer image has both)."""
    micro_batch_size: int = Field(8, ge=1, le=65_536)
    """Samples per process per micro-batch. Global batch = microBatchSize x gradientAccumulationSteps x world size. At most 65536."""
    max_steps: int = Field(100, ge=1, le=MAX_STEPS)
    """Optimizer steps to train; the job succeeds when rank 0 reaches it. At most 1000000000."""
    eval_every_steps: int | None = Field(None, ge=1, le=MAX_STEPS)
    """Compute the loss on held-out text (data.evalPath, or the last 5% of the training text) every this many steps and at the last step, over all ranks: status.evalLoss, the `kubetrain_trainer_eval_loss` metric, summary.json's eval_loss; the checkpoint with the lowest eval loss is recorded as `best-eval.json` in the checkpoint directory and kept. Unset: no evaluation."""
    eval_batches: int = Field(4, ge=1, le=10_000)
    """Micro-batches of microBatchSize windows each rank evaluates per evaluation (the same windows every time, so evaluations compare)."""
    seed: int = Field(1234, ge=0, le=2**32 - 1)
    """Seed for initialisation and data order; the same seed gives the same run. At most 4294967295."""
    model: ModelSpec = Field(default_factory=ModelSpec)
    """The model."""
    lora: LoraSpec | None = None
    """Train LoRA adapters instead of every weight (a model.hfPath or hfUri model; strategies ddp, fsdp and deepspeed). Checkpoints hold the adapters, the frozen weights and the optimizer's state, and resume exactly. Unset: full fine-tuning."""
    export: ExportSpec | None = None
    """Export the trained model when the job succeeds (`kubetrain export` does the same from any committed checkpoint)."""
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec)
    """Model parallelism: tensor- and pipeline-parallel degrees (data parallelism over the rest of the world)."""
    data: DataSpec = Field(default_factory=DataSpec)
    """The training data."""
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    """Optimizer and learning-rate schedule."""
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    """Checkpointing."""
    s3: S3Spec | None = None
    """Endpoint, region, addressing style and credentials of the S3-compatible object storage that checkpoint.uri, data.uri, model.hfUri and data.tokenizerUri name (one store's credentials per job)."""
    profile: ProfileSpec | None = None
    """Profile every rank over these steps; a running job can also be asked for a trace of its next steps (the annotation kubetrain.io/profile, docs/trainer.md#profiling)."""
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    """Per-worker resources."""
    restart_policy: RestartPolicySpec = Field(default_factory=RestartPolicySpec)
    """Gang restart policy."""
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    """Placement of worker pods."""
    pod_template: dict[str, Any] | None = None
    """Anything else for worker pods: a partial core/v1 PodTemplateSpec (`metadata`, `spec`) merged over the generated pod. Maps merge key by key; `containers`, `initContainers`, `volumes`, `env`, `volumeMounts` and `ports` merge by `name` (kubetrain's container is named `trainer`). Your values win, except kubetrain's own `kubetrain.io/*` labels."""
    fabric: Fabric = "none"
    """Network fabric profile, one per cloud (docs/scheduling.md#fabrics): `infiniband` and `roce` (RDMA shared device plugin), `efa` (EKS), `tcpx` (GKE A3 High, GPUDirect-TCPX), `tcpxo` (GKE A3 Mega, GPUDirect-TCPXO), `aks-infiniband` (AKS ND-series). Adds the device resources, capabilities, NCCL/libfabric environment, annotations, volumes and sidecars the cloud publishes for it. Your own env and resources win."""
    fabric_options: FabricOptions | None = None
    """What a fabric profile cannot know about your nodes (device plugin resource name, instance type, network names, daemon image); every field has the default the cloud's docs publish."""
    metrics_port: int = Field(9400, ge=1024, le=65535)
    """Port of every worker's Prometheus endpoint; a worker's processes use consecutive ports from it (local runs: every rank), so metricsPort + procsPerWorker - 1 must be at most 65535."""
    preflight: PreflightSpec = Field(default_factory=PreflightSpec)
    """The checks each rank runs before step 0 of every generation, and when a rank counts as degraded."""
    progress_reporting: bool = True
    """Rank 0 reports its progress (step, loss, last checkpoint) by annotating its own pod `kubetrain.io/progress`; the operator turns it into status and uses it for restartPolicy.progressDeadlineSeconds. The operator creates a Role and RoleBinding `<job>-progress` that let the workers' ServiceAccount get and patch only the pod `<job>-worker-0`. False creates neither and tells no worker its pod name: status then shows no progress unless something else writes the annotation."""
    suspend: bool = False
    """Suspended jobs have no pods; resuming starts a new gang from the latest checkpoint. With scheduling.queue it belongs to Kueue's admission: the operator sets it until the Workload is admitted and on eviction, and clears it on admission (to hold a queued job, deactivate its Workload: spec.active false)."""
    managed_by: str | None = Field(None, min_length=1, max_length=63, pattern=r"^[a-z0-9.-]+/[A-Za-z0-9._-]+$")
    """The controller that runs this job: unset or `kubetrain.io/trainingjob-controller` for this operator. Any other value (e.g. `kueue.x-k8s.io/multikueue`) leaves its pods and status to that controller: the operator only keeps its Kueue Workload (scheduling.queue). Immutable."""
    active_deadline_seconds: int | None = Field(None, ge=1, le=MAX_DEADLINE_SECONDS)
    """Fail the job when it has been active (not suspended) this long. At most 31536000 (one year)."""
    ttl_seconds_after_finished: int | None = Field(None, ge=0, le=MAX_DEADLINE_SECONDS)
    """Delete the job this long after it finished. Unset keeps it. At most 31536000 (one year)."""
    clean_pod_policy: Literal["None", "Running", "All"] = "Running"
    """Which pods to delete when the job finishes: `None`, `Running` (still running ones) or `All`. With in-place restarts, `None` still deletes the pods still running: their kubelet would restart a failed worker in them for ever."""

    @property
    def procs(self) -> int:
        """Processes per worker after defaults."""
        if self.procs_per_worker is not None:
            return self.procs_per_worker
        return max(1, self.resources.gpus_per_worker)

    @property
    def world_size(self) -> int:
        return self.workers * self.procs

    def object_store_uris(self) -> dict[str, str]:
        """The job's s3:// URIs by field: what spec.s3 and the credentials serve."""
        uris = {"checkpoint.uri": self.checkpoint.uri, "data.uri": self.data.uri, "model.hfUri": self.model.hf_uri,
                "data.tokenizerUri": self.data.tokenizer_uri}
        return {field: uri for field, uri in uris.items() if uri is not None}

    def fetched_uris(self) -> dict[str, str]:
        """What a worker pod fetches into its cache before training (the `fetch` step), by field: data.uri too
        when it holds chat or instruction JSONL (data.format), which is read whole, not streamed as text shards."""
        uris = {"model.hfUri": self.model.hf_uri, "data.tokenizerUri": self.data.tokenizer_uri,
                "data.uri": self.data.uri if self.data.format != "text" else None}
        return {field: uri for field, uri in uris.items() if uri is not None}

    @property
    def hang_limits(self) -> hangs.Limits | None:
        """restartPolicy.hangDetection as the workers' supervisor applies it (None: off)."""
        policy = self.restart_policy
        return policy.hang_detection.limits(policy.progress_deadline_seconds)

    @property
    def restarts_in_place(self) -> bool:
        """restartPolicy.inPlace, and where it is unset, whether in place is safe: checkpoints a recreated
        worker finds, no PodGroup per generation, and a launcher the workers run anyway (no new demand
        on a command's image)."""
        asked = self.restart_policy.in_place
        if asked is not None:
            return asked
        return not self.checkpoint.ephemeral and self.scheduling.gang != "kubernetes" and \
            (not self.command or self.procs > 1)

    @property
    def runs_launcher(self) -> bool:
        """Whether a worker pod runs kubetrain's launcher: the built-in trainer does, a command does with
        procsPerWorker > 1 or when it restarts in place."""
        return not self.command or self.procs > 1 or self.restarts_in_place

    def rule_violations(self) -> list[tuple[str, str]]:
        """(spec-relative path, message) for every cross-field rule this spec breaks, and what its podTemplate
        may not hold in any cluster (kubetrain.core.pod_template: shape and the fields kubetrain owns)."""
        found = [(r.path, r.message) for r in SPEC_RULES if not r.check(self)]
        if self.pod_template is not None:
            shape = pod_template.shape_problems(self.pod_template)
            found += shape or pod_template.owned_problems(self.pod_template)
        return found


class Condition(_Model):
    """A standard Kubernetes condition."""

    type: str
    """Condition type: Created, Running, Restarting, Suspended, Succeeded, Failed, CheckpointsDurable, WorkersBlocked, FabricDegraded, NodeDegraded, Admitted."""
    status: Literal["True", "False", "Unknown"]
    """Whether the condition holds."""
    reason: str = ""
    """Machine-readable reason in CamelCase."""
    message: str = ""
    """Human-readable detail."""
    last_transition_time: str | None = None
    """When status last changed (RFC 3339)."""


class Goodput(_Model):
    """Where the job's time went: training that counted, and what restarts cost."""

    productive_seconds: float = 0.0
    """Time between consecutive steps of one generation that the job keeps: steps redone after a restart move from here to lostSeconds."""
    lost_seconds: float = 0.0
    """What restarts cost: from the last step before each gang restart (a failure, a resize) to the new generation's first step, which holds finding the failure, plus the steps redone from the checkpoint at the mean step time (after a suspension too; the suspended time itself is not counted). From the first step on, productiveSeconds + lostSeconds is the wall time but for suspensions."""
    steps_lost: int = 0
    """Steps trained again after restarts: the steps past the checkpoint each restarted generation resumed from."""
    step_seconds: float | None = None
    """The current generation's mean step time, as rank 0 last reported it."""
    generation: int | None = None
    """The generation whose steps count as productive now (None until its first step)."""
    restarted_at: str | None = None
    """When the gang was restarted (not suspended), until the new generation's first step (RFC 3339)."""
    step_time: str | None = None
    """When rank 0 wrote the newest step record counted here (its own time stamp, not when the operator saw it: a record that arrives late is not productive time; RFC 3339)."""
    lost_gpu_hours: float = 0.0
    """lostSeconds in GPU-hours: the gang's GPUs (workers x resources.gpusPerWorker) for that time."""
    gpus_held: int = 0
    """GPUs the job's worker pods hold now (running, or placed on a node): resources.gpusPerWorker for each."""
    gpus_counted_at: str | None = None
    """While gpusHeld is above 0: up to when status.gpuHours has counted them (RFC 3339)."""


class CheckpointRef(_Model):
    """A complete checkpoint."""

    step: int
    """Optimizer step it holds."""
    path: str = ""
    """Where it is."""
    time: str | None = None
    """When it was committed (RFC 3339)."""


class PreflightRank(_Model):
    """One rank's preflight figures."""

    model_config = ConfigDict(extra="ignore")  # a newer trainer's report must still be read (progress.Progress)
    rank: int
    """Global rank."""
    worker: int
    """Worker index (the pod `<job>-worker-<i>`; locally the node rank)."""
    node: str = ""
    """The node it ran on (the pod's spec.nodeName; locally the hostname); empty: not known."""
    gflops: float
    """Its matmul benchmark: GFLOP/s (fp32 on CPU, bf16 on GPU)."""
    exchange_seconds: float | None = None
    """Seconds to send a buffer to rank+1 and receive one from rank-1 (unset in a gang of one)."""


class Fetch(_Model):
    """A worker pod's fetch of model.hfUri and data.tokenizerUri into its cache, before training starts."""

    uri: str
    """The URI being fetched (or the last one, once done)."""
    field: str
    """Its spec field: `model.hfUri` or `data.tokenizerUri`."""
    bytes: int = 0
    """Bytes in the cache so far, over every fetched URI."""
    total_bytes: int = 0
    """Bytes of every fetched URI together (from the store's listing)."""
    done: bool = False
    """Every URI is in the cache; training starts."""


class Preflight(_Model):
    """The preflight of one generation: rank 0's report of every rank's figures, and the verdict."""

    model_config = ConfigDict(extra="ignore")
    generation: int = 0
    """The generation it ran in."""
    seconds: float = 0.0
    """What it cost rank 0, from the first benchmark to the gathered report."""
    world_size: int = 0
    """Ranks in the gang."""
    bus_bandwidth_gbps: float | None = None
    """The gang's all-reduce bus bandwidth, GB/s (algorithm bandwidth x 2(n-1)/n; unset in a gang of one)."""
    median_gflops: float = 0.0
    """The gang's median compute."""
    median_exchange_seconds: float | None = None
    """The gang's median neighbour exchange time."""
    slowest_rank: int | None = None
    """The rank with the lowest compute."""
    ranks: list[PreflightRank] = Field(default_factory=list)
    """Every rank's figures, by rank (a gang of more than 256 ranks lists its 256 slowest)."""
    degraded_ranks: list[int] = Field(default_factory=list)
    """Ranks below spec.preflight.degradedFraction of the median (NodeDegraded says by how much)."""


class RankMemory(_Model):
    """One rank's peak memory."""

    model_config = ConfigDict(extra="ignore")  # a newer trainer's report must still be read (progress.Progress)
    rank: int
    """Global rank."""
    worker: int
    """Worker index (the pod `<job>-worker-<i>`; locally the node rank)."""
    host_peak_bytes: int = 0
    """The most host memory its process has held resident since it started (VmHWM; the page cache not included)."""
    device_peak_bytes: int | None = None
    """The most GPU memory its tensors have held since it started (torch.cuda.max_memory_allocated; the caching allocator reserves more); unset on CPU."""


class MemoryReport(_Model):
    """Peak memory of every rank of one generation, as rank 0 gathered it, and what its checkpoints could not keep in the pods' memory."""

    model_config = ConfigDict(extra="ignore")
    generation: int = 0
    """The generation it comes from."""
    step: int = 0
    """The step after which the ranks' figures were gathered (the first, every checkpoint, the last, every 100); 0: none yet."""
    host_peak_bytes: int = 0
    """The highest host peak of any rank."""
    device_peak_bytes: int | None = None
    """The highest GPU peak of any rank; unset on CPU."""
    ranks: list[RankMemory] = Field(default_factory=list)
    """Every rank's figures, by rank (a gang of more than 256 ranks lists the 256 with the highest host peaks)."""
    notices: list[str] = Field(default_factory=list)
    """What the pods' memory (limit and /dev/shm, summed over each pod's processes) could not hold this generation, with the numbers: checkpoint.memory off, or background saves written synchronously. Also a Warning Event MemoryBudget."""


class HangSuspect(_Model):
    """A rank named by a hang verdict."""

    rank: int
    """Global rank."""
    worker: int
    """Worker index (pod `<job>-worker-<i>`; locally the node rank)."""
    pod: str | None = None
    """The worker's pod (unset locally)."""
    node: str | None = None
    """The pod's node (unset locally or when not known)."""
    where: str = ""
    """What its stack or /proc showed: `stopped (SIGSTOP)`, `in the data loader`, `in step (train.py:42)`, ..."""


class LastHang(_Model):
    """The newest hang verdict (restartPolicy.hangDetection)."""

    time: str
    """When the gang restart it caused was decided (RFC 3339)."""
    generation: int
    """The generation that hung."""
    step: int | None = None
    """The newest step any rank had reached."""
    silent_seconds: float = 0.0
    """How long the first rank found silent had been, against its limit (limitSeconds)."""
    limit_seconds: float = 0.0
    """That rank's limit at the time."""
    suspects: list[HangSuspect] = Field(default_factory=list, max_length=64)
    """The odd ones out (empty: no rank stood out, e.g. every rank waited in the same collective)."""
    message: str = ""
    """The verdict in one sentence, as in the Event."""
    dumps: str = ""
    """Where the workers saved every rank's stacks (inside the pods: the checkpoint volume; locally the logs)."""


class CheckpointStore(_Model):
    """An object store for checkpoints: the operator's default (chart value checkpointStore) for jobs with several
    workers on a StorageClass that offers ReadWriteOnce only, and what such a job got (status.checkpointStore)."""

    uri: str = Field(..., max_length=1024, pattern=S3_URI_PATTERN)
    """`s3://bucket/prefix`: each job keeps its checkpoints under `<prefix>/<namespace>/<job>-<uid>`."""
    s3: S3Spec | None = None
    """How workers reach it, as a job's spec.s3 (endpoint, region, addressingStyle, credentialsSecret: a Secret of
    that name in each job's namespace). Unset: AWS S3 with the pods' cloud identity."""

    def for_job(self, meta: ObjectMeta) -> CheckpointStore:
        """The store with the prefix of one job."""
        return self.model_copy(update={"uri": job_prefix(self.uri, meta)})


def job_prefix(uri: str, meta: ObjectMeta) -> str:
    """A job's own prefix under a shared one (a runtime's or the operator's checkpoint store): one per job object,
    so that a job created anew under an old name starts afresh, as it would on a new claim."""
    return f"{uri.rstrip('/')}/{meta.namespace or 'default'}/{meta.name}-{meta.uid or ''}"


class AppliedRuntime(_Model):
    """The runtime a job was resolved with: the operator keeps it from the job's first reconcile on and takes it
    anew until the job starts, so that an edit of the runtime never changes a job that runs."""

    kind: RuntimeKind
    """TrainingRuntime or ClusterTrainingRuntime."""
    name: str
    """The runtime's name."""
    resource_version: str | None = None
    """The runtime's metadata.resourceVersion that was applied."""
    spec: dict[str, Any] = Field(default_factory=dict)
    """The runtime's spec as it was applied (only the fields its author set)."""


class TrainingJobStatus(_Model):
    """Observed state of a TrainingJob, written by the operator."""

    phase: Phase = Phase.PENDING
    """Pending, Created, Running, Restarting, Suspended, Succeeded or Failed."""
    conditions: list[Condition] = Field(default_factory=list)
    """Conditions with reasons and messages."""
    workers_ready: int = 0
    """Worker pods Running and ready in the current generation."""
    workers_total: int = 0
    """Worker pods desired."""
    workers_summary: str = ""
    """ready/total, for the printer column."""
    restart_count: int = 0
    """Gang restarts so far."""
    ignored_restarts: int = 0
    """Restarts not counted against backoffLimit (disruptions, RestartGangAndIgnore rules)."""
    restart_generation: int = 0
    """Generation of the current gang (0 for the first)."""
    resumed_from_step: int = 0
    """Step of the checkpoint the current generation resumed from, as its rank 0 reported it (0: it started from scratch, or has not reported yet)."""
    resumed_from: ResumeTier | None = None
    """The tier the current generation resumed from: memory (checkpoint.memory, a restart in place) or durable (the checkpoint directory); unset when it started from scratch or has not reported yet."""
    gang_created: bool = False
    """Every worker of the current generation has been created (a worker missing after that was deleted)."""
    last_restart_time: str | None = None
    """When the last gang restart was decided (RFC 3339); the next generation starts after the backoff."""
    running_since: str | None = None
    """When every worker of the current generation was first seen Running."""
    gang_created_time: str | None = None
    """When the current gang's workers were created (restartPolicy.startTimeoutSeconds counts from it)."""
    last_failure_time: str | None = None
    """When the last worker failure was seen (recovery time runs from here to all workers Running)."""
    reason: str = ""
    """Reason of the latest phase."""
    message: str = ""
    """Message of the latest phase."""
    failures: dict[str, int] = Field(default_factory=dict)
    """Worker failures counted by kind (e.g. ExitCode, Evicted, NodeLost, NoProgress)."""
    current_step: int = 0
    """Last optimizer step rank 0 reported."""
    max_steps: int = 0
    """spec.maxSteps."""
    loss: str | None = None
    """Last loss rank 0 reported."""
    eval_loss: str | None = None
    """Loss on the held-out text at rank 0's newest evaluation (spec.evalEverySteps)."""
    percent_complete: str | None = None
    """currentStep as a percentage of maxSteps (e.g. `45%`)."""
    eta: str | None = None
    """Time left at the current generation's mean step time (e.g. `4m10s`), as of rank 0's last report."""
    tokens_per_second: int | None = None
    """Training throughput of the whole gang, mean over the current generation's steps."""
    mfu: str | None = None
    """Model FLOPs utilization over the current generation's steps (e.g. `41.2%`), where the device's peak FLOP/s is known (a GPU in the trainer's table, or KUBETRAIN_PEAK_FLOPS)."""
    last_checkpoint: CheckpointRef | None = None
    """Newest complete checkpoint."""
    export: str | None = None
    """Where the exported model is (spec.export): its directory in the checkpoint volume, or its object-store URI with checkpoint.uri. Unset until rank 0 has written it."""
    goodput: Goodput = Field(default_factory=Goodput)
    """Productive and lost time, and steps redone after restarts (metrics kubetrain_operator_job_goodput_*)."""
    gpu_hours: float = 0.0
    """GPU-hours allocated to the job so far: resources.gpusPerWorker for each worker pod while it runs or is placed on a node, whatever it does with them (goodput.lostGpuHours: the part restarts cost). Metric kubetrain_operator_job_gpu_hours."""
    last_progress_time: str | None = None
    """When rank 0 last reported a new step."""
    network_transport: str | None = None
    """The network transport NCCL chose, as rank 0 of the current generation reported it: IB, OFI (EFA), GPUDirectTCPX, FasTrak (TCPXO), Socket (TCP), P2P/SHM (one node, no network) or gloo (CPU). Unset until reported."""
    fetch: Fetch | None = None
    """Worker 0's fetch of model.hfUri and data.tokenizerUri into its pod's cache, as it reported it: bytes so far of the total. Unset without those URIs, or until reported."""
    preflight: Preflight | None = None
    """The current generation's preflight, as rank 0 reported it (spec.preflight): per-rank compute and exchange, bus bandwidth, slowest and degraded ranks. Unset until reported."""
    memory: MemoryReport | None = None
    """Peak memory per rank (host resident, GPU allocated) of the newest generation that reported it, and what its checkpoints could not keep in the pods' memory. A restarted gang's replaces it once it reports, so a generation that ran out of memory leaves its figures until then."""
    runtime: AppliedRuntime | None = None
    """The TrainingRuntime or ClusterTrainingRuntime of spec.runtimeRef as applied: taken anew until the job starts, then kept."""
    checkpoint_store: CheckpointStore | None = None
    """Where the operator put the checkpoints of a job with several workers whose StorageClass offers ReadWriteOnce only: the chart's checkpointStore, under a prefix of this job's own. Chosen before the job starts, then kept."""
    avoided_nodes: list[str] = Field(default_factory=list)
    """Nodes where a preflight found a degraded rank, which later worker pods avoid (restartPolicy.avoidDegradedNodes)."""
    last_hang: LastHang | None = None
    """The newest hang verdict: when, the step, the suspect ranks with their pods and nodes, where the stacks are."""
    start_time: str | None = None
    """When the job first started running (RFC 3339)."""
    completion_time: str | None = None
    """When the job finished (RFC 3339)."""
    observed_generation: int = 0
    """metadata.generation this status reflects."""


class ObjectMeta(_Model):
    """The subset of metadata kubetrain reads."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="allow")
    name: str = Field(..., min_length=1, max_length=50, pattern=DNS_LABEL_PATTERN)
    """Job name: a DNS label of at most 50 characters (pod hostnames append `-worker-<i>` and must stay within 63)
    that starts with a letter (it is also the name of the job's Service, a DNS-1035 label)."""
    namespace: str | None = Field(None, max_length=63, pattern=DNS_LABEL_PATTERN)
    """Namespace: a DNS label (lowercase a-z, 0-9, '-'; at most 63 characters), as every namespace's name is."""
    labels: dict[str, str] | None = None
    """Labels."""
    annotations: dict[str, str] | None = None
    """Annotations."""
    uid: str | None = None
    """Set by the API server: which TrainingJob of this name this is."""

    @field_validator("name")
    @classmethod
    def _starts_with_letter(cls, name: str) -> str:
        if not name[:1].isalpha():  # the pattern, checked before, allows a-z and 0-9 only
            raise PydanticCustomError(OWN_ERROR, JOB_NAME_START_REASON)
        return name

    @field_validator("labels")
    @classmethod
    def _labels(cls, labels: dict[str, str] | None) -> dict[str, str] | None:
        return check_labels(labels)

    @field_validator("annotations")
    @classmethod
    def _annotations(cls, annotations: dict[str, str] | None) -> dict[str, str] | None:
        return check_annotations(annotations)


def check_labels(labels: dict[str, str] | None) -> dict[str, str] | None:
    """The API server's rules for any object's labels, said before it refuses the object."""
    for key, value in (labels or {}).items():
        _check_key(key, key)
        if value and (len(value) > MAX_LABEL_VALUE or not re.fullmatch(LABEL_VALUE_PATTERN, value)):
            raise PydanticCustomError(OWN_ERROR, "the value of {key} must be empty or at most {max} characters: "
                                      + PATTERN_REASONS[LABEL_VALUE_PATTERN].removeprefix("must be "),
                                      {"key": repr(key), "max": MAX_LABEL_VALUE})
    return labels


def check_annotations(annotations: dict[str, str] | None) -> dict[str, str] | None:
    """The API server's rules for any object's annotations: keys as label keys (in any case), and a total size."""
    for key in annotations or {}:
        _check_key(key, key.lower())
    size = sum(len(k.encode()) + len(v.encode()) for k, v in (annotations or {}).items())
    if size > MAX_ANNOTATIONS_BYTES:
        raise PydanticCustomError(OWN_ERROR, "must total at most {max} bytes, keys and values (the API server's "
                                  "limit); these take {size}", {"max": MAX_ANNOTATIONS_BYTES, "size": size})
    return annotations


def _check_key(key: str, checked: str) -> None:
    """`key` as a label key, `checked` being the form the API server checks (annotation keys: lowercased)."""
    if len(checked.rpartition("/")[0]) > MAX_LABEL_KEY_PREFIX or not re.fullmatch(LABEL_KEY_PATTERN, checked):
        raise PydanticCustomError(OWN_ERROR, "key {key} " + PATTERN_REASONS[LABEL_KEY_PATTERN]
                                  + " (at most {prefix} and 63 characters)", {"key": repr(key), "prefix": MAX_LABEL_KEY_PREFIX})


class TrainingJob(_Model):
    """A distributed PyTorch training job (DDP, FSDP2 or DeepSpeed ZeRO) run as a gang that restarts from its latest checkpoint."""

    api_version: Literal["kubetrain.io/v1alpha1"] = API_VERSION
    """kubetrain.io/v1alpha1"""
    kind: Literal["TrainingJob"] = KIND
    """TrainingJob"""
    metadata: ObjectMeta
    """Standard object metadata."""
    spec: TrainingJobSpec = Field(default_factory=TrainingJobSpec)
    """Desired state."""
    status: TrainingJobStatus | None = None
    """Observed state."""


# =========================================================================== runtimes

RUNTIME_PLURAL = "trainingruntimes"
RUNTIME_SINGULAR = "trainingruntime"
CLUSTER_RUNTIME_PLURAL = "clustertrainingruntimes"
CLUSTER_RUNTIME_SINGULAR = "clustertrainingruntime"


class RuntimeCheckpointSpec(_Model):
    """Where a runtime's jobs keep their checkpoints (the fields of a job's spec.checkpoint a runtime may set)."""

    storage_size: str | None = Field(None, max_length=MAX_QUANTITY, pattern=QUANTITY_PATTERN)
    """checkpoint.storageSize of its jobs."""
    storage_class_name: str | None = Field(None, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    """checkpoint.storageClassName of its jobs."""
    access_mode: AccessMode | None = None
    """checkpoint.accessMode of its jobs."""
    uri: str | None = Field(None, max_length=1024, pattern=S3_URI_PATTERN)
    """An s3:// prefix: each of its jobs that sets no checkpoint.uri of its own keeps its checkpoints under `<uri>/<namespace>/<job>-<uid>` (a job created anew under an old name starts afresh)."""


class TrainingRuntimeSpec(_Model):
    """What an admin sets once for the jobs that reference this runtime (spec.runtimeRef): each field is the default
    of the job's field of the same name, and `locked` names those a job may not set otherwise."""

    image: str | None = Field(None, max_length=1024, pattern=IMAGE_PATTERN)
    """The workers' image."""
    pod_template: dict[str, Any] | None = None
    """A partial core/v1 PodTemplateSpec under the job's own podTemplate (which merges over it as it merges over the generated pod)."""
    env: list[EnvVar] | None = Field(None, max_length=MAX_ENV_VARS)
    """Environment variables of the workers; a job's variable of the same name wins unless `env` is locked."""
    fabric: Fabric | None = None
    """The network fabric profile. Fabrics whose daemon or host volumes need host privileges (tcpx, tcpxo) are meant to come from here: a job's own is refused unless the chart's podPolicy allows host paths."""
    fabric_options: FabricOptions | None = None
    """The fabric's options, daemonImage included (which no job may name itself)."""
    scheduling: SchedulingSpec | None = None
    """Placement: node selector and tolerations (a job's add to these), affinity, priority class, queue, gang, scheduler."""
    resources: ResourcesSpec | None = None
    """Per-worker resources."""
    checkpoint: RuntimeCheckpointSpec | None = None
    """Checkpoint storage."""
    s3: S3Spec | None = None
    """The object store of checkpoint.uri (and of the jobs' other s3:// URIs)."""
    locked: list[Annotated[str, Field(min_length=1, max_length=253)]] | None = Field(None, max_length=64)
    """Fields a job may not set otherwise than this runtime does, as paths of this spec (`image`, `fabric`, `fabricOptions`, `scheduling.nodeSelector`, `resources.gpusPerWorker`, ...); a path locks everything under it, and a locked field this runtime leaves unset must stay unset."""


class RuntimeMeta(ObjectMeta):
    """The subset of a runtime's metadata kubetrain reads."""

    name: str = Field(..., min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    """The runtime's name, which jobs' spec.runtimeRef.name gives."""
    resource_version: str | None = None
    """Set by the API server."""

    @field_validator("name")
    @classmethod
    def _starts_with_letter(cls, name: str) -> str:
        return name  # a runtime is no job: no Service or hostname is made of its name


class TrainingRuntime(_Model):
    """Defaults and locked fields for the TrainingJobs of one namespace that reference it (spec.runtimeRef)."""

    api_version: Literal["kubetrain.io/v1alpha1"] = API_VERSION
    """kubetrain.io/v1alpha1"""
    kind: Literal["TrainingRuntime"] = RUNTIME_KIND
    """TrainingRuntime"""
    metadata: RuntimeMeta
    """Standard object metadata."""
    spec: TrainingRuntimeSpec = Field(default_factory=TrainingRuntimeSpec)
    """What its jobs start from."""


class ClusterTrainingRuntime(_Model):
    """Defaults and locked fields for the TrainingJobs of every namespace that reference it (spec.runtimeRef)."""

    api_version: Literal["kubetrain.io/v1alpha1"] = API_VERSION
    """kubetrain.io/v1alpha1"""
    kind: Literal["ClusterTrainingRuntime"] = CLUSTER_RUNTIME_KIND
    """ClusterTrainingRuntime"""
    metadata: RuntimeMeta
    """Standard object metadata."""
    spec: TrainingRuntimeSpec = Field(default_factory=TrainingRuntimeSpec)
    """What its jobs start from."""


# =========================================================================== TrainingSweep

SWEEP_KIND: Final = "TrainingSweep"
SWEEP_PLURAL = "trainingsweeps"
SWEEP_SINGULAR = "trainingsweep"
SWEEP_SHORT_NAMES = ["tsw", "sweep"]
MAX_TRIALS: Final = 500
"""A sweep's status records every trial: 500 trials with 20 intermediate values each take about 0.5 MB of the 1.5 MiB etcd holds per object."""
MAX_SWEEP_PARALLELISM: Final = 100
MAX_SWEEP_NAME: Final = 46
"""Trial jobs are named `<sweep>-<index>` (index < 500), and a job name has at most 50 characters."""
MAX_TRIAL_MESSAGE: Final = 512
"""Characters of a trial's message kept in status (a failed job's message can be long)."""
MAX_INTERMEDIATE_VALUES: Final = 20
MAX_SWEEP_PARAMETERS: Final = 32
MAX_GRID_POINTS: Final = 10_000
"""The most combinations a grid sampler may hold: the sampler builds every one of them at each sweep step (a
grid larger than maxTrials, at most 500, runs only a seeded sample of it). Larger spaces take random or tpe."""
"""Intermediate values kept per trial: the pruner's interval is widened so that maxSteps fits in this many."""
SWEEP_MUTABLE_SPEC_FIELDS = ("maxTrials", "parallelism")
"""Spec fields a sweep takes edits of once it exists; the API server refuses an edit of any other field."""
SPEC_PATH_PATTERN = r"^[a-z][A-Za-z0-9]*(\.[a-z][A-Za-z0-9]*)*$"

ParameterValue = Annotated[
    bool | int | float | str,
    WithJsonSchema({"x-kubernetes-preserve-unknown-fields": True, "description": "A number, string or boolean."}),
]
"""A value a parameter takes: the type of the spec field it sets."""


class SweepPhase(enum.StrEnum):
    """A TrainingSweep's status.phase."""

    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


FINISHED_SWEEP_PHASES = (SweepPhase.SUCCEEDED, SweepPhase.FAILED)


class SweepReason(enum.StrEnum):
    """status.reason of a sweep, its trials' StopTrial reasons, and its Event reasons."""

    CREATED = "Created"
    """Pending: no trial recorded yet."""
    TRIALS_RUNNING = "TrialsRunning"
    INVALID_SPEC = "InvalidSpec"
    """Failed: the search space cannot give valid TrainingJobs (see the message)."""
    TOO_MANY_FAILED_TRIALS = "TooManyFailedTrials"
    COMPLETED = "Completed"
    """Succeeded: every trial finished and at least one completed."""
    NO_TRIAL_COMPLETED = "NoTrialCompleted"
    """Failed: every trial finished and none completed."""
    TRIAL_COMPLETED = "TrialCompleted"
    TRIAL_FAILED = "TrialFailed"
    TRIAL_PRUNED = "TrialPruned"
    PRUNED = "Pruned"
    """StopTrial: the pruner stopped the trial."""
    SWEEP_FINISHED = "SweepFinished"
    """StopTrial: the sweep finished (failed) while the trial ran."""


class TrialState(enum.StrEnum):
    """The state of one trial of a sweep."""

    PENDING = "Pending"
    """Recorded with its parameters; its TrainingJob is being created."""
    RUNNING = "Running"
    """Its TrainingJob exists and has not finished."""
    COMPLETE = "Complete"
    """Its TrainingJob succeeded; value holds the objective."""
    PRUNED = "Pruned"
    """Stopped early by the pruner; value holds its last intermediate value."""
    FAILED = "Failed"
    """Its TrainingJob failed or disappeared."""


FINISHED_TRIAL_STATES = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAILED)


class SweepParameter(_Model):
    """One dimension of the search space: a TrainingJob spec field and the values it may take."""

    path: str = Field(..., max_length=128, pattern=SPEC_PATH_PATTERN)
    """The spec field to set, as in a manifest, e.g. `optimizer.lr`, `microBatchSize`, `model.nLayers`."""
    type: Literal["float", "int", "categorical"] = "float"
    """`float` and `int` take values in [low, high]; `categorical` one of `values`."""
    low: float | None = None
    """Lowest value (float and int)."""
    high: float | None = None
    """Highest value (float and int)."""
    log: bool = False
    """Sample on a log scale (needs low > 0), e.g. for learning rates."""
    step: float | None = Field(None, gt=0)
    """Spacing of the values between low and high (discrete search; needed by the grid sampler)."""
    values: list[ParameterValue] | None = Field(None, min_length=1, max_length=1000)
    """The choices of a categorical parameter."""


def grid_points(param: SweepParameter) -> int:
    """How many values the grid sampler tries for one parameter: its values, or low, low + step, ..., high
    (step 1 for an int parameter without one), counted, never listed."""
    if param.values is not None:
        return len(param.values)
    if param.low is None or param.high is None or param.high < param.low:
        return 1  # refused by another rule
    span = Decimal(str(param.high)) - Decimal(str(param.low))
    return int(span / Decimal(str(param.step or 1))) + 1


def grid_size(parameters: list[SweepParameter], limit: int = MAX_GRID_POINTS, ranges_only: bool = False) -> int:
    """The number of grid combinations, or the first partial product above `limit` (enough to refuse).
    `ranges_only`: count a categorical parameter as one value, as the API server must (CEL does not see
    `values`, whose items are untyped)."""
    total = 1
    for param in parameters:
        total *= 1 if ranges_only and param.values is not None else grid_points(param)
        if total > limit:
            break
    return total


def _grid_points_cel(i: int) -> str:
    """CEL for the number of values parameters[i] spans from low to high (1.0 for a categorical parameter, or
    where parameters[i] does not exist), as a double."""
    p = f"self.parameters[{i}]"
    count = (f"({p}.type != 'categorical' && has({p}.low) && has({p}.high) ? "
             f"({p}.high - {p}.low) / (has({p}.step) ? {p}.step : 1.0) + 1.0 : 1.0)")
    return f"(size(self.parameters) > {i} ? {count} : 1.0)"


GRID_RANGES_CEL = (f"self.sampler.type != 'grid' || "
                   f"{' * '.join(_grid_points_cel(i) for i in range(MAX_SWEEP_PARAMETERS))} <= {float(MAX_GRID_POINTS)}")
GRID_TOO_LARGE = (f"the grid sampler tries every combination of the parameters' values: at most {MAX_GRID_POINTS} "
                  "(use sampler random or tpe for a larger space, or coarser steps)")


UNTUNABLE: Final[dict[str, str]] = {
    "checkpoint.dir": "names where a job keeps its checkpoints, not a hyperparameter: every trial keeps its own",
    "checkpoint.claimName": "names a job's storage, not a hyperparameter: trials would share one claim",
    "checkpoint.uri": "names where a job keeps its checkpoints, not a hyperparameter: every trial keeps its own",
    "suspend": "pauses and resumes a job, not a hyperparameter: the sweep decides when each trial runs",
}
"""Spec fields that hold a value but are no hyperparameter; a parameter over one is refused."""

def _path_is_not(path: str) -> Callable[[Any], bool]:
    return lambda p: p.path != path


PARAMETER_RULES: list[Rule] = [
    Rule(
        "values",
        None,
        "a categorical parameter needs values; a float or int parameter takes low and high instead",
        lambda p: (p.values is not None) == (p.type == "categorical"),
    ),
    Rule(
        "low",
        "self.type == 'categorical' || (has(self.low) && has(self.high) && self.low < self.high)",
        "a float or int parameter needs low and high, with low < high",
        lambda p: p.type == "categorical" or (p.low is not None and p.high is not None and p.low < p.high),
    ),
    Rule(
        "log",
        "!self.log || (self.type != 'categorical' && has(self.low) && self.low > 0.0 && !has(self.step))",
        "log needs a float or int parameter with low > 0, and no step",
        lambda p: not p.log or (p.type != "categorical" and p.low is not None and p.low > 0 and p.step is None),
    ),
    Rule(
        "type",
        "self.type != 'int' || ((!has(self.low) || self.low == double(int(self.low)))"
        " && (!has(self.high) || self.high == double(int(self.high)))"
        " && (!has(self.step) || self.step == double(int(self.step))))",
        "an int parameter needs whole numbers for low, high and step",
        lambda p: p.type != "int" or all(v is None or float(v).is_integer() for v in (p.low, p.high, p.step)),
    ),
    *(Rule("path", f"self.path != '{path}'", f"{path} {why}", _path_is_not(path)) for path, why in UNTUNABLE.items()),
]
"""Rules on each entry of a TrainingSweep's spec.parameters (paths relative to the entry)."""


class SweepObjective(_Model):
    """What the sweep minimises."""

    metric: Literal["loss", "evalLoss"] = "loss"
    """`loss`: the training loss that rank 0 reports (status.loss of the trial's TrainingJob); `evalLoss`: the loss on held-out data at rank 0's newest evaluation (status.evalLoss: the template needs evalEverySteps, or a custom command that reports eval_loss)."""
    goal: Literal["minimize"] = "minimize"
    """Direction: losses are minimised."""
    value: Literal["final", "best"] = "final"
    """A finished trial's value: its `final` reported loss, or the `best` (lowest) one it reported."""


class SweepSampler(_Model):
    """How parameters are chosen (Optuna samplers)."""

    type: Literal["tpe", "random", "grid"] = "tpe"
    """`tpe` (Tree-structured Parzen Estimator), `random`, or `grid` (every combination; each parameter needs `values` or `step`)."""
    startup_trials: int = Field(4, ge=0, le=MAX_TRIALS)
    """TPE: random trials before the model takes over. At most 500."""


class SweepPruner(_Model):
    """How unpromising trials are stopped early (Optuna pruners), judged on the loss trials report."""

    type: Literal["asha", "median", "none"] = "asha"
    """`asha` (asynchronous successive halving), `median` (stop a trial worse than the median of earlier trials at the same step) or `none`."""
    min_steps: int | None = Field(None, ge=1, le=MAX_STEPS)
    """No trial is pruned before this step (ASHA's minimum resource, median's warm-up). Default: a tenth of the template's maxSteps."""
    reduction_factor: int = Field(3, ge=2, le=100)
    """ASHA: one trial in reductionFactor goes on at each rung."""
    startup_trials: int = Field(2, ge=0, le=MAX_TRIALS)
    """Median: finished trials needed before any trial is pruned."""
    interval_steps: int | None = Field(None, ge=1, le=MAX_STEPS)
    """Steps between the intermediate values recorded per trial (every trial is compared at the same steps). Default and minimum: maxSteps / 20."""


class TrainingJobTemplate(_Model):
    """The TrainingJob every trial runs, before the trial's parameters are set."""

    metadata: dict[str, Any] | None = None
    """Labels and annotations for the trial jobs (`labels`, `annotations`; held to the API server's rules for
    any object's, since every trial job carries them)."""
    spec: TrainingJobSpec = Field(default_factory=TrainingJobSpec)
    """The TrainingJob spec."""

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, meta: dict[str, Any] | None) -> dict[str, Any] | None:
        for key, check in (("labels", check_labels), ("annotations", check_annotations)):
            value = (meta or {}).get(key)
            if value is not None and not (isinstance(value, dict) and all(
                    isinstance(k, str) and isinstance(v, str) for k, v in value.items())):
                raise PydanticCustomError(OWN_ERROR, "{key} must map strings to strings", {"key": key})
            try:
                check(value)
            except PydanticCustomError as exc:  # name which of the two
                raise PydanticCustomError(OWN_ERROR, "{key}: {problem}", {"key": key, "problem": exc.message()}) from None
        return meta


class TrainingSweepSpec(_Model):
    """Desired state of a TrainingSweep: a search space over a TrainingJob template."""

    template: TrainingJobTemplate
    """The TrainingJob each trial runs, with the trial's parameters set."""
    parameters: list[SweepParameter] = Field(..., min_length=1, max_length=MAX_SWEEP_PARAMETERS)
    """The search space: the spec fields to tune and their ranges. At most 32."""
    objective: SweepObjective = Field(default_factory=SweepObjective)
    """What is minimised."""
    max_trials: int = Field(10, ge=1, le=MAX_TRIALS)
    """Trials to run in all (pruned and failed ones count). At most 500."""
    parallelism: int = Field(1, ge=1, le=MAX_SWEEP_PARALLELISM)
    """Trials running at once. At most 100."""
    max_failed_trials: int = Field(3, ge=0, le=MAX_TRIALS)
    """The sweep fails when more trials than this have failed."""
    sampler: SweepSampler = Field(default_factory=SweepSampler)
    """Parameter sampler."""
    pruner: SweepPruner = Field(default_factory=SweepPruner)
    """Early stopping."""
    seed: int = Field(0, ge=0, le=2**32 - 1)
    """Seed of the sampler: the same seed and the same results give the same trials."""

    def rule_violations(self) -> list[tuple[str, str]]:
        """(spec-relative path, message) for every cross-field rule this spec breaks, the template's included."""
        found = [(r.path, r.message) for r in SWEEP_RULES if not r.check(self)]
        for i, param in enumerate(self.parameters):
            found += [(f"parameters[{i}].{r.path}", r.message) for r in PARAMETER_RULES if not r.check(param)]
        return found + [(f"template.spec.{path}", message) for path, message in self.template.spec.rule_violations()]


SWEEP_RULES: list[Rule] = [
    Rule(
        "objective.metric",
        "self.objective.metric != 'evalLoss' || has(self.template.spec.evalEverySteps) || "
        "has(self.template.spec.command) || self.parameters.exists(p, p.path == 'evalEverySteps')",
        "evalLoss needs an evaluation in every trial: set template.spec.evalEverySteps (a custom command reports "
        "its own eval_loss)",
        lambda s: s.objective.metric != "evalLoss" or s.template.spec.eval_every_steps is not None
        or s.template.spec.command is not None or any(p.path == "evalEverySteps" for p in s.parameters),
    ),
    Rule(
        "parameters",
        "self.parameters.all(p, self.parameters.exists_one(q, q.path == p.path))",
        "every parameter needs its own path (a spec field is tuned once)",
        lambda s: len({p.path for p in s.parameters}) == len(s.parameters),
    ),
    Rule(
        "sampler.type",
        None,
        "the grid sampler needs values or step on every parameter",
        lambda s: s.sampler.type != "grid" or all(p.values is not None or p.step is not None for p in s.parameters),
    ),
    Rule(
        "parameters",
        GRID_RANGES_CEL,
        GRID_TOO_LARGE,
        lambda s: s.sampler.type != "grid" or grid_size(s.parameters, ranges_only=True) <= MAX_GRID_POINTS,
    ),
    Rule(  # the categorical values too, which CEL cannot count; said once, where the ranges alone fit
        "parameters",
        None,
        GRID_TOO_LARGE,
        lambda s: s.sampler.type != "grid" or grid_size(s.parameters, ranges_only=True) > MAX_GRID_POINTS
        or grid_size(s.parameters) <= MAX_GRID_POINTS,
    ),
    Rule(
        "template.spec.suspend",
        "!self.template.spec.suspend",
        "trial jobs start unsuspended: drop template.spec.suspend (a queue such as Kueue suspends and resumes them itself)",
        lambda s: not s.template.spec.suspend,
    ),
]
"""Cross-field rules of a TrainingSweep's spec."""


class TrialValue(_Model):
    """A loss a trial reported at a step."""

    step: int
    """Optimizer step."""
    value: float
    """Its loss."""


class TrialRecord(_Model):
    """One trial of a sweep, as the sweep controller recorded it."""

    index: int
    """Trial number, from 0."""
    job_name: str
    """Its TrainingJob: `<sweep>-<index>`."""
    params: dict[str, ParameterValue] = Field(default_factory=dict)
    """The parameters it runs with, by spec path."""
    state: TrialState = TrialState.PENDING
    """Pending, Running, Complete, Pruned or Failed."""
    step: int = 0
    """Last step its rank 0 reported."""
    value: float | None = None
    """Objective value: the final (or best) loss when Complete, the last one when Pruned."""
    intermediate: list[TrialValue] = Field(default_factory=list)
    """Losses recorded at the pruner's interval."""
    pruner_state: dict[str, float] = Field(default_factory=dict)
    """The pruner's bookkeeping for this trial (ASHA rungs), kept so that the study can be rebuilt."""
    message: str = Field("", max_length=MAX_TRIAL_MESSAGE)
    """Why it ended (pruned at which step, why it failed); at most 512 characters."""
    start_time: str | None = None
    """When it was recorded (RFC 3339)."""
    completion_time: str | None = None
    """When it ended (RFC 3339)."""


class TrainingSweepStatus(_Model):
    """Observed state of a TrainingSweep, written by the sweep controller; the study is rebuilt from it."""

    phase: SweepPhase = SweepPhase.PENDING
    """Pending, Running, Succeeded or Failed."""
    conditions: list[Condition] = Field(default_factory=list)
    """Conditions with reasons and messages."""
    reason: str = ""
    """Reason of the latest phase."""
    message: str = ""
    """Message of the latest phase."""
    trials: list[TrialRecord] = Field(default_factory=list)
    """Every trial so far, by index."""
    trials_running: int = 0
    """Trials Pending or Running."""
    trials_complete: int = 0
    """Trials that finished their maxSteps."""
    trials_pruned: int = 0
    """Trials stopped by the pruner."""
    trials_failed: int = 0
    """Trials that failed."""
    trials_summary: str = ""
    """done/maxTrials, for the printer column."""
    best_trial: int | None = None
    """Index of the best trial so far."""
    best_value: float | None = None
    """Its objective value."""
    best_params: dict[str, ParameterValue] | None = None
    """Its parameters."""
    start_time: str | None = None
    """When the sweep started (RFC 3339)."""
    completion_time: str | None = None
    """When it finished (RFC 3339)."""
    observed_generation: int = 0
    """metadata.generation this status reflects."""


class SweepMeta(ObjectMeta):
    """The subset of metadata kubetrain reads; a sweep's name leaves room for `-<index>` in trial job names."""

    name: str = Field(..., min_length=1, max_length=MAX_SWEEP_NAME, pattern=DNS_LABEL_PATTERN)
    """Sweep name: a DNS label of at most 46 characters that starts with a letter (trial jobs are `<sweep>-<index>`)."""


class TrainingSweep(_Model):
    """A hyperparameter sweep: trials of a TrainingJob template chosen by an Optuna sampler and stopped early by a pruner."""

    api_version: Literal["kubetrain.io/v1alpha1"] = API_VERSION
    """kubetrain.io/v1alpha1"""
    kind: Literal["TrainingSweep"] = SWEEP_KIND
    """TrainingSweep"""
    metadata: SweepMeta
    """Standard object metadata."""
    spec: TrainingSweepSpec
    """Desired state."""
    status: TrainingSweepStatus | None = None
    """Observed state."""
