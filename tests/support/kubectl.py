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


def table_rows(output: str) -> list[dict[str, str]]:
    """`kubectl get` table output as one dict per row, header -> cell, an unset field as "" (kubectl prints blanks
    or <none>). Cells are cut at the header's column starts: splitting on whitespace would shift past a blank."""
    header, *rows = output.splitlines()
    starts = [i for i, ch in enumerate(header) if ch != " " and (i == 0 or header[i - 1] == " ")]
    bounds = list(zip(starts, [*starts[1:], None], strict=True))
    names = [header[a:b].strip() for a, b in bounds]
    cells = [{name: row[a:b].strip() for name, (a, b) in zip(names, bounds, strict=True)} for row in rows]
    return [{name: "" if cell == "<none>" else cell for name, cell in row.items()} for row in cells]
