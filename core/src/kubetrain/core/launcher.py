"""One worker's processes: procsPerWorker ranks of one command, each with the full contract env.

The one per-worker launcher, used wherever a worker runs several processes:
- a pod of the built-in trainer: `python -m kubetrain.trainer` with RANK unset calls launch();
- a pod with a custom command (spec.command) and procsPerWorker > 1: the operator ships this
  file and contract.py in the job's ConfigMap (FILES) and the container runs
  `python3 /etc/kubetrain/launcher.py -- COMMAND ARGS...`, so a user's image needs python3
  but not kubetrain. That is why this module (and contract.py) import the standard library
  only and run on Python 3.8+;
- the local backend (kubetrain.core.local) starts each rank itself, with child_envs() and start().

Child i gets the worker's environment with the torch and torchrun variables of local rank i
(RANK = NODE_RANK x nproc + i, LOCAL_RANK = i), built by contract.torch_env (their one builder)
from the placement read back from the worker's environment, and metrics port
KUBETRAIN_METRICS_PORT + i. SIGTERM/SIGINT go to every child (they checkpoint and exit). When
a child fails the others are terminated and the launcher exits with the root cause
(contract.root_cause: the first failure that is not a lost peer, exit 3, nor an abort, 134, waiting up to
PEER_LOST_GRACE_SECONDS for one). A command that cannot be started exits 127 (not found) or
126 (not executable) after one line on stderr, as a shell does.

In a pod that restarts in place (restartPolicy.inPlace; the operator sets KUBETRAIN_GENERATION_FILE to
a Downward API file holding the pod's kubetrain.io/restart-generation annotation) the launcher outlives
its processes' lost peers: it waits for a higher number in that file (at most
KUBETRAIN_IN_PLACE_WAIT_SECONDS, then it exits 75), SIGKILLs whatever still runs of the old generation
(its state is in the latest complete checkpoint) and starts the processes again with that
KUBETRAIN_RESTART_GENERATION. Its own processes' failure still ends the worker (the container exits), so
the operator sees it; such a pod has restartPolicy OnFailure, and the kubelet starts the container again
in the same pod. The new launcher finds in KUBETRAIN_RAN_GENERATION_FILE (in the pod's own emptyDir,
which outlives the container) that its generation already ran here, and waits for the next one as a kept
worker does, instead of running the failed generation again. For kubetrain's own trainer (`standby`), a
launcher that waits starts its ranks at once as standbys (contract.STANDBY): they import torch and the
trainer while the operator and the kubelet pass the new generation on, and start training the moment
it arrives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

if __package__:
    from kubetrain.core import contract, hangs, rendezvous
else:  # run as a file from the job's ConfigMap: contract.py, hangs.py and rendezvous.py lie beside it
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import contract
    import hangs
    import rendezvous

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from types import FrameType

SCRIPT = "launcher.py"
FILES = (SCRIPT, "contract.py", "hangs.py", "rendezvous.py")
"""What a pod needs to run this file without kubetrain installed (kubetrain.core modules)."""
TERMINATE_GRACE_SECONDS = 30.0
PEER_LOST_GRACE_SECONDS = 5.0
POLL_SECONDS = 0.1
PROBE_ACCEPT_SECONDS = 0.5
"""How often the readiness probe's thread sees that its socket was closed."""
KILL_WAIT_SECONDS = 30.0
IN_PLACE_ONLY = (contract.GENERATION_FILE, contract.IN_PLACE_WAIT, contract.RAN_FILE)
"""The launcher's own variables, not passed on to the ranks."""
HANG_CHECK_SECONDS = 1.0
HANG_SETTLE_SECONDS = 5.0
"""After saving its stacks, a worker found hung by its silence limit waits this long before it ends its ranks:
the other workers' launchers, which find the gang silent at about the same moment, capture theirs before peers
vanish. A worker with a stopped rank ends at once: the culprit is known, and the others are not yet past their
limits."""
DEFAULT_IN_PLACE_WAIT_SECONDS = 360.0
"""Without IN_PLACE_WAIT: restartPolicy's default maxBackoffSeconds + IN_PLACE_WAIT_MARGIN_SECONDS."""


class NotStarted:
    """Stands in for the Popen of a command that could not be started: it has already exited."""

    pid = -1

    def __init__(self, returncode: int) -> None:
        self.returncode = returncode

    def poll(self) -> int:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        pass

    def terminate(self) -> None:
        pass

    def kill(self) -> None:
        pass


def child_envs(env: Mapping[str, str]) -> list[dict[str, str]]:
    """The environment of every process of one worker, from the worker's (a pod's) environment."""
    nproc = contract.env_int(env, contract.PET_NPROC_PER_NODE, contract.LOCAL_WORLD_SIZE, default=1)
    nnodes = contract.env_int(env, contract.PET_NNODES, default=1)
    node_rank = contract.env_int(env, contract.NODE_RANK, contract.PET_NODE_RANK, default=0)
    addr = contract.env_value(env, contract.MASTER_ADDR, contract.PET_MASTER_ADDR) or "127.0.0.1"
    port = contract.env_int(env, contract.MASTER_PORT, contract.PET_MASTER_PORT, default=contract.DEFAULT_MASTER_PORT)
    base_port = contract.env_int(env, contract.METRICS_PORT, default=0)
    out = []
    for local_rank in range(nproc):
        placement = contract.WorkerPlacement(node_rank, local_rank, nproc, nnodes)
        child = {**env, **contract.torch_env(placement, addr, port)}
        if base_port > 0:  # 0 leaves metrics off
            child[contract.METRICS_PORT] = str(base_port + local_rank)
        out.append(child)
    return out


def not_started(command: Sequence[str], error: OSError, path: str | None) -> tuple[int, str]:
    """The exit code and the one-line message for a command whose exec failed, as a shell words them."""
    name = command[0]
    if isinstance(error, FileNotFoundError):
        code = contract.COMMAND_NOT_FOUND_EXIT_CODE
        found = shutil.which(name, path=path) if os.sep not in name else (name if os.path.exists(name) else None)
        if found:  # the file is there: execve's ENOENT is about its #! interpreter
            why = f"{found} exists but cannot be started: its #! interpreter was not found"
        elif os.sep in name:
            why = "no such file"
        else:
            why = "command not found on PATH"
    else:
        code = contract.COMMAND_NOT_EXECUTABLE_EXIT_CODE
        why = f"cannot execute: {error.strerror or error}"
    return code, f"kubetrain: {name}: {why} (exit {code})"


def start(
    command: Sequence[str], env: Mapping[str, str], stdout: IO[bytes] | None = None, **popen: Any
) -> subprocess.Popen[bytes] | NotStarted:
    """subprocess.Popen(command), or, when it cannot be started, a NotStarted (127/126) after one line
    on `stdout` (a binary file, e.g. a rank's log) or else on stderr. No traceback for a typo."""
    try:
        return subprocess.Popen(list(command), env=dict(env), stdout=stdout, **popen)
    except OSError as exc:
        if exc.errno is None:  # not exec's failure (e.g. a stdout without a file descriptor)
            raise
        code, message = not_started(command, exc, env.get("PATH", os.defpath))
        if stdout is None:
            print(message, file=sys.stderr, flush=True)
        else:
            stdout.write((message + "\n").encode())
            stdout.flush()
        return NotStarted(code)


@dataclass
class HangWatch:
    """The worker's hang detection (kubetrain.core.hangs): its ranks' heartbeats, checked every second."""

    limits: hangs.Limits
    env: Mapping[str, str]
    ranks: list[int]
    beats: str = ""
    guard: hangs.Guard | None = None
    next_check: float = 0.0
    generation: int = 0
    peers: hangs.PeerWatch | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str], envs: list[dict[str, str]]) -> HangWatch | None:
        limits = hangs.Limits.decode(env.get(contract.HANG))
        if limits is None:
            return None
        ranks = [contract.env_int(e, contract.RANK, default=i) for i, e in enumerate(envs)]
        return cls(limits, env, ranks, peers=hangs.PeerWatch.from_env(env))

    def child_env(self) -> dict[str, str]:
        """The variables every rank gets: the heartbeat directory and the sitecustomize for stack dumps."""
        base = os.path.join(self.env.get(contract.OUTPUT_DIR) or "/tmp", "hang-watch")
        extra = hangs.prepare(base, self.env)
        self.beats = extra[contract.HEARTBEAT_DIR]
        return extra

    def arm(self, generation: int) -> None:
        hangs.clear_beats(self.beats)
        dest = hangs.dump_dir(self.env, generation)
        self.guard, self.next_check, self.generation = hangs.Guard(self.limits, self.beats, dest), 0.0, generation
        if self.peers is not None:
            self.peers.reset()

    def check(self, children: list[Any], now: float) -> bool:
        """True when the worker is hung: its stacks are saved, its report written and printed."""
        if self.guard is None or now < self.next_check:
            return False
        self.next_check = now + HANG_CHECK_SECONDS
        pids = {self.ranks[i]: c.pid for i, c in enumerate(children) if c.poll() is None}
        report = self.guard.hung(pids, now, self.peers)
        if report is None:
            return False
        report = dataclasses.replace(self.guard.save(report), generation=self.generation)
        named = [self.peers.name(i) for i in report.unanswered] if self.peers is not None else []
        for line in hangs.report_lines(report, hangs.verdict(report.ranks, self.ranks, unanswered=named)):
            _say(line)
        termination_message(report.encode())
        if not report.unanswered and not any(r.state == hangs.STOPPED for r in report.ranks):
            time.sleep(HANG_SETTLE_SECONDS)
        return True


def termination_message(text: str) -> None:
    """What the kubelet reports of this container's end; never created outside a pod (the kubelet makes it)."""
    if os.path.exists(contract.TERMINATION_LOG):
        try:
            with open(contract.TERMINATION_LOG, "w") as f:
                f.write(text)
        except OSError:
            pass  # the lines printed are the report


def launch(command: Sequence[str], env: Mapping[str, str] | None = None, standby: bool = False) -> int:
    """Run one child per local rank until all succeed, one fails, or a stop signal has been served; in a
    pod that restarts in place (GENERATION_FILE set), run them again for every newer generation.
    `standby`: the command understands contract.STANDBY (kubetrain's trainer)."""
    env = os.environ if env is None else env
    envs = child_envs(env)
    watch = HangWatch.from_env(env, envs)
    if watch is not None:
        extra = watch.child_env()
        envs = [{**e, **extra} for e in envs]
    children: list[Any] = []  # the current generation's, replaced in place so that `forward` sees them
    stop: list[int] = []  # the stop signal received, if any

    def forward(signum: int, _frame: FrameType | None) -> None:
        stop.append(signum)
        for c in children:
            if c.poll() is None:
                c.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    path = env.get(contract.GENERATION_FILE)
    if not path:
        if watch is not None:
            watch.arm(contract.env_int(env, contract.RESTART_GENERATION, default=0))
        return _start(command, envs, children, stop) or _supervise(children, stop, watch=watch).code or 0
    first = max(contract.env_int(env, contract.RESTART_GENERATION, default=0), read_generation(path) or 0)
    wait_s = float(env.get(contract.IN_PLACE_WAIT) or 0) or DEFAULT_IN_PLACE_WAIT_SECONDS
    where = InPlace(path, first, wait_s, env.get(contract.RAN_FILE) or None, standby, watch=watch,
                    probe=GangProbe(contract.env_int(env, contract.GANG_PROBE_PORT, default=0)))
    try:
        return _in_place(command, envs, where, children, stop)
    finally:
        where.probe.close()


def _start(command: Sequence[str], envs: list[dict[str, str]], children: list[Any], stop: list[int]) -> int | None:
    """Start one child per environment into `children`; an exit code when the worker ends here instead
    (stopped before any started, or the command cannot be started)."""
    children[:] = []
    for child_env in envs:
        if stop:
            break
        signals = len(stop)
        children.append(child := start(command, child_env))
        if len(stop) > signals and not isinstance(child, NotStarted) and child.poll() is None:
            # A stop signal came while this child was being started: `forward` may have run before it was
            # listed (a loaded machine runs the child first), so it is sent here too (a second copy is harmless
            # to a child that has not set its handler yet, and it ends a stopping one all the same).
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(stop[-1])
        if isinstance(child, NotStarted):
            break  # every rank runs the same command: one message is enough
    return 128 + stop[0] if not children else None


@dataclass
class InPlace:
    """Where a pod that restarts in place reads its generation, the one running, and how long to wait."""

    path: str
    generation: int
    wait_s: float
    ran_file: str | None = None
    """Where the generations started in this pod are noted (None: nowhere, every start is a first)."""
    standby: bool = False
    """The command can be started ahead of its generation (contract.STANDBY)."""
    ready: list[Any] = field(default_factory=list)
    """Standby ranks started for the next generation, one per local rank (empty: none)."""
    watch: HangWatch | None = None
    probe: GangProbe = field(default_factory=lambda: GangProbe(0))

    def newer(self) -> int | None:
        g = read_generation(self.path)
        return g if g is not None and g > self.generation else None

    def ran_before(self) -> bool:
        """Whether this generation (or a later one) already started in this pod: this container is the
        kubelet's restart of one whose processes failed, and `generation` becomes the one that ran."""
        ran = read_generation(self.ran_file) if self.ran_file else None
        if ran is None or ran < self.generation:
            return False
        self.generation = ran
        return True

    def note_started(self) -> None:
        if not self.ran_file:
            return
        try:  # whole or not at all: a restarted launcher must never read half a number
            with open(self.ran_file + ".tmp", "w") as f:
                f.write(f"{self.generation}\n")
            os.replace(self.ran_file + ".tmp", self.ran_file)
        except OSError as exc:  # the worker still runs; only a restart of this container would re-run it
            _say(f"cannot note generation {self.generation} in {self.ran_file}: {exc}")


class GangProbe:
    """The container's readiness (contract.GANG_PROBE_PORT; port 0: none): a listening socket whose connections
    are accepted and closed at once, open unless this worker waits for the next generation after its processes
    lost their peers."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.sock: socket.socket | None = None

    def open(self) -> None:
        if self.port <= 0 or self.sock is not None:
            return
        try:
            sock = _listener(self.port)
        except OSError as exc:  # the worker trains on; only a lost peer goes unsaid
            _say(f"cannot listen on port {self.port} for the readiness probe: {exc}")
            return
        self.sock = sock
        threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            with contextlib.suppress(OSError):  # stop listening now: the serving thread's accept() holds it
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _serve(self, sock: socket.socket) -> None:
        while self.sock is sock:
            try:
                conn, _ = sock.accept()
            except socket.timeout:  # noqa: UP041 - TimeoutError only from Python 3.10; this file runs on 3.8+
                continue
            except OSError:
                return
            conn.close()


def _listener(port: int) -> socket.socket:
    """A socket listening on `port` of every address: IPv6 and IPv4 where the pod has IPv6, else IPv4."""
    for family in (socket.AF_INET6, socket.AF_INET):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(("", port))
            sock.listen(16)
            sock.settimeout(PROBE_ACCEPT_SECONDS)
            return sock
        except OSError:
            sock.close()
            if family == socket.AF_INET:
                raise
    raise OSError(f"no socket for port {port}")


def read_generation(path: str) -> int | None:
    """The number in the generation file (the Downward API rewrites it whole); None if unreadable."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _in_place(command: Sequence[str], envs: list[dict[str, str]], where: InPlace, children: list[Any],
              stop: list[int]) -> int:
    """Run generation after generation in this pod; a worker fails (its container exits) only on its own
    failure, a stop signal, or when no new generation comes within where.wait_s of losing its peers."""
    where.probe.open()
    if where.ran_before():
        code = _await_next(command, envs, where, stop, f"generation {where.generation} failed in this pod "
                                                       "before this container restarted")
        if code is not None:
            return code
    while True:
        if _await_rendezvous(envs[0], where, stop):
            _drop(where)
            return 128 + stop[0]
        where.note_started()
        if where.watch is not None:
            where.watch.arm(where.generation)
        gen_envs = [_rank_env(e, _generation_env(e, where.generation)) for e in envs]
        code = None if _go(where, children) else _start(command, gen_envs, children, stop)
        outcome = _supervise(children, stop, where, where.watch) if code is None else Outcome(code)
        if outcome.code is not None:
            return outcome.code
        if outcome.newer is None:
            code = _await_next(command, envs, where, stop, f"generation {where.generation} ended elsewhere (a "
                                                           "lost peer, or the gang stopping)")
            if code is not None:
                return code
        else:
            _say(f"starting generation {outcome.newer} in place (was {where.generation})")
            where.generation = outcome.newer


def _await_rendezvous(env: Mapping[str, str], where: InPlace, stop: list[int]) -> bool:
    """Before a generation starts here, wait until the name of the gang's rendezvous on another worker resolves
    (rendezvous.await_master): a kept worker gets its generation while worker 0's pod is being recreated, and a
    command's torch would back off for up to a minute on the missing name. kubetrain's trainer also waits for
    the port itself, just before it joins. A newer generation meanwhile becomes where.generation. True when a
    stop signal came instead."""
    rendezvous.await_master(env, connect=False, give_up=lambda: bool(stop) or where.newer() is not None,
                            generation=where.generation)
    if (newer := where.newer()) is not None:
        where.generation = newer
    return bool(stop)


def _generation_env(env: Mapping[str, str], generation: int) -> dict[str, str]:
    """What a rank started for `generation` gets on top of the worker's environment: the generation, and worker 0's
    address where the operator has told it (rendezvous.master_address) in place of its name."""
    extra = {contract.RESTART_GENERATION: str(generation)}
    address = rendezvous.master_address(env, generation)
    for name in (contract.MASTER_ADDR, contract.PET_MASTER_ADDR):
        if env.get(name) and address:
            extra[name] = address
    return extra


def _rank_env(env: dict[str, str], extra: dict[str, str]) -> dict[str, str]:
    """A rank's environment in a pod that restarts in place: without the launcher's own variables (a
    trainer with one process would take itself for the launcher), with `extra`."""
    return {**{k: v for k, v in env.items() if k not in IN_PLACE_ONLY}, **extra}


def _await_next(command: Sequence[str], envs: list[dict[str, str]], where: InPlace, stop: list[int],
                why: str) -> int | None:
    """Wait for the next generation and make it where.generation (with its ranks on standby where the
    command allows); the exit code when none comes (or a stop signal does) instead."""
    _say(f"{why}; waiting up to {where.wait_s:g}s for the next generation")
    where.probe.close()
    if where.standby:
        where.ready = [start(command, _rank_env(e, {contract.STANDBY: "1"}), stdin=subprocess.PIPE) for e in envs]
    newer = _wait_for_generation(where, stop)
    if stop or newer is None:
        _drop(where)
    if stop:
        return 128 + stop[0]
    if newer is None:
        _say(f"no new generation within {where.wait_s:g}s; exiting {contract.IN_PLACE_GAVE_UP_EXIT_CODE}")
        return contract.IN_PLACE_GAVE_UP_EXIT_CODE
    _say(f"starting generation {newer} in place (was {where.generation})")
    where.generation = newer
    where.probe.open()
    return None


def _go(where: InPlace, children: list[Any]) -> bool:
    """Hand the standby ranks their generation: they become `children`. False when there are none, or one
    of them is gone (then the others are dropped and the ranks start afresh)."""
    ready, where.ready = where.ready, []
    if not ready:
        return False
    try:
        if any(c.poll() is not None for c in ready):
            raise OSError("a standby rank exited")
        for c in ready:
            c.stdin.write(f"{where.generation}\n".encode())
            c.stdin.close()
    except OSError as exc:
        _say(f"starting generation {where.generation} afresh: {exc}")
        where.ready = ready
        _drop(where)
        return False
    children[:] = ready
    return True


def _drop(where: InPlace) -> None:
    """Kill the standby ranks: they hold nothing yet."""
    for c in _signal_and_reap(where.ready, signal.SIGKILL, KILL_WAIT_SECONDS):
        _say(f"standby process {c.pid} did not exit within {KILL_WAIT_SECONDS:g}s of SIGKILL")
    where.ready = []


def _wait_for_generation(where: InPlace, stop: list[int]) -> int | None:
    deadline = time.monotonic() + where.wait_s
    while not stop and time.monotonic() < deadline:
        if (g := where.newer()) is not None:
            return g
        time.sleep(POLL_SECONDS)
    return None


def _say(message: str) -> None:
    print(f"kubetrain launcher: {message}", file=sys.stderr, flush=True)


@dataclass
class Outcome:
    """How one generation's children ended: `code` ends the worker; else `newer` is the generation to run
    next, or, both None, the children lost their peers and the launcher waits for the next generation."""

    code: int | None = None
    newer: int | None = None


def _supervise(children: list[Any], stop: list[int], in_place: InPlace | None = None,
               watch: HangWatch | None = None) -> Outcome:
    failed: dict[int, int] = {}  # child index -> exit code, in the order the children were seen to fail
    first_failure_at = 0.0
    while True:
        for i, c in enumerate(children):
            code = c.poll()
            if code and i not in failed:
                failed[i] = contract.exit_code(code)
                first_failure_at = first_failure_at or time.monotonic()
        codes = list(failed.values())
        if in_place is not None and not stop and (newer := in_place.newer()) is not None:
            # The gang is restarting: what these processes hold is in the latest complete checkpoint.
            return Outcome(newer=newer) if _kill(children) else Outcome(contract.IN_PLACE_GAVE_UP_EXIT_CODE)
        if not any(c.poll() is None for c in children):
            return _ended(contract.root_cause(codes) or 0, stop, in_place)
        if watch is not None and not codes and watch.check(children, time.monotonic()):
            return _hung(children, stop, in_place)
        # Stopping: every child got the signal and is writing its checkpoint; wait for all of them
        # (the pod's grace period bounds it). Otherwise a failure ends the worker, except that a rank
        # which lost its peer (or that NCCL's watchdog aborted) usually dies a moment before the rank that
        # caused it: while that is all there is, give a sibling PEER_LOST_GRACE_SECONDS to show the real cause.
        if codes and not stop:
            waiting = (
                all(contract.blame_order(f) > 0 for f in codes)
                and time.monotonic() - first_failure_at < PEER_LOST_GRACE_SECONDS
            )
            if not waiting:
                _terminate(children)
                return _ended(contract.root_cause(codes) or 1, stop, in_place)
        time.sleep(POLL_SECONDS)


def _hung(children: list[Any], stop: list[int], in_place: InPlace | None) -> Outcome:
    """This worker's ranks stopped advancing: what they hold is in the latest complete checkpoint. Stopping,
    the worker ends now rather than at the end of the pod's grace period. When another worker's report has
    already restarted the gang (a newer generation came while the stacks were saved), this worker runs it
    instead of failing: its exit would count as a failure of the new generation."""
    alive = _kill(children)
    if stop:
        return Outcome(128 + stop[0])
    newer = in_place.newer() if in_place is not None else None
    if newer is None or not alive:
        return Outcome(contract.HUNG_EXIT_CODE)
    termination_message("")  # the report is the old generation's; an exit later says its own
    _say(f"generation {newer} began while this worker reported its hang")
    return Outcome(newer=newer)


GANG_ENDED = (contract.PEER_LOST_EXIT_CODE, contract.SIGTERM_EXIT_CODE)
"""Exits that say the gang ended elsewhere: a lost peer, or the ranks stopping together (after their
checkpoint) because another worker's pod was told to stop while this launcher was not."""


def _ended(code: int, stop: list[int], in_place: InPlace | None) -> Outcome:
    """A worker that restarts in place outlives a gang that ended elsewhere: the next generation comes."""
    if in_place is not None and not stop and code in GANG_ENDED:
        return Outcome()
    return Outcome(code)


def _kill(children: list[Any]) -> bool:
    """SIGKILL every child and reap it; False when one is still there after KILL_WAIT_SECONDS (stuck in
    the kernel, a GPU driver call say): this pod cannot run another generation."""
    stuck = _signal_and_reap(children, signal.SIGKILL, KILL_WAIT_SECONDS)
    for c in stuck:
        _say(f"process {c.pid} did not exit within {KILL_WAIT_SECONDS:g}s of SIGKILL")
    return not stuck


def _terminate(children: list[Any]) -> None:
    for c in _signal_and_reap(children, signal.SIGTERM, TERMINATE_GRACE_SECONDS):
        c.kill()
        c.wait()


def _signal_and_reap(children: list[Any], sig: int, within: float) -> list[Any]:
    """Send `sig` to every child still running and wait for all; those still running after `within` s."""
    for c in children:
        if c.poll() is None:
            c.send_signal(sig)
    deadline = time.monotonic() + within
    stuck = []
    for c in children:
        try:
            c.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stuck.append(c)
    return stuck


def main(argv: Sequence[str]) -> int:
    """`launcher.py -- COMMAND [ARGS...]` with the worker's environment."""
    command = list(argv[1:] if argv[:1] == ["--"] else argv)
    if not command:
        print("usage: python3 launcher.py -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    try:
        return launch(command)
    except ValueError as exc:  # a malformed contract variable
        print(f"kubetrain launcher: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
