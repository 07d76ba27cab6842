"""The operator's sweep adapter (kubetrain.operator.sweeps.plan, pure), its cache and its metrics.

A small simulator stands in for the API server and the job controller: it writes each plan's status
into the sweep (as the status subresource would), creates and suspends the trial jobs the plan names,
and lets the test say what each trial's job reports (phase, step, loss), so whole sweeps run in
milliseconds through the real policy.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
from datetime import UTC, datetime, timedelta
from typing import Any
from unittest.mock import MagicMock

import pytest
from kubernetes import client
from prometheus_client import REGISTRY

from kubetrain.core import api, contract
from kubetrain.operator.controller import Controller
from kubetrain.operator.jobs.apply import Apis, Applier
from kubetrain.operator.jobs.cache import WatchCache
from kubetrain.operator.runtime.settings import OperatorSettings
from kubetrain.operator.sweeps import plan as sw
from kubetrain.operator.sweeps.cache import SweepCache
from kubetrain.operator.sweeps.controller import RECHECK_SECONDS, SweepController, export_metrics, remove_metrics

T0 = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)
NS = "ml"
UID = "sweep-uid-1"


def sweep_body(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "template": {"spec": {"workers": 1, "maxSteps": 100, "optimizer": {"minLr": 1e-5},
                              "checkpoint": {"ephemeral": True}}},
        "parameters": [{"path": "optimizer.lr", "type": "float", "low": 1e-4, "high": 1e-2, "log": True}],
        "maxTrials": 3, "parallelism": 2,
    }
    base.update(spec)
    return {"apiVersion": api.API_VERSION, "kind": api.SWEEP_KIND,
            "metadata": {"name": "lr", "namespace": NS, "uid": UID, "generation": 1, "resourceVersion": "1"},
            "spec": base}


class Sim:
    """The API server and the job controller, as far as the sweep adapter sees them."""

    def __init__(self, body: dict[str, Any]):
        self.body = body
        self.jobs: dict[str, dict[str, Any]] = {}
        self.created: list[str] = []
        self.suspended: list[str] = []
        self.rv = itertools.count(2)
        self.now = T0

    def round(self) -> sw.SweepPlan:
        """One reconcile: plan, then carry it out in the applier's order."""
        self.now += timedelta(seconds=5)
        p = sw.plan(self.body, list(self.jobs.values()), self.now)
        if p.status is not None:
            self.body = {**self.body, "status": copy.deepcopy(p.status),
                         "metadata": {**self.body["metadata"], "resourceVersion": str(next(self.rv))}}
        for job in p.create:
            name = job["metadata"]["name"]
            self.created.append(name)
            self.jobs.setdefault(name, {**copy.deepcopy(job), "status": {}})
        for name in p.suspend:
            self.suspended.append(name)
            self.jobs[name]["spec"]["suspend"] = True
        assert len(self.active()) <= self.body["spec"]["parallelism"], self.active()
        return p

    def active(self) -> list[str]:
        """Trial jobs that hold (or will hold) pods."""
        stopped = ("Succeeded", "Failed", "Suspended")
        return [n for n, j in self.jobs.items() if not j["spec"].get("suspend") and j["status"].get("phase") not in stopped]

    def report(self, name: str, phase: str = "Running", step: int = 0, loss: float | None = None) -> None:
        """What the job controller writes into a trial job's status (loss as the string it shows)."""
        status: dict[str, Any] = {"phase": phase, "currentStep": step}
        if loss is not None:
            status["loss"] = f"{loss:.4f}"
        self.jobs[name]["status"] = status

    @property
    def status(self) -> dict[str, Any]:
        return dict(self.body.get("status") or {})

    def trials(self) -> list[tuple[int, str, str]]:
        return [(t["index"], t["jobName"], t["state"]) for t in self.status.get("trials", [])]


# --------------------------------------------------------------------------- observing trial jobs


def test_trial_key_maps_a_labelled_job_to_its_sweep() -> None:
    labelled = {"metadata": {"namespace": NS, "name": "lr-0", "labels": {contract.LABEL_SWEEP: "lr"}}}
    assert sw.trial_key(labelled) == (NS, "lr")
    assert sw.trial_key({"metadata": {"namespace": NS, "name": "j", "labels": {contract.LABEL_JOB: "x"}}}) is None


@pytest.mark.parametrize(("status", "want"), [
    ({}, (api.Phase.PENDING, 0, None, "")),
    ({"phase": "Running", "currentStep": 40, "loss": "2.3456"}, (api.Phase.RUNNING, 40, 2.3456, "")),
    ({"phase": "Failed", "message": "exit 1"}, (api.Phase.FAILED, 0, None, "exit 1")),
    ({"phase": "Running", "loss": "not a number"}, (api.Phase.RUNNING, 0, None, "")),
    ({"phase": "SomethingNew", "currentStep": "x"}, (api.Phase.PENDING, 0, None, "")),
])
def test_observation_of_a_job(status: dict[str, Any], want: tuple[Any, ...]) -> None:
    obs = sw.observation({"metadata": {"name": "lr-0"}, "status": status})
    assert (obs.phase, obs.step, obs.loss, obs.message) == want


def test_observation_of_no_job_and_of_a_diverged_loss() -> None:
    assert sw.observation(None).phase is None
    diverged = sw.observation({"status": {"phase": "Running", "loss": "nan"}}).loss
    assert diverged is not None and diverged != diverged, "NaN reaches the policy, which prunes the trial"


# --------------------------------------------------------------------------- running a sweep


def test_first_reconcile_records_trials_before_creating_their_owned_jobs() -> None:
    p = sw.plan(sweep_body(), [], T0)
    assert p.status is not None and p.status["phase"] == "Running" and p.status["observedGeneration"] == 1
    assert [(t["index"], t["jobName"], t["state"]) for t in p.status["trials"]] == [(0, "lr-0", "Pending"),
                                                                                   (1, "lr-1", "Pending")]
    assert [j["metadata"]["name"] for j in p.create] == ["lr-0", "lr-1"], "parallelism 2"
    for i, job in enumerate(p.create):
        meta = job["metadata"]
        assert meta["namespace"] == NS and job["kind"] == api.KIND
        assert meta["labels"][contract.LABEL_SWEEP] == "lr" and meta["labels"][contract.LABEL_TRIAL] == str(i)
        assert meta["ownerReferences"] == [{"apiVersion": api.API_VERSION, "kind": api.SWEEP_KIND, "name": "lr",
                                            "uid": UID, "controller": True, "blockOwnerDeletion": True}]
        assert job["spec"]["optimizer"]["lr"] == p.status["trials"][i]["params"]["optimizer.lr"]
    assert not p.suspend and p.requeue_after is None and not p.finished


def test_a_lost_create_is_made_again_with_the_same_name_and_no_new_trial() -> None:
    """The operator died between the status write and the creates: the next step creates the same jobs."""
    first = sw.plan(sweep_body(), [], T0)
    body = {**sweep_body(), "status": first.status}
    again = sw.plan(body, [], T0 + timedelta(seconds=30))
    assert [j["metadata"]["name"] for j in again.create] == ["lr-0", "lr-1"]
    assert again.create == first.create
    assert again.status is None, "nothing new to record: no second trial, no status write"
    assert sw.needs_live_look(body, []), "unfinished trials without a job in the cache are confirmed live first"


def test_a_refused_trial_job_is_a_trials_blocked_condition_until_one_is_created() -> None:
    first = sw.plan(sweep_body(), [], T0)
    body = {**sweep_body(), "status": first.status}
    refused = (api.ConditionReason.CREATE_REJECTED, 'TrainingJob lr-1 was refused: exceeded quota: one-job')
    blocked = sw.plan(body, [], T0 + timedelta(seconds=5), refused)
    assert blocked.status is not None and [j["metadata"]["name"] for j in blocked.create] == ["lr-0", "lr-1"]
    cond = next(c for c in blocked.status["conditions"] if c["type"] == api.TRIALS_BLOCKED)
    assert (cond["status"], cond["reason"], cond["message"]) == ("True", "CreateRejected", refused[1])
    assert blocked.status["phase"] == "Running", "a refusal is waited out, not a failure"
    body = {**sweep_body(), "status": blocked.status}
    assert sw.plan(body, [], T0 + timedelta(seconds=9), refused).status is None, "said once, not per retry"
    cleared = sw.plan(body, [], T0 + timedelta(seconds=20))
    assert cleared.status is not None
    cond = next(c for c in cleared.status["conditions"] if c["type"] == api.TRIALS_BLOCKED)
    assert (cond["status"], cond["reason"]) == ("False", "TrialsCreated")
    assert not any(c["type"] == api.TRIALS_BLOCKED for c in first.status["conditions"]), "never blocked: no condition"


def test_a_whole_sweep_runs_to_the_best_trial_never_more_than_parallelism_at_once() -> None:
    sim = Sim(sweep_body(pruner={"type": "none"}))
    sim.round()
    assert sim.created == ["lr-0", "lr-1"]
    sim.report("lr-0", step=10, loss=3.0)
    sim.report("lr-1", step=10, loss=3.1)
    assert sim.round().status is not None
    assert sim.trials() == [(0, "lr-0", "Running"), (1, "lr-1", "Running")]
    assert sim.round().status is None, "nothing changed: no status write"
    sim.report("lr-0", phase="Succeeded", step=100, loss=1.5)
    p = sim.round()
    assert [j["metadata"]["name"] for j in p.create] == ["lr-2"], "the freed slot takes the third trial"
    assert ("Normal", "TrialCompleted") in [e[:2] for e in p.events]
    sim.report("lr-1", phase="Succeeded", step=100, loss=1.2)
    sim.round()
    sim.report("lr-2", phase="Succeeded", step=100, loss=2.0)
    p = sim.round()
    st = sim.status
    assert st["phase"] == "Succeeded" and p.finished and p.requeue_after is None
    assert (st["bestTrial"], st["bestValue"], st["trialsSummary"]) == (1, 1.2, "3/3")
    assert st["bestParams"] == st["trials"][1]["params"]
    assert sim.created == ["lr-0", "lr-1", "lr-2"], "exactly one job per trial"
    assert ("Normal", "Completed") in [e[:2] for e in p.events]


def test_a_pruned_trial_is_suspended_once() -> None:
    sim = Sim(sweep_body(maxTrials=2, pruner={"type": "asha", "minSteps": 10}))
    sim.round()
    sim.report("lr-0", step=10, loss=1.0)
    sim.round()
    sim.report("lr-1", step=10, loss=50.0)
    p = sim.round()
    assert p.suspend == ["lr-1"]
    assert dict((t[1], t[2]) for t in sim.trials())["lr-1"] == "Pruned"
    # The job controller has not turned spec.suspend into phase Suspended yet: no second patch.
    assert sim.round().suspend == []
    sim.report("lr-1", phase="Suspended", step=10, loss=50.0)
    assert sim.round().suspend == [] and sim.suspended == ["lr-1"]


def test_a_finished_sweep_only_stops_trial_jobs_still_running() -> None:
    sim = Sim(sweep_body(maxTrials=2, pruner={"type": "asha", "minSteps": 10}))
    sim.round()
    sim.report("lr-0", step=10, loss=1.0)
    sim.round()
    sim.report("lr-1", step=10, loss=50.0)
    sim.round()  # lr-1 pruned and suspended
    sim.report("lr-0", phase="Succeeded", step=100, loss=0.5)
    sim.report("lr-1", phase="Suspended", step=10, loss=50.0)
    assert sim.round().finished and sim.status["phase"] == "Succeeded"
    # Someone resumes the pruned trial's job by hand: the finished sweep stops it again, and writes nothing.
    sim.jobs["lr-1"]["spec"]["suspend"] = False
    sim.report("lr-1", phase="Running", step=10, loss=50.0)
    p = sim.round()
    assert p.suspend == ["lr-1"] and p.status is None and not p.events and not p.create and p.finished


def test_jobs_with_the_label_but_another_owner_are_reported_not_observed() -> None:
    first = sw.plan(sweep_body(), [], T0)
    body = {**sweep_body(), "status": first.status}
    stranger = {**copy.deepcopy(first.create[0]), "status": {"phase": "Succeeded", "loss": "0.0001"}}
    stranger["metadata"]["ownerReferences"] = [{"uid": "someone-else"}]
    p = sw.plan(body, [stranger], T0 + timedelta(seconds=5))
    assert p.foreign == ["lr-0"]
    assert [j["metadata"]["name"] for j in p.create] == ["lr-0", "lr-1"], "its trial is still not created"
    assert p.status is None, "the stranger's Succeeded did not complete trial 0"


def test_a_status_that_does_not_validate_is_not_stepped_over() -> None:
    body = {**sweep_body(), "status": {"phase": "Running", "trials": [{"index": "zero"}]}}
    with pytest.raises(ValueError, match="does not validate"):
        sw.plan(body, [], T0)


def test_a_spec_the_model_refuses_fails_the_sweep_once() -> None:
    body = sweep_body(parameters=[{"path": "optimizer.lr", "type": "float", "low": 1.0, "high": 0.5}])
    p = sw.plan(body, [], T0)
    assert p.status is not None and p.status["phase"] == "Failed" and p.status["reason"] == "InvalidSpec"
    assert "low < high" in p.status["message"] and p.events[0][:2] == ("Warning", "InvalidSpec")
    again = sw.plan({**body, "status": p.status}, [], T0)
    assert again.status is None and not again.events and again.finished


def test_a_field_from_a_newer_crd_stops_new_trials_but_fails_nothing() -> None:
    """The TrainingSweep CRD was upgraded before the operator (here a new field in the trial template): no trial
    starts, as one made without the field could train something else; the sweep says why, once."""
    body = sweep_body(template={"spec": {"workers": 1, "maxSteps": 100, "futureParallelism": {"degree": 1}}})
    p = sw.plan(body, [], T0)
    assert not p.create and not p.finished and p.status is not None and p.status.get("phase") != "Failed"
    assert p.status["message"].startswith("spec.template.spec.futureParallelism: not known to this operator")
    assert [e[:2] for e in p.events] == [("Warning", "UnknownFields")]
    [cond] = [c for c in p.status["conditions"] if c["type"] == api.OPERATOR_OUTDATED]
    assert (cond["status"], cond["reason"]) == ("True", "UnknownFields")
    again = sw.plan({**body, "status": p.status}, [], T0)
    assert again.status is None and not again.events and not again.create


# --------------------------------------------------------------------------- cache and metrics


def _job(name: str, uid: str, rv: int, sweep: str = "lr") -> dict[str, Any]:
    return {"metadata": {"namespace": NS, "name": name, "uid": uid, "resourceVersion": str(rv),
                         "labels": {contract.LABEL_SWEEP: sweep}}}


def test_cache_keeps_trial_jobs_by_their_sweep_and_the_newer_copy() -> None:
    cache = SweepCache()
    assert cache.job_event("ADDED", {"metadata": {"namespace": NS, "name": "plain"}}) is None
    assert cache.job_event("ADDED", _job("lr-0", "a", 5)) == (NS, "lr")
    cache.job_event("MODIFIED", _job("lr-0", "a", 3))  # an older copy arriving late
    assert cache.jobs((NS, "lr"))[0]["metadata"]["resourceVersion"] == "5"
    cache.job_event("ADDED", _job("lr-0", "b", 2))  # deleted and created again: the new object wins
    cache.job_event("DELETED", _job("lr-0", "a", 6))  # the old one's late DELETED does not remove it
    assert [j["metadata"]["uid"] for j in cache.jobs((NS, "lr"))] == ["b"]
    cache.job_event("DELETED", _job("lr-0", "b", 7))
    assert cache.jobs((NS, "lr")) == [] and cache.size() == 0


def test_a_live_list_does_not_take_back_a_newer_watch_copy() -> None:
    """A watch event that lands while the live LIST runs (the job Succeeded) outranks the LIST's older copy;
    a job the LIST does not have is dropped."""
    cache = SweepCache()
    cache.job_event("MODIFIED", _job("lr-0", "a", 9))
    cache.job_event("ADDED", _job("lr-1", "c", 4))
    cache.replace_jobs((NS, "lr"), [_job("lr-0", "a", 7), _job("lr-2", "d", 8)])
    by_name = {j["metadata"]["name"]: j["metadata"]["resourceVersion"] for j in cache.jobs((NS, "lr"))}
    assert by_name == {"lr-0": "9", "lr-2": "8"}


def test_a_job_whose_label_is_removed_leaves_its_sweep() -> None:
    """Taking a pruned trial's job out of the sweep (to resume it by hand) must stop the sweep seeing it."""
    cache = SweepCache()
    cache.job_event("ADDED", _job("lr-0", "a", 1))
    unlabelled = _job("lr-0", "a", 2)
    unlabelled["metadata"]["labels"] = {}
    assert cache.job_event("MODIFIED", unlabelled) == (NS, "lr"), "its sweep is looked at again"
    assert cache.jobs((NS, "lr")) == [] and cache.size() == 0
    cache.job_event("MODIFIED", _job("lr-0", "a", 3, sweep="other"))
    cache.job_event("MODIFIED", _job("lr-0", "a", 4, sweep="lr"))
    assert cache.jobs((NS, "other")) == [] and len(cache.jobs((NS, "lr"))) == 1


def test_cache_forgets_a_deleted_sweep_and_a_new_one_under_its_name_starts_clean() -> None:
    cache = SweepCache()
    key = cache.sweep_event("ADDED", sweep_body())
    cache.reported(key).refused = "quota"
    replacement = sweep_body()
    replacement["metadata"] = {**replacement["metadata"], "uid": "sweep-uid-2", "resourceVersion": "1"}
    cache.sweep_event("ADDED", replacement)
    assert cache.reported(key).refused is None
    cache.sweep_event("DELETED", replacement)
    assert cache.sweep(key) is None


def _sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_metrics_follow_the_status_and_go_with_the_sweep() -> None:
    key = (NS, "metrics-test")
    status = {"trials": [{"state": "Complete"}, {"state": "Complete"}, {"state": "Pruned"}, {"state": "Running"}],
              "bestValue": 1.25}
    export_metrics(key, status)
    trials = "kubetrain_operator_sweep_trials"
    assert _sample(trials, namespace=NS, sweep="metrics-test", state="Complete") == 2
    assert _sample(trials, namespace=NS, sweep="metrics-test", state="Failed") == 0
    assert _sample("kubetrain_operator_sweep_best_value", namespace=NS, sweep="metrics-test") == 1.25
    remove_metrics(key)
    assert _sample(trials, namespace=NS, sweep="metrics-test", state="Complete") is None
    assert _sample("kubetrain_operator_sweep_best_value", namespace=NS, sweep="metrics-test") is None
    remove_metrics(key)  # twice is fine


# --------------------------------------------------------------------------- the controller's loop


class FakeOutcome:
    def __init__(self, written: bool = True, blocked: bool = False):
        self.written, self.blocked = written, blocked


class FakeIo:
    """Stands in for the SweepApplier: records what it is asked to carry out."""

    def __init__(self, cache: SweepCache, outcome: FakeOutcome):
        self.cache, self.outcome, self.plans, self.refreshed = cache, outcome, [], 0

    async def refresh(self, key: Any) -> None:
        self.refreshed += 1

    async def execute(self, key: Any, body: dict[str, Any], plan: sw.SweepPlan) -> FakeOutcome:
        self.plans.append(plan)
        return self.outcome


def _controller(outcome: FakeOutcome) -> tuple[SweepController, FakeIo]:
    applier = Applier(Apis(MagicMock(), MagicMock(), MagicMock(), lambda obj: obj, MagicMock()), WatchCache(), 1, lambda: T0)
    applier.close()  # no API call leaves: the fake carries plans out
    ctl = SweepController(applier, 1, lambda: T0)
    io = FakeIo(ctl.cache, outcome)
    ctl.io = io  # type: ignore[assignment]
    return ctl, io


@pytest.mark.parametrize(("outcome", "want"), [
    (FakeOutcome(), RECHECK_SECONDS),
    (FakeOutcome(written=False), 0.0),
    (FakeOutcome(blocked=True), 2.0),
])
def test_reconcile_looks_again_while_running(outcome: FakeOutcome, want: float) -> None:
    ctl, io = _controller(outcome)
    ctl.sweep_event("ADDED", sweep_body())
    assert asyncio.run(ctl.reconcile((NS, "lr"))) == want
    assert io.refreshed == 0 and len(io.plans) == 1 and io.plans[0].create
    remove_metrics((NS, "lr"))


def test_reconcile_confirms_missing_jobs_live_and_forgets_deleted_sweeps() -> None:
    ctl, io = _controller(FakeOutcome())
    first = sw.plan(sweep_body(), [], T0)
    ctl.sweep_event("ADDED", {**sweep_body(), "status": first.status})
    asyncio.run(ctl.reconcile((NS, "lr")))
    assert io.refreshed == 1
    ctl.sweep_event("DELETED", sweep_body())
    assert asyncio.run(ctl.reconcile((NS, "lr"))) is None and len(io.plans) == 1
    assert (NS, "lr") not in ctl.queue


def test_the_job_controller_shares_its_leadership_and_forwards_trial_jobs() -> None:
    ctl = Controller(client.ApiClient(), OperatorSettings(metrics_port=0))
    try:
        ctl.stop_leading()
        assert not ctl.sweeps.queue.leading, "a standby steps no sweep"
        ctl.sweeps.sweep_event("ADDED", sweep_body())
        assert ctl.sweeps.queue.take() is None
        ctl.sweeps.queue.forget((NS, "lr"))
        ctl.job_event("ADDED", _job("lr-0", "a", 3))  # a trial job's event queues its sweep
        assert (NS, "lr") in ctl.sweeps.queue and ctl.sweeps.cache.jobs((NS, "lr"))
        ctl.job_event("ADDED", {"metadata": {"namespace": NS, "name": "plain", "resourceVersion": "1"}})
        assert ctl.sweeps.cache.jobs((NS, "plain")) == []
        ctl._lead(True)  # what start_leading() does after its re-LIST
        assert ctl.sweeps.queue.take() == (NS, "lr")
    finally:
        ctl.applier.close()
