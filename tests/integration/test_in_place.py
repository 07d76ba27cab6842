"""In-place gang restarts against the real control plane with kwok GPU nodes: the running workers' pods
stay (moved into the next generation, their launcher told when the recreated ones are created), only the
failed one is recreated (the default with durable checkpoints); with restartPolicy.inPlace false every pod is. (Real launchers restarting real
processes: test_real_pods.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from support.cluster import kubeconfig_path
from support.jobs import TrainingJobs
from support.kwok import fail_pod, kwok_job, static_claim
from support.operator_process import OperatorProcess
from support.waiting import wait_for

from kubetrain.core import contract

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def operator(crd: None, kube_cluster: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    with OperatorProcess(kubeconfig_path(), tmp_path_factory.mktemp("operator") / "operator.log") as op:
        yield op


@pytest.fixture
def jobs(admin_api: client.ApiClient, namespace: str, operator: OperatorProcess) -> TrainingJobs:
    return TrainingJobs(admin_api, namespace, operator)


@pytest.fixture
def claim(jobs: TrainingJobs) -> Iterator[str]:
    volume = static_claim(jobs.core, jobs.ns)
    yield "checkpoints"
    jobs.core.delete_persistent_volume(volume)


def running(jobs: TrainingJobs, name: str, generation: int, workers: int) -> dict[str, client.V1Pod]:
    """Wait for the job Running in `generation` with every pod of it Running and told; its pods by name."""
    def ok(s: dict[str, Any]) -> bool:
        pods = [p for p in jobs.pods(name) if p.status.phase == "Running" and not p.metadata.deletion_timestamp
                and p.metadata.labels[contract.LABEL_GENERATION] == str(generation)
                and p.metadata.annotations[contract.GENERATION_ANNOTATION] == str(generation)]
        return s.get("phase") == "Running" and s.get("restartGeneration", 0) == generation and len(pods) == workers
    jobs.wait_status(name, ok, 90, what=f"{name} Running in generation {generation}")
    return {p.metadata.name: p for p in jobs.pods(name) if not p.metadata.deletion_timestamp}


def restart_after_failing(jobs: TrainingJobs, name: str, claim: str, worker: int = 2,
                          **policy: Any) -> tuple[dict[str, Any], dict, dict]:
    jobs.submit(kwok_job(name, {"workers": 4, "checkpoint": {"claimName": claim},
                                "restartPolicy": {"backoffSeconds": 0, **policy}}))
    before = running(jobs, name, 0, 4)
    fail_pod(jobs.core, jobs.ns, f"{name}-worker-{worker}", exit_code=1)
    after = running(jobs, name, 1, 4)
    return jobs.status(name), before, after


def test_only_the_failed_worker_is_recreated_and_the_others_run_the_next_generation(jobs: TrainingJobs, claim: str) -> None:
    st, before, after = restart_after_failing(jobs, "inplace", claim)  # unset: on, the default where safe
    recreated = sorted(n for n in after if after[n].metadata.uid != before[n].metadata.uid)
    assert recreated == ["inplace-worker-2"], recreated
    assert (st["restartCount"], st["failures"]) == (1, {"ExitCode": 1})
    restart = next(e for e in jobs.events("inplace") if e.reason == "ExitCode")
    assert "worker 2 exited with code 1: restarting the whole gang from step 0" in restart.message
    assert "in place, keeping 3 of 4 workers" in restart.message


def test_the_kept_workers_are_told_the_address_of_a_recreated_worker_0(jobs: TrainingJobs, claim: str) -> None:
    """contract.MASTER_ANNOTATION: the kept pods reach the new worker 0 at its pod IP, not through its name."""
    _, before, after = restart_after_failing(jobs, "newzero", claim, worker=0)
    zero = after["newzero-worker-0"]
    assert zero.metadata.uid != before["newzero-worker-0"].metadata.uid and zero.status.pod_ip
    assert contract.MASTER_ANNOTATION not in (zero.metadata.annotations or {})  # a new pod goes by the name
    told = f"1 {zero.status.pod_ip}"

    def addresses() -> dict[str, str | None]:
        return {p.metadata.name: (p.metadata.annotations or {}).get(contract.MASTER_ANNOTATION)
                for p in jobs.pods("newzero") if p.metadata.name != "newzero-worker-0"}
    wait_for(lambda: set(addresses().values()) == {told}, 30, what=f"the kept pods told {told!r}: {addresses()}")


def test_with_in_place_off_every_worker_is_recreated(jobs: TrainingJobs, claim: str) -> None:
    st, before, after = restart_after_failing(jobs, "recreate", claim, inPlace=False)
    assert all(after[n].metadata.uid != before[n].metadata.uid for n in after)
    assert contract.IN_PLACE_ANNOTATION not in (after["recreate-worker-0"].metadata.annotations or {})
    assert st["restartCount"] == 1
