"""The pinned kubectl that hack/build.sh builds, run against the test cluster."""

from __future__ import annotations

import subprocess
from pathlib import Path

from .cluster import cache_dir, kubeconfig_path, pinned_kubernetes_version
from .processes import run_checked


def kubectl_binary() -> Path:
    """Where hack/build.sh puts kubectl (hack/lib.sh's bin_path layout), found without Go."""
    return cache_dir() / "bin" / f"kubectl-{pinned_kubernetes_version()}" / "kubectl"


def kubectl(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``kubectl ARGS...`` as the cluster's admin; with ``check``, a non-zero exit fails the test."""
    return run_checked([str(kubectl_binary()), *args], check=check, timeout=timeout,
                       env={"KUBECONFIG": str(kubeconfig_path())})
