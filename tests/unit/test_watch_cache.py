"""The operator's watch cache (kubetrain.operator.jobs.cache), and how the controller queues its events."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kubernetes import client

from kubetrain.core import contract
from kubetrain.core.progress import Progress
from kubetrain.operator.controller import Controller
from kubetrain.operator.jobs.cache import WatchCache, node_not_ready_since
from kubetrain.operator.jobs.controller import PACE_MAX, pace
from kubetrain.operator.jobs.pod_watch import PodList
from kubetrain.operator.runtime.objects import LIST_PAGE, list_pages
from kubetrain.operator.runtime.settings import OperatorSettings

NOW = datetime(2026, 11, 22, 12, 0, 0, tzinfo=UTC)
NS = "team"


def job(name: str, rv: int = 1, generation: int = 0) -> dict[str, Any]:
    return {"metadata": {"namespace": NS, "name": name, "resourceVersion": str(rv)},
            "status": {"restartGeneration": generation}}


def pod(job_name: str, index: int, rv: int = 1, node: str | None = None, **annotations: str) -> dict[str, Any]:
    return {"metadata": {"namespace": NS, "name": f"{job_name}-worker-{index}", "resourceVersion": str(rv),
                         "labels": {contract.LABEL_JOB: job_name, contract.LABEL_GENERATION: "0"},
                         "annotations": annotations},
            "spec": {"nodeName": node} if node else {}}


def node(name: str, ready: bool, since: str | None = "2026-11-22T11:59:00Z") -> dict[str, Any]:
    cond = {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": since}
    return {"metadata": {"name": name}, "status": {"conditions": [cond]}}


def test_a_job_keeps_its_newest_copy() -> None:
    cache = WatchCache()
    assert cache.job_event("ADDED", job("a", rv=5)) == (NS, "a")
    cache.job_event("MODIFIED", job("a", rv=4))  # a stale copy (a late response)
    assert cache.job((NS, "a"))["metadata"]["resourceVersion"] == "5"
    cache.job_event(None, job("a", rv=7))
    assert cache.job((NS, "a"))["metadata"]["resourceVersion"] == "7"


def test_pods_are_kept_under_their_job_and_only_for_a_known_job() -> None:
    cache = WatchCache()
    assert cache.pod_event("ADDED", pod("a", 0)) is None  # no such job: nothing kept
    assert cache.size() == 0
    cache.job_event("ADDED", job("a"))
    assert cache.pod_event("ADDED", pod("a", 0)) == (NS, "a")
    assert cache.pod_event("ADDED", {"metadata": {"namespace": NS, "name": "x", "labels": {}}}) is None
    assert [p["metadata"]["name"] for p in cache.pods((NS, "a"))] == ["a-worker-0"]


def test_a_deleted_pod_is_not_brought_back_by_an_older_copy() -> None:
    cache = WatchCache()
    cache.job_event("ADDED", job("a"))
    cache.pod_event("ADDED", pod("a", 0, rv=9))
    cache.pod_event("DELETED", pod("a", 0, rv=10))
    cache.pod_event("MODIFIED", pod("a", 0, rv=9))  # e.g. the create response, arriving late
    assert cache.pods((NS, "a")) == []
    cache.pod_event("ADDED", pod("a", 0, rv=11))  # the next generation's worker 0
    assert cache.pod((NS, "a"), "a-worker-0")["metadata"]["resourceVersion"] == "11"


def test_deleted_jobs_leave_nothing_behind_even_when_their_pods_go_after_them() -> None:
    cache = WatchCache()
    for i in range(2000):
        cache.job_event("ADDED", job(f"j{i}"))
        for w in range(4):
            cache.pod_event("ADDED", pod(f"j{i}", w, rv=2))
    assert cache.size() == 2000 * 5
    for i in range(2000):
        cache.pod_event("DELETED", pod(f"j{i}", 0, rv=3))
        cache.job_event("DELETED", job(f"j{i}"))
        for w in range(4):  # the garbage collector deletes the pods after their owner
            cache.pod_event("MODIFIED", pod(f"j{i}", w, rv=4))
            cache.pod_event("DELETED", pod(f"j{i}", w, rv=5))
    assert cache.size() == 0 and cache.keys() == []


def test_a_termination_taint_marks_the_node_and_requeues_the_jobs_on_it() -> None:
    cache = WatchCache(("aws-node-termination-handler/spot-itn", "karpenter.sh/disrupted"))
    cache.job_event("ADDED", job("a"))
    cache.pod_event("ADDED", pod("a", 0, node="n1"))
    tainted = {**node("n1", ready=True), "spec": {"taints": [
        {"key": "other", "effect": "NoSchedule"}, {"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}]}}
    assert cache.node_event("MODIFIED", tainted, NOW) == [(NS, "a")]
    assert cache.terminating == {"n1": "karpenter.sh/disrupted"}
    assert cache.node_event("MODIFIED", tainted, NOW) == []  # nothing new
    assert cache.node_event("MODIFIED", node("n1", ready=True), NOW) == [(NS, "a")]  # the taint went
    assert cache.terminating == {}


def test_a_node_going_not_ready_requeues_the_jobs_with_a_pod_on_it() -> None:
    cache = WatchCache()
    cache.job_event("ADDED", job("a"))
    cache.job_event("ADDED", job("b"))
    cache.pod_event("ADDED", pod("a", 0, node="n1"))
    cache.pod_event("ADDED", pod("b", 0, node="n2"))
    assert cache.node_event("ADDED", node("n1", ready=True), NOW) == []
    assert cache.node_event("MODIFIED", node("n1", ready=False), NOW) == [(NS, "a")]
    assert cache.nodes == {"n1": datetime(2026, 11, 22, 11, 59, tzinfo=UTC)}
    assert cache.node_event("MODIFIED", node("n1", ready=False), NOW) == []  # no change
    assert cache.node_event("DELETED", node("n1", ready=False), NOW) == [(NS, "a")]
    assert cache.nodes == {}  # a gone node is not kept


def test_a_not_ready_node_without_a_transition_time_counts_from_now() -> None:
    assert node_not_ready_since(node("n", ready=False, since=None), NOW) == NOW
    assert node_not_ready_since(node("n", ready=True), NOW) is None
    assert node_not_ready_since({"metadata": {"name": "n"}}, NOW) is None


def test_a_live_read_replaces_the_pods_and_says_whether_the_cache_lagged() -> None:
    cache = WatchCache()
    cache.job_event("ADDED", job("a"))
    cache.pod_event("ADDED", pod("a", 0, rv=2))
    assert cache.read_live((NS, "a")) is None
    assert not cache.replace_pods((NS, "a"), {"a-worker-0": pod("a", 0, rv=2)}, NOW)
    assert cache.replace_pods((NS, "a"), {"a-worker-0": pod("a", 0, rv=3), "a-worker-1": pod("a", 1, node="n")}, NOW)
    assert len(cache.pods((NS, "a"))) == 2 and cache.nodes_of((NS, "a")) == {"n"}
    assert cache.read_live((NS, "a")) == NOW
    assert not cache.replace_pods((NS, "gone"), {}, NOW)


def test_a_pod_being_deleted_is_kept_as_terminating() -> None:
    cache = WatchCache()
    cache.job_event("ADDED", job("a"))
    cache.pod_event("ADDED", pod("a", 0))
    cache.mark_deleting((NS, "a"), "a-worker-0", NOW)
    assert cache.pod((NS, "a"), "a-worker-0")["metadata"]["deletionTimestamp"] == "2026-11-22T12:00:00Z"


def test_progress_is_rank_0s_of_the_current_generation() -> None:
    report = Progress(step=7).model_dump_json()
    cache = WatchCache()
    cache.job_event("ADDED", job("a"))
    assert cache.progress((NS, "a")) is None
    cache.pod_event("ADDED", pod("a", 0, **{contract.PROGRESS_ANNOTATION: report}))
    progress = cache.progress((NS, "a"))
    assert progress is not None and progress.step == 7
    cache.job_event("MODIFIED", job("a", rv=2, generation=1))  # worker 0 is of generation 0
    assert cache.progress((NS, "a")) is None
    cache.job_event("MODIFIED", job("a", rv=3))
    cache.pod_event("MODIFIED", pod("a", 0, rv=2, **{contract.PROGRESS_ANNOTATION: "{not json"}))
    assert cache.progress((NS, "a")) is None


def test_the_controller_forgets_a_deleted_job_everywhere() -> None:
    ctl = Controller(client.ApiClient(), OperatorSettings(), clock=lambda: NOW)
    try:
        key = (NS, "a")
        ctl.job_event("ADDED", job("a"))
        ctl.pod_event("ADDED", pod("a", 0))
        ctl.queue.add_after(("team", "b"), 30.0)
        ctl.job_event("ADDED", job("b"))  # queued now: the delay is superseded
        ctl.queue.set_leading(True)
        assert ctl.queue.take() == key
        ctl.first_running.add(key)
        ctl.job_event("DELETED", job("a"))
        ctl.pod_event("DELETED", pod("a", 0, rv=2))
        ctl.queue.done(key, requeue_after=30.0)  # the reconcile that was running when it went
        assert ctl.cache.job(key) is None and ctl.cache.pods(key) == []
        assert key not in ctl.queue and key not in ctl.first_running
        assert ctl.cache.size() == 1  # job b alone
    finally:
        ctl.applier.close()


def test_the_watchs_echo_of_the_operators_own_status_write_plans_nothing_again() -> None:
    ctl = Controller(client.ApiClient(), OperatorSettings(), clock=lambda: NOW)
    try:
        key = (NS, "a")
        ctl.job_event(None, job("a", rv=4))  # the first listing
        ctl.queue.set_leading(True)
        assert ctl.queue.take() == key
        ctl.applier.cache_job(key, job("a", rv=5, generation=1))  # the status write's response
        ctl.queue.done(key, requeue_after=None)
        ctl.job_event("MODIFIED", job("a", rv=5, generation=1))  # its echo
        assert key not in ctl.queue
        ctl.job_event("MODIFIED", job("a", rv=6, generation=1))  # someone else's change
        assert key in ctl.queue
    finally:
        ctl.applier.close()


def test_a_pod_event_that_only_moves_a_worker_on_towards_running_waits_in_proportion_to_planning() -> None:
    ctl = Controller(client.ApiClient(), OperatorSettings(), clock=lambda: NOW)
    try:
        key = (NS, "a")
        ctl.job_event(None, job("a"))
        ctl.queue.set_leading(True)
        assert ctl.queue.take() == key
        ctl.queue.done(key, requeue_after=None)
        ctl.paces[key] = pace(0.01)  # what planning a 1024-worker gang costs
        started = pod("a", 0, rv=2, node="n1") | {"status": {"phase": "Running"}}
        ctl.pod_event("MODIFIED", started)
        assert len(ctl.queue) == 0
        assert ctl.queue.due_in(key) == pytest.approx(0.2, abs=0.05)
        ctl.pod_event("MODIFIED", pod("a", 1, rv=3, node="n1") | {"status": {"phase": "Failed"}})
        assert len(ctl.queue) == 1 and ctl.queue.due_in(key) is None  # a failure is planned at once
        assert ctl.queue.take() == key
        ctl.queue.done(key, requeue_after=None)
        ctl.pod_event("DELETED", started | {"metadata": {**started["metadata"], "resourceVersion": "4"}})
        assert len(ctl.queue) == 1  # so is a pod gone
    finally:
        ctl.applier.close()


def test_the_pause_grows_with_planning_up_to_its_cap_and_a_small_job_barely_waits() -> None:
    assert pace(0.0002) == pytest.approx(0.004)  # a 2-worker job's plan
    assert pace(0.02) == pytest.approx(0.4)
    assert pace(10.0) == PACE_MAX


def owned(p: dict[str, Any], uid: str) -> dict[str, Any]:
    p["metadata"]["ownerReferences"] = [{"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                                         "name": p["metadata"]["labels"][contract.LABEL_JOB], "uid": uid}]
    return p


def job_uid(name: str, uid: str, rv: int = 1) -> dict[str, Any]:
    body = job(name, rv)
    body["metadata"]["uid"] = uid
    return body


def test_only_pods_the_job_owns_by_uid_are_kept_under_it() -> None:
    cache = WatchCache()
    cache.job_event("ADDED", job_uid("a", "new"))
    assert cache.pod_event("ADDED", owned(pod("a", 0), "old")) is None  # the deleted predecessor's, GC'd soon
    assert cache.pod_event("ADDED", pod("a", 1)) is None  # made by someone else with the job's labels
    assert cache.pod_event("ADDED", owned(pod("a", 2), "new")) == (NS, "a")
    assert [p["metadata"]["name"] for p in cache.pods((NS, "a"))] == ["a-worker-2"]
    live = {"a-worker-0": owned(pod("a", 0), "old"), "a-worker-2": owned(pod("a", 2), "new")}
    assert not cache.replace_pods((NS, "a"), live, NOW)  # a live read keeps the same ones
    assert [p["metadata"]["name"] for p in cache.pods((NS, "a"))] == ["a-worker-2"]


def test_a_job_created_again_under_its_name_starts_from_nothing() -> None:
    cache = WatchCache()
    cache.job_event("ADDED", job_uid("a", "old"))
    cache.pod_event("ADDED", owned(pod("a", 0), "old"))
    cache.set_create_refused((NS, "a"), "exceeded quota")
    cache.job_event("MODIFIED", job_uid("a", "old", rv=1))
    assert cache.create_refused((NS, "a")) == "exceeded quota"
    cache.job_event("ADDED", job_uid("a", "new", rv=5))  # its predecessor's DELETED event was missed
    assert cache.pods((NS, "a")) == [] and cache.create_refused((NS, "a")) is None
    cache.job_event("MODIFIED", job_uid("a", "old", rv=4))  # a late copy of the old job changes nothing
    assert cache.job((NS, "a"))["metadata"]["uid"] == "new"


def test_refusals_and_foreign_objects_are_kept_per_job_and_forgotten_with_it() -> None:
    cache = WatchCache()
    key = (NS, "a")
    cache.set_create_refused(key, "ignored: no such job")
    assert cache.create_refused(key) is None and cache.foreign(key) is None
    cache.job_event("ADDED", job_uid("a", "u"))
    cache.set_create_refused(key, 'pods "a-worker-1" is forbidden: exceeded quota')
    cache.set_foreign(key, "Pod a-worker-1")
    assert (cache.create_refused(key), cache.foreign(key)) == ('pods "a-worker-1" is forbidden: exceeded quota',
                                                               "Pod a-worker-1")
    cache.set_foreign(key, None)
    assert cache.foreign(key) is None
    cache.job_event("DELETED", job_uid("a", "u"))
    assert cache.create_refused(key) is None


def test_a_foreign_pods_events_requeue_the_job_only_while_it_holds_a_name_the_job_needs() -> None:
    cache = WatchCache()
    cache.job_event("ADDED", job_uid("a", "u"))
    stranger = pod("a", 1)
    assert cache.pod_event("MODIFIED", stranger) is None
    cache.set_foreign((NS, "a"), "Pod a-worker-1")
    assert cache.pod_event("DELETED", stranger) == (NS, "a")  # the name is free: look again now
    assert cache.pods((NS, "a")) == [] and cache.size() == 1


def workload(job_name: str, rv: int, owner_uid: str | None = None, name: str = "wl") -> dict[str, Any]:
    meta: dict[str, Any] = {"namespace": NS, "name": name, "resourceVersion": str(rv),
                            "labels": {contract.LABEL_JOB: job_name}}
    if owner_uid:
        meta["ownerReferences"] = [{"uid": owner_uid}]
    return {"metadata": meta}


def test_a_jobs_workload_is_kept_newest_first_and_only_when_the_job_owns_it() -> None:
    cache = WatchCache()
    assert cache.workload_event("ADDED", workload("a", 3)) is None  # no such job yet
    cache.job_event("ADDED", {**job("a"), "metadata": {**job("a")["metadata"], "uid": "u1"}})
    assert cache.workload_event("ADDED", workload("a", 3, owner_uid="someone-else")) is None
    cache.set_kueue_missing((NS, "a"), True)
    cache.set_workload_foreign((NS, "a"), "Workload w exists and is not owned by this TrainingJob")
    assert cache.workload_foreign((NS, "a")) is not None
    assert cache.workload_event("ADDED", workload("a", 3, owner_uid="u1")) == (NS, "a")
    assert not cache.kueue_missing((NS, "a"))  # a Workload seen: Kueue serves the kind
    assert cache.workload_foreign((NS, "a")) is None  # and the job's own now holds its name
    cache.workload_event("MODIFIED", workload("a", 2, owner_uid="u1"))  # stale
    assert cache.workload((NS, "a"))["metadata"]["resourceVersion"] == "3"  # type: ignore[index]
    cache.workload_event("DELETED", workload("a", 4, owner_uid="u1", name="other"))  # not the one kept
    assert cache.workload((NS, "a")) is not None
    cache.workload_event("DELETED", workload("a", 4, owner_uid="u1"))
    assert cache.workload((NS, "a")) is None


def test_the_cache_keeps_no_managed_fields() -> None:
    """The field managers' bookkeeping is never read; with thousands of pods it was memory for nothing."""
    fields = [{"manager": "kubelet", "operation": "Update", "fieldsV1": {"f:status": {}}}]
    cache = WatchCache()
    cache.job_event("ADDED", {**job("a"), "metadata": {**job("a")["metadata"], "managedFields": fields}})
    watched, live = pod("a", 0, rv=2), pod("a", 1, rv=2)
    watched["metadata"]["managedFields"] = live["metadata"]["managedFields"] = fields
    cache.pod_event("ADDED", watched)
    cache.replace_pods((NS, "a"), {"a-worker-0": watched, "a-worker-1": live}, NOW)
    kept = [cache.job((NS, "a")), *cache.pods((NS, "a"))]
    assert len(kept) == 3 and all("managedFields" not in o["metadata"] for o in kept)
    assert cache.pod((NS, "a"), "a-worker-1")["metadata"]["labels"][contract.LABEL_JOB] == "a"  # the rest stays


def test_the_cache_keeps_of_a_pods_spec_only_its_node_and_restart_policy() -> None:
    """The operator wrote the containers and volumes itself and reads only where the pod runs and whether
    the kubelet restarts its failed container."""
    cache = WatchCache()
    cache.job_event("ADDED", job("a"))
    containers = [{"name": "trainer", "image": "t", "env": [{"name": "RANK", "value": "0"}]}]
    placed, pending = pod("a", 0, node="n1"), pod("a", 1)
    placed["spec"]["containers"] = pending["spec"]["containers"] = containers
    placed["spec"]["restartPolicy"] = "OnFailure"
    cache.pod_event("ADDED", placed)
    cache.pod_event("ADDED", pending)
    assert [p["spec"] for p in cache.pods((NS, "a"))] == [{"nodeName": "n1", "restartPolicy": "OnFailure"}, {}]
    assert cache.nodes_of((NS, "a")) == {"n1"}


def test_a_relist_reports_the_pods_it_lacks_as_deleted_but_keeps_those_newer_than_itself() -> None:
    ctl = Controller(client.ApiClient(), OperatorSettings(), clock=lambda: NOW)
    try:
        key = (NS, "a")
        ctl.job_event(None, job("a"))
        for index, rv in ((0, 5), (1, 6), (2, 12)):  # worker 2 was cached from a create answered after the LIST
            ctl.pod_event("ADDED", pod("a", index, rv=rv))
        ctl.queue.set_leading(True)
        assert ctl.queue.take() == key
        ctl.queue.done(key, requeue_after=None)
        ctl.pods_listed(PodList([pod("a", 0, rv=7)], "10"))  # worker 1's DELETED fell in a gap of the watch
        assert {p["metadata"]["name"]: p["metadata"]["resourceVersion"] for p in ctl.cache.pods(key)} == \
            {"a-worker-0": "7", "a-worker-2": "12"}
        assert key in ctl.queue
        ctl.pod_event("MODIFIED", pod("a", 1, rv=6))  # a stale copy does not bring it back
        assert ctl.cache.pod(key, "a-worker-1") is None
    finally:
        ctl.applier.close()


def test_a_relist_forgets_the_jobs_and_nodes_it_no_longer_holds_but_not_newer_ones() -> None:
    cache = WatchCache()
    for name, rv in (("kept", 5), ("deleted", 6), ("newer", 12)):
        cache.job_event("ADDED", job(name, rv))
    listed = [job("kept", 5)]
    assert cache.jobs_missing_from(listed, "10") == [(NS, "deleted")]  # "newer" was made after the list
    cache.node_event("MODIFIED", node("n1", ready=False), NOW)
    cache.node_event("MODIFIED", node("gone", ready=False), NOW)
    assert cache.nodes_missing_from([node("n1", ready=False)]) == ["gone"]
    assert cache.node_names == {"n1"}


def test_the_cache_counts_every_node_it_was_told_of() -> None:
    cache = WatchCache()
    for name, ready in (("n1", True), ("n2", False), ("n3", True)):
        cache.node_event("ADDED", node(name, ready=ready), NOW)
    assert (cache.node_names, set(cache.nodes)) == ({"n1", "n2", "n3"}, {"n2"})  # NotReady ones only in nodes
    cache.node_event("DELETED", node("n3", ready=True), NOW)
    assert cache.node_names == {"n1", "n2"}


def test_a_list_is_read_page_by_page_and_keeps_its_snapshots_version() -> None:
    pages = {None: {"items": [{"n": 1}, {"n": 2}], "metadata": {"continue": "p2", "resourceVersion": "7"}},
             "p2": {"items": [{"n": 3}], "metadata": {"resourceVersion": "7"}}}
    calls: list[dict[str, Any]] = []

    def call(*args: Any, **kw: Any) -> dict[str, Any]:
        calls.append(kw)
        return pages[kw.get("_continue")]

    items, version = list_pages(call, "ns", label_selector="x")
    assert (items, version) == ([{"n": 1}, {"n": 2}, {"n": 3}], "7")
    assert [c.get("_continue") for c in calls] == [None, "p2"]
    assert all(c["limit"] == LIST_PAGE and c["label_selector"] == "x" for c in calls)


def test_a_progress_step_keeps_the_time_it_was_first_seen() -> None:
    cache = WatchCache()
    cache.job_event("ADDED", job("a"))
    first = Progress(step=10, generation=0)
    assert cache.progress_seen((NS, "a"), first, NOW) == NOW
    assert cache.progress_seen((NS, "a"), first, NOW + timedelta(seconds=20)) == NOW  # the same step
    later = NOW + timedelta(seconds=30)
    assert cache.progress_seen((NS, "a"), Progress(step=11, generation=0), later) == later
    assert cache.progress_seen((NS, "a"), Progress(step=11, generation=1), later + timedelta(seconds=1)) == \
        later + timedelta(seconds=1)  # a new generation's report is new even at the same step
    assert cache.progress_seen((NS, "a"), None, NOW) is None
