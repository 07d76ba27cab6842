"""Trainer ranks forked from a process that has imported torch and the trainer once (the e2e tier's gangs).

A rank of a test gang is ``python -m kubetrain.trainer``; about 4 of the 5.4 CPU seconds a one-step rank costs
are imports (torch 2.3 s, Dynamo 1.6 s, which DDP and FSDP2 import on first use), paid again by every rank of
every gang, on a machine whose two cores the suite keeps busy. The fork server pays them once per session: it
imports them, then for each rank forks a child that takes the rank's environment, working directory and log
and runs the same entry point (``runpy`` of ``kubetrain.trainer`` as ``__main__``, as ``-m`` does), exiting
as that process would. Only imports are shared; every rank is still its own process, with its own pid,
signals and exit status (reported back by the server, which reaps it, with its CPU time).

The server is single-threaded (a fork from a multi-threaded process could inherit a held lock) and exits when
its standard input closes, so it never outlives the session that started it. Used only where a test session
asks for it (tests/e2e/conftest.py); bench/ measures real ranks (their memory counts what they import).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PRELOAD = ("torch", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.checkpoint",
           "torch.distributed.tensor.parallel", "torch.distributed.pipelining", "kubetrain.trainer.loop",
           "kubetrain.trainer.main")
OPTIONAL = ("transformers", "transformers.models.llama.modeling_llama", "peft", "deepspeed")
"""Imported too where installed: the Hugging Face tests' ranks (a tiny Llama, LoRA) and ZeRO's import them, 3.7
CPU seconds more for the first two."""
STARTUP_PREFIXES = ("PYTHON", "TORCH", "OMP_", "MKL_", "LD_", "HF_", "TRANSFORMERS", "DS_", "CUDA")
START_TIMEOUT_S = 300.0
_reaped_cpu = [0.0]


def reaped_cpu_seconds() -> float:
    """CPU seconds of every forked rank reaped so far (their server's children, not this process's)."""
    return _reaped_cpu[0]


# ------------------------------------------------------------------------------------------- the server


def _preload(required: list[str], optional: list[str]) -> None:
    for name in required:
        importlib.import_module(name)
    for name in optional:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the client may be gone; the rank is reaped all the same
        conn.sendall((json.dumps(message) + "\n").encode())


def _status(wait_status: int) -> int:
    """subprocess's returncode: the exit code, or minus the signal that ended the process."""
    return -os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else os.WEXITSTATUS(wait_status)


def _reap(running: dict[int, socket.socket]) -> None:
    while running:
        try:
            pid, wait_status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = running.pop(pid, None)
        if conn is not None:
            _send(conn, {"returncode": _status(wait_status), "cpu": usage.ru_utime + usage.ru_stime})
            conn.close()


def _read_request(conn: socket.socket) -> dict[str, Any]:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("client closed before its request")
        data += chunk
    return dict(json.loads(data))


def serve(path: str) -> tuple[dict[str, Any], list[Any]] | None:
    """Forks a child per request until standard input closes. Returns only in a child: its request, and the
    server's descriptors for it to close."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    for what in (listener, wake_r, sys.stdin):
        sel.register(what, selectors.EVENT_READ)
    running: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while True:
        for key, _ in sel.select():
            if key.fileobj is sys.stdin and not sys.stdin.readline():
                return None
            if key.fileobj == wake_r:
                os.read(wake_r, 4096)
            elif key.fileobj is listener:
                conn, _ = listener.accept()
                try:
                    request = _read_request(conn)
                except (OSError, ValueError) as exc:  # one client's trouble, not the server's end
                    print(f"forkserver: request refused: {exc}", file=sys.stderr, flush=True)
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    return request, [listener, wake_r, wake_w, *running.values(), conn]
                running[pid] = conn
                _send(conn, {"pid": pid})
        _reap(running)


def _become_rank(request: dict[str, Any], inherited: list[Any]) -> None:
    """In the forked child: the rank's process, as ``python -m MODULE`` would start it. Does not return."""
    import runpy  # noqa: PLC0415

    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
    for item in inherited:
        with contextlib.suppress(OSError):
            if isinstance(item, int):
                os.close(item)
            else:
                item.close()
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]  # as `python -m` starts there: the working directory, not the server's
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [request["module"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


def main(argv: list[str]) -> int:
    """``forkserver.py SOCKET [MODULE...]``: imports the modules (default: PRELOAD, and OPTIONAL where
    installed; ``-`` alone: none), then serves on the UNIX socket SOCKET."""
    modules = argv[2:]
    _preload(*(([], []) if modules == ["-"] else (modules, []) if modules else (list(PRELOAD), list(OPTIONAL))))
    child = serve(argv[1])
    if child is None:
        Path(argv[1]).unlink(missing_ok=True)
        return 0
    _become_rank(*child)
    return 0


# ------------------------------------------------------------------------------------------- the client


class ForkedRank:
    """subprocess.Popen's interface (pid, poll, wait, send_signal, terminate, kill, returncode) for a rank the
    server forked."""

    def __init__(self, server: Server, env: dict[str, str], cwd: Path, log: Path, module: str) -> None:
        self.args = [sys.executable, "-m", module]
        self.returncode: int | None = None
        self._server = server
        log.open("ab").close()  # there once started, as a log Popen's caller opens for it
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(str(server.socket_path))
        request = {"env": env, "cwd": str(cwd), "log": str(log), "module": module}
        self._conn.sendall((json.dumps(request) + "\n").encode())
        self.pid = int(json.loads(_recv_line(self._conn))["pid"])

    def poll(self) -> int | None:
        if self.returncode is None and _readable(self._conn, 0):
            self._finish()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not _readable(self._conn, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._finish()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _finish(self) -> None:
        line = _recv_line(self._conn)
        if not line:
            raise RuntimeError(f"the fork server closed rank {self.pid}'s connection without its exit status")
        done = json.loads(line)
        self.returncode = int(done["returncode"])
        self._server.counted += float(done["cpu"])
        _reaped_cpu[0] += float(done["cpu"])
        self._conn.close()


def _recv_line(conn: socket.socket) -> bytes:
    """One line, read a byte at a time: nothing of the next line is taken into a buffer the select cannot see
    (the exit status of a rank that ended at once follows its pid on the same connection)."""
    line = b""
    while not line.endswith(b"\n") and (byte := conn.recv(1)):
        line += byte
    return line


def _readable(source: Any, timeout: float | None) -> bool:
    """Whether `source` (a socket, an unbuffered pipe) has something to read within `timeout` (None: ever)."""
    with selectors.DefaultSelector() as sel:
        sel.register(source, selectors.EVENT_READ)
        return bool(sel.select(None if timeout is None else max(0.0, timeout)))


class Server:
    """A running fork server (:meth:`start`, then :meth:`spawn` per rank, :meth:`stop` at the end)."""

    def __init__(self, work: Path, env: dict[str, str], preload: list[str] | None = None) -> None:
        """``preload``: the modules to import first (None: torch and the trainer, PRELOAD; []: none)."""
        self.preload = ["-"] if preload == [] else (preload or [])
        self.socket_path = work / "forkserver.sock"
        self.log_path = work / "forkserver.log"
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.counted = 0.0
        """CPU seconds of its reaped ranks, counted in reaped_cpu_seconds() until the server itself is reaped."""

    def start(self) -> Server:
        """Blocks until the server has imported everything (a few CPU seconds, once)."""
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "support.forkserver", str(self.socket_path), *self.preload],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, bufsize=0,
                                         env=self.env, cwd=Path(__file__).resolve().parent.parent)
        try:
            self._await_ready()
        except AssertionError:
            self.proc.kill()
            self.proc.wait()
            raise
        return self

    def _await_ready(self) -> None:
        """Until the server says "ready"; what the imports print before it (DeepSpeed's notices) goes to its log.
        Its stdout is unbuffered: a line read ahead into a buffer would be invisible to the select."""
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if not _readable(self.proc.stdout, deadline - time.monotonic()):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    break
                continue
            line = self.proc.stdout.readline()
            if line.strip() == b"ready":
                return
            if not line:
                break
            with self.log_path.open("ab") as log:
                log.write(line)
        raise AssertionError(f"fork server not ready: {self.log_path.read_text(errors='replace')[-3000:]}")

    def compatible(self, env: dict[str, str]) -> bool:
        """A rank with this environment may be forked: the variables read while the interpreter and the
        preloaded modules start (STARTUP_PREFIXES: a sitecustomize on a PYTHONPATH, thread counts, Hugging Face's
        offline switches) are the server's."""
        def startup(e: dict[str, str]) -> dict[str, str]:
            return {k: v for k, v in e.items() if k.startswith(STARTUP_PREFIXES)}
        return startup(env) == startup(self.env)

    def spawn(self, env: dict[str, str], cwd: Path, log: Path, module: str = "kubetrain.trainer") -> ForkedRank:
        return ForkedRank(self, env, cwd, log, module)

    def stop(self) -> None:
        """Closes its standard input (it exits); ranks still running are left to their gangs' own stop."""
        if self.proc is None:
            return
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        # Reaped, the server brings its ranks' CPU into this process's RUSAGE_CHILDREN: not to count it twice.
        _reaped_cpu[0] -= self.counted
        self.counted = 0.0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
