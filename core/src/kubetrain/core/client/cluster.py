"""The client for a cluster: the API server of a kubeconfig context, or the one a pod runs in.

The kubernetes package is imported when a ClusterClient is made (kubetrain.core does not depend
on it: `pip install kubetrain-core[kube]`, or the operator's package). Every request goes through
`_call`, which turns the HTTP client's exceptions into the typed errors of
kubetrain.core.client.errors, keeping the API server's message.
"""

from __future__ import annotations

import builtins
import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError

from kubetrain.core import workdir
from kubetrain.core.api import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    SWEEP_KIND,
    SWEEP_PLURAL,
    VERSION,
    TrainingJob,
    TrainingSweep,
)
from kubetrain.core.client.errors import ApiError, ClientError, InvalidManifest, api_error
from kubetrain.core.client.model import Event, Manifest, TrainingClient, Worker, load_manifest, selector_text
from kubetrain.core.contract import CONTAINER, LABEL_GENERATION, LABEL_INDEX, LABEL_JOB

IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
DROPPED_METADATA = ("managedFields",)
"""Metadata the models leave out: large, and of use to no reader of a job."""

Parsed = TypeVar("Parsed", TrainingJob, TrainingSweep)


def _kubernetes() -> tuple[Any, Any, Any]:
    try:
        import urllib3  # noqa: PLC0415 - the kubernetes package's HTTP client
        from kubernetes import client, config  # noqa: PLC0415 - optional: only a cluster client needs it
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ClientError("a cluster client needs the kubernetes package: pip install 'kubetrain-core[kube]'") from exc
    return client, config, urllib3


def _default_kubeconfig_exists(kubeconfig: str | None) -> bool:
    if kubeconfig or os.environ.get("KUBECONFIG"):
        return True
    return Path("~/.kube/config").expanduser().is_file()


def connect(kubeconfig: str | None = None, context: str | None = None) -> tuple[Any, str]:
    """(an ApiClient, the namespace to use by default): the kubeconfig's context (its namespace, else default),
    or inside a pod without a kubeconfig its ServiceAccount's credentials and namespace."""
    client, config, _ = _kubernetes()
    if not _default_kubeconfig_exists(kubeconfig) and os.environ.get("KUBERNETES_SERVICE_HOST"):
        cfg = client.Configuration()
        config.load_incluster_config(client_configuration=cfg)
        ns = IN_CLUSTER_NAMESPACE.read_text().strip() if IN_CLUSTER_NAMESPACE.is_file() else "default"
        return client.ApiClient(cfg), ns
    try:
        api = config.new_client_from_config(config_file=kubeconfig, context=context)
        contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)
    except (config.ConfigException, OSError, TypeError) as exc:
        raise ClientError(f"no usable kubeconfig: {exc}") from None
    if context:
        active = next((c for c in contexts if c["name"] == context), active)
    return api, (active or {}).get("context", {}).get("namespace") or "default"


def parse(model: type[Parsed], body: Mapping[str, Any]) -> Parsed:
    """An object as the API server returned it, as `model` (metadata kept whole: uid, creationTimestamp, ...)."""
    meta = {k: v for k, v in (body.get("metadata") or {}).items() if k not in DROPPED_METADATA}
    try:
        return model.model_validate({**body, "metadata": meta})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ClientError(f"{body.get('kind')} {meta.get('namespace')}/{meta.get('name')} as stored does not fit this "
                          f"kubetrain's API models ({exc.error_count()} problem(s), first {where}: {first['msg']}); "
                          "are the client and the CRD of the same release?") from None


def worker_of(pod: Mapping[str, Any]) -> Worker:
    """A worker pod (its JSON) as a Worker: its phase, and why it is not running when it is not."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    labels = meta.get("labels") or {}
    state, message, code, restarts = "", "", None, 0
    for c in status.get("containerStatuses") or []:
        if c.get("name") != CONTAINER:
            continue
        restarts = int(c.get("restartCount") or 0)
        current = c.get("state") or {}
        detail = current.get("waiting") or current.get("terminated") or {}
        state, message = str(detail.get("reason") or ""), str(detail.get("message") or "")
        code = (current.get("terminated") or {}).get("exitCode")
    for cond in status.get("conditions") or []:
        if not state and cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            state, message = str(cond.get("reason") or "Unschedulable"), str(cond.get("message") or "")
    return Worker(index=int(labels.get(LABEL_INDEX, "0")), generation=int(labels.get(LABEL_GENERATION, "0")),
                  phase=str(status.get("phase") or "Pending"), name=str(meta.get("name") or ""),
                  node=str((pod.get("spec") or {}).get("nodeName") or ""), state=state, message=message,
                  exit_code=code, restarts=restarts)


def event_of(ev: Mapping[str, Any]) -> Event:
    source = ev.get("source") or {}
    return Event(type=str(ev.get("type") or ""), reason=str(ev.get("reason") or ""),
                 message=str(ev.get("message") or ""),
                 time=ev.get("lastTimestamp") or ev.get("eventTime") or ev.get("firstTimestamp")
                 or (ev.get("metadata") or {}).get("creationTimestamp"),
                 count=int(ev.get("count") or 1), source=str(source.get("component") or ev.get("reportingComponent") or ""))


class ClusterClient(TrainingClient):
    """TrainingJobs and TrainingSweeps on a cluster.

    ClusterClient() uses the current kubeconfig context (or, in a pod, its ServiceAccount); `namespace`
    overrides the context's; `api_client` is a kubernetes ApiClient of your own (another identity, say).
    """

    def __init__(self, namespace: str | None = None, *, kubeconfig: str | None = None, context: str | None = None,
                 api_client: Any = None, poll_seconds: float = 2.0):
        client, _, urllib3 = _kubernetes()
        default_ns = "default"
        if api_client is None:
            api_client, default_ns = connect(kubeconfig, context)
        self.api = api_client
        self.namespace = namespace or default_ns
        self.poll_seconds = poll_seconds
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        # What a request can raise besides a bug: the API server's refusal, and the connection's failures.
        self.transport_errors: tuple[type[Exception], ...] = (client.ApiException, urllib3.exceptions.HTTPError, OSError)

    # ------------------------------------------------------------------ plumbing

    def _call(self, what: str, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """func(*args, **kwargs); an exception of the HTTP client becomes the typed error, without its traceback."""
        try:
            return func(*args, **kwargs)
        except self.transport_errors as exc:
            raise api_error(exc, what) from None

    def _json(self, obj: Any) -> Any:
        """A kubernetes model object as the API server's JSON (camelCase keys)."""
        return self.api.sanitize_for_serialization(obj)

    def _object(self, plural: str, name: str, what: str) -> dict[str, Any]:
        return dict(self._call(f"{what} {self.namespace}/{name}", self.custom.get_namespaced_custom_object,
                               GROUP, VERSION, self.namespace, plural, name))

    def _items(self, plural: str, what: str, selector: str | Mapping[str, str] | None,
               all_namespaces: bool) -> builtins.list[dict[str, Any]]:
        kw = {"label_selector": sel} if (sel := selector_text(selector)) else {}
        if all_namespaces:
            found = self._call(f"listing {what}s", self.custom.list_cluster_custom_object, GROUP, VERSION, plural, **kw)
        else:
            found = self._call(f"listing {what}s in namespace {self.namespace}",
                               self.custom.list_namespaced_custom_object, GROUP, VERSION, self.namespace, plural, **kw)
        return sorted(found.get("items") or [], key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))

    # ------------------------------------------------------------------ TrainingJobs

    def submit(self, obj: Manifest, namespace: str | None = None,
               workdir: str | Path | None = None) -> TrainingJob | TrainingSweep:
        """Create the job (or sweep). ``workdir``: a TrainingJob's directory to ship (kubetrain.core.workdir): packed
        into a ConfigMap first, named in spec.workdir, and owned by the job once it exists."""
        body, model = load_manifest(obj)
        ns = namespace or model.metadata.namespace or self.namespace
        body["apiVersion"], body["metadata"]["namespace"] = API_VERSION, ns
        name = body["metadata"].get("name") or f"{body['metadata'].get('generateName', '')}*"
        sweep = body.get("kind") == SWEEP_KIND
        shipped = self._ship_workdir(body, ns, Path(workdir)) if workdir is not None else None
        try:
            created = self._call(f"submitting {ns}/{name}", self.custom.create_namespaced_custom_object,
                                 GROUP, VERSION, ns, SWEEP_PLURAL if sweep else PLURAL, body)
        except ClientError:
            if shipped is not None and not shipped["metadata"].get("ownerReferences"):
                self._drop(shipped, ns)  # no job will own it: nothing would ever delete it
            raise
        if shipped is not None:
            self._own(shipped, ns, created)
        return parse(TrainingSweep, created) if sweep else parse(TrainingJob, created)

    def _drop(self, cm: dict[str, Any], ns: str) -> None:
        """Delete a workdir ConfigMap no job owns; best effort (the submit's own error is the one to report)."""
        with contextlib.suppress(ClientError):
            self._call(f"deleting ConfigMap {ns}/{cm['metadata']['name']}", self.core.delete_namespaced_config_map,
                       cm["metadata"]["name"], ns)

    def _ship_workdir(self, body: dict[str, Any], ns: str, directory: Path) -> dict[str, Any]:
        """The ConfigMap of ``directory``, created (or found: the same tree has the same name), and spec.workdir
        naming it in ``body``."""
        name = body["metadata"].get("name")
        if body.get("kind") == SWEEP_KIND or not name:
            raise InvalidManifest(str(directory), ["--workdir ships a TrainingJob's directory: the manifest must be "
                                                   "a TrainingJob with metadata.name"])
        try:
            archive = workdir.pack(directory)
        except workdir.WorkdirError as exc:
            raise InvalidManifest(str(directory), [str(exc)]) from None
        cm = workdir.config_map(workdir.config_map_name(name, archive), ns, name, archive)
        try:
            found = self._call(f"creating ConfigMap {ns}/{cm['metadata']['name']}",
                               self.core.create_namespaced_config_map, ns, cm)
        except ApiError as exc:
            if exc.reason != "AlreadyExists":
                raise
            found = self._call("reading the ConfigMap", self.core.read_namespaced_config_map,
                               cm["metadata"]["name"], ns)
        body["spec"]["workdir"] = {"configMap": cm["metadata"]["name"]}
        return dict(self._json(found))

    def _own(self, cm: dict[str, Any], ns: str, job: dict[str, Any]) -> None:
        """The job becomes an owner of its workdir ConfigMap (deleted with the last job that ships it). An owner
        added, never replacing one: a job of the same name deleted a moment ago may still be listed there."""
        meta = job["metadata"]
        owners = [o for o in cm["metadata"].get("ownerReferences") or [] if o.get("uid") != meta["uid"]]
        owners.append({"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"], "uid": meta["uid"]})
        self._call(f"owning ConfigMap {ns}/{cm['metadata']['name']}", self.core.patch_namespaced_config_map,
                   cm["metadata"]["name"], ns, {"metadata": {"ownerReferences": owners}})

    def get(self, name: str) -> TrainingJob:
        return parse(TrainingJob, self._object(PLURAL, name, KIND))

    def list(self, selector: str | Mapping[str, str] | None = None, all_namespaces: bool = False) -> builtins.list[TrainingJob]:
        return [parse(TrainingJob, o) for o in self._items(PLURAL, KIND, selector, all_namespaces)]

    def delete(self, name: str) -> None:
        self._call(f"deleting {KIND} {self.namespace}/{name}", self.custom.delete_namespaced_custom_object,
                   GROUP, VERSION, self.namespace, PLURAL, name)

    def _set_suspend(self, name: str, value: bool) -> TrainingJob:
        verb = "suspending" if value else "resuming"
        patched = self._call(f"{verb} {KIND} {self.namespace}/{name}", self.custom.patch_namespaced_custom_object,
                             GROUP, VERSION, self.namespace, PLURAL, name, {"spec": {"suspend": value}})
        return parse(TrainingJob, patched)

    def suspend(self, name: str) -> TrainingJob:
        return self._set_suspend(name, True)

    def resume(self, name: str) -> TrainingJob:
        return self._set_suspend(name, False)

    def events(self, name: str, kind: str = KIND) -> builtins.list[Event]:
        found = self._call(f"listing events of {self.namespace}/{name}", self.core.list_namespaced_event,
                           self.namespace, field_selector=f"involvedObject.name={name}")
        mine = [e for e in self._json(found).get("items") or [] if (e.get("involvedObject") or {}).get("kind") == kind]
        return sorted((event_of(e) for e in mine), key=lambda e: e.time or "")

    def _pods(self, name: str, rank: int | None = None) -> builtins.list[dict[str, Any]]:
        selector = f"{LABEL_JOB}={name}" + ("" if rank is None else f",{LABEL_INDEX}={rank}")
        found = self._call(f"listing pods of {self.namespace}/{name}", self.core.list_namespaced_pod,
                           self.namespace, label_selector=selector)
        return list(self._json(found).get("items") or [])

    def workers(self, name: str) -> builtins.list[Worker]:
        found = [worker_of(p) for p in self._pods(name)]
        newest = max((w.generation for w in found), default=0)
        return sorted((w for w in found if w.generation == newest), key=lambda w: w.index)

    def _worker_pod(self, name: str, rank: int) -> str:
        self._object(PLURAL, name, KIND)  # a clear "not found" for a wrong job name
        pods = self._pods(name, rank)
        if not pods:
            raise ClientError(f"{KIND} {self.namespace}/{name} has no pod for rank {rank} (yet)")
        newest = max(pods, key=lambda p: (int(p["metadata"].get("labels", {}).get(LABEL_GENERATION, "0")),
                                          p["metadata"].get("creationTimestamp") or ""))
        return str(newest["metadata"]["name"])

    def _log_text(self, name: str, rank: int, tail: int | None) -> str:
        pod = self._worker_pod(name, rank)
        kw = {"container": CONTAINER, **({"tail_lines": tail} if tail is not None else {})}
        return str(self._call(f"logs of pod {self.namespace}/{pod}", self.core.read_namespaced_pod_log,
                              pod, self.namespace, **kw))

    def _log_stream(self, name: str, rank: int, tail: int | None) -> Iterator[str]:
        pod = self._worker_pod(name, rank)
        what = f"logs of pod {self.namespace}/{pod}"
        kw = {"container": CONTAINER, **({"tail_lines": tail} if tail is not None else {})}
        resp = self._call(what, self.core.read_namespaced_pod_log, pod, self.namespace, follow=True,
                          _preload_content=False, **kw)
        try:
            for chunk in resp.stream():
                yield chunk.decode(errors="replace")
        except self.transport_errors as exc:  # a connection cut mid-stream
            raise api_error(exc, what) from None
        finally:
            resp.release_conn()

    # ------------------------------------------------------------------ TrainingSweeps

    def get_sweep(self, name: str) -> TrainingSweep:
        return parse(TrainingSweep, self._object(SWEEP_PLURAL, name, SWEEP_KIND))

    def list_sweeps(self, selector: str | Mapping[str, str] | None = None,
                    all_namespaces: bool = False) -> builtins.list[TrainingSweep]:
        return [parse(TrainingSweep, o) for o in self._items(SWEEP_PLURAL, SWEEP_KIND, selector, all_namespaces)]

    def delete_sweep(self, name: str) -> None:
        """Delete the sweep (its trial jobs are deleted with it)."""
        self._call(f"deleting {SWEEP_KIND} {self.namespace}/{name}", self.custom.delete_namespaced_custom_object,
                   GROUP, VERSION, self.namespace, SWEEP_PLURAL, name)
