"""The local sweep backend, `kubetrain sweep FILE`: a TrainingSweep's trials as local runs, no cluster.

An adapter of the sweep policy, as the operator's sweep controller is: observe every trial's run
-> policy.step -> write the status (`<out>/sweep-status.json`, before any trial starts) -> carry
out the effects, until the sweep succeeds or fails. The status file is the whole state: running
the same command again rebuilds the study from it and starts the trials that were running, which
`kubetrain run` resumes from their checkpoints.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import yaml
from pydantic import ValidationError

from kubetrain.core import owned_dirs
from kubetrain.core.api import (
    API_VERSION,
    KIND,
    ObjectMeta,
    SweepPhase,
    TrainingSweep,
    TrainingSweepStatus,
    TrialRecord,
    TrialState,
)
from kubetrain.core.progress import atomic_write_text
from kubetrain.core.sweep import policy, report, space
from kubetrain.core.sweep.mirror import StorageError, StudyMirror
from kubetrain.core.sweep.model import Effect, StartTrial, StopTrial, SweepEvent
from kubetrain.core.sweep.trials import PROCESS_RECORD, TRIALS_DIR, LocalTrials
from kubetrain.core.sweep.view import SweepView

STATUS_FILE = "sweep-status.json"
BEST_FILE = "best.yaml"
POLL_SECONDS = 0.5
TEMPLATE_SUFFIX = "-template"
FINISHED = (SweepPhase.SUCCEEDED, SweepPhase.FAILED)


class SweepRunError(Exception):
    """The sweep cannot start (its output directory, its saved status, its storage); the message says why."""


@dataclass
class SweepOptions:
    output_dir: Path
    storage: str | None = None
    """An Optuna storage URL that every finished trial is copied to."""
    fresh: bool = False
    quiet: bool = False
    summary_json: Path | None = None
    poll_seconds: float = POLL_SECONDS


@dataclass
class SweepResult:
    name: str
    status: TrainingSweepStatus
    interrupted: bool
    timing: report.Timing
    output_dir: Path
    objective: str = "final"
    """Which loss a trial's value is (spec.objective.value)."""
    best_file: Path | None = None
    best_manifest: dict[str, Any] | None = None

    def to_json(self) -> str:
        st = self.status
        return json.dumps({
            "name": self.name, "phase": st.phase, "reason": st.reason, "message": st.message,
            "interrupted": self.interrupted, "output_dir": str(self.output_dir),
            "best": {"trial": st.best_trial, "value": st.best_value, "params": st.best_params,
                     "manifest": str(self.best_file) if self.best_file else None},
            "timings": {"sweep_seconds": round(self.timing.sweep_seconds, 2),
                        "mean_complete_trial_seconds": _round(self.timing.mean_complete_seconds),
                        "unpruned_estimate_seconds": _round(self.timing.unpruned_seconds),
                        "trials": self.timing.trials, "parallelism": self.timing.parallelism},
            "status": st.dump(),
        }, indent=2)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


# --------------------------------------------------------------------------- manifests a user runs


def runnable_anywhere(manifest: dict[str, Any], base_dir: Path) -> dict[str, Any]:
    """The manifest with a relative spec.data.path made absolute against `base_dir`, so that
    `kubetrain run` finds the data wherever the file is written (a relative path means the
    sweep manifest's directory locally, and the working directory in pods)."""
    spec = dict(manifest.get("spec") or {})
    data = dict(spec.get("data") or {})
    path = Path(str(data.get("path", "data")))
    if not path.is_absolute():
        spec["data"] = {**data, "path": str((base_dir / path).resolve())}
    return {**manifest, "spec": spec}


def _job_name_limit() -> int:
    return next(m.max_length for m in ObjectMeta.model_fields["name"].metadata
                if getattr(m, "max_length", None) is not None)


def template_manifest(sweep: TrainingSweep, base_dir: Path) -> dict[str, Any]:
    """The template as a TrainingJob of its own, `<sweep>-template`, with its own values and no sweep labels:
    what `kubetrain run` trains when no parameter is tuned."""
    meta = sweep.spec.template.metadata or {}
    name = sweep.metadata.name[: _job_name_limit() - len(TEMPLATE_SUFFIX)] + TEMPLATE_SUFFIX
    metadata: dict[str, Any] = {"name": name}
    if sweep.metadata.namespace:
        metadata["namespace"] = sweep.metadata.namespace
    metadata.update({k: dict(meta[k]) for k in ("labels", "annotations") if meta.get(k)})
    spec = sweep.spec.template.spec.model_dump(by_alias=True, exclude_unset=True, mode="json")
    return runnable_anywhere({"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": spec}, base_dir)


def to_yaml(manifest: dict[str, Any]) -> str:
    return yaml.safe_dump(manifest, sort_keys=False)


# --------------------------------------------------------------------------- the runner


class LocalSweep:
    """Run one TrainingSweep's trials as local `kubetrain run` processes until it succeeds or fails, or Ctrl-C."""

    def __init__(self, sweep: TrainingSweep, manifest_dir: Path, opts: SweepOptions, stream: IO[str] | None = None):
        self.sweep, self.name, self.spec, self.opts = sweep, sweep.metadata.name, sweep.spec, opts
        self.out = opts.output_dir.resolve()
        self.base_dir = manifest_dir.resolve()
        self.trials = LocalTrials(self.out, self.base_dir, self.spec.parallelism)
        self.view = SweepView(stream or sys.stderr, self.name, self.spec, opts.quiet)
        self.status = TrainingSweepStatus()
        self.mirror: StudyMirror | None = None
        self.stop_requested = False
        self.started = time.monotonic()
        self.resumed = False

    @property
    def status_file(self) -> Path:
        return self.out / STATUS_FILE

    def run(self) -> SweepResult:
        note = self._prepare()
        self._say_start(note)
        previous = {sig: signal.signal(sig, self._on_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            for t in self._unfinished():  # before the first step, which takes a running trial without a run as deleted
                self._start(t.index, t.job_name, dict(t.params))
            interrupted = self._loop()
        finally:
            self.trials.stop_all()  # no trial outlives the sweep; each one checkpoints on the way out
            self._save()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return self._result(interrupted)

    def _unfinished(self) -> list[TrialRecord]:
        return [t for t in self.status.trials if t.state in (TrialState.PENDING, TrialState.RUNNING)]

    def _on_interrupt(self, signum: int, frame: Any) -> None:
        self.stop_requested = True

    # ------------------------------------------------------------------ start or resume

    def _prepare(self) -> str | None:
        """Resume the sweep saved in the output directory, or start over there. Returns a line for the user."""
        written = (STATUS_FILE, BEST_FILE, PROCESS_RECORD, TRIALS_DIR)
        try:
            owned_dirs.claim(self.out, "--output-dir", owned_dirs.names(*written))
        except owned_dirs.NotOwnedError as exc:
            raise SweepRunError(str(exc)) from None
        saved = None if self.opts.fresh else self._load_status()
        if saved is None:
            owned_dirs.clear(self.out, only=written)
        if self.opts.storage:
            try:
                self.mirror = StudyMirror(self.opts.storage, self.name, self.spec, fresh=saved is None)
            except StorageError as exc:
                raise SweepRunError(str(exc)) from None
        if saved is None:
            return None
        self.status, self.resumed = saved, True
        return (f"resuming the sweep saved in {self.status_file}: {len(saved.trials)} trial(s) recorded, "
                f"{len(self._unfinished())} restarted from their checkpoints (pass --fresh to start over)")

    def _load_status(self) -> TrainingSweepStatus | None:
        try:
            text = self.status_file.read_text()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise SweepRunError(f"cannot read {self.status_file}: {exc.strerror or exc}") from None
        try:
            saved = TrainingSweepStatus.model_validate_json(text)
        except ValidationError as exc:
            raise SweepRunError(f"{self.status_file} is not a sweep's status ({exc.error_count()} problem(s)): "
                                "pass --fresh to start over") from None
        if saved.trials and saved.trials[0].job_name != space.trial_job_name(self.name, 0):
            raise SweepRunError(f"{self.status_file} holds another sweep's trials ({saved.trials[0].job_name}, ...): "
                                "choose another --output-dir, or pass --fresh to start over there")
        return saved

    def _say_start(self, note: str | None) -> None:
        spec = self.spec
        self.view.say(f"kubetrain: sweep {self.name!r} locally: {spec.max_trials} trials, {spec.parallelism} at a "
                      f"time, sampler {spec.sampler.type}, pruner {spec.pruner.type}, minimising the "
                      f"{spec.objective.value} {spec.objective.metric} "
                      f"over {', '.join(p.path for p in spec.parameters)}")
        if note:
            self.view.say(note)
        self.view.say(f"output: {self.out} ({STATUS_FILE}, {TRIALS_DIR}/<job>/ with each trial's run.log)")

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> bool:
        """Step the policy until the sweep has finished (False) or Ctrl-C stopped it (True)."""
        while not self.stop_requested:
            now = datetime.now(UTC)
            observed = {t.index: self.trials.observe(t.index, t.job_name) for t in self.status.trials}
            transition = policy.step(self.name, self.spec, self.status, observed, now)
            self.status = transition.status
            self._save()  # before any StartTrial: the trial is recorded before its run exists
            self._carry_out(transition.effects)
            self.view.update(self.status, self.trials.live_losses())
            for event in (e for e in transition.effects if isinstance(e, SweepEvent)):
                self.view.event(event)  # after the trials' lines: a sweep's end comes after its last trial's
            if self.status.phase in FINISHED:
                return False
            time.sleep(self.opts.poll_seconds)
            self.trials.pump()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.view.say("stopping: asking every running trial to checkpoint and exit (Ctrl-C again is ignored) ...")
        self.trials.stop_all()
        return True

    def _carry_out(self, effects: tuple[Effect, ...]) -> None:
        """Stops first (a start waits for them to end), then starts; events are shown by the loop."""
        for e in effects:
            if isinstance(e, StopTrial):
                self.trials.stop(e.index)
        for e in effects:
            if isinstance(e, StartTrial):
                self._start(e.index, e.job_name, e.params)

    def _start(self, index: int, job_name: str, params: dict[str, Any]) -> None:
        manifest = space.trial_manifest(self.name, self.sweep.metadata.namespace, self.spec, index, params)
        self.trials.start(index, job_name, manifest)

    def _save(self) -> None:
        atomic_write_text(self.status_file, json.dumps(self.status.dump(), indent=1) + "\n")
        if self.mirror is not None:
            self.mirror.sync(self.status)

    # ------------------------------------------------------------------ the end

    def _result(self, interrupted: bool) -> SweepResult:
        self.view.finish(self.status, {})
        took = report.sweep_seconds(self.status)  # a resumed sweep's time runs from its first start
        seconds = took if took is not None and self.resumed else time.monotonic() - self.started
        result = SweepResult(self.name, self.status, interrupted, report.timing(self.spec, self.status, seconds),
                             self.out, self.spec.objective.value)
        if self.status.best_params is not None and not interrupted:
            manifest = space.best_manifest(self.name, self.sweep.metadata.namespace, self.spec, self.status.best_params)
            result.best_manifest = runnable_anywhere(manifest, self.base_dir)
            result.best_file = self.out / BEST_FILE
            atomic_write_text(result.best_file, to_yaml(result.best_manifest))
        if self.opts.summary_json:
            atomic_write_text(self.opts.summary_json, result.to_json() + "\n")
        return result
