"""What `kubetrain suspend` / `resume` print once they have watched the job: the phase it reached and, for a
queued job, Kueue's word; a request that has not taken effect yet says so instead of claiming it did."""

from __future__ import annotations

from typing import Any

from kubetrain.core.api import TrainingJob
from kubetrain.core.kube_cli import outcome_line


def job(phase: str, admitted: tuple[str, str, str] | None = None) -> TrainingJob:
    status: dict[str, Any] = {"phase": phase}
    if admitted is not None:
        value, reason, message = admitted
        status["conditions"] = [{"type": "Admitted", "status": value, "reason": reason, "message": message,
                                 "lastTransitionTime": "2026-11-29T12:00:00Z"}]
    return TrainingJob.model_validate({"apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
                                       "metadata": {"name": "j", "namespace": "ns"}, "spec": {}, "status": status})


DEACTIVATED = ("False", "Deactivated", "Workload trainingjob-j-abcde deactivated: the job is suspended")


def test_a_suspend_that_took_effect_says_suspended_with_the_queues_word() -> None:
    assert outcome_line(job("Suspended", DEACTIVATED), True, 30) == (
        "trainingjob.kubetrain.io/j suspended (phase Suspended; Kueue: Deactivated: Workload trainingjob-j-abcde "
        "deactivated: the job is suspended)")


def test_a_suspend_not_yet_in_effect_says_requested_and_where_the_job_is() -> None:
    line = outcome_line(job("Running"), True, 30)
    assert line.startswith("trainingjob.kubetrain.io/j suspend requested (spec.suspend: true); phase still Running "
                           "after 30s") and "kubetrain describe j" in line


def test_a_resumed_job_waiting_in_its_queue_is_resumed_and_says_so() -> None:
    queued = ("False", "Queued", "Workload trainingjob-j-abcde in LocalQueue q: waiting for Kueue to admit it")
    assert outcome_line(job("Suspended", queued), False, 30) == (
        "trainingjob.kubetrain.io/j resumed (phase Suspended; Kueue: Queued: Workload trainingjob-j-abcde in "
        "LocalQueue q: waiting for Kueue to admit it)")
    assert outcome_line(job("Running"), False, 30) == "trainingjob.kubetrain.io/j resumed (phase Running)"


def test_a_resume_still_deactivated_is_only_requested() -> None:
    assert "resume requested (spec.suspend: false); phase still Suspended" in outcome_line(
        job("Suspended", DEACTIVATED), False, 30)
