"""Where things are in the repository, for tests and benchmarks alike."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # resolved: bench/support is a link to this directory
HACK_DIR = REPO_ROOT / "hack"
CHART = REPO_ROOT / "charts" / "kubetrain"
CRD_FILE = REPO_ROOT / "crds" / "kubetrain.io_trainingjobs.yaml"
SWEEP_CRD_FILE = REPO_ROOT / "crds" / "kubetrain.io_trainingsweeps.yaml"
RUNTIME_CRD_FILES = (REPO_ROOT / "crds" / "kubetrain.io_trainingruntimes.yaml",
                     REPO_ROOT / "crds" / "kubetrain.io_clustertrainingruntimes.yaml")
QUICKSTART = REPO_ROOT / "examples" / "quickstart.yaml"
EXAMPLE_DATA = REPO_ROOT / "examples" / "data"
