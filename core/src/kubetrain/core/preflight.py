"""The preflight's verdict, pure: which ranks of a gang are degraded (no torch, no clock).

Every rank of the built-in trainer measures its own compute (GFLOP/s) and a neighbour exchange (seconds)
before the first step of each generation (kubetrain.trainer.preflight); rank 0 gathers them into its
progress record (api.Preflight). A rank is degraded when its compute, or its exchange speed (1 / seconds),
is below `fraction` of the gang's median. A gang of one rank has no one to compare with: never degraded.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from kubetrain.core.api import Preflight, PreflightRank

MAX_REPORTED_RANKS = 256
"""Ranks listed in a preflight report; a larger gang keeps the slowest (the record rides in a pod annotation,
which the API server caps at 256 KiB with all the pod's others). The medians are the whole gang's."""


@dataclass(frozen=True)
class Degraded:
    """One degraded rank: what it measured against the gang's median, and where it runs."""

    rank: int
    worker: int
    node: str
    what: str
    """`compute` or `exchange`."""
    measured: float
    median: float
    unit: str

    def describe(self) -> str:
        where = f"rank {self.rank} (worker {self.worker}" + (f", node {self.node})" if self.node else ")")
        return f"{where}: {self.what} {self.measured:.3g} {self.unit}, gang median {self.median:.3g} {self.unit}"


def median_or_none(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def degraded_ranks(report: Preflight, fraction: float) -> list[Degraded]:
    """The ranks of `report` below `fraction` of the gang's median compute or exchange speed, by rank.

    A rank at exactly the fraction is not degraded; a gang of one never is; a missing figure (no
    exchange in a gang of one) says nothing. A rank slow at both is named once, for its compute."""
    if report.world_size < 2:
        return []
    out = []
    for r in sorted(report.ranks, key=lambda r: r.rank):
        if report.median_gflops and r.gflops < fraction * report.median_gflops:
            out.append(Degraded(r.rank, r.worker, r.node, "compute", r.gflops, report.median_gflops, "GFLOP/s"))
        elif (med := report.median_exchange_seconds) and r.exchange_seconds and med / r.exchange_seconds < fraction:
            out.append(Degraded(r.rank, r.worker, r.node, "exchange", r.exchange_seconds, med, "s"))
    return out


def slowest_rank(ranks: Sequence[PreflightRank]) -> int | None:
    """The rank with the lowest compute (the lowest rank among equals)."""
    return min(ranks, key=lambda r: (r.gflops, r.rank)).rank if ranks else None


def summarize(ranks: Sequence[PreflightRank], *, generation: int, seconds: float, busbw_gbps: float | None,
              world_size: int) -> Preflight:
    """The report rank 0 sends: medians over every rank, the slowest MAX_REPORTED_RANKS listed by rank."""
    listed = sorted(ranks, key=lambda r: (r.gflops, r.rank))[:MAX_REPORTED_RANKS]
    return Preflight(
        generation=generation, seconds=round(seconds, 3), world_size=world_size,
        bus_bandwidth_gbps=None if busbw_gbps is None else round(busbw_gbps, 4),
        median_gflops=round(statistics.median(r.gflops for r in ranks), 3),
        median_exchange_seconds=median_or_none([r.exchange_seconds for r in ranks]),
        slowest_rank=slowest_rank(ranks), ranks=sorted(listed, key=lambda r: r.rank),
    )


def degraded_nodes(found: Sequence[Degraded]) -> list[str]:
    """The node names of degraded ranks, once each, in order (a rank with no known node names none)."""
    return list(dict.fromkeys(d.node for d in found if d.node))


def verdict_message(found: Sequence[Degraded], fraction: float, generation: int) -> str:
    """NodeDegraded's message (and its Event's)."""
    return (f"preflight of generation {generation}: below {fraction:g} of the gang's median: "
            + "; ".join(d.describe() for d in found))
