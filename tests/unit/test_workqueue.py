"""The operator's work queue (kubetrain.operator.runtime.workqueue): dedup, delays, forgetting, gating, workers."""

from __future__ import annotations

import asyncio

from kubetrain.operator.runtime.workqueue import RetryLater, WorkQueue


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def leading_queue(clock: Clock | None = None) -> WorkQueue[str]:
    q: WorkQueue[str] = WorkQueue(clock or Clock())
    q.set_leading(True)
    return q


def test_a_key_is_queued_once_and_handed_out_in_order() -> None:
    q = leading_queue()
    for key in ("a", "b", "a", "c", "b"):
        q.add(key)
    assert len(q) == 3
    assert [q.take(), q.take(), q.take(), q.take()] == ["a", "b", "c", None]


def test_a_key_added_while_a_worker_has_it_is_handed_out_again_once_after() -> None:
    q = leading_queue()
    q.add("a")
    assert q.take() == "a"
    q.add("a")
    q.add("a")
    assert len(q) == 0 and q.take() is None  # never to two workers at once
    q.done("a", requeue_after=30.0)
    assert len(q) == 1 and q.due_in("a") is None  # the newer state is looked at now, not in 30 s
    assert q.take() == "a"


def test_done_requeues_after_the_delay_the_work_asked_for() -> None:
    clock = Clock()
    q = leading_queue(clock)
    q.add("a")
    q.done(q.take() or "", requeue_after=30.0)
    assert len(q) == 0 and q.due_in("a") == 30.0
    q.done("b", requeue_after=None)
    assert "b" not in q


def test_of_several_delays_the_earliest_wins() -> None:
    clock = Clock()
    q = leading_queue(clock)
    q.add_after("a", 10.0)
    q.add_after("a", 5.0)
    q.add_after("a", 20.0)
    assert q.due_in("a") == 5.0
    clock.t += 4.0
    assert q.promote_due() == 1.0 and len(q) == 0
    clock.t += 1.0
    assert q.promote_due() is None
    assert q.take() == "a"


def test_an_immediate_add_supersedes_a_pending_delay_and_a_queued_key_takes_no_delay() -> None:
    clock = Clock()
    q = leading_queue(clock)
    q.add_after("a", 10.0)
    q.add("a")
    assert q.due_in("a") is None and len(q) == 1
    q.add_after("a", 10.0)  # queued: it runs sooner anyway
    assert q.due_in("a") is None
    clock.t += 60.0
    q.promote_due()
    assert [q.take(), q.take()] == ["a", None]


def test_a_key_added_again_while_a_worker_has_it_takes_no_delay() -> None:
    clock = Clock()
    q = leading_queue(clock)
    q.add("a")
    assert q.take() == "a"
    q.add("a")  # runs again once the worker is done
    q.add_after("a", 0.5)
    assert q.due_in("a") is None
    q.done("a", requeue_after=None)
    assert q.take() == "a"
    q.done("a", requeue_after=None)
    clock.t += 60.0
    q.promote_due()
    assert q.take() is None  # not once more for the delay


def test_a_zero_delay_is_an_add() -> None:
    q = leading_queue()
    q.add_after("a", 0.0)
    assert len(q) == 1


def test_forget_drops_a_queued_and_a_delayed_key() -> None:
    clock = Clock()
    q = leading_queue(clock)
    q.add("queued")
    q.add("other")
    q.add_after("delayed", 5.0)
    for key in ("queued", "delayed"):
        q.forget(key)
        assert key not in q
    clock.t += 10.0
    assert q.promote_due() is None
    assert [q.take(), q.take()] == ["other", None]


def test_a_key_forgotten_while_a_worker_has_it_is_not_requeued() -> None:
    q = leading_queue()
    q.add("a")
    assert q.take() == "a"
    q.add("a")  # an event came in meanwhile ...
    q.forget("a")  # ... then the job was deleted
    q.done("a", requeue_after=30.0)
    assert "a" not in q and q.take() is None


def test_a_key_added_again_after_forget_is_worked_on() -> None:
    q = leading_queue()
    q.add("a")
    assert q.take() == "a"
    q.forget("a")
    q.add("a")  # a job of the same name, created again
    q.done("a", requeue_after=None)
    assert q.take() == "a"


def test_many_replaced_and_forgotten_delays_do_not_pile_up() -> None:
    clock = Clock()
    q = leading_queue(clock)
    for i in range(2000):
        q.add_after(f"job-{i}", 3600.0)
        q.add_after(f"job-{i}", 30.0)
        q.forget(f"job-{i}")
    assert all(f"job-{i}" not in q for i in range(2000))
    assert len(q._heap) <= 16  # what a forgotten delay leaves until it would have come due


def test_nothing_is_handed_out_while_not_leading() -> None:
    q: WorkQueue[str] = WorkQueue(Clock())
    q.add("a")
    q.add("a")
    assert q.take() is None and len(q) == 1  # kept, deduplicated, for when this replica leads
    q.set_leading(True)
    assert q.take() == "a"
    q.add("b")
    q.set_leading(False)
    assert q.take() is None and "b" in q


def test_workers_run_keys_concurrently_but_never_one_key_twice_at_once() -> None:
    async def scenario() -> tuple[int, list[str]]:
        q: WorkQueue[str] = WorkQueue()
        q.set_leading(True)
        running: set[str] = set()
        peak, seen = 0, []
        release = asyncio.Event()

        async def handle(key: str) -> float | None:
            nonlocal peak
            assert key not in running
            running.add(key)
            peak = max(peak, len(running))
            seen.append(key)
            await release.wait()
            running.discard(key)
            return None

        server = asyncio.create_task(q.serve(3, handle))
        for key in ("a", "b", "c", "d", "a"):
            q.add(key)
        await asyncio.sleep(0.05)
        q.add("a")  # while a worker has it
        release.set()
        await asyncio.sleep(0.05)
        server.cancel()
        return peak, seen

    peak, seen = asyncio.run(scenario())
    assert peak == 3
    assert sorted(seen) == ["a", "a", "b", "c", "d"]


def test_workers_wait_for_the_lease_and_retry_a_key_whose_work_raised() -> None:
    async def scenario() -> list[str]:
        q: WorkQueue[str] = WorkQueue(retry_after=0.01)
        calls: list[str] = []

        async def handle(key: str) -> float | None:
            calls.append(key)
            if len(calls) == 1:
                raise RuntimeError("API server unreachable")
            return None

        server = asyncio.create_task(q.serve(2, handle))
        q.add("a")
        await asyncio.sleep(0.05)
        assert calls == []  # not leading: nothing handed out
        q.set_leading(True)
        await asyncio.sleep(0.1)
        server.cancel()
        return calls

    assert asyncio.run(scenario()) == ["a", "a"]


def test_a_delayed_key_is_worked_on_when_it_comes_due() -> None:
    async def scenario() -> list[str]:
        q: WorkQueue[str] = WorkQueue()
        q.set_leading(True)
        calls: list[str] = []

        async def handle(key: str) -> float | None:
            calls.append(key)
            return None

        server = asyncio.create_task(q.serve(1, handle))
        q.add_after("a", 10.0)
        await asyncio.sleep(0.01)
        q.add_after("a", 0.02)  # an earlier delay wakes the timer up
        await asyncio.sleep(0.1)
        server.cancel()
        return calls

    assert asyncio.run(scenario()) == ["a"]


def test_failures_back_off_doubling_to_a_cap_and_start_over_after_a_reset() -> None:
    q = leading_queue()
    assert [q.backoff("a") for _ in range(7)] == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    assert q.backoff("b") == 2.0  # per key
    q.reset("a")
    assert q.backoff("a") == 2.0
    q.forget("a")
    assert q.backoff("a") == 2.0
    for _ in range(200):  # no overflow however long it fails
        assert q.backoff("c") <= 60.0


def test_work_that_keeps_raising_is_retried_with_growing_delays() -> None:
    async def scenario() -> list[float | None]:
        q: WorkQueue[str] = WorkQueue(Clock())  # a clock that stands still: the retries never come due alone
        q.set_leading(True)
        delays: list[float | None] = []

        async def handle(key: str) -> float | None:
            raise RuntimeError("API server unreachable")

        server = asyncio.create_task(q.serve(1, handle))
        for _ in range(3):
            q.add("a")  # an event: tried at once, whatever the delay
            await asyncio.sleep(0.01)
            delays.append(q.due_in("a"))
        server.cancel()
        return delays

    assert asyncio.run(scenario()) == [2.0, 4.0, 8.0]


def test_work_the_server_throttled_waits_its_retry_after_or_the_backoff_whichever_is_longer() -> None:
    async def scenario() -> list[float | None]:
        q: WorkQueue[str] = WorkQueue(Clock())
        q.set_leading(True)
        delays: list[float | None] = []
        after = iter([30.0, 1.0])

        async def handle(key: str) -> float | None:
            raise RetryLater(next(after), "the API server answered 429")

        server = asyncio.create_task(q.serve(1, handle))
        for _ in range(2):
            q.add("a")
            await asyncio.sleep(0.01)
            delays.append(q.due_in("a"))
        server.cancel()
        return delays

    assert asyncio.run(scenario()) == [30.0, 4.0]  # Retry-After 30 s; then 1 s, below the backoff's 4 s
