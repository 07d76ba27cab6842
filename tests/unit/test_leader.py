"""The Lease decision of leader election (kubetrain.operator.runtime.leader), as pure functions."""

from __future__ import annotations

from datetime import UTC, datetime

from kubetrain.operator.runtime.leader import Action, Observation, lease_body, next_step

NOW = datetime(2026, 11, 22, 12, 0, 0, tzinfo=UTC)


def lease(holder: str, version: str, duration: int = 15, transitions: int = 0) -> dict:
    return {"metadata": {"name": "kubetrain-operator", "namespace": "ops", "resourceVersion": version},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": duration, "leaseTransitions": transitions,
                     "renewTime": "2026-11-22T11:59:59.000000Z"}}


def test_no_lease_is_created_with_us_as_holder() -> None:
    action, seen = next_step(None, None, "a", now=100.0, duration=15)
    assert (action, seen) == (Action.CREATE, None)
    body = lease_body(None, action, "a", 15, NOW)
    assert body["spec"] == {"holderIdentity": "a", "leaseDurationSeconds": 15, "leaseTransitions": 0,
                            "acquireTime": "2026-11-22T12:00:00.000000Z", "renewTime": "2026-11-22T12:00:00.000000Z"}


def test_our_own_lease_is_renewed_keeping_its_version_for_optimistic_concurrency() -> None:
    current = lease("a", "7", transitions=3)
    action, _ = next_step(current, None, "a", now=100.0, duration=15)
    assert action == Action.RENEW
    body = lease_body(current, action, "a", 15, NOW)
    assert body["metadata"]["resourceVersion"] == "7"
    assert body["spec"]["leaseTransitions"] == 3 and "acquireTime" not in body["spec"]
    assert body["spec"]["renewTime"] == "2026-11-22T12:00:00.000000Z"


def test_a_live_holder_is_waited_for_by_our_own_clock_not_its_timestamps() -> None:
    first, seen = next_step(lease("b", "7"), None, "a", now=100.0, duration=15)
    assert first == Action.WAIT and seen == Observation("b", "7", 100.0)
    # the holder's renewTime is in the past (clock skew does not matter): only a lack of change does
    action, seen2 = next_step(lease("b", "7"), seen, "a", now=114.9, duration=15)
    assert action == Action.WAIT and seen2 == seen
    # a renewal (new resourceVersion) restarts our count
    action, seen3 = next_step(lease("b", "8"), seen2, "a", now=114.9, duration=15)
    assert action == Action.WAIT and seen3 == Observation("b", "8", 114.9)
    action, _ = next_step(lease("b", "8"), seen3, "a", now=129.8, duration=15)
    assert action == Action.WAIT


def test_an_expired_lease_is_taken_over_with_a_transition() -> None:
    _, seen = next_step(lease("b", "7", transitions=2), None, "a", now=100.0, duration=15)
    action, _ = next_step(lease("b", "7", transitions=2), seen, "a", now=115.0, duration=15)
    assert action == Action.ACQUIRE
    body = lease_body(lease("b", "7", transitions=2), action, "a", 15, NOW)
    assert body["spec"]["holderIdentity"] == "a" and body["spec"]["leaseTransitions"] == 3
    assert body["spec"]["acquireTime"] == body["spec"]["renewTime"]


def test_the_longer_of_our_and_the_holders_duration_applies() -> None:
    _, seen = next_step(lease("b", "7", duration=60), None, "a", now=100.0, duration=15)
    assert next_step(lease("b", "7", duration=60), seen, "a", now=130.0, duration=15)[0] == Action.WAIT
    assert next_step(lease("b", "7", duration=60), seen, "a", now=160.0, duration=15)[0] == Action.ACQUIRE


def test_a_released_lease_is_taken_at_once() -> None:
    action, _ = next_step(lease("", "9", duration=1), None, "a", now=100.0, duration=15)
    assert action == Action.ACQUIRE
