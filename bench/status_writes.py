"""API writes per running job per minute at steady state: the operator's, and rank 0's progress channel.

Runs against the hack/ control plane (make cluster-up) with kwok nodes: starts the operator as a real
process, creates --jobs TrainingJobs of 2 workers, waits until all run, then for --seconds plays rank 0 of
each job as the trainer does (a merge patch of the progress annotation on worker 0 every 10 s, the step
advancing) and reads the operator's kubetrain_operator_api_writes_total before and after.

    .venv/bin/python bench/status_writes.py --jobs 20 --seconds 180
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

from kubernetes import client
from support.bench_cluster import bench_namespace  # bench/support: a link to tests/support
from support.cluster import kubeconfig_path
from support.kwok import kwok_job
from support.operator_process import OperatorProcess
from support.ports import free_port

from kubetrain.core import api, contract
from kubetrain.operator.jobs import builders as b

PROGRESS_INTERVAL = 10.0
"""As the trainer's default KUBETRAIN_PROGRESS_INTERVAL_SECONDS."""
WRITE = re.compile(r'^kubetrain_operator_api_writes_total\{resource="([^"]*)",verb="([^"]*)"\} ([0-9.e+]+)$')


def writes(port: int) -> Counter[str]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: Counter[str] = Counter()
    for line in text.splitlines():
        if m := WRITE.match(line):
            out[f"{m[2]} {m[1]}"] += int(float(m[3]))
    return out


def report_progress(core: client.CoreV1Api, ns: str, jobs: list[str], step: int) -> None:
    """Rank 0 of every job, as observe/progress.py sends it: the whole record in one annotation."""
    for job in jobs:
        record = {"job": job, "generation": 0, "step": step, "maxSteps": 100000, "loss": 5.0 - step * 1e-3,
                  "stepSeconds": 0.5, "tokensPerSecond": 1000.0, "worldSize": 2, "time": time.strftime("%FT%TZ")}
        body = {"metadata": {"annotations": {contract.PROGRESS_ANNOTATION: json.dumps(record)}}}
        core.patch_namespaced_pod(b.worker_name(job, 0), ns, body)


def running(custom: client.CustomObjectsApi, ns: str) -> int:
    items = custom.list_namespaced_custom_object(api.GROUP, api.VERSION, ns, api.PLURAL)["items"]
    return sum((j.get("status") or {}).get("phase") == "Running" for j in items)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", type=int, default=20)
    p.add_argument("--seconds", type=float, default=180)
    args = p.parse_args()
    core, custom, ns = bench_namespace()
    port = free_port()
    op = OperatorProcess(kubeconfig_path(), Path("/tmp/kubetrain-bench-writes.log"), metrics_port=port)
    op.start()
    try:
        names = [f"w{i}" for i in range(args.jobs)]
        for name in names:
            custom.create_namespaced_custom_object(api.GROUP, api.VERSION, ns, api.PLURAL,
                                                   kwok_job(name, {"workers": 2}))
        deadline = time.monotonic() + 300
        while running(custom, ns) < args.jobs:
            if time.monotonic() > deadline:
                print("timed out waiting for the jobs to run", file=sys.stderr)
                return 1
            time.sleep(1)
        report_progress(core, ns, names, 1)
        time.sleep(PROGRESS_INTERVAL)  # the first report's writes (status takes its first progress) stay out
        before, t0, step, patches = writes(port), time.monotonic(), 1, 0
        while (elapsed := time.monotonic() - t0) < args.seconds:
            step += 20
            report_progress(core, ns, names, step)
            patches += len(names)
            print(f"\r{elapsed:5.0f}s / {args.seconds:.0f}s", end="", file=sys.stderr, flush=True)
            time.sleep(max(0.0, PROGRESS_INTERVAL - (time.monotonic() - t0 - elapsed)))
        minutes = (time.monotonic() - t0) / 60
        delta = writes(port) - before
        print(file=sys.stderr)
        per = {k: round(v / args.jobs / minutes, 2) for k, v in sorted(delta.items())}
        total = round(sum(delta.values()) / args.jobs / minutes, 2)
        print(f"jobs={args.jobs} minutes={minutes:.2f} operator_writes_per_job_per_min={total} by_call={per} "
              f"progress_patches_per_job_per_min={patches / args.jobs / minutes:.2f}")
        return 0
    finally:
        op.stop()
        core.delete_namespace(ns)


if __name__ == "__main__":
    sys.exit(main())
