"""The minimal creator: what this API server can do, with no controller in the way.

    .venv/bin/python bench/min_creator.py --kubeconfig K --namespace NS --jobs 1 --workers 1024 --gpus 1

bench/compare.py runs it as a third "operator" of the operator-scale benchmark, under its own
ServiceAccount token, and measures it the same way (pod watch, /proc, audit log).

What it does: builds, before it is told to start, the objects kubetrain's operator creates for
the scenario's jobs that matter to the comparison: per job the headless Service and one Pod per
worker, from kubetrain's own pure builders (`builders.headless_service`, `builders.worker_pod`, on
the TrainingJob that `bench/compare_lib.job_manifest` describes, parsed as the operator parses a
stored job, with the operator's settings as compare.py sets them), serialized to JSON once. It
then opens its connections (one GET /version each), prints "ready", waits for a "go" line on
stdin, POSTs every object (per job: the Service, then the pods) with --concurrency requests in
flight (--client threads: a thread and a keep-alive connection each; aiohttp: one event loop; see
CLIENTS for which is faster here and why), retrying a 429, a 5xx or a dropped connection, prints a
summary, and stays alive until stdin closes so that its CPU seconds and peak RSS can be read.

What it does not do: no watch, no list, no cache, no status, no Events, no reconcile; no
ConfigMap, Role or RoleBinding (kwok mounts nothing, so the pods run without them), and no
ownerReferences on its objects (there is no TrainingJob to own them: the garbage collector would
delete children of an owner that does not exist). It does not
read the TrainingJob from the API server either: its clock starts at "go", while an operator's
starts before the harness creates the jobs. Its times are a floor for this API server, scheduler
and kwok on this machine, not a competing operator.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import ssl
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import compare_lib as cl
import urllib3
from kubernetes import client, config

from kubetrain.core.api import TrainingJob
from kubetrain.core.validate import stored_object
from kubetrain.operator.jobs import builders
from kubetrain.operator.runtime.settings import ENV_TRAINER_IMAGE, parse_settings

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
TRIES = 5
USER_AGENT = "kubetrain-bench-min-creator"


@dataclass(frozen=True)
class Target:
    """Where to send, and as whom: the API server and the ServiceAccount token of a kubeconfig."""

    host: str
    ca_file: str | None
    verify: bool
    headers: dict[str, str]


@dataclass(frozen=True)
class Request:
    path: str
    body: bytes


def load_target(kubeconfig: Path) -> Target:
    cfg = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
    token = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization") or ""
    if not token:
        sys.exit(f"{kubeconfig}: no bearer token (the creator authenticates as a ServiceAccount)")
    auth = token if token.startswith("Bearer ") else f"Bearer {token}"
    headers = {"Authorization": auth, "Content-Type": "application/json", "Accept": "application/json",
               "User-Agent": USER_AGENT}
    return Target(cfg.host.rstrip("/"), cfg.ssl_ca_cert, bool(cfg.verify_ssl), headers)


# --------------------------------------------------------------------------- what to create


def job_objects(manifest: dict[str, Any], settings: builders.WorkerSettings) -> list[dict[str, Any]]:
    """The headless Service and the generation-0 worker pods kubetrain's operator builds for ``manifest``."""
    job, problems, _ = stored_object(TrainingJob, manifest)
    if job is None:
        raise ValueError(f"invalid TrainingJob {manifest['metadata']['name']}: {problems}")
    # owner None: see the module docstring. The operator's own call is builders.worker_pod(job, i, 0,
    # settings, owner) for every index (jobs/plan.py _translate), with no Kueue placement here. The pods run
    # as the namespace's default ServiceAccount: the creator makes no per-job ServiceAccount (nor RBAC).
    pods = [builders.worker_pod(job, i, 0, settings) for i in range(job.spec.workers)]
    for pod in pods:
        pod["spec"].pop("serviceAccountName", None)
    return [builders.headless_service(job), *pods]


def requests_for(sc: cl.Scenario, namespace: str, trainer_image: str) -> list[Request]:
    """Every POST, in the order an operator would make them: job by job, its Service first."""
    settings = parse_settings([], {ENV_TRAINER_IMAGE: trainer_image}).builders
    plural = {"Service": "services", "Pod": "pods"}
    out = []
    for i in range(sc.jobs):
        for obj in job_objects(cl.job_manifest(cl.KUBETRAIN, sc, namespace, i), settings):
            path = f"/api/v1/namespaces/{namespace}/{plural[obj['kind']]}"
            out.append(Request(path, json.dumps(obj, separators=(",", ":")).encode()))
    return out


# --------------------------------------------------------------------------- sending


@dataclass
class Outcome:
    statuses: Counter[int] = field(default_factory=Counter)
    retries: int = 0
    first_error: str = ""
    seconds: float = 0.0
    cpu_s: float = 0.0
    """This process's CPU seconds (all threads) while sending."""

    def record(self, status: int, text: str, retries: int) -> None:
        self.statuses[status] += 1
        self.retries += retries
        if status not in (200, 201, 409) and not self.first_error:
            self.first_error = f"{status}: {text[:300]}"


def run_threads(t: Target, reqs: list[Request], n: int, wait_go: Callable[[], None]) -> Outcome:
    """``n`` threads, each with its own keep-alive HTTPS connection (urllib3), pulling from one queue."""
    work: queue.SimpleQueue[Request | None] = queue.SimpleQueue()
    for r in [*reqs, *[None] * n]:
        work.put(r)
    out, lock = Outcome(), threading.Lock()
    warm, go = threading.Barrier(n + 1), threading.Event()

    def worker() -> None:
        conn = urllib3.connection_from_url(t.host, maxsize=1, block=True, ca_certs=t.ca_file,
                                           cert_reqs="CERT_REQUIRED" if t.verify else "CERT_NONE",
                                           retries=False, timeout=60.0)
        conn.urlopen("GET", "/version", headers=t.headers)  # opens the connection before "go"
        warm.wait(60)
        go.wait()
        while (r := work.get()) is not None:
            status, text, retries = post_sync(conn, t, r)
            with lock:
                out.record(status, text, retries)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(n)]
    for th in threads:
        th.start()
    warm.wait(60)  # BrokenBarrierError if a connection could not be opened
    wait_go()
    t0, cpu0 = time.monotonic(), time.process_time()
    go.set()
    for th in threads:
        th.join()
    out.seconds, out.cpu_s = time.monotonic() - t0, time.process_time() - cpu0
    return out


def post_sync(conn: urllib3.HTTPConnectionPool, t: Target, r: Request) -> tuple[int, str, int]:
    """(status, body, retries): one POST, again after a 429, a 5xx or a dropped connection."""
    for attempt in range(TRIES):
        try:
            resp = conn.urlopen("POST", r.path, body=r.body, headers=t.headers)
            status, text = resp.status, resp.data.decode(errors="replace")
        except urllib3.exceptions.HTTPError as exc:
            status, text = 599, str(exc)
        if status not in RETRY_STATUSES or attempt == TRIES - 1:
            return status, text, attempt
        time.sleep(0.05 * 2**attempt)
    raise AssertionError("unreachable")


def run_aiohttp(t: Target, reqs: list[Request], n: int, wait_go: Callable[[], None]) -> Outcome:
    """One asyncio thread: ``n`` tasks on one aiohttp session with up to ``n`` keep-alive connections."""
    return asyncio.run(_run_aiohttp(t, reqs, n, wait_go))


async def _run_aiohttp(t: Target, reqs: list[Request], n: int, wait_go: Callable[[], None]) -> Outcome:
    ctx = ssl.create_default_context(cafile=t.ca_file)
    if not t.verify:
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    connector = aiohttp.TCPConnector(limit=n, ssl=ctx, keepalive_timeout=300)
    out, todo = Outcome(), iter(reqs)
    async with aiohttp.ClientSession(t.host, connector=connector, headers=t.headers,
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def warm() -> None:
            async with session.get("/version") as resp:
                await resp.read()

        await asyncio.gather(*(warm() for _ in range(n)))  # n requests at once: n connections open
        await asyncio.get_running_loop().run_in_executor(None, wait_go)
        t0, cpu0 = time.monotonic(), time.process_time()

        async def worker() -> None:
            for r in todo:  # one shared iterator: each request goes to exactly one task
                out.record(*await post_async(session, r))

        await asyncio.gather(*(worker() for _ in range(n)))
        out.seconds, out.cpu_s = time.monotonic() - t0, time.process_time() - cpu0
    return out


async def post_async(session: aiohttp.ClientSession, r: Request) -> tuple[int, str, int]:
    for attempt in range(TRIES):
        try:
            async with session.post(r.path, data=r.body) as resp:
                status, text = resp.status, await resp.text(errors="replace")
        except (TimeoutError, aiohttp.ClientError) as exc:
            status, text = 599, str(exc)
        if status not in RETRY_STATUSES or attempt == TRIES - 1:
            return status, text, attempt
        await asyncio.sleep(0.05 * 2**attempt)
    raise AssertionError("unreachable")


# Why threads by default. Both clients send raw HTTP with bodies serialized before the clock (no
# kubernetes client models to build or parse: what is timed is the API server, not the client). On the
# 2-core VM of docs/benchmarks.md (2026-11-26; 1,025 POSTs of a 1024-pod gang, no GPU, 32 in flight,
# a 16-node private cluster, another session's cluster loading the same cores), seven back-to-back
# pairs took threads 2.37, 4.93, 11.46, 12.24, 9.51, 5.52, 4.95 s and aiohttp 3.63, 11.65, 17.66,
# 11.06, 4.77, 6.04, 5.17 s: threads faster in 5 of 7 pairs, in the median (5.5 vs 6.0 s) and at best
# (2.4 vs 3.6 s, the least loaded pair). aiohttp spends less CPU (0.52-0.56 s vs 0.63-0.64 s per
# 1,025), but a creator is limited by how soon its replies are read, not by its CPU (a tenth of one
# core). Probably: 32 threads, each blocked in its own socket with the GIL released during TLS and I/O, are
# woken by the kernel as replies arrive, where one event-loop thread competes for a core with the API
# server's many threads. The noise on a shared 2-core machine is large; aiohttp stays for comparison.
CLIENTS = {"threads": run_threads, "aiohttp": run_aiohttp}
DEFAULT_CLIENT = "threads"
DEFAULT_CONCURRENCY = 32
"""kubetrain's own KUBETRAIN_CREATE_PARALLELISM default (compare.py sets 32 too)."""


# --------------------------------------------------------------------------- main


def wait_for_go() -> None:
    line = sys.stdin.readline()
    if line.strip() != "go":
        sys.exit(f"expected 'go' on stdin, got {line!r}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kubeconfig", type=Path, required=True, help="a ServiceAccount token's kubeconfig")
    p.add_argument("--namespace", required=True)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--workers", type=int, required=True, help="pods per job")
    p.add_argument("--gpus", type=int, default=0, help="nvidia.com/gpu per pod")
    p.add_argument("--client", choices=sorted(CLIENTS), default=DEFAULT_CLIENT)
    p.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY, help="requests in flight")
    p.add_argument("--trainer-image", default=cl.TRAINER_IMAGE, help="the operator's KUBETRAIN_TRAINER_IMAGE")
    p.add_argument("--no-wait", action="store_true", help="start at once and exit when done (no stdin protocol)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sc = cl.Scenario("creator", args.jobs, args.workers, args.gpus)
    reqs = requests_for(sc, args.namespace, args.trainer_image)
    target = load_target(args.kubeconfig)

    def go() -> None:
        print(f"ready: {len(reqs)} objects ({sc.pods} pods), client {args.client}, "
              f"concurrency {args.concurrency}", flush=True)
        if not args.no_wait:
            wait_for_go()

    out = CLIENTS[args.client](target, reqs, args.concurrency, go)
    codes = ", ".join(f"{code} x{n}" for code, n in sorted(out.statuses.items()))
    print(f"done: {len(reqs)} objects in {out.seconds:.2f}s ({len(reqs) / max(out.seconds, 1e-9):.0f}/s), "
          f"CPU {out.cpu_s:.2f}s; HTTP {codes}; {out.retries} retries" + (f"; first error {out.first_error}" if out.first_error else ""),
          flush=True)
    if not args.no_wait:
        sys.stdin.read()  # until the harness closes stdin: it reads our CPU and peak RSS first
    return 0 if not out.first_error else 1


if __name__ == "__main__":
    sys.exit(main())
