"""Rank 0 tells the operator how far it got: the `kubetrain.io/progress` annotation on its own pod.

The operator reads that annotation on worker 0 (the JSON of
:class:`kubetrain.core.progress.Progress`, the same record as ``progress.json``) for the
job's status (currentStep, loss, lastCheckpoint, lastProgressTime) and for
``restartPolicy.progressDeadlineSeconds``. It cannot read files inside a pod, so rank 0
merge-patches the annotation through the API server:

- only in a pod: ``KUBETRAIN_POD_NAME`` and ``KUBETRAIN_POD_NAMESPACE`` (the operator sets them
  from the Downward API), the ServiceAccount token and CA at the standard paths, and
  ``KUBERNETES_SERVICE_HOST``/``_PORT``; the operator's Role ``<job>-progress`` lets the
  workers' ServiceAccount get and patch exactly the pod ``<job>-worker-0``;
- from a background thread, newest record wins: at most every
  ``KUBETRAIN_PROGRESS_INTERVAL_SECONDS`` (10), at once when forced (a checkpoint commit, the
  end). Every request has a timeout (``KUBETRAIN_PROGRESS_TIMEOUT_SECONDS``, 5); a slow or
  unreachable API server never blocks or fails training: one warning, then a retry per interval.

Standard library only (urllib, ssl): no Kubernetes client in the image. Overrides (tests, or a
non-standard mount): ``KUBETRAIN_API_SERVER`` (URL), ``KUBETRAIN_TOKEN_FILE``, ``KUBETRAIN_CA_FILE``.

Custom scripts (``spec.command``) call :func:`report_progress` on rank 0, or run
``python -m kubetrain.trainer.observe.progress --step N [--loss L] ...`` (see docs/trainer.md).
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import ssl
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from kubetrain.core import contract
from kubetrain.core.progress import CheckpointRecord, Progress, write_progress

log = logging.getLogger("kubetrain.trainer.progress")

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
API_SERVER_ENV = "KUBETRAIN_API_SERVER"
"""Base URL of the API server; default https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT."""
TOKEN_FILE_ENV = "KUBETRAIN_TOKEN_FILE"
"""Bearer token file; default the pod's ServiceAccount token (re-read for every request: it rotates)."""
CA_FILE_ENV = "KUBETRAIN_CA_FILE"
"""CA bundle that signs the API server's certificate; default the ServiceAccount's ca.crt."""
INTERVAL_ENV = "KUBETRAIN_PROGRESS_INTERVAL_SECONDS"
TIMEOUT_ENV = "KUBETRAIN_PROGRESS_TIMEOUT_SECONDS"
DEFAULT_INTERVAL_SECONDS = 10.0
DEFAULT_TIMEOUT_SECONDS = 5.0
MAX_CHECKPOINTS_IN_ANNOTATION = 16
"""The annotation keeps only the newest checkpoint steps (progress.json keeps them all): every patch
is stored in etcd and sent to every pod watcher, the operator included."""
FILE_INTERVAL_SECONDS = 1.0


class ReportError(Exception):
    """One PATCH did not succeed (HTTP status, network error or timeout)."""


@dataclass(frozen=True)
class PodTarget:
    """Where rank 0's annotation goes, and how to authenticate."""

    server: str
    namespace: str
    pod: str
    token_file: Path
    ca_file: Path | None

    @property
    def url(self) -> str:
        ns, pod = (urllib.parse.quote(x, safe="") for x in (self.namespace, self.pod))
        return f"{self.server.rstrip('/')}/api/v1/namespaces/{ns}/pods/{pod}"

    def __str__(self) -> str:
        return f"pod {self.namespace}/{self.pod}"


def target_from_env(environ: Mapping[str, str] | None = None) -> tuple[PodTarget | None, str]:
    """The pod to annotate, or (None, why not): outside a pod there is nothing to do."""
    e = os.environ if environ is None else environ
    pod, namespace = e.get(contract.POD_NAME), e.get(contract.POD_NAMESPACE)
    if not pod or not namespace:
        return None, f"{contract.POD_NAME}/{contract.POD_NAMESPACE} not set (not in a pod, or spec.progressReporting off)"
    server = e.get(API_SERVER_ENV)
    if not server:
        host, port = e.get("KUBERNETES_SERVICE_HOST"), e.get("KUBERNETES_SERVICE_PORT") or "443"
        if not host:
            return None, f"neither {API_SERVER_ENV} nor KUBERNETES_SERVICE_HOST is set"
        server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
    token = Path(e.get(TOKEN_FILE_ENV) or SA_DIR / "token")
    if not token.is_file():
        return None, f"no ServiceAccount token at {token} (automountServiceAccountToken off?)"
    ca_raw = e.get(CA_FILE_ENV)
    ca: Path | None = Path(ca_raw) if ca_raw else SA_DIR / "ca.crt"
    if ca is not None and not ca.is_file():
        if ca_raw:
            return None, f"{CA_FILE_ENV}={ca_raw} does not exist"
        ca = None  # the system's trust store
    return PodTarget(server=server, namespace=namespace, pod=pod, token_file=token, ca_file=ca), ""


def annotation_value(progress: Progress) -> str:
    """The annotation: the Progress JSON (compact), with only the newest checkpoint steps."""
    p = progress
    if len(p.checkpoints) > MAX_CHECKPOINTS_IN_ANNOTATION:
        p = progress.model_copy(update={"checkpoints": p.checkpoints[-MAX_CHECKPOINTS_IN_ANNOTATION:]})
    return json.dumps(p.dump(), separators=(",", ":"), sort_keys=True)


class PatchClient:
    """Merge-patches one pod's `kubetrain.io/progress` annotation (urllib + ssl, proxies bypassed:
    the API server is in the cluster)."""

    def __init__(self, target: PodTarget, timeout: float = DEFAULT_TIMEOUT_SECONDS) -> None:
        self.target = target
        self.timeout = timeout
        ctx = ssl.create_default_context(cafile=str(target.ca_file) if target.ca_file else None)
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ctx))

    def patch(self, value: str) -> dict[str, str]:
        """The pod's annotations as the API server returned them with the patched pod."""
        try:
            token = self.target.token_file.read_text().strip()
        except OSError as exc:
            raise ReportError(f"cannot read the token {self.target.token_file}: {exc}") from None
        body = json.dumps({"metadata": {"annotations": {contract.PROGRESS_ANNOTATION: value}}}).encode()
        req = urllib.request.Request(self.target.url, data=body, method="PATCH", headers={
            "Authorization": f"Bearer {token}",
            "Content-Type": "application/merge-patch+json",
            "Accept": "application/json",
            "User-Agent": "kubetrain-trainer",
        })
        try:
            with self.opener.open(req, timeout=self.timeout) as resp:
                pod = json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as exc:
            raise ReportError(f"HTTP {exc.code} {exc.reason}: {_status_message(exc)}") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:  # refused, DNS, TLS, timeout
            raise ReportError(f"{type(exc).__name__}: {getattr(exc, 'reason', None) or exc}") from None
        return dict((pod.get("metadata") or {}).get("annotations") or {})


def _status_message(exc: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(exc.read() or b"{}").get("message", ""))[:300]
    except (OSError, ValueError, AttributeError):
        return ""


class PodProgressReporter:
    """Sends the newest progress from a daemon thread: throttled, forced sends first, never blocking.

    ``report()`` only stores the record and wakes the thread. The thread PATCHes when the record is
    forced, or once ``interval`` has passed since its last attempt. A failed record is kept for the
    next attempt unless a newer one arrived. ``close()`` sends what is pending at once and waits a
    bounded time for it.
    """

    def __init__(
        self,
        target: PodTarget,
        *,
        interval: float = DEFAULT_INTERVAL_SECONDS,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        send: Callable[[str], dict[str, str] | None] | None = None,
    ) -> None:
        self.target = target
        self.interval = interval
        self.timeout = timeout
        self._send = send or PatchClient(target, timeout).patch
        self._cond = threading.Condition()
        self._pending: str | None = None
        self._forced = False
        self._closing = False
        self._busy = False
        self._last_attempt = float("-inf")
        self._thread: threading.Thread | None = None
        self.sent = 0
        self.failures = 0
        self.last_error: str | None = None
        self.annotations: dict[str, str] = {}
        """The pod's annotations as the last successful PATCH returned them (a profile request, say)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PodProgressReporter | None:
        e = os.environ if environ is None else environ
        target, why = target_from_env(e)
        if target is None:
            log.info("progress goes to progress.json only: %s", why)
            return None
        interval = _float_env(e, INTERVAL_ENV, DEFAULT_INTERVAL_SECONDS)
        timeout = _float_env(e, TIMEOUT_ENV, DEFAULT_TIMEOUT_SECONDS)
        try:
            reporter = cls(target, interval=interval, timeout=timeout)
        except (OSError, ssl.SSLError) as exc:  # an unreadable CA bundle: train without reporting
            log.warning("not reporting progress to %s: %s", target, exc)
            return None
        log.info("reporting progress as the %s annotation on %s (every %gs at most)",
                 contract.PROGRESS_ANNOTATION, target, interval)
        return reporter

    def report(self, progress: Progress | str, force: bool = False) -> None:
        """Queue this record (replacing an unsent one); returns at once."""
        value = progress if isinstance(progress, str) else annotation_value(progress)
        with self._cond:
            if self._closing:
                return
            self._pending = value
            self._forced = self._forced or force
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kubetrain-progress", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def close(self, timeout: float | None = None) -> bool:
        """Send the pending record at once, stop the thread; True when nothing was left unsent."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(self.default_wait if timeout is None else timeout)
        with self._cond:
            return self._pending is None and not self._busy and self.last_error is None

    @property
    def default_wait(self) -> float:
        """Long enough for one request in flight and the pending one after it."""
        return 2 * self.timeout + 1

    def _attempt(self, value: str) -> str | None:
        """One PATCH; why it failed, or None."""
        try:
            seen = self._send(value)
        except ReportError as exc:
            return str(exc)
        except Exception as exc:  # noqa: BLE001 - nothing here may ever stop training
            return f"{type(exc).__name__}: {exc}"
        if seen is not None:
            self.annotations = seen
        return None

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    wait: float | None = None
                    if self._pending is not None:
                        wait = 0.0 if self._forced or self._closing else \
                            self._last_attempt + self.interval - time.monotonic()
                        if wait <= 0:
                            break
                    elif self._closing:
                        return
                    self._cond.wait(wait)
                value, self._pending, self._forced = self._pending, None, False
                self._busy = True
            error = self._attempt(value)
            with self._cond:
                self._busy = False
                self._last_attempt = time.monotonic()
                if error is None:
                    if self.last_error is not None:
                        log.info("progress annotation on %s works again", self.target)
                    self.last_error = None
                    self.sent += 1  # last: a reader that sees the count sees the cleared error
                else:
                    if self.failures == 0:
                        log.warning("could not annotate %s with progress (%s); training goes on, retrying every %gs",
                                    self.target, error, self.interval)
                    else:
                        log.debug("progress annotation on %s failed again: %s", self.target, error)
                    self.last_error = error
                    self.failures += 1  # last, as for `sent`
                    if self._pending is None and not self._closing:
                        self._pending = value  # retried after the interval unless a newer record comes
                self._cond.notify_all()


def _float_env(e: Mapping[str, str], name: str, default: float) -> float:
    try:
        value = float(e.get(name) or default)
    except ValueError:
        log.warning("%s=%r is not a number; using %g", name, e.get(name), default)
        return default
    return value if value > 0 else default


# --------------------------------------------------------------------------- custom scripts


class _ScriptReporter:
    """report_progress()'s state: the pod reporter (if in a pod) and progress.json (if an output dir)."""

    def __init__(self) -> None:
        self.pod = PodProgressReporter.from_env()
        out = os.environ.get(contract.OUTPUT_DIR)
        self.out = Path(out) if out else None
        self.last_file = float("-inf")
        self.lock = threading.Lock()
        atexit.register(self.close)

    def report(self, progress: Progress, force: bool) -> None:
        if self.pod is not None:
            self.pod.report(progress, force)
        if self.out is not None:
            with self.lock:
                now = time.monotonic()
                if force or now - self.last_file >= FILE_INTERVAL_SECONDS:
                    write_progress(self.out, progress)
                    self.last_file = now

    def close(self) -> None:
        if self.pod is not None:
            self.pod.close()


_script: _ScriptReporter | None = None
_script_lock = threading.Lock()


def _now() -> str:
    return contract.format_time(datetime.now(UTC))


def make_progress(
    step: int,
    *,
    loss: float | None = None,
    max_steps: int = 0,
    checkpoint_step: int | None = None,
    checkpoint_path: str = "",
    finished: bool = False,
    environ: Mapping[str, str] | None = None,
) -> Progress:
    """A Progress record for this job and generation (from the contract env), stamped now."""
    e = os.environ if environ is None else environ
    gen = e.get(contract.RESTART_GENERATION, "0")
    world = e.get(contract.WORLD_SIZE, "0")
    ck = None
    if checkpoint_step is not None:
        ck = CheckpointRecord(step=checkpoint_step, path=checkpoint_path, time=_now())
    return Progress(
        job=e.get(contract.JOB, ""), generation=int(gen) if gen.isdigit() else 0, step=step, max_steps=max_steps,
        loss=loss, world_size=int(world) if world.isdigit() else 0, last_checkpoint=ck,
        checkpoints=[checkpoint_step] if checkpoint_step is not None else [], time=_now(), finished=finished,
    )


def report_progress(
    step: int | None = None,
    *,
    loss: float | None = None,
    max_steps: int = 0,
    checkpoint_step: int | None = None,
    checkpoint_path: str = "",
    finished: bool = False,
    progress: Progress | None = None,
    force: bool = False,
) -> bool:
    """For custom scripts: report rank 0's progress to kubetrain. Call it after optimizer steps.

    Writes ``$KUBETRAIN_OUTPUT_DIR/progress.json`` (at most once a second; local runs read it) and,
    in a pod, annotates the pod for the operator (at most every 10 s, from a background thread).
    ``force=True`` sends at once: pass it after a checkpoint is complete and at the end. Never
    blocks on the API server and never raises over it. Returns False on ranks other than 0 (a
    no-op) and when there is nowhere to report to.
    """
    rank = os.environ.get(contract.RANK)
    if rank not in (None, "", "0"):
        return False
    if progress is None:
        if step is None:
            raise TypeError("report_progress() needs step or progress")
        progress = make_progress(step, loss=loss, max_steps=max_steps, checkpoint_step=checkpoint_step,
                                 checkpoint_path=checkpoint_path, finished=finished)
    global _script  # noqa: PLW0603 - one reporter (one thread) per process
    with _script_lock:
        if _script is None:
            _script = _ScriptReporter()
    _script.report(progress, force or finished or checkpoint_step is not None)
    return _script.pod is not None or _script.out is not None


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """``python -m kubetrain.trainer.observe.progress --step N ...``: one report, sent now.

    Exit 0 when the annotation was written (or there is no pod to annotate: a local run),
    1 when the API server refused it or could not be reached (the message says why).
    """
    ap = argparse.ArgumentParser(prog="python -m kubetrain.trainer.observe.progress", description=main.__doc__)
    ap.add_argument("--step", type=int, help="last completed optimizer step")
    ap.add_argument("--loss", type=float)
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--checkpoint-step", type=int, help="step of the newest complete checkpoint")
    ap.add_argument("--checkpoint-path", default="")
    ap.add_argument("--finished", action="store_true")
    ap.add_argument("--json", help="a whole Progress record (camelCase JSON) instead of the flags")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.json:
        progress = Progress.model_validate_json(args.json)
    elif args.step is not None:
        progress = make_progress(args.step, loss=args.loss, max_steps=args.max_steps,
                                 checkpoint_step=args.checkpoint_step, checkpoint_path=args.checkpoint_path,
                                 finished=args.finished)
    else:
        ap.error("--step or --json is required")
    reporter = PodProgressReporter.from_env()
    if reporter is None:
        print("kubetrain: not in a pod with a ServiceAccount token; nothing sent", file=sys.stderr)
        return 0
    reporter.report(progress, force=True)
    if reporter.close() and reporter.sent:
        print(f"kubetrain: progress step {progress.step} -> {reporter.target}", file=sys.stderr)
        return 0
    print(f"kubetrain: progress not sent to {reporter.target}: {reporter.last_error or 'timed out'}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
