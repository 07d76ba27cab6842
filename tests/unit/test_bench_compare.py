"""bench/compare_lib.py: the pure parts of the operator comparison (no cluster, no timing)."""

from __future__ import annotations

import json

import compare_lib as cl  # bench/, on pytest's pythonpath (pyproject.toml)
import pytest

from kubetrain.core.api import TrainingJob


def audit(user: str, audit_id: str, verb: str, resource: str | None = "pods", stage: str = "ResponseComplete",
          t: str = "2026-11-22T14:00:10.500000Z", subresource: str | None = None, name: str = "p") -> str:
    ev = {"kind": "Event", "apiVersion": "audit.k8s.io/v1", "level": "Metadata", "auditID": audit_id,
          "stage": stage, "verb": verb, "user": {"username": user}, "requestReceivedTimestamp": t}
    if resource:
        ev["objectRef"] = {"resource": resource, "namespace": "ns", "name": name}
        if subresource:
            ev["objectRef"]["subresource"] = subresource
    return json.dumps(ev)


KT, KF = "system:serviceaccount:a:kt", "system:serviceaccount:b:kf"


def test_count_requests_dedups_stages_and_splits_by_user_and_verb():
    lines = [
        audit(KT, "1", "create"),
        audit(KT, "2", "watch", stage="ResponseStarted"),
        audit(KT, "2", "watch", stage="ResponseComplete"),  # same request, second stage
        audit(KT, "3", "patch", resource="trainingjobs", subresource="status"),
        audit(KF, "4", "create", resource="services"),
        audit("system:kube-scheduler", "5", "create", resource="bindings"),
        "",
        '{"cut short',
    ]
    counts = cl.count_requests(lines, [KT, KF])
    assert counts[KT].total == 3
    assert counts[KT].by_verb == {"create pods": 1, "watch pods": 1, "patch trainingjobs/status": 1}
    assert counts[KF].total == 1 and counts[KF].by_verb == {"create services": 1}
    assert counts[KT].summary(1) in ("create pods 1", "watch pods 1", "patch trainingjobs/status 1")


def test_count_requests_window_uses_request_received_time():
    t0 = cl.parse_time("2026-11-22T14:00:10Z")
    lines = [audit(KT, "1", "list", t="2026-11-22T14:00:09.999999Z"),
             audit(KT, "2", "create", t="2026-11-22T14:00:10.000001Z"),
             audit(KT, "3", "create", t="2026-11-22T14:00:20.5Z"),
             audit(KT, "4", "get", resource=None, t="2026-11-22T14:00:15Z").encode()]
    counts = cl.count_requests(lines, [KT], since=t0, until=t0 + 10)
    assert counts[KT].total == 2
    assert counts[KT].by_verb == {"create pods": 1, "get": 1}


def test_parse_time_is_utc_epoch():
    assert cl.parse_time("1970-01-01T00:01:00.250000Z") == pytest.approx(60.25)


def test_audit_policy_logs_only_the_operators():
    policy = cl.audit_policy([KT, KF])
    assert policy["rules"][0] == {"level": "Metadata", "users": [KT, KF]}
    assert policy["rules"][-1] == {"level": "None"}
    assert "RequestReceived" in policy["omitStages"]


def test_parse_proc_sums_process_and_children_cpu_and_reads_peak_rss():
    # pid (comm with ") " inside) state ppid ... utime=250 stime=50 cutime=100 cstime=0 (fields 14-17)
    stat = "4242 (python -m (x) y) S 1 4242 4242 0 -1 4194304 100 0 0 0 250 50 100 0 20 0 9 0 123 456 789"
    status = "Name:\tpython\nVmPeak:\t  900000 kB\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\n"
    s = cl.parse_proc(stat, status, clk_tck=100)
    assert s.cpu_s == pytest.approx(4.0)
    assert s.peak_rss_bytes == 200 * 2**20
    assert s.rss_bytes == 100 * 2**20


def test_metric_sum_adds_labelled_samples_and_ignores_lookalikes():
    text = "\n".join([
        "# HELP controller_runtime_reconcile_errors_total Total number of reconciliation errors",
        "# TYPE controller_runtime_reconcile_errors_total counter",
        'controller_runtime_reconcile_errors_total{controller="pytorchjob-controller"} 2',
        'controller_runtime_reconcile_errors_total{controller="tfjob-controller"} 1',
        "controller_runtime_reconcile_errors_total_created 1.7e9",
        'controller_runtime_reconcile_total{result="error"} 3',
    ])
    assert cl.metric_sum(text, "controller_runtime_reconcile_errors_total") == 3
    assert cl.metric_sum(text, "kubetrain_operator_reconcile_errors_total") is None


def test_ratio_is_baseline_over_ours():
    assert cl.ratio(50.0, 10.0) == "5.00x"
    assert cl.ratio(5.0, 10.0) == "0.50x"
    assert cl.ratio(None, 1.0) == "—" and cl.ratio(1.0, None) == "—"
    assert cl.ratio(0, 0) == "—" and cl.ratio(3, 0) == "∞"


def test_table_rows_ratios_and_missing_values():
    scenarios = [cl.Scenario("gang-8", 1, 8, 1), cl.Scenario("rec-4", 1, 4, 8, fail_one=True)]
    results = [
        cl.RunResult(cl.KUBETRAIN, "gang-8", 8, pods_created_s=1.0, all_running_s=2.0, cpu_s=3.0, peak_rss_mb=100.4,
                     api_requests=1200, reconcile_errors=0.0, load_before=(1.0, 2.0, 3.0)),
        cl.RunResult(cl.KUBEFLOW, "gang-8", 8, pods_created_s=4.5, all_running_s=None, cpu_s=1.5, peak_rss_mb=50.0,
                     api_requests=2400, reconcile_errors=2.0),
        cl.RunResult(cl.KUBETRAIN, "rec-4", 4, recovery_s=0.5, pods_replaced=4),
    ]
    out = cl.table(scenarios, results)
    lines = out.splitlines()
    assert lines[0].startswith("| scenario | metric | kubetrain | Kubeflow v1 |")
    second = next(i for i, line in enumerate(lines) if line.startswith("| **rec-4**"))
    row = {line.split("|")[2].strip(): [c.strip() for c in line.split("|")[3:6]] for line in lines[2:second]}
    assert row["all pods created (s)"] == ["1.0", "4.5", "4.50x"]
    assert row["all pods Running (s)"] == ["2.0", "—", "—"]
    assert row["operator CPU (s)"] == ["3.0", "1.5", "0.50x"]
    assert row["operator peak RSS (MB)"] == ["100", "50", "0.50x"]
    assert row["API requests"] == ["1,200", "2,400", "2.00x"]
    assert row["reconcile errors"][2] == ""  # no ratio for error counts
    assert row["load average at start (1/5/15 min)"][:2] == ["1.0 / 2.0 / 3.0", "—"]
    # recovery rows only where a scenario has them; the first row of a block names the scenario
    assert sum("recovery: failed" in line for line in lines) == 1
    assert sum("pods created on recovery" in line for line in lines) == 1
    assert "**gang-8** (1 job x 8 workers, 1 GPU/worker)" in out
    assert "**rec-4** (1 job x 4 workers, 8 GPU/worker, one worker fails)" in out


def test_table_with_the_minimal_creator_adds_its_column_and_each_time_as_a_multiple_of_its_own():
    scenarios = [cl.Scenario("gang-8", 1, 8, 1), cl.Scenario("rec-4", 1, 4, 8, fail_one=True)]
    results = [
        cl.RunResult(cl.KUBETRAIN, "gang-8", 8, pods_created_s=1.5, cpu_s=3.0),
        cl.RunResult(cl.KUBEFLOW, "gang-8", 8, pods_created_s=4.5, cpu_s=1.5),
        cl.RunResult(cl.CREATOR, "gang-8", 8, pods_created_s=1.0, cpu_s=0.5),
        cl.RunResult(cl.KUBETRAIN, "rec-4", 4, recovery_s=0.5, pods_replaced=4),
        cl.RunResult(cl.CREATOR, "rec-4", 4, skipped=cl.NO_CONTROLLER),
    ]
    lines = cl.table(scenarios, results).splitlines()
    assert lines[0].endswith("| Kubeflow v1 / kubetrain | minimal creator |")
    second = next(i for i, line in enumerate(lines) if line.startswith("| **rec-4**"))
    row = {line.split("|")[2].strip(): [c.strip() for c in line.split("|")[3:7]] for line in lines[2:second]}
    assert row["all pods created (s)"] == ["1.5", "4.5", "3.00x", "1.0"]
    assert row["all pods created, × creator's time"] == ["1.50x", "4.50x", "", "1.00x"]
    assert row["operator CPU (s)"] == ["3.0", "1.5", "0.50x", "0.5"]
    recovery = [line.split("|")[6].strip() for line in lines[second:]]
    assert recovery[0] == cl.NO_CONTROLLER and set(recovery[1:]) == {"n/a"}
    without = cl.table(scenarios, results[:2]).splitlines()
    assert without[0].endswith("| Kubeflow v1 / kubetrain |") and not any("creator" in line for line in without)


def test_scenarios_fit_the_fake_nodes():
    for scenarios, nodes in ((cl.FULL, cl.FULL_NODES), (cl.QUICK, cl.QUICK_NODES)):
        for sc in scenarios:
            assert sc.workers * sc.gpus <= nodes * 8, sc  # every gang fits at once
            assert sc.pods <= nodes * 110, sc
        assert sum(sc.fail_one for sc in scenarios) == 1
    assert [s.name for s in cl.FULL] == ["gang-1024", "jobs-200x8", "jobs-1000x2", "recovery-128"]


def test_manifests_describe_the_same_pods():
    sc = cl.Scenario("rec", 1, 16, 8, fail_one=True)
    tj = cl.job_manifest(cl.KUBETRAIN, sc, "ns", 0)
    job = TrainingJob.model_validate(tj)  # a valid TrainingJob
    assert (job.spec.workers, job.spec.resources.gpus_per_worker) == (16, 8)
    # recovery: checkpoints on a claim bound to a static volume, so the gang restarts in place (its default)
    assert job.spec.checkpoint.claim_name == cl.CHECKPOINT_CLAIM and job.spec.restart_policy.in_place
    assert job.spec.restart_policy.backoff_seconds == 0
    pj = cl.job_manifest(cl.KUBEFLOW, sc, "ns", 0)
    reps = pj["spec"]["pytorchReplicaSpecs"]
    assert reps["Master"]["replicas"] + reps["Worker"]["replicas"] == 16
    for r in reps.values():
        c = r["template"]["spec"]["containers"][0]
        assert c["name"] == "pytorch" and c["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert r["restartPolicy"] == "ExitCode"  # exit 137 is retryable: Kubeflow re-creates the pod
    many = cl.Scenario("many", 3, 2, 0)
    assert [cl.job_manifest(cl.KUBEFLOW, many, "ns", i)["metadata"]["name"] for i in range(3)] == [
        "job-0000", "job-0001", "job-0002"]
    assert "restartPolicy" not in cl.job_manifest(cl.KUBEFLOW, many, "ns", 0)["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert "resources" not in cl.job_manifest(cl.KUBETRAIN, many, "ns", 0)["spec"]
    assert cl.job_manifest(cl.KUBETRAIN, many, "ns", 0)["spec"]["checkpoint"] == {"ephemeral": True}  # no storage
    assert cl.victim_pod(sc) == "gang-worker-5"


def kwok_line(t: str, pod: str, msg: str = "Delete pod", level: str = "INFO") -> str:
    return json.dumps({"time": t, "level": level, "msg": msg, "pod": pod, "node": "kwok-gpu-0"})


def test_unrequested_deletes_counts_kwok_deletes_nobody_asked_for():
    t = cl.parse_time
    lines = [
        kwok_line("2026-11-22T15:03:36.874000001Z", "ns/gang-worker-2"),  # asked at 36.749
        kwok_line("2026-11-22T15:03:36.970000001Z", "ns/gang-worker-2"),  # again: kills the re-created pod
        kwok_line("2026-11-22T15:03:37.750Z", "ns/gang-worker-2"),  # asked at 37.679
        kwok_line("2026-11-22T15:03:37.788Z", "ns/gang-worker-2", "failed to apply stage", "ERROR"),
        kwok_line("2026-11-22T15:03:36.800Z", "ns/gang-worker-3"),  # asked
        kwok_line("2026-11-22T15:03:36.810Z", "other/gang-worker-3"),
        kwok_line("2026-11-22T15:03:36.900Z", "ns/gang-worker-3", "Patch pod"),
        "not json",
    ]
    requested = cl.pod_requests([
        audit(KT, "1", "delete", t="2026-11-22T15:03:36.749Z", name="gang-worker-2"),
        audit(KT, "2", "delete", t="2026-11-22T15:03:37.679Z", name="gang-worker-2"),
        audit(KF, "3", "delete", t="2026-11-22T15:03:36.700Z", name="gang-worker-3").encode(),
        audit(KT, "4", "create", t="2026-11-22T15:03:36.902Z", name="gang-worker-2"),
        audit(KT, "5", "delete", resource="pods", subresource="eviction", name="gang-worker-9"),
    ], "ns")
    assert requested == {"gang-worker-2": [t("2026-11-22T15:03:36.749Z"), t("2026-11-22T15:03:37.679Z")],
                         "gang-worker-3": [t("2026-11-22T15:03:36.700Z")]}
    assert cl.unrequested_deletes(lines, "ns", requested) == 1
    assert cl.unrequested_deletes(lines, "other", {}) == 1


def test_a_kwok_delete_after_the_successor_was_created_is_unrequested():
    """A Failed pod is removed at once by the API server; kwok's one delete by name, after the operator
    re-created the worker, removes the successor."""
    t = cl.parse_time
    lines = [kwok_line("2026-11-26T20:08:35.807Z", "ns/gang-worker-5")]
    entries = [audit(KT, "1", "delete", t="2026-11-26T20:08:35.694Z", name="gang-worker-5"),
               audit(KT, "2", "create", t="2026-11-26T20:08:35.782Z", name="gang-worker-5")]
    created = cl.pod_requests(entries, "ns", verb="create")
    assert created == {"gang-worker-5": [t("2026-11-26T20:08:35.782Z")]}
    assert cl.unrequested_deletes(lines, "ns", cl.pod_requests(entries, "ns"), created) == 1
    assert cl.unrequested_deletes(lines, "ns", cl.pod_requests(entries, "ns")) == 0  # without the creates


# --------------------------------------------------------------------------- Kubeflow Trainer v2, Kubeflow v1 tuned

UPSTREAM_TORCH_RUNTIME = {  # manifests/base/runtimes/torch_distributed.yaml (trainer v2.3.0), abridged
    "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "ClusterTrainingRuntime",
    "metadata": {"name": "torch-distributed", "labels": {"trainer.kubeflow.org/framework": "torch"}},
    "spec": {"mlPolicy": {"numNodes": 1, "torch": {}}, "template": {"spec": {"replicatedJobs": [
        {"name": "node", "template": {
            "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
            "spec": {"template": {"spec": {"containers": [
                {"name": "node", "image": "pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime"}]}}}}}]}}}}


def test_trainjob_manifests_ask_for_the_same_pods_as_the_others():
    rec = cl.Scenario("rec", 1, 16, 8, fail_one=True)
    tj = cl.job_manifest(cl.TRAINER_V2, rec, "ns", 0)
    assert (tj["apiVersion"], tj["kind"], tj["metadata"]) == (
        "trainer.kubeflow.org/v1alpha1", "TrainJob", {"name": "gang", "namespace": "ns"})
    assert tj["spec"]["trainer"] == {"numNodes": 16, "resourcesPerNode": {"limits": {"nvidia.com/gpu": "8"}}}
    assert tj["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                        "name": cl.TORCH_RESTART_RUNTIME}  # recovery: the JobSet failurePolicy
    plain = cl.job_manifest(cl.TRAINER_V2, cl.Scenario("many", 3, 2, 0), "ns", 2)
    assert plain["metadata"]["name"] == "job-0002"
    assert plain["spec"]["runtimeRef"]["name"] == cl.TORCH_RUNTIME == UPSTREAM_TORCH_RUNTIME["metadata"]["name"]
    assert plain["spec"]["trainer"] == {"numNodes": 2}  # no GPU: no resources
    tuned = cl.job_manifest(cl.KUBEFLOW_TUNED, rec, "ns", 0)
    assert tuned == cl.job_manifest(cl.KUBEFLOW, rec, "ns", 0)  # the same PyTorchJob, only the flags differ
    assert set(cl.JOB_RESOURCES) == set(cl.OPERATORS) - {cl.CREATOR}
    assert cl.JOB_RESOURCES[cl.TRAINER_V2] == ("trainer.kubeflow.org", "v1alpha1", "trainjobs")


def test_training_runtimes_swap_the_image_and_add_a_restarting_copy():
    upstream = json.loads(json.dumps(UPSTREAM_TORCH_RUNTIME))
    plain, restart = cl.training_runtimes(upstream)
    assert upstream == UPSTREAM_TORCH_RUNTIME  # not modified in place

    def container(rt):
        return rt["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
            "containers"][0]

    assert container(plain) == {"name": "node", "image": cl.TRAINER_IMAGE}
    assert plain["metadata"] == UPSTREAM_TORCH_RUNTIME["metadata"]
    assert plain["spec"]["mlPolicy"] == {"numNodes": 1, "torch": {}}
    assert "failurePolicy" not in plain["spec"]["template"]["spec"]
    assert restart["metadata"]["name"] == cl.TORCH_RESTART_RUNTIME
    assert restart["spec"]["template"]["spec"]["failurePolicy"] == {"maxRestarts": cl.JOBSET_MAX_RESTARTS}
    assert restart["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["backoffLimit"] == 0
    assert container(restart) == container(plain)


def test_find_victim_matches_the_same_worker_index_under_every_operator():
    sc = cl.Scenario("rec", 1, 128, 8, fail_one=True)
    assert cl.victim_index(sc) == 5 and cl.victim_index(cl.Scenario("small", 1, 4, 8, fail_one=True)) == 2
    names = {"gang-node-0-50-abcde", "gang-node-0-5-x7k2p", "gang-node-0-4-qqqqq", "gang-worker-5"}
    assert cl.find_victim(cl.TRAINER_V2, sc, names) == "gang-node-0-5-x7k2p"
    assert cl.find_victim(cl.TRAINER_V2, sc, {"gang-node-0-50-abcde"}) is None
    assert cl.find_victim(cl.KUBETRAIN, sc, names) == "gang-worker-5"
    assert cl.find_victim(cl.KUBEFLOW_TUNED, sc, {"gang-master-0"}) is None
    assert sorted(cl.GANG_RESTART) == [cl.TRAINER_V2]  # kubetrain restarts in place


def test_kustomize_sets_namespace_and_name_prefix_like_jobset_config_default():
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "controller-manager", "namespace": "system"}}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "leader"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "leader-election-role"},
               "subjects": [{"kind": "ServiceAccount", "name": "controller-manager", "namespace": "system"},
                            {"kind": "Group", "name": "system:authenticated"}]}
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "manager-role"}}
    crd = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
           "metadata": {"name": "jobsets.jobset.x-k8s.io"}}
    assert cl.kustomize(sa, "jobset-system", "jobset-")["metadata"] == {
        "name": "jobset-controller-manager", "namespace": "jobset-system"}
    b = cl.kustomize(binding, "jobset-system", "jobset-")
    assert b["metadata"] == {"name": "jobset-leader", "namespace": "jobset-system"}
    assert b["roleRef"]["name"] == "jobset-leader-election-role"
    assert b["subjects"] == [{"kind": "ServiceAccount", "name": "jobset-controller-manager", "namespace": "jobset-system"},
                             {"kind": "Group", "name": "system:authenticated"}]
    assert cl.kustomize(role, "jobset-system", "jobset-")["metadata"] == {"name": "jobset-manager-role"}
    assert cl.kustomize(crd, "jobset-system", "jobset-")["metadata"] == crd["metadata"]
    # Trainer's base/rbac: a namespace, no prefix; a subject without a namespace gets it
    trainer = cl.kustomize({**binding, "subjects": [{"kind": "ServiceAccount", "name": "kubeflow-trainer"}]}, "kf")
    assert trainer["subjects"] == [{"kind": "ServiceAccount", "name": "kubeflow-trainer", "namespace": "kf"}]
    assert trainer["roleRef"]["name"] == "leader-election-role"
    assert binding["metadata"] == {"name": "leader"}  # inputs untouched


def test_json_patch_applies_the_upstream_webhook_patches():
    hook = {"name": "a", "clientConfig": {"service": {"name": "webhook-service", "path": "/validate"}}}
    doc = {"kind": "ValidatingWebhookConfiguration", "metadata": {"name": "validating-webhook-configuration"},
           "webhooks": [hook, {**hook, "name": "b"}]}
    out = cl.json_patch(doc, [
        {"op": "replace", "path": "/webhooks/0/clientConfig/service/name", "value": "svc"},
        {"op": "replace", "path": "/metadata/name", "value": "validator.trainer.kubeflow.org"},
        {"op": "add", "path": "/webhooks/1/objectSelector", "value": {"matchLabels": {"x": "y"}}},
        {"op": "replace", "path": "/webhooks/1", "value": {"name": "c"}},
        {"op": "add", "path": "/webhooks/-", "value": {"name": "d"}},
        {"op": "add", "path": "/metadata/annotations", "value": {"a~b/c": "1"}},
        {"op": "add", "path": "/metadata/annotations/a~1b~0", "value": "2"},
    ])
    assert out["metadata"] == {"name": "validator.trainer.kubeflow.org", "annotations": {"a~b/c": "1", "a/b~": "2"}}
    assert [h["name"] for h in out["webhooks"]] == ["a", "c", "d"]
    assert out["webhooks"][0]["clientConfig"]["service"]["name"] == "svc"
    assert doc["webhooks"][0]["clientConfig"]["service"]["name"] == "webhook-service"
    with pytest.raises(ValueError, match="unsupported"):
        cl.json_patch(doc, [{"op": "remove", "path": "/webhooks/0"}])


def test_webhooks_call_the_local_process_with_the_throwaway_ca():
    doc = {"kind": "MutatingWebhookConfiguration", "metadata": {"name": "jobset-mutating-webhook-configuration"},
           "webhooks": [{"name": "mpod.kb.io", "failurePolicy": "Fail",
                         "objectSelector": {"matchExpressions": [{"key": "jobset.sigs.k8s.io/jobset-name",
                                                                  "operator": "Exists"}]},
                         "clientConfig": {"service": {"name": "webhook-service", "namespace": "system",
                                                      "path": "/mutate--v1-pod"}}}]}
    out = cl.webhooks_to_url(doc, 4242, b"PEM")
    hook = out["webhooks"][0]
    assert hook["clientConfig"] == {"url": "https://127.0.0.1:4242/mutate--v1-pod", "caBundle": "UEVN"}
    assert hook["objectSelector"] == doc["webhooks"][0]["objectSelector"] and hook["failurePolicy"] == "Fail"


def test_controller_configs_keep_upstream_settings_but_listen_on_loopback():
    trainer = {"apiVersion": "config.trainer.kubeflow.org/v1alpha1", "kind": "Configuration",
               "health": {"healthProbeBindAddress": ":8081", "readinessEndpointName": "readyz"},
               "metrics": {"bindAddress": ":8443", "secureServing": True}, "webhook": {"port": 9443, "host": ""},
               "leaderElection": {"leaderElect": True, "resourceName": "trainer.kubeflow.org", "resourceNamespace": ""},
               "certManagement": {"enable": True, "webhookSecretName": "s"}, "clientConnection": {"qps": 50, "burst": 100}}
    out = cl.trainer_config(trainer, health=1, metrics=2, webhook=3, namespace="kubeflow-system")
    assert out["health"] == {"healthProbeBindAddress": "127.0.0.1:1", "readinessEndpointName": "readyz"}
    assert out["metrics"] == {"bindAddress": "127.0.0.1:2", "secureServing": True}
    assert out["webhook"] == {"port": 3, "host": "127.0.0.1"}
    assert out["certManagement"] == {"enable": False, "webhookSecretName": "s"}
    assert out["leaderElection"] == {"leaderElect": True, "resourceName": "trainer.kubeflow.org",
                                     "resourceNamespace": "kubeflow-system"}
    assert out["clientConnection"] == {"qps": 50, "burst": 100}  # as shipped
    assert trainer["webhook"] == {"port": 9443, "host": ""}
    jobset = {"apiVersion": "config.jobset.x-k8s.io/v1alpha1", "kind": "Configuration",
              "leaderElection": {"leaderElect": True}, "internalCertManagement": {"enable": True}}
    out = cl.jobset_config(jobset, health=1, metrics=2, webhook=3, namespace="jobset-system", cert_dir="/c")
    assert out["internalCertManagement"] == {"enable": False}
    assert out["leaderElection"] == {"leaderElect": True, "resourceNamespace": "jobset-system"}
    assert out["webhook"] == {"port": 3, "host": "127.0.0.1", "certDir": "/c"}
    assert out["metrics"] == {"bindAddress": "127.0.0.1:2", "certDir": "/c"}
    assert out["health"] == {"healthProbeBindAddress": "127.0.0.1:1"}


def test_configurations_name_every_column_and_reject_unknown_names():
    configs = cl.configurations(list(cl.OPERATORS), kubeflow_version="v1.9.2", trainer_version="v2.3.0",
                                jobset_version="v0.12.0")
    assert list(configs) == list(cl.OPERATORS)
    assert [c["title"] for c in configs.values()] == [
        "kubetrain", "Kubeflow v1.9.2", "Kubeflow v1.9.2 tuned", "Trainer v2.3.0", "minimal creator"]
    assert configs[cl.KUBEFLOW_TUNED]["args"] == cl.KUBEFLOW_TUNED_ARGS == "--kube-api-qps=500 --kube-api-burst=1000"
    assert configs[cl.KUBEFLOW]["describe"] == "Kubeflow Training Operator v1.9.2 (defaults)"
    assert configs[cl.TRAINER_V2]["describe"] == "Kubeflow Trainer v2.3.0 on JobSet v0.12.0 (defaults)"
    with pytest.raises(ValueError, match="unknown operator 'kubeflow-v2'"):
        cl.configurations([cl.KUBETRAIN, "kubeflow-v2"])


def test_table_has_a_column_per_configuration_and_a_ratio_per_peer():
    sc = cl.Scenario("gang-8", 1, 8, 1)
    results = [
        cl.RunResult(cl.CREATOR, "gang-8", 8, pods_created_s=1.0),
        cl.RunResult(cl.TRAINER_V2, "gang-8", 8, pods_created_s=6.0, api_requests=30, helper_api_requests=150),
        cl.RunResult(cl.KUBEFLOW_TUNED, "gang-8", 8, pods_created_s=3.0, api_requests=300),
        cl.RunResult(cl.KUBEFLOW, "gang-8", 8, pods_created_s=4.0, api_requests=300),
        cl.RunResult(cl.KUBETRAIN, "gang-8", 8, pods_created_s=2.0, api_requests=100),
    ]
    lines = cl.table([sc], results).splitlines()
    header = [c.strip() for c in lines[0].split("|")[1:-1]]
    assert header == ["scenario", "metric", "kubetrain", "Kubeflow v1", "Kubeflow v1 / kubetrain",
                      "Kubeflow v1 tuned", "Kubeflow v1 tuned / kubetrain", "Trainer v2", "Trainer v2 / kubetrain",
                      "minimal creator"]
    assert lines[1].count("---:") == 8
    row = {line.split("|")[2].strip(): [c.strip() for c in line.split("|")[3:-1]] for line in lines[2:]}
    assert row["all pods created (s)"] == ["2.0", "4.0", "2.00x", "3.0", "1.50x", "6.0", "3.00x", "1.0"]
    assert row["all pods created, × creator's time"] == ["2.00x", "4.00x", "", "3.00x", "", "6.00x", "", "1.00x"]
    assert row["API requests of the Job controller (kube-controller-manager)"] == [
        "—", "—", "", "—", "", "150", "", "—"]
    # without Trainer v2 the Job controller's row is left out; without kubetrain there are no ratios
    only_peers = cl.table([sc], results[1:4]).splitlines()
    assert [c.strip() for c in only_peers[0].split("|")[3:-1]] == ["Kubeflow v1", "Kubeflow v1 tuned", "Trainer v2"]
    assert not any("Job controller" in line for line in cl.table([sc], results[2:]).splitlines())


def test_each_round_rotates_the_order_so_every_configuration_runs_once_in_every_position():
    ops = [cl.KUBETRAIN, cl.KUBEFLOW_TUNED, cl.CREATOR]
    orders = [cl.round_order(ops, i) for i in range(4)]
    assert orders[0] == ops
    assert orders[1] == [cl.KUBEFLOW_TUNED, cl.CREATOR, cl.KUBETRAIN]
    assert [o[0] for o in orders[:3]] == ops and orders[3] == ops  # each first once, then again from the top
    assert cl.round_order([cl.KUBETRAIN], 5) == [cl.KUBETRAIN]


def test_median_runs_keep_one_real_run_per_configuration_by_the_scenarios_key_figure():
    gang, rec = cl.Scenario("gang-8", 1, 8, 1), cl.Scenario("rec-4", 1, 4, 8, fail_one=True)
    runs = [cl.RunResult(cl.KUBETRAIN, "gang-8", 8, pods_created_s=t, cpu_s=c, round_index=i)
            for i, (t, c) in enumerate([(3.0, 30.0), (1.0, 10.0), (2.0, 20.0)])]
    runs += [cl.RunResult(cl.KUBEFLOW, "gang-8", 8, pods_created_s=t, round_index=i)
             for i, t in enumerate([None, 5.0, 4.0, 6.0])]  # a run without a figure counts as slowest
    runs += [cl.RunResult(cl.KUBETRAIN, "rec-4", 4, pods_created_s=9.0 - i, recovery_s=r, round_index=i)
             for i, r in enumerate([0.7, 0.9, 0.8])]
    picked = {(r.scenario, r.operator): r for r in cl.median_runs([gang, rec], runs)}
    assert (picked["gang-8", cl.KUBETRAIN].pods_created_s, picked["gang-8", cl.KUBETRAIN].cpu_s) == (2.0, 20.0)
    assert picked["gang-8", cl.KUBEFLOW].pods_created_s == 5.0  # the lower middle of 4.0, 5.0, 6.0, None
    assert picked["rec-4", cl.KUBETRAIN].recovery_s == 0.8  # recovery, not creation, picks it
    assert len(picked) == 3


def test_rounds_summary_counts_the_rounds_ours_was_ahead_and_its_multiple_of_the_creator():
    gang, rec = cl.Scenario("gang-8", 1, 8, 1), cl.Scenario("rec-4", 1, 4, 8, fail_one=True)
    figures = {cl.KUBETRAIN: [2.0, 6.0, 3.0], cl.KUBEFLOW_TUNED: [4.0, 5.0, None], cl.CREATOR: [1.0, 4.0, 3.0]}
    runs = [cl.RunResult(op, "gang-8", 8, pods_created_s=t, round_index=i)
            for op, ts in figures.items() for i, t in enumerate(ts)]
    runs += [cl.RunResult(cl.CREATOR, "rec-4", 4, skipped=cl.NO_CONTROLLER),
             cl.RunResult(cl.KUBETRAIN, "rec-4", 4, recovery_s=0.9)]
    gang_line, rec_line = cl.rounds_summary([gang, rec], runs)
    assert gang_line.startswith("gang-8, pods_created_s by round: kubetrain 2.0, 6.0, 3.0; "
                                "Kubeflow v1 tuned 4.0, 5.0, —; minimal creator 1.0, 4.0, 3.0")
    assert "kubetrain ahead of Kubeflow v1 tuned in 1 of 2 rounds" in gang_line  # round 3 has no peer figure
    assert gang_line.endswith("kubetrain as a multiple of the minimal creator: 2.00x, 1.50x, 1.00x")
    assert rec_line == "rec-4, recovery_s by round: kubetrain 0.9"  # the skipped creator is left out
