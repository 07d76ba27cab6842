"""The gang schedulers' PodGroup CRDs, as their own Go modules ship them (the Go module proxy is the one
source the test machines reach): downloaded once with `go mod download`, kept under KUBETRAIN_CACHE, and
installed into the test cluster or removed again."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from .cluster import cache_dir
from .resources import apply_crds, not_found_ok, wait_gone


@dataclass(frozen=True)
class CrdSource:
    module: str
    version: str
    path: str
    """The CRD's file inside the module's source tree."""
    name: str
    """The CustomResourceDefinition's metadata.name."""


VOLCANO = CrdSource("volcano.sh/volcano", "v1.10.0", "config/crd/volcano/bases/scheduling.volcano.sh_podgroups.yaml",
                    "podgroups.scheduling.volcano.sh")
"""The proxy serves volcano.sh/volcano v1.10.0; it refuses v1.11.x and v1.12.x (403, "not available").
PodGroup v1beta1 has the same spec fields in all of them."""
COSCHEDULING = CrdSource("sigs.k8s.io/scheduler-plugins", "v0.31.8", "manifests/coscheduling/crd.yaml",
                         "podgroups.scheduling.x-k8s.io")
SOURCES = {"volcano": VOLCANO, "coscheduling": COSCHEDULING}


def available() -> bool:
    """The CRDs can be had: Go to download them, or every one already in the cache."""
    return shutil.which("go") is not None or all(_cached(s).is_file() for s in SOURCES.values())


def _cached(source: CrdSource) -> Path:
    return cache_dir() / "gang-crds" / f"{source.module.replace('/', '_')}@{source.version}" / Path(source.path).name


def crd_file(source: CrdSource) -> Path:
    """The CRD's YAML, from the cache, else downloaded with its module (tens of MB, once)."""
    cached = _cached(source)
    if cached.is_file():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "GOTOOLCHAIN": os.environ.get("GOTOOLCHAIN", "local"), "GOFLAGS": "-mod=mod"}
    # Outside any module (the cache dir), so that no go.mod of ours takes part.
    proc = subprocess.run(["go", "mod", "download", "-json", f"{source.module}@{source.version}"],
                          cwd=cached.parent, env=env, capture_output=True, text=True, timeout=600, check=False)
    info = json.loads(proc.stdout or "{}")
    if proc.returncode != 0 or "Dir" not in info:
        raise RuntimeError(f"go mod download {source.module}@{source.version}: {info.get('Error') or proc.stderr}")
    tmp = cached.with_suffix(".tmp")
    shutil.copyfile(Path(info["Dir"]) / source.path, tmp)
    tmp.replace(cached)
    return cached


def crd(source: CrdSource) -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all(crd_file(source).read_text()) if d]
    found = [d for d in docs if d.get("kind") == "CustomResourceDefinition" and d["metadata"]["name"] == source.name]
    if not found:
        raise RuntimeError(f"{source.module}@{source.version} {source.path} has no CRD {source.name}")
    return found[0]


def install(admin: client.ApiClient, source: CrdSource) -> None:
    """Apply the CRD and wait until it is Established (its kind is served)."""
    apply_crds(admin, [crd(source)])


def uninstall(admin: client.ApiClient, source: CrdSource, timeout: float = 60.0) -> None:
    """Delete the CRD (and with it every object of its kind) and wait until it is gone."""
    ext = client.ApiextensionsV1Api(admin)
    with not_found_ok():
        ext.delete_custom_resource_definition(source.name)
    wait_gone(lambda: ext.read_custom_resource_definition(source.name), timeout, what=f"CRD {source.name} deleted")
