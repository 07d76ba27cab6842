"""`kubetrain sweep --storage URL`: every finished trial copied into an Optuna study named after the sweep,
so that optuna-dashboard (or any Optuna code) can show it. The sweep's status stays the state: the
study is only written to, once per trial, and a resumed sweep skips the trials already there.
"""

from __future__ import annotations

import contextlib

import optuna

from kubetrain.core.api import FINISHED_TRIAL_STATES, TrainingSweepSpec, TrainingSweepStatus, TrialRecord
from kubetrain.core.contract import parse_time
from kubetrain.core.sweep import study

INDEX_ATTR = "kubetrain_trial_index"
"""User attribute of each mirrored trial: its index in the sweep (how a resumed sweep knows it is there)."""
JOB_ATTR = "kubetrain_job"
"""User attribute of each mirrored trial: its TrainingJob's name."""


class StorageError(Exception):
    """The storage URL cannot be opened; the message says why."""


class StudyMirror:
    def __init__(self, url: str, name: str, spec: TrainingSweepSpec, fresh: bool = False):
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.spec = spec
        try:
            if fresh:
                with contextlib.suppress(KeyError):
                    optuna.delete_study(study_name=name, storage=url)
            self.study = optuna.create_study(storage=url, study_name=name, direction="minimize", load_if_exists=True)
        except Exception as exc:  # storages raise their own errors (SQLAlchemy, redis, gRPC) beside ValueError
            raise StorageError(f"--storage {url}: {type(exc).__name__}: {exc}") from exc
        self.done = {t.user_attrs.get(INDEX_ATTR) for t in self.study.get_trials(deepcopy=False)}

    def sync(self, status: TrainingSweepStatus) -> int:
        """Add every finished trial not in the study yet; returns how many were added."""
        added = 0
        for record in status.trials:
            if record.state in FINISHED_TRIAL_STATES and record.index not in self.done:
                self.study.add_trial(self._trial(record))
                self.done.add(record.index)
                added += 1
        return added

    def _trial(self, record: TrialRecord) -> optuna.trial.FrozenTrial:
        trial = study.frozen(self.spec, record)
        trial.user_attrs = {INDEX_ATTR: record.index, JOB_ATTR: record.job_name}
        start, end = parse_time(record.start_time), parse_time(record.completion_time)
        if start is not None and end is not None:  # Optuna keeps naive local times
            trial.datetime_start = start.astimezone().replace(tzinfo=None)
            trial.datetime_complete = end.astimezone().replace(tzinfo=None)
        return trial
