"""Rendezvous and test-server ports: outside the kernel's ephemeral range, never handed out twice."""

from __future__ import annotations

import socket
from pathlib import Path

from kubetrain.core import ports


def test_candidates_leave_out_the_ephemeral_range_and_the_low_ports():
    bases = ports.candidate_bases(3, (32768, 60999))
    assert bases == [range(ports.LOWEST, 32766), range(61000, 65534)]
    for r in bases:  # the whole run of 3 ports stays outside the range
        assert r[-1] + 2 < 32768 or r[0] > 60999


def test_a_range_covering_everything_falls_back_to_the_unprivileged_ports():
    assert ports.candidate_bases(1, (1024, 65535)) == [range(1024, 65536)]


def test_the_kernels_range_is_read_and_a_missing_file_gives_linuxs_default(tmp_path: Path):
    (tmp_path / "range").write_text("20000\t40000\n")
    assert ports.ephemeral_range(tmp_path / "range") == (20000, 40000)
    assert ports.ephemeral_range(tmp_path / "missing") == ports.DEFAULT_EPHEMERAL


def test_ports_handed_out_are_distinct_bindable_and_outside_the_ephemeral_range():
    low, high = ports.ephemeral_range()
    got = [ports.free_port(consecutive=2) for _ in range(50)]
    spans = {p for base in got for p in (base, base + 1)}
    assert len(spans) == 100
    assert all(not low <= p <= high and p >= ports.LOWEST for p in spans)
    with socket.socket() as s:
        s.bind(("127.0.0.1", got[0]))
