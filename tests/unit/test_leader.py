"""Leader election (kubetrain.operator.runtime.leader): the Lease decision as pure functions, and the elector's
loop with its Lease calls faked."""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import UTC, datetime
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from kubetrain.operator.runtime.leader import Action, LeaderElector, Observation, lease_body, next_step
from kubetrain.operator.runtime.settings import LeaderElection

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


# --------------------------------------------------------------------------- the elector's loop (Lease calls faked)


def _elector(rounds: list[bool], on_start: Any, calls: list[str], renew_deadline: float = 10.0) -> LeaderElector:
    """An elector whose rounds answer `rounds` in turn (held or not), then not held; faked: the API server.
    Every round is appended to `calls` as "round"."""
    election = LeaderElection(namespace="ops", identity="a", renew_deadline=renew_deadline, retry=0.01)
    elector = LeaderElector(client.ApiClient(), election, on_start, lambda: calls.append("stop"))
    answers = iter(rounds)

    def round_() -> bool:
        calls.append("round")
        return next(answers, False)

    elector.try_once = round_  # type: ignore[method-assign]
    return elector


def test_a_takeover_that_fails_is_tried_again_while_the_lease_is_renewed() -> None:
    calls: list[str] = []

    async def on_start() -> None:
        calls.append("start")
        if calls.count("start") == 1:
            raise TimeoutError("LIST of pods timed out")
        await asyncio.sleep(0.05)  # a slow fill: the lease is renewed meanwhile
        calls.append("started")

    async def scenario() -> None:
        elector = _elector([True] * 40, on_start, calls)
        elector.start()
        await asyncio.sleep(0.3)
        assert elector.leading and elector.takeover is not None and elector.takeover.done()
        assert elector.task is not None
        elector.task.cancel()  # not release(): that would write the Lease
        with contextlib.suppress(asyncio.CancelledError):
            await elector.task

    asyncio.run(scenario())
    assert calls.count("start") == 2 and "started" in calls and "stop" not in calls
    fill = calls[calls.index("start", calls.index("start") + 1):calls.index("started")]
    assert fill.count("round") >= 2  # renewals went on during the second, slow fill


def test_a_lost_lease_stops_the_controller_before_the_takeover_is_cancelled() -> None:
    calls: list[str] = []
    cancelled: list[str] = []

    async def on_start() -> None:
        try:
            await asyncio.sleep(10)  # a fill that never ends
        except asyncio.CancelledError:
            cancelled.append("stop" if "stop" in calls else "before stop")
            raise

    async def scenario() -> None:
        elector = _elector([True], on_start, calls, renew_deadline=0.05)
        elector.start()
        assert elector.task is not None
        while "stop" not in calls:
            await asyncio.sleep(0.01)
        assert not elector.leading and elector.takeover is not None
        with contextlib.suppress(asyncio.CancelledError):
            await elector.takeover
        assert not elector.task.done()  # a standby again, not gone
        elector.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await elector.task

    asyncio.run(scenario())
    assert calls.count("stop") == 1 and cancelled == ["stop"]


def test_a_replica_that_lost_the_lease_leads_again_when_it_holds_it() -> None:
    calls: list[str] = []

    async def on_start() -> None:
        calls.append("start")

    async def scenario() -> None:
        # held, then 20 rounds not (an API server stalled past the renew deadline), then held again
        elector = _elector([True, *[False] * 20, True, True, True], on_start, calls, renew_deadline=0.05)
        elector.start()
        while calls.count("start") < 2:
            await asyncio.sleep(0.01)
        assert elector.leading and elector.task is not None
        elector.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await elector.task

    asyncio.run(asyncio.wait_for(scenario(), 5))
    assert [c for c in calls if c != "round"] == ["start", "stop", "start"]


def test_each_lease_call_is_bounded_by_half_the_renew_deadline() -> None:
    seen: list[Any] = []

    class Api:
        def read_namespaced_lease(self, name: str, ns: str, **kw: Any) -> None:
            seen.append(kw["_request_timeout"])
            raise ApiException(status=404)

        def create_namespaced_lease(self, ns: str, body: Any, **kw: Any) -> None:
            seen.append(kw["_request_timeout"])

    election = LeaderElection(namespace="ops", identity="a", renew_deadline=10.0)
    elector = LeaderElector(client.ApiClient(), election, lambda: asyncio.sleep(0), lambda: None)
    elector.api = Api()  # type: ignore[assignment]
    assert elector.try_once() is True
    assert seen == [5.0, 5.0]


def test_lease_calls_are_never_retried_by_the_http_pool() -> None:
    base = client.Configuration(host="https://10.0.0.1:6443")
    elector = LeaderElector(client.ApiClient(base), LeaderElection(namespace="ops", identity="a"),
                            lambda: asyncio.sleep(0), lambda: None)
    own = elector.api.api_client.configuration
    assert own.retries is False and own.host == base.host and base.retries is None
    assert elector.api.api_client.rest_client.pool_manager.connection_pool_kw["retries"].total is False


def test_a_leader_whose_round_hangs_stops_at_the_renew_deadline_not_when_the_round_ends() -> None:
    calls: list[str] = []
    stopped: list[float] = []

    async def on_start() -> None:
        return None

    async def scenario() -> None:
        election = LeaderElection(namespace="ops", identity="a", renew_deadline=0.3, retry=0.01)
        elector = LeaderElector(client.ApiClient(), election, on_start, lambda: stopped.append(time.monotonic()))
        rounds = iter([0.0, 2.0])  # held at once; then a round stuck on a half-open connection for 2 s

        def round_() -> bool:
            delay = next(rounds, 0.0)
            calls.append("round")
            time.sleep(delay)
            return delay == 0.0 and len(calls) == 1

        elector.try_once = round_  # type: ignore[method-assign]
        t0 = time.monotonic()
        elector.start()
        while not stopped:
            await asyncio.sleep(0.01)
        assert stopped[0] - t0 < 1.0  # the deadline (0.3 s), not the stuck round's 2 s
        assert elector.task is not None
        elector.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await elector.task

    asyncio.run(scenario())
