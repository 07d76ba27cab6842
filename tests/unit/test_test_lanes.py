"""The integration tier's lanes (tests/support/lanes.py): which lane a test runs in, and how a lane keeps its
namespaces and operators apart from another lane's on the same cluster."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from support import lanes
from support.waiting import wait_for


def test_a_test_runs_in_the_lane_its_module_markers_and_fixtures_say() -> None:
    assert lanes.lane_of("test_real_pods.py", ["integration", lanes.WHOLE_CLUSTER], ["real_node"]) == "whole"
    assert lanes.lane_of("test_real_pods.py", ["integration"], ["namespace", "real_node"]) == "one"
    assert lanes.lane_of("test_kueue_smoke.py", [], ["kueue"]) == "one"
    assert lanes.lane_of("test_real_nodes.py", ["integration"], ["real_namespace", "real_node"]) == "two"
    assert lanes.lane_of("test_operator.py", ["integration"], ["namespace", "admin_api"]) == "two"


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
