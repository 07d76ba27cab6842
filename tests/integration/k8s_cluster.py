"""Helpers for tests against the local control plane built and started by hack/.

The cluster (etcd, kube-apiserver with RBAC, kube-controller-manager, kube-scheduler
and kwok fake GPU nodes) runs as local processes; see docs/testing.md. Fixtures
live in conftest.py; this module holds the plain functions so that other test
packages can import them (``from k8s_cluster import wait_for`` inside tests/integration).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from kubetrain.core import api

REPO_ROOT = Path(__file__).resolve().parents[2]
HACK_DIR = REPO_ROOT / "hack"

# Labels/annotations read by the kwok stages in hack/kwok/stages/.
POD_FAIL_STAGE = "pod-container-running-failed.stage.kwok.x-k8s.io"
POD_SUCCEED_LABEL = "kwok.kubetrain.io/succeed"
NODE_NOT_READY_STAGE = "node-not-ready.stage.kwok.x-k8s.io"
FAKE_NODE_SELECTOR = "type=kwok"

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """A wait_for condition did not hold in time."""


def wait_for(
    condition: Callable[[], T],
    timeout: float = 30.0,
    *,
    interval: float = 0.1,
    what: str = "",
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """Poll ``condition`` until it returns a truthy value and return that value.

    Exceptions listed in ``ignore`` count as "not yet". On timeout raises WaitTimeout
    naming ``what`` (or the condition) and the last value or exception seen.
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = condition()
        except ignore as exc:
            last = exc
        else:
            if value:
                return value
            last = value
        if time.monotonic() >= deadline:
            name = what or getattr(condition, "__name__", repr(condition))
            raise WaitTimeout(f"timed out after {timeout:.1f}s waiting for {name}; last: {last!r}")
        time.sleep(interval)


def is_not_found(exc: BaseException) -> bool:
    return isinstance(exc, ApiException) and exc.status == 404


def wait_gone(read: Callable[[], object], timeout: float = 30.0, *, what: str = "") -> None:
    """Wait until ``read()`` raises 404 Not Found."""

    def gone() -> bool:
        try:
            read()
        except ApiException as exc:
            if exc.status == 404:
                return True
            raise
        return False

    wait_for(gone, timeout, what=what or "object to be deleted")


# --------------------------------------------------------------------------- paths


def cache_dir() -> Path:
    return Path(os.environ.get("KUBETRAIN_CACHE") or Path.home() / ".cache" / "kubetrain")


def cluster_dir() -> Path:
    return Path(os.environ.get("KUBETRAIN_CLUSTER_DIR") or cache_dir() / "cluster")


def kubeconfig_path() -> Path:
    """The admin kubeconfig that hack/cluster-up.sh writes."""
    return cluster_dir() / "kubeconfig"


def pinned_kubernetes_version() -> str:
    """The k8s.io/kubernetes version pinned in hack/k8s/go.mod (e.g. ``v1.36.3``)."""
    gomod = (HACK_DIR / "k8s" / "go.mod").read_text()
    match = re.search(r"^\s*(?:require\s+)?k8s\.io/kubernetes\s+(v\S+)", gomod, re.MULTILINE)
    if match is None:
        raise RuntimeError("k8s.io/kubernetes is not required in hack/k8s/go.mod")
    return match.group(1)


def cluster_up(timeout: float = 3600.0) -> Path:
    """Start the cluster with hack/cluster-up.sh (a no-op when it is healthy); return the kubeconfig.

    A cold start builds the binaries first (tens of minutes on 2 cores); progress goes to stderr.
    """
    proc = subprocess.run(
        ["bash", str(HACK_DIR / "cluster-up.sh")],
        stdout=subprocess.PIPE,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"hack/cluster-up.sh failed with exit code {proc.returncode}; logs in {cluster_dir()}/logs")
    return Path(proc.stdout.strip().splitlines()[-1])


def cluster_down() -> None:
    subprocess.run(["bash", str(HACK_DIR / "cluster-down.sh")], check=True, timeout=120)


def cluster_running() -> bool:
    """True when every component's pid file names a live process and the API server is ready."""
    pids = cluster_dir() / "pids"
    for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"):
        try:
            os.kill(int((pids / f"{name}.pid").read_text()), 0)
        except (OSError, ValueError):
            return False
    if not kubeconfig_path().exists():
        return False
    try:
        with new_admin_client() as api:
            client.VersionApi(api).get_code(_request_timeout=5)
    except Exception:  # noqa: BLE001 - any failure means "not running"
        return False
    return True


# ------------------------------------------------------------------------- clients


def new_admin_client(kubeconfig: Path | None = None) -> client.ApiClient:
    return config.new_client_from_config(config_file=str(kubeconfig or kubeconfig_path()))


def bearer_client(base: client.ApiClient, token: str) -> client.ApiClient:
    """A client for the same API server as ``base`` that authenticates with ``token`` only."""
    src = base.configuration
    cfg = client.Configuration()
    cfg.host = src.host
    cfg.ssl_ca_cert = src.ssl_ca_cert
    cfg.verify_ssl = src.verify_ssl
    cfg.api_key = {"authorization": token}
    cfg.api_key_prefix = {"authorization": "Bearer"}
    return client.ApiClient(cfg)


def impersonating_client(base: client.ApiClient, user: str, group: str | None = None) -> client.ApiClient:
    """A client that acts as ``user`` (optionally in ``group``) through impersonation by ``base``'s identity."""
    api = client.ApiClient(base.configuration)
    api.set_default_header("Impersonate-User", user)
    if group is not None:
        api.set_default_header("Impersonate-Group", group)
    return api


@dataclass(frozen=True)
class Identity:
    """A ServiceAccount with its own token-authenticated client."""

    namespace: str
    name: str
    api: client.ApiClient

    @property
    def username(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.name}"


def service_account_identity(
    admin: client.ApiClient,
    namespace: str,
    name: str,
    rules: list[client.V1PolicyRule] | None = None,
    *,
    token_seconds: int = 3600,
) -> Identity:
    """Create ServiceAccount ``name`` (bound to a Role with ``rules`` if given) and log in as it.

    The token comes from the TokenRequest API, so authentication and RBAC are the API
    server's own.
    """
    core = client.CoreV1Api(admin)
    core.create_namespaced_service_account(namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=name)))
    if rules:
        rbac = client.RbacAuthorizationV1Api(admin)
        rbac.create_namespaced_role(namespace, client.V1Role(metadata=client.V1ObjectMeta(name=name), rules=rules))
        rbac.create_namespaced_role_binding(
            namespace,
            client.V1RoleBinding(
                metadata=client.V1ObjectMeta(name=name),
                role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="Role", name=name),
                subjects=[client.RbacV1Subject(kind="ServiceAccount", name=name, namespace=namespace)],
            ),
        )
    request = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=token_seconds)
    )
    token = core.create_namespaced_service_account_token(name, namespace, request).status.token
    return Identity(namespace=namespace, name=name, api=bearer_client(admin, token))


# ----------------------------------------------------------------------- pods/nodes


def pod_phase(core: client.CoreV1Api, namespace: str, name: str) -> str | None:
    return core.read_namespaced_pod(name, namespace).status.phase


def wait_pod_phase(
    core: client.CoreV1Api, namespace: str, name: str, phase: str, timeout: float = 30.0
) -> client.V1Pod:
    def reached() -> client.V1Pod | None:
        pod = core.read_namespaced_pod(name, namespace)
        return pod if pod.status.phase == phase else None

    return wait_for(reached, timeout, what=f"pod {namespace}/{name} phase {phase}")


def container_exit_codes(pod: client.V1Pod) -> dict[str, int]:
    """Exit codes of the pod's terminated containers, by container name."""
    codes: dict[str, int] = {}
    for status in pod.status.container_statuses or []:
        terminated = status.state.terminated if status.state else None
        if terminated is not None:
            codes[status.name] = terminated.exit_code
    return codes


def fail_pod(
    core: client.CoreV1Api,
    namespace: str,
    name: str,
    exit_code: int = 1,
    reason: str = "Error",
    message: str = "failed by test",
) -> None:
    """Make a Running pod on a kwok node fail: phase Failed, containers terminated with ``exit_code``.

    kwok's pod-container-running-failed stage applies once the pod is Running.
    """
    core.patch_namespaced_pod(
        name,
        namespace,
        {
            "metadata": {
                "annotations": {
                    f"{POD_FAIL_STAGE}/exit-code": str(exit_code),
                    f"{POD_FAIL_STAGE}/reason": reason,
                    f"{POD_FAIL_STAGE}/message": message,
                    f"{POD_FAIL_STAGE}/delay": "0s",
                    f"{POD_FAIL_STAGE}/jitter-delay": "0s",
                },
                "labels": {POD_FAIL_STAGE: "true"},
            }
        },
    )


def succeed_pod(core: client.CoreV1Api, namespace: str, name: str) -> None:
    """Make a Running pod on a kwok node finish: phase Succeeded, exit code 0."""
    core.patch_namespaced_pod(name, namespace, {"metadata": {"labels": {POD_SUCCEED_LABEL: "true"}}})


def node_ready(core: client.CoreV1Api, name: str) -> bool:
    for cond in core.read_node(name).status.conditions or []:
        if cond.type == "Ready":
            return cond.status == "True"
    return False


def set_node_ready(core: client.CoreV1Api, name: str, ready: bool) -> None:
    """Mark a kwok node NotReady (``ready=False``) or Ready again, through kwok's node-not-ready stage."""
    if ready:
        body: dict[str, Any] = {"metadata": {"labels": {NODE_NOT_READY_STAGE: None}}}
    else:
        body = {
            "metadata": {
                "labels": {NODE_NOT_READY_STAGE: "true"},
                "annotations": {f"{NODE_NOT_READY_STAGE}/delay": "0s", f"{NODE_NOT_READY_STAGE}/jitter-delay": "0s"},
            }
        }
    core.patch_node(name, body)


KWOK_TAINT = {"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}
"""hack/nodes.sh taints the kwok nodes when the cluster has a real node: pods land on the real
node unless their namespace routes them to kwok (KWOK_NAMESPACE_ANNOTATIONS)."""
KWOK_NAMESPACE_ANNOTATIONS = {
    # The API server's PodNodeSelector and PodTolerationRestriction admission plugins apply these
    # to every pod of the namespace, so the operator's pods need no test-only scheduling fields.
    "scheduler.alpha.kubernetes.io/node-selector": "type=kwok",
    "scheduler.alpha.kubernetes.io/defaultTolerations": json.dumps([{**KWOK_TAINT, "operator": "Equal"}]),
}


KWOK_CHECKPOINT = {"ephemeral": True}
"""spec.checkpoint of jobs whose pods land on kwok nodes: kwok pods have no storage (no provisioner
binds a claim for them), so a default checkpoint claim would stay Pending and block the pods."""


def kwok_job(name: str, spec: dict[str, Any] | None = None, namespace: str | None = None) -> dict[str, Any]:
    """A TrainingJob manifest for pods on kwok nodes: ``spec`` with ephemeral checkpoints, unless it
    says where checkpoints go itself (checkpoint.ephemeral or checkpoint.claimName)."""
    spec = dict(spec or {})
    checkpoint = dict(spec.get("checkpoint") or {})
    if "ephemeral" not in checkpoint and "claimName" not in checkpoint:
        spec["checkpoint"] = {**checkpoint, **KWOK_CHECKPOINT}  # kwok pods have no storage
    metadata = {"name": name, **({"namespace": namespace} if namespace else {})}
    return {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": metadata, "spec": spec}


def fake_node_manifest(
    name: str,
    *,
    gpus: int = 8,
    rdma: int = 8,
    cpu: str = "96",
    memory: str = "1Ti",
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A Node that kwok manages (same shape as hack/nodes.sh); create it with CoreV1Api.create_node."""
    resources = {"cpu": cpu, "memory": memory, "pods": "110", "nvidia.com/gpu": str(gpus)}
    if rdma:
        resources["rdma/ib"] = str(rdma)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {"type": "kwok", "kubernetes.io/hostname": name, **(labels or {})},
        },
        "status": {"capacity": resources, "allocatable": resources},
    }


def free_port() -> int:
    """A free loopback port. (kopf reads port 0 in --liveness as "no port", i.e. 80: never pass 0.)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
