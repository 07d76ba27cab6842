"""A small in-pod launcher: one pod, several trainer processes (one per GPU).

Used when ``RANK`` is unset but ``PET_NPROC_PER_NODE`` is set (the operator sets the
torchrun variables for a pod with procsPerWorker > 1). Child ``i`` gets
``RANK = NODE_RANK × nproc + i``, ``LOCAL_RANK = i`` and metrics port ``base + i``.
When a child fails the others are terminated and the launcher exits with the
failed child's code (the first failure that is not a lost peer, exit 3, if one shows
within PEER_LOST_GRACE_SECONDS); SIGTERM/SIGINT are forwarded to every child.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from types import FrameType

from kubetrain.core import contract

TERMINATE_GRACE_SECONDS = 30.0
PEER_LOST_GRACE_SECONDS = 5.0


def _get(env: Mapping[str, str], *names: str, default: str | None = None) -> str | None:
    for name in names:
        value = env.get(name)
        if value:
            return value
    return default


def child_envs(env: Mapping[str, str]) -> list[dict[str, str]]:
    """The environment of every child process of this pod."""
    nproc = int(_get(env, contract.PET_NPROC_PER_NODE, contract.LOCAL_WORLD_SIZE, default="1") or 1)
    node_rank = int(_get(env, contract.NODE_RANK, contract.PET_NODE_RANK, default="0") or 0)
    nnodes = int(_get(env, contract.PET_NNODES, default="1") or 1)
    world_size = int(_get(env, contract.WORLD_SIZE, default=str(nnodes * nproc)) or nnodes * nproc)
    base_port = _get(env, contract.METRICS_PORT)
    out = []
    for local_rank in range(nproc):
        child = dict(env)
        child.update(
            {
                contract.RANK: str(node_rank * nproc + local_rank),
                contract.LOCAL_RANK: str(local_rank),
                contract.WORLD_SIZE: str(world_size),
                contract.LOCAL_WORLD_SIZE: str(nproc),
                contract.NODE_RANK: str(node_rank),
                contract.MASTER_ADDR: _get(env, contract.MASTER_ADDR, contract.PET_MASTER_ADDR, default="127.0.0.1")
                or "127.0.0.1",
                contract.MASTER_PORT: _get(
                    env, contract.MASTER_PORT, contract.PET_MASTER_PORT, default=str(contract.DEFAULT_MASTER_PORT)
                )
                or str(contract.DEFAULT_MASTER_PORT),
            }
        )
        if base_port and base_port.isdigit() and int(base_port) > 0:
            child[contract.METRICS_PORT] = str(int(base_port) + local_rank)
        out.append(child)
    return out


def launch() -> int:
    children = [subprocess.Popen([sys.executable, "-m", "kubetrain.trainer"], env=e) for e in child_envs(os.environ)]

    def forward(signum: int, _frame: FrameType | None) -> None:
        for c in children:
            if c.poll() is None:
                c.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    failed: dict[int, int] = {}  # pid -> exit code, in the order the children were seen to fail
    first_failure_at = 0.0
    while True:
        for c in children:
            code = c.poll()
            if code and c.pid not in failed:
                failed[c.pid] = contract.exit_code(code)
                first_failure_at = first_failure_at or time.monotonic()
        if failed:
            codes = list(failed.values())
            # A rank that lost its peer usually dies a moment after the rank that caused it:
            # when that is all there is so far, give a sibling in this pod PEER_LOST_GRACE_SECONDS
            # to show the real cause.
            waiting = (
                all(f == contract.PEER_LOST_EXIT_CODE for f in codes)
                and time.monotonic() - first_failure_at < PEER_LOST_GRACE_SECONDS
                and any(c.poll() is None for c in children)
            )
            if not waiting:
                _terminate(children)
                return contract.root_cause(codes) or 1
        elif all(c.poll() == 0 for c in children):
            return 0
        time.sleep(0.1)


def _terminate(children: list[subprocess.Popen[bytes]]) -> None:
    for c in children:
        if c.poll() is None:
            c.terminate()
    deadline = time.monotonic() + TERMINATE_GRACE_SECONDS
    for c in children:
        try:
            c.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.kill()
            c.wait()
