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
    assert job.spec.checkpoint.ephemeral  # kwok pods have no storage for a claim
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
    requested = cl.delete_requests([
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
