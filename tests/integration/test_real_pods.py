"""Real pods: the trainer image on the test cluster's real node (kubelet + containerd), driven by
the operator, with checkpoints on a claim from the cluster's default StorageClass.

What only real pods show: rendezvous through the headless Service's DNS name, SIGTERM from a pod
deletion, the progress annotation written with the pod's own ServiceAccount token through the
`kubernetes` Service, a gang restart that finds the previous generation's checkpoints on the claim,
and a pull failure reported by the kubelet.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from support import helm_image
from support import helm_tool as ht
from support import prom_server as ps
from support.cluster import kubeconfig_path
from support.hf_models import bpe_tokenizer, tiny_causal_lm
from support.kubectl import kubectl
from support.operator_process import OperatorProcess
from support.paths import EXAMPLE_DATA, QUICKSTART, REPO_ROOT
from support.real_pods import (
    NODE_NAME,
    REGISTRY,
    TRAINER_IMAGE,
    RealJobs,
    claim_dir,
    cluster_bucket,
    cluster_object_store,
    elapsed,
    pod_memory_peak,
    pod_monitor_targets,
    progress_step,
    quickstart,
    rank_beat,
    store_keys,
    throttle_pod_cpu,
    trainer_ranks,
    wait_step,
)
from support.waiting import wait_for

from kubetrain.core import contract, hangs
from kubetrain.trainer.checkpoint.fence import FENCE_FILE

pytestmark = pytest.mark.integration

# fp32 and more steps than the quickstart: slow enough to interrupt, exact enough to compare.
RESUMABLE = {"precision": "fp32", "maxSteps": 120, "checkpoint": {"everySteps": 10, "keep": 3},
             "restartPolicy": {"backoffLimit": 3, "backoffSeconds": 1}}


@pytest.fixture(scope="module")
def operator(crd: None, real_node: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    """The operator from this checkout, cluster-wide, putting the real trainer image into pods."""
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    with OperatorProcess(kubeconfig_path(), log, trainer_image=TRAINER_IMAGE) as op:
        yield op


@pytest.fixture
def jobs(admin_api: client.ApiClient, real_namespace: str, operator: OperatorProcess) -> RealJobs:
    return RealJobs(admin_api, real_namespace)


def losses(log: str) -> list[float]:
    """The loss values rank 0 logged, in order."""
    return [float(m) for m in re.findall(r"loss[= :]+([0-9]+\.[0-9]+)", log)]


def test_quickstart_unchanged_trains_on_real_pods(jobs: RealJobs, real_namespace: str) -> None:
    start = time.monotonic()
    kubectl("apply", "-n", real_namespace, "-f", str(QUICKSTART))
    st = jobs.wait_phase("quickstart", "Succeeded", timeout=900)
    print(f"quickstart Succeeded in {elapsed(start)} s: step {st.get('currentStep')}, loss {st.get('loss')}")
    assert st["currentStep"] == 60 and st.get("restartCount", 0) == 0
    assert st.get("resumedFromStep", 0) == 0
    assert (st.get("lastCheckpoint") or {}).get("step") == 60
    pod = jobs.core.read_namespaced_pod("quickstart-worker-0", real_namespace)
    assert pod.spec.node_name == NODE_NAME
    seen = losses(jobs.log("quickstart-worker-0"))
    assert len(seen) >= 2 and seen[-1] < 0.8 * seen[0], f"loss did not fall: {seen}"
    # The quickstart checkpoints onto a claim of the cluster's default StorageClass, not an emptyDir.
    claim = jobs.core.read_namespaced_persistent_volume_claim("quickstart-checkpoints", real_namespace)
    assert claim.status.phase == "Bound" and claim.spec.access_modes == ["ReadWriteMany"]
    assert any(v.persistent_volume_claim and v.persistent_volume_claim.claim_name == "quickstart-checkpoints"
               for v in pod.spec.volumes)


def _cli(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "kubetrain.core", *args], capture_output=True, text=True,
                          timeout=60, env={"KUBECONFIG": str(kubeconfig_path()), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_status_and_logs_come_from_the_real_pods(jobs: RealJobs, real_namespace: str) -> None:
    """Rank 0 reports progress with its pod's own ServiceAccount token through the `kubernetes` Service."""
    name = jobs.create(quickstart(**RESUMABLE), name="report")
    wait_step(jobs, name, 20)
    status = _cli("status", name, "-n", real_namespace)
    assert re.search(r"step\s*:?\s*\d+", status, re.I) and re.search(r"loss", status, re.I), status
    logs = _cli("logs", name, "-n", real_namespace, "--tail", "50")
    assert "step" in logs and "loss" in logs, logs
    annotation = jobs.core.read_namespaced_pod(f"{name}-worker-0", real_namespace).metadata.annotations
    record = json.loads(annotation["kubetrain.io/progress"])
    assert record["step"] >= 20
    jobs.wait_phase(name, "Succeeded")


REFERENCES: dict[str, float] = {}
"""Final losses of the uninterrupted local runs, by _reference_key: several tests' jobs train the same."""


def _reference_key(body: dict[str, Any], env: dict[str, str] | None) -> str:
    """What an uninterrupted local run's loss depends on. Not restartPolicy (the run asserts no restart) nor
    KUBETRAIN_FAIL_AT in spec.env (the local backend drops it; only `kubetrain run --fail-at` sets it)."""
    spec = {k: v for k, v in body["spec"].items() if k != "restartPolicy"}
    spec["env"] = [e for e in spec.get("env") or [] if e.get("name") != "KUBETRAIN_FAIL_AT"]
    return json.dumps({"name": body["metadata"]["name"], "spec": spec, "env": env or {}}, sort_keys=True)


def _start_reference(tmp_path: Path, body: dict[str, Any], env: dict[str, str] | None = None) -> Callable[[], float]:
    """The same manifest, uninterrupted, through the local backend (same trainer code and torch), started now,
    beside the job (``env`` added to its environment): what waits for its final loss. A manifest already run this
    session is not run again."""
    key = _reference_key(body, env)
    if key in REFERENCES:
        return lambda: REFERENCES[key]
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(body))
    (tmp_path / "data").symlink_to(EXAMPLE_DATA)
    summary = tmp_path / "summary.json"
    proc = subprocess.Popen([sys.executable, "-m", "kubetrain.core", "run", str(tmp_path / "job.yaml"), "--fresh",
                             "-q", "--output-dir", str(tmp_path / "run"), "--summary-json", str(summary)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})

    def final_loss() -> float:
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, out[-2000:] + err[-2000:]
        result = json.loads(summary.read_text())
        assert result["restarts"] == 0
        REFERENCES[key] = float(result["final_loss"])
        return REFERENCES[key]

    return final_loss


def _ends_on_the_reference_loss(jobs: RealJobs, name: str, reference: Callable[[], float], what: str) -> None:
    """The job's final loss (worker 0's last progress report) equals the uninterrupted run's within 1e-5."""
    pod = jobs.core.read_namespaced_pod(f"{name}-worker-0", jobs.ns)
    final = float(json.loads(pod.metadata.annotations["kubetrain.io/progress"])["loss"])
    expected = reference()
    print(f"{what}: final loss {final!r} (resumed) vs {expected!r} (uninterrupted, local), "
          f"relative difference {abs(final - expected) / expected:.2e}")
    assert math.isclose(final, expected, rel_tol=1e-5), (final, expected)


@pytest.mark.parametrize("how", ["force-delete", "exit-137", "exit-137-in-place"])
def test_killed_worker_resumes_from_the_claim(jobs: RealJobs, real_namespace: str, tmp_path: Path,
                                              how: str) -> None:
    body = quickstart(**RESUMABLE)
    in_place = how != "exit-137"  # the default for the built-in trainer; exit-137 recreates both pods
    if how.startswith("exit-137"):  # rank 2 (worker 1's only process) exits 137 at step 35, once
        body["spec"]["env"] = [{"name": "KUBETRAIN_FAIL_AT", "value": "1:35"}]
    if how == "exit-137":
        body["spec"]["restartPolicy"] = {**RESUMABLE["restartPolicy"], "inPlace": False}
    name = jobs.create(body, name=f"resume-{how}")
    reference = _start_reference(tmp_path, body)  # beside the job (the first of the three; the others reuse it)
    jobs.wait(name, lambda st: st.get("phase") == "Running", 300, "Running")
    uids = {p.metadata.name: p.metadata.uid for p in jobs.pods(name)}
    if how == "force-delete":
        wait_step(jobs, name, 30)
        kubectl("delete", "pod", "-n", real_namespace, f"{name}-worker-1", "--grace-period=0", "--force")
    if in_place:  # worker 0's pod runs both generations; with exit-137-in-place, so does worker 1's
        _wait_for_lines(jobs, name, {"worker-0": "starting generation 1 in place (was 0)"} | (
            {"worker-1": "generation 0 failed in this pod before this container restarted"}
            if how == "exit-137-in-place" else {}))
    st = jobs.wait_phase(name, "Succeeded", timeout=900)
    resumed = st.get("resumedFromStep", 0)
    print(f"{how}: restarts {st['restartCount']}, resumed from step {resumed}, final loss {st.get('loss')}")
    assert st["restartCount"] == 1 and resumed >= 30, jobs.describe(name)
    now = {p.metadata.name: p for p in jobs.pods(name)}
    kept = now[f"{name}-worker-0"].metadata.uid == uids[f"{name}-worker-0"]
    recreated = now[f"{name}-worker-1"].metadata.uid != uids[f"{name}-worker-1"]
    assert (kept, recreated) == (in_place, how != "exit-137-in-place"), jobs.describe(name)
    if how == "exit-137-in-place":  # the kubelet restarted worker 1's container in its pod
        assert now[f"{name}-worker-1"].status.container_statuses[0].restart_count == 1, jobs.describe(name)
    _ends_on_the_reference_loss(jobs, name, reference, how)


def _wait_for_lines(jobs: RealJobs, name: str, lines: dict[str, str]) -> None:
    """Each worker's pod log says its line, read while the job runs: once it finishes, cleanPodPolicy deletes
    a pod whose container has not yet exited, and its log with it."""
    for worker, line in lines.items():
        pod = f"{name}-{worker}"
        wait_for(lambda pod=pod, line=line: line in jobs.log(pod), 600, interval=1,
                 what=f"{worker}'s log to say {line!r}")


def test_a_worker_killed_in_place_resumes_from_the_memory_tier(jobs: RealJobs, real_namespace: str,
                                                               tmp_path: Path) -> None:
    """Worker 1 exits 137 after step 35 (KUBETRAIN_FAIL_AT): both pods are kept, each rank's /dev/shm holds step 30
    of checkpoint.memory while the claim's newest checkpoint is step 20, and the gang resumes from memory at 30,
    ending on the uninterrupted run's loss."""
    start = time.monotonic()
    body = quickstart(precision="fp32", maxSteps=40, preflight={"enabled": False},
                      checkpoint={"everySteps": 20, "keep": 2, "memory": {"everySteps": 10}},
                      restartPolicy={"backoffLimit": 3, "backoffSeconds": 1})
    body["spec"]["env"] = [{"name": "KUBETRAIN_FAIL_AT", "value": "1:35"}]
    name = jobs.create(body, name="memory-tier")
    reference = _start_reference(tmp_path, body)  # beside the job: its workers share this machine's cores
    jobs.wait(name, lambda st: st.get("phase") == "Running", 300, "Running")
    uids = {p.metadata.name: p.metadata.uid for p in jobs.pods(name)}
    st = jobs.wait_phase(name, "Succeeded", timeout=600)
    fields = {k: st.get(k) for k in ("restartCount", "resumedFrom", "resumedFromStep", "currentStep", "loss")}
    fields["lastCheckpoint"] = (st.get("lastCheckpoint") or {}).get("step")
    print(f"memory tier: Succeeded in {elapsed(start)} s: {json.dumps(fields)}")
    assert (st["restartCount"], st.get("resumedFrom"), st.get("resumedFromStep")) == (1, "memory", 30), \
        _memory_tier_lines(jobs, name) + " || " + jobs.describe(name)
    assert {p.metadata.name: p.metadata.uid for p in jobs.pods(name)} == uids  # both pods ran both generations
    assert "Resumed:     from step 30 (memory tier)" in _cli("status", name, "-n", real_namespace)
    assert "resumed from the memory tier (/dev/shm/kubetrain-ckpt) (step 30)" in jobs.log(f"{name}-worker-0")
    _ends_on_the_reference_loss(jobs, name, reference, "memory tier")


def _memory_tier_lines(jobs: RealJobs, name: str) -> str:
    """The memory tier's lines of every pod's log on one line (rank 0's writes kept, any rank's warnings)."""
    return " / ".join(line[-160:] for pod in jobs.pods(name) for line in jobs.log(pod.metadata.name).splitlines()
                      if "memory tier" in line or "checkpoint.memory" in line)


@pytest.mark.parametrize(("example", "fail_at"), [("tensor-parallel", "2:25"), ("pipeline-parallel", "3:25")])
def test_a_parallel_layout_two_by_two_resumes_exactly_after_a_kill(jobs: RealJobs, tmp_path: Path, example: str,
                                                                    fail_at: str) -> None:
    """examples/tensor-parallel.yaml (T=2 x data 2: each worker's 2 processes split every block, FSDP2 over the
    workers) and examples/pipeline-parallel.yaml (P=2 x data 2: worker 0 runs the first stage, worker 1 the
    last, FSDP2 over each worker's processes) on real pods; one rank of worker 1 exits 137 after step 25, once.
    The gang restarts in place, resumes (each rank holding only its part of the state, in memory and on the
    claim), Succeeds, and ends on the loss of the same manifest run uninterrupted."""
    start = time.monotonic()
    body = yaml.safe_load((REPO_ROOT / "examples" / f"{example}.yaml").read_text())
    reference = _start_reference(tmp_path, body)  # beside the job, without the injected failure
    body["spec"]["env"] = [{"name": "KUBETRAIN_FAIL_AT", "value": fail_at}]
    name = jobs.create(body, name=example)
    st = jobs.wait_phase(name, "Succeeded", timeout=900)
    fields = {k: st.get(k) for k in ("restartCount", "resumedFrom", "resumedFromStep", "currentStep", "failures")}
    print(f"{example} 2 x data 2: Succeeded in {elapsed(start)} s: {json.dumps(fields)}")
    assert st["restartCount"] == 1 and st["resumedFromStep"] >= 20 and st["failures"] == {"ExitCode": 1}, \
        jobs.describe(name)
    # A pipeline's last stage computes the loss; the step's all-reduce gives it to worker 0, which reports it.
    _ends_on_the_reference_loss(jobs, name, reference, example)


def test_a_hugging_face_trainer_script_resumes_from_its_newest_committed_checkpoint(jobs: RealJobs) -> None:
    """examples/hf-trainer/job.yaml (transformers.Trainer with kubetrain's callback, 2 workers, the script and
    text shipped in the trainer image) with a drill: rank 1 exits 137 after step 13, once. Status shows step
    and loss while it trains; the gang resumes from checkpoint-10, the newest committed, and Succeeds."""
    start = time.monotonic()
    body = yaml.safe_load((REPO_ROOT / "examples" / "hf-trainer" / "job.yaml").read_text())
    body["spec"]["env"] = [{"name": "KUBETRAIN_FAIL_AT", "value": "1:13"}]
    name = jobs.create(body, name="hf-trainer")
    running = jobs.wait(name, lambda st: st.get("currentStep", 0) >= 3 and st.get("loss"), 600, "step and loss")
    print(f"hf-trainer: while training: step {running['currentStep']}, loss {running['loss']}")
    st = jobs.wait_phase(name, "Succeeded", timeout=900)
    fields = {k: st.get(k) for k in ("restartCount", "resumedFromStep", "currentStep", "maxSteps", "loss", "failures")}
    fields["lastCheckpoint"] = (st.get("lastCheckpoint") or {}).get("step")
    print(f"hf-trainer: Succeeded in {elapsed(start)} s: {json.dumps(fields)}")
    assert (st["restartCount"], st["resumedFromStep"], st["currentStep"], fields["lastCheckpoint"]) == (1, 10, 40, 40), \
        jobs.describe(name)
    # Every rank that finished exits 0: not 134 from gloo's abort in interpreter teardown, which would restart
    # a finished gang whenever it came before worker 0's exit.
    codes = wait_for(lambda: _exit_codes(jobs, name), 60, what="both workers' exit codes")
    print(f"hf-trainer: workers' exit codes {codes}")
    assert codes == {"hf-trainer-worker-0": 0, "hf-trainer-worker-1": 0}, jobs.describe(name)


def _exit_codes(jobs: RealJobs, name: str) -> dict[str, int] | None:
    """Each worker pod's trainer exit code, once every one has terminated."""
    codes = {}
    for pod in jobs.pods(name):
        done = [c.state.terminated for c in pod.status.container_statuses or [] if c.state.terminated]
        if not done:
            return None
        codes[pod.metadata.name] = done[0].exit_code
    return codes


def test_checkpoints_in_the_object_store_resume_from_the_newest_committed_one(
        jobs: RealJobs, real_namespace: str, tmp_path: Path) -> None:
    """checkpoint.uri on the test cluster's object store (S3Proxy), no claim, the memory tier off. Worker 1's rank
    exits 137 after step 30, before that step's save: worker 0 uploads its part of step 30, which never gets
    COMMITTED. The gang resumes from step 20, the newest committed, deletes the torn step 30, and ends on the
    loss of the same job run uninterrupted (on a local directory)."""
    start = time.monotonic()
    endpoint, fs = cluster_object_store(real_namespace)
    with cluster_bucket(fs, "ckpt") as bucket:
        reference = _start_reference(tmp_path, quickstart(**RESUMABLE))
        body = quickstart(**RESUMABLE)
        body["spec"]["checkpoint"].update(uri=f"s3://{bucket}/job", memory={"enabled": False})
        body["spec"]["s3"] = {"endpoint": endpoint, "credentialsSecret": "kubetrain-s3"}
        body["spec"]["env"] = [{"name": "KUBETRAIN_FAIL_AT", "value": "1:30"}]
        name = jobs.create(body, name="object-store")
        st = jobs.wait_phase(name, "Succeeded", timeout=600)
        fields = {k: st.get(k) for k in ("restartCount", "resumedFrom", "resumedFromStep", "currentStep", "failures")}
        durable = next(c for c in st["conditions"] if c["type"] == "CheckpointsDurable")
        keys = fs.find(f"{bucket}/job", refresh=True)  # objects only: some stores list emptied folders as well
        steps = sorted({k.split("/")[2] for k in keys if k.split("/")[2] != FENCE_FILE})  # the fence beside them
        committed = sorted(k.split("/")[2] for k in keys if k.endswith("/COMMITTED"))
        print(f"object store: Succeeded in {elapsed(start)} s: {json.dumps(fields)}; {durable['reason']}: "
              f"{durable['message']}; bucket: {steps}")
        assert (st["restartCount"], st.get("resumedFrom"), st.get("resumedFromStep")) == (1, "durable", 20), \
            jobs.describe(name)
        assert durable["status"] == "True" and durable["reason"] == "ObjectStore"
        assert not jobs.core.list_namespaced_persistent_volume_claim(real_namespace).items  # no claim at all
        # keep 3 of the committed steps 20 ... 120; nothing of the torn step 30 is left
        assert steps == committed == ["step-00000100", "step-00000110", "step-00000120"], keys
        assert f"{bucket}/job/{FENCE_FILE}" in keys, keys  # the fence, named by the job's uid
        _ends_on_the_reference_loss(jobs, name, reference, "object store")


def _upload_model_tokenizer_and_shards(fs: Any, bucket: str, tmp_path: Path) -> None:
    """A tiny Llama, a BPE tokenizer trained on the example text, and that text tokenized into 4 `.bin` shards
    (uint16), under s3://bucket/{model,tokenizer,tokens}."""
    import numpy as np  # noqa: PLC0415
    import tokenizers  # noqa: PLC0415

    texts = sorted(EXAMPLE_DATA.glob("*.txt"))
    vocab = bpe_tokenizer(tmp_path / "tokenizer", texts)
    tiny_causal_lm(tmp_path / "model", vocab_size=vocab, max_position_embeddings=128)
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer" / "tokenizer.json"))
    ids = np.concatenate([np.asarray(tok.encode(t.read_text()).ids, dtype=np.uint16) for t in texts])
    (tmp_path / "tokens").mkdir()
    for i, part in enumerate(np.array_split(ids, 4)):
        part.tofile(tmp_path / "tokens" / f"shard-{i:03d}.bin")
    for what in ("model", "tokenizer", "tokens"):
        fs.put(str(tmp_path / what), f"{bucket}/{what}", recursive=True)


def test_data_model_and_tokenizer_from_the_object_store_train_and_resume_exactly(
        jobs: RealJobs, real_namespace: str, tmp_path: Path) -> None:
    """model.hfUri (a tiny Llama), data.tokenizerUri and data.uri (token shards) on the test cluster's object store.
    Each worker pod's init container fetches the model and the tokenizer into its cache (status.fetch: every byte);
    each rank streams shards of its own. Worker 1's rank exits 137 after step 25, once: the gang resumes and ends on
    the loss of the same manifest run uninterrupted by `kubetrain run` (which fetches and streams the same way)."""
    start = time.monotonic()
    endpoint, fs = cluster_object_store(real_namespace)
    with cluster_bucket(fs, "data") as bucket:
        _upload_model_tokenizer_and_shards(fs, bucket, tmp_path / "upload")
        body = quickstart(precision="fp32", maxSteps=40, activationCheckpointing=False,
                          checkpoint={"everySteps": 10, "keep": 2},
                          restartPolicy={"backoffLimit": 3, "backoffSeconds": 1},
                          model={"hfUri": f"s3://{bucket}/model", "seqLen": 64},
                          data={"uri": f"s3://{bucket}/tokens", "glob": "*.bin",
                                "tokenizerUri": f"s3://{bucket}/tokenizer"},
                          s3={"endpoint": endpoint, "credentialsSecret": "kubetrain-s3"})
        reference = _start_reference(tmp_path / "reference", body, env=store_keys(real_namespace))
        body["spec"]["env"] = [{"name": "KUBETRAIN_FAIL_AT", "value": "1:25"}]
        name = jobs.create(body, name="from-store")
        st = jobs.wait_phase(name, "Succeeded", timeout=900)
        fields = {k: st.get(k) for k in ("restartCount", "resumedFrom", "resumedFromStep", "currentStep", "fetch")}
        print(f"from the object store: Succeeded in {elapsed(start)} s: {json.dumps(fields)}")
        assert st["restartCount"] == 1 and st["resumedFromStep"] >= 20, jobs.describe(name)
        assert st["fetch"]["done"] and st["fetch"]["bytes"] == st["fetch"]["totalBytes"] > 0, st["fetch"]
        pod = jobs.core.read_namespaced_pod(f"{name}-worker-1", real_namespace)
        fetch = next(c for c in pod.status.init_container_statuses if c.name == contract.FETCH_CONTAINER)
        assert fetch.state.terminated.exit_code == 0, fetch
        _ends_on_the_reference_loss(jobs, name, reference, "from the object store")


def finetune_guide(bucket: str, endpoint: str) -> dict[str, Any]:
    """examples/finetune/job.yaml (docs/guide-finetune.md) at this machine's scale: its bucket here, 2 CPU workers
    without a fabric, a tiny model's sequence length and a few steps. Its strategy, HSDP, chat data, LoRA, evaluation,
    checkpoints and export stay as the guide has them."""
    body = yaml.safe_load((REPO_ROOT / "examples" / "finetune" / "job.yaml").read_text())
    spec = body["spec"]
    spec.update(workers=2, resources={}, fabric="none", precision="fp32", microBatchSize=2, maxSteps=6,
                evalEverySteps=3, s3={"endpoint": endpoint, "credentialsSecret": "kubetrain-s3"})
    spec["parallelism"]["replicate"] = 2  # one group a worker, as the guide's 4
    spec["model"].update(hfUri=f"s3://{bucket}/model", seqLen=96)
    spec["data"].update(uri=f"s3://{bucket}/chat", tokenizerUri=f"s3://{bucket}/model")
    spec["checkpoint"].update(uri=f"s3://{bucket}/ckpt", everySteps=3)
    return body


def test_the_fine_tuning_guide_reads_and_writes_the_object_store_and_exports_there(
        jobs: RealJobs, real_namespace: str, tmp_path: Path) -> None:
    """The guide's manifest on real pods: a tiny Llama with a ChatML tokenizer (model.hfUri), chat JSONL (data.uri),
    LoRA under HSDP on 2 workers, checkpoints in checkpoint.uri and export.huggingFace: status.export names
    `<checkpoint.uri>/export`, and what is there loads with from_pretrained and differs from the base in the adapted
    projections only."""
    import transformers  # noqa: PLC0415
    from support.hf_models import chat_tokenizer  # noqa: PLC0415

    start = time.monotonic()
    endpoint, fs = cluster_object_store(real_namespace)
    with cluster_bucket(fs, "tune") as bucket:
        model = tmp_path / "model"
        vocab = chat_tokenizer(model, sorted(EXAMPLE_DATA.glob("*.txt")))
        tiny_causal_lm(model, vocab_size=vocab, max_position_embeddings=128)
        fs.put(str(model), f"{bucket}/model", recursive=True)
        fs.put(str(REPO_ROOT / "examples" / "data-chat" / "chat.jsonl"), f"{bucket}/chat/chat.jsonl")
        name = jobs.create(finetune_guide(bucket, endpoint))
        st = jobs.wait_phase(name, "Succeeded", timeout=900)
        print(f"the fine-tuning guide at small scale: Succeeded in {elapsed(start)} s, eval loss {st.get('evalLoss')}, "
              f"export {st.get('export')}")
        assert st.get("export") == f"s3://{bucket}/ckpt/export", jobs.describe(name)
        assert st.get("evalLoss") is not None
        fs.get(f"{bucket}/ckpt/export", str(tmp_path / "export"), recursive=True)
        base = transformers.AutoModelForCausalLM.from_pretrained(str(model)).state_dict()
        tuned = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "export")).state_dict()
        changed = {n for n in base if not (tuned[n] == base[n]).all()}
        assert changed and all(n.endswith("proj.weight") for n in changed), sorted(changed)
        assert (tmp_path / "export" / "adapter" / "adapter_model.safetensors").is_file()
        assert (tmp_path / "export" / "tokenizer_config.json").is_file()


@pytest.mark.parametrize("fault", ["checkpoint-bucket", "model-credentials", "image-without-trainer"])
def test_what_no_restart_cures_fails_the_job_once_naming_the_field(jobs: RealJobs, real_namespace: str,
                                                                   fault: str) -> None:
    """No restart cures a bucket that does not exist (checkpoint.uri: the trainer finds it), keys the store
    refuses (model.hfUri: the init container `fetch` finds it) or a custom image without kubetrain's trainer
    package (the fetch cannot run in it): the job fails at once (no restart), with the configuration error
    naming the field (and the URI) in its status and a Warning Event."""
    endpoint, fs = cluster_object_store(real_namespace)
    with cluster_bucket(fs, "model") as bucket:
        uri = f"s3://{bucket}/model"
        if fault == "checkpoint-bucket":  # a store may create a missing bucket on a write: none must be written
            uri = f"s3://no-such-{bucket}/job"
            body = quickstart(checkpoint={"uri": uri}, s3={"endpoint": endpoint, "credentialsSecret": "kubetrain-s3"})
            said, named = f"checkpoint.uri: {uri}: the bucket does not exist", uri
        elif fault == "model-credentials":
            fs.pipe(f"{bucket}/model/config.json", b"{}")
            kubectl("create", "secret", "generic", "wrong-keys", "-n", real_namespace,
                    "--from-literal=AWS_ACCESS_KEY_ID=not-a-key", "--from-literal=AWS_SECRET_ACCESS_KEY=not-a-secret")
            body = quickstart(model={"hfUri": uri}, s3={"endpoint": endpoint, "credentialsSecret": "wrong-keys"})
            said, named = f"model.hfUri: {uri}: the credentials were refused", uri
        else:
            body = quickstart(model={"hfUri": uri}, s3={"endpoint": endpoint, "credentialsSecret": "kubetrain-s3"},
                              image=helm_image.names()["operator"], command=["python3", "-c", "pass"])
            said, named = "spec.image: the worker's image cannot run kubetrain.trainer.data.fetch", "spec.image"
        name = jobs.create(body, name=fault)
        st = jobs.wait_phase(name, "Failed", timeout=300)
        if fault == "checkpoint-bucket":
            # Asked, not created by a first write (ListBuckets: s3fs's exists() asks GetBucketLocation, which
            # S3Proxy answers for any name).
            assert f"no-such-{bucket}" not in [b["Name"] for b in fs.call_s3("list_buckets")["Buckets"]]
    print(f"{fault}: {st.get('reason')}: {st.get('message')}")
    assert (st["reason"], st.get("restartCount", 0)) == ("PermanentError", 0), jobs.describe(name)
    assert f"exited with code 2 (configuration error: {said}" in st["message"], st["message"]
    wait_for(lambda: [e for e in jobs.events(name) if e.type == "Warning" and named in (e.message or "")], 30,
             what=f"a Warning Event naming {named}")  # recorded after the status that says it


def test_sigterm_checkpoints_and_the_next_generation_resumes_there(jobs: RealJobs, real_namespace: str) -> None:
    name = jobs.create(quickstart(**{**RESUMABLE, "checkpoint": {"everySteps": 1000}}), name="graceful")
    wait_for(lambda: progress_step(jobs.core, real_namespace, name) >= 15, 300, what="rank 0 at step >= 15")
    kubectl("delete", "pod", "-n", real_namespace, f"{name}-worker-0", "--wait=false")
    st = jobs.wait(name, lambda s: s.get("restartGeneration", 0) >= 1 and s.get("resumedFromStep", 0) > 0, 300,
                   "the next generation resumed")
    resumed = st["resumedFromStep"]
    # With checkpoints every 1000 steps the only one before step 120 is the one written on SIGTERM, at the
    # step the gang had reached (>= 15 when the pod was deleted); generation 1 resumed from exactly it.
    assert 15 <= resumed < 120
    log = jobs.log(f"{name}-worker-0")  # generation 1's worker 0
    assert f"resumed from /checkpoints/step-{resumed:08d} (step {resumed})" in log, log[-2000:]
    st = jobs.wait_phase(name, "Succeeded")
    assert st["resumedFromStep"] == resumed and st["restartCount"] == 1


def test_missing_image_is_reported_within_60s(jobs: RealJobs) -> None:
    """The node asks the test cluster's registry, which has no such repository (404)."""
    name = jobs.create(quickstart(image=f"{REGISTRY}/no-such-image:0"), name="noimage")
    start = time.monotonic()
    st = jobs.wait(name, lambda s: any(c.get("type") == "WorkersBlocked" and c.get("status") == "True"
                                       and c.get("reason") == "ImagePullFailed"
                                       for c in s.get("conditions") or []), 60, "WorkersBlocked: ImagePullFailed")
    cond = next(c for c in st["conditions"] if c["type"] == "WorkersBlocked")
    print(f"pull failure reported after {elapsed(start)} s: {cond['reason']}: {cond['message']}")
    assert "noimage-worker-" in cond["message"] and "no-such-image" in cond["message"]
    def warned() -> list[str]:  # the Event is recorded just after the status write that shows the condition
        events = jobs.core.list_namespaced_event(jobs.ns, field_selector=f"involvedObject.name={name}").items
        return [e.message for e in events if e.reason == "ImagePullFailed" and e.type == "Warning"]

    wait_for(warned, 15, what="the ImagePullFailed Warning Event")


def test_prometheus_scrapes_workers_on_their_pod_ips_as_the_podmonitor_selects(
        jobs: RealJobs, real_namespace: str, tmp_path: Path) -> None:
    monitor = ht.find(ht.render(set_values={"metrics.podMonitor.enabled": True}), "PodMonitor")
    endpoint = monitor["spec"]["podMetricsEndpoints"][0]
    targets = tmp_path / "targets.json"
    targets.write_text("[]")
    scrape = {"job_name": monitor["metadata"]["name"], "honor_labels": endpoint["honorLabels"],
              "metrics_path": endpoint["path"], "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "1s"}]}
    prom = ps.start_or_skip(tmp_path, [scrape])
    try:
        name = jobs.create(quickstart(**RESUMABLE), name="scraped")
        query = f'kubetrain_trainer_step{{trainingjob="{name}"}}'

        def scraped() -> bool:
            targets.write_text(json.dumps(pod_monitor_targets(monitor, jobs.core, real_namespace)))
            return len(prom.finite(query)) == 2

        jobs.wait(name, lambda _: scraped(), 300, "both workers scraped")
        ips = {p.status.pod_ip for p in jobs.pods(name)}
        series = prom.finite(query)
        print("scraped:", [(s["metric"]["instance"], s["value"][1]) for s in series], "pod IPs:", ips)
        assert {s["metric"]["instance"].rsplit(":", 1)[0] for s in series} == ips
        # Labelled from the pod (jobLabel, the namespace), not from the process: honorLabels is off
        assert all(s["metric"]["job"] == name and s["metric"]["namespace"] == real_namespace for s in series)
        jobs.wait_phase(name, "Succeeded")
    finally:
        prom.__exit__()


def test_deepspeed_zero3_on_real_pods(jobs: RealJobs) -> None:
    body = quickstart(strategy="deepspeed", deepspeed={"zeroStage": 3}, precision="fp32", maxSteps=30,
                      checkpoint={"everySteps": 10})
    body["spec"].pop("fsdp", None)
    name = jobs.create(body, name="zero3")
    st = jobs.wait_phase(name, "Succeeded", timeout=900)
    assert st["currentStep"] == 30 and (st.get("lastCheckpoint") or {}).get("step") == 30
    seen = losses(jobs.log(f"{name}-worker-0"))
    assert seen and seen[-1] < seen[0], seen


SHARDED_MODEL = {"dModel": 512, "nLayers": 32, "nHeads": 8, "seqLen": 128}
"""101.2M parameters: 386 MiB of fp32 weights, what one more whole copy per process adds."""
SHARDED_POD_MEMORY_MIB = 2560
"""Each worker pod's memory limit. Measured on the real node with a 4 GiB limit, the pods of this job peaked at
2079-2091 MiB (their cgroups' max usage; each rank 1.15 GiB resident: runtime, a quarter of the parameters,
gradients and AdamW moments, one block's buffers). One more whole fp32 copy per process would need 2 x 386 MiB
more (2.8 GiB); the trainer that built the whole model first peaked at 4.3x the weights per process (bench/
memory_per_rank.py), about 4.9 GiB per pod."""


def test_a_model_sharded_from_the_first_byte_fits_pods_that_a_whole_copy_would_not(jobs: RealJobs) -> None:
    """2 workers x 2 processes of FSDP2 under a pod memory limit below what one more whole fp32 copy per process
    needs: the model is built on the meta device and each process materialises only its shards."""
    body = quickstart(procsPerWorker=2, precision="fp32", microBatchSize=1, gradientAccumulationSteps=1,
                      maxSteps=4, activationCheckpointing=True, model=SHARDED_MODEL,
                      checkpoint={"everySteps": 1000, "keep": 1}, resources={"memory": f"{SHARDED_POD_MEMORY_MIB}Mi"})
    name = jobs.create(body, name="sharded")
    peaks: dict[str, int] = {}

    def done() -> dict[str, Any] | None:
        for pod in jobs.pods(name):
            peak = pod_memory_peak(pod.metadata.uid)
            peaks[pod.metadata.name] = max(peaks.get(pod.metadata.name, 0), peak or 0)
        st = jobs.status(name)
        if st.get("phase") == "Failed":
            raise AssertionError(f"{name} Failed: {st.get('reason')}: {st.get('message')}")
        return st if st.get("phase") == "Succeeded" else None

    st = wait_for(done, 900, interval=0.5, what=f"{name} Succeeded under {SHARDED_POD_MEMORY_MIB} MiB per pod")
    print(f"sharded: Succeeded under a {SHARDED_POD_MEMORY_MIB} MiB limit per pod; pod peaks (MiB) "
          f"{ {k: v // 2**20 for k, v in sorted(peaks.items())} }; status.memory {json.dumps(st.get('memory'))}")
    assert st.get("restartCount", 0) == 0 and st["currentStep"] == 4, st  # no worker OOMKilled and restarted
    assert peaks and max(peaks.values()) <= SHARDED_POD_MEMORY_MIB * 2**20
    ranks = (st.get("memory") or {}).get("ranks") or []
    assert len(ranks) == 4, st.get("memory")  # every rank's own peak in the job's status


def test_custom_command_two_by_two_on_real_pods(jobs: RealJobs, real_namespace: str) -> None:
    """spec.command with procsPerWorker 2: the launcher from the job's ConfigMap starts 2 ranks per pod."""
    script = (REPO_ROOT / "tests" / "e2e" / "ddp_script.py").read_text()
    jobs.core.create_namespaced_config_map(real_namespace, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="ddp-script"), data={"ddp_script.py": script}))
    body = quickstart(procsPerWorker=2, command=["python", "/scripts/ddp_script.py"], args=["4", "1"],
                      podTemplate={"spec": {"volumes": [{"name": "scripts", "configMap": {"name": "ddp-script"}}],
                                            "containers": [{"name": "trainer", "volumeMounts": [
                                                {"name": "scripts", "mountPath": "/scripts"}]}]}})
    name = jobs.create(body, name="custom")
    st = jobs.wait_phase(name, "Succeeded", timeout=900)
    assert st.get("restartCount", 0) == 0
    logs = jobs.log(f"{name}-worker-0") + jobs.log(f"{name}-worker-1")
    ranks = sorted(set(re.findall(r"start rank=(\d)", logs)))
    assert ranks == ["0", "1", "2", "3"], logs[-3000:]
    assert "snapshot epoch=4" in logs and logs.count("done rank=") == 4, logs[-3000:]


def test_a_script_shipped_with_workdir_changes_without_an_image_build(jobs: RealJobs, real_namespace: str,
                                                                      tmp_path: Path) -> None:
    """`kubetrain submit FILE --workdir DIR`: the pod runs DIR's script in a copy of DIR (a relative command, a
    relative file and a local module); the script edited and the job submitted again runs the new one."""
    from support.trainer_harness import run_cli  # noqa: PLC0415

    work = tmp_path / "work"
    (work / "helpers").mkdir(parents=True)
    (work / "helpers" / "__init__.py").write_text("")
    (work / "helpers" / "say.py").write_text("def say(text):\n    print('shipped:', text, flush=True)\n")
    (work / "train.py").write_text("from helpers.say import say\nsay(open('message.txt').read().strip())\n")
    manifest = tmp_path / "job.yaml"
    body = quickstart(workers=1, command=["python", "train.py"])
    body["metadata"]["name"] = "shipped"
    manifest.write_text(yaml.safe_dump(body))
    seen = []
    for version in ("v1", "v2"):
        (work / "message.txt").write_text(f"script {version}\n")
        done = run_cli(["submit", str(manifest), "--workdir", str(work), "-n", real_namespace],
                       env={"KUBECONFIG": str(kubeconfig_path())})
        assert done.returncode == 0, done.stderr
        jobs.wait_phase("shipped", "Succeeded", timeout=300)
        shipped = jobs.get("shipped")["spec"]["workdir"]["configMap"]
        owners = jobs.core.read_namespaced_config_map(shipped, real_namespace).metadata.owner_references
        assert [o.uid for o in owners] == [jobs.get("shipped")["metadata"]["uid"]]
        assert f"shipped: script {version}" in jobs.log("shipped-worker-0"), jobs.describe("shipped")
        seen.append(shipped)
        jobs.custom.delete_namespaced_custom_object("kubetrain.io", "v1alpha1", real_namespace, "trainingjobs",
                                                    "shipped")
        wait_for(lambda: not jobs.pods("shipped") and "shipped" not in [
            o["metadata"]["name"] for o in jobs.custom.list_namespaced_custom_object(
                "kubetrain.io", "v1alpha1", real_namespace, "trainingjobs")["items"]], 120, what="the job and its pods gone")
    assert seen[0] != seen[1]  # a new tree is a new ConfigMap; the running job's is never edited


@pytest.mark.parametrize("procs", [1, 2])
def test_a_command_that_cannot_be_found_fails_at_once_with_127(jobs: RealJobs, procs: int) -> None:
    """procsPerWorker 1: runc cannot exec it (StartError); 2: the launcher cannot. Both are exit 127,
    a permanent failure: no gang restart."""
    name = jobs.create(quickstart(command=["no-such-command"], procsPerWorker=procs), name=f"nocmd-{procs}")
    st = jobs.wait_phase(name, "Failed", timeout=180)
    print(f"procs {procs}: {st['reason']}: {st['message']}")
    assert st.get("restartCount", 0) == 0 and "127" in st["message"], st


def test_ephemeral_checkpoints_with_two_workers_train_and_say_so(jobs: RealJobs) -> None:
    """Each pod keeps its own part in its emptyDir: the job runs, and says from the start that a
    gang restart would begin again at step 0."""
    name = jobs.create(quickstart(checkpoint={"ephemeral": True, "everySteps": 20}), name="ephemeral")
    st = jobs.wait_phase(name, "Succeeded", timeout=600)
    cond = next(c for c in st["conditions"] if c["type"] == "CheckpointsDurable")
    assert (cond["status"], cond["reason"]) == ("False", "EphemeralCheckpoints")
    assert st["currentStep"] == 60
    assert not jobs.core.list_namespaced_persistent_volume_claim(jobs.ns).items


def test_a_sidecar_that_never_exits_does_not_hold_the_job(jobs: RealJobs) -> None:
    """Success is judged from the trainer container's exit, not the pod phase: a sidecar keeps the pod
    Running after the trainer is done, and the job still succeeds (cleanPodPolicy then removes the pod)."""
    sidecar = {"name": "sidecar", "image": TRAINER_IMAGE, "command": ["sleep", "3600"]}
    name = jobs.create(quickstart(workers=1, command=["python", "-c", "print('trained')"],
                                  podTemplate={"spec": {"containers": [sidecar]}}), name="sidecar")
    st = jobs.wait_phase(name, "Succeeded", timeout=180)
    assert st["reason"] == "Succeeded", st
    # The sidecar still runs, so cleanPodPolicy (Running) deletes its pod (it ends after its grace period).
    wait_for(lambda: all(p.metadata.deletion_timestamp for p in jobs.pods(name)), 60,
             what="the sidecar's pod deleted by cleanPodPolicy")


PATCH_ANOTHER_JOB = """
import json, os, ssl, sys, urllib.error, urllib.request
sa = "/var/run/secrets/kubernetes.io/serviceaccount/"
host = "https://%s:%s" % (os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"])
ns, token = open(sa + "namespace").read(), open(sa + "token").read()
def patch(pod, key, value):
    body = json.dumps({"metadata": {"annotations": {key: value}}}).encode()
    req = urllib.request.Request(host + "/api/v1/namespaces/%s/pods/%s" % (ns, pod), body, method="PATCH",
        headers={"Authorization": "Bearer " + token, "Content-Type": "application/merge-patch+json"})
    try:
        return urllib.request.urlopen(req, context=ssl.create_default_context(cafile=sa + "ca.crt")).status
    except urllib.error.HTTPError as err:
        return err.code
codes = {"victim": patch(sys.argv[1], "kubetrain.io/progress", '{"step": 999999}'),
         "own": patch(os.environ["KUBETRAIN_POD_NAME"], "example.com/probe", "1")}
print("patch codes", json.dumps(codes, sort_keys=True), flush=True)
sys.exit(0 if codes == {"own": 200, "victim": 403} else 3)
"""


def test_another_jobs_worker_cannot_patch_this_jobs_worker_0(jobs: RealJobs) -> None:
    """Each job's pods run as its own ServiceAccount: a worker of job `intruder` holds the right to patch its
    own worker 0 (its progress) and is refused `victim`'s, with the token the kubelet mounted in its pod."""
    victim = jobs.create(quickstart(workers=1, command=["python", "-c", "import time; time.sleep(600)"]),
                         name="victim")
    wait_for(lambda: [p for p in jobs.pods(victim) if p.status.phase == "Running"], 180, what="victim's worker Running")
    intruder = jobs.create(quickstart(workers=1, command=["python", "-c", PATCH_ANOTHER_JOB, f"{victim}-worker-0"]),
                           name="intruder")
    st = jobs.wait_phase(intruder, "Succeeded", timeout=180)
    assert st["reason"] == "Succeeded", jobs.explain(intruder)
    assert 'patch codes {"own": 200, "victim": 403}' in jobs.log(f"{intruder}-worker-0")
    pod = jobs.core.read_namespaced_pod(f"{victim}-worker-0", jobs.ns)
    assert pod.spec.service_account_name == f"{victim}-worker"
    assert "999999" not in (pod.metadata.annotations or {}).get("kubetrain.io/progress", "")


def test_preflight_names_a_worker_throttled_to_a_hundredth_of_a_cpu(jobs: RealJobs, real_namespace: str) -> None:
    """Worker 1's pod cgroup is capped at a hundredth of a CPU by the time its rank measures itself: the
    preflight before step 0 finds its compute below half the gang's median, and the job says so (both workers
    share the one real node, so the verdict tells them apart by rank and worker). Of two ranks the median is
    their mean, so the capped rank must be three times slower than its peer, whose share of the 2 cores falls
    with the suite's load: at 0.05 CPU a run at load 12 or more was not (rank 0 got about a sixth of a core)."""
    start = time.monotonic()
    name = jobs.create(quickstart(maxSteps=4, checkpoint={"everySteps": 4}), name="preflight")
    # Bound to a node first: the other lane's real-pod jobs may hold the node's CPU for minutes, and the kubelet
    # makes the pod's cgroup only once the pod is bound to it.
    pod = wait_for(lambda: (w := {p.metadata.name: p for p in jobs.pods(name)}.get(f"{name}-worker-1"))
                   and w.spec.node_name and w, 600, interval=0.2, what="worker 1's pod bound to a node")
    print(f"worker 1's pod bound to {pod.spec.node_name} after {elapsed(start)} s")
    # Its start (torch's import) at a fifth of a CPU, which leaves the test a second or more to see its first
    # heartbeat, written before it joins the gang; the least quota cgroups allow (1 ms in 100 ms) from there
    # until rank 0 logs the preflight's figures; then the rest of the run uncapped.
    uid = pod.metadata.uid
    throttle_pod_cpu(uid, 0.2, timeout=120)
    [rank] = wait_for(lambda: trainer_ranks(uid), 120, interval=0.05, what="worker 1's trainer rank")
    wait_for(lambda: rank_beat(rank, 1), 120, interval=0.05, what="rank 1's first heartbeat")
    throttle_pod_cpu(uid, 0.01)
    print(f"rank 1 capped at 0.01 CPU after {elapsed(start)} s")
    wait_for(lambda: "preflight: 2 rank(s)" in jobs.log(f"{name}-worker-0"), 240, interval=0.5,
             what="rank 0's preflight line")
    throttle_pod_cpu(uid, None)
    print(f"cap lifted after {elapsed(start)} s")
    st = jobs.wait(name, lambda st: st.get("preflight"), 300, "status.preflight")
    pf = st["preflight"]
    [cond] = [c for c in st["conditions"] if c["type"] == "NodeDegraded"]
    print(f"preflight after {elapsed(start)} s: {json.dumps(pf)}\nNodeDegraded: {cond['message']}")
    assert (pf["worldSize"], pf["degradedRanks"], pf["slowestRank"]) == (2, [1], 1)
    assert [(r["rank"], r["worker"], r["node"]) for r in pf["ranks"]] == [(0, 0, NODE_NAME), (1, 1, NODE_NAME)]
    assert (cond["status"], cond["reason"]) == ("True", "RankDegraded")
    assert f"rank 1 (worker 1, node {NODE_NAME}): compute" in cond["message"]
    warned = wait_for(lambda: [e for e in jobs.events(name) if e.reason == "RankDegraded"], 30, what="the Event")
    assert warned[0].type == "Warning" and warned[0].message == cond["message"]


def test_a_rank_stopped_from_the_host_is_named_with_its_stacks_and_the_gang_resumes(
        jobs: RealJobs, real_namespace: str) -> None:
    """Worker 1's rank is SIGSTOPped from the host mid-run, defaults only (hangDetection on, in-place
    restarts): worker 1's launcher sees its rank stopped and silent for hangs.STOPPED_SECONDS (not the 30 s
    minSeconds), saves its stacks on the claim and ends; the operator names rank 1 of worker 1 in
    status.lastHang and a Warning Event without waiting for worker 0 (still within its limit) and restarts the
    gang in place from the last checkpoint; the job succeeds."""
    # Checkpoints every 20 steps and the rank stopped between two, as its own heartbeat says (read from the
    # host through the process's root): a hang inside a checkpoint is given hangDetection.phaseSeconds instead.
    name = jobs.create(quickstart(**{**RESUMABLE, "maxSteps": 160, "checkpoint": {"everySteps": 20, "keep": 3}}),
                       name="hang")
    wait_for(lambda: progress_step(jobs.core, jobs.ns, name) >= 5, 300, what="rank 0 at step >= 5")
    uid = jobs.core.read_namespaced_pod(f"{name}-worker-1", real_namespace).metadata.uid
    [rank] = trainer_ranks(uid)
    beat = wait_for(lambda: rank_beat(rank, 1), 30, what="rank 1's heartbeat")

    def between_checkpoints() -> bool:
        b = json.loads(beat.read_text())
        return b["phase"] == "train" and b["step"] > 20 and 3 <= b["step"] % 20 <= 12

    wait_for(between_checkpoints, 120, interval=0.05, what="rank 1 between two checkpoints")
    os.kill(rank, signal.SIGSTOP)
    stopped = time.monotonic()
    st = jobs.wait(name, lambda s: s.get("lastHang"), 120, "status.lastHang")
    detected = elapsed(stopped)
    hang = st["lastHang"]
    print(f"hang found {detected} s after SIGSTOP at step {hang['step']}: {json.dumps(hang, indent=1)}")
    assert hang["limitSeconds"] == hangs.STOPPED_SECONDS and detected < 30, hang  # before minSeconds ends
    assert [(s["rank"], s["worker"], s["pod"], s["node"], s["where"]) for s in hang["suspects"]] == [
        (1, 1, f"{name}-worker-1", NODE_NAME, "stopped (SIGSTOP)")]
    assert hang["message"].startswith(f"rank 1 on worker 1 (pod {name}-worker-1, node {NODE_NAME}) is stopped")
    assert hang["message"].endswith("; no report from rank 0") and hang["dumps"].startswith("/checkpoints/hangs/gen-0")
    # The Event is recorded after the status that names the hang.
    [event] = wait_for(lambda: [e for e in jobs.events(name) if e.reason == "NoProgress"], 30, what="the Event")
    print(f"Event {event.type} {event.reason}: {event.message}")
    assert event.type == "Warning" and event.message.startswith(f"hung: {hang['message']}")
    st = jobs.wait_phase(name, "Succeeded", timeout=600)
    assert st["restartCount"] == 1 and st["failures"] == {"NoProgress": 1} and st["resumedFromStep"] >= 20
    saved = claim_dir(jobs.core, real_namespace, f"{name}-checkpoints") / "hangs" / "gen-0"
    stacks = {f.name: f.read_text() for f in sorted(saved.glob("rank-*.txt"))}
    print("\n".join(f"--- {n}\n" + "\n".join(t.splitlines()[:12]) for n, t in stacks.items()))
    assert list(stacks) == ["rank-1.txt"] and not list(saved.glob("fr_trace_rank_*"))  # a stopped rank writes none
    assert stacks["rank-1.txt"].startswith("rank 1: stopped (SIGSTOP) (step ")
