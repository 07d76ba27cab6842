"""`kubetrain validate`: exit codes and one field-path message per problem."""

import random
import re
from pathlib import Path

import pytest
import yaml

from kubetrain.core import api
from kubetrain.core.cli import main
from kubetrain.core.validate import load_job, problems_of
from kubetrain.operator.jobs import fabrics

MANIFESTS = Path(__file__).parent / "manifests"
REPO = Path(__file__).resolve().parents[2]

SYSTEM_DIR_LINE = ("spec.checkpoint.dir: checkpoint.dir must not be / or in a system directory (/bin, /boot, /dev, "
                   "/etc, /lib, /lib32, /lib64, /libx32, /proc, /run, /sbin, /sys, /usr, /var/run): the checkpoint "
                   "volume would hide it, and kubetrain's own mounts are there")
ARGS_LINE = "spec.command: args needs a non-empty command (custom script mode; the built-in trainer takes no args)"
RESERVED_ENV_LINE = ("spec.env: env cannot set the variables kubetrain sets for every worker: MASTER_ADDR, MASTER_PORT, "
                     "WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, PET_NNODES, PET_NPROC_PER_NODE, "
                     "PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT, KUBETRAIN_JOB, KUBETRAIN_NAMESPACE, "
                     "KUBETRAIN_CONFIG, KUBETRAIN_CHECKPOINT_DIR, KUBETRAIN_OUTPUT_DIR, KUBETRAIN_RESTART_GENERATION, "
                     "KUBETRAIN_METRICS_PORT, KUBETRAIN_METRICS_ADDR, KUBETRAIN_POD_NAME, KUBETRAIN_POD_NAMESPACE, "
                     "KUBETRAIN_GENERATION_FILE, KUBETRAIN_IN_PLACE_WAIT_SECONDS, KUBETRAIN_STANDBY, "
                     "KUBETRAIN_RAN_GENERATION_FILE, KUBETRAIN_HEARTBEAT_DIR, KUBETRAIN_HANG, KUBETRAIN_HANG_DIR, "
                     "KUBETRAIN_NODE_NAME, KUBETRAIN_MEMORY_CKPT_DIR, KUBETRAIN_MEMORY_CKPT_EVERY_STEPS, "
                     "KUBETRAIN_MEMORY_CKPT_BYTES")
IMAGE_LINE = ("spec.image: must be an image reference, [registry[:port]/]repository[:tag][@digest]: a lowercase "
              "repository, no spaces or shell characters")
TENSOR_PROCS_LINE = ("spec.parallelism.tensor: parallelism.tensor must divide the processes per worker (procsPerWorker, "
                     "default resources.gpusPerWorker or 1): tensor parallelism stays inside one worker, and the world "
                     "size is then a multiple of it")
TENSOR_STRATEGY_LINE = ("spec.parallelism.tensor: parallelism.tensor > 1 needs strategy fsdp: tensor parallelism composes "
                        "with FSDP2 only, not yet with ddp (nor its gradientCompression) or deepspeed")
PIPELINE_WORLD_LINE = ("spec.parallelism.pipeline: parallelism.pipeline times parallelism.tensor must divide the world size "
                       "(workers x processes per worker): every stage runs on the same number of processes")
PIPELINE_MICROBATCHES_LINE = (
    "spec.parallelism.pipelineSchedule: parallelism.pipelineSchedule 1F1B needs gradientAccumulationSteps (the "
    "micro-batches of a step) >= parallelism.pipeline: use more micro-batches, or pipelineSchedule GPipe")
PIPELINE_INTERLEAVED_LINE = (
    "spec.parallelism.pipelineSchedule: parallelism.pipelineSchedule Interleaved1F1B runs 2 stages per process: it "
    "needs gradientAccumulationSteps (the micro-batches of a step) a multiple of parallelism.pipeline and "
    "model.nLayers >= 2 x parallelism.pipeline")
PIPELINE_STRATEGY_LINE = ("spec.parallelism.pipeline: parallelism.pipeline > 1 needs strategy fsdp: pipelining composes "
                          "with FSDP2 only, not yet with ddp or deepspeed")
# file -> the exact line(s) `kubetrain validate` must print for it
EXPECTED = {
    "bad-command-empty-string.yaml": ["spec.command: command[0], the program to run, must not be empty"],
    "bad-vocab-bytes.yaml": [
        "spec.model.vocabSize: model.vocabSize must be at least 256 for the built-in model reading text with the "
        "byte tokenizer (its ids are the bytes 0-255)"
    ],
    "bad-storage-size-zero.yaml": ["spec.checkpoint.storageSize: checkpoint.storageSize must be more than 0"],
    "bad-memory-tiny.yaml": [
        "spec.resources.memory: resources.memory must be at least 512Mi: each of a worker's processes takes about "
        "300 MB before it trains (Python and torch)",
        "spec.resources.shmSize: resources.shmSize must be more than 0 and at most 64Ti (more memory than any node "
        "has)",
    ],
    "bad-metrics-port-rendezvous.yaml": [
        "spec.metricsPort: metricsPort to metricsPort + processes per worker - 1 must leave out 29500, the port the "
        "workers meet on (MASTER_PORT)"
    ],
    "bad-namespace.yaml": ["metadata.namespace: must be a lowercase DNS label (a-z, 0-9, '-')"],
    "bad-nan-free-form.yaml": ["spec.deepspeed.config.gradient_clipping: must be a finite number"],
    "bad-workers.yaml": ["spec.workers: must be >= 1"],
    "bad-zero-stage.yaml": ["spec.deepspeed.zeroStage: must be <= 3"],
    "bad-deepspeed-with-ddp.yaml": ["spec.deepspeed: deepspeed options need strategy 'deepspeed'"],
    "bad-precision.yaml": ["spec.precision: must be one of 'fp32', 'bf16' or 'fp16'"],
    "bad-unknown-field.yaml": ["spec.checkpoint.evrySteps: unknown field"],
    "bad-heads.yaml": ["spec.model.nHeads: model.dModel must be divisible by model.nHeads"],
    "bad-kind.yaml": ["apiVersion: must be kubetrain.io/v1alpha1", "kind: must be TrainingJob"],
    "bad-offload.yaml": ["spec.deepspeed.offloadParam: deepspeed.offloadParam needs zeroStage 3"],
    "bad-name.yaml": ["metadata.name: must be a lowercase DNS label (a-z, 0-9, '-')"],
    "bad-type.yaml": ["spec.maxSteps: must be an integer"],
    "bad-fp16-deepspeed-cpu.yaml": [
        "spec.precision: precision fp16 with strategy deepspeed needs GPUs (DeepSpeed has no fp16 on CPU); use bf16"
    ],
    "bad-args-without-command.yaml": [ARGS_LINE],
    "bad-command-empty-with-args.yaml": [ARGS_LINE],
    "bad-ephemeral-with-claim.yaml": [
        "spec.checkpoint.ephemeral: checkpoint.ephemeral cannot be combined with checkpoint.claimName "
        "(a claim is durable storage): drop one"
    ],
    "bad-missing-spec.yaml": ["spec: required"],
    "bad-int64.yaml": ["spec.workers: must fit in 64 bits"],
    "bad-infinite.yaml": ["spec.optimizer.lr: must be a finite number"],
    "bad-string-bool.yaml": ["spec.suspend: must be true or false"],
    "bad-string-number.yaml": ["spec.maxSteps: must be an integer"],
    "bad-name-digit.yaml": [
        "metadata.name: must start with a letter (it is also the name of the job's Service, a DNS-1035 label)"
    ],
    "bad-name-dot.yaml": ["metadata.name: must be a lowercase DNS label (a-z, 0-9, '-')"],
    "bad-pod-name.yaml": ["spec.workers: must be <= 10000"],
    "bad-cpu.yaml": ["spec.resources.cpu: must be a Kubernetes quantity (e.g. 500m, 16, 128Gi)"],
    "bad-queue.yaml": [
        "spec.scheduling.queue: must be a label value: letters, digits, '-', '_' or '.', "
        "starting and ending with a letter or digit"
    ],
    "bad-env-without-name.yaml": ["spec.env[0]: needs a name (a non-empty string)"],
    "bad-deadline.yaml": ["spec.activeDeadlineSeconds: must be <= 31536000"],
    "bad-backoff.yaml": ["spec.restartPolicy.maxBackoffSeconds: must be <= 86400.0"],
    "bad-backoff-limit.yaml": ["spec.restartPolicy.backoffLimit: must be <= 1000"],
    "bad-metrics-port.yaml": [
        "spec.metricsPort: metricsPort + processes per worker - 1 must be <= 65535 "
        "(each process serves metrics on the next port)"
    ],
    "bad-claim-name.yaml": ["spec.checkpoint.claimName: must be a lowercase DNS subdomain (a-z, 0-9, '-', '.')"],
    "bad-not-utf8.yaml": ["(file): not UTF-8 text (byte 110)"],
    "bad-deep.yaml": ["spec.podTemplate: nested more than 100 levels deep"],
    "bad-checkpoint-dir-relative.yaml": [
        "spec.checkpoint.dir: must be an absolute path (pods mount the checkpoint volume there)"],
    "bad-checkpoint-dir-dotdot.yaml": [
        "spec.checkpoint.dir: checkpoint.dir must be a normal path: no '.' or '..' segments and no '//'"],
    "bad-checkpoint-dir-root.yaml": [SYSTEM_DIR_LINE],
    "bad-pod-template-owned.yaml": [
        "spec.podTemplate.metadata.annotations[kubetrain.io/progress]: kubetrain.io/ annotations are kubetrain's own",
        "spec.podTemplate.spec.nodeName: would bypass the scheduler and any queue: use scheduling.nodeSelector or "
        "podTemplate.spec.affinity"],
    "bad-pod-template-shape.yaml": ["spec.podTemplate.spec: must be a mapping"],
    "bad-checkpoint-dir-etc.yaml": [SYSTEM_DIR_LINE],
    "bad-sexagesimal.yaml": ["spec.workers: must be an integer"],
    "bad-duplicate-key.yaml": [
        "spec.workers: duplicate key (line 7): kubectl refuses a mapping that sets a key twice"],
    "bad-tag.yaml": [
        "spec.image: tag !!binary (line 5) is not one of YAML's core tags (!!str, !!int, !!float, !!bool, !!null, "
        "!!map, !!seq): YAML readers disagree on what the others mean"],
    "bad-list-item.yaml": ["items[1].spec.workers: must be >= 1"],
    "bad-generate-name.yaml": [
        "metadata.generateName: must start with a lowercase letter and hold only a-z, 0-9 and '-' (the API server "
        "appends 5 random characters to make the name, a DNS-1035 label)"],
    "bad-env-name.yaml": ["spec.env[0]: name 'A=B' is not a variable name: printable ASCII characters other than '='"],
    "bad-env-reserved.yaml": [RESERVED_ENV_LINE],
    "bad-image.yaml": [IMAGE_LINE],
    "bad-labels.yaml": [
        "metadata.labels: key 'cost center' must be a label key: an optional DNS subdomain and '/', then a name of "
        "letters, digits, '-', '_' or '.' (at most 253 and 63 characters)"],
    "bad-annotations-size.yaml": [
        "metadata.annotations: must total at most 262144 bytes, keys and values (the API server's limit); these take "
        "278841"],
    "bad-tensor-procs.yaml": [TENSOR_PROCS_LINE],
    "bad-tensor-gpus.yaml": [TENSOR_PROCS_LINE],
    "bad-tensor-heads.yaml": [
        "spec.parallelism.tensor: parallelism.tensor must divide model.nHeads (each process computes whole attention "
        "heads)"],
    "bad-tensor-deepspeed.yaml": [TENSOR_STRATEGY_LINE],
    "bad-tensor-powersgd.yaml": [TENSOR_STRATEGY_LINE],
    "bad-tensor-zero.yaml": ["spec.parallelism.tensor: must be >= 1"],
    "bad-pipeline-world.yaml": [PIPELINE_WORLD_LINE],
    "bad-pipeline-layers.yaml": [
        "spec.parallelism.pipeline: parallelism.pipeline must be at most model.nLayers (each stage runs at least one "
        "block)"],
    "bad-pipeline-microbatches.yaml": [PIPELINE_MICROBATCHES_LINE],
    "bad-pipeline-ddp.yaml": [PIPELINE_STRATEGY_LINE],
    "bad-pipeline-hf.yaml": [
        "spec.parallelism.pipeline: parallelism.pipeline > 1 runs the built-in model only: model.hfPath and hfUri "
        "models cannot be split into stages yet"],
    "bad-pipeline-fp16.yaml": [
        "spec.parallelism.pipeline: parallelism.pipeline > 1 needs precision fp32 or bf16: the pipeline schedule runs "
        "the backward passes itself, without fp16's loss scaling"],
    "bad-pipeline-schedule.yaml": [
        "spec.parallelism.pipelineSchedule: must be one of 'GPipe', '1F1B' or 'Interleaved1F1B'"],
    "bad-pipeline-interleaved.yaml": [PIPELINE_INTERLEAVED_LINE],
    "bad-gpu-in-extra.yaml": [
        "spec.resources.extra: resources.extra cannot set nvidia.com/gpu, cpu, memory: use resources.gpusPerWorker "
        "(it also sets the processes per worker), resources.cpu and resources.memory"],
}


def test_every_broken_manifest_is_covered():
    assert sorted(p.name for p in MANIFESTS.glob("bad-*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_broken_manifest_exits_2_with_field_path(name, capsys):
    assert main(["validate", str(MANIFESTS / name)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"{MANIFESTS / name}: {line}" for line in EXPECTED[name]]


@pytest.mark.parametrize("path", sorted((REPO / "examples").rglob("*.yaml")), ids=lambda p: str(p.relative_to(REPO / "examples")))
def test_examples_are_valid(path, capsys):
    kind = next((k for k in ("TrainingSweep", "ClusterTrainingRuntime") if f"\nkind: {k}\n" in path.read_text()),
                "TrainingJob")
    assert main(["validate", str(path)]) == 0
    assert f"valid {kind}" in capsys.readouterr().out


def test_several_problems_in_one_manifest_are_all_reported(tmp_path, capsys):
    f = tmp_path / "many.yaml"
    f.write_text(
        "apiVersion: kubetrain.io/v1alpha1\nkind: TrainingJob\nmetadata: {name: many}\n"
        "spec: {workers: -1, maxSteps: 0, optimizer: {lr: 0}}\n"
    )
    assert main(["validate", str(f)]) == 2
    err = capsys.readouterr().err
    assert "spec.workers: must be >= 1" in err
    assert "spec.maxSteps: must be >= 1" in err
    assert "spec.optimizer.lr: must be > 0.0" in err


def test_not_yaml_and_missing_file(tmp_path, capsys):
    f = tmp_path / "broken.yaml"
    f.write_text("spec: [unclosed\n")
    assert main(["validate", str(f), str(tmp_path / "absent.yaml")]) == 2
    err = capsys.readouterr().err
    assert "not valid YAML" in err
    assert "absent.yaml: cannot read" in err


HEADER = "apiVersion: kubetrain.io/v1alpha1\nkind: TrainingJob\nmetadata: {name: edge}\n"
HOSTILE = {
    "random-bytes.yaml": random.Random(7).randbytes(4096),
    "ten-megabytes.yaml": HEADER.encode() + b"spec: {image: '" + b"x" * 10_000_000 + b"'}\n",
    "nul-byte.yaml": HEADER.encode() + b"spec: {image: \"a\x00b\"}\n",
    "nested-flow.yaml": HEADER.encode() + b"spec: {podTemplate: " + b"[" * 20_000 + b"]" * 20_000 + b"}\n",
    "self-alias.yaml": HEADER.encode() + b"spec: {podTemplate: &a {spec: [*a]}}\n",
    "alias-bomb.yaml": HEADER.encode() + b"a: &a [x, x, x, x, x, x, x, x, x, x]\n"
    + b"".join(b"%c: &%c [*%c, *%c, *%c, *%c, *%c, *%c, *%c, *%c, *%c, *%c]\n" % ((c, c) + (c - 1,) * 10)
               for c in range(ord("b"), ord("k"))),
    "huge-integer.yaml": HEADER.encode() + b"spec: {maxSteps: " + b"9" * 5000 + b"}\n",
    "bad-timestamp-tag.yaml": HEADER.encode() + b"spec: {image: !!timestamp nope}\n",
    "python-tag.yaml": HEADER.encode() + b"spec: !!python/object:os.system {}\n",
    "tab-indent.yaml": HEADER.encode() + b"spec:\n\tworkers: 2\n",
    "empty.yaml": b"",
    "list.yaml": b"- 1\n- 2\n",
    "odd-key.yaml": HEADER.encode() + b"spec: {2020-01-01: d}\n",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_no_input_gives_a_traceback_only_exit_2_and_one_line(name, tmp_path, capsys):
    f = tmp_path / name
    f.write_bytes(HOSTILE[name])
    assert main(["validate", str(f)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"{f}: "), err


def test_a_directory_is_a_read_error(tmp_path, capsys):
    assert main(["validate", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"{tmp_path}: cannot read")


def test_numbers_are_read_as_kubectl_reads_them(tmp_path):
    """`3e-4` is a number (PyYAML alone reads a string), 2.0 an integer, as the API server decodes them."""
    f = tmp_path / "numbers.yaml"
    f.write_text(HEADER + "spec: {workers: 2.0, maxSteps: 1e3, optimizer: {lr: 3e-4, minLr: 1e-5}, image: 2024-01-01}\n")
    spec = load_job(f).spec
    assert (spec.workers, spec.max_steps, spec.optimizer.lr, spec.optimizer.min_lr) == (2, 1000, 3e-4, 1e-5)
    assert spec.image == "2024-01-01"


def test_nulls_are_dropped_as_the_api_server_prunes_them(tmp_path):
    f = tmp_path / "nulls.yaml"
    f.write_text(HEADER + "spec: {workers: null, restartPolicy: {backoffSeconds: ~}}\n")
    spec = load_job(f).spec
    assert spec.workers == 1 and spec.restart_policy.backoff_seconds == 5.0


@pytest.mark.parametrize(("env", "expected"), [
    ("[{name: A, value: '1'}, {name: B, valueFrom: {fieldRef: {fieldPath: metadata.name}}}]", None),
    ("[{name: A, value: 1}]", "spec.env[0]: value must be a string"),
    ("[{name: '', value: a}]", "spec.env[0]: needs a name (a non-empty string)"),
    ("[{name: A, valueFrom: x}]", "spec.env[0]: valueFrom must be a mapping"),
    ("[{name: A, vaule: a}]", "spec.env[0]: unknown field vaule (an EnvVar has name, value and valueFrom)"),
])
def test_env_entries_are_core_v1_env_vars(env, expected, tmp_path, capsys):
    f = tmp_path / "env.yaml"
    f.write_text(HEADER + f"spec: {{env: {env}}}\n")
    assert main(["validate", str(f)]) == (2 if expected else 0)
    err = capsys.readouterr().err.splitlines()
    assert err == ([f"{f}: {expected}"] if expected else [])


@pytest.mark.parametrize(("quantity", "ok"), [
    ("500m", True), ("16", True), ("1.5", True), (".5", True), ("128Gi", True), ("1e3", True), ("2E", True),
    ("lots", False), ("1 Gi", False), ("-1", False), ("1GB", False), ("", False),
])
def test_cpu_is_a_kubernetes_quantity(quantity, ok, tmp_path, capsys):
    f = tmp_path / "cpu.yaml"
    f.write_text(HEADER + f"spec: {{resources: {{cpu: '{quantity}'}}}}\n")
    assert main(["validate", str(f)]) == (0 if ok else 2)


@pytest.mark.parametrize(("quantity", "ok"), [
    ("512Mi", True), ("536870912", True), ("0.5Gi", True), ("1e12", True), ("2E", True),
    ("511Mi", False), ("16", False), ("1", False), ("500m", False), ("lots", False), ("1GB", False),
])
def test_memory_is_a_quantity_a_worker_can_start_in(quantity, ok):
    doc = yaml.safe_load(HEADER + f"spec: {{resources: {{memory: '{quantity}'}}}}\n")
    assert (problems_of(doc) == []) == ok


@pytest.mark.parametrize(("name", "ok"), [
    ("NCCL_DEBUG", True), ("my.var-1", True), ("1ST", True), ("Logging:LogLevel", True), ("a b", True),
    ("KUBETRAIN_FAIL_AT", True), ("KUBETRAIN_DIST_TIMEOUT_SECONDS", True), ("KUBETRAIN_PEAK_FLOPS", True),
    ("A=B", False), ("=", False), ("tab\there", False), ("é", False),
])
def test_env_names_are_what_the_api_server_takes_in_a_pod(name, ok):
    """Printable ASCII but '=' (Kubernetes >= 1.32); the knobs meant for spec.env stay open."""
    doc = yaml.safe_load(HEADER + "spec: {}\n")
    doc["spec"]["env"] = [{"name": name, "value": "1"}]
    assert (problems_of(doc) == []) == ok


@pytest.mark.parametrize("name", api.RESERVED_ENV)
def test_the_worker_contracts_variables_are_kubetrains_own(name):
    doc = yaml.safe_load(HEADER + "spec: {}\n")
    doc["spec"]["env"] = [{"name": name, "value": "1"}]
    assert [str(p) for p in problems_of(doc)] == [RESERVED_ENV_LINE]


@pytest.mark.parametrize("resource", api.OWN_RESOURCES)
def test_extra_resources_cannot_override_the_ones_with_a_field_of_their_own(resource):
    doc = yaml.safe_load(HEADER + "spec: {resources: {cpu: '2', memory: 4Gi}}\n")
    doc["spec"]["resources"]["extra"] = {resource: "0", "rdma/ib": "1"}
    assert [str(p) for p in problems_of(doc)] == [EXPECTED["bad-gpu-in-extra.yaml"][0]]
    del doc["spec"]["resources"]["extra"][resource]
    assert problems_of(doc) == []


def test_env_holds_at_most_1000_variables():
    doc = yaml.safe_load(HEADER + "spec: {}\n")
    doc["spec"]["env"] = [{"name": f"V{i}", "value": "1"} for i in range(api.MAX_ENV_VARS + 1)]
    assert [str(p) for p in problems_of(doc)] == ["spec.env: must have at most 1000 items"]


DIGEST = "sha256:" + "0123456789abcdef" * 4


@pytest.mark.parametrize(("image", "ok"), [
    ("ghcr.io/kubetrain/trainer:0.1.0", True), ("kubetrain/trainer:test", True), (f"localhost:5000/x@{DIGEST}", True),
    (f"ghcr.io/kubetrain/trainer:0.1.0@{DIGEST}", True), ("trainer", True), ("pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime", True),
    ("My.Registry.io:5000/team/a__b/c-d:Tag_1", True), ("[::1]:5000/x:1", True), ("2024-01-01", True),
    ("Kubetrain/Trainer", False), ("trainer latest", False), ("trainer:latest; rm -rf /", False), ("$(id)", False),
    ("trainer:", False), ("a//b", False), ("x@sha256:abc", False), (" trainer", False), ("", False),
    ("a/" + "b" * 1030, False),
])
def test_images_are_oci_references(image, ok, tmp_path):
    doc = yaml.safe_load(HEADER + "spec: {fabric: tcpx}\n")
    doc["spec"]["image"] = image
    problems = problems_of(doc)
    assert [p.path for p in problems] == ([] if ok else ["spec.image"])
    if image and len(image) < 1024:
        assert [str(p) for p in problems[:1]] == ([] if ok else [IMAGE_LINE])
    runtime = {"apiVersion": api.API_VERSION, "kind": "ClusterTrainingRuntime", "metadata": {"name": "gpu"},
               "spec": {"image": image, "fabric": "tcpx", "fabricOptions": {"daemonImage": image}}}
    assert [p.path for p in problems_of(runtime)] == ([] if ok else ["spec.image", "spec.fabricOptions.daemonImage"])


def test_the_daemon_images_kubetrain_defaults_to_are_references():
    assert re.fullmatch(api.IMAGE_PATTERN, fabrics.TCPX_DAEMON_IMAGE)
    assert re.fullmatch(api.IMAGE_PATTERN, fabrics.TCPXO_DAEMON_IMAGE)


@pytest.mark.parametrize(("metadata", "line"), [
    ({"labels": {"app.kubernetes.io/name": "x", "k": "", "v": "a" * 63}}, None),
    ({"labels": {"a" * 253 + "/k": "v"}}, None),
    ({"labels": {"a" * 254 + "/k": "v"}}, "metadata.labels: key '" + "a" * 254 + "/k' must be a label key"),
    ({"labels": {"k" * 64: "v"}}, "metadata.labels: key '" + "k" * 64 + "' must be a label key"),
    ({"labels": {"a/b/c": "v"}}, "metadata.labels: key 'a/b/c' must be a label key"),
    ({"labels": {"k": "v" * 64}}, "metadata.labels: the value of 'k' must be empty or at most 63 characters"),
    ({"labels": {"k": "-v"}}, "metadata.labels: the value of 'k' must be empty or at most 63 characters"),
    ({"annotations": {"Example.COM/Note": "x" * (api.MAX_ANNOTATIONS_BYTES - 16)}}, None),  # keys in any case
    ({"annotations": {"Example.COM/Note": "x" * (api.MAX_ANNOTATIONS_BYTES - 15)}},
     "metadata.annotations: must total at most 262144 bytes"),
    ({"annotations": {"note": "é" * (api.MAX_ANNOTATIONS_BYTES // 2)}}, "metadata.annotations: must total at most"),
    ({"annotations": {"bad key": "x"}}, "metadata.annotations: key 'bad key' must be a label key"),
])
def test_labels_and_annotations_keep_the_api_servers_limits(metadata, line):
    doc = yaml.safe_load(HEADER + "spec: {}\n")
    doc["metadata"].update(metadata)
    lines = [str(p) for p in problems_of(doc)]
    assert lines == [] if line is None else (len(lines) == 1 and lines[0].startswith(line)), lines


def test_an_empty_command_without_args_is_the_built_in_trainer(tmp_path):
    f = tmp_path / "command.yaml"
    f.write_text(HEADER + "spec: {command: []}\n")
    spec = load_job(f).spec
    assert spec.command == [] and spec.runs_launcher  # the built-in trainer runs its own launcher


@pytest.mark.parametrize(("spec", "line"), [
    ("{strategy: fsdp, workers: 3, procsPerWorker: 4, parallelism: {tensor: 4}}", None),  # one group per worker
    ("{strategy: fsdp, workers: 2, procsPerWorker: 4, parallelism: {tensor: 2}}", None),  # two groups per worker
    ("{strategy: fsdp, resources: {gpusPerWorker: 2}, parallelism: {tensor: 2}}", None),  # procs from the GPUs
    ("{strategy: ddp, parallelism: {tensor: 1}}", None),  # T=1: data parallelism only, any strategy
    # a model.hfPath model's head counts are in its config (the trainer checks them), not model.nHeads (4)
    ("{strategy: fsdp, procsPerWorker: 8, model: {hfPath: /models/llama}, parallelism: {tensor: 8}}", None),
    ("{strategy: fsdp, procsPerWorker: 8, parallelism: {tensor: 8}}",
     "spec.parallelism.tensor: parallelism.tensor must divide model.nHeads (each process computes whole attention heads)"),
    ("{strategy: fsdp, workers: 4, parallelism: {tensor: 2}}", TENSOR_PROCS_LINE),  # world 4, but across workers
    ("{strategy: fsdp, procsPerWorker: 6, parallelism: {tensor: 4}}", TENSOR_PROCS_LINE),
    ("{strategy: ddp, procsPerWorker: 2, parallelism: {tensor: 2}}", TENSOR_STRATEGY_LINE),
])
def test_tensor_parallel_layouts(spec, line, tmp_path, capsys):
    """T divides a worker's processes (so the world too) and the built-in model's heads; T > 1 only with FSDP2."""
    _validate_layout(spec, line, tmp_path, capsys)


@pytest.mark.parametrize(("spec", "line"), [
    ("{strategy: fsdp, workers: 2, gradientAccumulationSteps: 2, parallelism: {pipeline: 2}}", None),
    ("{strategy: fsdp, workers: 2, procsPerWorker: 2, gradientAccumulationSteps: 2, parallelism: {pipeline: 2}}", None),
    ("{strategy: fsdp, workers: 2, parallelism: {pipeline: 2, pipelineSchedule: GPipe}}", None),  # any micro-batches
    ("{strategy: fsdp, workers: 4, gradientAccumulationSteps: 8, model: {nLayers: 4}, parallelism: {pipeline: 4}}",
     None),
    ("{strategy: fsdp, workers: 2, procsPerWorker: 2, gradientAccumulationSteps: 2, "
     "parallelism: {pipeline: 2, tensor: 2}}", None),  # P=2 x T=2: a stage per worker, split over its processes
    ("{strategy: fsdp, workers: 2, gradientAccumulationSteps: 4, model: {nLayers: 4}, "
     "parallelism: {pipeline: 2, pipelineSchedule: Interleaved1F1B}}", None),  # stages 0, 2 | 1, 3
    ("{strategy: fsdp, workers: 2, gradientAccumulationSteps: 4, model: {nLayers: 3}, "
     "parallelism: {pipeline: 2, pipelineSchedule: Interleaved1F1B}}", PIPELINE_INTERLEAVED_LINE),  # 4 stages > 3
    ("{strategy: fsdp, workers: 3, gradientAccumulationSteps: 2, parallelism: {pipeline: 2}}", PIPELINE_WORLD_LINE),
    ("{strategy: fsdp, workers: 3, procsPerWorker: 2, gradientAccumulationSteps: 2, "
     "parallelism: {pipeline: 2, tensor: 2}}", PIPELINE_WORLD_LINE),  # world 6, T x P 4
    ("{strategy: fsdp, workers: 2, parallelism: {pipeline: 2}}", PIPELINE_MICROBATCHES_LINE),  # 1F1B, 1 micro-batch
    ("{strategy: deepspeed, workers: 2, gradientAccumulationSteps: 2, parallelism: {pipeline: 2}}",
     PIPELINE_STRATEGY_LINE),
])
def test_pipeline_parallel_layouts(spec, line, tmp_path, capsys):
    """P x T divides the world, P <= the blocks, 1F1B has >= P micro-batches; P > 1 only with FSDP2 (and T)."""
    _validate_layout(spec, line, tmp_path, capsys)


REPLICATE_WORLD_LINE = ("spec.parallelism.replicate: parallelism.replicate must divide the data-parallel processes: "
                        "world size (workers x processes per worker) / (parallelism.tensor x parallelism.pipeline); "
                        "HSDP shards within each of the R groups")
REPLICATE_STRATEGY_LINE = ("spec.parallelism.replicate: parallelism.replicate > 1 (HSDP) needs strategy fsdp: ddp "
                           "replicates the whole model already, and deepspeed shards over all processes")


@pytest.mark.parametrize(("spec", "line"), [
    ("{strategy: fsdp, workers: 2, procsPerWorker: 4, parallelism: {replicate: 2}}", None),  # a group per worker
    ("{strategy: fsdp, workers: 4, procsPerWorker: 2, parallelism: {replicate: 2}}", None),
    ("{strategy: fsdp, workers: 2, procsPerWorker: 4, parallelism: {replicate: 2, tensor: 2}}", None),
    ("{strategy: fsdp, workers: 2, procsPerWorker: 2, gradientAccumulationSteps: 2, "
     "parallelism: {replicate: 2, pipeline: 2}}", None),  # 2 data ranks per stage, each its own group
    ("{strategy: fsdp, workers: 2, procsPerWorker: 2, gradientAccumulationSteps: 2, "
     "parallelism: {replicate: 4, pipeline: 2}}", REPLICATE_WORLD_LINE),  # 4 groups of 2 data ranks
    ("{strategy: fsdp, workers: 3, procsPerWorker: 2, parallelism: {replicate: 4}}", REPLICATE_WORLD_LINE),
    ("{strategy: fsdp, workers: 2, procsPerWorker: 2, parallelism: {replicate: 4, tensor: 2}}", REPLICATE_WORLD_LINE),
    ("{strategy: ddp, workers: 2, parallelism: {replicate: 2}}", REPLICATE_STRATEGY_LINE),
    ("{strategy: deepspeed, workers: 2, parallelism: {replicate: 2}}", REPLICATE_STRATEGY_LINE),
])
def test_hsdp_layouts(spec, line, tmp_path, capsys):
    """R divides world / (T x P); R > 1 only with FSDP2."""
    _validate_layout(spec, line, tmp_path, capsys)


@pytest.mark.parametrize(("spec", "line"), [
    ("{compile: true}", None),  # ddp, bf16
    ("{compile: true, strategy: fsdp, precision: fp16, activationCheckpointing: true}", None),
    ("{compile: true, strategy: fsdp, procsPerWorker: 2, parallelism: {tensor: 2}}", None),
    ("{compile: true, strategy: fsdp, workers: 2, gradientAccumulationSteps: 2, parallelism: {pipeline: 2}}", None),
    ("{compile: true, strategy: fsdp, model: {hfPath: /models/llama}}", None),
    ("{compile: true, strategy: deepspeed, deepspeed: {zeroStage: 3}}", None),
    ("{compile: true, command: [python, train.py]}",
     "spec.compile: compile applies to the built-in trainer: a custom command compiles its own model (drop compile "
     "or command)"),
])
def test_compile_combinations(spec, line, tmp_path, capsys):
    """compile runs with every strategy (tensor and pipeline parallelism, every precision, hfPath models), not with
    a custom command, whose model is its own."""
    _validate_layout(spec, line, tmp_path, capsys)


def _validate_layout(spec, line, tmp_path, capsys):
    f = tmp_path / "tp.yaml"
    f.write_text(HEADER + f"spec: {spec}\n")
    assert main(["validate", str(f)]) == (0 if line is None else 2)
    out = capsys.readouterr()
    assert out.err.strip().splitlines() == ([] if line is None else [f"{f}: {line}"])
