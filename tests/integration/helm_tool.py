"""helm, built from its Go module by hack/helm/build.sh, and small helpers around the chart.

Used by tests/unit/test_chart*.py (lint/template, no cluster) and tests/integration/test_helm*.py,
test_rbac*.py and test_prometheus*.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from k8s_cluster import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART = REPO_ROOT / "charts" / "kubetrain"
PRESETS = sorted((CHART / "presets").glob("*.yaml"))
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
BUILD = REPO_ROOT / "hack" / "helm" / "build.sh"


class HelmUnavailable(RuntimeError):
    """No helm binary and no Go to build one."""


@cache
def helm_binary() -> Path:
    """The pinned helm; built on first use (a few minutes cold, then cached under ~/.cache/kubetrain/bin)."""
    path = Path(subprocess.run([str(BUILD), "--path"], check=True, capture_output=True, text=True).stdout.strip())
    if path.is_file() and os.access(path, os.X_OK):
        return path
    if shutil.which("go") is None:
        raise HelmUnavailable(f"{path} is not built and Go is not on PATH (hack/helm/build.sh needs it)")
    subprocess.run([str(BUILD)], check=True, stdout=subprocess.DEVNULL)  # build log goes to stderr (shown)
    return path


def helm(*args: str, check: bool = True, env: Mapping[str, str] | None = None,
         timeout: float = 300) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(helm_binary()), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def value_args(values_files: Iterable[Path] = (), set_values: Mapping[str, Any] | None = None) -> list[str]:
    args: list[str] = []
    for f in values_files:
        args += ["-f", str(f)]
    for k, v in (set_values or {}).items():
        args += ["--set-json", f"{k}={json.dumps(v)}"]
    return args


def render(values_files: Iterable[Path] = (), set_values: Mapping[str, Any] | None = None,
           namespace: str = "kubetrain", release: str = "kubetrain", *extra: str) -> list[dict[str, Any]]:
    """`helm template` output as a list of objects (chart CRDs included)."""
    out = helm("template", release, str(CHART), "--namespace", namespace, "--include-crds",
               *value_args(values_files, set_values), *extra).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def find(docs: Iterable[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    hits = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {[d['metadata']['name'] for d in hits]}"
    return hits[0]


def alert_rules(set_values: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The chart's alert rules as a Prometheus rules file (`groups:`), rendered from the PrometheusRule."""
    docs = render(set_values={"metrics.prometheusRule.enabled": True, **(set_values or {})})
    return {"groups": find(docs, "PrometheusRule")["spec"]["groups"]}


# ------------------------------------------------------------------ identities and the operator process


def token_kubeconfig(admin_kubeconfig: Path, token: str, path: Path) -> Path:
    """A kubeconfig for the same API server that authenticates with ``token`` only."""
    admin = yaml.safe_load(admin_kubeconfig.read_text())
    ctx = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])["context"]
    cluster = next(c for c in admin["clusters"] if c["name"] == ctx["cluster"])
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "sa",
        "clusters": [{"name": "test", "cluster": cluster["cluster"]}],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "test", "user": "sa"}}],
    }))
    path.chmod(0o600)
    return path


class OperatorProcess:
    """`python -m kubetrain.operator` as a child process with its own kubeconfig; log kept for failures."""

    def __init__(self, kubeconfig: Path, log: Path, *args: str, metrics_port: int = 0,
                 command: list[str] | None = None, trainer_image: str = "kubetrain/trainer:test"):
        self.kubeconfig, self.log_path, self.args, self.metrics_port = kubeconfig, log, args, metrics_port
        self.trainer_image = trainer_image
        self.command = command or [sys.executable, "-m", "kubetrain.operator",
                                   "--liveness", f"http://127.0.0.1:{free_port()}/healthz"]
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> OperatorProcess:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "KUBETRAIN_METRICS_PORT": str(self.metrics_port),
               "KUBETRAIN_TRAINER_IMAGE": self.trainer_image}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [*self.command, *self.args],
                env=env, stdout=log, stderr=subprocess.STDOUT,
            )
        return self

    def __exit__(self, *_: object) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])
