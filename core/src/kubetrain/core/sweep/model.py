"""What the sweep policy observes and what it asks its backend to do.

The policy (:func:`kubetrain.core.sweep.policy.step`) is pure: the backend (the local
sweep runner or the operator's sweep controller) observes its trials, calls it, and
carries out the effects. The sweep's status is the whole state: the Optuna study is
rebuilt from it on every step, so a restarted backend loses nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kubetrain.core.api import Phase, TrainingSweepStatus


@dataclass(frozen=True)
class TrialObservation:
    """What a backend sees of one trial's TrainingJob (or local run)."""

    phase: Phase | None
    """The job's phase; None when the job does not exist (not yet created, or deleted)."""
    step: int = 0
    """Last step its rank 0 reported."""
    loss: float | None = None
    """Last loss its rank 0 reported."""
    message: str = ""
    """The job's status message (why it failed)."""
    eval_loss: float | None = None
    """Loss on held-out data at its rank 0's newest evaluation."""

    def metric(self, name: str) -> float | None:
        """The value of the sweep's objective metric (SweepObjective.metric)."""
        return self.eval_loss if name == "evalLoss" else self.loss


@dataclass(frozen=True)
class StartTrial:
    """Create the trial's job (idempotent: the job name is deterministic) with these parameters."""

    index: int
    job_name: str
    params: dict[str, Any]


@dataclass(frozen=True)
class StopTrial:
    """Stop the trial's job and release its resources (suspend its TrainingJob in a cluster, end its processes locally)."""

    index: int
    job_name: str
    reason: str


@dataclass(frozen=True)
class SweepEvent:
    """Something a user should see (a Kubernetes Event, a line of the local run's output)."""

    type: str
    """Normal or Warning."""
    reason: str
    message: str


Effect = StartTrial | StopTrial | SweepEvent


@dataclass(frozen=True)
class SweepTransition:
    """The new status, what to do, and when to look again (None: on the next change)."""

    status: TrainingSweepStatus
    effects: tuple[Effect, ...]
    requeue_after: float | None = None
