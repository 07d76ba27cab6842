"""`kubetrain.client`: the Python client for TrainingJobs and TrainingSweeps (docs/sdk.md).

    from kubetrain.client import ClusterClient, LocalClient

The implementation is kubetrain.core.client (the CLI is built on it); this is its public name.
"""

from kubetrain.core.api import TrainingJob, TrainingJobStatus, TrainingSweep, TrainingSweepStatus
from kubetrain.core.client import (
    ApiError,
    BestTrial,
    ClientError,
    ClusterClient,
    Conflict,
    Event,
    Forbidden,
    Invalid,
    InvalidManifest,
    JobFailed,
    LocalClient,
    NotFound,
    ProgressUpdate,
    TrainingClient,
    Unauthorized,
    WaitTimeout,
    Worker,
)

__all__ = [
    "ApiError",
    "BestTrial",
    "ClientError",
    "ClusterClient",
    "Conflict",
    "Event",
    "Forbidden",
    "Invalid",
    "InvalidManifest",
    "JobFailed",
    "LocalClient",
    "NotFound",
    "ProgressUpdate",
    "TrainingClient",
    "TrainingJob",
    "TrainingJobStatus",
    "TrainingSweep",
    "TrainingSweepStatus",
    "Unauthorized",
    "WaitTimeout",
    "Worker",
]
