"""The operator image, built here from the root Dockerfile with buildah (see helm_image.py for how,
with no registry), runs as uid 65532 without torch, and the operator inside it runs a TrainingJob
to Running on the test cluster under the chart's own RBAC identity.

Opt-in: KUBETRAIN_IMAGE_TESTS=1 (needs root and `apt-get install buildah debootstrap`; the first
build takes ~3 min on 2 cores, later ones reuse buildah's layer cache).
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import helm_image as hi
import helm_tool as ht
import pytest
from helm_rbac import ChartIdentity, assert_no_forbidden, run_job_to_running
from kubernetes import client

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def image() -> str:
    if os.environ.get("KUBETRAIN_IMAGE_TESTS") != "1":
        pytest.skip("image build tests are opt-in (1-3 min): KUBETRAIN_IMAGE_TESTS=1")
    why = hi.unavailable()
    if why:
        pytest.skip(f"cannot build images here: {why}")
    try:
        ht.helm_binary()
    except ht.HelmUnavailable as exc:
        pytest.skip(str(exc))
    return hi.build_operator()


def test_image_metadata_and_user(image: str) -> None:
    assert hi.inspect(image, "{{.OCIv1.Config.User}}") == "65532:65532"
    assert hi.inspect(image, "{{.OCIv1.Config.Entrypoint}}") == "[python -m kubetrain.operator]"
    with hi.Container(image) as ctr:
        proc = ctr.run("sh", "-c", "id -u; python -c 'import importlib.util as u, kubetrain.operator.handlers; "
                                   "print(u.find_spec(\"torch\"))'; touch /opt/kubetrain/x || echo read-only")
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["65532", "None", "read-only"]


class _Proc:
    """The operator inside the image, as `buildah run` in its own process group; log kept."""

    def __init__(self, cmd: list[str], log: Path):
        self.cmd, self.log_path = cmd, log

    def __enter__(self) -> _Proc:
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def __exit__(self, *_: object) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])


def test_operator_image_runs_a_job_under_the_chart_identity(
    image: str, kube_cluster: Any, admin_api: client.ApiClient, namespace: str, tmp_path: Path
) -> None:
    with ChartIdentity(admin_api, namespace, tmp_path, **{"rbac.scope": "namespaced"}) as ident:
        os.chown(ident.kubeconfig, 65532, 65532)  # readable by the image's user only
        with hi.Container(image) as ctr:
            cmd = ctr.command("python", "-m", "kubetrain.operator", f"--namespace={namespace}",
                              f"--liveness=http://127.0.0.1:{ht.free_port()}/healthz",
                              env={"KUBECONFIG": "/etc/kubetrain/kubeconfig", "KUBETRAIN_METRICS_PORT": "0"},
                              volumes={ident.kubeconfig: "/etc/kubetrain/kubeconfig"})
            with _Proc(cmd, tmp_path / "operator.log") as op:
                status = run_job_to_running(admin_api, namespace, op, "image")  # type: ignore[arg-type]
                assert status["workersSummary"] == "2/2"
            assert_no_forbidden(op)  # type: ignore[arg-type]
