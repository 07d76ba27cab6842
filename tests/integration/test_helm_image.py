"""The images `make images` builds (hack/images.sh: buildah on local Debian bases, loaded into the
real node's containerd; see tests/support/helm_image.py). The operator image runs as uid 65532 without torch, and
the operator inside it runs a TrainingJob to Running on the test cluster under the chart's own RBAC
identity. The trainer image runs as uid 1000 in /workspace with torch, DeepSpeed and the trainer,
ships the example data, and trains the quickstart (one worker, a few steps) as a pod would start it.

They run wherever the real node does (the `real_node` fixture has built and loaded the images;
the first build takes ~7 min on 2 cores with torch's wheels, later ones seconds) and skip with
the reason elsewhere, never under CI=true.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from support import helm_image as hi
from support import helm_tool as ht
from support.helm_rbac import ChartIdentity, assert_no_forbidden, run_job_to_running
from support.operator_process import OperatorProcess
from support.paths import QUICKSTART, REPO_ROOT
from support.ports import free_port

from kubetrain.core import contract

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def image(real_node: None) -> str:
    return hi.build("operator")  # up to date: the real_node fixture built it


@pytest.fixture(scope="module")
def trainer_image(real_node: None) -> str:
    return hi.build("trainer")


def test_image_metadata_and_user(image: str) -> None:
    assert hi.inspect(image, "{{.OCIv1.Config.User}}") == "65532:65532"
    assert hi.inspect(image, "{{.OCIv1.Config.Entrypoint}}") == "[python -m kubetrain.operator]"
    proc = hi.node_run(image, "sh", "-c", "id -u; python -c 'import importlib.util as u, kubetrain.operator.handlers; "
                                          "print(u.find_spec(\"torch\"))'; touch /opt/kubetrain/x || echo read-only")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["65532", "None", "read-only"]


def test_trainer_image_has_torch_deepspeed_and_the_example_data(trainer_image: str) -> None:
    assert hi.inspect(trainer_image, "{{.OCIv1.Config.User}}") == "1000:1000"
    torch_pin = next(line.split("==")[1] for line in (REPO_ROOT / "requirements-dev.txt").read_text().splitlines()
                     if line.startswith("torch=="))
    proc = hi.node_run(trainer_image, "sh", "-c", "id -u; pwd; test -r data/licenses.txt && echo data-readable; "
                                                  "python -c 'import torch, deepspeed, kubetrain.trainer.loop; "
                                                  "print(torch.__version__)'")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[:3] == ["1000", "/workspace", "data-readable"]
    assert proc.stdout.split()[-1].startswith(torch_pin)


def test_trainer_image_trains_the_quickstart(trainer_image: str, tmp_path: Path) -> None:
    """examples/quickstart.yaml as is (data.path `data`, relative to /workspace), cut to 1 worker, 4 steps."""
    spec = yaml.safe_load(QUICKSTART.read_text())["spec"]
    spec.update(workers=1, maxSteps=4)
    (tmp_path / "config.json").write_text(json.dumps(spec))
    tmp_path.chmod(0o755)
    (tmp_path / "config.json").chmod(0o644)
    placement = contract.WorkerPlacement(node_rank=0, local_rank=0, procs_per_worker=1, workers=1)
    env = {
        **contract.torch_env(placement, "127.0.0.1", free_port()),
        **contract.kubetrain_env(job="quickstart", namespace="default", config_path="/etc/kubetrain/config.json",
                                 checkpoint_dir="/tmp/checkpoints", output_dir="/tmp/output", restart_generation=0,
                                 metrics_port=0),
        "OMP_NUM_THREADS": "1",
    }
    proc = hi.node_run(trainer_image, "python", "-m", "kubetrain.trainer", env=env, mounts={tmp_path: "/etc/kubetrain"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "step 4/4" in out
    assert "checkpoint step 4 committed" in out


def test_operator_image_runs_a_job_under_the_chart_identity(
    image: str, kube_cluster: Any, admin_api: client.ApiClient, namespace: str, tmp_path: Path
) -> None:
    ht.require_helm()
    with ChartIdentity(admin_api, namespace, tmp_path, **{"rbac.scope": "namespaced"}) as ident:
        os.chown(ident.kubeconfig, 65532, 65532)  # readable by the image's user only
        with hi.Container(image) as ctr:
            cmd = ctr.command("python", "-m", "kubetrain.operator", f"--namespace={namespace}",
                              f"--liveness=http://127.0.0.1:{free_port()}/healthz",
                              env={"KUBECONFIG": "/etc/kubetrain/kubeconfig", "KUBETRAIN_METRICS_PORT": "0"},
                              volumes={ident.kubeconfig: "/etc/kubetrain/kubeconfig"})
            # `buildah run` in a process group of its own: stopping it stops the operator inside.
            with OperatorProcess(ident.kubeconfig, tmp_path / "operator.log", command=cmd, own_session=True,
                                 grace=20) as op:
                status = run_job_to_running(admin_api, namespace, op, "image")
                assert status["workersSummary"] == "2/2"
            assert_no_forbidden(op)
