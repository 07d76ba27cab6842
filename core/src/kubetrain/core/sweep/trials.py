"""A local sweep's trials: each one a `kubetrain run` child process in `<out>/trials/<job>/`.

What the sweep policy calls a trial's job is, here, one `kubetrain run` of the trial's manifest: it
supervises the trial's workers (gang restarts from checkpoints included) and ends with a summary.
A stopped trial gets SIGTERM, which `kubetrain run` turns into a checkpoint and a clean exit; a
trial asked to start while another one is still stopping waits for it (observed Pending), so the
sweep never runs more trial processes than its parallelism.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import yaml

from kubetrain.core import contract, local, owned_dirs
from kubetrain.core.api import Phase, TrainingJobSpec
from kubetrain.core.contract import format_time
from kubetrain.core.progress import atomic_write_text, read_progress
from kubetrain.core.sweep.model import TrialObservation

TRIALS_DIR = "trials"
PROCESS_RECORD = "processes.jsonl"
"""One JSON line per trial process started or ended (index, event, time, pid, exit code)."""
STOP_WAIT_SECONDS = local.STOP_GRACE_SECONDS + 30.0
"""How long a stopped trial gets: `kubetrain run` itself waits this long less 30 s for its workers' checkpoints."""
STOPPED_MESSAGE = "stopped by the sweep"
SUMMARY = "summary.json"


@dataclass
class TrialProcess:
    index: int
    job_name: str
    directory: Path
    popen: subprocess.Popen[bytes]
    log: IO[bytes]
    slot: int
    stopping_since: float | None = None
    """When StopTrial sent SIGTERM (monotonic); None while it runs on."""


@dataclass
class QueuedStart:
    index: int
    job_name: str
    manifest: dict[str, Any]


def last_line(path: Path) -> str:
    """The last non-empty line of a log (why a trial failed, when its summary does not say)."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def read_summary(directory: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((directory / SUMMARY).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def ended(directory: Path, code: int, step: int, loss: float | None) -> TrialObservation:
    """A trial whose `kubetrain run` exited by itself: its summary says how it went."""
    summary = read_summary(directory) or {}
    if code == 0 and summary.get("phase") == Phase.SUCCEEDED:
        return TrialObservation(Phase.SUCCEEDED, int(summary.get("steps") or step), summary.get("final_loss", loss))
    if code == 0:  # `suspend: true` in the template: the run ends at once without training
        return TrialObservation(Phase.SUSPENDED, step, loss, str(summary.get("message", "")))
    why = str(summary.get("message") or "") or last_line(directory / "run.log") or f"kubetrain run exited {code}"
    return TrialObservation(Phase.FAILED, step, loss, why)


def from_disk(directory: Path, step: int, loss: float | None) -> TrialObservation:
    """A trial this runner did not start: what an earlier run of the sweep left in its directory."""
    summary = read_summary(directory)
    if summary is None:
        return TrialObservation(None)
    phase = Phase(summary["phase"]) if summary.get("phase") in set(Phase) else Phase.FAILED
    loss = summary.get("final_loss", loss) if phase == Phase.SUCCEEDED else loss
    return TrialObservation(phase, int(summary.get("steps") or step), loss, str(summary.get("message", "")))


def local_manifest(manifest: dict[str, Any], metrics_port: int | None) -> dict[str, Any]:
    """The trial's manifest as this machine runs it: its checkpoints in its own output directory (a
    template's checkpoint.dir names a path inside pods, which every local trial would share) and,
    trials sharing one host, its own metrics ports."""
    spec = dict(manifest["spec"])
    if "checkpoint" in spec:
        spec["checkpoint"] = {k: v for k, v in spec["checkpoint"].items() if k != "dir"}
    if metrics_port is not None:
        spec["metricsPort"] = metrics_port
    return {**manifest, "spec": spec}


@dataclass
class LocalTrials:
    """Start, observe and stop the trial runs of one sweep."""

    out: Path
    """The sweep's output directory."""
    base_dir: Path
    """Relative paths in the template resolve against it (the sweep manifest's directory)."""
    parallelism: int
    procs: dict[int, TrialProcess] = field(default_factory=dict)
    queued: dict[int, QueuedStart] = field(default_factory=dict)

    def directory(self, job_name: str) -> Path:
        return self.out / TRIALS_DIR / job_name

    # ------------------------------------------------------------------ start

    def start(self, index: int, job_name: str, manifest: dict[str, Any]) -> None:
        """Start the trial, or queue it while a stopped trial is still ending. Starting one that runs is a no-op."""
        running = self.procs.get(index)
        if (running is not None and running.popen.poll() is None) or index in self.queued:
            return
        self.queued[index] = QueuedStart(index, job_name, manifest)
        self.pump()

    def pump(self) -> None:
        """Reap ended trials, SIGKILL a stopped one past its grace, start queued ones once none is stopping."""
        for proc in self.procs.values():
            waited = time.monotonic() - (proc.stopping_since or time.monotonic())
            if proc.popen.poll() is None and waited > STOP_WAIT_SECONDS:
                self._signal(proc, signal.SIGKILL)
            self._reap(proc)
        if any(p.stopping_since is not None and p.popen.poll() is None for p in self.procs.values()):
            return
        for index in sorted(self.queued):
            self._launch(self.queued.pop(index))

    def _free_slot(self) -> int:
        taken = {p.slot for p in self.procs.values() if p.popen.poll() is None}
        return next(s for s in range(len(taken) + 1) if s not in taken)

    def _metrics_port(self, spec: TrainingJobSpec, slot: int) -> int | None:
        """Consecutive ports per slot from the template's metricsPort; None (keep it) when they would not fit."""
        port = spec.metrics_port + slot * spec.world_size
        return port if slot and port + spec.world_size - 1 <= local.MAX_PORT else None

    def _launch(self, q: QueuedStart) -> None:
        directory = self.directory(q.job_name)
        # Claimed here, before job.yaml and run.log, so that the trial's own `kubetrain run` finds it kubetrain's.
        owned_dirs.claim(directory, f"trial {q.job_name}", owned_dirs.names("job.yaml", "run.log", *local.OUTPUT_ENTRIES))
        spec = TrainingJobSpec.model_validate(q.manifest["spec"])
        slot = self._free_slot()
        job_file = directory / "job.yaml"
        atomic_write_text(job_file, yaml.safe_dump(local_manifest(q.manifest, self._metrics_port(spec, slot)),
                                                   sort_keys=False))
        command = [sys.executable, "-m", "kubetrain.core", "run", str(job_file), "--output-dir", str(directory),
                   "--base-dir", str(self.base_dir), "--quiet", "--summary-json", str(directory / SUMMARY)]
        log = (directory / "run.log").open("ab")  # appended: a resumed trial keeps its earlier output
        popen = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=self._env(spec), start_new_session=True)  # Ctrl-C reaches the sweep only
        self.procs[q.index] = TrialProcess(q.index, q.job_name, directory, popen, log, slot)
        self._record(q.index, "start", pid=popen.pid)

    def _env(self, spec: TrainingJobSpec) -> dict[str, str]:
        """This environment, with the cores shared among the trials unless the user chose thread counts
        (`kubetrain run` would give each of its processes all the cores divided by the trial's world size)."""
        env = dict(os.environ)
        for name, value in contract.thread_env(os.cpu_count() or 1, self.parallelism * spec.world_size).items():
            env.setdefault(name, value)
        return env

    # ------------------------------------------------------------------ observe

    def observe(self, index: int, job_name: str) -> TrialObservation:
        """The trial's run as the policy sees a job: Pending while queued, Running, or how it ended."""
        if index in self.queued:
            return TrialObservation(Phase.PENDING)
        directory = self.directory(job_name)
        progress = read_progress(directory)
        step, loss = (progress.step, progress.loss) if progress is not None else (0, None)
        seen = dataclasses.replace(self._observe(index, directory, step, loss),
                                   eval_loss=progress.eval_loss if progress is not None else None)
        summary = read_summary(directory) if seen.phase == Phase.SUCCEEDED else None
        if summary is not None and summary.get("eval_loss") is not None:
            seen = dataclasses.replace(seen, eval_loss=float(summary["eval_loss"]))
        return seen

    def _observe(self, index: int, directory: Path, step: int, loss: float | None) -> TrialObservation:
        proc = self.procs.get(index)
        if proc is None:
            return from_disk(directory, step, loss)
        code = proc.popen.poll()
        if code is None:
            return TrialObservation(Phase.RUNNING, step, loss)
        if proc.stopping_since is not None:
            return TrialObservation(Phase.SUSPENDED, step, loss, STOPPED_MESSAGE)
        return ended(directory, code, step, loss)

    def live_losses(self) -> dict[int, float | None]:
        """The latest loss of every trial that runs now (for the table)."""
        found: dict[int, float | None] = {}
        for index, proc in self.procs.items():
            progress = read_progress(proc.directory) if proc.popen.poll() is None else None
            if progress is not None:
                found[index] = progress.loss
        return found

    # ------------------------------------------------------------------ stop

    def stop(self, index: int) -> None:
        """SIGTERM the trial's run (it checkpoints and exits); the next pump() reaps it."""
        self.queued.pop(index, None)
        proc = self.procs.get(index)
        if proc is None or proc.popen.poll() is not None or proc.stopping_since is not None:
            return
        proc.stopping_since = time.monotonic()
        self._signal(proc, signal.SIGTERM)

    def stop_all(self, grace: float = STOP_WAIT_SECONDS) -> None:
        """Stop every trial and wait for them (SIGKILL after `grace`); nothing of the sweep runs afterwards."""
        self.queued.clear()
        for index in list(self.procs):
            self.stop(index)
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            try:
                proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal(proc, signal.SIGKILL)
                proc.popen.wait(timeout=10.0)
            self._reap(proc)

    def _signal(self, proc: TrialProcess, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.popen.send_signal(sig)

    def _reap(self, proc: TrialProcess) -> None:
        code = proc.popen.poll()
        if code is not None and not proc.log.closed:
            proc.log.close()
            self._record(proc.index, "exit", pid=proc.popen.pid, code=code, stopped=proc.stopping_since is not None)

    def _record(self, index: int, event: str, **extra: Any) -> None:
        line = {"index": index, "event": event, "time": format_time(datetime.now(UTC), micros=True), **extra}
        with (self.out / PROCESS_RECORD).open("a") as f:
            f.write(json.dumps(line) + "\n")
