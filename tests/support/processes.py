"""Child processes of tests and benchmarks: run a tool and check it, stop a server politely."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kubetrain.core import hangs

KILL_WAIT_S = 10.0
"""How long a SIGKILLed process may take to be reaped."""


def run_checked(cmd: Sequence[str], *, check: bool = True, env: Mapping[str, str] | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``cmd`` with its output captured as text and ``env`` over this process's environment; with
    ``check``, a non-zero exit fails the test with the command and the tail of its output."""
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, check=False,
                          env={**os.environ, **env} if env else None)
    if check and proc.returncode != 0:
        shown = " ".join([Path(cmd[0]).name, *cmd[1:]])
        # The last line of stderr on the first line: a CI summary shows only an error's first line.
        last = next((line for line in reversed(proc.stderr.splitlines()) if line.strip()), "")
        raise AssertionError(f"{shown} exited {proc.returncode}: {last}\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-4000:]}")
    return proc


def stop_process(proc: subprocess.Popen[Any] | None, grace: float = 15.0, *, group: bool = False) -> None:
    """SIGTERM, then SIGKILL if it is still running after ``grace`` seconds; a no-op once it has exited.

    ``group``: signal its whole process group (it was started with ``start_new_session=True``).
    """
    if proc is None or proc.poll() is not None:
        return
    _signal(proc, signal.SIGTERM, group)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        kill_process(proc, group=group)


def kill_process(proc: subprocess.Popen[Any] | None, *, group: bool = False) -> None:
    """SIGKILL (no clean shutdown) and reap it; a no-op once it has exited."""
    if proc is None or proc.poll() is not None:
        return
    _signal(proc, signal.SIGKILL, group)
    proc.wait(KILL_WAIT_S)


def _signal(proc: subprocess.Popen[Any], sig: int, group: bool) -> None:
    if group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)


def rank_pid(beats: Path, rank: int) -> int | None:
    """A rank's process under a hang-watching supervisor, from the stack-dump files its sitecustomize made in
    the heartbeat directory `beats` (`<pid>.stack`) and the rank each of those processes was given."""
    for f in beats.glob("*.stack"):
        try:
            env = Path(f"/proc/{f.stem}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return int(f.stem)
    return None


def stopped(pid: int) -> bool:
    """Whether every thread of `pid` is stopped (SIGSTOP taken effect): hangs.proc_state of each of its tasks."""
    tids = [int(task.name) for task in Path(f"/proc/{pid}/task").glob("*")]
    return bool(tids) and all(hangs.proc_state(tid).startswith("stopped") for tid in tids)
