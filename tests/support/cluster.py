"""The local control plane that hack/ builds and starts (etcd, kube-apiserver with RBAC,
kube-controller-manager, kube-scheduler and kwok fake GPU nodes as local processes; see
docs/testing.md): where it keeps its state, starting and stopping it, an admin client.

KUBETRAIN_CACHE and KUBETRAIN_CLUSTER_DIR choose the cluster, as they do for the hack/ scripts.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

from kubernetes import client, config

from .paths import HACK_DIR

COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")


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


def component_pid(name: str) -> int:
    """The host pid of a control-plane component (kube-apiserver, etcd, kwok, ...) of the running cluster."""
    return int((cluster_dir() / "pids" / f"{name}.pid").read_text())


@contextlib.contextmanager
def component_stopped(name: str) -> Iterator[None]:
    """The component frozen (SIGSTOP) for the block, then resumed (SIGCONT) whatever happens: a fault, not a
    crash. Its clients' connections stay open and unanswered meanwhile, as with an API server that hangs."""
    with process_stopped(component_pid(name)):
        yield


@contextlib.contextmanager
def process_stopped(pid: int) -> Iterator[None]:
    """`pid` frozen (SIGSTOP) for the block, then resumed (SIGCONT) whatever happens."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def cluster_running() -> bool:
    """True when every component's pid file names a live process and the API server is ready."""
    pids = cluster_dir() / "pids"
    for name in COMPONENTS:
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


def new_admin_client(kubeconfig: Path | None = None) -> client.ApiClient:
    return config.new_client_from_config(config_file=str(kubeconfig or kubeconfig_path()))
