"""Per-pod facts (kubetrain.operator.jobs.pod_facts): read once per version of a pod, never stale."""

from __future__ import annotations

from typing import Any

import pytest

from kubetrain.core import contract
from kubetrain.core.hangs import HangReport, RankReport
from kubetrain.core.lifecycle import FailureKind, WorkerPhase, policies
from kubetrain.operator.jobs import builders as b
from kubetrain.operator.jobs import plan, pod_facts
from kubetrain.operator.jobs.pod_facts import facts


def pod(rv: str | None, phase: str = "Running", index: int = 3) -> dict[str, Any]:
    meta: dict[str, Any] = {"namespace": "team", "name": f"j-worker-{index}",
                            "labels": {contract.LABEL_JOB: "j", b.LABEL_INDEX: str(index), b.LABEL_GENERATION: "2"}}
    if rv is not None:
        meta["resourceVersion"] = rv
    return {"metadata": meta, "spec": {"nodeName": "n1"}, "status": {"phase": phase}}


def test_a_pod_version_is_read_once_and_a_new_version_afresh() -> None:
    first = facts(pod("11"))
    assert (first.index, first.generation, first.phase, first.node, first.running) == (
        3, 2, WorkerPhase.RUNNING, "n1", True)
    assert facts(pod("11")) is first
    failed = pod("12", "Failed")
    failed["status"]["containerStatuses"] = [
        {"name": b.CONTAINER, "state": {"terminated": {"exitCode": 137, "reason": "Error"}}}]
    later = facts(failed)
    assert (later.phase, later.exit_code, later.running) == (WorkerPhase.FAILED, 137, False)


def test_a_pod_marked_deleting_under_the_same_version_is_read_again() -> None:
    """The operator marks a pod it deleted as terminating before the watch says so."""
    p = pod("21")
    assert facts(p).phase == WorkerPhase.RUNNING
    p["metadata"]["deletionTimestamp"] = "2026-11-22T12:00:00Z"
    assert (facts(p).phase, facts(p).reason) == (WorkerPhase.MISSING, "Deleted")


def test_a_pod_without_a_version_is_read_every_time() -> None:
    p = pod(None, "Pending")
    assert facts(p).pending
    p["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    assert (facts(p).pending, facts(p).ready) == (False, True)


def test_the_memo_forgets_everything_when_full(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pod_facts, "MEMO_LIMIT", 2)
    monkeypatch.setattr(pod_facts, "_memo", {})
    kept = facts(pod("31"))
    facts(pod("32"))
    facts(pod("33"))
    assert len(pod_facts._memo) == 1 and facts(pod("31")) is not kept and facts(pod("31")) == kept


# ------------------------------------------------------------------ a worker the kubelet restarts in its pod

TERM_137 = {"exitCode": 137, "reason": "Error"}


def in_pod(rv: str, restarts: int, state: dict[str, Any], last: dict[str, Any] | None = None,
           handled: int | None = None) -> dict[str, Any]:
    """A pod with restartPolicy OnFailure whose trainer container restarted `restarts` times."""
    p = pod(rv)
    p["spec"]["restartPolicy"] = "OnFailure"
    cs: dict[str, Any] = {"name": b.CONTAINER, "restartCount": restarts, "state": state}
    if last is not None:
        cs["lastState"] = {"terminated": last}
    p["status"]["containerStatuses"] = [cs]
    if handled is not None:
        p["metadata"]["annotations"] = {contract.FAILURES_HANDLED_ANNOTATION: str(handled)}
    return p


def test_a_first_failure_in_a_pod_that_restarts_it_is_the_same_before_and_after_the_restart() -> None:
    """The kubelet reports the exit, then the restarted container: one failure, and the pod stays."""
    for p in (in_pod("41", 0, {"terminated": TERM_137}), in_pod("42", 1, {"running": {}}, TERM_137)):
        f = facts(p)
        assert (f.phase, f.exit_code, f.failures, f.restartable, f.running) == (
            WorkerPhase.FAILED, 137, 1, True, True)


def test_a_failure_the_operator_acted_on_leaves_the_worker_running() -> None:
    for p in (in_pod("43", 0, {"terminated": TERM_137}, handled=1),
              in_pod("44", 1, {"running": {}}, TERM_137, handled=1)):
        f = facts(p)
        assert (f.phase, f.failures, f.restartable, f.running) == (WorkerPhase.RUNNING, 1, False, True)


@pytest.mark.parametrize("p", [
    in_pod("45", 1, {"terminated": {"exitCode": 1, "reason": "Error"}}, TERM_137, handled=1),  # its second
    in_pod("46", 2, {"waiting": {"reason": "CrashLoopBackOff"}}, {"exitCode": 1}, handled=1),  # backing off
])
def test_a_later_failure_in_the_same_pod_is_not_restarted_there(p: dict[str, Any]) -> None:
    """The kubelet backs off a second restart (10 s, then doubling): the pod is recreated instead."""
    f = facts(p)
    assert (f.phase, f.exit_code, f.failures, f.restartable) == (WorkerPhase.FAILED, 1, 2, False)


def test_a_later_failure_after_ten_minutes_of_running_is_restarted_there() -> None:
    """The kubelet's back-off for a container expires once it ran twice the 300 s cap: a failure after that is
    restarted at once again, as the first one was."""
    ran = {"exitCode": 1, "reason": "Error", "startedAt": "2026-03-01T11:00:00Z", "finishedAt": "2026-03-01T11:10:06Z"}
    f = facts(in_pod("52", 1, {"terminated": ran}, TERM_137, handled=1))
    assert (f.phase, f.failures, f.restartable) == (WorkerPhase.FAILED, 2, True)
    short = {**ran, "finishedAt": "2026-03-01T11:09:00Z"}
    assert not facts(in_pod("53", 1, {"terminated": short}, TERM_137, handled=1)).restartable


def test_success_after_a_restart_in_the_pod_is_success_and_an_oom_kill_says_so() -> None:
    done = facts(in_pod("47", 1, {"terminated": {"exitCode": 0, "reason": "Completed"}}, TERM_137, handled=1))
    assert (done.phase, done.failures, done.running) == (WorkerPhase.SUCCEEDED, 0, False)
    oom = facts(in_pod("48", 0, {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}))
    assert (oom.phase, oom.reason, oom.restartable) == (WorkerPhase.FAILED, "OOMKilled", True)


def test_without_restart_policy_on_failure_a_terminated_trainer_is_a_failure_of_its_pod() -> None:
    p = in_pod("49", 0, {"terminated": TERM_137})
    p["spec"]["restartPolicy"] = "Never"
    f = facts(p)
    assert (f.phase, f.exit_code, f.failures, f.restartable, f.running) == (WorkerPhase.FAILED, 137, 0, False, False)


def test_an_init_container_that_keeps_failing_fails_the_worker() -> None:
    """With restartPolicy Never the pod would fail; OnFailure retries it for ever, so the operator says so."""
    p = pod("50", "Pending")
    p["spec"]["restartPolicy"] = "OnFailure"
    p["status"]["initContainerStatuses"] = [{"name": "fetch", "restartCount": 2, "state": {
        "waiting": {"reason": "CrashLoopBackOff"}}, "lastState": {"terminated": {"exitCode": 4}}}]
    f = facts(p)
    assert (f.phase, f.exit_code, f.reason, f.restartable) == (WorkerPhase.FAILED, 4, "InitContainerFailed", False)
    p["metadata"]["deletionTimestamp"] = "2026-11-27T03:00:00Z"
    assert (facts(p).phase, facts(p).reason) == (WorkerPhase.MISSING, "Deleted")  # going, whatever it was doing
    del p["metadata"]["deletionTimestamp"]
    p["status"]["initContainerStatuses"][0]["state"] = {"running": {}}  # a native sidecar that came back
    p["metadata"]["resourceVersion"] = "51"
    assert facts(p).phase == WorkerPhase.PENDING


def test_a_pod_of_the_same_name_and_version_but_another_uid_is_read_afresh() -> None:
    """Versions are per object: a pod recreated under the same name (or built by a test) is another."""
    first = pod("61")
    first["metadata"]["uid"] = "u-1"
    assert facts(first).phase == WorkerPhase.RUNNING
    second = pod("61", "Failed")
    second["metadata"]["uid"] = "u-2"
    assert facts(second).phase == WorkerPhase.FAILED


def hung(generation: int | None) -> dict[str, Any]:
    """A launcher's exit 124 with its hang report, which names the generation its ranks ran."""
    report = HangReport(7, 40.0, 30.0, (RankReport(1, 7, "stopped (SIGSTOP)", "main (t.py:3)"),), "/d", 1.0, generation)
    return {"exitCode": contract.HUNG_EXIT_CODE, "reason": "Error", "message": report.encode()}


def test_a_hang_reported_for_the_generation_before_the_pods_is_not_a_failure_of_the_new_one() -> None:
    """Both workers' launchers report one hang; the first restarts the gang in place (this pod is relabelled
    generation 2) and the second report, of generation 1, comes after: the kubelet restarts the container,
    whose launcher runs generation 2. Counting that exit would restart the gang a second time."""
    for p in (in_pod("60", 0, {"terminated": hung(1)}), in_pod("61", 1, {"running": {}}, hung(1))):
        f = facts(p)
        assert (f.phase, f.failures, f.restartable, f.running, f.hang) == (WorkerPhase.RUNNING, 1, False, True, None)
    for report_gen in (2, None):  # its own generation's hang, or a launcher that does not say
        f = facts(in_pod(f"62-{report_gen}", 0, {"terminated": hung(report_gen)}))
        assert (f.phase, f.exit_code, f.restartable) == (WorkerPhase.FAILED, contract.HUNG_EXIT_CODE, True)
        assert f.hang is not None and f.hang.generation == report_gen and f.hang.ranks[0].rank == 1


def test_a_configuration_error_reaches_the_failure_message_and_nothing_else_is_read_as_one() -> None:
    """The trainer writes its configuration error (exit 2) to the termination message; the message the job's
    status and Event carry then names the field. Other exits' messages are not taken for one."""
    said = "configuration error: checkpoint.uri: bucket 'nope' does not exist (s3://nope/ckpt)"
    term = {"exitCode": contract.CONFIG_ERROR_EXIT_CODE, "reason": "Error", "message": f"{said}\n"}
    for p in (in_pod("70", 0, {"terminated": term}), in_pod("71", 1, {"running": {}}, term)):
        assert facts(p).said == said
    worker = plan.worker_state(1, in_pod("72", 0, {"terminated": term}), {})
    assert policies.describe(worker, FailureKind.PERMANENT_EXIT_CODE) == f"worker 1 exited with code 2 ({said})"
    other = facts(in_pod("73", 0, {"terminated": {**TERM_137, "message": "whatever the command printed"}}))
    assert other.said is None


def test_only_a_running_fetch_init_container_is_fetching_and_its_failure_is_named() -> None:
    def with_inits(rv: str, phase: str, **states: dict[str, Any]) -> dict[str, Any]:
        p = pod(rv, phase)
        p["spec"]["restartPolicy"] = "Never"
        p["status"]["initContainerStatuses"] = [{"name": n, "state": s} for n, s in states.items()]
        return p

    running = {"running": {"startedAt": "2026-11-28T10:00:00Z"}}
    f = facts(with_inits("80", "Pending", **{"tcpx-daemon": running, contract.FETCH_CONTAINER: running}))
    assert (f.phase, f.pending, f.fetching, f.failed_in) == (WorkerPhase.PENDING, True, True, None)
    assert not facts(with_inits("81", "Pending", **{"tcpx-daemon": running})).fetching  # a sidecar starting
    done = with_inits("82", "Running", **{contract.FETCH_CONTAINER: {"terminated": {"exitCode": 0}}})
    assert not facts(done).fetching
    said = "configuration error: data.tokenizerUri: s3://tok/x: access denied"
    failed = with_inits("83", "Failed", **{contract.FETCH_CONTAINER: {"terminated": {
        "exitCode": contract.CONFIG_ERROR_EXIT_CODE, "reason": "Error", "message": said}}})
    f = facts(failed)
    assert (f.phase, f.exit_code, f.failed_in, f.said, f.fetching) == (
        WorkerPhase.FAILED, contract.CONFIG_ERROR_EXIT_CODE, contract.FETCH_CONTAINER, said, False)
    failed["status"]["reason"] = "Evicted"  # the kubelet's own reason for the pod wins over its containers' exits
    failed["metadata"]["resourceVersion"] = "84"
    assert (facts(failed).reason, facts(failed).failed_in) == ("Evicted", None)


def test_a_kept_worker_that_stopped_answering_its_probe_after_starting_lost_its_peers() -> None:
    def probed(rv: str, ready: bool, since: str, started: str = "2026-01-01T00:00:10Z") -> dict[str, Any]:
        p = in_pod(rv, 0, {"running": {"startedAt": started}})
        p["status"]["containerStatuses"][0]["ready"] = ready
        p["status"]["conditions"] = [{"type": "Ready", "status": str(ready), "lastTransitionTime": since}]
        p["spec"]["containers"] = [{"name": b.CONTAINER, "env": [{"name": contract.GANG_PROBE_PORT, "value": "29499"}]}]
        return p

    assert facts(probed("1", False, "2026-01-01T00:01:00Z")).peers_lost_since == contract.parse_time(
        "2026-01-01T00:01:00Z")
    assert facts(probed("2", True, "2026-01-01T00:00:11Z")).peers_lost_since is None
    assert facts(probed("3", False, "2026-01-01T00:00:05Z")).peers_lost_since is None  # not Ready yet as it starts
    again = probed("4", False, "2026-01-01T00:01:00Z", started="2026-01-01T00:01:30Z")
    assert facts(again).peers_lost_since is None  # a container started again since: a new one
    never = probed("5", False, "2026-01-01T00:01:00Z")
    never["spec"]["restartPolicy"] = "Never"  # no in-place restarts: no launcher waits, no probe
    assert facts(never).peers_lost_since is None
    theirs = probed("6", False, "2026-01-01T00:01:00Z")
    theirs["spec"]["containers"][0]["env"] = []  # a readinessProbe of the job's own: not Ready says nothing of peers
    assert facts(theirs).peers_lost_since is None
