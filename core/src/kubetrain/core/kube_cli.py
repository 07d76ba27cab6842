"""`kubetrain submit | list | status | logs`: TrainingJobs on the cluster of the current kubeconfig.

The kubernetes client is imported only when one of these commands runs (kubetrain.core does
not depend on it; install it with the operator package or `pip install kubernetes`).
`register(subparsers)` adds the commands to the `kubetrain` CLI.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kubetrain.core.api import API_VERSION, GROUP, KIND, PLURAL, VERSION
from kubetrain.core.contract import CONTAINER, LABEL_GENERATION, LABEL_INDEX, LABEL_JOB, parse_time
from kubetrain.core.validate import ManifestError, load_documents, load_job


class CliError(Exception):
    """A problem to print as one line (exit 1)."""


def _clients(args: argparse.Namespace) -> tuple[Any, Any, str]:
    """(CustomObjectsApi, CoreV1Api, namespace) for the kubeconfig context."""
    try:
        from kubernetes import client, config  # noqa: PLC0415 - optional: only these commands need it
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise CliError("these commands need the kubernetes client: pip install kubernetes") from exc
    try:
        config.load_kube_config(config_file=args.kubeconfig, context=args.context)
        _, active = config.list_kube_config_contexts(config_file=args.kubeconfig)
    except (config.ConfigException, OSError, TypeError) as exc:
        raise CliError(f"no usable kubeconfig: {exc}") from exc
    if args.context:
        contexts, _ = config.list_kube_config_contexts(config_file=args.kubeconfig)
        active = next((c for c in contexts if c["name"] == args.context), active)
    ns = args.namespace or (active or {}).get("context", {}).get("namespace") or "default"
    api = client.ApiClient()
    return client.CustomObjectsApi(api), client.CoreV1Api(api), ns


def _api_error(exc: Exception, what: str) -> CliError:
    status = getattr(exc, "status", None)
    body = getattr(exc, "body", None)
    message = str(exc)
    if body:
        try:
            message = json.loads(body).get("message", message)
        except (ValueError, AttributeError):
            message = str(body)
    if status == 404:
        return CliError(f"{what}: not found")
    return CliError(f"{what}: {message}" if status is None else f"{what}: {message} (HTTP {status})")


def _age(ts: str | None, now: datetime) -> str:
    then = parse_time(ts)
    if then is None:
        return "-"
    seconds = int((now - then).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("   ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


# ----------------------------------------------------------------------------------- commands


def cmd_submit(args: argparse.Namespace) -> int:
    try:
        job = load_job(Path(args.file))
        # Submit what the user wrote (the API server applies the CRD's defaults), not a dump of the model.
        body = next(d for d in load_documents(Path(args.file)) if isinstance(d, dict) and d.get("kind") == KIND)
    except ManifestError as exc:
        print(exc, file=sys.stderr)
        return 2
    except OSError as exc:
        raise CliError(f"{args.file}: cannot read: {exc.strerror}") from exc
    custom, _, ns = _clients(args)
    body.pop("status", None)
    body["apiVersion"] = API_VERSION
    ns = args.namespace or job.metadata.namespace or ns
    body["metadata"]["namespace"] = ns
    what = body["metadata"].get("name") or f"{body['metadata'].get('generateName', '')}*"
    try:
        created = custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body)
    except Exception as exc:
        raise _api_error(exc, f"submitting {ns}/{what}") from exc
    name = (created.get("metadata") or {}).get("name") if isinstance(created, dict) else None
    print(f"trainingjob.{GROUP}/{name or job.metadata.name} created in namespace {ns}")  # generateName: the API's
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    custom, _, ns = _clients(args)
    try:
        if args.all_namespaces:
            items = custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)["items"]
        else:
            items = custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]
    except Exception as exc:
        raise _api_error(exc, "listing TrainingJobs") from exc
    if not items:
        print("No TrainingJobs found" + ("" if args.all_namespaces else f" in namespace {ns}."), file=sys.stderr)
        return 0
    now = datetime.now(UTC)
    head = (["NAMESPACE"] if args.all_namespaces else []) + ["NAME", "PHASE", "WORKERS", "STEP", "RESTARTS", "AGE"]
    rows = [head]
    for j in sorted(items, key=lambda j: (j["metadata"].get("namespace", ""), j["metadata"]["name"])):
        st = j.get("status") or {}
        step = f"{st.get('currentStep', 0)}/{st['maxSteps']}" if st.get("maxSteps") else str(st.get("currentStep", 0))
        rows.append(([j["metadata"]["namespace"]] if args.all_namespaces else []) + [
            j["metadata"]["name"], st.get("phase", "Pending"), st.get("workersSummary") or "-", step,
            str(st.get("restartCount", 0)), _age(j["metadata"].get("creationTimestamp"), now)])
    print(_table(rows))
    return 0


def _get(custom: Any, ns: str, name: str) -> dict[str, Any]:
    try:
        return custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
    except Exception as exc:
        raise _api_error(exc, f"TrainingJob {ns}/{name}") from exc


def cmd_status(args: argparse.Namespace) -> int:
    custom, _, ns = _clients(args)
    job = _get(custom, ns, args.name)
    st = job.get("status") or {}
    if args.output == "json":
        print(json.dumps({"name": args.name, "namespace": ns, "status": st}, indent=2))
        return 0
    lines = [
        f"Name:        {args.name}",
        f"Namespace:   {ns}",
        f"Phase:       {st.get('phase', 'Pending')}" + (f" ({st['reason']})" if st.get("reason") else ""),
        f"Workers:     {st.get('workersSummary') or '-'}",
        f"Step:        {st.get('currentStep', 0)}" + (f"/{st['maxSteps']}" if st.get("maxSteps") else "")
        + (f"  loss {st['loss']}" if st.get("loss") else "")
        + (f"  ({st['percentComplete']}, ETA {st.get('eta') or '-'})" if st.get("percentComplete") else ""),
        f"Restarts:    {st.get('restartCount', 0)} (generation {st.get('restartGeneration', 0)})",
    ]
    if st.get("tokensPerSecond"):
        lines.append(f"Throughput:  {st['tokensPerSecond']:,} tokens/s" + (f", MFU {st['mfu']}" if st.get("mfu") else ""))
    if st.get("failures"):
        lines.append("Failures:    " + ", ".join(f"{k}={v}" for k, v in sorted(st["failures"].items())))
    ckpt = st.get("lastCheckpoint")
    if ckpt:
        lines.append(f"Checkpoint:  step {ckpt.get('step')} at {ckpt.get('path')} ({ckpt.get('time', '')})")
    if st.get("resumedFromStep") or st.get("resumedFrom"):
        tier = f" ({st['resumedFrom']} tier)" if st.get("resumedFrom") else ""
        lines.append(f"Resumed:     from step {st.get('resumedFromStep', 0)}{tier}")
    if st.get("message"):
        lines.append(f"Message:     {st['message']}")
    lines += _hang_lines(st.get("lastHang"))
    conds = st.get("conditions") or []
    if conds:
        lines.append("Conditions:")
        rows = [["TYPE", "STATUS", "REASON", "LAST TRANSITION", "MESSAGE"]] + [
            [c.get("type", ""), c.get("status", ""), c.get("reason", ""), c.get("lastTransitionTime") or "",
             c.get("message", "")] for c in conds]
        lines += ["  " + line for line in _table(rows).splitlines()]
    print("\n".join(lines))
    return 0


def _hang_lines(hang: dict[str, Any] | None) -> list[str]:
    """status.lastHang: the verdict, when and where the stacks are."""
    if not hang:
        return []
    return [f"Last hang:   {hang.get('time', '')} generation {hang.get('generation')} step {hang.get('step')}: "
            f"{hang.get('message', '')}",
            f"             silent {hang.get('silentSeconds')}s (limit {hang.get('limitSeconds')}s); stacks in "
            f"{hang.get('dumps') or '-'} (the checkpoint volume) and the workers' previous logs"]


def cmd_logs(args: argparse.Namespace) -> int:
    custom, core, ns = _clients(args)
    _get(custom, ns, args.name)  # a clear "not found" for a wrong job name
    selector = f"{LABEL_JOB}={args.name},{LABEL_INDEX}={args.rank}"
    try:
        pods = core.list_namespaced_pod(ns, label_selector=selector).items
    except Exception as exc:
        raise _api_error(exc, f"listing pods of {ns}/{args.name}") from exc
    if not pods:
        raise CliError(f"TrainingJob {ns}/{args.name} has no pod for rank {args.rank} (yet)")

    def generation(p: Any) -> int:
        return int((p.metadata.labels or {}).get(LABEL_GENERATION, "0"))

    pod = max(pods, key=lambda p: (generation(p), p.metadata.creation_timestamp))
    kwargs: dict[str, Any] = {"container": CONTAINER}
    if args.tail is not None:
        kwargs["tail_lines"] = args.tail
    try:
        if args.follow:
            resp = core.read_namespaced_pod_log(pod.metadata.name, ns, follow=True, _preload_content=False, **kwargs)
            for chunk in resp.stream():
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()
        else:
            sys.stdout.write(core.read_namespaced_pod_log(pod.metadata.name, ns, **kwargs))
    except Exception as exc:
        raise _api_error(exc, f"logs of pod {ns}/{pod.metadata.name}") from exc
    return 0


def _wrap(func: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        try:
            return int(func(args))
        except CliError as exc:
            print(f"kubetrain: {exc}", file=sys.stderr)
            return 1

    return run


def register(subparsers: Any) -> None:
    """Add submit, list, status and logs to the `kubetrain` CLI's subparsers."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-n", "--namespace", help="namespace (default: the kubeconfig context's, else default)")
    common.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
    common.add_argument("--context", help="kubeconfig context (default: the current one)")

    s = subparsers.add_parser("submit", parents=[common], help="validate a TrainingJob manifest and create it on the cluster")
    s.add_argument("file", metavar="FILE")
    s.set_defaults(func=_wrap(cmd_submit))

    ls = subparsers.add_parser("list", parents=[common], help="list TrainingJobs with phase, workers, step and restarts")
    ls.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace")
    ls.set_defaults(func=_wrap(cmd_list))

    st = subparsers.add_parser("status", parents=[common], help="a TrainingJob's phase, progress, restarts and conditions")
    st.add_argument("name", metavar="NAME")
    st.add_argument("-o", "--output", choices=["text", "json"], default="text")
    st.set_defaults(func=_wrap(cmd_status))

    lg = subparsers.add_parser("logs", parents=[common], help="logs of one worker (rank 0 by default) of the current gang")
    lg.add_argument("name", metavar="NAME")
    lg.add_argument("--rank", type=int, default=0, help="worker index (default 0)")
    lg.add_argument("-f", "--follow", action="store_true")
    lg.add_argument("--tail", type=int, help="only the last N lines")
    lg.set_defaults(func=_wrap(cmd_logs))
