"""The operator's controller: TrainingJobs and, above them, TrainingSweeps, under one leadership and on
one API call pool.

A sweep's trials are TrainingJobs, so sweeps depend on jobs and never the other way: the job controller
(jobs/controller.py) knows nothing of sweeps, and this one adds the SweepController beside it: a job's
event also queues the sweep that owns it, and the sweeps' cache fills and leads with the jobs'.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from kubernetes import client

from kubetrain.operator.jobs.controller import JobController
from kubetrain.operator.jobs.pod_watch import PodList
from kubetrain.operator.runtime.settings import OperatorSettings
from kubetrain.operator.sweeps.controller import SweepController

__all__ = ["Controller"]


class Controller(JobController):
    def __init__(self, api_client: client.ApiClient, settings: OperatorSettings,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC)):
        super().__init__(api_client, settings, clock)
        self.sweeps = SweepController(self.applier, settings.reconcile_workers, clock)
        """TrainingSweeps: their own cache and queue, the jobs' applier and pool, the same leadership."""

    def job_event(self, kind: str | None, body: dict[str, Any]) -> None:
        self.sweeps.job_event(kind, body)  # a sweep's trial queues its sweep
        super().job_event(kind, body)

    async def start(self) -> None:
        await super().start()
        self.tasks.append(asyncio.create_task(self.sweeps.serve()))

    def _lead(self, leading: bool) -> None:
        super()._lead(leading)
        self.sweeps.set_leading(leading)

    async def _fill_cache(self) -> list[PodList]:
        listed = await super()._fill_cache()
        await self.sweeps.fill(self.settings.scopes(), self.settings.watches)
        return listed
