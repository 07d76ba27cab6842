"""The operator's per-job series: named by namespace and job, and gone with the job."""

from __future__ import annotations

from typing import Any

from kubetrain.operator.runtime import metrics


def _jobs(metric: Any) -> set[tuple[str, str]]:
    return {(s.labels["namespace"], s.labels["trainingjob"]) for family in metric.collect()
            for s in family.samples if "trainingjob" in s.labels}


def test_a_deleted_jobs_series_go_and_a_same_named_job_elsewhere_keeps_its_own():
    metrics.GANG_RESTARTS.labels("team-a", "llama", "NodeLost").inc()
    metrics.GANG_RESTARTS.labels("team-a", "llama", "OOMKilled").inc()
    metrics.GANG_RESTARTS.labels("team-b", "llama", "NodeLost").inc()
    metrics.JOBS_FINISHED.labels("team-a", "llama", "Failed", "BackoffLimitExceeded").inc()
    metrics.JOB_GOODPUT_SECONDS.labels("team-a", "llama", "lost").set(3.0)
    metrics.JOB_STEPS_LOST.labels("team-a", "llama").set(4)

    metrics.forget_job("team-a", "llama")

    for metric in metrics.PER_JOB:
        assert ("team-a", "llama") not in _jobs(metric), metric
    assert ("team-b", "llama") in _jobs(metrics.GANG_RESTARTS)
    metrics.forget_job("team-b", "llama")
    assert ("team-b", "llama") not in _jobs(metrics.GANG_RESTARTS)  # other tests' jobs share the registry


def test_every_per_job_metric_declares_namespace_and_trainingjob_first():
    for metric, names in metrics.PER_JOB.items():
        assert names[:2] == ("namespace", "trainingjob")
        assert tuple(metric._labelnames) == names  # the order forget_job removes them in


def test_writes_are_counted_by_verb_and_resource_and_reads_are_not():
    def value(verb: str, resource: str) -> float:
        return metrics.API_WRITES.labels(verb, resource)._value.get()

    status, pods = value("patch", "custom_object_status"), value("create", "pods")
    metrics.count_write("patch_namespaced_custom_object_status")
    metrics.count_write("create_pods")  # a raw POST of pods
    metrics.count_write("read_namespaced_pod")
    metrics.count_write("list_namespaced_pod")
    assert (value("patch", "custom_object_status"), value("create", "pods")) == (status + 1, pods + 1)
    assert not [s for m in metrics.API_WRITES.collect() for s in m.samples if s.labels["verb"] in ("read", "list")]
