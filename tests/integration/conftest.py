"""Fixtures for the integration tier: a real control plane from hack/ (see docs/testing.md).

- ``kube_cluster`` (session): the cluster, started with hack/cluster-up.sh unless it is
  already running (stopped again at the end if this session started it, unless
  KUBETRAIN_KEEP_CLUSTER=1). KUBECONFIG is exported for the session.
- ``admin_api`` / ``core_v1``: admin clients (system:masters).
- ``namespace``: a fresh namespace per test, deleted afterwards.
- ``service_account``: factory for a restricted ServiceAccount identity (TokenRequest token).
- ``kueue`` (session): Kueue's controller and webhooks, built from its Go module (support/kueue.py).

Under hack/test-lanes.sh several sessions share the cluster, each running one lane's tests (support/lanes.py).
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from kubernetes import client
from support import kueue as kueue_support
from support import lanes, real_pods
from support.builds import shown
from support.cluster import cache_dir, cluster_down, cluster_running, cluster_up, kubeconfig_path, new_admin_client
from support.identities import Identity, service_account_identity
from support.kwok import KWOK_NAMESPACE_ANNOTATIONS
from support.paths import CRD_FILE, RUNTIME_CRD_FILES, SWEEP_CRD_FILE
from support.resources import apply_crds, not_found_ok, wait_default_service_account


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "integration: needs the real control plane from hack/ (make cluster-up)")
    config.addinivalue_line("markers", f"{lanes.WHOLE_CLUSTER}: changes the cluster for every other test (its CRDs, "
                                       "the API server, a cluster-wide operator): runs alone (support/lanes.py)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a lane (KUBETRAIN_TEST_LANE), only that lane's tests of this tier, and after them those it may take
    over from another lane (support/lanes.py)."""
    left = lanes.select(items, Path(__file__).parent)
    if left:
        config.hook.pytest_deselected(items=left)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    return lanes.pass_by(item, nextitem)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    line = lanes.summary()
    if line:
        terminalreporter.write_line(line)


@dataclass(frozen=True)
class KubeCluster:
    kubeconfig: Path
    api: client.ApiClient


def _binaries_buildable() -> bool:
    return shutil.which("go") is not None or (cache_dir() / "bin").is_dir()


def _say(line: str) -> None:
    with shown(line):
        pass


@pytest.fixture(scope="session")
def kube_cluster() -> Iterator[KubeCluster]:
    started_here = False
    # In lanes, one starts it and the others find it up.
    with lanes.one_at_a_time(cache_dir() / "cluster-up.lock", say=_say):
        if not cluster_running():
            if not _binaries_buildable():
                pytest.skip("no Go toolchain to build the test cluster (hack/build.sh) and no built binaries")
            # Show hack/cluster-up.sh's progress (a cold start builds the binaries, or waits for hack/prebuild.sh
            # to, a line per part and every 30 s) instead of capturing it.
            try:
                with shown("starting the test cluster (hack/cluster-up.sh)"):
                    cluster_up()
            except Exception as exc:  # noqa: BLE001 - reported as a test error with the reason
                pytest.fail(f"could not start the test cluster: {exc}", pytrace=False)
            started_here = lanes.current() is None  # in lanes, hack/test-lanes.sh stops it after the last
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
def crd(admin_api: client.ApiClient) -> None:
    """Every kubetrain CRD from crds/ (jobs, sweeps, runtimes), applied server-side and Established."""
    apply_crds(admin_api, [yaml.safe_load(path.read_text()) for path in (CRD_FILE, SWEEP_CRD_FILE, *RUNTIME_CRD_FILES)])


@pytest.fixture(scope="session")
def admin_api(kube_cluster: KubeCluster) -> client.ApiClient:
    return kube_cluster.api


@pytest.fixture(scope="session")
def core_v1(admin_api: client.ApiClient) -> client.CoreV1Api:
    return client.CoreV1Api(admin_api)


def _namespace_name(test_name: str) -> str:
    base = re.sub(r"[^a-z0-9-]+", "-", test_name.lower()).strip("-")[:40].strip("-")
    return lanes.namespace(f"{base or 'test'}-{uuid.uuid4().hex[:6]}")


def _fresh_namespace(core: client.CoreV1Api, test_name: str, annotations: dict[str, str] | None) -> Iterator[str]:
    """A new namespace named after the test, ready for pods (its default ServiceAccount exists); deleted after."""
    name = _namespace_name(test_name)
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(
        name=name, labels={"kubetrain.io/test": "true"}, annotations=annotations)))
    wait_default_service_account(core, name)
    try:
        yield name
    finally:
        with not_found_ok():
            core.delete_namespace(name)


@pytest.fixture
def namespace(request: pytest.FixtureRequest, core_v1: client.CoreV1Api) -> Iterator[str]:
    """A fresh namespace, deleted after the test.

    Its pods go to the kwok nodes (KWOK_NAMESPACE_ANNOTATIONS); ``real_namespace`` is for real pods.
    """
    yield from _fresh_namespace(core_v1, request.node.name, KWOK_NAMESPACE_ANNOTATIONS)


@pytest.fixture
def other_namespace(request: pytest.FixtureRequest, core_v1: client.CoreV1Api) -> Iterator[str]:
    """A second fresh namespace for kwok pods, as `namespace` (for tests of an operator serving several)."""
    yield from _fresh_namespace(core_v1, request.node.name, KWOK_NAMESPACE_ANNOTATIONS)


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
def kueue(request: pytest.FixtureRequest, kube_cluster: KubeCluster, crd: None,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[kueue_support.Kueue]:
    """Kueue running against the cluster (built first: a few minutes cold, progress shown)."""
    binary = Path(kueue_support.build_path())
    if not binary.exists() and shutil.which("go") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("CI must run the Kueue tests: no Go toolchain to build Kueue", pytrace=False)
        pytest.skip("no Go toolchain to build Kueue (hack/kueue/build.sh) and no built binary")
    if not binary.exists():
        with shown(f"the kueue fixture needs Kueue ({binary}): hack/kueue/build.sh"):
            binary = kueue_support.build()
    running = kueue_support.Kueue(binary, kube_cluster.kubeconfig, tmp_path_factory.mktemp("kueue")).start()
    yield running
    running.stop()


@pytest.fixture(scope="session")
def real_node(core_v1: client.CoreV1Api) -> None:
    """The cluster's real node is Ready and the images are built and loaded into it.

    Skips where this machine cannot run the node (not root, no containerd...), never under CI=true.
    """
    why = real_pods.real_node_missing(core_v1)
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the real-pod tests: {why}", pytrace=False)
        pytest.skip(why)
    with shown("the real node needs the images (hack/images.sh; a no-op when up to date)"):
        real_pods.build_images()


@pytest.fixture
def real_namespace(request: pytest.FixtureRequest, core_v1: client.CoreV1Api, real_node: None) -> Iterator[str]:
    """A fresh namespace whose pods run on the real node; deleted after the test."""
    yield from _fresh_namespace(core_v1, request.node.name, None)
