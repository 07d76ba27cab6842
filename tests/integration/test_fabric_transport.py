"""A silent NCCL fallback to TCP shows on the real API server: rank 0's reported transport goes into
status.networkTransport, and a transport that is not spec.fabric's sets FabricDegraded with one
Warning Event.

Worker pods are kwok pods on a node that advertises the EFA devices, so nothing runs NCCL: the test
plays rank 0 with the progress helper (`python -m kubetrain.trainer.observe.progress --json`), under the
workers' own ServiceAccount token, as the trainer would report after its first collective."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from support.cluster import kubeconfig_path
from support.conditions import condition
from support.identities import token_for
from support.jobs import TrainingJobs
from support.kwok import fake_node_manifest, kwok_job
from support.operator_process import OperatorProcess
from support.resources import not_found_ok

from kubetrain.core import api, contract
from kubetrain.core.progress import Progress
from kubetrain.trainer.observe import progress as pp

pytestmark = pytest.mark.integration

NODE_LABEL = "kubetrain.io/transport-test"
EFA_NODE = {"vpc.amazonaws.com/efa": "64", "hugepages-2Mi": "20Gi", "nvidia.com/gpu": "8", "memory": "1Ti"}


@pytest.fixture
def efa_node(core_v1: client.CoreV1Api) -> Iterator[str]:
    """A kwok node of its own with the EFA devices of two p5.48xlarge workers (32 each)."""
    name = f"kwok-efa-{uuid.uuid4().hex[:6]}"
    node = fake_node_manifest(name, labels={NODE_LABEL: name, "node.kubernetes.io/instance-type": "p5.48xlarge"})
    for key in ("capacity", "allocatable"):
        node["status"][key].update(EFA_NODE)
    core_v1.create_node(node)
    try:
        yield name
    finally:
        with not_found_ok():
            core_v1.delete_node(name)


@pytest.fixture
def operator(crd: None, kube_cluster: Any, tmp_path: Path) -> Iterator[OperatorProcess]:
    with OperatorProcess(kubeconfig_path(), tmp_path / "operator.log") as op:
        yield op


def efa_job(jobs: TrainingJobs, name: str, node: str) -> None:
    jobs.submit(kwok_job(name, {
        "workers": 1, "maxSteps": 10, "fabric": "efa", "fabricOptions": {"instanceType": "p5.48xlarge"},
        "resources": {"gpusPerWorker": 1}, "scheduling": {"nodeSelector": {NODE_LABEL: node}},
    }))
    jobs.wait_status(name, lambda s: s.get("phase") == "Running", 90, what=f"{name} Running")


def report(admin: client.ApiClient, ns: str, job: str, tmp: Path, step: int, transport: str) -> None:
    """Rank 0's progress record with its transport, on its own pod, with the workers' token."""
    token = tmp / "token"
    token.write_text(token_for(admin, ns, f"{job}-worker"))  # the job's own ServiceAccount
    cfg = admin.configuration
    env = {contract.POD_NAME: f"{job}-worker-0", contract.POD_NAMESPACE: ns, pp.API_SERVER_ENV: cfg.host,
           pp.TOKEN_FILE_ENV: str(token), pp.CA_FILE_ENV: str(cfg.ssl_ca_cert)}
    record = Progress(job=job, step=step, max_steps=10, world_size=1, network_transport=transport)
    done = subprocess.run([sys.executable, "-m", "kubetrain.trainer.observe.progress", "--json", record.model_dump_json(
        by_alias=True, exclude_none=True)], capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr


def fabric_condition(status: dict[str, Any]) -> dict[str, Any] | None:
    return condition(status, api.FABRIC_DEGRADED)


def test_socket_on_an_efa_job_is_fabric_degraded_once_and_ofi_is_not(
    admin_api: client.ApiClient, namespace: str, efa_node: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    jobs = TrainingJobs(admin_api, namespace, operator)
    efa_job(jobs, "tcp", efa_node)
    efa_job(jobs, "ofi", efa_node)
    assert "networkTransport" not in jobs.status("tcp") and fabric_condition(jobs.status("tcp")) is None

    report(admin_api, namespace, "tcp", tmp_path, 1, contract.TRANSPORT_SOCKET)
    report(admin_api, namespace, "ofi", tmp_path, 1, contract.TRANSPORT_OFI)
    st = jobs.wait_status("tcp", lambda s: fabric_condition(s) is not None, 30, what="FabricDegraded")
    cond = fabric_condition(st)
    assert cond is not None and (cond["status"], cond["reason"]) == ("True", "NcclFallbackToSocket"), cond
    assert "spec.fabric efa expects NCCL transport OFI, but rank 0 reports Socket" in cond["message"]
    assert st["networkTransport"] == "Socket" and st["phase"] == "Running"
    ofi = jobs.wait_status("ofi", lambda s: s.get("networkTransport") == "OFI", 30, what="ofi transport")
    assert fabric_condition(ofi) is None and ofi["phase"] == "Running"

    # Another record with the same transport: the condition stays, no second Event.
    report(admin_api, namespace, "tcp", tmp_path, 2, contract.TRANSPORT_SOCKET)
    jobs.wait_status("tcp", lambda s: s.get("currentStep") == 2, 60, what="tcp step 2")  # progress alone: <= 30 s
    jobs.wait_status("ofi", lambda s: s.get("currentStep") == 1, 30, what="ofi step 1")
    warned = [e for e in jobs.events("tcp") if e.reason == "NcclFallbackToSocket"]
    assert len(warned) == 1 and warned[0].type == "Warning" and (warned[0].count or 1) == 1, warned
    assert "expects NCCL transport OFI, but rank 0 reports Socket" in warned[0].message
    assert not [e for e in jobs.events("ofi") if e.reason in ("NcclFallbackToSocket", "UnexpectedTransport")]
