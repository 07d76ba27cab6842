"""The e2e tier's fork server (support.forkserver): a forked rank behaves as the process it stands for."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.forkserver import ForkedRank, Server, reaped_cpu_seconds

PROBE = """
import os, sys, time
print("cwd", os.getcwd(), "path0", sys.path[0], "value", os.environ.get("PROBE_VALUE"), flush=True)
print("oops", file=sys.stderr, flush=True)
mode = os.environ["PROBE_MODE"]
if mode == "sleep":
    time.sleep(60)
elif mode == "burn":
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
elif mode == "raise":
    raise RuntimeError("the probe failed")
sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
"""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    running = Server(tmp_path, env, preload=[]).start()
    try:
        yield running
    finally:
        running.stop()


def _spawn(server: Server, work: Path, mode: str, **extra: str) -> ForkedRank:
    work.mkdir(exist_ok=True)
    (work / "probe_rank.py").write_text(PROBE)
    env = {**server.env, "PROBE_MODE": mode, **extra}
    return server.spawn(env, work, work / "rank.log", module="probe_rank")


def test_a_forked_rank_gets_its_environment_directory_log_and_exit_code(server: Server, tmp_path: Path) -> None:
    rank = _spawn(server, tmp_path / "a", "exit", PROBE_VALUE="seven", PROBE_EXIT="3")
    assert rank.wait(30) == 3
    log = (tmp_path / "a" / "rank.log").read_text()
    assert f"cwd {tmp_path / 'a'} path0 {tmp_path / 'a'} value seven" in log
    assert "oops" in log  # stderr goes to the same log


def test_an_exception_exits_1_with_its_traceback_as_python_m_would(server: Server, tmp_path: Path) -> None:
    rank = _spawn(server, tmp_path / "b", "raise")
    assert rank.wait(30) == 1
    assert "RuntimeError: the probe failed" in (tmp_path / "b" / "rank.log").read_text()


def test_a_signal_reaches_the_rank_and_its_returncode_says_so(server: Server, tmp_path: Path) -> None:
    rank = _spawn(server, tmp_path / "c", "sleep")
    deadline = time.monotonic() + 30
    while "value" not in (tmp_path / "c" / "rank.log").read_text(errors="replace") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rank.poll() is None
    with pytest.raises(Exception, match="timed out"):
        rank.wait(0.1)
    rank.terminate()
    assert rank.wait(30) == -signal.SIGTERM
    assert rank.poll() == -signal.SIGTERM


def test_a_ranks_cpu_is_counted_once_it_is_reaped(server: Server, tmp_path: Path) -> None:
    before = reaped_cpu_seconds()
    assert _spawn(server, tmp_path / "d", "burn").wait(30) == 0
    assert reaped_cpu_seconds() - before >= 0.3


def test_only_a_rank_whose_startup_environment_is_the_servers_is_forked(server: Server) -> None:
    assert server.compatible({**server.env, "KUBETRAIN_ANYTHING": "1"})
    assert not server.compatible({**server.env, "PYTHONPATH": "/elsewhere"})  # e.g. a sitecustomize to run
    assert not server.compatible({**server.env, "OMP_NUM_THREADS": "7"})


def test_a_client_gone_before_its_request_leaves_the_server_serving(server: Server, tmp_path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
        gone.connect(str(server.socket_path))
        gone.sendall(b'{"half": ')
    assert _spawn(server, tmp_path / "e", "exit").wait(30) == 0
    assert server.proc is not None and server.proc.poll() is None
