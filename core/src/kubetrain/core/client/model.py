"""What both clients share: the values they return, manifest loading, and `wait` over `get`.

`wait` polls `get` (one GET per interval, no watch): the same loop serves a cluster and a local
run, a dropped connection costs one interval, and the progress callback sees every change of
step, loss or phase that one read shows.
"""

from __future__ import annotations

import abc
import builtins
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeAlias, overload

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
from kubetrain.core.client.errors import ClientError, InvalidManifest, JobFailed, WaitTimeout
from kubetrain.core.sweep import space
from kubetrain.core.validate import ManifestError, check, check_sweep, is_list, load_documents

Manifest: TypeAlias = TrainingJob | TrainingSweep | Mapping[str, Any] | str | Path
"""What `submit` takes: a model, a plain dict (as YAML would give it) or the path of a YAML file."""
SETTABLE_METADATA = ("name", "generateName", "namespace", "labels", "annotations")


# ----------------------------------------------------------------------------------- values returned


@dataclass(frozen=True)
class ProgressUpdate:
    """One change a `wait` saw, for its `on_progress` callback."""

    name: str
    phase: str
    step: int
    max_steps: int
    loss: float | None
    """The last loss rank 0 reported (None before the first step)."""
    eta: str | None
    """Time left as status shows it (`4m10s`)."""
    eta_seconds: float | None
    percent: float | None
    """currentStep as a percentage of maxSteps."""
    reason: str = ""


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event about the job (locally: a lifecycle line of the run's log)."""

    type: str
    reason: str
    message: str
    time: str | None = None
    count: int = 1
    source: str = ""


@dataclass(frozen=True)
class Worker:
    """One worker of the job's newest generation: a pod on a cluster, a process group locally."""

    index: int
    generation: int
    phase: str
    """Pending, Running, Succeeded, Failed (a pod's phase)."""
    name: str = ""
    node: str = ""
    state: str = ""
    """Why it is not running, when it is not: the container's waiting or terminated reason (ImagePullBackOff,
    OOMKilled, Error), or Unschedulable."""
    message: str = ""
    exit_code: int | None = None
    restarts: int = 0


@dataclass(frozen=True)
class BestTrial:
    """A sweep's best trial and a TrainingJob manifest that trains its parameters (`<sweep>-best`)."""

    index: int
    value: float | None
    params: dict[str, Any]
    manifest: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------------- progress parsing

_DURATION = re.compile(r"^(?:(?P<h>\d+)h)?(?:(?P<m>\d+)m)?(?:(?P<s>\d+(?:\.\d+)?)s)?$")


def parse_duration(text: str | None) -> float | None:
    """Seconds of a duration as status writes it (contract.format_duration: `42.0s`, `3m05s`, `1h02m`)."""
    m = _DURATION.match(text or "")
    if not text or m is None:
        return None
    return int(m["h"] or 0) * 3600 + int(m["m"] or 0) * 60 + float(m["s"] or 0)


def parse_number(text: str | None) -> float | None:
    """A number status writes as a string (`2.3456`, `45%`); None when it is not one."""
    try:
        return float(str(text).rstrip("%")) if text not in (None, "") else None
    except ValueError:
        return None


def progress_of(name: str, status: TrainingJobStatus | None) -> ProgressUpdate:
    st = status or TrainingJobStatus()
    return ProgressUpdate(name=name, phase=str(st.phase), step=st.current_step, max_steps=st.max_steps,
                          loss=parse_number(st.loss), eta=st.eta, eta_seconds=parse_duration(st.eta),
                          percent=parse_number(st.percent_complete), reason=st.reason)


def wait_outcome(phase: str, until: str, failed: str = Phase.FAILED, succeeded: str = Phase.SUCCEEDED) -> str:
    """`done`, `failed` or `wait`: a wait ends at `until`, and at the end of the object's life (it succeeded: done;
    it failed: failed, unless `until` is the failed phase)."""
    if phase in (until, succeeded):
        return "done"
    return "failed" if phase == failed else "wait"


# ----------------------------------------------------------------------------------- manifests


def _validated(doc: Any, source: str) -> TrainingJob | TrainingSweep:
    is_sweep = isinstance(doc, Mapping) and doc.get("kind") == SWEEP_KIND
    obj, problems = check_sweep(doc) if is_sweep else check(doc)
    if obj is None:
        raise InvalidManifest(source, [str(p) for p in problems])
    return obj


def _from_file(path: Path) -> dict[str, Any]:
    try:
        docs = load_documents(path)
    except ManifestError as exc:
        raise InvalidManifest(str(path), [str(p) for p in exc.problems]) from None
    except OSError as exc:
        raise ClientError(f"{path}: cannot read: {exc.strerror or exc}") from None
    ours = [d for d in docs if isinstance(d, dict) and d.get("kind") in (KIND, SWEEP_KIND)]
    if len(ours) != 1 or is_list(ours[0]):
        raise InvalidManifest(str(path), [f"(file): must hold exactly one {KIND} or {SWEEP_KIND}, found {len(ours)}"])
    return dict(ours[0])


def load_manifest(obj: Manifest) -> tuple[dict[str, Any], TrainingJob | TrainingSweep]:
    """(the body to send, the validated model) of what `submit` was given. A file or a dict is sent as the user
    wrote it (the API server applies the CRD's defaults); a model as its wire form. Status is never sent."""
    if isinstance(obj, TrainingJob | TrainingSweep):
        body, source = obj.dump(), f"{obj.kind} {obj.metadata.name}"
    elif isinstance(obj, str | Path):
        body, source = _from_file(Path(obj)), str(obj)
    elif isinstance(obj, Mapping):
        body, source = dict(obj), f"{obj.get('kind', KIND)} {(obj.get('metadata') or {}).get('name', '')}".strip()
    else:
        raise TypeError(f"submit takes a TrainingJob, a TrainingSweep, a dict or a YAML path, not {type(obj).__name__}")
    body.pop("status", None)
    # What a user may set; the rest (uid, resourceVersion, ...) is the API server's, refused on a create.
    body["metadata"] = {k: v for k, v in (body.get("metadata") or {}).items() if k in SETTABLE_METADATA}
    return body, _validated(body, source)


def best_trial_of(sweep: TrainingSweep) -> BestTrial | None:
    st = sweep.status or TrainingSweepStatus()
    if st.best_trial is None or st.best_params is None:
        return None
    manifest = space.best_manifest(sweep.metadata.name, sweep.metadata.namespace, sweep.spec, st.best_params)
    return BestTrial(index=st.best_trial, value=st.best_value, params=dict(st.best_params), manifest=manifest)


# ----------------------------------------------------------------------------------- the calls


ProgressCallback = Callable[[ProgressUpdate], None]


class TrainingClient(abc.ABC):
    """The calls, for a cluster (ClusterClient) or this machine (LocalClient)."""

    poll_seconds: float = 2.0

    @abc.abstractmethod
    def submit(self, obj: Manifest, workdir: str | Path | None = None) -> TrainingJob | TrainingSweep:
        """Validate (as `kubetrain validate` does) and start a TrainingJob or TrainingSweep; returns it as created.
        ``workdir``: a directory every worker of a TrainingJob runs in (a cluster ships it: kubetrain.core.workdir)."""

    @abc.abstractmethod
    def get(self, name: str) -> TrainingJob:
        """The TrainingJob with its status."""

    @abc.abstractmethod
    def list(self, selector: str | Mapping[str, str] | None = None) -> builtins.list[TrainingJob]:
        """The TrainingJobs whose labels match `selector` (`team=nlp,tier!=dev`, or a dict of equalities)."""

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Delete the job (its workers stop)."""

    @abc.abstractmethod
    def suspend(self, name: str) -> TrainingJob:
        """Stop the workers after a checkpoint; the job keeps its progress (spec.suspend: true)."""

    @abc.abstractmethod
    def resume(self, name: str) -> TrainingJob:
        """Start a suspended job again from its newest checkpoint."""

    @abc.abstractmethod
    def events(self, name: str) -> builtins.list[Event]:
        """What happened to the job, oldest first."""

    @abc.abstractmethod
    def workers(self, name: str) -> builtins.list[Worker]:
        """The newest generation's workers, by index."""

    @abc.abstractmethod
    def _log_text(self, name: str, rank: int, tail: int | None) -> str: ...

    @abc.abstractmethod
    def _log_stream(self, name: str, rank: int, tail: int | None) -> Iterator[str]: ...

    @abc.abstractmethod
    def get_sweep(self, name: str) -> TrainingSweep:
        """The TrainingSweep with its status (trials, best so far)."""

    @abc.abstractmethod
    def list_sweeps(self, selector: str | Mapping[str, str] | None = None) -> builtins.list[TrainingSweep]: ...

    @overload
    def logs(self, name: str, rank: int = 0, follow: Literal[False] = False, tail: int | None = None) -> str: ...

    @overload
    def logs(self, name: str, rank: int = 0, *, follow: Literal[True], tail: int | None = None) -> Iterator[str]: ...

    def logs(self, name: str, rank: int = 0, follow: bool = False, tail: int | None = None) -> str | Iterator[str]:
        """Worker `rank`'s log of the newest generation: the text, or with follow=True an iterator of chunks that
        ends when the worker does. `tail`: only the last lines."""
        return self._log_stream(name, rank, tail) if follow else self._log_text(name, rank, tail)

    def wait(self, name: str, until: str = Phase.SUCCEEDED, timeout: float | None = None,
             on_progress: ProgressCallback | None = None) -> TrainingJob:
        """The job once its phase is `until` (or it Succeeded). Raises JobFailed naming the reason when it fails
        (unless `until` is Failed) and WaitTimeout after `timeout` seconds. `on_progress` gets a ProgressUpdate
        for every change of phase, step or loss seen."""
        deadline = None if timeout is None else time.monotonic() + timeout
        seen: ProgressUpdate | None = None
        while True:
            job = self.get(name)
            update = progress_of(name, job.status)
            if on_progress is not None and update != seen:
                on_progress(update)
            seen = update
            outcome = wait_outcome(update.phase, str(until))
            if outcome == "done":
                return job
            if outcome == "failed":
                st = job.status or TrainingJobStatus()
                raise JobFailed(name, st.reason, st.message, job)
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(name, str(until), timeout or 0, update.phase, job)
            time.sleep(self._pause(deadline))

    def wait_sweep(self, name: str, timeout: float | None = None,
                   on_progress: Callable[[TrainingSweepStatus], None] | None = None) -> TrainingSweep:
        """The sweep once it finished; JobFailed when it failed, WaitTimeout after `timeout` seconds. `on_progress`
        gets the status whenever its trial counts or best value change."""
        deadline = None if timeout is None else time.monotonic() + timeout
        seen: tuple[Any, ...] | None = None
        while True:
            sweep = self.get_sweep(name)
            st = sweep.status or TrainingSweepStatus()
            key = (st.phase, st.trials_summary, st.trials_running, st.best_value)
            if on_progress is not None and key != seen:
                on_progress(st)
            seen = key
            outcome = wait_outcome(st.phase, SweepPhase.SUCCEEDED, SweepPhase.FAILED, SweepPhase.SUCCEEDED)
            if outcome == "done":
                return sweep
            if outcome == "failed":
                raise JobFailed(name, st.reason, st.message, sweep)
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(name, SweepPhase.SUCCEEDED, timeout or 0, st.phase, sweep)
            time.sleep(self._pause(deadline))

    def best_trial(self, name: str) -> BestTrial | None:
        """The sweep's best trial so far and its manifest; None before any trial reported a value."""
        return best_trial_of(self.get_sweep(name))

    def _pause(self, deadline: float | None) -> float:
        return self.poll_seconds if deadline is None else max(0.0, min(self.poll_seconds, deadline - time.monotonic()))


def selector_text(selector: str | Mapping[str, str] | None) -> str | None:
    """A label selector as the API server takes it."""
    if selector is None or isinstance(selector, str):
        return selector or None
    return ",".join(f"{k}={v}" for k, v in selector.items()) or None
