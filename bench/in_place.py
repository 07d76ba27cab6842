"""In-place gang restart against recreating every pod, in one run, on the hack/ test cluster.

    .venv/bin/python bench/in_place.py                 # kwok (32 workers) and real pods
    .venv/bin/python bench/in_place.py --workers 0     # real pods only
    .venv/bin/python bench/in_place.py --skip-real     # kwok only (no real node needed)
    .venv/bin/python bench/in_place.py --json bench/results/in-place.json

kwok: one job of --workers CPU-only workers on the cluster's 4 kwok nodes (128 workers at the scale of
bench/compare.py's recovery-128, which runs kubetrain in place too), checkpoints on a claim bound
to a static volume (in-place restarts need durable checkpoints), backoffSeconds 0; worker N/2 fails (exit
1, kwok's failure stage). Measured from the bench's pod watch: seconds from that pod seen Failed to every
worker of generation 1 Running (and, kept ones, told their generation), and how many pods were recreated.

Real pods: the quickstart (2 workers, fp32, 120 steps, a checkpoint every 10) on the real node, rank 1
exits 137 at step 35 (KUBETRAIN_FAIL_AT), backoffSeconds 0. Measured from the container runtime's log
timestamps (one clock: the node is this machine): rank 1's "injected failure" line to rank 0's first step
line of generation 1.

Each restart mode runs once per invocation, in place first, then recreating (restartPolicy.inPlace false).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from kubernetes import client, config, watch
from support.cluster import cluster_running, cluster_up, kubeconfig_path  # bench/support: a link to tests/support
from support.kubectl import kubectl
from support.kwok import KWOK_NAMESPACE_ANNOTATIONS, fail_pod, kwok_job, static_claim
from support.operator_process import OperatorProcess
from support.real_pods import TRAINER_IMAGE, RealJobs, build_images, quickstart, real_node_missing
from support.resources import wait_default_service_account

from kubetrain.core import api, contract

MODES = {"in place": True, "recreate": False}


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@contextmanager
def namespace(core: client.CoreV1Api, annotations: dict[str, str] | None) -> Iterator[str]:
    ns = f"bench-inplace-{uuid.uuid4().hex[:6]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns, annotations=annotations)))
    wait_default_service_account(core, ns, timeout=60)
    try:
        yield ns
    finally:
        core.delete_namespace(ns)
        # Gone before the next run: kwok's deletes of this run's pods would load the next one's cluster.
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and any(n.metadata.name == ns for n in core.list_namespace().items):
            time.sleep(0.5)


# --------------------------------------------------------------------------- kwok


class PodWatch(threading.Thread):
    """The job's pods as a watch shows them, and when each condition below first held."""

    def __init__(self, core: client.CoreV1Api, ns: str, job: str) -> None:
        super().__init__(daemon=True)
        self.core, self.ns, self.selector = core, ns, f"{contract.LABEL_JOB}={job}"
        self.pods: dict[str, Any] = {}
        self.lock = threading.Lock()
        self.stopped = threading.Event()

    def run(self) -> None:
        w = watch.Watch()
        while not self.stopped.is_set():
            for ev in w.stream(self.core.list_namespaced_pod, self.ns, label_selector=self.selector,
                               timeout_seconds=5):
                with self.lock:
                    if ev["type"] == "DELETED":
                        self.pods.pop(ev["object"].metadata.name, None)
                    else:
                        self.pods[ev["object"].metadata.name] = ev["object"]

    def wait(self, check: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> float:
        """time.monotonic() once check(pods) holds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if check(self.pods):
                    return time.monotonic()
            time.sleep(0.01)
        raise TimeoutError(what)


def gang_running(workers: int, generation: int) -> Callable[[dict[str, Any]], bool]:
    """Every worker Running in one generation >= `generation` (and, a kept one, told it)."""
    def check(pods: dict[str, Any]) -> bool:
        gens = {p.metadata.labels.get(contract.LABEL_GENERATION) for p in pods.values()}
        if len(pods) != workers or len(gens) != 1 or int(gens.pop() or -1) < generation:
            return False
        return all(p.status.phase == "Running" and not p.metadata.deletion_timestamp
                   and (p.metadata.annotations or {}).get(contract.GENERATION_ANNOTATION)
                   == p.metadata.labels.get(contract.LABEL_GENERATION) for p in pods.values())
    return check


def kwok_restart(core: client.CoreV1Api, custom: client.CustomObjectsApi, workers: int, in_place: bool,
                 timeout: float) -> dict[str, Any]:
    with namespace(core, KWOK_NAMESPACE_ANNOTATIONS) as ns:
        volume = static_claim(core, ns)
        try:
            spec = {"workers": workers, "checkpoint": {"claimName": "checkpoints"},
                    "restartPolicy": {"backoffSeconds": 0, "inPlace": in_place}}
            custom.create_namespaced_custom_object(api.GROUP, api.VERSION, ns, api.PLURAL, kwok_job("rec", spec))
            pods = PodWatch(core, ns, "rec")
            pods.start()
            pods.wait(gang_running(workers, 0), timeout, "generation 0 Running")
            before = {n: p.metadata.uid for n, p in pods.pods.items()}
            victim = f"rec-worker-{workers // 2}"
            fail_pod(core, ns, victim)
            failed = pods.wait(lambda ps: victim in ps and ps[victim].status.phase == "Failed", timeout, "failed")
            running = pods.wait(gang_running(workers, 1), timeout, "generation 1 Running")
            pods.stopped.set()
            recreated = sum(p.metadata.uid != before.get(n) for n, p in pods.pods.items())
            status = custom.get_namespaced_custom_object(api.GROUP, api.VERSION, ns, api.PLURAL, "rec")["status"]
            # More than one restart: kwok deleted a re-created pod by name (kwok's pod-delete stage has no
            # UID precondition; bench/compare_lib.unrequested_deletes), which a real kubelet never does.
            return {"workers": workers, "failure_to_all_running_s": round(running - failed, 3),
                    "pods_recreated": recreated, "restarts": status.get("restartCount")}
        finally:
            core.delete_persistent_volume(volume)


# --------------------------------------------------------------------------- real pods

STEP = re.compile(r"^step (\d+)/")


def stamped(line: str) -> tuple[float, str]:
    """A `kubectl logs --timestamps` line: (epoch seconds, the text)."""
    stamp, _, text = line.partition(" ")
    return datetime.fromisoformat(stamp[:26].rstrip("Z") + "+00:00").timestamp(), text


def follow(core: client.CoreV1Api, ns: str, pod: str, into: list[str]) -> threading.Thread:
    def run() -> None:
        stream = core.read_namespaced_pod_log(pod, ns, follow=True, timestamps=True, _preload_content=False)
        for raw in stream.stream():
            into.extend(raw.decode(errors="replace").splitlines())
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def first_step_after_resume(lines: list[str], after: float) -> float:
    """When rank 0 logged its first step after resuming (the first step line after `after` that follows a
    'resumed from' line)."""
    resumed = False
    for line in lines:
        t, text = stamped(line)
        if t < after:
            continue
        resumed = resumed or "resumed from" in text
        if resumed and STEP.match(text.strip()):
            return t
    raise AssertionError("rank 0 logged no step after resuming:\n" + "\n".join(lines[-30:]))


def real_restart(core: client.CoreV1Api, admin: client.ApiClient, in_place: bool) -> dict[str, Any]:
    with namespace(core, None) as ns:
        jobs = RealJobs(admin, ns)
        body = quickstart(precision="fp32", maxSteps=120, checkpoint={"everySteps": 10, "keep": 3},
                          restartPolicy={"backoffSeconds": 0, "inPlace": in_place},
                          env=[{"name": contract.FAIL_AT, "value": "1:35"}])
        name = jobs.create(body, name="rec")
        jobs.wait(name, lambda st: st.get("phase") == "Running", 600, "Running")
        worker1: list[str] = []
        follow(core, ns, f"{name}-worker-1", worker1)
        before = {p.metadata.name: p.metadata.uid for p in jobs.pods(name)}
        st = jobs.wait_phase(name, "Succeeded", timeout=900)
        failed_at = next(stamped(x)[0] for x in worker1 if "injected failure" in x)
        rank0 = core.read_namespaced_pod_log(f"{name}-worker-0", ns, timestamps=True).splitlines()
        first = first_step_after_resume(rank0, failed_at)
        recreated = sum(p.metadata.uid != before.get(p.metadata.name) for p in jobs.pods(name))
        told = next((t for t, text in map(stamped, rank0) if t >= failed_at and "starting generation" in text), None)
        return {"failure_to_first_step_s": round(first - failed_at, 3), "pods_recreated": recreated,
                "failure_to_kept_launcher_told_s": None if told is None else round(told - failed_at, 3),
                "restarts": st.get("restartCount"), "resumed_from_step": st.get("resumedFromStep")}


# --------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> dict[str, Any]:
    config.load_kube_config(str(kubeconfig_path()))
    admin = client.ApiClient()
    core, custom = client.CoreV1Api(admin), client.CustomObjectsApi(admin)
    out: dict[str, Any] = {"kwok": {}, "real": {}}
    real = not args.skip_real and real_node_missing(core) is None
    if real:
        build_images()
    log = Path("/tmp/kubetrain-bench-in-place-operator.log")
    with OperatorProcess(kubeconfig_path(), log, trainer_image=TRAINER_IMAGE):
        for mode, in_place in MODES.items() if args.workers else ():
            say(f"kwok, {args.workers} workers, {mode}")
            out["kwok"][mode] = kwok_restart(core, custom, args.workers, in_place, args.timeout)
            say(f"  {out['kwok'][mode]}")
        for mode, in_place in MODES.items() if real else ():
            say(f"real pods, {mode}")
            out["real"][mode] = real_restart(core, admin, in_place)
            say(f"  {out['real'][mode]}")
    if not real and not args.skip_real:
        out["real"] = {"skipped": real_node_missing(core)}
    return out


def table(out: dict[str, Any]) -> str:
    rows = ["| | in place | recreate |", "|---|---|---|"]
    for key, title in (("failure_to_all_running_s", "kwok: failure -> all Running (s)"),
                       ("pods_recreated", "kwok: pods recreated"), ("restarts", "kwok: gang restarts")):
        rows.append(f"| {title} | " + " | ".join(str(out["kwok"].get(m, {}).get(key, "-")) for m in MODES) + " |")
    for key, title in (("failure_to_first_step_s", "real pods: failure -> first step (s)"),
                       ("pods_recreated", "real pods: pods recreated")):
        rows.append(f"| {title} | " + " | ".join(str(out["real"].get(m, {}).get(key, "-")) for m in MODES) + " |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=32, help="kwok workers (0: no kwok run)")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--skip-real", action="store_true", help="kwok only")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if not cluster_running():
        cluster_up()
    os.environ["KUBECONFIG"] = str(kubeconfig_path())
    apply_crd()
    out = run(args)
    print(table(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


def apply_crd() -> None:
    """The CRD of this checkout (an in-place field the cluster's copy may lack)."""
    crd = "/tmp/kubetrain-bench-in-place-crd.yaml"
    subprocess.run([sys.executable, "-m", "kubetrain.core", "crd", "-o", crd], check=True)
    kubectl("apply", "--server-side", "--force-conflicts", "-f", crd)


if __name__ == "__main__":
    sys.exit(main())
