"""Kueue's real controller manager against the test cluster: built from its Go module by
hack/kueue/build.sh, run as a local process (no image registry here) with its webhooks served on
127.0.0.1 over a throwaway certificate.

What differs from an in-cluster install, and why:
- the webhook configurations Kueue ships (config/components/webhook/manifests.yaml) call a Service;
  here each calls `https://127.0.0.1:<port><path>` with the throwaway CA as its caBundle. Only the
  webhooks on Kueue's own API group are installed. Kueue answers the others too (a no-op for a
  framework that is not enabled), but they are failurePolicy Fail on Pods, Jobs, Deployments and
  StatefulSets in every namespace: each such create in the cluster, by tests that never asked for
  Kueue included, would then depend on this process. So a batch/v1 Job with a queue-name label is
  suspended by Kueue's reconciler just after it is created, not by its webhook at creation;
- Kueue's internal certificate management is off (it would issue a certificate for the Service's DNS
  name); Kueue v0.15 then reads its metrics serving certificate from the fixed path
  /etc/kueue/metrics/certs, so the throwaway pair is written there too;
- the on-demand visibility API server (an aggregated API needing its own APIService) is off.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from .cluster import new_admin_client
from .kubectl import kubectl
from .paths import HACK_DIR
from .ports import free_port
from .processes import run_checked, stop_process
from .resources import wait_established

EXTERNAL_FRAMEWORK = "TrainingJob.v1alpha1.kubetrain.io"
METRICS_CERT_DIR = Path("/etc/kueue/metrics/certs")
WEBHOOK_NAMES = {"MutatingWebhookConfiguration": "kueue-mutating-webhook-configuration",
                 "ValidatingWebhookConfiguration": "kueue-validating-webhook-configuration"}
KUEUE_GROUP = "kueue.x-k8s.io"


def build() -> Path:
    """hack/kueue/build.sh: the binary (built once per pinned version; its progress goes to stderr)."""
    proc = subprocess.run(["bash", str(HACK_DIR / "kueue" / "build.sh")], stdout=subprocess.PIPE, stderr=None,
                          text=True, timeout=3600, check=False)
    if proc.returncode != 0:
        raise AssertionError(f"hack/kueue/build.sh exited {proc.returncode}:\n{proc.stdout[-3000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def build_path() -> Path:
    """Where hack/kueue/build.sh puts the binary (exists once built)."""
    out = run_checked(["bash", str(HACK_DIR / "kueue" / "build.sh"), "--path"], timeout=60).stdout
    return Path(out.strip().splitlines()[-1])


def module_dir() -> Path:
    out = run_checked(["bash", str(HACK_DIR / "kueue" / "build.sh"), "--module-dir"], timeout=600).stdout
    return Path(out.strip().splitlines()[-1])


def make_certs(work: Path) -> bytes:
    """A CA and a serving certificate for 127.0.0.1 (tls.crt, tls.key in `work`); returns the CA's PEM."""
    def ssl(*args: str) -> None:
        run_checked(["openssl", *args], timeout=60)
    ca_key, ca_crt = work / "ca.key", work / "ca.crt"
    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=kubetrain-test-kueue-ca",
        "-keyout", str(ca_key), "-out", str(ca_crt))
    (work / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    ssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", str(work / "tls.key"),
        "-out", str(work / "tls.csr"))
    ssl("x509", "-req", "-in", str(work / "tls.csr"), "-CA", str(ca_crt), "-CAkey", str(ca_key), "-CAcreateserial",
        "-days", "2", "-extfile", str(work / "san.cnf"), "-out", str(work / "tls.crt"))
    return ca_crt.read_bytes()


def configuration(work: Path, webhook_port: int, health_port: int) -> dict[str, Any]:
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta1", "kind": "Configuration",
        "namespace": "kueue-system",
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(work)},
        "internalCertManagement": {"enable": False},
        "leaderElection": {"leaderElect": False},
        "metrics": {"bindAddress": "0"},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "integrations": {"frameworks": ["batch/job"], "externalFrameworks": [EXTERNAL_FRAMEWORK]},
    }


def custom_resource_definitions(crd_dir: Path, port: int, ca: bytes) -> list[dict[str, Any]]:
    """Kueue's CRDs, with the conversion webhook (v1beta1 <-> v1beta2) its kustomization patches in where
    it does (patches/webhook_in_*.yaml, listed in its kustomization.yaml), calling 127.0.0.1:`port`."""
    patches = [Path(p["path"]).stem for p in yaml.safe_load((crd_dir / "kustomization.yaml").read_text())["patches"]]
    patched = {stem.removeprefix("webhook_in_") for stem in patches if stem.startswith("webhook_in_")}
    out = []
    for path in sorted((crd_dir / "bases").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["plural"] in patched:
            crd["spec"]["conversion"] = {"strategy": "Webhook", "webhook": {"conversionReviewVersions": ["v1"],
                "clientConfig": {"url": f"https://127.0.0.1:{port}/convert", "caBundle": base64.b64encode(ca).decode()}}}
        out.append(crd)
    return out


def webhook_configurations(manifests: Path, port: int, ca: bytes) -> list[dict[str, Any]]:
    """Kueue's webhook configurations, calling 127.0.0.1:`port`, with only its own API group's webhooks."""
    out = []
    for doc in yaml.safe_load_all(manifests.read_text()):
        if not doc:
            continue
        hooks = [h for h in doc["webhooks"] if any(KUEUE_GROUP in r.get("apiGroups", []) for r in h["rules"])]
        for hook in hooks:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}",
                                    "caBundle": base64.b64encode(ca).decode()}
        out.append({**doc, "metadata": {"name": WEBHOOK_NAMES[doc["kind"]]}, "webhooks": hooks})
    return out


class Kueue:
    """A running Kueue: `stop()` ends it and removes its webhook configurations (its CRDs stay)."""

    def __init__(self, binary: Path, kubeconfig: Path, work: Path):
        self.binary, self.kubeconfig, self.work = binary, kubeconfig, work
        self.log_path = work / "kueue.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.converted: list[str] = []  # the CRDs whose conversion webhook Kueue serves
        self.health_port = free_port()
        self.webhook_port = free_port()

    def start(self, timeout: float = 180) -> Kueue:
        mod = module_dir()
        ca = make_certs(self.work)
        crds = self.work / "crds.json"
        items = custom_resource_definitions(mod / "config" / "components" / "crd", self.webhook_port, ca)
        self.converted = [c["metadata"]["name"] for c in items if c["spec"].get("conversion")]
        crds.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
        kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crds))
        with new_admin_client(self.kubeconfig) as api:  # 180 s: a loaded CI run once took longer than 60
            wait_established(api, [c["metadata"]["name"] for c in items], timeout=180)
        kubectl("create", "namespace", "kueue-system", check=False)
        METRICS_CERT_DIR.mkdir(parents=True, exist_ok=True)
        for name in ("tls.crt", "tls.key"):
            (METRICS_CERT_DIR / name).write_bytes((self.work / name).read_bytes())
        config = self.work / "config.yaml"
        config.write_text(yaml.safe_dump(configuration(self.work, self.webhook_port, self.health_port)))
        hooks = self.work / "webhooks.json"
        hooks.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": webhook_configurations(
            mod / "config" / "components" / "webhook" / "manifests.yaml", self.webhook_port, ca)}))
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [str(self.binary), f"--config={config}", f"--kubeconfig={self.kubeconfig}",
                 "--feature-gates=VisibilityOnDemand=false", "--zap-log-level=2"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "KUBECONFIG": str(self.kubeconfig)})
        kubectl("apply", "-f", str(hooks))
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        """Until Kueue's readiness probe answers and its Workload webhook takes a dry-run create."""
        deadline = time.monotonic() + timeout
        probe = ["curl", "-fsS", f"http://127.0.0.1:{self.health_port}/readyz"]
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"kueue exited {self.proc.returncode}:\n{self.tail()}")
            ready = subprocess.run(probe, capture_output=True, check=False).returncode == 0
            if ready and self._webhook_answers():
                return
            time.sleep(0.25)
        raise AssertionError(f"kueue not ready within {timeout:.0f}s:\n{self.tail()}")

    def _webhook_answers(self) -> bool:
        wl = {"apiVersion": f"{KUEUE_GROUP}/v1beta1", "kind": "Workload",
              "metadata": {"name": "kueue-probe", "namespace": "default"},
              "spec": {"podSets": [{"name": "main", "count": 1, "template": {"spec": {"containers": [
                  {"name": "c", "image": "x"}]}}}]}}
        probe = self.work / "probe.json"
        probe.write_text(json.dumps(wl))
        return kubectl("create", "--dry-run=server", "-f", str(probe), check=False).returncode == 0

    def tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no kueue log)"

    def stop(self) -> None:
        """Ends Kueue, removes its webhook configurations and turns its CRDs' conversion webhook off: left
        pointing at the stopped process, it would fail every read of a Kueue object, so a namespace still
        holding one (e.g. deleted just before the session ended) would stay Terminating. start() puts it back."""
        for kind, name in WEBHOOK_NAMES.items():
            kubectl("delete", kind.lower(), name, "--ignore-not-found", check=False)
        stop_process(self.proc, group=True)
        no_conversion = json.dumps({"spec": {"conversion": {"strategy": "None", "webhook": None}}})
        for crd in self.converted:
            kubectl("patch", "crd", crd, "--type=merge", "-p", no_conversion, check=False)
