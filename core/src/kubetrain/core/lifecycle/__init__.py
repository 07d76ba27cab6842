"""The lifecycle: one state machine that both backends drive.

`step(spec, status, observed, now)` takes what a backend observed about the current gang (worker
states, rank 0's progress) and the job's status, and returns the new status and the effects to
carry out (create workers, delete workers, record an Event, delete the job). It never reads a
clock or does I/O; the Kubernetes operator and the local process backend only translate effects
into API calls or process signals.

Rules (the same everywhere; one function each in `policies`):
- Any worker failure -- non-zero exit, deletion, eviction, a node NotReady past its grace with no
  progress of the job in that grace (none while many of the cluster's nodes are NotReady at once: cluster_disruption),
  no progress for progressDeadlineSeconds -- restarts the WHOLE gang from the latest complete
  checkpoint, once per failure: every old worker is gone before the next generation starts. The
  messages name that checkpoint's step, or why there is none (restart_origin).
- In place (restartPolicy.inPlace): the workers still running and able to are kept; they join the
  next generation at once (KeepWorkers) and their launchers are told to run it when the recreated
  workers are created (CreateWorkers.resume), after the restart's backoff.
- An exit code listed in restartPolicy.permanentExitCodes fails the job at once.
- Restarts back off exponentially; restartPolicy.backoffLimit caps their count.
- activeDeadlineSeconds fails a job that has been active too long.
- suspend deletes every worker; resuming starts a new generation from the latest checkpoint.
- Success: worker 0 (rank 0) exited 0 (it does so only after the final checkpoint).
- A finished job: cleanPodPolicy, then ttlSecondsAfterFinished.
"""

from kubetrain.core.lifecycle import model
from kubetrain.core.lifecycle.machine import finished, step, view
from kubetrain.core.lifecycle.model import *  # noqa: F403 - the vocabulary, re-exported whole (model.__all__)
from kubetrain.core.lifecycle.policies import (
    JobView,
    backoff_seconds,
    classify,
    cluster_disruption,
    decide,
    progressing_despite,
    restart_origin,
)
from kubetrain.core.lifecycle.status import gpu_hours_now, phase_conditions, set_condition, take_progress

__all__ = [
    *model.__all__, "JobView", "backoff_seconds", "classify", "cluster_disruption", "decide", "finished", "gpu_hours_now",
    "phase_conditions",
    "progressing_despite", "restart_origin", "set_condition", "step", "take_progress", "view",
]
