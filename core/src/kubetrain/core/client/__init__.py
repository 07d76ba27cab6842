"""kubetrain's Python client: TrainingJobs and TrainingSweeps from a notebook, a pipeline step or a script,
on a cluster (ClusterClient) or on this machine (LocalClient), with the same calls. See docs/sdk.md.

Imported as `kubetrain.client` (the public name); it lives in kubetrain.core so that the CLI, which
is built on it, imports only downwards.
"""

from kubetrain.core.client.cluster import ClusterClient
from kubetrain.core.client.errors import (
    ApiError,
    ClientError,
    Conflict,
    Forbidden,
    Invalid,
    InvalidManifest,
    JobFailed,
    NotFound,
    Unauthorized,
    WaitTimeout,
)
from kubetrain.core.client.local import LocalClient
from kubetrain.core.client.model import BestTrial, Event, ProgressUpdate, TrainingClient, Worker

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
    "Unauthorized",
    "WaitTimeout",
    "Worker",
]
