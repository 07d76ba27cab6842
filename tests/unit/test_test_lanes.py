"""The integration tier's lanes (tests/support/lanes.py): which lane a test runs in, and how a lane keeps its
namespaces and operators apart from another lane's on the same cluster."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from support import lanes
from support.paths import REPO_ROOT
from support.waiting import wait_for


def test_a_test_runs_in_the_lane_its_module_and_markers_say() -> None:
    assert lanes.lane_of("test_real_pods.py", ["integration", lanes.WHOLE_CLUSTER]) == "whole"
    assert lanes.lane_of("test_real_pods.py", ["integration"]) == "one"
    assert lanes.lane_of("test_kueue_smoke.py", []) == "two"  # one session runs Kueue's controller: never shared
    assert lanes.lane_of("test_real_nodes.py", ["integration"]) == "two"
    assert lanes.lane_of("test_operator.py", ["integration"]) == "two"


def test_lane_two_takes_over_lane_ones_tests_only_where_the_lanes_share_a_claims_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(lanes.CLAIMS_ENV, raising=False)
    assert not lanes.takes_over("two", "one")
    assert lanes.claim("t::a") and lanes.claim("t::a")  # nothing shared: every lane runs its own
    monkeypatch.setenv(lanes.CLAIMS_ENV, str(tmp_path))
    assert lanes.takes_over("two", "one")
    assert not lanes.takes_over("one", "two") and not lanes.takes_over("whole", "one")
    assert lanes.claim("t::a") and not lanes.claim("t::a") and lanes.claim("t::b")


TIER_CONFTEST = """
from pathlib import Path
import pytest
from support import lanes
from support.paths import REPO_ROOT

def pytest_collection_modifyitems(config, items):
    left = lanes.select(items, Path(__file__).parent)
    if left:
        config.hook.pytest_deselected(items=left)
    items.sort(key=lambda item: item.stash.get(lanes.TAKEN_OVER, False))

@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    return lanes.pass_by(item, nextitem)

def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(lanes.summary())
"""

MODULE = """
import pytest

@pytest.fixture(scope="module")
def setup_log():
    with open("{log}", "a") as f:
        f.write("up {name}\\n")
    yield
    with open("{log}", "a") as f:
        f.write("down {name}\\n")

def test_1(setup_log): pass
def test_2(setup_log): pass
def test_3(setup_log): pass
"""


def run_lane(tmp_path: Path, lane: str, claims: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, lanes.ENV: lane, lanes.CLAIMS_ENV: str(claims), "PYTHONPATH": str(REPO_ROOT / "tests")}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "tier"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)


def test_a_test_both_lanes_collect_runs_once_in_the_lane_that_claims_it_and_fixtures_come_down_as_usual(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier, claims, log = tmp_path / "tier", tmp_path / "claims", tmp_path / "fixtures.log"
    tier.mkdir()
    claims.mkdir()
    (tier / "conftest.py").write_text(TIER_CONFTEST)
    for module in ("test_helm_image", "test_real_pods", "test_operator"):  # lane one, one, two
        (tier / f"{module}.py").write_text(MODULE.format(log=log, name=module))
    monkeypatch.setenv(lanes.CLAIMS_ENV, str(claims))
    # lane two "claimed" these first: the last of a module (its fixture must come down before the next
    # module's) and one in the middle of a module
    assert lanes.claim("tier/test_helm_image.py::test_3") and lanes.claim("tier/test_real_pods.py::test_2")
    one = run_lane(tmp_path, "one", claims)
    assert one.returncode == 0, one.stdout + one.stderr
    assert "4 passed, 3 deselected" in one.stdout, one.stdout
    assert "lane one: 0 tests taken over from lane one, 2 shared tests run by the other lane" in one.stdout
    assert log.read_text().split("\n")[:4] == ["up test_helm_image", "down test_helm_image",
                                                "up test_real_pods", "down test_real_pods"]
    # lane two: its own first, then lane one's, none of which is left
    log.unlink()
    two = run_lane(tmp_path, "two", claims)
    assert two.returncode == 0, two.stdout + two.stderr
    assert "3 passed" in two.stdout and "lane two: 0 tests taken over from lane one, 6 shared" in two.stdout
    assert log.read_text().split() == ["up", "test_operator", "down", "test_operator"]


def test_in_a_lane_namespaces_and_operators_are_the_lanes_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(lanes.ENV, "two")
    assert lanes.namespace("psa-restricted-1a2b3c") == "two-psa-restricted-1a2b3c"
    assert lanes.operator_args(["--leader-elect"]) == ("--leader-elect", "--namespace=two-*")
    assert lanes.operator_args(["--namespace=two-x"]) == ("--namespace=two-x",)  # its own, kept
    assert lanes.operator_args(["--namespace", "a"]) == ("--namespace", "a")
    assert lanes.operator_args([], given=["buildah", "run", "c", "--", "python", "--namespace=two-y"]) == ()


@pytest.mark.parametrize("lane", [None, "whole"])
def test_outside_the_parallel_lanes_everything_is_as_named(monkeypatch: pytest.MonkeyPatch, lane: str | None) -> None:
    if lane is None:
        monkeypatch.delenv(lanes.ENV, raising=False)
    else:
        monkeypatch.setenv(lanes.ENV, lane)
    assert lanes.namespace("client-1a2b3c") == "client-1a2b3c"
    assert lanes.operator_args(["-v"]) == ("-v",)


def test_an_unknown_lane_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(lanes.ENV, "fast")
    with pytest.raises(ValueError, match="not one of one, two, whole"):
        lanes.current()


def test_a_lane_waits_its_turn_and_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(lanes.ENV, "two")
    said: list[str] = []
    inside = threading.Event()

    def second() -> None:
        with lanes.one_at_a_time(tmp_path / "cluster-up.lock", say=said.append):
            inside.set()

    with lanes.one_at_a_time(tmp_path / "cluster-up.lock", say=said.append):
        other = threading.Thread(target=second)
        other.start()
        wait_for(lambda: said, 10, what="the second lane says it waits")
        assert not inside.is_set()
    other.join(10)
    assert inside.is_set()
    assert said[0] == "lane two: waiting while another lane holds cluster-up.lock (its lines show its progress)"
    assert said[1].startswith("lane two: cluster-up.lock free after ")
