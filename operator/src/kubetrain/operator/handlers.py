"""kopf wiring: thin handlers that feed the controller's caches. All logic lives elsewhere.

Worker pods are not kopf's: the controller watches them itself (jobs/pod_watch.py), for speed.

The watch handlers are coroutines: kopf runs a plain function in a thread pool, and the caches and
the work queue (asyncio events) belong to the event loop's thread; a thread hop per event also
cost CPU of its own. They keep the event's object itself, no copy: kopf parses every event afresh and
keeps no reference to it once the handlers ran (it would for daemons and timers, which this operator
does not register), so the caches own it (a deep copy of a pod event, when kopf still watched pods,
was 0.4 ms).

Run with `python -m kubetrain.operator` (__main__.py): it builds the OperatorSettings once and
hands them to kopf as `memo` (an OperatorMemo); startup() adds the Controller to it, and kopf
passes that memo (a shallow copy per object, sharing both) to every handler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import kopf
from kubernetes import client, config
from prometheus_client import start_http_server

from kubetrain.core import api, contract
from kubetrain.operator.controller import Controller
from kubetrain.operator.runtime.leader import LeaderElector
from kubetrain.operator.runtime.settings import OperatorSettings

API_CALLS_OUTSIDE_POOL = 8
"""Connections beyond the applier's pool: leader election's calls run on threads of their own."""


@dataclass
class OperatorMemo:
    """kopf's `memo`: the settings from __main__, and what startup() builds from them."""

    settings: OperatorSettings
    controller: Controller | None = None
    elector: LeaderElector | None = None

    def running(self) -> Controller:
        if self.controller is None:  # kopf runs the startup handlers before it starts watching
            raise RuntimeError("a watch event before the operator's startup handler ran")
        return self.controller


def _api_client(pool_size: int) -> client.ApiClient:
    """A client whose connection pool holds ``pool_size`` connections: one per concurrent API call.

    (The kubernetes client's default is 5 x CPUs; with more threads calling at once, every call
    beyond it opened a new TLS connection and dropped it: "Connection pool is full".)"""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    cfg = client.Configuration.get_default_copy()
    cfg.connection_pool_maxsize = max(cfg.connection_pool_maxsize or 1, pool_size)
    # The proxy the environment names for this host, fixed: the token refresh hook sets the host again
    # before every call, and each time the whole environment was read to find the proxy anew (65 us a
    # call) although the connection pool, built once, never uses another.
    cfg.proxy = cfg.proxy
    return client.ApiClient(cfg)


class _NoDiffBase(kopf.DiffBaseStorage):
    """No change detection: kopf builds an object's "essence" (a deep copy of the whole body) on
    every watch event, to diff it for on.create/on.update handlers. Ours are all on.event handlers,
    so that copy was thrown away, once per pod event (a quarter of the operator's CPU on a 1024-pod gang)."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return kopf.BodyEssence()

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: OperatorMemo, **_: Any) -> None:
    settings.posting.enabled = False  # we record our own Events with reasons
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.persistence.diffbase_storage = _NoDiffBase()
    ours = memo.settings
    ctl = Controller(_api_client(ours.create_parallelism + API_CALLS_OUTSIDE_POOL), ours)
    memo.controller = ctl
    if ours.metrics_port:
        start_http_server(ours.metrics_port)
    await ctl.start()
    if ours.leader_election is not None:
        memo.elector = LeaderElector(ctl.api_client, ours.leader_election,
                                     on_start=ctl.start_leading, on_stop=ctl.stop_leading)
        memo.elector.start()


@kopf.on.cleanup()
async def cleanup(memo: OperatorMemo, **_: Any) -> None:
    if memo.elector is not None:
        await memo.elector.release()
    if memo.controller is not None:
        await memo.controller.stop()


@kopf.on.event(api.GROUP, api.VERSION, api.PLURAL)
async def job_event(event: kopf.RawEvent, memo: Any, **_: Any) -> None:
    memo.running().job_event(event.get("type"), event["object"])


@kopf.on.event(api.GROUP, api.VERSION, api.SWEEP_PLURAL)
async def sweep_event(event: kopf.RawEvent, memo: Any, **_: Any) -> None:
    memo.running().sweeps.sweep_event(event.get("type"), event["object"])


@kopf.on.event(contract.KUEUE_GROUP, contract.KUEUE_VERSION, contract.WORKLOAD_PLURAL,
               labels={contract.LABEL_JOB: kopf.PRESENT})
async def workload_event(event: kopf.RawEvent, memo: Any, **_: Any) -> None:
    """Kueue's Workloads of queued jobs (kopf warns and watches nothing where Kueue is not installed)."""
    memo.running().workload_event(event.get("type"), event["object"])


@kopf.on.event("", "v1", "nodes")
async def node_event(event: kopf.RawEvent, memo: Any, **_: Any) -> None:
    memo.running().node_event(event.get("type"), event["object"])
