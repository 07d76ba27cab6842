"""The client for this machine: each TrainingJob (or TrainingSweep) is a `kubetrain run` (`kubetrain sweep`)
in the background, started by `submit`.

Layout under `root` (default `runs/`, where `kubetrain run` writes too):

    runs/<name>/                 the run's output directory, as `kubetrain run` writes it (progress.json,
                                 summary.json, logs/gen-<N>/rank-<R>.log, checkpoints/)
    runs/.client/<name>/         the client's own record: manifest.yaml (as submitted), run.json (the
                                 runner's pid and start time), run.log (the runner's output)

The status is read from what the run leaves on disk: progress.json while it runs (through the same
lifecycle.take_progress the operator uses), summary.json once it ended. A name is taken until `delete`,
as on a cluster. `suspend` sends the runner SIGTERM (its workers checkpoint; it ends Suspended),
`resume` starts it again, resuming from the newest checkpoint.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from kubetrain.core import contract, owned_dirs
from kubetrain.core.api import (
    KIND,
    SWEEP_KIND,
    Phase,
    SweepPhase,
    TrainingJob,
    TrainingJobStatus,
    TrainingSweep,
    TrainingSweepStatus,
)
from kubetrain.core.client.errors import ClientError, Conflict, InvalidManifest, NotFound
from kubetrain.core.client.model import Event, Manifest, TrainingClient, Worker, load_manifest
from kubetrain.core.lifecycle.model import Observed
from kubetrain.core.lifecycle.status import take_progress
from kubetrain.core.progress import read_progress
from kubetrain.core.validate import check, check_sweep

CLIENT_DIR = ".client"
STOP_SECONDS = 150.0
"""How long delete waits for a runner to stop after SIGTERM (the run's own grace for its workers' checkpoint is
120 s) before SIGKILL."""
_EVENT_LINE = re.compile(r"^(?P<reason>[A-Z][A-Za-z]+|restarting): (?P<message>.+)$")
_WARNING = re.compile(r"Fail|Exceeded|Error|Hang|restarting|Forbidden")


@dataclass(frozen=True)
class RunRecord:
    """run.json: the runner process of a local job or sweep."""

    kind: str
    pid: int
    started: float
    """time.time() when it was started (a summary older than this is a previous run's)."""
    command: list[str]


def matches(labels: Mapping[str, str] | None, selector: str | Mapping[str, str] | None) -> bool:
    """Whether labels match a selector of equalities (`a=b`, `a==b`), inequalities (`a!=b`), `a` and `!a`."""
    labels = labels or {}
    if isinstance(selector, Mapping):
        return all(labels.get(k) == v for k, v in selector.items())
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        if "!=" in term:
            key, value = (s.strip() for s in term.split("!=", 1))
            ok = labels.get(key) != value
        elif "=" in term:
            key, value = (s.strip() for s in term.replace("==", "=").split("=", 1))
            ok = labels.get(key) == value
        else:
            ok = (term[1:].strip() not in labels) if term.startswith("!") else term in labels
        if not ok:
            return False
    return True


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def job_status(out: Path, max_steps: int, started: float, alive: bool, log: Path, workers: int = 1) -> TrainingJobStatus:
    """A local job's status from its output directory: the summary of this run once it ended, rank 0's progress
    while it runs, Failed (the runner's last line) when the runner ended without a summary."""
    status = TrainingJobStatus(max_steps=max_steps, workers_total=workers, start_time=contract.format_time(
        datetime.fromtimestamp(started, UTC)))
    progress = read_progress(out)
    if progress is not None:
        status.restart_generation = progress.generation  # the record is the current generation's
        take_progress(status, Observed(progress=progress), datetime.now(UTC))
    summary_path = out / "summary.json"
    summary = _read_json(summary_path) if summary_path.is_file() and summary_path.stat().st_mtime >= started else None
    if alive:
        status.phase = Phase.RUNNING if progress is not None and progress.step > 0 else Phase.CREATED
        status.workers_ready = workers if status.phase == Phase.RUNNING else 0
        status.workers_summary = f"{status.workers_ready}/{workers}"
        return status
    if summary is None:
        status.phase, status.reason = Phase.FAILED, "RunnerExited"
        status.message = _last_line(log) or "the local runner ended without a summary"
        return status
    status.phase, status.reason, status.message = Phase(summary["phase"]), summary.get("reason", ""), summary.get("message", "")
    status.restart_count, status.failures = int(summary.get("restarts", 0)), dict(summary.get("failures") or {})
    status.current_step = int(summary.get("steps", status.current_step))
    if summary.get("final_loss") is not None:
        status.loss = f"{summary['final_loss']:.4f}"
    return status


class LocalClient(TrainingClient):
    """TrainingJobs and TrainingSweeps run on this machine, in the background.

    `root`: where the runs' output directories are (default `runs/`, as `kubetrain run`'s); `base_dir`: what a
    relative spec.data.path of a job given as a dict or a model is relative to (default: the working directory;
    a YAML file's own directory for a file)."""

    namespace = "local"

    def __init__(self, root: str | Path = "runs", base_dir: str | Path | None = None, poll_seconds: float = 1.0):
        self.root = Path(root).resolve()
        self.base_dir = Path(base_dir).resolve() if base_dir else None
        self.poll_seconds = poll_seconds
        self._procs: dict[str, subprocess.Popen[bytes]] = {}

    # ------------------------------------------------------------------ records

    def _control(self, name: str) -> Path:
        return self.root / CLIENT_DIR / name

    def _record(self, name: str, kind: str) -> RunRecord:
        data = _read_json(self._control(name) / "run.json")
        if data is None or data.get("kind") != kind:
            raise NotFound(f"{kind} local/{name}", f"no local {kind} named {name!r} under {self.root}")
        return RunRecord(kind=data["kind"], pid=int(data["pid"]), started=float(data["started"]),
                         command=list(data["command"]))

    def _manifest(self, name: str) -> dict[str, Any]:
        return dict(yaml.safe_load((self._control(name) / "manifest.yaml").read_text()))

    def _alive(self, name: str, record: RunRecord) -> bool:
        """Whether the runner still runs: our own child (reaped here), else a process with its command line."""
        proc = self._procs.get(name)
        if proc is not None and proc.pid == record.pid:
            return proc.poll() is None
        try:
            cmdline = Path(f"/proc/{record.pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        return [c.decode(errors="replace") for c in cmdline if c] == record.command

    # ------------------------------------------------------------------ submit and the runner

    def _runner_command(self, kind: str, name: str, manifest: Path, base: Path) -> builtins.list[str]:
        verb = ["sweep"] if kind == SWEEP_KIND else ["run", "--base-dir", str(base)]
        return [sys.executable, "-m", "kubetrain.core", verb[0], str(manifest), *verb[1:],
                "--output-dir", str(self.root / name), "-q"]

    def _start(self, name: str, kind: str, command: builtins.list[str]) -> RunRecord:
        control = self._control(name)
        with open(control / "run.log", "ab") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)  # a notebook's Ctrl-C or exit does not stop the run
        self._procs[name] = proc
        record = RunRecord(kind=kind, pid=proc.pid, started=time.time(), command=command)
        (control / "run.json").write_text(json.dumps(record.__dict__, indent=1))
        return record

    def submit(self, obj: Manifest, workdir: str | Path | None = None) -> TrainingJob | TrainingSweep:
        body, model = load_manifest(obj)
        if workdir is not None and (model.kind == SWEEP_KIND or not Path(workdir).is_dir()):
            raise InvalidManifest(str(workdir), ["--workdir: a directory a TrainingJob's workers run in"])
        name, kind = model.metadata.name, model.kind
        control = self._control(name)
        if control.exists():
            raise Conflict(f"submitting local/{name}", f"a local {kind} named {name!r} exists ({control}): "
                           "delete it first", None, "AlreadyExists")
        base = Path(obj).resolve().parent if isinstance(obj, str | Path) else (self.base_dir or Path.cwd())
        if kind == SWEEP_KIND:
            _absolute_data_path(body["spec"].get("template", {}).get("spec", {}), base)
        control.mkdir(parents=True)
        (control / "manifest.yaml").write_text(yaml.safe_dump(body, sort_keys=False))
        command = self._runner_command(kind, name, control / "manifest.yaml",
                                       Path(workdir).resolve() if workdir is not None else base)
        if workdir is not None:
            command += ["--workdir", str(Path(workdir).resolve())]
        self._start(name, kind, command)
        return self.get_sweep(name) if kind == SWEEP_KIND else self.get(name)

    # ------------------------------------------------------------------ TrainingJobs

    def get(self, name: str) -> TrainingJob:
        record = self._record(name, KIND)
        job, problems = check(self._manifest(name))
        if job is None:
            raise InvalidManifest(str(self._control(name) / "manifest.yaml"), [str(p) for p in problems])
        job.metadata.namespace = self.namespace
        if (extra := job.metadata.__pydantic_extra__) is not None:  # metadata kept beyond the model's (the age)
            extra["creationTimestamp"] = contract.format_time(datetime.fromtimestamp(record.started, UTC))
        job.status = job_status(self.root / name, job.spec.max_steps, record.started, self._alive(name, record),
                                self._control(name) / "run.log", job.spec.workers)
        return job

    def _names(self, kind: str) -> builtins.list[str]:
        control = self.root / CLIENT_DIR
        names = sorted(p.name for p in control.iterdir() if p.is_dir()) if control.is_dir() else []
        return [n for n in names if (_read_json(control / n / "run.json") or {}).get("kind") == kind]

    def list(self, selector: str | Mapping[str, str] | None = None) -> builtins.list[TrainingJob]:
        jobs = [self.get(n) for n in self._names(KIND)]
        return [j for j in jobs if matches(j.metadata.labels, selector)]

    def _stop(self, name: str, record: RunRecord, grace: float) -> None:
        """SIGTERM the runner (its workers checkpoint), SIGKILL its process group after `grace` seconds."""
        if not self._alive(name, record):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(record.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while self._alive(name, record) and time.monotonic() < deadline:
            time.sleep(0.2)
        if self._alive(name, record):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(record.pid, signal.SIGKILL)

    def delete(self, name: str) -> None:
        """Stop the run, forget it, and remove its output directory (checkpoints too, unless spec.checkpoint.dir
        is elsewhere): only a directory kubetrain created (kubetrain.core.owned_dirs)."""
        control = self._control(name)
        data = _read_json(control / "run.json")
        if data is None:
            raise NotFound(f"local/{name}", f"no local run named {name!r} under {self.root}")
        self._stop(name, self._record(name, data["kind"]), STOP_SECONDS)
        self._procs.pop(name, None)
        out = self.root / name
        if owned_dirs.owned(out):
            shutil.rmtree(out)
        shutil.rmtree(control)

    def _write_suspend(self, name: str, value: bool) -> None:
        """spec.suspend in the stored manifest, as on a cluster: what get() shows and a restarted runner reads."""
        body = self._manifest(name)
        body["spec"] = {**(body.get("spec") or {}), "suspend": value}
        (self._control(name) / "manifest.yaml").write_text(yaml.safe_dump(body, sort_keys=False))

    def suspend(self, name: str) -> TrainingJob:
        """SIGTERM to the runner: the workers write a checkpoint, the run ends Suspended (Interrupted)."""
        record = self._record(name, KIND)
        self._write_suspend(name, True)
        if self._alive(name, record):
            with contextlib.suppress(ProcessLookupError):
                os.kill(record.pid, signal.SIGTERM)
        return self.get(name)

    def resume(self, name: str) -> TrainingJob:
        """Start a suspended (or stopped) run again; it resumes from its newest checkpoint. A running or finished
        job is left as it is."""
        self._write_suspend(name, False)
        job = self.get(name)
        if job.status is not None and job.status.phase in (Phase.SUSPENDED, Phase.FAILED) and \
                job.status.reason in ("Interrupted", "Suspended", "RunnerExited"):
            self._start(name, KIND, self._record(name, KIND).command)
            return self.get(name)
        return job

    def events(self, name: str) -> builtins.list[Event]:
        """The lifecycle's lines of the runner's output (`BackoffWait: ...`, `restarting: ...`) as Events."""
        self._record(name, KIND)
        try:
            lines = (self._control(name) / "run.log").read_text(errors="replace").splitlines()
        except OSError:
            return []
        found = [m for ln in lines if (m := _EVENT_LINE.match(ln.strip()))]
        return [Event(type="Warning" if _WARNING.search(m["reason"]) else "Normal",
                      reason="Restarting" if m["reason"] == "restarting" else m["reason"], message=m["message"],
                      source="kubetrain-run") for m in found]

    def _generation_logs(self, name: str) -> Path | None:
        gens = sorted(self.root.joinpath(name, "logs").glob("gen-*"), key=lambda p: int(p.name[4:]))
        return gens[-1] if gens else None

    def workers(self, name: str) -> builtins.list[Worker]:
        """One per rank of the newest generation (locally a worker is a process group; a rank is one process)."""
        job = self.get(name)
        logs = self._generation_logs(name)
        if logs is None:
            return []
        phase = {Phase.RUNNING: "Running", Phase.SUCCEEDED: "Succeeded", Phase.FAILED: "Failed"}.get(
            job.status.phase if job.status else Phase.PENDING, "Pending")
        ranks = sorted(int(p.stem.split("-")[1]) for p in logs.glob("rank-*.log"))
        return [Worker(index=r, generation=int(logs.name[4:]), phase=phase, name=f"rank {r}", node="localhost")
                for r in ranks]

    def _log_path(self, name: str, rank: int) -> Path:
        self._record(name, KIND)
        logs = self._generation_logs(name)
        path = logs / f"rank-{rank}.log" if logs is not None else None
        if path is None or not path.is_file():
            raise ClientError(f"{KIND} local/{name} has no log for rank {rank} (yet)")
        return path

    def _log_text(self, name: str, rank: int, tail: int | None) -> str:
        text = self._log_path(name, rank).read_text(errors="replace")
        return text if tail is None else "".join(text.splitlines(keepends=True)[-tail:] if tail else [])

    def _log_stream(self, name: str, rank: int, tail: int | None) -> Iterator[str]:
        path = self._log_path(name, rank)
        yield self._log_text(name, rank, tail)
        with open(path, errors="replace") as f:
            f.seek(0, os.SEEK_END)
            while True:
                chunk = f.read()
                if chunk:
                    yield chunk
                elif not self._alive(name, self._record(name, KIND)):
                    yield f.read()
                    return
                else:
                    time.sleep(self.poll_seconds)

    # ------------------------------------------------------------------ TrainingSweeps

    def get_sweep(self, name: str) -> TrainingSweep:
        record = self._record(name, SWEEP_KIND)
        sweep, problems = check_sweep(self._manifest(name))
        if sweep is None:
            raise InvalidManifest(str(self._control(name) / "manifest.yaml"), [str(p) for p in problems])
        sweep.metadata.namespace = self.namespace
        try:
            status = TrainingSweepStatus.model_validate_json((self.root / name / "sweep-status.json").read_text())
        except (OSError, ValueError):
            status = TrainingSweepStatus()
        if not self._alive(name, record) and status.phase not in (SweepPhase.SUCCEEDED, SweepPhase.FAILED):
            status.phase, status.reason = SweepPhase.FAILED, "RunnerExited"
            status.message = _last_line(self._control(name) / "run.log") or "the local sweep runner ended"
        sweep.status = status
        return sweep

    def list_sweeps(self, selector: str | Mapping[str, str] | None = None) -> builtins.list[TrainingSweep]:
        sweeps = [self.get_sweep(n) for n in self._names(SWEEP_KIND)]
        return [s for s in sweeps if matches(s.metadata.labels, selector)]


def _absolute_data_path(spec: dict[str, Any], base: Path) -> None:
    """A sweep's template data path made absolute: the runner reads the copy of the manifest in .client/."""
    data = spec.get("data")
    if isinstance(data, dict) and not Path(str(data.get("path", "data"))).is_absolute():
        data["path"] = str((base / str(data.get("path", "data"))).resolve())
    elif data is None:
        spec["data"] = {"path": str((base / "data").resolve())}
