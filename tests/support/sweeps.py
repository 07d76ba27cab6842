"""TrainingSweeps of one namespace through the admin client, and their trials played on kwok nodes:
rank 0's progress written the way workers report it (the kubetrain.io/progress annotation on the
trial job's worker 0, a kubetrain.core.progress.Progress record) and the trial's pods finished."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from kubernetes import client

from kubetrain.core import api, contract
from kubetrain.core.progress import Progress

from .jobs import StatusCheck, TrainingJobs
from .kwok import KWOK_CHECKPOINT, succeed_pod
from .operator_process import OperatorProcess
from .waiting import wait_for

MAX_STEPS = 100


def kwok_sweep(name: str, **spec: Any) -> dict[str, Any]:
    """A TrainingSweep whose trials (one worker, one GPU, ephemeral checkpoints) run on kwok nodes, tuning
    optimizer.lr; ``spec`` overrides the sweep's spec fields (the pruner is off unless given)."""
    template = {"workers": 1, "resources": {"gpusPerWorker": 1}, "maxSteps": MAX_STEPS,
                "optimizer": {"minLr": 1e-5}, "checkpoint": KWOK_CHECKPOINT,
                "restartPolicy": {"backoffSeconds": 0}}
    body: dict[str, Any] = {
        "template": {"spec": template},
        "parameters": [{"path": "optimizer.lr", "type": "float", "low": 1e-4, "high": 1e-2, "log": True}],
        "maxTrials": 3, "parallelism": 2, "pruner": {"type": "none"}, "sampler": {"type": "random"}, "seed": 7,
    }
    body.update(spec)
    return {"apiVersion": api.API_VERSION, "kind": api.SWEEP_KIND, "metadata": {"name": name}, "spec": body}


class TrainingSweeps:
    """``op``: the operator that runs them, whose log tail goes into failure messages."""

    def __init__(self, admin_api: client.ApiClient, namespace: str, op: OperatorProcess | None = None):
        self.custom = client.CustomObjectsApi(admin_api)
        self.core = client.CoreV1Api(admin_api)
        self.jobs = TrainingJobs(admin_api, namespace, op)
        self.ns, self.op = namespace, op

    def submit(self, body: dict[str, Any]) -> dict[str, Any]:
        return dict(self.custom.create_namespaced_custom_object(api.GROUP, api.VERSION, self.ns, api.SWEEP_PLURAL,
                                                                body))

    def get(self, name: str) -> dict[str, Any]:
        return dict(self.custom.get_namespaced_custom_object(api.GROUP, api.VERSION, self.ns, api.SWEEP_PLURAL, name))

    def status(self, name: str) -> dict[str, Any]:
        return dict(self.get(name).get("status") or {})

    def delete(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object(api.GROUP, api.VERSION, self.ns, api.SWEEP_PLURAL, name)

    def trial_jobs(self, name: str) -> list[dict[str, Any]]:
        """The TrainingJobs labelled as the sweep's trials, by name."""
        found = self.custom.list_namespaced_custom_object(api.GROUP, api.VERSION, self.ns, api.PLURAL,
                                                          label_selector=f"{contract.LABEL_SWEEP}={name}")
        return sorted(found.get("items", []), key=lambda j: j["metadata"]["name"])

    def events(self, name: str) -> list[client.CoreV1Event]:
        evs = self.core.list_namespaced_event(self.ns, field_selector=f"involvedObject.name={name}").items
        return [e for e in evs if e.involved_object.kind == api.SWEEP_KIND]

    def wait_status(self, name: str, check: StatusCheck, timeout: float = 60, what: str = "") -> dict[str, Any]:
        """The sweep's status once ``check(status)`` is truthy; on timeout the failure explains the sweep."""
        try:
            return wait_for(lambda: (s := self.status(name)) and check(s) and s, timeout, what=what or name,
                            interval=0.2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.explain(name)}") from exc

    def explain(self, name: str) -> str:
        """The sweep's status, its trial jobs' phases and the operator's log tail, for failure messages."""
        jobs = [(j["metadata"]["name"], (j.get("status") or {}).get("phase"), j["spec"].get("suspend"))
                for j in self.trial_jobs(name)]
        text = f"sweep status: {self.status(name)}\ntrial jobs (name, phase, suspend): {jobs}"
        return f"{text}\noperator log:\n{self.op.tail()}" if self.op else text


def report_progress(core: client.CoreV1Api, namespace: str, job: str, step: int, loss: float,
                    max_steps: int = MAX_STEPS) -> None:
    """What rank 0 of trial job ``job`` reports: its Progress record as the annotation on worker 0."""
    record = Progress(job=job, step=step, max_steps=max_steps, loss=loss, world_size=1,
                      time=contract.format_time(datetime.now(UTC)), finished=step >= max_steps)
    core.patch_namespaced_pod(f"{job}-worker-0", namespace,
                              {"metadata": {"annotations": {contract.PROGRESS_ANNOTATION: record.model_dump_json(
                                  by_alias=True, exclude_none=True)}}})


def wait_trial_running(jobs: TrainingJobs, job: str, timeout: float = 60) -> dict[str, Any]:
    """Until the trial job exists (the sweep records a trial before it creates its job) and its workers run."""
    wait_for(lambda: jobs.get(job), timeout, what=f"trial job {job}", ignore=(client.ApiException,))
    return jobs.wait_status(job, lambda s: s.get("phase") == "Running" and s.get("workersReady") == 1, timeout,
                            what=f"trial {job} Running")


def train_trial(jobs: TrainingJobs, job: str, step: int, loss: float) -> None:
    """Trial ``job`` reports ``loss`` at ``step``; returns once its status shows that step."""
    wait_trial_running(jobs, job)
    report_progress(jobs.core, jobs.ns, job, step, loss)
    jobs.wait_status(job, lambda s: s.get("currentStep") == step, 30, what=f"trial {job} at step {step}")


def finish_trial(jobs: TrainingJobs, job: str, loss: float, step: int = MAX_STEPS) -> None:
    """Trial ``job`` reports its final ``loss`` and its worker exits 0: the job Succeeds with that loss."""
    train_trial(jobs, job, step, loss)
    succeed_pod(jobs.core, jobs.ns, f"{job}-worker-0")
    jobs.wait_status(job, lambda s: s.get("phase") == "Succeeded", 30, what=f"trial {job} Succeeded")
