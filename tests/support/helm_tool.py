"""helm, built from its Go module by hack/helm/build.sh, and small helpers around the chart.

Used by tests/unit/test_chart*.py (lint/template, no cluster), the integration tests of the chart
and bench/compare.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from .builds import shown
from .paths import CHART, HACK_DIR
from .processes import run_checked

PRESETS = sorted((CHART / "presets").glob("*.yaml"))
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
BUILD = HACK_DIR / "helm" / "build.sh"


class HelmUnavailable(RuntimeError):
    """No helm binary and no Go to build one."""


@cache
def helm_binary() -> Path:
    """The pinned helm; built on first use (a few minutes cold, then cached under ~/.cache/kubetrain/bin), or
    waited for where hack/prebuild.sh is building it; the build's lines (every 30 s at least) are shown."""
    path = Path(subprocess.run([str(BUILD), "--path"], check=True, capture_output=True, text=True).stdout.strip())
    if path.is_file() and os.access(path, os.X_OK):
        return path
    if shutil.which("go") is None:
        raise HelmUnavailable(f"{path} is not built and Go is not on PATH (hack/helm/build.sh needs it)")
    with shown(f"needs helm ({path}): hack/helm/build.sh"):
        subprocess.run([str(BUILD)], check=True, stdout=subprocess.DEVNULL)  # its lines go to stderr
    return path


def require_helm() -> Path:
    """helm_binary(), or skip the test with the reason where it cannot be had (no Go)."""
    try:
        return helm_binary()
    except HelmUnavailable as exc:
        pytest.skip(str(exc))


def helm(*args: str, check: bool = True, env: Mapping[str, str] | None = None,
         timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return run_checked([str(helm_binary()), *args], check=check, env=env, timeout=timeout)


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
