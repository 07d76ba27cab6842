"""Operator scale: time from `create TrainingJob` to all worker pods created, and to all Running.

Runs against the hack/ control plane (make cluster-up) with kwok nodes, starts the
operator as a real process, applies one job of N workers (CPU-only pods, so they fit
on the 4 default kwok nodes up to ~440 pods), and prints the timings.

    .venv/bin/python bench/operator_scale.py --workers 256
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from support.bench_cluster import bench_namespace  # bench/support: a link to tests/support
from support.cluster import kubeconfig_path
from support.kwok import kwok_job
from support.operator_process import OperatorProcess

from kubetrain.core import api
from kubetrain.operator.jobs import builders as b


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=256)
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args()
    core, custom, ns = bench_namespace()
    log = Path("/tmp/kubetrain-bench-operator.log")
    log.unlink(missing_ok=True)  # this run's log only
    op = OperatorProcess(kubeconfig_path(), log)
    op.start()
    try:
        time.sleep(3)  # let the operator list and watch
        body = kwok_job("scale", {"workers": args.workers})
        t0 = time.monotonic()
        custom.create_namespaced_custom_object(api.GROUP, api.VERSION, ns, api.PLURAL, body)
        created = running = None
        while time.monotonic() - t0 < args.timeout:
            pods = core.list_namespaced_pod(ns, label_selector=f"{b.LABEL_JOB}=scale").items
            now = time.monotonic() - t0
            if created is None and len(pods) >= args.workers:
                created = now
            if sum(p.status.phase == "Running" for p in pods) >= args.workers:
                running = now
                break
            print(f"\r{now:6.1f}s pods {len(pods)}/{args.workers}", end="", file=sys.stderr, flush=True)
            time.sleep(0.2)
        print(file=sys.stderr)
        print(f"workers={args.workers} all_pods_created_s={created:.2f} all_running_s={running:.2f}"
              if created and running else f"timed out: created={created} running={running}")
        return 0 if running else 1
    finally:
        op.stop()
        core.delete_namespace(ns)


if __name__ == "__main__":
    sys.exit(main())
