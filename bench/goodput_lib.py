"""Pure parts of bench/goodput.py: the fault schedule, the trainer's TensorBoard step records, goodput from them,
and the table.

Nothing here talks to a cluster or reads a clock, so tests/unit/test_bench_goodput.py can cover it.

Where the step times come from: rank 0 of kubetrain's trainer writes one TensorBoard event per optimizer step into
`<checkpoint dir>/tensorboard/` (kubetrain.trainer.observe.tensorboard), flushed at once, one file per process it runs in;
on a claim those files outlive every pod. Each step's event carries its wall time and `train/tokens_per_second`,
the step's tokens over its own duration (the loop's timer, from the step's start to its loss known on every
rank: no checkpoint save or evaluation in it), so the duration is tokens per step / that rate. The file's first
record (its file version) is written when the process opens it, before its first step: an execution's start.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

KILL, DELETE, HANG, OOM, EVICT = "kill", "delete", "hang", "oom", "evict"
FREEZE_NODE, KILL_NODE = "freeze-node", "kill-node"
POD_FAULTS = (KILL, DELETE, HANG, OOM, EVICT)
NODE_FAULTS = (FREEZE_NODE, KILL_NODE)
"""Applied to the second real node (hack/chaos.sh), whichever worker runs there, and undone a while later."""
FAULT_KINDS = POD_FAULTS + NODE_FAULTS
MOVES_A_POD = (DELETE, EVICT)
"""Faults after which the worker's pod is created again, so the scheduler may place it on the other node."""
FAULT_TITLES = {
    KILL: "container killed (SIGKILL of its main process from the host)",
    DELETE: "pod deleted (grace 0)",
    HANG: "rank hung (SIGSTOP of one rank from the host)",
    OOM: "OOM kill (the container's memory cgroup limit lowered from the host)",
    EVICT: "preempted (Eviction API: SIGTERM, the pod's grace period)",
    FREEZE_NODE: "node frozen (its kubelet, containerd and pods' processes SIGSTOPped; thawed later)",
    KILL_NODE: "node killed (its kubelet, containerd and pods' processes SIGKILLed; restored later)",
}
TPS_TAG = "train/tokens_per_second"
KUBETRAIN, TRAINER_V2, UNDISTURBED = "kubetrain", "trainer-v2", "kubetrain-undisturbed"
SYSTEM_TITLES = {KUBETRAIN: "kubetrain", TRAINER_V2: "Trainer v2 (JobSet)", UNDISTURBED: "kubetrain, no faults"}


# --------------------------------------------------------------------------- the schedule


@dataclass(frozen=True)
class Fault:
    """One planned fault: what, when (seconds after the job's creation), on which worker (its index: kubetrain's
    worker-N, Trainer v2's completion index N), and at which step in the checkpoint period (step % everySteps, or
    the two steps after it), so that every system meets it at the same point between two checkpoints."""

    kind: str
    at_s: float
    worker: int
    phase: int


def schedule(seed: int, every: float, kinds: Sequence[str], workers: int, every_steps: int) -> list[Fault]:
    """One fault of each of ``kinds`` about every ``every`` seconds (k-th at k × every, ± 10 % seeded jitter), in a
    seeded order, each on a seeded worker and at a seeded phase between two checkpoints (away from a save: a
    hang inside one is judged by the checkpoint's own limit)."""
    unknown = set(kinds) - set(FAULT_KINDS)
    if unknown:
        raise ValueError(f"unknown fault kinds {sorted(unknown)}: pick from {', '.join(FAULT_KINDS)}")
    rng = random.Random(seed)
    order = list(dict.fromkeys(kinds))
    for _ in range(1000):  # seeded, so the same order every time
        rng.shuffle(order)
        if node_faults_apart(order):
            break
    lo, hi = (3, every_steps - 8) if every_steps >= 12 else (1, max(1, every_steps - 3))
    return [Fault(kind, round(every * (i + 1) + rng.uniform(-0.1, 0.1) * every, 1), rng.randrange(workers),
                  rng.randint(lo, hi)) for i, kind in enumerate(order)]


def node_faults_apart(order: Sequence[str]) -> bool:
    """Whether a fault that recreates a pod comes between any two node faults (where the kinds allow it): a node
    fault moves its worker to the other node, and only a recreated pod goes back to the node once it is healthy."""
    between: list[str] | None = None
    for kind in order:
        if kind in NODE_FAULTS:
            if between is not None and not set(between) & set(MOVES_A_POD):
                return not set(order) & set(MOVES_A_POD)
            between = []
        elif between is not None:
            between.append(kind)
    return True


def in_phase(step: int, fault: Fault, every_steps: int) -> bool:
    """Whether the step just finished is where ``fault`` is to be applied (its phase or the two steps after)."""
    return 0 <= (step % every_steps) - fault.phase <= 2


# --------------------------------------------------------------------------- TensorBoard event files


@dataclass(frozen=True)
class Event:
    wall: float
    step: int
    values: dict[str, float] = field(default_factory=dict)
    file_version: str | None = None


def records(buf: bytes) -> tuple[list[bytes], int]:
    """The complete TFRecords at the start of ``buf`` (length, its CRC, data, its CRC; CRCs not checked) and how
    many bytes they take: a file being written may end in part of one."""
    out, pos = [], 0
    while pos + 12 <= len(buf):
        (length,) = struct.unpack_from("<Q", buf, pos)
        end = pos + 12 + length + 4
        if end > len(buf):
            break
        out.append(buf[pos + 12:pos + 12 + length])
        pos = end
    return out, pos


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _fields(buf: bytes) -> Iterable[tuple[int, int, Any]]:
    """(field number, wire type, value) of one protobuf message: ints, 8- and 4-byte raw values, bytes."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        elif wire == 2:
            length, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + length], pos + length
        else:
            raise ValueError(f"protobuf wire type {wire} is not in a TensorBoard scalar event")
        yield number, wire, value


def parse_event(data: bytes) -> Event:
    """A `tensorflow.Event`: wall_time (1), step (2), file_version (3), summary (5) of simple values."""
    wall, step, version, values = 0.0, 0, None, {}
    for number, _, value in _fields(data):
        if number == 1:
            (wall,) = struct.unpack("<d", value)
        elif number == 2:
            step = value
        elif number == 3:
            version = value.decode()
        elif number == 5:
            for vnum, _, item in _fields(value):
                if vnum != 1:
                    continue
                tag, simple = "", None
                for inum, _, x in _fields(item):
                    if inum == 1:
                        tag = x.decode()
                    elif inum == 2:
                        (simple,) = struct.unpack("<f", x)
                if simple is not None:
                    values[tag] = simple
    return Event(wall, step, values, version)


# --------------------------------------------------------------------------- executions and goodput


@dataclass(frozen=True)
class Step:
    step: int
    wall: float
    """When rank 0 recorded it (its end)."""
    seconds: float
    execution: str


@dataclass
class Execution:
    """One process of rank 0 (one event file): when it opened its file, and the steps it recorded."""

    name: str
    started: float
    steps: list[Step] = field(default_factory=list)

    @property
    def first_step(self) -> int | None:
        return self.steps[0].step if self.steps else None


def executions(files: Mapping[str, Sequence[Event]], tokens_per_step: int) -> list[Execution]:
    """Each event file as an execution, in the order they started."""
    out = []
    for name, events in files.items():
        if not events:
            continue
        started = next((e.wall for e in events if e.file_version is not None), events[0].wall)
        ex = Execution(name, started)
        for e in events:
            tps = e.values.get(TPS_TAG)
            if e.file_version is None and tps:
                ex.steps.append(Step(e.step, e.wall, tokens_per_step / tps, name))
        out.append(ex)
    return sorted(out, key=lambda x: x.started)


@dataclass
class AppliedFault:
    """A fault as the campaign met it: when it was due and applied (epoch seconds), what was done, what the pod
    showed afterwards; ``skipped`` says why it was not applied."""

    kind: str
    worker: int
    planned_s: float
    due: float
    applied: float | None = None
    step: int | None = None
    pod: str = ""
    how: str = ""
    outcome: str = ""
    skipped: str = ""


@dataclass
class FaultResult:
    kind: str
    planned_s: float
    at_s: float | None
    """Applied this many seconds after the job's creation (None: skipped)."""
    step: int | None
    recovered_after_s: float | None
    """From the fault to the first step of the first rank-0 process after it whose steps were kept (None: no
    process started before the next fault)."""
    steps_redone: int | None
    """Steps the fault cost (trained again later): the execution it hit had trained them past the checkpoint the
    recovery resumed from, or a short-lived execution of the recovery trained them."""
    pod: str = ""
    how: str = ""
    outcome: str = ""
    skipped: str = ""
    executions: int | None = None
    """Processes of rank 0 that trained in the recovery (more than 1: some died before the last one trained on)."""
    settled_after_s: float | None = None
    """From the fault to the first step of the last rank-0 process started before the next fault."""


@dataclass
class Goodput:
    system: str
    wall_s: float
    kept_step_s: float
    goodput: float
    kept_interval_s: float
    """The kept steps' intervals instead: from the step before in the same execution (its own duration for an
    execution's first step), so with what runs between two steps (the step record, a checkpoint save)."""
    goodput_intervals: float
    steps: int
    """Distinct steps kept (maxSteps when the job finished)."""
    step_executions: int
    steps_redone: int
    executions: int
    """Processes of rank 0 that trained (event files with steps): restarts + 1 where every restart trained."""
    restarts: int | None
    mean_step_s: float
    """Kept step time over the steps kept: the step itself."""
    mean_interval_s: float
    """Between consecutive steps of one execution (its first 3 steps left out): the step and what follows it (a
    checkpoint save every everySteps, the step record). What sizes maxSteps for --minutes."""
    faults: list[FaultResult]
    missing_steps: int = 0
    """Steps in 1..maxSteps no execution recorded: 0 unless the records are incomplete."""
    cross_check: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)
    """What the figures come from (see raw() and from_raw()): recomputed by `bench/goodput.py --report FILE`."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def raw(execs: Sequence[Execution], created: float, finished: float, faults: Sequence[AppliedFault]) -> dict[str, Any]:
    """The records behind a result, for the JSON: each execution's start, and per step its number, wall time (s
    after `created`, ms) and duration (s, 0.1 ms), each as one space-separated string (a 10-minute run has
    thousands of steps)."""
    return {"created": created, "finished": finished, "faults": [asdict(f) for f in faults],
            "executions": [{"name": e.name, "started": e.started,
                            "steps": " ".join(str(s.step) for s in e.steps),
                            "walls": " ".join(f"{s.wall - created:.3f}" for s in e.steps),
                            "seconds": " ".join(f"{s.seconds:.4f}" for s in e.steps)} for e in execs]}


def from_raw(system: str, data: dict[str, Any], max_steps: int, restarts: int | None) -> Goodput:
    """goodput() again from raw()'s record."""
    created = data["created"]
    execs = [Execution(e["name"], e["started"], [
        Step(int(n), created + float(w), float(sec), e["name"])
        for n, w, sec in zip(e["steps"].split(), e["walls"].split(), e["seconds"].split(), strict=True)])
        for e in data["executions"]]
    faults = [AppliedFault(**f) for f in data["faults"]]
    return goodput(system, execs, data["created"], data["finished"], max_steps, faults, restarts)


def mean_interval(execs: Sequence[Execution]) -> float:
    """Mean time between consecutive steps of one execution, each execution's first 3 steps left out."""
    gaps = [b.wall - a.wall for e in execs for a, b in zip(e.steps[3:], e.steps[4:], strict=False)]
    return round(sum(gaps) / len(gaps), 4) if gaps else 0.0


def step_intervals(execs: Sequence[Execution]) -> dict[Step, float]:
    """Each step's interval: since the step before it in its execution, or its own duration for the first."""
    out = {}
    for e in execs:
        for before, s in zip([None, *e.steps], e.steps, strict=False):
            out[s] = s.wall - before.wall if before is not None and before.step == s.step - 1 else s.seconds
    return out


def kept_lineage(execs: Sequence[Execution]) -> dict[int, Step]:
    """Per step number, its last execution: the steps the final model went through."""
    kept: dict[int, Step] = {}
    for s in sorted((s for e in execs for s in e.steps), key=lambda s: s.wall):
        kept[s.step] = s
    return kept


def fault_result(fault: AppliedFault, execs: Sequence[Execution], next_applied: float | None, created: float,
                 kept: set[Step]) -> FaultResult:
    """Recovery from one applied fault, from the processes of rank 0 that started after it (and before the next
    fault). Training was back at the first step of the first of them whose steps were kept; it settled at the first
    step of the last of them (it trained on until the next fault, or to the end): later than the first when a
    process of the recovery died too (Trainer v2: the kubelet restarts a failed container in its pod, which trains
    until JobSet recreates the gang). The steps the fault cost: those of the process it hit and those of the
    recovery's short-lived processes that were trained again later."""
    out = FaultResult(fault.kind, fault.planned_s, None if fault.applied is None else round(fault.applied - created, 1),
                      fault.step, None, None, fault.pod, fault.how, fault.outcome, fault.skipped)
    if fault.applied is None:
        return out
    window = [e for e in execs if e.steps and e.started >= fault.applied
              and (next_applied is None or e.started < next_applied)]
    hit = [e for e in execs if e.steps and e.started < fault.applied]
    if not window:
        return out
    back = next((e for e in window if any(s in kept for s in e.steps)), window[-1])
    out.recovered_after_s = round(back.steps[0].wall - fault.applied, 2)
    out.settled_after_s = round(window[-1].steps[0].wall - fault.applied, 2)
    out.executions = len(window)
    wasted = [s for e in [*hit[-1:], *window[:-1]] for s in e.steps if s not in kept]
    out.steps_redone = len(wasted)
    return out


def goodput(system: str, execs: Sequence[Execution], created: float, finished: float, max_steps: int,
            faults: Sequence[AppliedFault], restarts: int | None) -> Goodput:
    """Kept step time (the durations of the final lineage's steps) over the wall time from the job's creation
    to its success."""
    kept = kept_lineage(execs)
    ran = sum(len(e.steps) for e in execs)
    kept_s = sum(s.seconds for s in kept.values())
    kept_i = sum(step_intervals(execs)[s] for s in kept.values())
    wall = finished - created
    applied = sorted(f.applied for f in faults if f.applied is not None)
    results = []
    for f in faults:
        later = [t for t in applied if f.applied is not None and t > f.applied]
        results.append(fault_result(f, execs, later[0] if later else None, created, set(kept.values())))
    return Goodput(system, round(wall, 1), round(kept_s, 1), round(kept_s / wall, 4) if wall > 0 else 0.0,
                   round(kept_i, 1), round(kept_i / wall, 4) if wall > 0 else 0.0,
                   len(kept), ran, ran - len(kept), sum(1 for e in execs if e.steps), restarts,
                   round(kept_s / len(kept), 4) if kept else 0.0, mean_interval(execs), results,
                   missing_steps=len(set(range(1, max_steps + 1)) - set(kept)))


# --------------------------------------------------------------------------- the table


def _f(value: float | int | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def table(results: Sequence[Goodput]) -> str:
    """One block per system: its totals on the first row, one row per fault."""
    lines = ["| system | wall (s) | kept step (s) | goodput | goodput, step intervals | restarts | steps redone "
             "| fault | at (s) | step | recovered after (s) | settled after (s) | redone |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in results:
        head = [SYSTEM_TITLES.get(r.system, r.system), _f(r.wall_s), _f(r.kept_step_s), f"{r.goodput * 100:.1f} %",
                f"{r.goodput_intervals * 100:.1f} %", _f(r.restarts, 0), _f(r.steps_redone, 0)]
        rows = r.faults or [None]
        for i, f in enumerate(rows):
            cells = head if i == 0 else [""] * len(head)
            if f is None:
                tail = ["(no faults)", "", "", "", "", ""]
            elif f.skipped:
                tail = [f.kind, "—", "—", f"skipped: {f.skipped}", "—", "—"]
            else:
                tail = [f.kind, _f(f.at_s), _f(f.step, 0), _f(f.recovered_after_s), _f(f.settled_after_s),
                        _f(f.steps_redone, 0)]
            lines.append("| " + " | ".join(cells + tail) + " |")
    return "\n".join(lines)


def summary(results: Sequence[Goodput]) -> list[str]:
    """The campaign's verdicts in lines: each system's mean recovery per fault, kubetrain's goodput over its
    undisturbed run's and over Trainer v2's, and the fault kinds where kubetrain recovered slower than the peer."""
    by = {r.system: r for r in results}
    lines = []
    for r in results:
        times = [f.recovered_after_s for f in r.faults if f.recovered_after_s is not None]
        if times:
            lines.append(f"{SYSTEM_TITLES.get(r.system, r.system)}: mean recovery {sum(times) / len(times):.1f} s "
                         f"over {len(times)} faults")
    ours, calm, peer = by.get(KUBETRAIN), by.get(UNDISTURBED), by.get(TRAINER_V2)
    if ours and calm and calm.goodput:
        lines.append(f"kubetrain under faults / undisturbed: {ours.goodput / calm.goodput:.3f}x goodput")
    if ours and peer and peer.goodput:
        lines.append(f"kubetrain / Trainer v2: {ours.goodput / peer.goodput:.2f}x goodput")
        theirs = {f.kind: f.recovered_after_s for f in peer.faults}
        slower = [f"{f.kind} ({f.recovered_after_s:.1f} s vs {theirs[f.kind]:.1f} s)" for f in ours.faults
                  if f.recovered_after_s is not None and theirs.get(f.kind) is not None
                  and f.recovered_after_s > (theirs[f.kind] or 0.0)]
        lines.append("fault kinds kubetrain recovered slower from: " + (", ".join(slower) or "none"))
    return lines
