"""Operator metrics (prometheus-client), all named kubetrain_operator_*."""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge, Histogram

LEADER = Gauge("kubetrain_operator_leader", "1 on the replica that reconciles (holds the leader Lease), 0 on a standby")
JOBS = Gauge("kubetrain_operator_jobs", "TrainingJobs known to the operator, by phase", ["phase"])
RECONCILE_SECONDS = Histogram(
    "kubetrain_operator_reconcile_duration_seconds",
    "Time of one reconcile, API calls included",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
RECONCILE_ERRORS = Counter("kubetrain_operator_reconcile_errors_total", "Reconciles that raised", ["reason"])
PODS_CREATED = Counter("kubetrain_operator_pods_created_total", "Worker pods created")
API_WRITES = Counter("kubetrain_operator_api_writes_total",
                     "Writes the reconciles sent to the API server, by verb and resource (status included)",
                     ["verb", "resource"])
GANG_RESTARTS = Counter("kubetrain_operator_gang_restarts_total", "Whole-gang restarts of each job, by failure kind",
                        ["namespace", "trainingjob", "reason"])
JOBS_FINISHED = Counter("kubetrain_operator_jobs_finished_total", "Jobs that finished, by phase and reason",
                        ["namespace", "trainingjob", "phase", "reason"])
TIME_TO_RUNNING = Histogram(
    "kubetrain_operator_time_to_running_seconds",
    "From job creation to every worker of the first generation Running",
    buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800),
)
RECOVERY_SECONDS = Histogram(
    "kubetrain_operator_recovery_seconds",
    "From a worker failure to every worker of the new generation Running",
    buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600),
)
CREATES_REFUSED = Counter("kubetrain_operator_creates_refused_total",
                          "Worker pod creates the API server refused (quota, Pod Security, invalid), by HTTP status",
                          ["code"])
STATUS_CONFLICTS = Counter("kubetrain_operator_status_conflicts_total",
                           "Status writes refused because the job changed since it was read (re-planned)")
SWEEP_TRIALS = Gauge("kubetrain_operator_sweep_trials",
                     "Trials of each TrainingSweep, by state (Pending, Running, Complete, Pruned, Failed)",
                     ["namespace", "sweep", "state"])
SWEEP_BEST_VALUE = Gauge("kubetrain_operator_sweep_best_value",
                         "The best objective value (the lowest trial loss) of each TrainingSweep so far",
                         ["namespace", "sweep"])
TIME_TO_FIRST_STEP = Histogram(
    "kubetrain_operator_time_to_first_step_seconds",
    "From job creation to rank 0's first reported step",
    buckets=(5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600),
)
JOB_GOODPUT_SECONDS = Gauge("kubetrain_operator_job_goodput_seconds",
                            "Each job's training time that counted (productive) and what restarts cost (lost), "
                            "as status.goodput says", ["namespace", "trainingjob", "kind"])
JOB_GPU_HOURS = Gauge("kubetrain_operator_job_gpu_hours",
                      "Each job's GPU-hours: allocated (its worker pods held the GPUs, status.gpuHours brought up "
                      "to now) and lost (what restarts cost, status.goodput.lostGpuHours)",
                      ["namespace", "trainingjob", "kind"])
JOB_STEPS_LOST = Gauge("kubetrain_operator_job_steps_lost",
                       "Steps each job trained again after restarts (past the checkpoint it resumed from)",
                       ["namespace", "trainingjob"])
POD_WATCH_RESTARTS = Counter("kubetrain_operator_pod_watch_restarts_total",
                             "Times the operator's watch of worker pods started over: 'expired' (listed again "
                             "after 410 Gone) or 'error' (after a backoff)", ["reason"])
HANGS = Counter("kubetrain_operator_hangs_total",
                "Hang verdicts (restartPolicy.hangDetection): named, a suspect rank was named; unnamed, every rank "
                "waited alike", ["named"])
for _named in ("true", "false"):
    HANGS.labels(_named)  # both series exist from the start, at 0

PER_JOB: dict[Counter | Gauge, tuple[str, ...]] = {
    GANG_RESTARTS: ("namespace", "trainingjob", "reason"),
    JOBS_FINISHED: ("namespace", "trainingjob", "phase", "reason"),
    JOB_GOODPUT_SECONDS: ("namespace", "trainingjob", "kind"),
    JOB_STEPS_LOST: ("namespace", "trainingjob"),
    JOB_GPU_HOURS: ("namespace", "trainingjob", "kind"),
}
"""The series that name one TrainingJob (`namespace`, `trainingjob`), with their label names in order."""


def forget_job(namespace: str, name: str) -> None:
    """A deleted job's series go with it: kept, their number would grow with every job the cluster ever ran."""
    for metric, names in PER_JOB.items():
        labelsets = {tuple(s.labels[n] for n in names) for family in metric.collect() for s in family.samples
                     if s.labels.get("namespace") == namespace and s.labels.get("trainingjob") == name}
        for labels in labelsets:
            with contextlib.suppress(KeyError):
                metric.remove(*labels)


WRITE_VERBS = ("create", "patch", "replace", "delete")


def count_write(call: str) -> None:
    """One API call by its client method's name (`patch_namespaced_pod`): counted when it writes."""
    verb, _, rest = call.partition("_")
    if verb in WRITE_VERBS:
        API_WRITES.labels(verb, rest.replace("namespaced_", "", 1)).inc()
