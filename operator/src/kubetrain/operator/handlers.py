"""kopf wiring: thin handlers that feed the controller's caches. All logic lives elsewhere.

Run with `python -m kubetrain.operator` (or `kopf run -m kubetrain.operator.handlers`).
Environment: KUBETRAIN_TRAINER_IMAGE, KUBETRAIN_NAMESPACE (watch one namespace;
default all), KUBETRAIN_METRICS_PORT (default 8080), KUBETRAIN_CREATE_PARALLELISM,
KUBETRAIN_RECONCILE_WORKERS,
KUBETRAIN_LEADER_ELECT (a "namespace/name" Lease: reconcile only while holding it),
KUBETRAIN_LEADER_ID (this replica's identity in the Lease).
"""

from __future__ import annotations

import copy
import os
import signal
import socket
import uuid
from typing import Any

import kopf
from kubernetes import client, config
from prometheus_client import start_http_server

from kubetrain.core import api
from kubetrain.operator import builders as b
from kubetrain.operator.controller import Controller
from kubetrain.operator.leader import LeaderElector

STATE: dict[str, Controller] = {}


def controller() -> Controller:
    return STATE["controller"]


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
async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.posting.enabled = False  # we record our own Events with reasons
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.persistence.finalizer = "kubetrain.io/operator"
    settings.persistence.diffbase_storage = _NoDiffBase()
    image = os.environ.get("KUBETRAIN_TRAINER_IMAGE", b.Settings.trainer_image)
    parallelism = int(os.environ.get("KUBETRAIN_CREATE_PARALLELISM", "32"))
    ctl = Controller(
        _api_client(parallelism + 8),  # headroom for calls outside the I/O pool (leader election)
        b.Settings(trainer_image=image),
        create_parallelism=parallelism,
        workers=int(os.environ.get("KUBETRAIN_RECONCILE_WORKERS", "16")),
    )
    STATE["controller"] = ctl
    port = int(os.environ.get("KUBETRAIN_METRICS_PORT", "8080"))
    if port:
        start_http_server(port)
    lease = os.environ.get("KUBETRAIN_LEADER_ELECT")
    await ctl.start(os.environ.get("KUBETRAIN_NAMESPACE") or None, leader_election=bool(lease))
    if lease:
        namespace, _, name = lease.rpartition("/")
        identity = os.environ.get("KUBETRAIN_LEADER_ID") or f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"
        elector = LeaderElector(ctl.api_client, namespace or "default", name, identity,
                                on_start=ctl.start_leading, on_stop=lambda: _lost_lease(ctl))
        STATE["elector"] = elector
        elector.start()


def _lost_lease(ctl: Controller) -> None:
    """Stop reconciling at once, then exit (kopf shuts down; the Deployment restarts the pod as a standby)."""
    ctl.stop_leading()
    os.kill(os.getpid(), signal.SIGTERM)


@kopf.on.cleanup()
async def cleanup(**_: Any) -> None:
    if "elector" in STATE:
        await STATE.pop("elector").release()
    if "controller" in STATE:
        await STATE.pop("controller").stop()


@kopf.on.event(api.GROUP, api.VERSION, api.PLURAL)
def job_event(event: dict[str, Any], body: kopf.Body, **_: Any) -> None:
    controller().job_event(event.get("type"), copy.deepcopy(dict(body)))


@kopf.on.event("", "v1", "pods", labels={b.LABEL_JOB: kopf.PRESENT})
def pod_event(event: dict[str, Any], body: kopf.Body, **_: Any) -> None:
    controller().pod_event(event.get("type"), copy.deepcopy(dict(body)))


@kopf.on.event("", "v1", "nodes")
def node_event(event: dict[str, Any], body: kopf.Body, **_: Any) -> None:
    controller().node_event(event.get("type"), dict(body))
