"""How much of a pod's memory the checkpoint copies may take: pure, no torch, no I/O.

A worker pod's processes share its memory limit (every page they touch counts against it, /dev/shm's files
included) and its /dev/shm (a memory emptyDir, at most its sizeLimit). Beside what each process needs to
train, the checkpoints keep copies of each rank's state there:

- background saves (checkpoint.asyncSave, background.DcpWriter): one host copy per rank, kept between saves
  (pinned on CUDA), which the write reads while training goes on;
- the memory tier (checkpoint.memory, memory.py): one host snapshot per rank (the copy its background write
  reads) and, in /dev/shm, two copies per rank while it writes the next step.

:func:`plan_gang` sums them over each pod's processes, from every rank's figures gathered at resume, and
decides what the gang keeps (every rank computes the same plan from the same numbers): background staging
first (a synchronous save needs no copy of the whole state), then the tier with what is left. Locally the
"pod" is the machine, shared by every rank of the run (contract.MEMORY_PROCS).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kubetrain.core import contract

STAGING_COPIES = 1
"""Host copies of a rank's state that background saves keep."""
TIER_HOST_COPIES = 1
"""The memory tier's snapshot: the host copy its background write reads."""
TIER_SHM_COPIES = 2
"""The memory tier's copies in /dev/shm: the newest complete step and the one being written."""


@dataclass(frozen=True)
class PodMemory:
    """What one pod's processes share, as the contract passes it (MEMORY_LIMIT, SHM_BYTES, MEMORY_PROCS)."""

    limit_bytes: int | None
    """The pod's memory limit; None: not known (no check against it)."""
    shm_bytes: int | None
    """/dev/shm's size; None: not known (its free space still bounds the tier)."""
    procs: int
    """Processes sharing both."""
    tier_share_bytes: int | None = None
    """What checkpoint.memory.memoryShare grants the tier over the whole pod (MEMORY_CKPT_BYTES x procs)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> PodMemory:
        procs = _positive(environ, contract.MEMORY_PROCS) or _positive(environ, contract.LOCAL_WORLD_SIZE) or 1
        share = _positive(environ, contract.MEMORY_CKPT_BYTES)
        return cls(_positive(environ, contract.MEMORY_LIMIT), _positive(environ, contract.SHM_BYTES), procs,
                   share * procs if share is not None else None)


def _positive(environ: Mapping[str, str], name: str) -> int | None:
    try:
        value = int(environ.get(name) or "")
    except ValueError:
        return None
    return value if value > 0 else None


@dataclass(frozen=True)
class RankNeed:
    """One rank's figures, gathered at resume."""

    state_bytes: int
    """Its state: parameters (its shards), AdamW's two states of each, PowerSGD's error feedback."""
    own_bytes: int
    """What its process needs besides the checkpoint copies (its resident memory, and what the first step still
    adds on the host: :func:`own_bytes`)."""
    held_bytes: int = 0
    """What its memory tier holds in /dev/shm already (one of the two copies it needs)."""
    shm_free_bytes: int | None = None
    """Free space of /dev/shm as it saw it; None: no tier."""


def own_bytes(resident_bytes: int, state_bytes: int, *, state_on_host: bool) -> int:
    """A process's own need before its first step: what it holds now and, when it trains on the CPU, its
    gradients and optimizer states still to come (about its state's size). Activations are not counted."""
    return resident_bytes + (state_bytes if state_on_host else 0)


@dataclass(frozen=True)
class GangPlan:
    """What the gang keeps, the same on every rank."""

    staging: bool
    """Background saves may stage a host copy of each rank's state."""
    tier_budgets: tuple[int | None, ...] | None
    """Each rank's memory-tier budget in bytes (None: no bound); None: the gang keeps no memory tier."""
    notices: tuple[str, ...] = ()
    """Why staging or the tier is off, with the numbers (rank 0 says so once)."""


def plan_gang(pod: PodMemory, ranks: Sequence[RankNeed], *, staging: bool, tier: bool) -> GangPlan:
    """Staging where every pod holds it, then the tier where every pod holds it beside that."""
    pods = [tuple(ranks[i:i + pod.procs]) for i in range(0, len(ranks), max(1, pod.procs))]
    notices: list[str] = []
    if staging:
        why = next(((w, r) for w, p in enumerate(pods) if (r := staging_unfit(pod, p)) is not None), None)
        if why is not None:
            staging = False
            notices.append(f"checkpoints are written synchronously: worker {why[0]}: {why[1]}")
    if not tier:
        return GangPlan(staging, None, tuple(notices))
    budgets: list[int | None] = []
    for worker, members in enumerate(pods):
        planned = tier_budgets(pod, members, staging=staging)
        if isinstance(planned, str):
            notices.append(f"checkpoint.memory is off: worker {worker}: {planned}; restarts resume from the "
                           "durable tier")
            return GangPlan(staging, None, tuple(notices))
        budgets += planned
    return GangPlan(staging, tuple(budgets), tuple(notices))


def staging_unfit(pod: PodMemory, ranks: Sequence[RankNeed]) -> str | None:
    """Why one pod cannot keep a host copy of each rank's state for background saves, or None."""
    if pod.limit_bytes is None:
        return None
    states = [r.state_bytes * STAGING_COPIES for r in ranks]
    own = sum(r.own_bytes for r in ranks)
    if own + sum(states) <= pod.limit_bytes:
        return None
    return (f"staging {_per_process(states)} of state beside the processes' own {gib(own)} exceeds the pod's "
            f"memory limit of {gib(pod.limit_bytes)}")


def tier_budgets(pod: PodMemory, ranks: Sequence[RankNeed], *, staging: bool) -> list[int | None] | str:
    """One pod's memory tier: each rank's budget (its share of the pod's, by its state's size), or why the pod
    cannot hold two copies of every rank's state in /dev/shm and its snapshot on the host."""
    states = [r.state_bytes for r in ranks]
    need = TIER_SHM_COPIES * sum(states)
    bounds = tier_bounds(pod, ranks, staging=staging)
    if not bounds:
        return [None] * len(ranks)
    budget, _ = min(bounds)
    if need > budget:
        return (f"{TIER_SHM_COPIES} copies of {_per_process(states)} of state need {gib(need)}, above its "
                f"budget of {gib(budget)} (" + ", ".join(f"{what} {gib(b)}" for b, what in bounds) + ")")
    total = max(1, sum(states))
    return [budget * s // total for s in states]


def tier_bounds(pod: PodMemory, ranks: Sequence[RankNeed], *, staging: bool) -> list[tuple[int, str]]:
    """What bounds one pod's memory tier (bytes, what): memoryShare's grant, /dev/shm's room (its free space
    and what the tier holds there already), and what the memory limit leaves beside the processes' own
    memory, background staging and the tier's snapshots."""
    bounds: list[tuple[int, str]] = []
    if pod.tier_share_bytes is not None:
        bounds.append((pod.tier_share_bytes, "memoryShare of the pod's memory"))
    free = [r.shm_free_bytes for r in ranks if r.shm_free_bytes is not None]
    room = min(free) + sum(r.held_bytes for r in ranks) if free else None
    if pod.shm_bytes is not None:
        room = pod.shm_bytes if room is None else min(room, pod.shm_bytes)
    if room is not None:
        bounds.append((room, "room in /dev/shm"))
    if pod.limit_bytes is not None:
        copies = TIER_HOST_COPIES + (STAGING_COPIES if staging else 0)
        used = sum(r.own_bytes + copies * r.state_bytes for r in ranks)
        bounds.append((max(0, pod.limit_bytes - used), f"left of the {gib(pod.limit_bytes)} memory limit"))
    return bounds


def _per_process(values: Sequence[int]) -> str:
    """`8 processes x 1.5 GiB` when they are alike, else `12.0 GiB over 8 processes`."""
    if len(set(values)) <= 1:
        return f"{len(values)} process(es) x {gib(values[0] if values else 0)}"
    return f"{gib(sum(values))} over {len(values)} processes"


def gib(n: int) -> str:
    """`1.50 GiB`, below a GiB `146.1 MiB`."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
