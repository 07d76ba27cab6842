"""`kubetrain submit | list | status | describe | logs | wait | suspend | resume | delete`: TrainingJobs on the
cluster of the current kubeconfig (or, with --local, the runs of this machine), through kubetrain.core.client.

The kubernetes client is imported only when a cluster command runs (kubetrain.core does not depend
on it; install it with the operator package or `pip install kubernetes`).
`register(subparsers)` adds the commands to the `kubetrain` CLI.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import yaml

from kubetrain.core.api import (
    ADMITTED,
    GROUP,
    Condition,
    ConditionReason,
    Phase,
    TrainingJob,
    TrainingJobStatus,
    TrainingSweep,
    TrainingSweepStatus,
)
from kubetrain.core.client import (
    ClientError,
    ClusterClient,
    InvalidManifest,
    JobFailed,
    LocalClient,
    NotFound,
    WaitTimeout,
)
from kubetrain.core.client.describe import age, describe_text, status_lines, table
from kubetrain.core.client.model import ProgressUpdate, TrainingClient
from kubetrain.core.sweep import report as sweep_report

CliError = ClientError
"""A problem printed as one line (exit 1): every error of the client."""


def _client(args: argparse.Namespace) -> TrainingClient:
    if getattr(args, "local", False):
        return LocalClient(args.root)
    return ClusterClient(args.namespace, kubeconfig=args.kubeconfig, context=args.context)


def _dump(data: Any, output: str) -> None:
    """-o json|yaml: what kubectl prints for the same flag."""
    if output == "json":
        print(json.dumps(data, indent=2))
    else:
        sys.stdout.write(yaml.safe_dump(data, sort_keys=False))


def _wire(obj: TrainingJob | TrainingSweep) -> dict[str, Any]:
    """An object as the API server shows it (its metadata whole)."""
    return obj.model_dump(by_alias=True, exclude_none=True, mode="json")


# ----------------------------------------------------------------------------------- commands


def cmd_submit(args: argparse.Namespace) -> int:
    client = _client(args)
    try:
        # -n overrides the manifest's namespace on a cluster, as it always has
        created = (client.submit(args.file, namespace=args.namespace, workdir=args.workdir)
                   if isinstance(client, ClusterClient) else client.submit(args.file, workdir=args.workdir))
    except InvalidManifest as exc:
        for problem in exc.problems:
            print(f"{exc.source}: {problem}", file=sys.stderr)
        return 2
    kind = created.kind.lower()
    print(f"{kind}.{GROUP}/{created.metadata.name} created in namespace {created.metadata.namespace}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    client = _client(args)
    every = bool(args.all_namespaces) and isinstance(client, ClusterClient)
    items = client.list(args.selector, all_namespaces=True) if isinstance(client, ClusterClient) and every \
        else client.list(args.selector)
    if args.output in ("json", "yaml"):
        _dump({"apiVersion": "v1", "kind": "List", "items": [_wire(j) for j in items]}, args.output)
        return 0
    if not items:
        where = "" if every else f" in namespace {getattr(client, 'namespace', 'local')}."
        print("No TrainingJobs found" + where, file=sys.stderr)
        return 0
    now = datetime.now(UTC)
    rows = [(["NAMESPACE"] if every else []) + ["NAME", "PHASE", "WORKERS", "STEP", "RESTARTS", "AGE"]]
    for j in items:
        st, meta = j.status or TrainingJobStatus(), j.metadata  # no status yet: Pending, as the operator will say
        step = f"{st.current_step}/{st.max_steps}" if st.max_steps else str(st.current_step)
        rows.append(([meta.namespace or ""] if every else []) + [
            meta.name, st.phase, st.workers_summary or "-", step, str(st.restart_count),
            age(getattr(meta, "creationTimestamp", None), now)])
    print(table(rows))
    return 0


SWEEP_PREFIXES = ("sweep/", "trainingsweep/", "trainingsweeps/")
"""`kubetrain status sweep/NAME`: a TrainingSweep, kubectl's TYPE/NAME way (a plain NAME that no job has is
looked up as a sweep too)."""


def _sweep_or_job(client: TrainingClient, name: str) -> TrainingSweep | TrainingJob:
    if name.startswith(SWEEP_PREFIXES):
        return client.get_sweep(name.split("/", 1)[1])
    try:
        return client.get(name)
    except NotFound:
        try:
            return client.get_sweep(name)
        except NotFound:
            pass
        raise


def sweep_lines(sweep: TrainingSweep, describe: bool = False) -> list[str]:
    """`kubetrain status` of a sweep: its phase and message, then the trials table (the best marked `*`);
    `describe` adds each finished trial's message and the best trial's job."""
    st, name = sweep.status or TrainingSweepStatus(), sweep.metadata.name
    lines = [f"Name:        {name}", f"Namespace:   {sweep.metadata.namespace or '-'}",
             f"Phase:       {st.phase} ({st.reason or '-'})", f"Message:     {st.message or '-'}",
             *sweep_report.table(name, sweep.spec, st)]
    if describe:
        lines += [f"  trial {t.index} ({t.job_name}): {t.message}" for t in st.trials if t.message]
        best = next((t for t in st.trials if t.index == st.best_trial), None)
        if best is not None:
            lines.append(f"Best:        trial {best.index}, job {best.job_name} "
                         f"(`kubetrain describe {best.job_name}`)")
    return lines


def cmd_status(args: argparse.Namespace) -> int:
    client = _client(args)
    found = _sweep_or_job(client, args.name)
    if isinstance(found, TrainingSweep):
        return _show_sweep(found, args.output, describe=False)
    job = found
    ns = job.metadata.namespace or "-"
    st = job.status.dump() if job.status else {}
    if args.output in ("json", "yaml"):
        _dump({"name": args.name, "namespace": ns, "status": st}, args.output)
        return 0
    print("\n".join(status_lines(args.name, ns, job.status or TrainingJobStatus())))
    return 0


def _show_sweep(sweep: TrainingSweep, output: str, describe: bool) -> int:
    if output in ("json", "yaml"):
        _dump(_wire(sweep), output)
    else:
        print("\n".join(sweep_lines(sweep, describe)))
    return 0


def cmd_describe(args: argparse.Namespace) -> int:
    client = _client(args)
    found = _sweep_or_job(client, args.name)
    if isinstance(found, TrainingSweep):
        return _show_sweep(found, args.output, describe=True)
    job = found
    events, workers = client.events(args.name), client.workers(args.name)
    if args.output in ("json", "yaml"):
        _dump({**_wire(job), "events": [e.__dict__ for e in events], "workers": [w.__dict__ for w in workers]},
              args.output)
        return 0
    print(describe_text(job, events, workers, datetime.now(UTC)))
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.follow:
        for chunk in client.logs(args.name, args.rank, follow=True, tail=args.tail):
            sys.stdout.write(chunk)
            sys.stdout.flush()
    else:
        sys.stdout.write(client.logs(args.name, args.rank, tail=args.tail))
    return 0


def progress_line(u: ProgressUpdate) -> str:
    """One line per change `kubetrain wait` sees."""
    step = f"step {u.step}/{u.max_steps}" if u.max_steps else f"step {u.step}"
    return (f"{u.name}: {u.phase}" + (f" ({u.reason})" if u.reason else "") + f", {step}"
            + (f", loss {u.loss:.4f}" if u.loss is not None else "") + (f", ETA {u.eta}" if u.eta else ""))


def cmd_wait(args: argparse.Namespace) -> int:
    client = _client(args)
    show: Callable[[ProgressUpdate], None] | None = None if args.quiet else (lambda u: print(progress_line(u), flush=True))
    try:
        job = client.wait(args.name, until=args.until, timeout=args.timeout, on_progress=show)
    except JobFailed as exc:
        print(f"kubetrain: {exc}", file=sys.stderr)
        return 1
    except WaitTimeout as exc:
        print(f"kubetrain: {exc}", file=sys.stderr)
        return 1
    print(f"trainingjob.{GROUP}/{args.name} {job.status.phase if job.status else args.until}")
    return 0


SETTLE_SECONDS = 30.0
"""How long `suspend` / `resume` watch the job after the request, to say what happened rather than what was asked."""


def _patch_verb(verb: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        client = _client(args)
        suspending = verb == "suspended"
        job = client.suspend(args.name) if suspending else client.resume(args.name)
        deadline = time.monotonic() + args.wait
        while not _settled(job, suspending) and time.monotonic() < deadline:
            time.sleep(1.0)
            job = client.get(args.name)
        print(outcome_line(job, suspending, args.wait))
        return 0

    return run


def _settled(job: TrainingJob, suspending: bool) -> bool:
    """The request has had its effect: Suspended; or, resuming, running again or waiting for its queue."""
    phase = job.status.phase if job.status else None
    if suspending:
        return phase == Phase.SUSPENDED
    admitted = _admitted(job)
    return phase not in (Phase.SUSPENDED, None) or (
        admitted is not None and admitted.reason not in (ConditionReason.DEACTIVATED, ConditionReason.EVICTED))


def _admitted(job: TrainingJob) -> Condition | None:
    return next((c for c in (job.status.conditions if job.status else []) if c.type == ADMITTED), None)


def outcome_line(job: TrainingJob, suspending: bool, waited: float) -> str:
    """What `suspend` / `resume` print: the phase the job reached, and its queue's word where it has one."""
    name = f"trainingjob.{GROUP}/{job.metadata.name}"
    phase = job.status.phase if job.status else None
    admitted = _admitted(job)
    queue = f"; Kueue: {admitted.reason}: {admitted.message}" if admitted is not None else ""
    if not _settled(job, suspending):
        what = "suspend" if suspending else "resume"
        return (f"{name} {what} requested (spec.suspend: {str(suspending).lower()}); phase still {phase} after "
                f"{waited:.0f}s{queue}: see `kubetrain describe {job.metadata.name}`")
    if suspending:
        return f"{name} suspended (phase {phase}{queue})"
    return f"{name} resumed (phase {phase}{queue})"


def cmd_delete(args: argparse.Namespace) -> int:
    _client(args).delete(args.name)
    print(f"trainingjob.{GROUP}/{args.name} deleted")
    return 0


def _wrap(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return int(func(args))
        except ClientError as exc:
            print(f"kubetrain: {exc}", file=sys.stderr)
            return 1

    return run


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-n", "--namespace", help="namespace (default: the kubeconfig context's, else default)")
    common.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)")
    common.add_argument("--context", help="kubeconfig context (default: the current one)")
    common.add_argument("--local", action="store_true",
                        help="the runs of this machine (kubetrain.client.LocalClient under --root), not a cluster")
    common.add_argument("--root", default="runs", help="with --local: where the runs are (default runs/)")
    return common


def register(subparsers: Any) -> None:
    """Add the cluster commands to the `kubetrain` CLI's subparsers."""
    common = _common()

    def add(name: str, func: Callable[[argparse.Namespace], int], text: str) -> argparse.ArgumentParser:
        p = subparsers.add_parser(name, parents=[common], help=text)
        p.set_defaults(func=_wrap(func))
        return p

    def output(p: argparse.ArgumentParser, default: str) -> None:
        p.add_argument("-o", "--output", choices=[default, "json", "yaml"], default=default)

    submit = add("submit", cmd_submit, "validate a TrainingJob (or TrainingSweep) manifest and create it")
    submit.add_argument("file", metavar="FILE")
    submit.add_argument("--workdir", metavar="DIR", help="ship DIR with the job (at most 900 KiB packed): every "
                        "worker runs in a copy of it, where a relative command and data.path resolve")
    ls = add("list", cmd_list, "list TrainingJobs with phase, workers, step and restarts")
    ls.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace")
    ls.add_argument("-l", "--selector", help="label selector (e.g. team=nlp,tier!=dev)")
    output(ls, "table")
    verbs: tuple[tuple[str, Callable[[argparse.Namespace], int], str], ...] = (("status", cmd_status, "a TrainingJob's phase, progress, restarts and conditions (sweep/NAME: a "
                                       "TrainingSweep's trials and best)"),
                             ("describe", cmd_describe, "status, workers, goodput, recent Events and what to do next "
                                                        "(sweep/NAME: its trials' outcomes and best job)"))
    for name, func, text in verbs:
        p = add(name, func, text)
        p.add_argument("name", metavar="NAME")
        output(p, "text")
    lg = add("logs", cmd_logs, "logs of one worker (rank 0 by default) of the current gang")
    lg.add_argument("name", metavar="NAME")
    lg.add_argument("--rank", type=int, default=0, help="worker index (default 0; with --local: the process rank)")
    lg.add_argument("-f", "--follow", action="store_true")
    lg.add_argument("--tail", type=int, help="only the last N lines")
    w = add("wait", cmd_wait, "wait until a TrainingJob is Succeeded (or --for PHASE); exit 1 when it fails")
    w.add_argument("name", metavar="NAME")
    w.add_argument("--for", dest="until", default="Succeeded", metavar="PHASE",
                   choices=["Created", "Running", "Suspended", "Succeeded", "Failed"],
                   help="the phase to wait for (default Succeeded)")
    w.add_argument("--timeout", type=float, help="give up after this many seconds (exit 1)")
    w.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    for name, func, text in (("suspend", _patch_verb("suspended"), "stop the workers after a checkpoint; keep the job"),
                             ("resume", _patch_verb("resumed"), "start a suspended job again from its checkpoint")):
        p = add(name, func, text)
        p.add_argument("name", metavar="NAME")
        p.add_argument("--wait", type=float, default=SETTLE_SECONDS, metavar="SECONDS",
                       help=f"watch the job this long for the outcome it prints (default {SETTLE_SECONDS:.0f}; 0: not)")
    add("delete", cmd_delete, "delete a TrainingJob (its workers stop)").add_argument("name", metavar="NAME")
