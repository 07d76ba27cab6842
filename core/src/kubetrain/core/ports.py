"""Loopback ports for the processes this machine starts: a gang's rendezvous, a test's servers.

A port is chosen now and bound seconds later (a rank imports torch first), and in between it is free for anyone:
a port from the kernel's ephemeral range can be taken by any outgoing connection in that window (a gang's own
gloo connections make hundreds), and the rendezvous then fails. So the ports come from outside that range, and
one process never hands out the same port twice.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL = (32768, 60999)
"""Linux's default, where the file cannot be read."""
LOWEST = 20000
"""Never chosen below: fixed ports live there (the workers' metrics default, 9400 and up, and any a user or a
test names)."""
_handed_out: set[int] = set()


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    try:
        low, high = (int(v) for v in path.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return low, high


def candidate_bases(consecutive: int, ephemeral: tuple[int, int]) -> list[range]:
    """The ranges a run of `consecutive` ports may start in: at or above LOWEST, outside `ephemeral`."""
    low, high = ephemeral
    ranges = [range(LOWEST, low - consecutive + 1), range(high + 1, 65536 - consecutive + 1)]
    return [r for r in ranges if len(r) > 0] or [range(1024, 65536 - consecutive + 1)]


def free_port(consecutive: int = 1, host: str = "127.0.0.1") -> int:
    """A port (and the ``consecutive - 1`` after it) that nothing is bound to now, outside the ephemeral range,
    not handed out before by this process. Never 0 (kopf reads port 0 in --liveness as "no port", i.e. 80)."""
    ranges = candidate_bases(consecutive, ephemeral_range())
    weights = [len(r) for r in ranges]
    for _ in range(200):
        base = random.choice(random.choices(ranges, weights)[0])
        ports = range(base, base + consecutive)
        if _handed_out.isdisjoint(ports) and _bindable(ports, host):
            _handed_out.update(ports)
            return base
    raise RuntimeError(f"no {consecutive} consecutive free ports outside the ephemeral range")


def _bindable(ports: range, host: str) -> bool:
    socks: list[socket.socket] = []
    try:
        for port in ports:
            s = socket.socket()
            socks.append(s)
            s.bind((host, port))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()
