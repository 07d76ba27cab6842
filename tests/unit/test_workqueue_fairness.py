"""The work queue's fairness between groups (kubetrain.operator.runtime.workqueue, `fair_by`): the operator's
controllers group their (namespace, name) keys by namespace, so one namespace's backlog does not hold up
another's jobs. The queue's other rules (dedup, delays, leading) are tests/unit/test_workqueue.py's."""

from __future__ import annotations

import random
from collections import Counter

from kubernetes import client

from kubetrain.operator.controller import Controller
from kubetrain.operator.runtime.objects import Key, namespace_of
from kubetrain.operator.runtime.settings import OperatorSettings
from kubetrain.operator.runtime.workqueue import WorkQueue


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def fair_queue(clock: Clock | None = None) -> WorkQueue[Key]:
    q: WorkQueue[Key] = WorkQueue(clock or Clock(), fair_by=namespace_of)
    q.set_leading(True)
    return q


def drain(q: WorkQueue[Key]) -> list[Key]:
    """Every key handed out until none is left, each done at once (nothing requeued)."""
    taken = []
    while (key := q.take()) is not None:
        taken.append(key)
        q.done(key, requeue_after=None)
    return taken


def test_a_namespace_with_one_job_waits_one_turn_not_for_another_namespaces_backlog() -> None:
    q = fair_queue()
    for i in range(500):
        q.add(("big", f"job-{i}"))
    q.add(("small", "only"))
    assert len(q) == 501
    taken = drain(q)
    assert taken.index(("small", "only")) == 1  # behind the one key "big" had first, not behind all 500
    assert [k for k in taken if k[0] == "big"] == [("big", f"job-{i}") for i in range(500)]  # each group FIFO


def test_groups_take_turns_in_the_order_they_got_keys() -> None:
    q = fair_queue()
    for key in (("a", "1"), ("a", "2"), ("a", "3"), ("b", "1"), ("c", "1"), ("c", "2")):
        q.add(key)
    assert drain(q) == [("a", "1"), ("b", "1"), ("c", "1"), ("a", "2"), ("c", "2"), ("a", "3")]


def test_adding_a_queued_key_again_gives_its_group_no_extra_turn() -> None:
    q = fair_queue()
    q.add(("a", "1"))
    q.add(("b", "1"))
    q.add(("a", "1"))
    q.add(("a", "2"))
    q.add(("a", "1"))
    assert len(q) == 3
    assert drain(q) == [("a", "1"), ("b", "1"), ("a", "2")]


def test_a_forgotten_key_leaves_its_group_and_an_empty_group_leaves_the_round() -> None:
    q = fair_queue()
    for key in (("a", "1"), ("b", "1"), ("a", "2"), ("c", "1")):
        q.add(key)
    q.forget(("b", "1"))
    q.forget(("a", "1"))
    assert len(q) == 2 and ("b", "1") not in q
    assert drain(q) == [("a", "2"), ("c", "1")]
    q.add(("b", "2"))  # a group that emptied comes back as a new one
    assert drain(q) == [("b", "2")]


def test_a_key_that_comes_due_or_back_from_a_worker_queues_in_its_group() -> None:
    clock = Clock()
    q = fair_queue(clock)
    for i in range(3):
        q.add(("big", str(i)))
    q.add_after(("small", "later"), 5.0)
    first = q.take()
    assert first == ("big", "0")
    q.add(first)  # added while its worker has it: back in the queue once done
    clock.t += 5.0
    q.promote_due()
    q.done(first, requeue_after=None)
    # "big" had its turn: its next key, then "small"'s that came due, then "big"'s, the requeued one last.
    assert drain(q) == [("big", "1"), ("small", "later"), ("big", "2"), ("big", "0")]


def test_nothing_is_handed_out_while_not_leading_and_turns_hold_after() -> None:
    q: WorkQueue[Key] = WorkQueue(Clock(), fair_by=namespace_of)
    for key in (("a", "1"), ("a", "2"), ("b", "1")):
        q.add(key)
    assert q.take() is None
    q.set_leading(True)
    assert drain(q) == [("a", "1"), ("b", "1"), ("a", "2")]


def test_without_fair_by_keys_are_first_in_first_out_whatever_their_namespace() -> None:
    q: WorkQueue[Key] = WorkQueue(Clock())
    q.set_leading(True)
    for key in (("a", "1"), ("a", "2"), ("b", "1")):
        q.add(key)
    assert drain(q) == [("a", "1"), ("a", "2"), ("b", "1")]


def test_random_work_hands_out_each_key_once_and_serves_no_group_twice_while_another_waits() -> None:
    """Adds, forgets and takes in random order: what comes out is what went in (each once, none lost), and
    while a group has keys waiting, no other group is served twice before it."""
    rng = random.Random(7)
    q = fair_queue()
    queued: set[Key] = set()
    served_while_waiting: dict[str, Counter[str]] = {}
    """Per group with keys waiting: how often each other group was served since its wait began."""
    for _ in range(5000):
        op, key = rng.random(), (f"ns-{rng.randrange(4)}", str(rng.randrange(20)))
        waiting = {namespace_of(k) for k in queued}
        if op < 0.5:
            q.add(key)
            queued.add(key)
            served_while_waiting.setdefault(key[0], Counter())
        elif op < 0.6:
            q.forget(key)
            queued.discard(key)
            if key[0] not in {namespace_of(k) for k in queued}:
                served_while_waiting.pop(key[0], None)
        elif (taken := q.take()) is not None:
            assert taken in queued
            queued.discard(taken)
            group = namespace_of(taken)
            for other in waiting - {group}:
                served_while_waiting[other][group] += 1
                assert served_while_waiting[other][group] == 1, f"{group} served twice while {other} waited"
            served_while_waiting[group] = Counter()  # it goes to the end of the round
            q.done(taken, requeue_after=None)
        assert len(q) == len(queued)
    assert set(drain(q)) == queued


def test_the_operators_queues_are_fair_between_namespaces() -> None:
    ctl = Controller(client.ApiClient(), OperatorSettings(metrics_port=0))
    try:
        for q in (ctl.queue, ctl.sweeps.queue):
            for key in (("a", "1"), ("a", "2"), ("a", "3"), ("b", "1")):
                q.add(key)
            q.set_leading(True)
            assert drain(q) == [("a", "1"), ("b", "1"), ("a", "2"), ("a", "3")]
    finally:
        ctl.applier.close()
