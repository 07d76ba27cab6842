"""Fixtures for the integration tier: a real control plane from hack/ (see docs/testing.md).

- ``kube_cluster`` (session): the cluster, started with hack/cluster-up.sh unless it is
  already running (stopped again at the end if this session started it, unless
  KUBETRAIN_KEEP_CLUSTER=1). KUBECONFIG is exported for the session.
- ``admin_api`` / ``core_v1``: admin clients (system:masters).
- ``namespace``: a fresh namespace per test, deleted afterwards.
- ``service_account``: factory for a restricted ServiceAccount identity (TokenRequest token).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from k8s_cluster import (  # noqa: E402 - after the sys.path line above
    KWOK_NAMESPACE_ANNOTATIONS,
    REPO_ROOT,
    Identity,
    cluster_down,
    cluster_running,
    cluster_up,
    kubeconfig_path,
    new_admin_client,
    service_account_identity,
    wait_for,
)
from kubernetes import client, dynamic  # noqa: E402
from kubernetes.client.rest import ApiException  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "integration: needs the real control plane from hack/ (make cluster-up)")


CRD_FILE = REPO_ROOT / "crds" / "kubetrain.io_trainingjobs.yaml"


@dataclass(frozen=True)
class KubeCluster:
    kubeconfig: Path
    api: client.ApiClient


def _binaries_buildable() -> bool:
    return (
        shutil.which("go") is not None
        or (Path(os.environ.get("KUBETRAIN_CACHE", "~/.cache/kubetrain")).expanduser() / "bin").is_dir()
    )


@pytest.fixture(scope="session")
def kube_cluster(request: pytest.FixtureRequest) -> Iterator[KubeCluster]:
    started_here = False
    if not cluster_running():
        if not _binaries_buildable():
            pytest.skip("no Go toolchain to build the test cluster (hack/build.sh) and no built binaries")
        # Show hack/cluster-up.sh's progress (a cold start builds the binaries) instead of capturing it.
        capture = request.config.pluginmanager.getplugin("capturemanager")
        try:
            if capture is None:
                cluster_up()
            else:
                with capture.global_and_fixture_disabled():
                    cluster_up()
        except Exception as exc:  # noqa: BLE001 - reported as a test error with the reason
            pytest.fail(f"could not start the test cluster: {exc}", pytrace=False)
        started_here = True
    kubeconfig = kubeconfig_path()
    previous = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(kubeconfig)
    api = new_admin_client(kubeconfig)
    try:
        yield KubeCluster(kubeconfig=kubeconfig, api=api)
    finally:
        api.close()
        if previous is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = previous
        if started_here and os.environ.get("KUBETRAIN_KEEP_CLUSTER") != "1":
            cluster_down()


@pytest.fixture(scope="session")
def helm_ok() -> None:
    """helm from hack/helm (built on first use); skips where it cannot be had (no Go)."""
    import helm_tool

    try:
        helm_tool.helm_binary()
    except helm_tool.HelmUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def crd(admin_api: client.ApiClient) -> None:
    """The TrainingJob CRD from crds/, applied server-side and Established."""
    body = yaml.safe_load(CRD_FILE.read_text())
    dyn = dynamic.DynamicClient(admin_api)
    crds = dyn.resources.get(api_version="apiextensions.k8s.io/v1", kind="CustomResourceDefinition")
    crds.server_side_apply(body=body, name=body["metadata"]["name"], field_manager="kubetrain-tests",
                           force_conflicts=True)

    def established() -> bool:
        conds = crds.get(name=body["metadata"]["name"]).status.conditions or []
        return any(c.type == "Established" and c.status == "True" for c in conds)

    wait_for(established, 30, what="CRD Established")


@pytest.fixture(scope="session")
def admin_api(kube_cluster: KubeCluster) -> client.ApiClient:
    return kube_cluster.api


@pytest.fixture(scope="session")
def core_v1(admin_api: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(admin_api)


def _namespace_name(test_name: str) -> str:
    base = re.sub(r"[^a-z0-9-]+", "-", test_name.lower()).strip("-")[:40].strip("-")
    return f"{base or 'test'}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def namespace(request: pytest.FixtureRequest, core_v1: client.CoreV1Api) -> Iterator[str]:
    """A fresh namespace (with its default ServiceAccount in place), deleted after the test.

    Its pods go to the kwok nodes (KWOK_NAMESPACE_ANNOTATIONS); ``real_namespace`` is for real pods.
    """
    name = _namespace_name(request.node.name)
    core_v1.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(
        name=name, labels={"kubetrain.io/test": "true"}, annotations=KWOK_NAMESPACE_ANNOTATIONS)))
    # Pods are refused until the ServiceAccount controller has created "default".
    wait_for(
        lambda: core_v1.read_namespaced_service_account("default", name),
        30,
        what=f"ServiceAccount {name}/default",
        ignore=(ApiException,),
    )
    try:
        yield name
    finally:
        try:
            core_v1.delete_namespace(name)
        except ApiException as exc:
            if exc.status != 404:
                raise


ServiceAccountFactory = Callable[..., Identity]


@pytest.fixture
def service_account(admin_api: client.ApiClient, namespace: str) -> Iterator[ServiceAccountFactory]:
    """``service_account(name, rules=[V1PolicyRule(...)], namespace=...)`` -> Identity with its own client.

    The identity authenticates with a TokenRequest token and has only the given Role rules
    in the test namespace (or ``namespace=``), so RBAC decisions are the API server's.
    """
    created: list[Identity] = []
    test_namespace = namespace

    def make(
        name: str = "restricted", rules: list[client.V1PolicyRule] | None = None, namespace: str | None = None
    ) -> Identity:
        identity = service_account_identity(admin_api, namespace or test_namespace, name, rules)
        created.append(identity)
        return identity

    yield make
    for identity in created:
        identity.api.close()


@pytest.fixture(scope="session")
def real_node(core_v1: client.CoreV1Api) -> None:
    """The cluster's real node is Ready and the images are built and loaded into it.

    Skips where this machine cannot run the node (not root, no containerd...), never under CI=true.
    """
    import real_pods

    why = real_pods.real_node_missing(core_v1)
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the real-pod tests: {why}", pytrace=False)
        pytest.skip(why)
    real_pods.build_images()


@pytest.fixture
def real_namespace(request: pytest.FixtureRequest, core_v1: client.CoreV1Api, real_node: None) -> Iterator[str]:
    """A fresh namespace whose pods run on the real node; deleted after the test."""
    name = _namespace_name(request.node.name)
    core_v1.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(
        name=name, labels={"kubetrain.io/test": "true"})))
    wait_for(lambda: core_v1.read_namespaced_service_account("default", name), 30,
             what=f"ServiceAccount {name}/default", ignore=(ApiException,))
    try:
        yield name
    finally:
        core_v1.delete_namespace(name)
