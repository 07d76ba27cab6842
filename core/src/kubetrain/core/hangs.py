"""Hangs: every rank is seen to advance; one that stops is named, with the stacks of every process.

Each rank writes a heartbeat (its step and phase) to `<KUBETRAIN_HEARTBEAT_DIR>/rank-<RANK>.beat` with
write_beat() -- kubetrain's trainer at every step, a custom script through the same call (or by writing
the same JSON itself). Whoever supervises the ranks -- a pod's launcher, or the local backend -- keeps a
Watch over them: a rank silent for longer than its limit (Limits.limit: adaptive, from the intervals
seen between its steps, with a phase's own allowance for start-up, checkpoints and evaluation) makes the
worker hung. The supervisor then captures (capture()): every Python process it starts registers a
faulthandler dump on SIGUSR1 into `<heartbeat dir>/<pid>.stack` (SITECUSTOMIZE, which the supervisor puts
first on the ranks' PYTHONPATH: kubetrain's trainer and a custom command alike), and a stopped or
kernel-bound process is read from /proc.
verdict() compares the ranks and names the odd one out.

A rank waits for its peers in every collective, so a peer whose whole worker stopped (its node frozen, cut off or
gone) leaves the ranks here running and silent. While they are quiet, the supervisor asks the launchers of the
workers it watches (contract.PEER_HOSTS) whether they answer (PeerWatch): one that does not is named at once,
without waiting out the ranks' limit.

A rank that never wrote a heartbeat is never judged: a command that does not report is not taken for hung.

Shipped in a job's ConfigMap beside launcher.py and contract.py: standard library only, Python 3.8+.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if __package__:
    from kubetrain.core import contract
else:  # run as a file from the job's ConfigMap
    import contract

if TYPE_CHECKING:
    from collections.abc import Collection, Mapping, Sequence

START, TRAIN, CHECKPOINT, EVAL = "start", "train", "checkpoint", "eval"
PHASES = (START, TRAIN, CHECKPOINT, EVAL)
"""start: before the first step (imports, rendezvous, model build, compilation, the first step itself)."""
RECENT_INTERVALS = 20
"""The train limit follows the longest of the last this-many intervals between a rank's steps."""
PHASE_GROWTH = 3.0
"""A checkpoint or an evaluation may take this many times the longest one seen before, at least phaseSeconds."""
STACK_WAIT_SECONDS = 3.0
WHERE_LIMIT = 120
MAX_REPORTED_RANKS = 24
"""A worker's report is its container's termination message (at most 4096 bytes): this many ranks fit."""
_BEAT_MIN_INTERVAL = 0.2
DUMP_REQUEST = "dump-request"
"""In the heartbeat directory: the supervisor's request that every rank dump its flight recorder to the
directory the file names (kubetrain's trainer watches for it, kubetrain.trainer.observe.flight_recorder)."""
TRACE_PREFIX = "fr_trace_rank_"
"""A rank's flight recorder trace: `<dest>/fr_trace_rank_<RANK>`, the name torchfrtrace reads."""
TRACE_READY = ".fr"
"""`rank-<RANK>.fr` in the heartbeat directory: that rank answers DUMP_REQUEST (the supervisor waits for it)."""
TRACE_WAIT_SECONDS = 10.0
STOPPED_SECONDS = 5.0
"""A rank whose process the kernel shows stopped (SIGSTOP, state T) and that has been silent this long is hung,
whatever its phase and limit: a stopped process cannot advance, and no slow step, save or evaluation looks like
one, so a gang with a stopped rank need not wait out minSeconds."""


@dataclass(frozen=True)
class Limits:
    """How long a rank may be silent; contract.HANG carries it to every worker as `key=value,...`."""

    min_seconds: float = 30.0
    factor: float = 10.0
    phase_seconds: float = 300.0
    start_seconds: float = 900.0
    explicit: float | None = None
    """restartPolicy.progressDeadlineSeconds: the train limit, instead of the adaptive one."""

    def encode(self) -> str:
        items = {"min": self.min_seconds, "factor": self.factor, "phase": self.phase_seconds,
                 "start": self.start_seconds}
        if self.explicit is not None:
            items["limit"] = self.explicit
        return ",".join(f"{k}={v:g}" for k, v in items.items())

    @classmethod
    def decode(cls, text: str | None) -> Limits | None:
        """None: hang detection is off (unset or `off`)."""
        if not text or text == "off":
            return None
        names = {"min": "min_seconds", "factor": "factor", "phase": "phase_seconds", "start": "start_seconds",
                 "limit": "explicit"}
        values = {}
        for item in text.split(","):
            key, _, value = item.partition("=")
            if key not in names:
                raise ValueError(f"{contract.HANG}={text!r}: unknown key {key!r}")
            values[names[key]] = float(value)
        return cls(**values)

    def collective_timeout(self) -> float:
        """The timeout torch's collectives get: past every limit, so that a hang is answered here first,
        with stacks, rather than by a library timeout with no diagnosis."""
        return max(self.start_seconds, self.phase_seconds, self.explicit or 0.0, self.min_seconds) + 120.0


# ---------------------------------------------------------------- ranks' side


_last_beat: dict[str, float | str] = {"time": 0.0, "phase": ""}


def write_beat(step: int, phase: str = TRAIN, env: Mapping[str, str] | None = None, force: bool = False) -> None:
    """This rank's heartbeat. Cheap enough for every step: a phase change is written at once, the same
    phase at most every 0.2 s. A no-op without contract.HEARTBEAT_DIR (nothing supervises)."""
    env = os.environ if env is None else env
    where, rank = env.get(contract.HEARTBEAT_DIR), env.get(contract.RANK, "0")
    now = time.time()
    last = float(_last_beat["time"])
    if not where or (not force and phase == _last_beat["phase"] and now - last < _BEAT_MIN_INTERVAL):
        return
    _last_beat.update(time=now, phase=phase)
    path = os.path.join(where, f"rank-{rank}.beat")
    try:
        with open(path + ".tmp", "w") as f:
            f.write(json.dumps({"step": int(step), "phase": phase, "time": now}))
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # a heartbeat must never fail a step; a rank that cannot write is not judged


def read_beat(path: str) -> tuple[int, str] | None:
    try:
        with open(path) as f:
            data = json.load(f)
        return int(data["step"]), str(data.get("phase") or TRAIN)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_beats(where: str, ranks: Sequence[int]) -> dict[int, tuple[int, str]]:
    found = {}
    for r in ranks:
        beat = read_beat(os.path.join(where, f"rank-{r}.beat"))
        if beat is not None:
            found[r] = beat
    return found


# ---------------------------------------------------------------- the supervisor's watch


@dataclass
class RankWatch:
    step: int
    phase: str
    since: float
    """When the step or phase last changed (the watcher's clock)."""
    intervals: list[float] = field(default_factory=list)
    longest: dict[str, float] = field(default_factory=dict)
    """The longest checkpoint and evaluation seen."""


class Watch:
    """The supervisor's view of its ranks' heartbeats. `now` is passed in (time.monotonic())."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.ranks: dict[int, RankWatch] = {}

    def observe(self, beats: Mapping[int, tuple[int, str]], now: float) -> None:
        for rank, (step, phase) in beats.items():
            w = self.ranks.get(rank)
            if w is None:
                self.ranks[rank] = RankWatch(step, phase, now)
            elif (step, phase) != (w.step, w.phase):
                took = now - w.since
                if w.phase == TRAIN and phase == TRAIN and step > w.step:
                    w.intervals = [*w.intervals, took / (step - w.step)][-RECENT_INTERVALS:]
                elif w.phase in (CHECKPOINT, EVAL):
                    w.longest[w.phase] = max(took, w.longest.get(w.phase, 0.0))
                w.step, w.phase, w.since = step, phase, now

    def limit(self, rank: int) -> float:
        """How long this rank may be silent in its current phase."""
        w, lim = self.ranks[rank], self.limits
        if w.phase == START:
            return lim.start_seconds
        if w.phase in (CHECKPOINT, EVAL):
            return max(lim.phase_seconds, PHASE_GROWTH * w.longest.get(w.phase, 0.0))
        if lim.explicit is not None:
            return lim.explicit
        if not w.intervals:  # the first train interval also holds compilation and warm-up
            return max(lim.start_seconds, lim.min_seconds)
        return max(lim.min_seconds, lim.factor * max(w.intervals))

    def quiet(self, now: float, seconds: float) -> list[int]:
        """The ranks silent for longer than `seconds`."""
        return [r for r, w in sorted(self.ranks.items()) if now - w.since > seconds]

    def silent(self, now: float, stopped: Collection[int] = ()) -> list[tuple[int, float, float]]:
        """(rank, seconds silent, its limit) for every rank past its limit; a rank in `stopped` (its process
        stopped, as the supervisor read it) has at most STOPPED_SECONDS."""
        found = []
        for r, w in sorted(self.ranks.items()):
            limit = min(self.limit(r), STOPPED_SECONDS) if r in stopped else self.limit(r)
            if now - w.since > limit:
                found.append((r, now - w.since, limit))
        return found


# ---------------------------------------------------------------- capture


@dataclass(frozen=True)
class RankReport:
    """One rank at the moment its worker was found hung."""

    rank: int
    step: int | None
    state: str
    """running, stopped (SIGSTOP), in the kernel (uninterruptible), exited, zombie."""
    where: str
    """The innermost frame worth naming, or what /proc says."""


@dataclass(frozen=True)
class HangReport:
    """What a hung worker tells its backend (a pod: its termination message)."""

    step: int | None
    silent_seconds: float
    limit_seconds: float
    ranks: tuple[RankReport, ...]
    dumps: str = ""
    at: float = 0.0
    """When the worker was found hung (seconds since the epoch)."""
    generation: int | None = None
    """The restart generation the hung ranks ran: a report that arrives after the gang moved on is an old
    generation's, not a failure of the new one."""
    unanswered: tuple[int, ...] = ()
    """The workers whose launchers did not answer this one's (PeerWatch): the cause, found before any limit."""

    def encode(self) -> str:
        ranks = [[r.rank, r.step, r.state, r.where[:WHERE_LIMIT]] for r in self.ranks[:MAX_REPORTED_RANKS]]
        return json.dumps({"hang": {"step": self.step, "silent": round(self.silent_seconds, 1),
                                    "limit": round(self.limit_seconds, 1), "ranks": ranks,
                                    "dumps": self.dumps[:300], "at": round(self.at, 1),
                                    "gen": self.generation, "peers": list(self.unanswered)}},
                          separators=(",", ":"))

    @classmethod
    def decode(cls, text: str | None) -> HangReport | None:
        try:
            h = json.loads(text or "")["hang"]
            ranks = tuple(RankReport(int(r[0]), None if r[1] is None else int(r[1]), str(r[2]), str(r[3]))
                          for r in h["ranks"])
            return cls(h.get("step"), float(h["silent"]), float(h["limit"]), ranks, str(h.get("dumps") or ""),
                       float(h.get("at") or 0.0), None if h.get("gen") is None else int(h["gen"]),
                       tuple(int(i) for i in h.get("peers") or ()))
        except (ValueError, KeyError, TypeError, IndexError):
            return None


STOPPED = "stopped (SIGSTOP)"
UNINTERRUPTIBLE = "in the kernel (uninterruptible)"
_STATES = {"T": STOPPED, "t": "stopped (traced)", "D": UNINTERRUPTIBLE, "Z": "exited (zombie)", "X": "exited"}
UNINTERRUPTIBLE_SECONDS = 1.0
"""A rank counts as in the kernel only when it stays in uninterruptible sleep this long: a running rank passes
through it for milliseconds at a time (a page fault, a write) and, on a machine busy with I/O, is often caught
there by a single look."""


def proc_state(pid: int) -> str:
    """running, or what /proc says the process is doing instead of running Python."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            letter = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "exited"
    return _STATES.get(letter, "running")


def settled_states(pids: Mapping[int, int], settle_s: float = UNINTERRUPTIBLE_SECONDS) -> dict[int, str]:
    """rank -> proc_state of its pid, where uninterruptible sleep counts only once it has lasted `settle_s`
    (looked at every 50 ms, all ranks at once)."""
    states, deadline = {rank: proc_state(pid) for rank, pid in pids.items()}, time.monotonic() + settle_s
    while UNINTERRUPTIBLE in states.values() and time.monotonic() < deadline:
        time.sleep(0.05)
        states.update({r: proc_state(pids[r]) for r, s in states.items() if s == UNINTERRUPTIBLE})
    return states


def catches_usr1(pid: int) -> bool:
    """Whether the process handles SIGUSR1 (else it would kill it): its SigCgt mask in /proc."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(line.split()[1] for line in f if line.startswith("SigCgt:"))
        return bool(int(mask, 16) & (1 << (signal.SIGUSR1 - 1)))
    except (OSError, StopIteration, ValueError):
        return False


def capture(pids: Mapping[int, int], where: str, wait_s: float = STACK_WAIT_SECONDS) -> dict[int, tuple[str, str]]:
    """rank -> (state, stack text) for each rank's process (`pids`: rank -> pid); asks every live one that
    registered a dump for its stacks and waits up to `wait_s` for them."""
    asked, states = {}, settled_states(pids)
    for rank, pid in pids.items():
        state = states[rank]
        stack = os.path.join(where, f"{pid}.stack")
        if state == "running" and os.path.exists(stack) and catches_usr1(pid):
            try:
                os.kill(pid, signal.SIGUSR1)
                asked[rank] = stack
            except OSError:
                pass
    deadline = time.monotonic() + wait_s
    while asked and time.monotonic() < deadline and not all(_dumped(p) for p in asked.values()):
        time.sleep(0.1)
    time.sleep(0.2)  # let the last frames land
    states = settled_states(pids)
    return {rank: (states[rank], _read(asked[rank]) if rank in asked else "") for rank in pids}


def _dumped(path: str) -> bool:
    try:
        return os.path.getsize(path) > 0
    except OSError:
        return False


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


# ---------------------------------------------------------------- reading stacks and the verdict


_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier", "monitored_barrier",
               "all_to_all", "send", "recv", "wait", "gather", "scatter", "reduce", "all_gather_object",
               "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast_object_list")


def main_thread_frames(text: str) -> list[tuple[str, int, str]]:
    """(file, line, function), innermost first, of the thread that runs the program (it has a module's
    frame), else of the last thread in the dump (faulthandler lists the current thread last)."""
    threads: list[list[tuple[str, int, str]]] = []
    for line in text.splitlines():
        if "(most recent call first)" in line:
            threads.append([])
        elif threads and (m := _FRAME.match(line)):
            threads[-1].append((m["file"], int(m["line"]), m["func"]))
    threads = [t for t in threads if t]
    return next((t for t in threads if any(f[2] == "<module>" for f in t)), threads[-1] if threads else [])


def where_from_stack(text: str) -> str:
    """`in all_reduce (torch.distributed)`, `in the data loader`, `in backward (autograd: gradient
    all-reduce)`, else the innermost frame: `in step (train.py:42)`."""
    frames = main_thread_frames(text)
    if not frames:
        return "no Python stack"
    for file, _line, func in frames:
        path = file.replace("\\", "/")
        if path.endswith("torch/distributed/distributed_c10d.py") or ("torch/distributed/" in path and func in COLLECTIVES):
            return f"in {func} (torch.distributed)"
        if "torch/utils/data/" in path:
            return "in the data loader"
        if "torch/autograd/" in path:
            return "in backward (autograd, with DDP's gradient all-reduce)"
    file, line, func = frames[0]
    return f"in {func} ({os.path.basename(file)}:{line})"


def rank_report(rank: int, step: int | None, state: str, stack: str) -> RankReport:
    where = where_from_stack(stack) if state == "running" else state
    if state == "running" and not stack:
        where = "no stack (the process registered no dump)"
    return RankReport(rank, step, state, where)


def _span(ranks: Sequence[int]) -> str:
    """`0, 2-5, 7`."""
    out: list[str] = []
    for r in sorted(ranks):
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)


def suspects(reports: Sequence[RankReport]) -> list[int]:
    """The odd ones out: ranks not running Python (stopped, in the kernel, gone); else ranks behind the
    others' step; else the smaller group of ranks by where they are, when the others agree."""
    odd = [r.rank for r in reports if r.state != "running"]
    if odd:
        return odd
    steps = [r.step for r in reports if r.step is not None]
    if steps and min(steps) < max(steps):
        return [r.rank for r in reports if r.step is not None and r.step < max(steps)]
    groups: dict[str, list[int]] = {}
    for r in reports:
        groups.setdefault(r.where, []).append(r.rank)
    if len(groups) < 2:
        return []
    biggest = max(len(g) for g in groups.values())
    if sum(len(g) == biggest for g in groups.values()) > 1:
        return []  # no majority to be odd against
    return sorted(r for g in groups.values() if len(g) < biggest for r in g)


def verdict(reports: Sequence[RankReport], expected: Sequence[int], name_rank: Mapping[int, str] | None = None,
            unanswered: Sequence[str] = ()) -> str:
    """One sentence: the suspects and where they are, then where the others wait.
    `name_rank`: rank -> `worker-1 on node n1`, where the backend knows it; `unanswered`: the workers (named)
    whose launchers did not answer, the cause before any rank."""
    name_rank = name_rank or {}
    odd = suspects(reports)
    lead = ""
    if unanswered:
        verb = "does" if len(unanswered) == 1 else "do"
        lead = f"{', '.join(unanswered)} {verb} not answer (its node frozen, cut off or gone): "
    by_rank = {r.rank: r for r in reports}
    missing = [r for r in expected if r not in by_rank]
    parts = []
    for r in odd:
        rep, who = by_rank[r], name_rank.get(r)
        at = f" at step {rep.step}" if rep.step is not None else ""
        parts.append(f"rank {r}{f' on {who}' if who else ''} is {rep.where}{at}")
    rest: dict[str, list[int]] = {}
    for rep in reports:
        if rep.rank not in odd:
            rest.setdefault(rep.where, []).append(rep.rank)
    for where, ranks in rest.items():
        label = f"{'rank' if len(ranks) == 1 else 'ranks'} {_span(ranks)}"
        verb = "waits" if len(ranks) == 1 else "wait"
        parts.append(f"{label} {verb} {where}" if where.startswith("in ") else f"{label}: {where}")
    if missing:
        parts.append(f"no report from {'rank' if len(missing) == 1 else 'ranks'} {_span(missing)}")
    head = lead or ("" if odd else "no single rank stands out: ")
    return head + "; ".join(parts)


# ---------------------------------------------------------------- peers


PEER_ASK_SECONDS = 2.0
"""A rank quiet this long has its worker ask its peers whether they answer: asking costs one connection per peer,
and a live peer answers however long a step, a save or an evaluation takes."""
PEER_ANSWER_SECONDS = 1.5
"""How long a peer's launcher has to take a connection on its gang probe port. A live launcher accepts at once
(a thread of its own, whatever its ranks do); a stopped one leaves it unaccepted in its kernel's backlog, and a
node cut off or gone drops it."""
PEER_MISSES = 2
"""Unanswered asks in a row that make a peer silent: one dropped packet is not a frozen node."""
NOT_ANSWERING = "its worker does not answer"
"""Where a verdict says a rank is when a peer's launcher found its worker not answering."""


def peer_answers(host: str, port: int, timeout: float = PEER_ANSWER_SECONDS) -> bool | None:
    """Whether the launcher at host:port answers: True once it accepts (and closes) the connection, or when
    nothing listens there (refused: that launcher waits for the next generation, or is gone, which the backend
    learns by itself); False when the connection or its acceptance does not come within `timeout`, or the
    address is unreachable; None when the name does not resolve (a pod not there yet)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (OSError, IndexError):
        return None
    with socket.socket(family, kind, proto) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(addr)
            sock.recv(1)  # end of file once the peer's launcher accepts and closes
        except socket.timeout:  # noqa: UP041 - TimeoutError only from Python 3.10; this file runs on 3.8+
            return False
        except (ConnectionRefusedError, ConnectionResetError):
            return True
        except OSError:  # no route to the peer's address: its node is gone or cut off
            return False
    return True


def silent_peers(peers: Mapping[int, str], port: int, timeout: float = PEER_ANSWER_SECONDS) -> list[int]:
    """The workers of `peers` (index -> host) whose launchers do not answer, all asked at once; one whose name
    takes longer than the answer to resolve is not counted."""
    answers: dict[int, bool | None] = {}

    def ask(index: int, host: str) -> None:
        answers[index] = peer_answers(host, port, timeout)

    threads = [threading.Thread(target=ask, args=item, daemon=True) for item in sorted(peers.items())]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout + 1.0
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return sorted(i for i, answer in list(answers.items()) if answer is False)


class PeerWatch:
    """Whether the workers this one watches (contract.PEER_HOSTS) answer, asked while its ranks are quiet."""

    def __init__(self, peers: Mapping[int, str], port: int) -> None:
        self.peers = dict(peers)
        self.port = port
        self.misses: dict[int, int] = {}

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> PeerWatch | None:
        peers = contract.parse_peer_hosts(env.get(contract.PEER_HOSTS))
        port = contract.env_int(env, contract.GANG_PROBE_PORT, default=0)
        return cls(peers, port) if peers and port > 0 else None

    def silent(self) -> list[int]:
        """Ask every peer once: those unanswered PEER_MISSES times in a row."""
        found = set(silent_peers(self.peers, self.port))
        self.misses = {i: self.misses.get(i, 0) + 1 for i in found}
        return sorted(i for i, n in self.misses.items() if n >= PEER_MISSES)

    def reset(self) -> None:
        self.misses = {}

    def name(self, index: int) -> str:
        return f"worker {index} ({self.peers[index]})" if index in self.peers else f"worker {index}"


# ---------------------------------------------------------------- the supervisor's guard


def setting(limits: Limits | None) -> str:
    """contract.HANG's value."""
    return limits.encode() if limits is not None else "off"


SITECUSTOMIZE = '''"""kubetrain: Python stacks on SIGUSR1 for hang reports (kubetrain.core.hangs); nothing else."""
import os, signal
_where = os.environ.get("{env}")
if _where and hasattr(signal, "SIGUSR1") and signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:
    try:
        import faulthandler
        _kubetrain_stacks = open(os.path.join(_where, "%d{suffix}" % os.getpid()), "w")
        faulthandler.register(signal.SIGUSR1, file=_kubetrain_stacks, all_threads=True, chain=False)
    except (OSError, RuntimeError, ValueError):
        pass
'''.format(env=contract.HEARTBEAT_DIR, suffix=".stack")
"""Run by every Python process of a custom command (the launcher puts it first on PYTHONPATH)."""


class Guard:
    """One generation's watch over the processes whose heartbeats land in `where` (a supervisor's)."""

    def __init__(self, limits: Limits, where: str, dest: str) -> None:
        self.watch = Watch(limits)
        self.where = where
        self.dest = dest
        """Where the stacks (and the flight recorder's traces) are saved."""
        self.stacks: dict[int, str] = {}

    def hung(self, pids: Mapping[int, int], now: float, peers: PeerWatch | None = None) -> HangReport | None:
        """A report when a live rank (`pids`: rank -> pid) is silent past its limit, or quiet while a peer
        does not answer (`peers`), after capturing every rank's stacks; None while all advance."""
        self.watch.observe(read_beats(self.where, list(pids)), now)
        stopped = [r for r in self.watch.quiet(now, STOPPED_SECONDS) if r in pids and proc_state(pids[r]) == STOPPED]
        silent = [s for s in self.watch.silent(now, stopped) if s[0] in pids]
        quiet = [r for r in self.watch.quiet(now, PEER_ASK_SECONDS) if r in pids]
        unanswered = self._unanswered(peers, quiet) if not silent else ()
        if unanswered:
            silent = [(r, now - self.watch.ranks[r].since, PEER_ASK_SECONDS) for r in quiet]
        if not silent:
            return None
        _write(os.path.join(self.where, DUMP_REQUEST), self.dest)
        caught = capture(pids, self.where)
        if not unanswered:  # the cause is known: no flight recorder to wait for
            self._await_traces([r for r, (state, _text) in caught.items() if state == "running"])
        self.stacks = {r: text for r, (_state, text) in caught.items()}
        ranks = tuple(rank_report(r, self._step(r), state, text) for r, (state, text) in sorted(caught.items()))
        steps = [r.step for r in ranks if r.step is not None]
        _rank, silence, limit = silent[0]
        return HangReport(max(steps) if steps else None, silence, limit, ranks, at=time.time(), unanswered=unanswered)

    @staticmethod
    def _unanswered(peers: PeerWatch | None, quiet: Sequence[int]) -> tuple[int, ...]:
        """The peers that do not answer, asked only while a rank here is quiet."""
        if peers is None:
            return ()
        if not quiet:
            peers.reset()
            return ()
        return tuple(peers.silent())

    def _await_traces(self, ranks: Sequence[int]) -> None:
        """Give the live ranks that answer DUMP_REQUEST up to TRACE_WAIT_SECONDS to write their traces."""
        waiting = [r for r in ranks if os.path.exists(os.path.join(self.where, f"rank-{r}{TRACE_READY}"))]
        deadline = time.monotonic() + TRACE_WAIT_SECONDS
        while waiting and time.monotonic() < deadline:
            waiting = [r for r in waiting if not os.path.exists(os.path.join(self.dest, f"{TRACE_PREFIX}{r}"))]
            time.sleep(0.1)

    def _step(self, rank: int) -> int | None:
        w = self.watch.ranks.get(rank)
        return w.step if w is not None else None

    def save(self, report: HangReport) -> HangReport:
        """Every rank's stacks as `<dest>/rank-<R>.txt` (what the report says first); the report with dest."""
        dest = self.dest
        try:
            os.makedirs(dest, exist_ok=True)
            for r in report.ranks:
                stack = self.stacks.get(r.rank, "")
                main = "".join(f'  File "{file}", line {line} in {func}\n' for file, line, func in main_thread_frames(stack))
                with open(os.path.join(dest, f"rank-{r.rank}.txt"), "w") as f:
                    f.write(f"rank {r.rank}: {r.where} (step {r.step}, {r.state})\n\n"
                            f"main thread (most recent call first):\n{main or '  (none)'}\n\nall threads:\n{stack}")
        except OSError as exc:
            return dataclasses.replace(report, dumps=f"not saved: {exc}")
        return dataclasses.replace(report, dumps=dest)


def dump_dir(env: Mapping[str, str], generation: int) -> str:
    """Where a hung worker saves its ranks' stacks: HANG_DIR, else `<checkpoint dir>/hangs`, per generation."""
    base = env.get(contract.HANG_DIR) or os.path.join(env.get(contract.CHECKPOINT_DIR) or ".", "hangs")
    return os.path.join(base, f"gen-{generation}")


def report_lines(report: HangReport, verdict_text: str) -> list[str]:
    """What a supervisor prints: the verdict, the limit, where the stacks are, each rank in one line."""
    lines = [f"hang: {verdict_text}",
             f"hang: silent {report.silent_seconds:.0f}s past a limit of {report.limit_seconds:.0f}s at step "
             f"{report.step}; stacks in {report.dumps or 'no file'}"]
    lines += [f"hang:   rank {r.rank}: {r.where} (step {r.step})" for r in report.ranks]
    return lines


def prepare(base: str, env: Mapping[str, str]) -> dict[str, str]:
    """A fresh heartbeat directory under `base` and the sitecustomize that registers the stack dumps: the
    variables every rank gets for them."""
    beats, site = os.path.join(base, "beats"), os.path.join(base, "site")
    for d in (beats, site):
        os.makedirs(d, exist_ok=True)
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(SITECUSTOMIZE)
    path = env.get("PYTHONPATH")
    return {contract.HEARTBEAT_DIR: beats, "PYTHONPATH": site + (os.pathsep + path if path else "")}


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError:
        pass  # the stacks still come; only the flight recorder's traces would not


def clear_beats(where: str) -> None:
    """Forget the last generation's heartbeats and dump request (not the stack files: a standby rank
    registered its own)."""
    for name in os.listdir(where):
        if name.endswith((".beat", ".beat.tmp", TRACE_READY)) or name == DUMP_REQUEST:
            os.remove(os.path.join(where, name))
