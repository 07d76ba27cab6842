"""The walkthrough in docs/install.md ("Try it on the local test cluster") works, command by
command, on the test cluster's real node: the test runs the documented block verbatim. The chart
installs the operator as a real pod from the image `make images` built, and the unchanged
quickstart trains in two real worker pods."""

from __future__ import annotations

import os
import re
import subprocess
from typing import Any

import pytest
from support import helm_tool as ht
from support.cluster import kubeconfig_path
from support.doc_blocks import marked_block
from support.kubectl import kubectl_binary
from support.paths import REPO_ROOT

# Alone (support/lanes.py): a cluster-wide operator and the chart's admission policies.
pytestmark = [pytest.mark.integration, pytest.mark.whole_cluster]
DOC = REPO_ROOT / "docs" / "install.md"
MARKER = "<!-- test-cluster-steps -->"
REGISTRY = subprocess.run(["hack/images.sh", "registry"], cwd=REPO_ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
"""The test cluster's registry as the node reaches it (10.88.0.1:5000)."""


def documented_steps() -> list[str]:
    return marked_block(DOC, MARKER)


def test_doc_block_covers_the_newcomer_path() -> None:
    steps = "\n".join(documented_steps())
    for needle in ("make images", "export REGISTRY=$(hack/images.sh registry)",
                   "helm upgrade --install kubetrain charts/kubetrain --namespace kubetrain-system",
                   "--set image.repository=$REGISTRY/kubetrain-operator --set trainerImage=$REGISTRY/kubetrain-trainer",
                   "kubectl -n kubetrain-system rollout status deployment/kubetrain",
                   "kubectl apply -n ml -f examples/quickstart.yaml", "kubectl get tj",
                   "kubectl wait -n ml --for=condition=Running",
                   "kubectl wait -n ml --for=condition=Succeeded tj/quickstart --timeout=15m"):
        assert needle in steps


def _cleanup(env: dict[str, str]) -> None:
    script = ('helm uninstall kubetrain --namespace kubetrain-system --wait >/dev/null 2>&1 || true\n'
              'kubectl delete namespace ml kubetrain-system --ignore-not-found --wait=true --timeout=60s >/dev/null\n')
    subprocess.run(["bash", "-c", script], cwd=REPO_ROOT, env=env, timeout=120, check=False)


def test_install_steps_run_verbatim(kube_cluster: Any, real_node: None) -> None:
    helm_dir = ht.require_helm().parent
    cli = subprocess.run([str(REPO_ROOT / ".venv" / "bin" / "kubetrain"), "--help"], capture_output=True, text=True)
    if "status" not in cli.stdout:
        pytest.skip("`kubetrain status` is not registered yet: core/src/kubetrain/core/cli.py must call "
                    "kubetrain.core.kube_cli.register(sub)")
    env = {**os.environ, "KUBECONFIG": str(kubeconfig_path())}
    env["PATH"] = f"{helm_dir}:{kubectl_binary().parent}:{env['PATH']}"
    _cleanup(env)
    pulled = {f"{REGISTRY}/kubetrain-operator:0.1.0", f"{REGISTRY}/kubetrain-trainer:0.1.0"}
    _remove_node_images(pulled)  # so that the node must pull them (the pushed images have IDs of their own)
    # Each documented line runs as written; `set -x` shows which one failed; background jobs die on exit.
    script = "set -euo pipefail -x\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + "\n".join(documented_steps())
    try:
        proc = subprocess.run(["bash", "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                              timeout=1500)
        images = _node_images()
        # the documented steps end uninstalled: the first `make install` installs, the second upgrades
        installs = [subprocess.run(["make", "install"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                                   timeout=300) for _ in range(2)]
    finally:
        _cleanup(env)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}"
    out = proc.stdout
    print(out)
    assert "STATUS: deployed" in out and 'deployment "kubetrain" successfully rolled out' in out
    assert out.count("trainingjob.kubetrain.io/quickstart condition met") == 2  # Running, then Succeeded
    assert re.search(r"pod/quickstart-worker-1\s+[01]/1\s+Running.*kubetrain-node", out), out  # a real pod
    assert re.search(r"persistentvolumeclaim/quickstart-checkpoints\s+Bound.*RWX", out), out
    assert re.search(r"Succeeded", out) and re.search(r"step\D+60", out), out
    # The node pulled both images from the test cluster's registry, as a cluster pulls from yours.
    assert pulled <= images, images
    print(f"pulled through the registry: {sorted(pulled)}")
    # `make install` on an installed release upgrades it (helm upgrade --install) instead of failing.
    for run, revision in zip(installs, ("REVISION: 1", "REVISION: 2"), strict=True):
        assert run.returncode == 0 and revision in run.stdout, run.stdout + run.stderr
    print("make install twice:", [next(line for line in r.stdout.splitlines() if "REVISION" in line) for r in installs])


def _remove_node_images(names: set[str]) -> None:
    subprocess.run(["hack/images.sh", "ctr", "images", "rm", *sorted(names)], cwd=REPO_ROOT, capture_output=True,
                   check=False)
    assert not names & _node_images()


def _node_images() -> set[str]:
    out = subprocess.run(["hack/images.sh", "ctr", "images", "ls", "-q"], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True).stdout
    return set(out.split())
