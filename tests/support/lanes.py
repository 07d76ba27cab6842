"""Integration test lanes: several pytest processes against one test cluster at once (hack/test-lanes.sh).

A lane runs its share of the tier (``KUBETRAIN_TEST_LANE``):
- ``one``: the real-pod tests of test_real_pods.py, the images' tests and Kueue's (one session runs Kueue's
  controller);
- ``two``: the rest: the kwok tests, the two-node tests (whose node faults touch only the second node, tainted
  for them alone), the sweeps' real pods;
- ``whole``: the tests marked ``whole_cluster``, which change the cluster for everyone (the CRDs removed, the
  API server or the first node's kubelet stopped, a cluster-wide operator or admission policy installed): run
  alone, after the others.

In a lane, each namespace a test makes starts with the lane's name, and a test's operator process watches
only those (``--namespace=<lane>-*``), so that two lanes' operators never reconcile each other's jobs. Without
``KUBETRAIN_TEST_LANE`` every test runs and the operators watch every namespace.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

ENV = "KUBETRAIN_TEST_LANE"
LANES = ("one", "two", "whole")
WHOLE_CLUSTER = "whole_cluster"
"""The marker of a test that changes the cluster for every other test: it runs in the ``whole`` lane."""
LANE_ONE_MODULES = frozenset({"test_real_pods.py", "test_helm_image.py"})
LANE_ONE_FIXTURES = frozenset({"kueue"})
"""Lane ``one``'s tests: about 19 minutes warm, against 17 for ``two`` (test_real_pods.py 13, the images 3.5,
Kueue 2.5; the kwok tests 12, the two nodes 4)."""


def current() -> str | None:
    lane = os.environ.get(ENV) or None
    if lane is not None and lane not in LANES:
        raise ValueError(f"{ENV}={lane!r}: not one of {', '.join(LANES)}")
    return lane


def lane_of(module: str, markers: Iterable[str], fixtures: Iterable[str]) -> str:
    """The lane of a test of `module` (its file's name) with these markers and fixtures."""
    if WHOLE_CLUSTER in set(markers):
        return "whole"
    return "one" if module in LANE_ONE_MODULES or LANE_ONE_FIXTURES & set(fixtures) else "two"


def namespace(name: str) -> str:
    """A test namespace's name in the current lane (its prefix; unchanged outside lanes)."""
    lane = current()
    return f"{lane}-{name}" if lane and lane != "whole" else name


def operator_args(args: Sequence[str], given: Sequence[str] = ()) -> tuple[str, ...]:
    """A test operator's arguments: in a lane, watching the lane's namespaces unless they (or the command `given`
    before them) name their own."""
    lane = current()
    if lane is None or lane == "whole" or any(a == "--namespace" or a.startswith("--namespace=")
                                               for a in (*given, *args)):
        return tuple(args)
    return (*args, f"--namespace={lane}-*")


@contextmanager
def one_at_a_time(lock: Path, say: Callable[[str], None] = print) -> Iterator[None]:
    """The block run by one lane at a time (an flock on `lock`); a lane that waits `say`s so when it starts and
    when it ends. Outside lanes, as is."""
    if current() is None:
        yield
        return
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            start = time.monotonic()
            say(f"lane {current()}: waiting while another lane holds {lock.name} (its lines show its progress)")
            fcntl.flock(f, fcntl.LOCK_EX)
            say(f"lane {current()}: {lock.name} free after {time.monotonic() - start:.0f}s")
        yield
