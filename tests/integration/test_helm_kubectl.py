"""kubectl ergonomics of the chart's CRD and the `kubetrain submit/list/status/describe/wait/logs` commands,
against the real control plane with the operator (watching the test namespace) running.

- `kubectl explain trainingjob.spec.restartPolicy` shows the field docs from the API models;
- `kubectl get tj` shows the printer columns; `-o wide` adds the strategy;
- `kubectl wait --for=condition=Succeeded tj/NAME` returns 0 once kwok finishes the worker pods.
"""

from __future__ import annotations

import argparse
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from support.cluster import kubeconfig_path
from support.kubectl import kubectl, kubectl_binary, table_rows
from support.kwok import kwok_job, succeed_workers
from support.operator_process import OperatorProcess
from support.paths import CRD_FILE as CRD
from support.waiting import wait_for

from kubetrain.core import kube_cli

pytestmark = pytest.mark.integration


def kubetrain(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """One `kubetrain` CLI call (the kube_cli commands), in-process."""
    p = argparse.ArgumentParser(prog="kubetrain")
    kube_cli.register(p.add_subparsers(dest="command", required=True))
    ns = p.parse_args([*args, "--kubeconfig", str(kubeconfig_path())])
    capsys.readouterr()
    rc = ns.func(ns)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture()
def operator(kube_cluster: Any, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    kubectl("wait", "--for=condition=Established", "crd/trainingjobs.kubetrain.io", "--timeout=30s")
    with OperatorProcess(kubeconfig_path(), tmp_path / "operator.log", f"--namespace={namespace}") as op:
        yield op


def test_kubectl_explain_shows_field_docs(kube_cluster: Any) -> None:
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    out = wait_for(lambda: (p := kubectl("explain", "trainingjob.spec.restartPolicy", check=False)).returncode == 0
                   and p.stdout, 30, what="kubectl explain")
    assert "KIND:       TrainingJob" in out and "GROUP:      kubetrain.io" in out
    assert "Gang restart policy." in out
    assert "backoffLimit" in out
    field = kubectl("explain", "tj.spec.restartPolicy.backoffLimit").stdout
    assert "<integer>" in field


def test_cli_and_kubectl_follow_a_job_to_succeeded(
    operator: OperatorProcess, admin_api: client.ApiClient, namespace: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(kwok_job(
        "ergo", {"workers": 2, "strategy": "ddp", "maxSteps": 10, "restartPolicy": {"backoffSeconds": 0}})))
    rc, out, err = kubetrain(capsys, "submit", str(manifest), "-n", namespace)
    assert rc == 0, err
    assert f"trainingjob.kubetrain.io/ergo created in namespace {namespace}" in out
    rc, _, err = kubetrain(capsys, "submit", str(manifest), "-n", namespace)
    assert rc == 1 and "already exists" in err

    kubectl("wait", "--for=condition=Running", "tj/ergo", "-n", namespace, "--timeout=90s", timeout=100)
    (row,) = table_rows(kubectl("get", "tj", "-n", namespace).stdout)
    assert list(row) == ["NAME", "PHASE", "WORKERS", "STEP", "DONE", "ETA", "LOSS", "RESTARTS", "AGE"]
    assert row | {"AGE": ""} == {"NAME": "ergo", "PHASE": "Running", "WORKERS": "2/2", "STEP": "0", "DONE": "",
                                 "ETA": "", "LOSS": "", "RESTARTS": "0", "AGE": ""}
    wide = kubectl("get", "tjob", "-n", namespace, "-o", "wide").stdout.splitlines()
    assert "STRATEGY" in wide[0].split() and "ddp" in wide[1].split()

    rc, out, _ = kubetrain(capsys, "list", "-n", namespace)
    assert rc == 0 and out.splitlines()[1].split()[:4] == ["ergo", "Running", "2/2", "0/10"]
    rc, out, _ = kubetrain(capsys, "status", "ergo", "-n", namespace)
    assert rc == 0 and "Phase:       Running" in out and "Running" in out.split("Conditions:")[1]
    rc, out, _ = kubetrain(capsys, "wait", "ergo", "-n", namespace, "--for", "Running", "--timeout", "30")
    assert rc == 0 and out.splitlines()[-1] == "trainingjob.kubetrain.io/ergo Running", out
    rc, out, _ = kubetrain(capsys, "describe", "ergo", "-n", namespace)
    assert rc == 0 and "ergo-worker-1" in out.split("Per worker:")[1] and "Events (last" in out, out
    rc, out, _ = kubetrain(capsys, "list", "-n", namespace, "-o", "yaml")
    assert rc == 0 and yaml.safe_load(out)["items"][0]["status"]["phase"] == "Running", out
    # kwok nodes have no kubelet to serve logs; either way the command must pick the right pod.
    for rank in (0, 1):
        rc, out, err = kubetrain(capsys, "logs", "ergo", "-n", namespace, *(["--rank", "1"] if rank else []))
        assert rc == 0 or f"logs of pod {namespace}/ergo-worker-{rank}:" in err, err
    rc, _, err = kubetrain(capsys, "logs", "ergo", "-n", namespace, "--rank", "5")
    assert rc == 1 and "no pod for rank 5" in err
    rc, _, err = kubetrain(capsys, "status", "missing", "-n", namespace)
    assert rc == 1 and "not found" in err

    # kubectl wait blocks until the operator sets Succeeded; kwok finishes the workers meanwhile.
    waiter = subprocess.Popen([str(kubectl_binary()), "--kubeconfig", str(kubeconfig_path()), "wait",
                               "--for=condition=Succeeded", "tj/ergo", "-n", namespace, "--timeout=90s"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert waiter.poll() is None
        core = client.CoreV1Api(admin_api)
        succeed_workers(core, namespace,
                        core.list_namespaced_pod(namespace, label_selector="kubetrain.io/job-name=ergo").items)
        out, err = waiter.communicate(timeout=100)
    finally:
        if waiter.poll() is None:
            waiter.kill()
    assert waiter.returncode == 0, f"{err}\noperator log:\n{operator.tail()}"
    assert "trainingjob.kubetrain.io/ergo condition met" in out

    # generateName: the name printed is the one the API server gave, suspended so nothing runs.
    generated = yaml.safe_load(manifest.read_text())
    generated["metadata"] = {"generateName": "ergo-"}
    generated["spec"]["suspend"] = True
    manifest.write_text(yaml.safe_dump(generated))
    rc, out, err = kubetrain(capsys, "submit", str(manifest), "-n", namespace)
    assert rc == 0, err
    assert re.fullmatch(rf"trainingjob\.kubetrain\.io/ergo-[a-z0-9]{{5}} created in namespace {namespace}\n", out), out
    rc, out, _ = kubetrain(capsys, "status", "ergo", "-n", namespace, "-o", "json")
    assert rc == 0 and '"phase": "Succeeded"' in out
