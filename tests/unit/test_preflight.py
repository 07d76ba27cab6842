"""Preflight: the pure verdict, the NodeDegraded condition through lifecycle.step, the avoided nodes' affinity,
and the API fields (defaults, bounds, CRD)."""

from datetime import UTC, datetime

import pytest
import yaml

from kubetrain.core import crd
from kubetrain.core.api import (
    NODE_DEGRADED,
    ConditionReason,
    Preflight,
    PreflightRank,
    TrainingJob,
    TrainingJobSpec,
    TrainingJobStatus,
)
from kubetrain.core.contract import format_time
from kubetrain.core.lifecycle import Observed, RecordEvent, WorkerPhase, WorkerState, step
from kubetrain.core.preflight import (
    MAX_REPORTED_RANKS,
    Degraded,
    degraded_nodes,
    degraded_ranks,
    summarize,
    verdict_message,
)
from kubetrain.core.progress import Progress
from kubetrain.core.validate import problems_of
from kubetrain.operator.jobs import builders as b

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def rank(i: int, gflops: float, exchange: float | None = 0.01, worker: int | None = None, node: str = "") -> PreflightRank:
    return PreflightRank(rank=i, worker=i if worker is None else worker, node=node or f"node-{i}", gflops=gflops,
                         exchange_seconds=exchange)


def report(*ranks: PreflightRank, generation: int = 0) -> Preflight:
    return summarize(list(ranks), generation=generation, seconds=0.5, busbw_gbps=1.0, world_size=len(ranks))


# --------------------------------------------------------------------------- the verdict

@pytest.mark.parametrize(("gflops", "fraction", "expected"), [
    ([100, 100, 100, 100], 0.5, []),  # a healthy gang
    ([100, 100, 100, 20], 0.5, [3]),  # one slow rank
    ([100, 100, 100, 50], 0.5, []),  # exactly at the fraction of the median: not degraded
    ([100, 100, 100, 49.9], 0.5, [3]),  # just below it
    ([10, 100, 100, 20], 0.5, [0, 3]),  # two slow ranks, named by rank
    ([30, 30, 30, 30], 0.5, []),  # a slow gang is not a degraded rank
    ([100, 100, 100, 80], 0.9, [3]),  # a stricter fraction
    ([100, 25], 0.5, [1]),  # a gang of two: the median is their mean (62.5), 25 < 31.25
    ([100, 40], 0.5, []),  # 40 > 0.5 x 70
])
def test_compute_below_the_fraction_of_the_median_is_degraded(gflops, fraction, expected):
    found = degraded_ranks(report(*(rank(i, g) for i, g in enumerate(gflops))), fraction)
    assert [d.rank for d in found] == expected
    assert all(d.what == "compute" and d.unit == "GFLOP/s" for d in found)


def test_a_gang_of_one_is_never_degraded():
    one = report(rank(0, 0.001, exchange=None))
    assert degraded_ranks(one, 0.99) == []
    assert one.bus_bandwidth_gbps == 1.0 and one.median_exchange_seconds is None and one.slowest_rank == 0


def test_a_slow_exchange_names_the_ranks_beside_a_slow_link():
    # the link 1 -> 2 is slow: rank 1 waits on its send, rank 2 on its receive; the others do not
    found = degraded_ranks(report(*(rank(i, 100, exchange=e) for i, e in enumerate([0.01, 0.05, 0.05, 0.01, 0.01]))),
                           0.5)
    assert [(d.rank, d.what, d.measured, d.median) for d in found] == [(1, "exchange", 0.05, 0.01),
                                                                         (2, "exchange", 0.05, 0.01)]


def test_a_rank_slow_at_both_is_named_once_for_its_compute():
    found = degraded_ranks(report(rank(0, 100), rank(1, 100), rank(2, 10, exchange=1.0)), 0.5)
    assert [(d.rank, d.what) for d in found] == [(2, "compute")]


def test_ties_for_slowest_go_to_the_lowest_rank():
    assert report(rank(0, 100), rank(1, 50), rank(2, 50)).slowest_rank == 1


def test_a_large_gang_lists_its_slowest_ranks_with_the_whole_gangs_medians():
    ranks = [rank(i, 1000 + i) for i in range(MAX_REPORTED_RANKS + 10)]
    ranks[250] = rank(250, 1.0)
    r = report(*ranks)
    assert len(r.ranks) == MAX_REPORTED_RANKS and r.world_size == MAX_REPORTED_RANKS + 10
    assert [x.rank for x in r.ranks] == sorted(x.rank for x in r.ranks) and r.ranks[0].rank == 0
    assert all(x.rank < MAX_REPORTED_RANKS for x in r.ranks if x.rank != 250)
    assert r.median_gflops == 1131.5  # of all 266: 1.0, then 1000..1249 and 1251..1265
    assert [d.rank for d in degraded_ranks(r, 0.5)] == [250]


def test_the_message_names_rank_worker_node_and_figures():
    found = [Degraded(3, 1, "gpu-7", "compute", 20.0, 100.0, "GFLOP/s"),
             Degraded(5, 2, "", "exchange", 0.5, 0.01, "s")]
    assert verdict_message(found, 0.5, 4) == (
        "preflight of generation 4: below 0.5 of the gang's median: rank 3 (worker 1, node gpu-7): compute 20 "
        "GFLOP/s, gang median 100 GFLOP/s; rank 5 (worker 2): exchange 0.5 s, gang median 0.01 s")
    assert degraded_nodes([*found, found[0]]) == ["gpu-7"]


# --------------------------------------------------------------------------- the condition, through step

def spec(**kw) -> TrainingJobSpec:
    return TrainingJobSpec.model_validate({"workers": 2, "maxSteps": 100, **kw})


def running(**kw) -> TrainingJobStatus:
    base = {"phase": "Running", "gangCreated": True, "startTime": format_time(T0), "runningSince": format_time(T0)}
    return TrainingJobStatus.model_validate({**base, **kw})


def observed(pf: Preflight | None) -> Observed:
    return Observed(workers=tuple(WorkerState(i, WorkerPhase.RUNNING) for i in range(2)),
                    progress=Progress(generation=pf.generation if pf else 0, step=0, preflight=pf))


SLOW_WORKER_1 = report(rank(0, 100, node="n0"), rank(1, 10, node="n1"))


def node_degraded(status: TrainingJobStatus):
    return [c for c in status.conditions if c.type == NODE_DEGRADED]


def test_a_degraded_rank_sets_node_degraded_with_one_warning_event():
    t = step(spec(), running(), observed(SLOW_WORKER_1), T0)
    [c] = node_degraded(t.status)
    assert (c.status, c.reason) == ("True", ConditionReason.RANK_DEGRADED)
    assert "rank 1 (worker 1, node n1): compute 10 GFLOP/s, gang median 55 GFLOP/s" in c.message
    assert [e for e in t.effects if isinstance(e, RecordEvent) and e.reason == ConditionReason.RANK_DEGRADED] == [
        RecordEvent("Warning", ConditionReason.RANK_DEGRADED, c.message)]
    assert t.status.preflight.degraded_ranks == [1] and t.status.preflight.slowest_rank == 1
    assert t.status.avoided_nodes == []  # avoidDegradedNodes is off by default
    again = step(spec(), t.status, observed(SLOW_WORKER_1), T0)
    assert node_degraded(again.status) == [c]
    assert not [e for e in again.effects if isinstance(e, RecordEvent) and e.reason == ConditionReason.RANK_DEGRADED]


def test_a_healthy_preflight_adds_no_condition_and_clears_a_true_one():
    healthy = report(rank(0, 100), rank(1, 90), generation=1)
    assert node_degraded(step(spec(), running(restartGeneration=1), observed(healthy), T0).status) == []
    was = step(spec(), running(), observed(SLOW_WORKER_1), T0).status
    was.restart_generation = 1
    [c] = node_degraded(step(spec(), was, observed(healthy), T0).status)
    assert (c.status, c.reason) == ("False", ConditionReason.PREFLIGHT_PASSED)


def test_an_earlier_generations_report_is_not_this_ones():
    t = step(spec(), running(restartGeneration=2), observed(SLOW_WORKER_1), T0)
    assert t.status.preflight is None and node_degraded(t.status) == []


def test_avoid_degraded_nodes_remembers_them_in_status():
    sp = spec(restartPolicy={"avoidDegradedNodes": True})
    t = step(sp, running(avoidedNodes=["old"]), observed(SLOW_WORKER_1), T0)
    assert t.status.avoided_nodes == ["old", "n1"]
    assert step(sp, t.status, observed(SLOW_WORKER_1), T0).status.avoided_nodes == ["old", "n1"]


# --------------------------------------------------------------------------- the avoided nodes' affinity

AVOID = {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["n1", "n2"]}


def test_avoiding_nodes_adds_a_required_node_affinity():
    assert b.avoid_nodes(None, []) is None
    assert b.avoid_nodes(None, ["n2", "n1", "n2"]) == {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [AVOID]}]}}}


def test_avoiding_nodes_joins_every_term_of_the_users_and_leaves_theirs_alone():
    user = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]},
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n9"]}]}]}},
        "podAntiAffinity": {"x": 1}}
    out = b.avoid_nodes(user, ["n1", "n2"])
    terms = out["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert [t["matchExpressions"][-1] for t in terms] == [AVOID, AVOID]
    assert out["podAntiAffinity"] == {"x": 1}
    assert len(user["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
        "matchExpressions"]) == 1


@pytest.mark.parametrize(("avoid", "expected"), [(True, {"nodeAffinity": {
    "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [AVOID]}]}}}),
    (False, None)])
def test_worker_pods_avoid_the_status_nodes_only_when_asked(avoid, expected):
    job = TrainingJob.model_validate({"metadata": {"name": "llm", "namespace": "a"},
                                      "spec": {"workers": 2, "restartPolicy": {"avoidDegradedNodes": avoid}},
                                      "status": {"avoidedNodes": ["n1", "n2"]}})
    assert b.worker_pod(job, 1, 3, b.WorkerSettings())["spec"].get("affinity") == expected


# --------------------------------------------------------------------------- the API

def test_preflight_is_on_by_default_with_half_the_median():
    s = TrainingJobSpec()
    assert (s.preflight.enabled, s.preflight.degraded_fraction, s.restart_policy.avoid_degraded_nodes) == (
        True, 0.5, False)


@pytest.mark.parametrize(("fraction", "message"), [
    (0, "spec.preflight.degradedFraction: must be > 0.0"),
    (1, "spec.preflight.degradedFraction: must be < 1.0"),
    ("half", "spec.preflight.degradedFraction: must be a number"),
])
def test_degraded_fraction_is_between_0_and_1(fraction, message):
    doc = {"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "j"},
           "spec": {"preflight": {"degradedFraction": fraction}}}
    assert [str(p) for p in problems_of(doc)] == [message]


def test_the_crd_carries_preflight_spec_and_status():
    schema = crd.openapi_schema()
    pf = schema["properties"]["spec"]["properties"]["preflight"]
    fraction = pf["properties"]["degradedFraction"]
    assert (fraction["minimum"], fraction["maximum"], fraction["default"]) == (0, 1, 0.5)
    assert fraction["exclusiveMinimum"] is True and fraction["exclusiveMaximum"] is True
    assert pf["properties"]["enabled"]["default"] is True
    assert schema["properties"]["spec"]["properties"]["restartPolicy"]["properties"]["avoidDegradedNodes"][
        "default"] is False
    status = schema["properties"]["status"]["properties"]
    assert set(status["preflight"]["properties"]) >= {"ranks", "busBandwidthGbps", "slowestRank", "degradedRanks"}
    assert set(status["preflight"]["properties"]["ranks"]["items"]["properties"]) == {
        "rank", "worker", "node", "gflops", "exchangeSeconds"}
    assert status["avoidedNodes"]["items"]["type"] == "string"
    yaml.safe_dump(schema)  # plain data


def test_a_newer_trainers_preflight_fields_are_ignored():
    p = Progress.model_validate({"step": 1, "preflight": {"worldSize": 1, "future": 1, "medianGflops": 2,
                                                          "ranks": [{"rank": 0, "worker": 0, "gflops": 2, "x": 1}]}})
    assert p.preflight.ranks[0].gflops == 2
