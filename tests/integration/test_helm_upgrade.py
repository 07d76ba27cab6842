"""The upgrade in docs/install.md ("Upgrade") works, command by command: a release of the chart as it
was before the runtime CRDs (two CRDs, no `spec.runtimeRef`) is upgraded by the documented block,
run verbatim, and afterwards the cluster serves the new CRDs, the new chart's roles and its operator."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from collections.abc import Iterator
from io import BytesIO
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from support import helm_tool as ht
from support.cluster import kubeconfig_path
from support.doc_blocks import marked_block
from support.kubectl import kubectl_binary
from support.paths import CRD_FILE, REPO_ROOT, RUNTIME_CRD_FILES, SWEEP_CRD_FILE
from support.resources import FIELD_MANAGER, apply, apply_crds, not_found_ok, wait_gone

# Alone (support/lanes.py): the CRDs deleted and a cluster-wide operator installed.
pytestmark = [pytest.mark.integration, pytest.mark.whole_cluster]
DOC = REPO_ROOT / "docs" / "install.md"
MARKER = "<!-- upgrade-steps -->"
PREVIOUS_CHART = "e1c6d732a80e5be085faff87f318a0ac459fb111"
"""The last commit whose chart had two CRDs (trainingjobs, trainingsweeps) and no runtimes."""
RUNTIME_CRDS = ("trainingruntimes.kubetrain.io", "clustertrainingruntimes.kubetrain.io")
RELEASE, NAMESPACE = "kubetrain", "kubetrain-system"  # the documented names


def documented_steps() -> list[str]:
    return marked_block(DOC, MARKER)


def test_the_upgrade_applies_the_crds_server_side_before_the_release() -> None:
    steps = documented_steps()
    assert steps[0] == "kubectl apply --server-side --force-conflicts -f charts/kubetrain/crds/"
    assert steps[1].startswith("helm upgrade kubetrain charts/kubetrain --namespace kubetrain-system")


def _previous_chart(into: Path) -> Path:
    """charts/kubetrain as of PREVIOUS_CHART, from this clone's history."""
    archive = subprocess.run(["git", "archive", PREVIOUS_CHART, "charts/kubetrain"], cwd=REPO_ROOT,
                             capture_output=True, check=False)
    assert archive.returncode == 0, f"git archive {PREVIOUS_CHART}: {archive.stderr.decode()} (a shallow clone?)"
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into / "charts" / "kubetrain"


def _as_installed_by(admin: client.ApiClient, chart: Path) -> None:
    """The CRDs as an install of ``chart`` leaves them: its CRDs, owned by Helm, and no others."""
    ext = client.ApiextensionsV1Api(admin)
    for name in RUNTIME_CRDS:
        with not_found_ok():
            ext.delete_custom_resource_definition(name)
        wait_gone(lambda n=name: ext.read_custom_resource_definition(n), 60, what=f"CRD {name} deleted")
    old = [yaml.safe_load(p.read_text()) for p in sorted((chart / "crds").glob("*.yaml"))]
    assert sorted(d["metadata"]["name"] for d in old) == ["trainingjobs.kubetrain.io", "trainingsweeps.kubetrain.io"]
    for doc in old:
        apply(admin, doc, "helm")


def _spec_fields(admin: client.ApiClient) -> set[str]:
    crd = client.ApiextensionsV1Api(admin).read_custom_resource_definition("trainingjobs.kubetrain.io")
    version = next(v for v in crd.spec.versions if v.served)
    return set(version.schema.open_apiv3_schema.properties["spec"].properties)


def _crd_names(admin: client.ApiClient) -> set[str]:
    items = client.ApiextensionsV1Api(admin).list_custom_resource_definition().items
    return {c.metadata.name for c in items if c.spec.group == "kubetrain.io"}


@pytest.fixture
def clean_release(admin_api: client.ApiClient, env: dict[str, str]) -> Iterator[None]:
    _uninstall(env)
    yield
    _uninstall(env)
    # Whatever happened, the session's other tests find this repository's CRDs again.
    apply_crds(admin_api, [yaml.safe_load(p.read_text()) for p in (CRD_FILE, SWEEP_CRD_FILE, *RUNTIME_CRD_FILES)],
               FIELD_MANAGER)


@pytest.fixture
def env() -> dict[str, str]:
    path = f"{ht.require_helm().parent}:{kubectl_binary().parent}:{os.environ['PATH']}"
    return {**os.environ, "KUBECONFIG": str(kubeconfig_path()), "PATH": path}


def _uninstall(env: dict[str, str]) -> None:
    script = (f"helm uninstall {RELEASE} --namespace {NAMESPACE} --wait >/dev/null 2>&1 || true\n"
              f"kubectl delete namespace {NAMESPACE} --ignore-not-found --wait=true --timeout=60s >/dev/null\n")
    subprocess.run(["bash", "-c", script], cwd=REPO_ROOT, env=env, timeout=120, check=False)


def _server_keeps_runtime_ref(admin: client.ApiClient) -> bool:
    """A server-side dry run of the quickstart with a spec.runtimeRef: does the stored object keep it
    (a CRD without the field prunes it)?"""
    body = yaml.safe_load((REPO_ROOT / "examples" / "quickstart.yaml").read_text())
    body["spec"]["runtimeRef"] = {"name": "gpu"}
    made = client.CustomObjectsApi(admin).create_namespaced_custom_object(
        "kubetrain.io", "v1alpha1", "default", "trainingjobs", body, dry_run="All")
    return "runtimeRef" in made.get("spec", {})


def test_helm_upgrade_from_the_previous_chart_upgrades_the_crds(
    helm_ok: None, kube_cluster: Any, admin_api: client.ApiClient, real_node: None, clean_release: None,
    env: dict[str, str], tmp_path: Path,
) -> None:
    old_chart = _previous_chart(tmp_path)
    _as_installed_by(admin_api, old_chart)
    ht.helm("install", RELEASE, str(old_chart), "--namespace", NAMESPACE, "--create-namespace",
            "--set", "operator.reconcileWorkers=8", "--kubeconfig", str(kubeconfig_path()))
    before = _crd_names(admin_api), "runtimeRef" in _spec_fields(admin_api), _server_keeps_runtime_ref(admin_api)
    assert before == ({"trainingjobs.kubetrain.io", "trainingsweeps.kubetrain.io"}, False, False), before

    script = "set -euo pipefail -x\n" + "\n".join(documented_steps())
    proc = subprocess.run(["bash", "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}"
    print(proc.stdout)

    after = _crd_names(admin_api), "runtimeRef" in _spec_fields(admin_api), _server_keeps_runtime_ref(admin_api)
    assert after == ({"trainingjobs.kubetrain.io", "trainingsweeps.kubetrain.io", *RUNTIME_CRDS}, True, True), after
    history = ht.helm("history", RELEASE, "--namespace", NAMESPACE, "-o", "json",
                      "--kubeconfig", str(kubeconfig_path())).stdout
    assert [(r["revision"], r["status"]) for r in json.loads(history)] == [(1, "superseded"), (2, "deployed")]
    values = json.loads(ht.helm("get", "values", RELEASE, "--namespace", NAMESPACE, "-o", "json",
                                "--kubeconfig", str(kubeconfig_path())).stdout)
    assert values == {"operator": {"reconcileWorkers": 8}}, values  # the install's --set kept
    rbac = client.RbacAuthorizationV1Api(admin_api)
    role = rbac.read_cluster_role("kubetrain-runtime-admin")  # new in this chart, owned by the release
    assert role.metadata.annotations["meta.helm.sh/release-name"] == RELEASE
    print(f"upgraded: CRDs {sorted(before[0])} -> {sorted(after[0])}; spec.runtimeRef kept by the server: "
          f"{before[2]} -> {after[2]}; helm history {[r['revision'] for r in json.loads(history)]}")
