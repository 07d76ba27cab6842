"""The operator as a child process of a test, with its own kubeconfig and a log kept for failures."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from . import lanes
from .ports import free_port
from .processes import kill_process, stop_process


class OperatorProcess:
    """`python -m kubetrain.operator ARGS...` (or ``command``), as a context manager or through
    start/stop/kill for tests that kill and restart it.

    ``own_session``: in a process group of its own, signalled as a whole (a wrapper such as
    `buildah run` around the operator); ``grace``: seconds from SIGTERM to SIGKILL; ``env``: settings the chart would
    set in the operator's environment (KUBETRAIN_*). In a test lane it watches only the lane's namespaces unless
    ``args`` name some (support/lanes.py).
    """

    def __init__(self, kubeconfig: Path, log: Path, *args: str, metrics_port: int = 0,
                 command: list[str] | None = None, trainer_image: str = "kubetrain/trainer:test",
                 own_session: bool = False, grace: float = 15.0, env: Mapping[str, str] | None = None):
        self.kubeconfig, self.log_path, self.metrics_port = kubeconfig, log, metrics_port
        self.args = lanes.operator_args(args, given=command or ())
        self.env = dict(env or {})
        self.command, self.trainer_image = command, trainer_image
        self.own_session, self.grace = own_session, grace
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        # A fresh liveness port on every start: a restarted operator must not race the old one's.
        command = self.command or [sys.executable, "-m", "kubetrain.operator",
                                   "--liveness", f"http://127.0.0.1:{free_port()}/healthz"]
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "KUBETRAIN_METRICS_PORT": str(self.metrics_port),
               "KUBETRAIN_TRAINER_IMAGE": self.trainer_image, **self.env}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([*command, *self.args], env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=self.own_session)

    def stop(self) -> None:
        stop_process(self.proc, self.grace, group=self.own_session)

    def kill(self) -> None:
        """SIGKILL: no clean shutdown, no Lease release."""
        kill_process(self.proc, group=self.own_session)

    def __enter__(self) -> OperatorProcess:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])
