"""Integration test lanes: several pytest processes against one test cluster at once (hack/test-lanes.sh).

A lane runs its share of the tier (``KUBETRAIN_TEST_LANE``):
- ``one``: the real-pod tests of test_real_pods.py and the images' tests;
- ``two``: the rest: the kwok tests, Kueue's (one session runs Kueue's controller), the two-node tests (whose
  node faults touch only the second node, tainted for them alone), the sweeps' real pods; then, with
  ``KUBETRAIN_TEST_CLAIMS`` set, it takes over lane one's tests that lane one has not begun yet: each of those
  tests runs in the lane that claims it first (a file in that directory), so whichever lane ends its own
  share first helps the other, warm or cold;
- ``whole``: the tests marked ``whole_cluster``, which change the cluster for everyone (the CRDs removed, the
  API server stopped, a cluster-wide operator or admission policy installed): run
  alone, after the others.

In a lane, each namespace a test makes starts with the lane's name, and a test's operator process watches
only those (``--namespace=<lane>-*``), so that two lanes' operators never reconcile each other's jobs. Without
``KUBETRAIN_TEST_LANE`` every test runs and the operators watch every namespace.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

ENV = "KUBETRAIN_TEST_LANE"
LANES = ("one", "two", "whole")
WHOLE_CLUSTER = "whole_cluster"
"""The marker of a test that changes the cluster for every other test: it runs in the ``whole`` lane."""
CLAIMS_ENV = "KUBETRAIN_TEST_CLAIMS"
LANE_ONE_MODULES = frozenset({"test_real_pods.py", "test_helm_image.py"})
"""Lane ``one``'s tests, which lane ``two`` takes over once its own are done: measured at the suite's load,
lane one's first share took 30 minutes warm against 22.5 for lane two's, and cold lane one waits 4 minutes
more, for the images on the nodes, while lane two runs its kwok tests."""


SHARED = pytest.StashKey[bool]()
"""On a test that lanes one and two both collect: it runs in the one that claims it first."""
TAKEN_OVER = pytest.StashKey[bool]()
"""On such a test in the lane that takes it over: run after the lane's own (tests/conftest.py's order)."""


def current() -> str | None:
    lane = os.environ.get(ENV) or None
    if lane is not None and lane not in LANES:
        raise ValueError(f"{ENV}={lane!r}: not one of {', '.join(LANES)}")
    return lane


def lane_of(module: str, markers: Iterable[str]) -> str:
    """The lane of a test of `module` (its file's name) with these markers."""
    if WHOLE_CLUSTER in set(markers):
        return "whole"
    return "one" if module in LANE_ONE_MODULES else "two"


def takes_over(lane: str | None, test_lane: str) -> bool:
    """Whether `lane` also collects the tests of `test_lane`, to run those no other lane has claimed."""
    return lane == "two" and test_lane == "one" and claims() is not None


def claims() -> Path | None:
    """The directory where lanes one and two claim the tests both collected (None: no sharing)."""
    where = os.environ.get(CLAIMS_ENV)
    return Path(where) if where else None


def claim(test_id: str) -> bool:
    """True when this lane may run the test `test_id`: the first to claim it (always, without sharing)."""
    where = claims()
    if where is None:
        return True
    name = hashlib.sha1(test_id.encode()).hexdigest()
    try:
        os.close(os.open(where / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    return True


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


def select(items: list[pytest.Item], tier: Path) -> list[pytest.Item]:
    """Keeps in `items` (in place) this lane's tests of the tier in directory `tier`, and those it may take over
    (marked so); returns the others. Outside lanes, all of them."""
    lane = current()
    if lane is None:
        return []
    kept, left = [], []
    for item in items:
        ours = tier in item.path.parents
        test_lane = lane_of(item.path.name, (m.name for m in item.iter_markers()))
        item.stash[SHARED] = ours and test_lane == "one" and lane in ("one", "two") and claims() is not None
        if not ours or test_lane == lane:  # another tier's test, given on the same command line, runs as is
            kept.append(item)
        elif takes_over(lane, test_lane):
            item.stash[TAKEN_OVER] = True
            kept.append(item)
        else:
            left.append(item)
    items[:] = kept
    return left


_ran_elsewhere: list[str] = []
_taken_over: list[str] = []


def pass_by(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    """pytest_runtest_protocol: True for a shared test that the other lane claimed first. What the next test
    does not need is torn down, as pytest's runner does after a test it ran; no report is made (the other lane
    makes it). None: run it."""
    if not item.stash.get(SHARED, False):
        return None
    if claim(item.nodeid):
        if item.stash.get(TAKEN_OVER, False):
            _taken_over.append(item.nodeid)
        return None
    _ran_elsewhere.append(item.nodeid)
    item.session._setupstate.teardown_exact(nextitem)
    return True


def summary() -> str:
    """The lane's line on the shared tests, for the end of its log ("" when it shared none)."""
    if not (_taken_over or _ran_elsewhere):
        return ""
    return (f"lane {current()}: {len(_taken_over)} tests taken over from lane one, "
            f"{len(_ran_elsewhere)} shared tests run by the other lane")


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
